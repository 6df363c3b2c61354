#include "server/output_parser.h"

#include <atomic>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"

namespace moestream {

namespace {

using json = nlohmann::ordered_json;

struct Block {
  std::string_view open, close;  // close "" = until the end of the output
  bool tool;                     // else reasoning
};

constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";
constexpr std::string_view kDeepseekOpen = "<｜tool▁calls▁begin｜>", kDeepseekClose = "<｜tool▁calls▁end｜>";
constexpr std::string_view kDeepseekCall = "<｜tool▁call▁begin｜>", kDeepseekCallEnd = "<｜tool▁call▁end｜>";
constexpr std::string_view kDeepseekSep = "<｜tool▁sep｜>";
constexpr std::string_view kKimiOpen = "<|tool_calls_section_begin|>", kKimiClose = "<|tool_calls_section_end|>";
constexpr std::string_view kKimiCall = "<|tool_call_begin|>", kKimiArgs = "<|tool_call_argument_begin|>";
constexpr std::string_view kKimiCallEnd = "<|tool_call_end|>";

std::vector<Block> blocks_of(OutputSyntax s) {
  switch (s) {
    case OutputSyntax::tagged:
      return {{kThinkOpen, kThinkClose, false}, {"<tool_call>", "</tool_call>", true}};
    case OutputSyntax::deepseek:
      return {{kThinkOpen, kThinkClose, false}, {kDeepseekOpen, kDeepseekClose, true},
              {kKimiOpen, kKimiClose, true}};
    case OutputSyntax::mistral:
      return {{"[TOOL_CALLS]", "", true}};
    case OutputSyntax::harmony:
      return {};
  }
  return {};
}

// Length of the longest suffix of `text` that is a proper prefix of one of `markers`.
size_t held_tail(std::string_view text, const std::vector<std::string_view>& markers) {
  size_t best = 0;
  for (std::string_view m : markers)
    for (size_t n = std::min(text.size(), m.size() - 1); n > best; --n)
      if (text.substr(text.size() - n) == m.substr(0, n)) {
        best = n;
        break;
      }
  return best;
}

std::string_view trim(std::string_view s) {
  const auto ws = " \t\r\n";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// A parameter value as the model wrote it: JSON when it parses as JSON, else a string.
json param_value(std::string_view raw) {
  std::string_view v = raw;
  if (!v.empty() && v.front() == '\n') v.remove_prefix(1);
  if (!v.empty() && v.back() == '\n') v.remove_suffix(1);
  json parsed = json::parse(v, nullptr, false);
  if (!parsed.is_discarded() && !parsed.is_string()) return parsed;
  return std::string(v);
}

std::string arguments_text(const json& args) {
  if (args.is_string()) {
    json parsed = json::parse(args.get<std::string>(), nullptr, false);
    if (parsed.is_discarded() || !parsed.is_object())
      fail("tool call arguments are not a JSON object: ", args.get<std::string>());
    return parsed.dump();
  }
  if (!args.is_object()) fail("tool call arguments are not a JSON object: ", args.dump());
  return args.dump();
}

ToolCall call_from_json(const json& j) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string())
    fail("a tool call needs a \"name\" string: ", j.dump());
  ToolCall c{new_tool_call_id(), j["name"].get<std::string>(), "{}"};
  if (j.contains("arguments")) c.arguments = arguments_text(j["arguments"]);
  else if (j.contains("parameters")) c.arguments = arguments_text(j["parameters"]);
  return c;
}

// <function=NAME><parameter=K>V</parameter>...</function>
ToolCall qwen_xml_call(std::string_view body) {
  const size_t name_at = body.find("<function=") + 10;
  const size_t name_end = body.find('>', name_at);
  if (name_end == std::string_view::npos) fail("a <function=…> tool call has no closing '>'");
  ToolCall c{new_tool_call_id(), std::string(trim(body.substr(name_at, name_end - name_at))), ""};
  json args = json::object();
  size_t pos = name_end + 1;
  for (;;) {
    const size_t p = body.find("<parameter=", pos);
    if (p == std::string_view::npos) break;
    const size_t k_end = body.find('>', p);
    const size_t v_end = body.find("</parameter>", k_end);
    if (k_end == std::string_view::npos || v_end == std::string_view::npos)
      fail("a <parameter=…> in tool call '", c.name, "' is not closed");
    const std::string key(trim(body.substr(p + 11, k_end - p - 11)));
    args[key] = param_value(body.substr(k_end + 1, v_end - k_end - 1));
    pos = v_end + 12;
  }
  c.arguments = args.dump();
  return c;
}

// NAME<arg_key>K</arg_key><arg_value>V</arg_value>...
ToolCall glm_call(std::string_view body) {
  const size_t first = body.find("<arg_key>");
  ToolCall c{new_tool_call_id(), std::string(trim(body.substr(0, first))), ""};
  if (c.name.empty() || c.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.") !=
                            std::string::npos)
    fail("'", c.name, "' is not a function name");
  json args = json::object();
  size_t pos = first;
  while (pos != std::string_view::npos) {
    const size_t k_end = body.find("</arg_key>", pos);
    const size_t v_at = body.find("<arg_value>", k_end);
    const size_t v_end = body.find("</arg_value>", v_at);
    if (k_end == std::string_view::npos || v_at == std::string_view::npos || v_end == std::string_view::npos)
      fail("an <arg_key> in tool call '", c.name, "' has no complete <arg_value>");
    const std::string key(trim(body.substr(pos + 9, k_end - pos - 9)));
    args[key] = param_value(body.substr(v_at + 11, v_end - v_at - 11));
    pos = body.find("<arg_key>", v_end);
  }
  c.arguments = args.dump();
  return c;
}

std::string_view strip_code_fence(std::string_view s) {
  s = trim(s);
  if (s.starts_with("```")) {
    const size_t nl = s.find('\n');
    s = nl == std::string_view::npos ? std::string_view{} : s.substr(nl + 1);
    if (s.ends_with("```")) s.remove_suffix(3);
  }
  return trim(s);
}

json parse_json(std::string_view text, std::string_view what) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) fail(what, " is not valid JSON: ", std::string(text));
  return j;
}

}  // namespace

OutputSyntax output_syntax(const std::string& model_type) {
  if (model_type == "deepseek_v3" || model_type == "kimi_k2") return OutputSyntax::deepseek;
  if (model_type == "mixtral") return OutputSyntax::mistral;
  if (model_type == "gpt_oss") return OutputSyntax::harmony;
  return OutputSyntax::tagged;
}

std::string new_tool_call_id() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  const uint64_t n = (salt << 20) ^ counter.fetch_add(1);
  static const char* digits = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::string id = "call_";
  uint64_t v = n * 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < 16; ++i, v /= 36) id += digits[v % 36];
  return id;
}

std::vector<ToolCall> parse_tool_calls(OutputSyntax syntax, std::string_view open, std::string_view body) {
  std::vector<ToolCall> calls;
  if (syntax == OutputSyntax::tagged) {
    const std::string_view b = trim(body);
    if (b.starts_with("{")) calls.push_back(call_from_json(parse_json(b, "a <tool_call> body")));
    else if (b.find("<function=") != std::string_view::npos) calls.push_back(qwen_xml_call(b));
    else calls.push_back(glm_call(b));
  } else if (syntax == OutputSyntax::mistral) {
    const std::string_view b = trim(body);
    if (b.starts_with("[") || b.starts_with("{")) {
      json j = parse_json(b, "a [TOOL_CALLS] list");
      if (j.is_object()) j = json::array({j});
      for (const json& c : j) calls.push_back(call_from_json(c));
    } else {  // NAME[ARGS]{…}, repeated
      size_t pos = 0;
      while (pos < b.size()) {
        const size_t a = b.find("[ARGS]", pos);
        if (a == std::string_view::npos) fail("a [TOOL_CALLS] call has no [ARGS]: ", std::string(b));
        const size_t next = b.find("[TOOL_CALLS]", a);
        const std::string_view args = b.substr(a + 6, next == std::string_view::npos ? b.npos : next - a - 6);
        calls.push_back({new_tool_call_id(), std::string(trim(b.substr(pos, a - pos))),
                         arguments_text(parse_json(trim(args), "tool call arguments"))});
        pos = next == std::string_view::npos ? b.size() : next + 12;
      }
    }
  } else if (syntax == OutputSyntax::deepseek && open == kKimiOpen) {
    size_t pos = 0;
    while ((pos = body.find(kKimiCall, pos)) != std::string_view::npos) {
      const size_t a = body.find(kKimiArgs, pos);
      const size_t e = body.find(kKimiCallEnd, a);
      if (a == std::string_view::npos || e == std::string_view::npos) fail("an unterminated Kimi tool call");
      std::string_view id = trim(body.substr(pos + kKimiCall.size(), a - pos - kKimiCall.size()));
      // functions.NAME:INDEX
      if (id.starts_with("functions.")) id.remove_prefix(10);
      if (const size_t colon = id.rfind(':'); colon != std::string_view::npos) id = id.substr(0, colon);
      const std::string_view args = body.substr(a + kKimiArgs.size(), e - a - kKimiArgs.size());
      calls.push_back({new_tool_call_id(), std::string(id),
                       arguments_text(parse_json(trim(args), "tool call arguments"))});
      pos = e + kKimiCallEnd.size();
    }
  } else if (syntax == OutputSyntax::deepseek) {
    size_t pos = 0;
    while ((pos = body.find(kDeepseekCall, pos)) != std::string_view::npos) {
      const size_t e = body.find(kDeepseekCallEnd, pos);
      if (e == std::string_view::npos) fail("an unterminated DeepSeek tool call");
      const std::string_view call = body.substr(pos + kDeepseekCall.size(), e - pos - kDeepseekCall.size());
      const size_t sep = call.find(kDeepseekSep);
      if (sep == std::string_view::npos) fail("a DeepSeek tool call without a separator");
      std::string_view left = trim(call.substr(0, sep)), right = call.substr(sep + kDeepseekSep.size());
      std::string name;
      if (left == "function") {  // V3: function<sep>NAME\n```json\nARGS\n```
        const size_t nl = right.find('\n');
        name = std::string(trim(right.substr(0, nl)));
        right = nl == std::string_view::npos ? std::string_view{} : right.substr(nl + 1);
      } else {  // V3.1: NAME<sep>ARGS
        name = std::string(left);
      }
      calls.push_back({new_tool_call_id(), name,
                       arguments_text(parse_json(strip_code_fence(right), "tool call arguments"))});
      pos = e + kDeepseekCallEnd.size();
    }
  }
  if (calls.empty()) fail("no tool call found in: ", std::string(body));
  return calls;
}

void ParsedOutput::append(ParsedOutput&& more) {
  content += more.content;
  reasoning += more.reasoning;
  for (auto& c : more.tool_calls) tool_calls.push_back(std::move(c));
}

OutputParser::OutputParser(OutputSyntax syntax, bool in_reasoning, bool parse_tools)
    : syntax_(syntax), parse_tools_(parse_tools),
      mode_(syntax == OutputSyntax::harmony ? Mode::harmony_header
                                            : in_reasoning ? Mode::reasoning : Mode::content),
      reasoning_start_(in_reasoning) {}

ParsedOutput OutputParser::push(std::string_view text) {
  buffer_.append(text);
  return syntax_ == OutputSyntax::harmony ? drain_harmony(false) : drain(false);
}

ParsedOutput OutputParser::finish() {
  return syntax_ == OutputSyntax::harmony ? drain_harmony(true) : drain(true);
}

ParsedOutput OutputParser::drain(bool at_end) {
  ParsedOutput out;
  const std::vector<Block> blocks = blocks_of(syntax_);
  for (;;) {
    if (mode_ == Mode::content) {
      if (after_reasoning_) {  // the newlines that separate a reasoning block from the answer
        buffer_.erase(0, std::min(buffer_.find_first_not_of('\n'), buffer_.size()));
        if (buffer_.empty() && !at_end) return out;
        after_reasoning_ = false;
      }
      size_t at = std::string::npos;
      const Block* found = nullptr;
      std::vector<std::string_view> opens;
      for (const Block& b : blocks) {
        if (b.tool && !parse_tools_) continue;
        opens.push_back(b.open);
        const size_t p = buffer_.find(b.open);
        if (p < at) at = p, found = &b;
      }
      if (!found) {
        const size_t keep = at_end ? 0 : held_tail(buffer_, opens);
        out.content += buffer_.substr(0, buffer_.size() - keep);
        buffer_.erase(0, buffer_.size() - keep);
        return out;
      }
      out.content += buffer_.substr(0, at);
      buffer_.erase(0, at + found->open.size());
      if (found->tool) {
        mode_ = Mode::tool;
        tool_open_ = found->open;
        tool_end_ = found->close;
      } else {
        mode_ = Mode::reasoning;
        reasoning_start_ = true;
      }
    } else if (mode_ == Mode::reasoning) {
      // Reasoning is reported without the newlines that pad it inside the tags.
      if (reasoning_start_) {
        buffer_.erase(0, std::min(buffer_.find_first_not_of('\n'), buffer_.size()));
        if (buffer_.empty() && !at_end) return out;
        reasoning_start_ = false;
      }
      const size_t p = buffer_.find(kThinkClose);
      if (p == std::string::npos) {
        size_t keep = 0;
        if (!at_end) {  // a possible "</think>" and the newlines before it
          keep = held_tail(buffer_, {kThinkClose});
          while (keep < buffer_.size() && buffer_[buffer_.size() - keep - 1] == '\n') ++keep;
        }
        out.reasoning += buffer_.substr(0, buffer_.size() - keep);
        buffer_.erase(0, buffer_.size() - keep);
        return out;
      }
      std::string_view body = std::string_view(buffer_).substr(0, p);
      while (!body.empty() && body.back() == '\n') body.remove_suffix(1);
      out.reasoning += body;
      buffer_.erase(0, p + kThinkClose.size());
      mode_ = Mode::content;
      after_reasoning_ = true;
    } else {  // tool
      const size_t p = tool_end_.empty() ? std::string::npos : buffer_.find(tool_end_);
      if (p == std::string::npos && !(at_end && tool_end_.empty())) {
        if (!at_end) return out;  // wait for the whole call
        out.content += tool_open_ + buffer_;  // unterminated: it was text after all
        buffer_.clear();
        mode_ = Mode::content;
        return out;
      }
      const std::string body = buffer_.substr(0, p);
      try {
        for (auto& c : parse_tool_calls(syntax_, tool_open_, body)) out.tool_calls.push_back(std::move(c));
      } catch (const Error&) {
        out.content += tool_open_ + body + tool_end_;  // malformed: keep what the model wrote
      }
      buffer_.erase(0, p == std::string::npos ? buffer_.size() : p + tool_end_.size());
      mode_ = Mode::content;
    }
  }
}

ParsedOutput OutputParser::drain_harmony(bool at_end) {
  // <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…
  static const std::vector<std::string_view> kEnds = {"<|end|>", "<|call|>", "<|return|>", "<|start|>"};
  ParsedOutput out;
  for (;;) {
    if (mode_ == Mode::content) {  // plain text without channels
      out.content += buffer_;
      buffer_.clear();
      return out;
    }
    if (mode_ == Mode::harmony_header) {
      if (buffer_.empty()) return out;
      if (!buffer_.starts_with("<|") && !std::string_view("<|").starts_with(buffer_)) {
        mode_ = Mode::content;
        continue;
      }
      const size_t p = buffer_.find("<|message|>");
      if (p == std::string::npos) {
        if (at_end) buffer_.clear();  // a header with no message: nothing to say
        return out;
      }
      const std::string header = buffer_.substr(0, p);
      buffer_.erase(0, p + 11);
      harmony_channel_.clear();
      harmony_recipient_.clear();
      if (const size_t c = header.find("<|channel|>"); c != std::string::npos) {
        const size_t s = c + 11;
        harmony_channel_ = header.substr(s, header.find_first_of(" <", s) - s);
      }
      if (const size_t t = header.find("to="); t != std::string::npos) {
        const size_t s = t + 3;
        harmony_recipient_ = header.substr(s, header.find_first_of(" <", s) - s);
      }
      mode_ = Mode::harmony_body;
      continue;
    }
    // harmony_body
    size_t at = std::string::npos, end_len = 0;
    for (std::string_view e : kEnds)
      if (const size_t p = buffer_.find(e); p < at) at = p, end_len = e == "<|start|>" ? 0 : e.size();
    const bool tool = parse_tools_ && harmony_recipient_.starts_with("functions.");
    const bool done = at != std::string::npos || at_end;
    const size_t take = at != std::string::npos ? at
                        : at_end             ? buffer_.size()
                        : tool               ? 0
                                             : buffer_.size() - held_tail(buffer_, kEnds);
    const std::string body = buffer_.substr(0, take);
    if (tool) {
      if (!done) return out;
      try {
        out.tool_calls.push_back({new_tool_call_id(), harmony_recipient_.substr(10),
                                  arguments_text(parse_json(trim(body), "tool call arguments"))});
      } catch (const Error&) {
        out.content += body;
      }
    } else if (harmony_channel_ == "analysis") {
      out.reasoning += body;
    } else {
      out.content += body;
    }
    buffer_.erase(0, take + (at != std::string::npos ? end_len : 0));
    if (!done) return out;
    mode_ = Mode::harmony_header;
    if (at == std::string::npos) return out;
  }
}

}  // namespace moestream
