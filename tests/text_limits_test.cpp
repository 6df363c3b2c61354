// Hostile inputs to the text side: JSON, template sources, template values and tokenizer files
// nested tens of thousands of levels deep, integer literals and arithmetic past int64, sizes
// taken from user numbers, megabytes of whitespace, NaN logits. Each must give a clear Error (or
// the right answer), never a crash, a wrapped number or a huge allocation. The deep inputs are
// built here, far deeper than the limits in src/text/limits.h, deep enough to overflow the stack
// of an unbounded recursion.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/jinja.h"
#include "text/limits.h"
#include "text/sampler.h"
#include "text/tokenizer.h"
#include "text/unicode.h"

namespace moestream {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;
namespace fs = std::filesystem;

constexpr int kDeep = 100000;  // far past every limit; overflows an 8 MiB stack when unbounded

std::string repeat(std::string_view s, size_t n) {
  std::string out;
  out.reserve(s.size() * n);
  for (size_t i = 0; i < n; ++i) out += s;
  return out;
}

// [[[...[1]...]]] (or {"a": {"a": ...}}) `depth` levels deep, parsed by nlohmann (which does
// not recurse while parsing).
ordered_json deep_json(int depth, bool objects) {
  std::string text = objects ? repeat("{\"a\":", size_t(depth)) + "1" + repeat("}", size_t(depth))
                             : repeat("[", size_t(depth)) + "1" + repeat("]", size_t(depth));
  return ordered_json::parse(text);
}

// Runs f, which must throw moestream::Error whose message has every one of `parts`.
template <class F>
void expect_error(F f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << "not one line: " << what;
    for (const auto& p : parts)
      EXPECT_NE(what.find(p), std::string::npos) << "'" << what << "' lacks '" << p << "'";
  }
}

std::string render(const std::string& src, const std::string& vars = "{}") {
  return jinja::Template::parse(src, "t").render(ordered_json::parse(vars));
}

// ---- 1. JSON given to templates ----

TEST(TextLimitsJson, DeepChatTemplateKwargsToolsAndMessagesAreErrors) {
  auto tpl =
      ChatTemplate::from_source("{{ messages | length }}{{ tools | tojson }}{{ x }}", nullptr);
  for (bool objects : {false, true}) {
    // Each deep value is built where it is used and moved in: nlohmann copies recursively, so a
    // copy made by the test itself would overflow the stack under AddressSanitizer.
    ordered_json kwargs = ordered_json::object();
    kwargs["x"] = deep_json(30000, objects);
    ordered_json msgs = ordered_json::array({{{"role", "user"}, {"content", "hi"}}});
    expect_error(
        [&] { tpl.render(msgs, nullptr, true, kwargs); },
        {"chat_template_kwargs", "nested more than", std::to_string(text_limits::kMaxJsonDepth)});
    ordered_json function = ordered_json::object();
    function["parameters"] = deep_json(30000, objects);
    ordered_json tool = ordered_json::object();
    tool["type"] = "function";
    tool["function"] = std::move(function);
    ordered_json tools = ordered_json::array();
    tools.push_back(std::move(tool));
    expect_error([&] { tpl.render(msgs, tools, true, ordered_json::object()); },
                 {"tools", "nested more than"});
    ordered_json call = ordered_json::object();
    call["function"] = ordered_json::object();
    call["function"]["arguments"] = deep_json(30000, objects);
    ordered_json assistant = ordered_json::object();
    assistant["role"] = "assistant";
    assistant["tool_calls"] = ordered_json::array();
    assistant["tool_calls"].push_back(std::move(call));
    ordered_json call_msgs = ordered_json::array();
    call_msgs.push_back(std::move(assistant));
    expect_error([&] { tpl.render(call_msgs, nullptr, true, ordered_json::object()); },
                 {"messages", "nested more than"});
  }
}

TEST(TextLimitsJson, DepthAtTheLimitRenders) {
  auto tpl = ChatTemplate::from_source("{{ x | tojson }}", nullptr);
  // The limit counts containers: kMaxJsonDepth - 1 inside the kwargs object itself.
  ordered_json kwargs = {{"x", deep_json(text_limits::kMaxJsonDepth - 1, false)}};
  std::string want = repeat("[", text_limits::kMaxJsonDepth - 1) + "1" +
                     repeat("]", text_limits::kMaxJsonDepth - 1);
  EXPECT_EQ(tpl.render(ordered_json::array(), nullptr, false, kwargs), want);
  kwargs = {{"x", deep_json(text_limits::kMaxJsonDepth, false)}};
  EXPECT_THROW(tpl.render(ordered_json::array(), nullptr, false, kwargs), Error);
  EXPECT_NO_THROW(check_json_depth(deep_json(text_limits::kMaxJsonDepth, true), "x"));
  EXPECT_THROW(check_json_depth(deep_json(text_limits::kMaxJsonDepth + 1, true), "x"), Error);
}

TEST(TextLimitsJson, DeepTemplateVariablesAreErrors) {
  ordered_json vars = ordered_json::object();
  vars["x"] = deep_json(kDeep, false);  // moved in: a copy would recurse (see above)
  expect_error([&] { jinja::Template::parse("{{ x }}", "t").render(vars); },
               {"t", "'x'", "nested more than"});
}

// Values built by the template itself, one level per loop iteration.
TEST(TextLimitsJson, DeepValuesBuiltByTheTemplateAreErrorsWhenUsed) {
  const std::string build =
      "{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}"
      "{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}";
  for (const char* use :
       {"{{ ns.x }}", "{{ ns.x | tojson }}", "{{ ns.x == ns.x }}", "{{ ns.x < ns.x }}",
        "{{ ns.x | string }}", "{{ [ns.x, ns.x] | unique | length }}", "{{ ns.x in [ns.x] }}"}) {
    expect_error([&] { render(build + use); }, {"nested more than"});
  }
  // Unused, it is only freed (which must not recurse either).
  EXPECT_EQ(render(build + "ok"), "ok");
  // Through dict.get (a method value holds its dict) and namespace attributes.
  EXPECT_EQ(
      render("{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% for j in range(3) %}"
             "{% set ns.x = {'k': ns.x}.get %}{% endfor %}{% endfor %}ok"),
      "ok");
  EXPECT_EQ(
      render("{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% for j in range(3) %}"
             "{% set ns.x = namespace(y=ns.x) %}{% endfor %}{% endfor %}ok"),
      "ok");
}

TEST(TextLimitsJson, SelfReferenceIsAnErrorNotACrash) {
  expect_error([&] { render("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}"); },
               {"nested more than"});
}

// ---- 3. Template sources ----

TEST(TextLimitsJinja, DeeplyNestedSourcesAreSyntaxErrors) {
  const size_t n = kDeep;
  const std::string sources[] = {
      "{{ " + repeat("(", n) + "1" + repeat(")", n) + " }}",
      "{{ " + repeat("[", n) + "1" + repeat("]", n) + " }}",
      "{{ " + repeat("{'a': ", n) + "1" + repeat("}", n) + " }}",
      "{{ " + repeat("not ", n) + "1 }}",
      "{{ " + repeat("-", n) + "1 }}",
      "{{ x" + repeat(".a", n) + " }}",
      "{{ x" + repeat("[0]", n) + " }}",
      "{{ x" + repeat("()", n) + " }}",
      "{{ x" + repeat("|e", n) + " }}",
      "{{ 1" + repeat(" + 1", n) + " }}",
      "{{ 1" + repeat(" ~ 1", n) + " }}",
      "{{ 1" + repeat(" if 1 else 1", n) + " }}",
      "{{ 1" + repeat(" and 1", n) + " }}",
      "{{ 2" + repeat(" ** 2", n) + " }}",
      "{{ f(" + repeat("f(", n) + repeat(")", n) + ") }}",
      repeat("{% if 1 %}", n) + repeat("{% endif %}", n),
      "{% if 0 %}" + repeat("{% elif 0 %}", n) + "{% endif %}",
      repeat("{% for i in x %}", n) + repeat("{% endfor %}", n),
      repeat("{% macro m() %}", n) + repeat("{% endmacro %}", n),
      "{% set x = " + repeat("(", n) + "1" + repeat(")", n) + " %}",
  };
  for (const auto& src : sources) {
    SCOPED_TRACE(src.substr(0, 40));
    expect_error([&] { jinja::Template::parse(src, "t"); }, {"t line 1", "nested more than"});
  }
}

TEST(TextLimitsJinja, NestingUnderTheLimitParsesAndRenders) {
  const size_t n = 100;  // deeper than any real chat template, under the limits
  EXPECT_EQ(render("{{ " + repeat("(", n) + "1" + repeat(")", n) + " }}"), "1");
  EXPECT_EQ(render("{{ " + repeat("[", n) + "1" + repeat("]", n) + " | length }}"), "1");
  EXPECT_EQ(render(repeat("{% if 1 %}", n) + "x" + repeat("{% endif %}", n)), "x");
  EXPECT_EQ(render("{{ 0" + repeat(" + 1", 500) + " }}"), "500");
  EXPECT_EQ(render("{{ ('a'" + repeat(" ~ 'a'", 499) + ") | length }}"), "500");
  EXPECT_EQ(render("{% if 0 %}" + repeat("{% elif 0 %}", n) + "{% else %}e{% endif %}"), "e");
}

TEST(TextLimitsJinja, RecursiveMacrosStopWithAnError) {
  // Unbounded self-recursion, with and without an expression in the way, and through caller().
  expect_error([&] { render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"); },
               {"RecursionError", "'f'"});
  expect_error(
      [&] {
        render(
            "{% macro f(n) %}{% if 1 %}{{ [[[f(n + 1)]]] | first | first }}{% endif %}{% endmacro "
            "%}{{ f(0) }}");
      },
      {"RecursionError"});
  expect_error(
      [&] {
        render(
            "{% macro f() %}{% call f() %}x{% endcall %}{{ caller() }}{% endmacro %}{% call f() "
            "%}y{% endcall %}");
      },
      {"RecursionError"});
  // A macro nested inside deep expressions at every level of recursion.
  const std::string deep_expr = "f(n - 1)" + repeat(" ~ ''", 900);  // evaluated 900 levels down
  expect_error(
      [&] {
        render("{% macro f(n) %}{{ " + deep_expr +
               " if n > 0 else 0 }}{% endmacro %}{{ f(1000) }}");
      },
      {"RecursionError", "nested evaluations"});
  // Bounded recursion is fine.
  EXPECT_EQ(render("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ "
                   "f(50) | length }}"),
            "91");
}

// Nested loops over the sandbox's largest range (10^10 iterations) stop at the step budget with an
// error naming it, instead of holding the process for hours (found by fuzzing the renderer). The
// budget is lowered here so that the test is quick; kMaxRenderSteps is the default.
TEST(TextLimitsJinja, LongRendersStopAtTheStepBudget) {
  jinja::RenderOptions small;
  small.max_steps = 200'000;
  auto run = [&](const std::string& src) { return jinja::Template::parse(src, "t").render(ordered_json::object(), small); };
  expect_error([&] { run("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"); },
               {"RuntimeError", "200000 evaluation steps"});
  // range() counts the items it makes: a loop of ranges is bounded too.
  expect_error([&] { run("{% for a in range(100000) %}{{ range(100000) | length }}{% endfor %}"); },
               {"evaluation steps"});
  // A render well inside the budget: 5,000 loop iterations of a message-like body.
  EXPECT_EQ(run("{% for m in range(5000) %}{% if m % 2 %}<u>{{ m }}</u>{% else %}<a>{{ m }}</a>{% endif %}"
                "{% endfor %}").size(),
            size_t(5000 * 7 + 18890));
  EXPECT_GE(text_limits::kMaxRenderSteps, 1'000'000);
}

// What an evaluation builds counts too (a step per 32 bytes of a string, per item of a list): one
// step can build 64 MB, and loops of a few hundred such steps ran for minutes inside the budget.
TEST(TextLimitsJinja, BigStringsAndListsCountAgainstTheStepBudget) {
  jinja::RenderOptions small;
  small.max_steps = 200'000;
  auto run = [&](const std::string& src) { return jinja::Template::parse(src, "t").render(ordered_json::object(), small); };
  expect_error([&] { run("{% for i in range(300) %}{% set x = 'a' * 5000000 %}{% endfor %}"); },
               {"RuntimeError", "200000 evaluation steps"});
  expect_error([&] { run("{% set s = 'a' * 2000000 %}{% for i in range(300) %}{% if s == s + '' %}{% endif %}{% endfor %}"); },
               {"evaluation steps"});
  expect_error([&] { run("{% set s = 'a' * 2000000 %}{% for i in range(300) %}{{ s | upper | length }}{% endfor %}"); },
               {"evaluation steps"});
  expect_error([&] { run("{% for i in range(300) %}{% set l = [0] * 100000 %}{% endfor %}"); }, {"evaluation steps"});
  // Referring to a big value costs nothing more; repetition (now by doubling) makes the same strings.
  EXPECT_EQ(run("{% set s = 'a' * 2000000 %}{% set ns = namespace(s=s) %}{% for i in range(1000) %}{% if s and ns.s "
                "and [s][0] %}{% endif %}{% endfor %}"),
            "");
  EXPECT_EQ(run("{{ 'ab' * 3 }}|{{ 'x' * 0 }}|{{ 3 * 'c' }}|{{ 'q' * -2 }}|{{ 'xyz' * 5 }}|{{ [1, 2] * 2 }}"),
            "ababab||ccc||xyzxyzxyzxyzxyz|[1, 2, 1, 2]");
}

// ---- 4. Numbers ----

TEST(TextLimitsJinja, BadIntegerLiteralsAreSyntaxErrors) {
  expect_error([] { render("{{ 0x }}"); }, {"TemplateSyntaxError"});
  expect_error([] { render("{{ 0b }}"); }, {"TemplateSyntaxError"});
  expect_error([] { render("{{ '\\ud800' }}"); }, {"TemplateSyntaxError", "surrogate"});
  expect_error([] { render("{{ 0xFFFFFFFFFFFFFFFFFFFF }}"); },
               {"TemplateSyntaxError", "too large"});
  expect_error([] { render("{{ 99999999999999999999 }}"); }, {"TemplateSyntaxError", "too large"});
  expect_error([] { render("{{ x.99999999999999999999 }}"); },
               {"TemplateSyntaxError", "too large"});
  expect_error([] { render("{{ '\\U00110000' }}"); }, {"TemplateSyntaxError"});
  EXPECT_EQ(
      render(
          "{{ 9223372036854775807 }}|{{ 0x7fffffffffffffff }}|{{ 0b101 }}|{{ 0o17 }}|{{ 1_000 }}"),
      "9223372036854775807|9223372036854775807|5|15|1000");
  EXPECT_EQ(render("{{ 1e400 }}|{{ -1e400 }}"), "inf|-inf");
}

TEST(TextLimitsJinja, IntegerOverflowIsAnError) {
  for (const char* src :
       {"{{ 9223372036854775807 + 1 }}", "{{ -9223372036854775807 - 2 }}",
        "{{ 4611686018427387904 * 2 }}", "{{ 3 * 3074457345618258603 }}", "{{ 2 ** 63 }}",
        "{{ 10 ** 19 }}", "{{ (-9223372036854775807 - 1) // -1 }}",
        "{{ -(-9223372036854775807 - 1) }}", "{{ (-9223372036854775807 - 1) | abs }}",
        "{{ [9223372036854775807, 1] | sum }}", "{{ 1e300 | int }}",
        "{{ '99999999999999999999' | int }}", "{{ '%d' % 1e300 }}"}) {
    SCOPED_TRACE(src);
    expect_error([&] { render(src); }, {"OverflowError"});
  }
  // Python's answers where they fit.
  EXPECT_EQ(
      render("{{ 2 ** 62 }}|{{ (-2) ** 63 }}|{{ 1 ** 9223372036854775807 }}|{{ (-1) ** "
             "9223372036854775807 }}|"
             "{{ 0 ** 9223372036854775807 }}|{{ 2 ** -1 }}|{{ (-9223372036854775807 - 1) % -1 }}|"
             "{{ (-9223372036854775807 - 1) // 1 }}|{{ '-9223372036854775808' | int }}|{{ '12' | "
             "int(base=99) }}"),
      "4611686018427387904|-9223372036854775808|1|-1|0|0.5|0|-9223372036854775808|-"
      "9223372036854775808|12");
}

TEST(TextLimitsJinja, ExponentDoesNotLoop) {
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(render("{{ 1 ** 9223372036854775807 }}"), "1");
  expect_error([] { render("{{ 3 ** 9223372036854775807 }}"); }, {"OverflowError"});
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.0);
}

TEST(TextLimitsJinja, HugeSizesFromUserNumbersAreErrors) {
  for (const char* src :
       {"{{ 'x' * 1000000000000 }}", "{{ 1000000000000 * 'ab' }}", "{{ [1] * 1000000000000 }}",
        "{{ 'x' | center(1000000000000) }}", "{{ 'x'.center(1000000000000) }}",
        "{{ 'x'.ljust(1000000000000) }}", "{{ 'x'.rjust(1000000000000) }}",
        "{{ 'x'.zfill(1000000000000) }}", "{{ 'x' | indent(1000000000000) }}",
        "{{ [1] | tojson(indent=1000000000000) }}", "{{ [1] | batch(1000000000000, 0) }}",
        "{{ range(1000000000000) | length }}"}) {
    SCOPED_TRACE(src);
    try {
      render(src);
      ADD_FAILURE() << "no error";
    } catch (const jinja::TemplateError& e) {
      EXPECT_NE(e.type(), "") << e.what();
      EXPECT_EQ(std::string(e.what()).find("internal error"), std::string::npos) << e.what();
    }
  }
  // Doubling a string in a loop stops at the size limit instead of exhausting memory.
  expect_error(
      [] {
        render(
            "{% set ns = namespace(s='x') %}{% for i in range(80) %}{% set ns.s = ns.s ~ ns.s %}{% "
            "endfor %}");
      },
      {"MemoryError"});
  expect_error(
      [] {
        render(
            "{% set ns = namespace(s=['x']) %}{% for i in range(80) %}{% set ns.s = ns.s + ns.s "
            "%}{% endfor %}");
      },
      {"MemoryError"});
}

TEST(TextLimitsJinja, HugeArgumentsWithCheapAnswersGetThem) {
  EXPECT_EQ(render("{{ 'abc' | truncate(99999999999999999) }}"), "abc");
  EXPECT_EQ(render("{{ 'abc' | truncate(9223372036854775807) }}"), "abc");
  EXPECT_EQ(render("{{ 'abc' | truncate(9223372036854775807, leeway=9223372036854775807) }}"),
            "abc");
  EXPECT_EQ(render("{{ 'abc' * -9223372036854775807 }}|{{ 'ab'.center(-5) }}"), "|ab");
  EXPECT_EQ(
      render("{{ [1, 2, 3][0::9223372036854775807] }}|{{ [1, 2, 3][::-9223372036854775807] }}|"
             "{{ 'abc'[1::9223372036854775807] }}|{{ [1, 2, "
             "3][-9223372036854775807:9223372036854775807] }}"),
      "[1]|[3]|b|[1, 2, 3]");
  EXPECT_EQ(render("{{ [{'0': 1}] | map(attribute='99999999999999999999') | list }}"),
            "[Undefined]");
  expect_error([] { render("{{ '{99999999999999999999}'.format(1) }}"); },
               {"ValueError", "Too many decimal digits"});
}

// ---- 2. tokenizer.json ----

class TempDir {
 public:
  TempDir()
      : path_(fs::temp_directory_path() / ("moestream_limits_" + std::to_string(::getpid()))) {
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string str() const { return path_.string(); }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name) << text;
  }

 private:
  fs::path path_;
};

std::string toy_tokenizer_with(const std::string& field, const std::string& value) {
  return "{\"version\": \"1.0\", \"added_tokens\": [], \"" + field + "\": " + value +
         ", \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \" \": 1, \" b\": 2, \"b\": 3}, "
         "\"merges\": []," +
         " \"ignore_merges\": true}}";
}

TEST(TextLimitsTokenizer, DeeplyNestedComponentsAreErrorsNamingFileAndField) {
  struct Nest {
    const char* field;
    const char* list;
  };
  for (Nest n : {Nest{"normalizer", "normalizers"}, Nest{"pre_tokenizer", "pretokenizers"},
                 Nest{"decoder", "decoders"}, Nest{"post_processor", "processors"}}) {
    std::string open = std::string("{\"type\": \"Sequence\", \"") + n.list + "\": [";
    std::string value = repeat(open, 50000) + repeat("]}", 50000);
    TempDir dir;
    dir.write("tokenizer.json", toy_tokenizer_with(n.field, value));
    expect_error([&] { Tokenizer::load(dir.str()); },
                 {dir.str() + "/tokenizer.json", n.field, "nested more than"});
  }
  // Nested plain arrays anywhere in the file.
  TempDir dir;
  dir.write("tokenizer.json", toy_tokenizer_with("extra", repeat("[", kDeep) + repeat("]", kDeep)));
  expect_error([&] { Tokenizer::load(dir.str()); },
               {"tokenizer.json", "extra", "nested more than"});
}

TEST(TextLimitsTokenizer, ShallowSequencesStillLoad) {
  std::string seq =
      "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Sequence\", \"pretokenizers\": "
      "[]}]}";
  TempDir dir;
  dir.write("tokenizer.json", toy_tokenizer_with("pre_tokenizer", seq));
  auto tok = Tokenizer::load(dir.str());
  EXPECT_EQ(tok->encode("a"), std::vector<int32_t>{0});
}

// ---- 5. Long whitespace ----

// The Qwen2/Qwen3 (and Llama 3 / GPT-4 style) split pattern over a toy vocab without merges: every
// space is its own token, so the expected ids follow from the split alone, which a long run of
// whitespace must not change: "a" + N spaces + "b" is "a", N - 1 spaces, " b" as for small N.
TEST(TextLimitsTokenizer, QwenPatternSplitsLongWhitespaceLikeShortWhitespace) {
  const std::string qwen =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  json pre = {{"type", "Split"},
              {"pattern", {{"Regex", qwen}}},
              {"behavior", "Isolated"},
              {"invert", false}};
  TempDir dir;
  dir.write("tokenizer.json", toy_tokenizer_with("pre_tokenizer", pre.dump()));
  auto tok = Tokenizer::load(dir.str());
  for (size_t n : {size_t(3), size_t(12) << 20}) {
    std::vector<int32_t> want{0};
    want.insert(want.end(), n - 1, 1);
    want.push_back(2);
    EXPECT_EQ(tok->encode("a" + std::string(n, ' ') + "b"), want) << n << " spaces";
    want.assign(n, 1);
    EXPECT_EQ(tok->encode(std::string(n, ' ')), want) << n << " spaces";
  }
}

// The same on the real tokenizer, with merges (1 MiB keeps it quick: BPE of one long word is
// the slow part; the toy test above is the one past PCRE2's default limit).
TEST(TextLimitsTokenizer, Qwen3EncodesAMegabyteOfWhitespace) {
  const char* env = std::getenv("MOESTREAM_QWEN3_TOKENIZER");
  std::string dir = env ? env : MOESTREAM_SOURCE_DIR "/.cache/tokenizer-qwen3";
  ASSERT_TRUE(fs::exists(fs::path(dir) / "tokenizer.json")) << "run scripts/setup";
  auto tok = Tokenizer::load(dir);
  // A run of spaces is one pre-tokenized word whatever its length (10 spaces are token 1843 in
  // the Hugging Face reference, qwen3_refs.json); with the text around it, three words.
  ASSERT_EQ(tok->encode(std::string(10, ' ')), std::vector<int32_t>{1843});
  const std::string text = "x" + std::string(1 << 20, ' ') + "\ny";
  auto start = std::chrono::steady_clock::now();
  auto ids = tok->encode(text);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[ info ] 1 MiB of spaces: " << ids.size() << " tokens in " << seconds << " s\n";
  EXPECT_EQ(tok->decode(ids), text);
  // "x", the spaces (one word: "\s*[\r\n]+" takes them together with the newline), "y".
  auto spaces = tok->encode(std::string(1 << 20, ' ') + "\n");
  std::vector<int32_t> want = tok->encode("x");
  want.insert(want.end(), spaces.begin(), spaces.end());
  auto y = tok->encode("y");
  want.insert(want.end(), y.begin(), y.end());
  EXPECT_EQ(ids, want);
}

// A sequence cut off by the end of the text is one byte, never read past the end.
TEST(TextLimitsUnicode, TruncatedSequenceStaysInsideTheText) {
  const std::string euro = "\xE2\x82\xAC";
  for (size_t len : {size_t(1), size_t(2)}) {
    size_t pos = 0;
    EXPECT_EQ(unicode::next_code_point(std::string_view(euro).substr(0, len), pos), char32_t(0xE2));
    EXPECT_EQ(pos, 1u);
  }
  size_t pos = 0;
  EXPECT_EQ(unicode::next_code_point(euro, pos), char32_t(0x20AC));
  EXPECT_EQ(pos, 3u);
}

// ---- 6. Sampler ----

TEST(TextLimitsSampler, NanAndInfLogitsAreErrors) {
  for (float temperature : {0.0f, 0.8f}) {
    SamplingParams p;
    p.temperature = temperature;
    Sampler s(p);
    std::vector<float> l{0.5f, std::nanf(""), 1.0f};
    expect_error([&] { s.sample(l, {}); }, {"logits contain NaN", "token id 1"});
    l = {0.5f, 1.0f, std::numeric_limits<float>::infinity()};
    expect_error([&] { s.sample(l, {}); }, {"logits contain Inf", "token id 2"});
    float ninf = -std::numeric_limits<float>::infinity();
    l = {ninf, ninf, ninf};
    expect_error([&] { s.sample(l, {}); }, {"all logits are -inf"});
    // Masked tokens (-inf) next to finite ones are fine.
    l = {ninf, 1.0f, ninf};
    EXPECT_EQ(s.sample(l, {}), 1);
  }
  Sampler empty(SamplingParams{});
  std::vector<float> none;
  expect_error([&] { empty.sample(none, {}); }, {"empty"});
}

// One pass over a Qwen3-sized vocabulary per token: microseconds, next to milliseconds of forward.
TEST(TextLimitsSampler, LogitCheckIsCheap) {
  std::vector<float> l(151936);
  for (size_t i = 0; i < l.size(); ++i) l[i] = float(i % 1000) * 0.01f - 5.0f;
  const int reps = 200;
  auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) check_logits(l);
  double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() /
      reps;
  std::cout << "[ info ] check_logits over 151936 logits: " << us << " us\n";
  EXPECT_LT(us, 1000.0);
}

}  // namespace
}  // namespace moestream
