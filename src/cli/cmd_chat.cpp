// moestream chat: a conversation in the terminal, with the model's own chat template.
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "cli/cli.h"
#include "core/error.h"
#include "server/generation.h"

namespace moestream::cli {

namespace {

struct ChatFlags {
  ModelFlags model;
  SamplingFlags sampling;
  std::string system;
  int max_tokens = 1024;
  int64_t ctx = 0;
  bool no_think = false;
};

const char* kHelp =
    "Type a message and press Enter. End a line with \\ to continue on the next line, or put \"\"\" on\n"
    "a line of its own to start and end a block of several lines. /reset starts a new conversation,\n"
    "/quit (or Ctrl-D) leaves.\n";

// One user message from stdin; nullopt at end of input.
std::optional<std::string> read_message(bool tty) {
  std::string text, line;
  bool block = false;
  for (;;) {
    if (tty) std::fputs(text.empty() && !block ? "> " : ". ", stderr);
    if (!std::getline(std::cin, line)) {
      if (text.empty()) return std::nullopt;
      return text;
    }
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

void chat(const ChatFlags& f) {
  if (f.max_tokens < 1) fail("-n: must be >= 1, got ", f.max_tokens);
  const SamplingParams sampling = f.sampling.resolve(f.model.dir);
  EngineOptions eo;
  eo.parallel = 1;
  eo.max_queue = 1;
  eo.kv_slots = 2;
  eo.ctx = f.ctx;
  auto m = ServedModel::load(f.model.dir, f.model.options, eo);
  if (!m->chat_template) fail(f.model.dir, ": the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)");
  const bool tty = isatty(STDIN_FILENO);
  const bool color = isatty(STDOUT_FILENO);
  std::fprintf(stderr, "moestream chat: %s (context %lld tokens)\n%s", m->id.c_str(),
               (long long)m->engine->options().ctx, tty ? kHelp : "");

  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  if (!f.system.empty()) messages.push_back({{"role", "system"}, {"content", f.system}});
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
  if (f.no_think) kwargs["enable_thinking"] = false;

  while (auto text = read_message(tty)) {
    if (*text == "/quit" || *text == "/exit") break;
    if (*text == "/reset") {
      messages.erase(messages.begin() + (f.system.empty() ? 0 : 1), messages.end());
      std::fprintf(stderr, "(new conversation)\n");
      continue;
    }
    if (*text == "/help") {
      std::fputs(kHelp, stderr);
      continue;
    }
    if (text->empty()) continue;
    messages.push_back({{"role", "user"}, {"content", *text}});
    GenerateOptions o;
    std::string prompt;
    try {
      prompt = m->chat_template->render(messages, nullptr, true, kwargs);
    } catch (const Error& e) {
      std::fprintf(stderr, "the chat template rejected the conversation: %s\n", e.what());
      messages.erase(messages.end() - 1);
      continue;
    }
    o.prompt = m->encode_chat(prompt);
    const int64_t room = m->engine->options().ctx - int64_t(o.prompt.size());
    if (room < 1) {
      std::fprintf(stderr, "the conversation (%zu tokens) no longer fits the context of %lld; /reset to start over\n",
                   o.prompt.size(), (long long)m->engine->options().ctx);
      messages.erase(messages.end() - 1);
      continue;
    }
    o.sampling = sampling;
    o.max_tokens = int(std::min<int64_t>(room, f.max_tokens));
    o.chat = true;
    o.in_reasoning = prompt_opens_reasoning(prompt);
    Generation gen(*m, o);
    bool in_reasoning = false;
    GenerateResult r = gen.run([&](const ParsedOutput& piece) {
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
      return true;
    });
    if (in_reasoning && color) std::fputs("\x1b[0m", stdout);
    std::fputs("\n", stdout);
    std::fflush(stdout);
    const double tps = r.decode_seconds > 0 && r.completion_tokens > 1 ? (r.completion_tokens - 1) / r.decode_seconds : 0;
    std::fprintf(stderr, "[%lld tokens, %.1f tok/s; prompt %lld tokens, %lld reused]\n", (long long)r.completion_tokens,
                 tps, (long long)r.prompt_tokens, (long long)r.cached_tokens);
    nlohmann::ordered_json reply = {{"role", "assistant"}, {"content", r.output.content}};
    if (!r.output.reasoning.empty()) reply["reasoning_content"] = r.output.reasoning;
    messages.push_back(std::move(reply));
  }
}

}  // namespace

void add_chat(CLI::App& app) {
  auto flags = std::make_shared<ChatFlags>();
  CLI::App* cmd = app.add_subcommand("chat", "Chat with the model in the terminal");
  flags->model.add_to(*cmd);
  flags->sampling.add_to(*cmd);
  cmd->add_option("--system", flags->system, "System message");
  cmd->add_option("-n,--max-tokens", flags->max_tokens, "Longest reply in tokens (default 1024)");
  cmd->add_option("--ctx", flags->ctx, "Context length (default: the model's, at most 4096)")->check(CLI::NonNegativeNumber);
  cmd->add_flag("--no-think", flags->no_think, "Ask the template to turn reasoning off (enable_thinking=false)");
  cmd->callback([flags] { chat(*flags); });
}

}  // namespace moestream::cli
