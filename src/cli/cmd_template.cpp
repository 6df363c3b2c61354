// moestream template: render a conversation with the model's chat template and print the prompt.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "core/error.h"
#include "core/files.h"
#include "text/chat_template.h"

namespace moestream::cli {

namespace {

nlohmann::ordered_json read_json_file(const std::string& path, const std::string& flag) {
  std::optional<std::string> text = try_read_file(path);
  if (!text) fail(flag, ": ", path, ": cannot open for reading");
  try {
    return nlohmann::ordered_json::parse(*text);
  } catch (const std::exception& e) {
    fail(flag, ": ", path, ": not valid JSON: ", e.what());
  }
}

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

}  // namespace

void add_template(CLI::App& app) {
  struct Flags {
    std::string dir, messages, tools, kwargs;
    bool no_generation_prompt = false;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand(
      "template", "Print a conversation rendered with the model's chat template (as transformers' apply_chat_template)");
  cmd->add_option("-m,--model", f->dir, "Model directory (tokenizer_config.json / chat_template.jinja)")->required();
  cmd->add_option("--messages", f->messages, "JSON file: the messages array (or an object with \"messages\")")
      ->required();
  cmd->add_option("--tools", f->tools, "JSON file: the tools array");
  cmd->add_flag("--no-generation-prompt", f->no_generation_prompt, "Do not add the assistant generation prompt");
  cmd->add_option("--kwargs", f->kwargs, "JSON object of extra template variables, e.g. '{\"enable_thinking\": false}'");
  cmd->callback([f] {
    nlohmann::ordered_json messages = read_json_file(f->messages, "--messages");
    nlohmann::ordered_json tools = nullptr;
    if (messages.is_object() && messages.contains("messages")) {
      if (messages.contains("tools")) tools = messages["tools"];
      nlohmann::ordered_json m = messages["messages"];
      messages = std::move(m);
    }
    if (!messages.is_array()) fail("--messages: ", f->messages, ": expected a JSON array of messages");
    if (!f->tools.empty()) tools = read_json_file(f->tools, "--tools");
    if (!tools.is_null() && !tools.is_array()) fail("--tools: ", f->tools, ": expected a JSON array");
    nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
    if (!f->kwargs.empty()) {
      try {
        kwargs = nlohmann::ordered_json::parse(f->kwargs);
      } catch (const std::exception& e) {
        fail("--kwargs: not valid JSON: ", e.what());
      }
      if (!kwargs.is_object()) fail("--kwargs: expected a JSON object");
    }
    std::string prompt;
    try {
      ChatTemplate t = ChatTemplate::load(f->dir);
      prompt = t.render(messages, tools, !f->no_generation_prompt, kwargs);
    } catch (const Error& e) {
      throw Error(one_line(e.what()));
    }
    std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  });
}

}  // namespace moestream::cli
