// Chat templates against transformers: every case of tests/fixtures/templates/renderings.json
// (written by tools/make_template_fixtures.py with transformers' apply_chat_template) must render
// byte for byte the same, or raise where the template raised. Also: loading a model directory's
// template and special tokens, and the `moestream template` command.
#include "text/chat_template.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace moestream {
namespace {

using nlohmann::ordered_json;

const std::string kTemplates = test::fixture("templates");

ordered_json read_json(const std::string& path) { return ordered_json::parse(test::read_file(path)); }

std::time_t parse_now(const std::string& iso) {
  std::tm tm{};
  if (!strptime(iso.c_str(), "%Y-%m-%dT%H:%M:%S", &tm)) return 0;
  tm.tm_isdst = -1;
  return std::mktime(&tm);
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

TEST(ChatTemplate, MatchesTransformersRenderings) {
  const std::string path = kTemplates + "/renderings.json";
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing (tools/make_template_fixtures.py makes it)";
  ordered_json fx = read_json(path);
  std::string now = fx.value("now", ordered_json()).is_string() ? fx["now"].get<std::string>() : "";
  if (now.empty()) now = read_json(kTemplates + "/conversations.json").value("now", "2026-01-15T12:00:00");
  std::map<std::string, ChatTemplate> templates;
  std::map<std::string, std::pair<int, int>> per_template;  // matched, total
  int mismatches = 0;
  for (const auto& c : fx["cases"]) {
    const std::string name = c["template"].get<std::string>();
    auto it = templates.find(name);
    if (it == templates.end()) {
      ChatTemplate t = ChatTemplate::from_source(test::read_file(kTemplates + "/" + name), ordered_json::object());
      t.fixed_time = parse_now(now);
      it = templates.emplace(name, std::move(t)).first;
    }
    ChatTemplate t = it->second;
    t.special_tokens = c["special_tokens"];
    std::string got, error;
    try {
      got = t.render(c["messages"], c["tools"], c["add_generation_prompt"].get<bool>(), c["kwargs"]);
    } catch (const Error& e) {
      error = e.what();
    }
    bool ok;
    std::string detail;
    if (c.contains("error")) {
      ok = !error.empty();
      // raise_exception messages must be the template's own.
      if (ok && c["error"]["type"] == "TemplateError")
        ok = error.find(c["error"]["message"].get<std::string>()) != std::string::npos;
      if (!ok) detail = "expected error " + c["error"].dump() + ", got " + (error.empty() ? ordered_json(got).dump() : error);
    } else {
      ok = error.empty() && got == c["rendered"].get<std::string>();
      if (!ok) detail = "expected " + c["rendered"].dump() + "\n got " + (error.empty() ? ordered_json(got).dump() : error);
    }
    auto& [matched, total] = per_template[name];
    ++total;
    if (ok) {
      ++matched;
    } else if (++mismatches <= 20) {
      ADD_FAILURE() << c["id"].get<std::string>() << ": " << detail;
    }
  }
  for (const auto& [name, mt] : per_template)
    std::printf("  %-36s %d/%d cases match\n", name.c_str(), mt.first, mt.second);
  EXPECT_EQ(mismatches, 0);
  EXPECT_GE(per_template.size(), 6u);
}

TEST(ChatTemplate, LoadsTemplateAndSpecialTokensFromTokenizerConfig) {
  const std::string dir = test::temp_dir("chat-template-load");
  ordered_json config = {
      {"bos_token", {{"__type", "AddedToken"}, {"content", "<s>"}, {"lstrip", false}}},
      {"eos_token", "</s>"},
      {"unk_token", nullptr},
      {"chat_template", "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                        "{{ eos_token }}{{ unk_token is defined }}{% if add_generation_prompt %}>{% endif %}"}};
  write_file(dir + "/tokenizer_config.json", config.dump());
  ChatTemplate t = ChatTemplate::load(dir);
  ordered_json msgs = ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  EXPECT_EQ(t.render(msgs, nullptr, true, ordered_json::object()), "<s>[user]hi</s>False>");
  EXPECT_EQ(t.render(msgs, nullptr, false, {{"eos_token", "E"}}), "<s>[user]hiEFalse");  // kwargs override

  // A list of named templates: "tool_use" when tools are given, else "default".
  config["chat_template"] = ordered_json::parse(
      R"([{"name": "default", "template": "D{{ tools is none }}"}, {"name": "tool_use", "template": "T{{ tools | length }}"}])");
  write_file(dir + "/tokenizer_config.json", config.dump());
  ChatTemplate named = ChatTemplate::load(dir);
  EXPECT_EQ(named.render(msgs, nullptr, false, ordered_json::object()), "DTrue");
  EXPECT_EQ(named.render(msgs, ordered_json::parse(R"([{"type": "function"}])"), false, ordered_json::object()), "T1");

  // chat_template.jinja overrides the config's template (as in transformers).
  write_file(dir + "/chat_template.jinja", "J{{ bos_token }}\n");
  EXPECT_EQ(ChatTemplate::load(dir).render(msgs, nullptr, false, ordered_json::object()), "J<s>");
}

TEST(ChatTemplate, LoadErrorsNameTheFile) {
  const std::string dir = test::temp_dir("chat-template-errors");
  test::expect_contains(test::error_of([&] { ChatTemplate::load(dir); }), {"tokenizer_config.json"});
  write_file(dir + "/tokenizer_config.json", R"({"eos_token": "</s>"})");
  test::expect_contains(test::error_of([&] { ChatTemplate::load(dir); }), {"chat_template"});
  write_file(dir + "/tokenizer_config.json", R"({"chat_template": "{% if %}"})");
  test::expect_contains(test::error_of([&] { ChatTemplate::load(dir); }), {"tokenizer_config.json line 1"});
  write_file(dir + "/tokenizer_config.json", "{not json");
  EXPECT_THROW(ChatTemplate::load(dir), Error);
}

TEST(ChatTemplate, RaiseExceptionBecomesAnError) {
  ChatTemplate t = ChatTemplate::from_source(test::read_file(kTemplates + "/mixtral-8x7b-instruct-v0.1.jinja"),
                                             {{"bos_token", "<s>"}, {"eos_token", "</s>"}});
  ordered_json msgs = ordered_json::parse(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])");
  test::expect_contains(test::error_of([&] { t.render(msgs, nullptr, true, ordered_json::object()); }),
                        {"conversation roles must alternate user/assistant", " line 11: "});
}

// The CLI prints exactly the rendering (no trailing newline) and fails with one line.
TEST(ChatTemplate, CliPrintsTheRenderedPrompt) {
  const std::string dir = test::temp_dir("chat-template-cli");
  const std::string source = test::read_file(kTemplates + "/qwen3.jinja");
  ordered_json config = {{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}, {"chat_template", source}};
  write_file(dir + "/tokenizer_config.json", config.dump());
  ordered_json conv = read_json(kTemplates + "/conversations.json");
  ordered_json chosen;
  for (const auto& c : conv["conversations"])
    if (c["name"] == "tool_call_with_content") chosen = c;
  ASSERT_FALSE(chosen.is_null());
  write_file(dir + "/messages.json", chosen["messages"].dump());
  write_file(dir + "/tools.json", chosen["tools"].dump());

  ChatTemplate t = ChatTemplate::load(dir);
  const std::string expected = t.render(chosen["messages"], chosen["tools"], true, {{"enable_thinking", false}});
  test::CliResult r = test::run_cli("template -m " + shell_quote(dir) + " --messages " + shell_quote(dir + "/messages.json") +
                                    " --tools " + shell_quote(dir + "/tools.json") +
                                    " --kwargs '{\"enable_thinking\": false}'");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, expected);
  EXPECT_NE(r.out.find("<think>\n\n</think>\n\n"), std::string::npos);

  // Against transformers' own rendering of this case, when the fixtures are there.
  const std::string fx_path = kTemplates + "/renderings.json";
  if (std::filesystem::exists(fx_path)) {
    bool found = false;
    const ordered_json fx = read_json(fx_path);
    for (const auto& c : fx["cases"]) {
      if (c["template"] == "qwen3.jinja" && c["conversation"] == "tool_call_with_content" &&
          c["add_generation_prompt"] == true && c["kwargs"] == ordered_json{{"enable_thinking", false}} &&
          c.contains("rendered")) {
        EXPECT_EQ(r.out, c["rendered"].get<std::string>());
        found = true;
      }
    }
    EXPECT_TRUE(found);
  }

  test::CliResult plain = test::run_cli("template -m " + shell_quote(dir) + " --messages " +
                                        shell_quote(dir + "/messages.json") + " --no-generation-prompt");
  EXPECT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_EQ(plain.out, t.render(chosen["messages"], nullptr, false, ordered_json::object()));

  // A template error: exit 1, one line on stderr, nothing on stdout.
  write_file(dir + "/bad.json", R"([{"role": "user", "content": null}])");
  test::CliResult bad = test::run_cli("template -m " + shell_quote(dir) + " --messages " + shell_quote(dir + "/bad.json"));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_EQ(bad.out, "");
  EXPECT_NE(bad.err.find("line "), std::string::npos) << bad.err;
  EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << bad.err;
}

}  // namespace
}  // namespace moestream
