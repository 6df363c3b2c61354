// Tokenizer of Jinja templates (internal): splits the source into text and tags the way jinja2's
// lexer does with trim_blocks=True and lstrip_blocks=True, and the inside of tags into tokens.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moestream::jinja {

struct Token {
  enum Kind {
    Text,        // data between tags (whitespace control already applied)
    VarBegin,    // {{
    VarEnd,      // }}
    BlockBegin,  // {%
    BlockEnd,    // %}
    Name,
    String,  // text holds the decoded value
    Integer,
    Float,
    Op,  // text holds the operator
    End,
  } kind;
  std::string text;
  int line;
};

// Throws RenderError{"TemplateSyntaxError"} with the line on malformed input.
std::vector<Token> tokenize(std::string_view source);

}  // namespace moestream::jinja
