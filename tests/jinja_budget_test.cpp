// The render's budget of bytes built (text_limits::kMaxRenderBytes): every builder of the Jinja
// interpreter charges what it is about to build before building it. The 10M-execution fuzz run
// found templates of a few hundred bytes (fuzz/findings/jinja/oom-*) that reached 2-6 GB first:
// chains of `| join(sep)` over strings, each link multiplying the length by the separator's, and
// iterating a string, a value of ~100 bytes a character. Each test below is the pattern, minimized;
// the sizes the templates ask for are gigabytes to petabytes, so a builder that built before it
// charged would exhaust the machine, not pass.
#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "text/jinja.h"
#include "text/limits.h"

namespace moestream {
namespace {

using nlohmann::ordered_json;

std::string render(const std::string& src, uint64_t max_bytes = 0) {
  jinja::RenderOptions o;
  o.max_bytes = max_bytes;
  return jinja::Template::parse(src, "t").render(ordered_json::object(), o);
}

// src must stop with the budget's MemoryError, quickly (before the budget, these took minutes and
// gigabytes, or exhausted the memory).
void expect_over_budget(const std::string& src, uint64_t max_bytes = 0) {
  SCOPED_TRACE(src);
  const auto start = std::chrono::steady_clock::now();
  try {
    render(src, max_bytes);
    ADD_FAILURE() << "no error";
  } catch (const jinja::TemplateError& e) {
    const uint64_t limit = max_bytes ? max_bytes : text_limits::kMaxRenderBytes;
    EXPECT_EQ(e.type(), "MemoryError") << e.what();
    EXPECT_NE(std::string(e.what()).find("render stopped: the template builds more than " + std::to_string(limit) +
                                         " bytes of strings and lists"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
}

// The fuzz findings' pattern: '...'.format(...) | join(sep) | join(sep, attribute) | ... .
TEST(JinjaBudget, JoinChainsOverStringsStopBeforeTheyBuild) {
  const std::string s = "('x' * 700)";
  expect_over_budget("{{ " + s + " | join('&' * 300) | join('&' * 30) | join('&' * 35) | join(',') }}");
  // With an attribute, every character's lookup is '' and only the separators remain.
  expect_over_budget("{{ " + s + " | join('&' * 300, 'a') | join('&' * 300, 'b') | join(',') }}");
  expect_over_budget("{{ '{} and {}'.format('x', 'y' * 700) | join(',' * 300) | join(',' * 300) | join(',') }}");
  // str.join over a string, and the join of a caller() block's output.
  expect_over_budget("{{ ('&' * 300).join('x' * 700) | join('&' * 300) | join(',') }}");
  expect_over_budget(
      "{% macro wrap() %}{{ caller() | join('&' * 300) | join(',') }}{% endmacro %}"
      "{% call wrap() %}{{ ('x' * 700) | join('&' * 300) }}{% endcall %}");
  // batch over the characters of a big string: a list of lists.
  expect_over_budget("{{ ('x' * 700) | join('&' * 30000) | batch(3) | length }}");
}

// Printing, serializing or formatting a value that holds one string many times (shared, so the
// value itself is small) builds far more than the value: 2^40 copies of 1000 bytes here. (A budget
// of 8 MB keeps the test quick; at the default, one string's 64 MB limit, also checked before
// each piece is appended, comes first.)
TEST(JinjaBudget, SharedValuesPrintWithinTheBudget) {
  const std::string grow =
      "{% set ns = namespace(a=['x' * 1000]) %}{% for i in range(40) %}{% set ns.a = [ns.a, ns.a] %}{% endfor %}";
  expect_over_budget(grow + "{{ ns.a }}", 8 << 20);
  expect_over_budget(grow + "{{ ns.a | tojson }}", 8 << 20);
  expect_over_budget(grow + "{{ ns.a | string | length }}", 8 << 20);
  expect_over_budget(grow + "{{ '%s' % [ns.a] }}", 8 << 20);
  expect_over_budget(grow + "{{ ns.a | join(',') }}", 8 << 20);
  expect_over_budget(grow + "{{ {'k': ns.a} }}", 8 << 20);
  expect_over_budget(grow + "{{ ns }}", 8 << 20);
  expect_over_budget(grow + "{{ ns.a | tojson(indent=2) }}", 8 << 20);
}

// Builders that multiply what they are given, each asked for more than the budget in one step.
TEST(JinjaBudget, EveryBuilderChargesBeforeItBuilds) {
  const uint64_t mb = 1 << 20;
  const std::string s = "{% set s = 'ab' * 300000 %}";  // 600 KB; each template below builds > 1 MB more
  for (const char* src : {
           "{{ s ~ s }}",
           "{{ s + s }}",
           "{{ s * 2 }}",
           "{{ ([s] * 2) | join }}",
           "{{ '%s%s' % (s, s) }}",
           "{{ '%s%s' | format(s, s) }}",
           "{{ '{0}{0}'.format(s) }}",
           "{{ s | replace('a', 'aaa') }}",
           "{{ s.replace('', '-') }}",
           "{{ s | center(1500000) }}",
           "{{ s.ljust(1500000) }}",
           "{{ s.zfill(1500000) }}",
           "{{ s | indent(1) }}",
           "{{ s | list | length }}",
           "{{ s.split('a') | length }}",
           "{{ s | batch(2) | length }}",
           "{{ s | upper | lower }}",
           "{{ s | title | capitalize }}",
           "{{ s | escape | escape }}",
           "{{ s | reverse | reverse }}",
           "{{ s[::-1][::-1] }}",
           "{{ s | tojson | tojson }}",
           "{{ [s, s] }}",
           "{{ {'a': s, 'b': s} | tojson }}",
           "{% for i in range(3) %}{{ s }}{% endfor %}",
           "{% filter upper %}{{ s }}{{ s }}{% endfilter %}",
           "{% set t %}{{ s }}{{ s }}{% endset %}",
           "{% macro m() %}{{ s }}{{ s }}{% endmacro %}{{ m() }}",
       }) {
    expect_over_budget(s + src, mb);
  }
  // Within the budget the same builders give jinja2's answers.
  EXPECT_EQ(render("{{ 'ab' | join('-') }}|{{ '%s%s' % ('a', 'b') }}|{{ '{0}{0}'.format('x') }}|{{ 'ab'.replace('', '-') }}|"
                   "{{ 'ab' | center(6) }}|{{ ['a', ['b']] }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'héllo'[1:3] }}|"
                   "{{ 'héllo'[1] }}|{{ 'héllo' | truncate(4, true, '', 0) }}|{{ range(5, 0, -2) | list }}",
                   mb),
            "a-b|ab|xx|-a-b-|  ab  |['a', ['b']]|  a\n  b|él|é|héll|[5, 3, 1]");
}

// The output counts too, and what a render may build in all is the limit, not one string's.
TEST(JinjaBudget, TheBudgetIsPerRender) {
  // 100 blocks of 5 MB: each under one string's limit, 500 MB in all.
  expect_over_budget("{% set s = 'x' * 5000000 %}{% for i in range(100) %}{% set t %}{{ s }}{% endset %}{% endfor %}");
  // Each render starts afresh: the same template renders again.
  const auto t = jinja::Template::parse("{% for i in range(5) %}{{ 'x' * 100000 }}{% endfor %}", "t");
  jinja::RenderOptions o;
  o.max_bytes = 1 << 20;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(t.render(ordered_json::object(), o).size(), 500000u);
  EXPECT_GE(text_limits::kMaxRenderBytes, uint64_t(64) << 20);  // at least one string's limit
}

// Loops whose body costs no statement count an evaluation step an iteration: 10^10 iterations of
// two nested loops over one big list ran for hours inside the step budget.
TEST(JinjaBudget, EmptyLoopsCountSteps) {
  jinja::RenderOptions o;
  o.max_steps = 300'000;  // range(100000) costs 200,000 (its items, then the list built)
  try {
    jinja::Template::parse("{% set l = range(100000) %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}", "t")
        .render(ordered_json::object(), o);
    ADD_FAILURE() << "no error";
  } catch (const jinja::TemplateError& e) {
    EXPECT_NE(std::string(e.what()).find("300000 evaluation steps"), std::string::npos) << e.what();
  }
  // unique compares an item with every one kept: 100,000 distinct items, 5 * 10^9 comparisons.
  try {
    jinja::Template::parse("{{ range(100000) | unique | length }}", "t").render(ordered_json::object(), o);
    ADD_FAILURE() << "no error";
  } catch (const jinja::TemplateError& e) {
    EXPECT_NE(std::string(e.what()).find("evaluation steps"), std::string::npos) << e.what();
  }
}

// Builtins that read a big value without building anything count what they read: `s | length`
// of a 60 MB string in a loop of 100,000 ran for half an hour inside the step budget.
TEST(JinjaBudget, ReadsCountSteps) {
  jinja::RenderOptions o;
  o.max_steps = 400'000;  // range(100000) costs 200,000, s and u 31,250 each
  const std::string setup =
      "{% set s = 'a' * 1000000 %}{% set u = 'é' * 500000 %}{% set l = range(100000) %}{% for i in l %}";
  for (const char* body : {"{{ s | length }}", "{{ 'b' in s }}", "{{ s.find('b') }}", "{{ s.count('b') }}",
                           "{{ s == s[1:] ~ 'b' }}", "{{ -1 in l }}", "{{ l.count(-1) }}", "{{ u[-1] }}"}) {
    SCOPED_TRACE(body);
    const auto start = std::chrono::steady_clock::now();
    try {
      jinja::Template::parse(setup + body + "{% endfor %}", "t").render(ordered_json::object(), o);
      ADD_FAILURE() << "no error";
    } catch (const jinja::TemplateError& e) {
      EXPECT_NE(std::string(e.what()).find("400000 evaluation steps"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
  }
}

}  // namespace
}  // namespace moestream
