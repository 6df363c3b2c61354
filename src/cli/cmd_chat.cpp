// moestream chat: a conversation in the terminal, with the model's own chat template.
//
// Nothing the user does loses the conversation: Ctrl-C stops the reply and returns to the prompt
// (twice in a row at the prompt leaves), a reply cut inside a character ends in U+FFFD instead of
// bytes the next prompt cannot encode, and /save writes a temporary file renamed into place.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>

#include "cli/cli.h"
#include "core/error.h"
#include "server/context_shift.h"
#include "server/generation.h"

namespace moestream::cli {

namespace {

struct ChatFlags {
  ModelFlags model;
  SamplingFlags sampling;
  std::string system;
  int max_tokens = 1024;
  bool no_think = false;
};

const char* kHelp =
    "Type a message and press Enter. End a line with \\ to continue on the next line, or put \"\"\" on\n"
    "a line of its own to start and end a block of several lines. Ctrl-C stops a reply.\n"
    "  /help               this text\n"
    "  /reset              start a new conversation\n"
    "  /save FILE          save the conversation (JSON)\n"
    "  /load FILE          continue a saved conversation\n"
    "  /set                show the settings; /set NAME VALUE changes one: temp, top_k, top_p,\n"
    "                      min_p, repeat_penalty, repeat_last_n, seed, max_tokens, system, think\n"
    "                      (on|off)\n"
    "  /quit               leave (also Ctrl-D, or Ctrl-C twice at the prompt)\n"
    "A message that starts with / is sent as written when it starts with //.\n";

// One user message from stdin; nullopt when the user leaves (end of input, or a second Ctrl-C in
// a row at the prompt).
std::optional<std::string> read_message(bool tty) {
  std::string text, line;
  bool block = false;
  reset_interrupts();
  for (;;) {
    if (tty) std::fputs(text.empty() && !block ? "> " : ". ", stderr);
    if (!std::getline(std::cin, line)) {
      if (interrupts() > 0) {  // Ctrl-C while waiting: drop the line being typed
        std::cin.clear();
        clearerr(stdin);
        if (interrupts() >= 2) return std::nullopt;
        std::fputs("\n(Ctrl-C again, /quit or Ctrl-D to leave)\n", stderr);
        text.clear();
        block = false;
        continue;
      }
      if (text.empty()) return std::nullopt;
      return text;
    }
    reset_interrupts();
    if (line == "\"\"\"") {
      if (block) return text;
      block = true;
      continue;
    }
    if (block) {
      text += (text.empty() ? "" : "\n") + line;
    } else if (!line.empty() && line.back() == '\\') {
      line.pop_back();
      text += line + "\n";
    } else {
      return text + line;
    }
  }
}

// The conversation and the settings /set changes.
struct Conversation {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();  // without the system message
  std::string system;
  SamplingParams sampling;
  int max_tokens = 1024;
  bool think = true;

  nlohmann::ordered_json with_system() const {
    nlohmann::ordered_json all = nlohmann::ordered_json::array();
    if (!system.empty()) all.push_back({{"role", "system"}, {"content", system}});
    for (const auto& m : messages) all.push_back(m);
    return all;
  }
};

void save(const Conversation& c, const std::string& path) {
  nlohmann::ordered_json j = {{"format", "moestream-chat"}, {"version", 1}, {"messages", c.with_system()}};
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out || !(out << j.dump(2) << "\n") || !out.flush()) fail(path, ": cannot write");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) fail(path, ": cannot write: ", ec.message());
}

// A saved conversation (or a plain messages array, or an object with "messages", as `template`
// reads them).
void load(Conversation& c, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open for reading");
  const auto j = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail(path, ": not valid JSON");
  const auto& list = j.is_object() && j.contains("messages") ? j["messages"] : j;
  if (!list.is_array()) fail(path, ": expected a messages array");
  Conversation loaded = c;
  loaded.messages = nlohmann::ordered_json::array();
  loaded.system.clear();
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& m = list[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") || !m["content"].is_string())
      fail(path, ": messages[", i, "]: expected {\"role\": string, \"content\": string}");
    const std::string role = m["role"].get<std::string>();
    if (role == "system" && i == 0) loaded.system = m["content"].get<std::string>();
    else if (role == "user" || role == "assistant") loaded.messages.push_back(m);
    else fail(path, ": messages[", i, "]: unknown role '", role, "'");
  }
  c = std::move(loaded);
}

double parse_number(const std::string& name, const std::string& value) {
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0') fail("/set ", name, ": '", value, "' is not a number");
  return v;
}

void set(Conversation& c, const std::string& args) {
  std::istringstream in(args);
  std::string name, value;
  in >> name;
  std::getline(in >> std::ws, value);
  if (name.empty()) {
    std::fprintf(stderr, "temp %g, top_k %d, top_p %g, min_p %g, repeat_penalty %g, repeat_last_n %d, seed %llu, max_tokens %d, think %s\nsystem: %s\n",
                 c.sampling.temperature, c.sampling.top_k, c.sampling.top_p, c.sampling.min_p,
                 c.sampling.repetition_penalty, c.sampling.repeat_last_n, (unsigned long long)c.sampling.seed, c.max_tokens,
                 c.think ? "on" : "off", c.system.empty() ? "(none)" : c.system.c_str());
    return;
  }
  if (value.empty() && name != "system") fail("/set ", name, ": give a value");
  SamplingParams s = c.sampling;
  if (name == "temp" || name == "temperature") s.temperature = float(parse_number(name, value));
  else if (name == "top_k" || name == "top-k") s.top_k = int(parse_number(name, value));
  else if (name == "top_p" || name == "top-p") s.top_p = float(parse_number(name, value));
  else if (name == "min_p" || name == "min-p") s.min_p = float(parse_number(name, value));
  else if (name == "repeat_penalty" || name == "repeat-penalty") s.repetition_penalty = float(parse_number(name, value));
  else if (name == "repeat_last_n" || name == "repeat-last-n") s.repeat_last_n = int(parse_number(name, value));
  else if (name == "seed") s.seed = uint64_t(parse_number(name, value));
  else if (name == "max_tokens" || name == "max-tokens") {
    const double n = parse_number(name, value);
    if (n < 1 || n > 1e9) fail("/set max_tokens: must be >= 1, got ", value);
    c.max_tokens = int(n);
  } else if (name == "system") c.system = value;
  else if (name == "think") {
    if (value != "on" && value != "off") fail("/set think: on or off, got '", value, "'");
    c.think = value == "on";
  } else fail("/set: unknown setting '", name, "' (see /help)");
  validate(s);
  c.sampling = s;
}

// A slash command; false when the line is not one (a message to send).
bool command(Conversation& c, const std::string& text, bool& quit) {
  if (text.empty() || text[0] != '/' || text.rfind("//", 0) == 0) return false;
  const size_t space = text.find(' ');
  const std::string name = text.substr(0, space);
  const std::string rest = space == std::string::npos ? "" : text.substr(text.find_first_not_of(' ', space) == std::string::npos ? text.size() : text.find_first_not_of(' ', space));
  if (name == "/quit" || name == "/exit" || name == "/bye") quit = true;
  else if (name == "/help" || name == "/?") std::fputs(kHelp, stderr);
  else if (name == "/reset" || name == "/clear") {
    c.messages = nlohmann::ordered_json::array();
    std::fprintf(stderr, "(new conversation)\n");
  } else if (name == "/save") {
    if (rest.empty()) fail("/save: give a file name");
    save(c, rest);
    std::fprintf(stderr, "(saved %zu messages to %s)\n", c.messages.size(), rest.c_str());
  } else if (name == "/load") {
    if (rest.empty()) fail("/load: give a file name");
    load(c, rest);
    std::fprintf(stderr, "(loaded %zu messages from %s)\n", c.messages.size(), rest.c_str());
  } else if (name == "/set") set(c, rest);
  else fail("unknown command ", name, " (see /help; start with // to send a message that begins with /)");
  return true;
}

// Context shift: leaves out the fewest oldest exchanges of c (never the system prompt or the
// latest user message) for which fits(tokens of the rendered rest) holds, or all it can when none
// does; prompt and ids become the rest's. Returns how many messages were left out.
int shift(const ServedModel& m, Conversation& c, const nlohmann::ordered_json& kwargs,
          const std::function<bool(int64_t)>& fits, std::string& prompt, std::vector<int32_t>& ids) {
  const nlohmann::ordered_json all = c.with_system();
  const ContextShift turns(all);
  if (turns.droppable() == 0) return 0;
  std::map<int, std::pair<std::string, std::vector<int32_t>>> tried;
  auto render = [&](int k) -> std::pair<std::string, std::vector<int32_t>>& {
    auto it = tried.find(k);
    if (it != tried.end()) return it->second;
    std::string text = m.chat_template->render(turns.kept(k), nullptr, true, kwargs);
    std::vector<int32_t> encoded = m.encode_chat(text);
    return tried[k] = {std::move(text), std::move(encoded)};
  };
  const int k = fewest_to_drop(turns.droppable(), [&](int k) { return fits(int64_t(render(k).second.size())); });
  if (k == 0) return 0;
  const int dropped = turns.dropped_messages(k);
  const size_t from_system = c.system.empty() ? 0 : 1;
  nlohmann::ordered_json kept = turns.kept(k);
  c.messages = nlohmann::ordered_json::array();
  for (size_t i = from_system; i < kept.size(); ++i) c.messages.push_back(kept[i]);
  prompt = render(k).first;
  ids = render(k).second;
  return dropped;
}

void chat(const ChatFlags& f) {
  if (f.max_tokens < 1) fail("-n: must be >= 1, got ", f.max_tokens);
  Conversation c;
  c.sampling = f.sampling.resolve(f.model.dir);
  c.system = f.system;
  c.max_tokens = f.max_tokens;
  c.think = !f.no_think;
  EngineOptions eo;
  eo.parallel = 1;
  eo.max_queue = 1;
  eo.kv_slots = 2;
  eo.ctx = f.model.ctx;
  auto m = ServedModel::load(f.model.dir, f.model.options, eo);
  if (!m->chat_template) fail(f.model.dir, ": the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)");
  const bool tty = isatty(STDIN_FILENO);
  const bool color = isatty(STDOUT_FILENO);
  std::fprintf(stderr, "moestream chat: %s (context %lld tokens)\n%s", m->id.c_str(),
               (long long)m->engine->options().ctx, tty ? kHelp : "");
  catch_interrupts(/*exit_on_second=*/false);

  while (auto line = read_message(tty)) {
    std::string text = *line;
    bool quit = false;
    try {
      if (command(c, text, quit)) {
        if (quit) break;
        continue;
      }
    } catch (const Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      continue;
    }
    if (text.rfind("//", 0) == 0) text.erase(0, 1);
    if (text.empty()) continue;
    c.messages.push_back({{"role", "user"}, {"content", text}});
    nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
    if (!c.think) kwargs["enable_thinking"] = false;
    GenerateOptions o;
    std::string prompt;
    const int64_t ctx = m->engine->options().ctx;
    const nlohmann::ordered_json before = c.messages;  // kept whole when the message cannot fit
    int dropped = 0;
    try {
      // Room for the reply: the smaller of max_tokens and shift_reply_room (a reply that reaches
      // the end of the context shifts again below).
      const int64_t need = std::min<int64_t>(c.max_tokens, shift_reply_room(ctx));
      auto fits = [&](int64_t tokens) { return tokens + need <= ctx; };
      prompt = m->chat_template->render(c.with_system(), nullptr, true, kwargs);
      o.prompt = m->encode_chat(prompt);
      if (!fits(int64_t(o.prompt.size()))) {
        dropped = shift(*m, c, kwargs, fits, prompt, o.prompt);
      }
    } catch (const Error& e) {
      std::fprintf(stderr, "the conversation could not be rendered: %s\n", e.what());
      c.messages.erase(c.messages.end() - 1);
      continue;
    }
    const int64_t room = ctx - int64_t(o.prompt.size());
    if (room < 1) {
      std::fprintf(stderr, "the message does not fit: the prompt has %zu tokens and the context (--ctx) holds %lld\n",
                   o.prompt.size(), (long long)ctx);
      c.messages = before;
      c.messages.erase(c.messages.end() - 1);
      continue;
    }
    if (dropped > 0) std::fprintf(stderr, "(context: left out the %d oldest messages to fit --ctx %lld)\n", dropped, (long long)ctx);
    o.sampling = c.sampling;
    o.max_tokens = int(std::min<int64_t>(room, c.max_tokens));
    o.chat = true;
    o.in_reasoning = prompt_opens_reasoning(prompt);
    bool in_reasoning = false;
    reset_interrupts();
    GenerateResult r;  // the whole reply, over its continuations
    bool failed = false;
    for (;;) {
      GenerateResult part;
      try {
        Generation gen(*m, o);
        part = gen.run([&](const ParsedOutput& piece) {
          if (!piece.reasoning.empty()) {
            if (!in_reasoning && color) std::fputs("\x1b[2m", stdout);
            in_reasoning = true;
            std::fputs(piece.reasoning.c_str(), stdout);
          }
          if (!piece.content.empty()) {
            if (in_reasoning) std::fputs(color ? "\x1b[0m\n" : "\n", stdout);
            in_reasoning = false;
            std::fputs(piece.content.c_str(), stdout);
          }
          std::fflush(stdout);
          return interrupts() == 0;
        });
      } catch (const Error& e) {
        if (in_reasoning && color) std::fputs("\x1b[0m", stdout);
        std::fprintf(stderr, "\nthe reply failed: %s\n", e.what());
        failed = true;
        break;
      }
      if (r.tokens.empty()) r.prompt_tokens = part.prompt_tokens, r.cached_tokens = part.cached_tokens;
      r.output.append(std::move(part.output));
      r.tokens.insert(r.tokens.end(), part.tokens.begin(), part.tokens.end());
      r.completion_tokens += part.completion_tokens;
      r.decode_seconds += part.decode_seconds;
      r.finish_reason = part.finish_reason;
      // The reply reached the end of the context before max_tokens: leave out the oldest turns,
      // prefill the rest with the reply so far, and go on.
      const int64_t left = c.max_tokens - r.completion_tokens;
      if (part.finish_reason != "length" || part.completion_tokens < o.max_tokens || left <= 0 || interrupts() > 0) break;
      const int64_t need = std::min<int64_t>(left, shift_reply_room(ctx));
      auto fits = [&](int64_t tokens) { return tokens + int64_t(r.tokens.size()) + need <= ctx; };
      dropped = 0;
      try {
        dropped = shift(*m, c, kwargs, fits, prompt, o.prompt);
      } catch (const Error& e) {
        std::fprintf(stderr, "\nthe conversation could not be rendered: %s\n", e.what());
      }
      if (dropped == 0) {
        std::fprintf(stderr, "\n(the reply reached the end of the context, --ctx %lld, with no older turns left to leave out)\n", (long long)ctx);
        break;
      }
      std::fprintf(stderr, "\n(context: left out the %d oldest messages to continue the reply within --ctx %lld)\n", dropped, (long long)ctx);
      o.in_reasoning = prompt_opens_reasoning(prompt + m->tokenizer->decode(r.tokens));
      o.prompt.insert(o.prompt.end(), r.tokens.begin(), r.tokens.end());
      if (int64_t(o.prompt.size()) >= ctx) {
        std::fprintf(stderr, "(the reply so far fills the context, --ctx %lld)\n", (long long)ctx);
        break;
      }
      o.max_tokens = int(std::min<int64_t>(left, ctx - int64_t(o.prompt.size())));
    }
    if (failed) {
      c.messages.erase(c.messages.end() - 1);
      continue;
    }
    if (in_reasoning && color) std::fputs("\x1b[0m", stdout);
    std::fputs("\n", stdout);
    std::fflush(stdout);
    const bool stopped = interrupts() > 0;
    reset_interrupts();
    const double tps = r.decode_seconds > 0 && r.completion_tokens > 1 ? (r.completion_tokens - 1) / r.decode_seconds : 0;
    std::fprintf(stderr, "[%s%lld tokens, %.1f tok/s; prompt %lld tokens, %lld reused]\n", stopped ? "stopped; " : "",
                 (long long)r.completion_tokens, tps, (long long)r.prompt_tokens, (long long)r.cached_tokens);
    nlohmann::ordered_json reply = {{"role", "assistant"}, {"content", r.output.content}};
    if (!r.output.reasoning.empty()) reply["reasoning_content"] = r.output.reasoning;
    c.messages.push_back(std::move(reply));
  }
}

}  // namespace

void add_chat(CLI::App& app) {
  auto flags = std::make_shared<ChatFlags>();
  CLI::App* cmd = app.add_subcommand("chat", "Chat with the model in the terminal");
  flags->model.add_to(*cmd);
  flags->sampling.add_to(*cmd);
  cmd->add_option("--system,--system-prompt", flags->system, "System message");
  cmd->add_option("-n,--max-tokens,--n-predict", flags->max_tokens, "Longest reply in tokens (default 1024)");
  cmd->add_flag("--no-think", flags->no_think, "Ask the template to turn reasoning off (enable_thinking=false)");
  cmd->callback([flags] { chat(*flags); });
}

}  // namespace moestream::cli
