// Splits a model's generated text, as it streams, into answer text, reasoning ("thinking") and
// tool calls, following each family's own output convention:
//   tagged    <think>…</think>; <tool_call>…</tool_call> whose body is JSON {"name", "arguments"}
//             (Qwen3), <function=NAME><parameter=K>V</parameter></function> (Qwen3.5 / Qwen3-Next,
//             Qwen3-Coder) or NAME<arg_key>K</arg_key><arg_value>V</arg_value> (GLM-4.5)
//   deepseek  <think>…</think>; <｜tool▁calls▁begin｜> … <｜tool▁calls▁end｜> (DeepSeek-V3 / V3.1)
//             and <|tool_calls_section_begin|> … <|tool_calls_section_end|> (Kimi-K2)
//   mistral   [TOOL_CALLS] followed by a JSON list of {"name", "arguments"} (or NAME[ARGS]{…})
//   harmony   gpt-oss channels: analysis -> reasoning, final -> answer, commentary addressed
//             `to=functions.NAME` -> a tool call
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moestream {

enum class OutputSyntax { tagged, deepseek, mistral, harmony };

// The convention of a model_type (config.json).
OutputSyntax output_syntax(const std::string& model_type);

struct ToolCall {
  std::string id;         // "call_…", unique per call
  std::string name;
  std::string arguments;  // a JSON object, as text
};

struct ParsedOutput {
  std::string content, reasoning;
  std::vector<ToolCall> tool_calls;
  bool empty() const { return content.empty() && reasoning.empty() && tool_calls.empty(); }
  void append(ParsedOutput&& more);
};

class OutputParser {
 public:
  // in_reasoning: the prompt already opened a reasoning block (a template that ends the
  // generation prompt with "<think>\n"). parse_tools false: tool markup stays plain text.
  OutputParser(OutputSyntax syntax, bool in_reasoning, bool parse_tools);

  // The part of the output that is certain after `text` arrives. Text that might be the start of
  // a marker is held back until it is decided.
  ParsedOutput push(std::string_view text);
  // End of generation: everything held back. An unterminated tool call is returned as text.
  ParsedOutput finish();

 private:
  enum class Mode { content, reasoning, tool, harmony_header, harmony_body };
  ParsedOutput drain(bool at_end);
  ParsedOutput drain_harmony(bool at_end);

  OutputSyntax syntax_;
  bool parse_tools_;
  Mode mode_;
  std::string buffer_;        // text not yet decided
  std::string tool_end_;      // the marker that closes the current tool block
  std::string tool_open_;     // the marker that opened it (to give it back if unterminated)
  std::string harmony_channel_, harmony_recipient_;
  bool reasoning_start_ = false;  // at the start of a reasoning block: drop its leading newlines
  bool after_reasoning_ = false;  // just after one: drop the newlines before the answer
};

// Parses one tool-call body in any of the tagged / deepseek / mistral forms into calls; throws
// Error when it is not a well-formed call.
std::vector<ToolCall> parse_tool_calls(OutputSyntax syntax, std::string_view open_marker,
                                       std::string_view body);

std::string new_tool_call_id();

}  // namespace moestream
