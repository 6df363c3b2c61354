// Unit tests of the Jinja interpreter (src/text/jinja*.cpp). The expected outputs are what jinja2
// 3.1 renders in the environment transformers uses (ImmutableSandboxedEnvironment, trim_blocks,
// lstrip_blocks, loopcontrols, transformers' tojson and raise_exception): Python's str() of values,
// floor division and modulo of negatives, code-point string indexing, whitespace control, loop
// variables, scoping of set inside loops, macros, filters, tests and str/dict/list methods.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "text/jinja.h"

namespace moestream::jinja {
namespace {

std::string render(const std::string& src, const std::string& vars = "{}") {
  return Template::parse(src, "t").render(nlohmann::ordered_json::parse(vars));
}

struct Case {
  const char* group;
  const char* source;
  const char* vars;  // JSON object
  const char* expected;
};

// clang-format off
const Case kCases[] = {
    {"expr", R"J({{ 1 + 2 * 3 }}|{{ (1 + 2) * 3 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7 % 3 }}|{{ -7 % 3 }}|{{ 7 / 2 }}|{{ 2 ** 10 }})J",
     R"J({})J",
     R"J(7|9|3|-4|1|2|3.5|1024)J"},
    {"expr", R"J({{ 1 == 1.0 }}|{{ 1 < 2 < 3 }}|{{ 3 > 2 > 2 }}|{{ 'a' ~ 1 ~ none }}|{{ 'ab' * 3 }}|{{ [1] + [2, 3] }})J",
     R"J({})J",
     R"J(True|True|False|a1None|ababab|[1, 2, 3])J"},
    {"expr", R"J({{ 'x' if flag else 'y' }}|{{ 'x' if not flag }}|{{ flag and 'a' or 'b' }}|{{ none or 0 or '' or 'last' }})J",
     R"J({"flag": false})J",
     R"J(y|x|b|last)J"},
    {"expr", R"J({{ 'bc' in 'abcd' }}|{{ 2 in [1, 2] }}|{{ 'k' in {'k': 1} }}|{{ 'z' not in 'abc' }}|{{ 'x' in missing }})J",
     R"J({})J",
     R"J(True|True|True|True|False)J"},
    {"expr", R"J({{ s[0] }}{{ s[-1] }}|{{ s[1:3] }}|{{ s[::-1] }}|{{ s[::2] }}|{{ s[-2:] }}|{{ s[:-2] }}|{{ l[::-1] }}|{{ l[1:] }}|{{ l[5:] }})J",
     R"J({"s": "héllo", "l": [1, 2, 3]})J",
     R"J(ho|él|olléh|hlo|lo|hél|[3, 2, 1]|[2, 3]|[])J"},
    {"expr", R"J({{ 'a\tb\n' }}|{{ "it's" }}|{{ '\u00e9\x41' }}|{{ 'a' 'b' }}|{{ 'don\'t' }})J",
     R"J({})J",
     R"J(a	b
|it's|éA|ab|don't)J"},
    {"expr", R"J({{ 1.5 }}|{{ 1e-7 }}|{{ 1e16 }}|{{ 10.0 }}|{{ 0.1 + 0.2 }}|{{ 3 / 1 }}|{{ -0.0 }}|{{ 123456789.125 }})J",
     R"J({})J",
     R"J(1.5|1e-07|1e+16|10.0|0.30000000000000004|3.0|-0.0|123456789.125)J"},
    {"str", R"J({{ true }}|{{ none }}|{{ [1, 'a', none, true, 2.5] }}|{{ {'a': 1, 'b': ["x"]} }}|{{ d }}|{{ "it's" | string }}|{{ ['it\'s', 'say "hi"', 'both \' "'] }})J",
     R"J({"d": {"k": "v", "n": null, "u": "é\n"}})J",
     R"J(True|None|[1, 'a', None, True, 2.5]|{'a': 1, 'b': ['x']}|{'k': 'v', 'n': None, 'u': 'é\n'}|it's|["it's", 'say "hi"', 'both \' "'])J"},
    {"str", R"J({{ x }}|{{ x is defined }}|{{ d.missing }}|{{ d['missing'] }}|{{ l[10] }}|{{ x | default('dflt') }}|{{ '' | default('e', true) }}|{{ none | d('nd') }})J",
     R"J({"d": {}, "l": []})J",
     R"J(|False||||dflt|e|None)J"},
    {"ws", R"J(<ul>
{% for i in [1, 2] %}
    <li>{{ i }}</li>
{% endfor %}
</ul>
)J",
     R"J({})J",
     R"J(<ul>
    <li>1</li>
    <li>2</li>
</ul>)J"},
    {"ws", R"J(a  {%- if true -%}  b  {%- endif -%}  c
  {{- ' d ' -}}  e)J",
     R"J({})J",
     R"J(abc d e)J"},
    {"ws", R"J(x
    {% if true %}
    y
    {% endif %}
  {{ 'z' }}
{# comment #}
{#- c2 -#}  w
)J",
     R"J({})J",
     R"J(x
    y
  z
w)J"},
    {"ws", R"J({% raw %}{{ not }} {% a tag %}{% endraw %}|{%+ if true %}k{% endif +%}
|  {%+ if true %}p{% endif %})J",
     R"J({})J",
     R"J({{ not }} {% a tag %}|k
|  p)J"},
    {"ws", R"J(line1
{%- set x = 1 %}
  {{ x }}  
{% macro m() %}
  body
{% endmacro %}
[{{ m() }}]
)J",
     R"J({})J",
     R"J(line1  1  
[  body
])J"},
    {"loop", R"J({% for x in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %})J",
     R"J({"l": ["a", "b", "c"]})J",
     R"J(1032TrueFalse3;2121FalseFalse3;3210FalseTrue3;)J"},
    {"loop", R"J({% for x in l %}{{ loop.previtem | default('-') }}{{ x }}{{ loop.nextitem | default('-') }} {% endfor %})J",
     R"J({"l": [1, 2, 3]})J",
     R"J(-12 123 23- )J"},
    {"loop", R"J({% for x in l if x > 1 %}{{ x }}:{{ loop.index }}/{{ loop.length }} {% else %}empty{% endfor %}|{% for x in [] %}x{% else %}none{% endfor %})J",
     R"J({"l": [1, 2, 3]})J",
     R"J(2:1/2 3:2/2 |none)J"},
    {"loop", R"J({% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 4 %}{% break %}{% endif %}{{ x }}{% endfor %})J",
     R"J({})J",
     R"J(0134)J"},
    {"loop", R"J({% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{% for k in d %}{{ k }}{% endfor %}|{% for c in 'hé' %}[{{ c }}]{% endfor %})J",
     R"J({"d": {"b": 1, "a": 2}})J",
     R"J(b=1;a=2;|ba|[h][é])J"},
    {"loop", R"J({% for i in [1,2] %}{% for j in 'ab' %}{{ loop.index }}{{ j }}{% endfor %}{{ loop.index }} {% endfor %}|{% for x in [1,2,3] %}{{ loop.cycle('a','b') }}{% endfor %})J",
     R"J({})J",
     R"J(1a2b1 1a2b2 |aba)J"},
    {"scope", R"J({% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}|{% if true %}{% set y = 3 %}{% endif %}{{ y }})J",
     R"J({})J",
     R"J(21|3)J"},
    {"scope", R"J({% set ns = namespace(n=0, s='') %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.n }} {{ ns.s }})J",
     R"J({})J",
     R"J(6 123)J"},
    {"scope", R"J({% set a, b = [1, 2] %}{{ b }}{{ a }}|{% set blk %}inner {{ a }}{% endset %}[{{ blk }}]|{% set t | upper %}shout{% endset %}{{ t }})J",
     R"J({})J",
     R"J(21|[inner 1]|SHOUT)J"},
    {"scope", R"J({% with q = 5 %}{{ q }}{% endwith %}[{{ q }}]|{% set ns = namespace() %}{% set ns.z = 'zz' %}{{ ns.z }})J",
     R"J({})J",
     R"J(5[]|zz)J"},
    {"macro", R"J({% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Bo') }} {{ greet('Al', punct='?') }} {{ greet(name='X') }})J",
     R"J({})J",
     R"J(Hi Bo! Hi Al? Hi X!)J"},
    {"macro", R"J({% macro wrap() %}<{{ caller() }}>{% endmacro %}{% call wrap() %}inside{% endcall %}|{% macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(3) }})J",
     R"J({})J",
     R"J(<inside>|321)J"},
    {"macro", R"J({% macro v() %}{{ varargs | join(',') }}{{ kwargs }}{% endmacro %}{{ v(1, 2, a=3) }}|{% macro g() %}{{ top }}{% endmacro %}{% set top = 'T' %}{{ g() }}|{% macro m(x) %}{{ x is defined }}{% endmacro %}{{ m() }})J",
     R"J({})J",
     R"J(1,2{'a': 3}|T|False)J"},
    {"filter", R"J({{ '  pad  ' | trim }}|{{ 'xxaxx' | trim('x') }}|{{ l | length }}|{{ 'héllo' | length }}|{{ d | length }}|{{ l | count }}|{{ l | first }}|{{ l | last }}|{{ l | join(', ') }}|{{ l | join }})J",
     R"J({"l": [3, 1, 2], "d": {"a": 1}})J",
     R"J(pad|a|3|5|1|3|3|2|3, 1, 2|312)J"},
    {"filter", R"J({{ 'Hello World' | upper }}|{{ 'Hello' | lower }}|{{ 'hello world-foo' | title }}|{{ 'hELLO wORLD' | capitalize }}|{{ 'a-b-c' | replace('-', '+') }}|{{ 'aaa' | replace('a', 'b', 2) }})J",
     R"J({})J",
     R"J(HELLO WORLD|hello|Hello World-Foo|Hello world|a+b+c|bba)J"},
    {"filter", R"J({{ 42 | string }}|{{ '12' | int + 1 }}|{{ '3.7' | int }}|{{ 'x' | int }}|{{ '2.5' | float }}|{{ 3 | float }}|{{ 2.567 | round(2) }}|{{ 2.5 | round }}|{{ 3.5 | round }}|{{ 2.1 | round(0, 'ceil') }}|{{ -3 | abs }})J",
     R"J({})J",
     R"J(42|13|3|0|2.5|3.0|2.57|2.0|4.0|3.0|3)J"},
    {"filter", R"J({{ l | list }}|{{ 'ab' | list }}|{{ l | sort }}|{{ l | sort(reverse=true) }}|{{ l | reverse | list }}|{{ l | unique | list }}|{{ l | sum }}|{{ l | min }}|{{ l | max }})J",
     R"J({"l": [3, 1, 2, 3]})J",
     R"J([3, 1, 2, 3]|['a', 'b']|[1, 2, 3, 3]|[3, 3, 2, 1]|[3, 2, 1, 3]|[3, 1, 2]|9|1|3)J"},
    {"filter", R"J({{ msgs | map(attribute='role') | list }}|{{ msgs | selectattr('role', 'equalto', 'user') | list | length }}|{{ msgs | rejectattr('role', 'eq', 'user') | map(attribute='content') | join }}|{{ [0, 1, '', 'a'] | select | list }}|{{ [1, 2, 3, 4] | select('odd') | list }}|{{ ['a', 'b'] | map('upper') | list }})J",
     R"J({"msgs": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]})J",
     R"J(['user', 'assistant', 'user']|2|a1|[1, 'a']|[1, 3]|['A', 'B'])J"},
    {"filter", R"J({% for k, v in d | items %}{{ k }}{{ v }}{% endfor %}|{% for k, v in d | dictsort %}{{ k }}{{ v }}{% endfor %}|{{ d.items() | list | length }}|{{ d.keys() | list }}|{{ d.values() | list }}|{{ d.get('a') }}|{{ d.get('zz', 'def') }}|{{ d.get('zz') }})J",
     R"J({"d": {"b": 2, "a": 1}})J",
     R"J(b2a1|a1b2|2|['b', 'a']|[2, 1]|1|def|None)J"},
    {"filter", R"J({{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ d | tojson(separators=(',', ':')) }}|{{ d | tojson(ensure_ascii=True) }}|{{ d | tojson(sort_keys=true) }}|{{ 'x<y' | tojson }})J",
     R"J({"d": {"z": "é\"\\\n\u0001", "a": [1, 2.0, null, true, {}], "m": []}})J",
     R"J({"z": "é\"\\\n\u0001", "a": [1, 2.0, null, true, {}], "m": []}|{
  "z": "é\"\\\n\u0001",
  "a": [
    1,
    2.0,
    null,
    true,
    {}
  ],
  "m": []
}|{"z":"é\"\\\n\u0001","a":[1,2.0,null,true,{}],"m":[]}|{"z": "\u00e9\"\\\n\u0001", "a": [1, 2.0, null, true, {}], "m": []}|{"a": [1, 2.0, null, true, {}], "m": [], "z": "é\"\\\n\u0001"}|"x<y")J"},
    {"filter", R"J({{ 'line1\nline2\n\nline4' | indent(2) }}|{{ 'a\nb' | indent(2, true) }}|{{ 'a\n\nb' | indent('> ', blank=true) }}|{{ '<a href="x">&' | e }}|{{ 'one two  three' | wordcount }}|{{ 'abc' | center(7) }}.)J",
     R"J({})J",
     R"J(line1
  line2

  line4|  a
  b|a
> 
> b|&lt;a href=&#34;x&#34;&gt;&amp;|3|  abc  .)J"},
    {"filter", R"J({{ [1, 2, 3, 4, 5] | batch(2) | list }}|{{ 'hello world' | truncate(8, leeway=0) }}|{{ '%s-%d' | format('a', 3) }}{{ '%s' | format([1, 2]) }}|{{ d | attr('x') }}|{{ none | string }}|{{ [1,2] | safe }})J",
     R"J({"d": {}})J",
     R"J([[1, 2], [3, 4], [5]]|hello...|a-3[1, 2]||None|[1, 2])J"},
    {"test", R"J({{ x is defined }}{{ y is undefined }}{{ n is none }}{{ 's' is string }}{{ 1 is number }}{{ 1.0 is number }}{{ true is number }}{{ 1 is integer }}{{ true is integer }}{{ 1.0 is float }})J",
     R"J({"x": 1, "n": null})J",
     R"J(TrueTrueTrueTrueTrueTrueTrueTrueFalseTrue)J"},
    {"test", R"J({{ {} is mapping }}{{ [] is mapping }}{{ [] is sequence }}{{ 's' is sequence }}{{ {} is iterable }}{{ 1 is iterable }}{{ none is iterable }}{{ true is boolean }}{{ true is true }}{{ 0 is false }}{{ false is false }})J",
     R"J({})J",
     R"J(TrueFalseTrueTrueTrueFalseFalseTrueTrueFalseTrue)J"},
    {"test", R"J({{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 'a' is eq 'a' }}{{ 2 is gt 1 }}{{ 1 is lt 2 }}{{ 'a' is in 'abc' }}{{ 'ab' is lower }}{{ 'AB' is upper }}{{ x is not none }}{{ f is callable }}{{ 'x'.upper is callable }})J",
     R"J({"x": 0})J",
     R"J(TrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrue)J"},
    {"method", R"J({{ s.startswith('He') }}{{ s.endswith('!') }}{{ s.startswith(('x', 'H')) }}|{{ s.split(' ') }}|{{ s.split() }}|{{ 'a,b,,c'.split(',', 1) }}|{{ 'a b c'.rsplit(' ', 1) }}|{{ '  x  '.strip() }}.{{ '  x  '.lstrip() }}.{{ '  x  '.rstrip() }}.|{{ 'xxhixx'.strip('x') }})J",
     R"J({"s": "Hello big world!"})J",
     R"J(TrueTrueTrue|['Hello', 'big', 'world!']|['Hello', 'big', 'world!']|['a', 'b,,c']|['a b', 'c']|x.x  .  x.|hi)J"},
    {"method", R"J({{ s.replace('l', 'L') }}|{{ s.upper() }}|{{ s.lower() }}|{{ 'hello wORLD 2nd'.title() }}|{{ s.find('l') }}|{{ s.find('z') }}|{{ s.rfind('l') }}|{{ s.count('l') }}|{{ 'é-é'.find('-') }}|{{ '-'.join(['a', 'b']) }}|{{ 'a\nb\r\nc'.splitlines() }})J",
     R"J({"s": "Hello"})J",
     R"J(HeLLo|HELLO|hello|Hello World 2Nd|2|-1|3|2|1|a-b|['a', 'b', 'c'])J"},
    {"method", R"J({{ '{} and {}'.format('x', 'y') }}|{{ '{0}{name}'.format('a', name='b') }}|{{ '12'.isdigit() }}{{ 'ab'.isalpha() }}{{ ' '.isspace() }}|{{ 'ab'.capitalize() }}|{{ '5'.zfill(3) }}|{{ 'a=b=c'.partition('=') | join(',') }}|{{ [1, 2, 1].count(1) }}{{ [1, 2].index(2) }})J",
     R"J({})J",
     R"J(x and y|ab|TrueTrueTrue|Ab|005|a,=,b=c|21)J"},
    {"method", R"J({{ '  a b  c  '.split(None, 1) }}|{{ '  a b  c  '.rsplit(None, 1) }}|{{ 'a b'.split(None, 0) }}|{{ 'pre-x'.removeprefix('pre-') }}{{ 'x.py'.removesuffix('.py') }}|{{ d.pop is defined }}{{ d.get is defined }}{{ l.append is defined }}|{{ '0x10' | float }}|{{ '0x10' | int }})J",
     R"J({"d": {}, "l": []})J",
     R"J(['a', 'b  c  ']|['  a b', 'c']|['a b']|xx|FalseTrueFalse|0.0|0)J"},
    {"misc", R"J({{ range(3) | list }}|{{ range(1, 7, 2) | list }}|{{ dict(a=1, b='x') }}|{% set j = joiner('+') %}{% for x in 'abc' %}{{ j() }}{{ x }}{% endfor %}|{{ messages[0]['content'] }}{{ messages[0].content }})J",
     R"J({"messages": [{"role": "user", "content": "hi"}]})J",
     R"J([0, 1, 2]|[1, 3, 5]|{'a': 1, 'b': 'x'}|a+b+c|hihi)J"},
    {"misc", R"J({%- for m in messages -%}{%- if m.role == 'user' -%}U:{{ m.content }}{%- elif m.role == 'assistant' -%}A:{{ m.content }}{%- else -%}?{%- endif -%}{%- if not loop.last %}, {% endif -%}{%- endfor -%})J",
     R"J({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "system", "content": "s"}]})J",
     R"J(U:q, A:a, ?)J"},
    {"misc", R"J({{ (1, 2) | join('-') }}|{{ () | length }}|{{ {'a': {'b': 1}} }}|{{ [1, [2, [3]]] }}|{{ {'a': {'b': 1}}.a.b }}|{{ d['items'] }})J",
     R"J({"d": {"items": 5}})J",
     R"J(1-2|0|{'a': {'b': 1}}|[1, [2, [3]]]|1|5)J"},
};
// clang-format on

TEST(Jinja, RendersLikeJinja2) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(std::string(c.group) + ": " + c.source);
    EXPECT_EQ(render(c.source, c.vars), c.expected);
  }
}

struct ErrorCase {
  const char* source;
  const char* vars;
  const char* type;     // the Python exception jinja2 raises
  const char* message;  // jinja2's message (compared for raise_exception and runtime errors)
};

// clang-format off
const ErrorCase kErrors[] = {
    {R"J(line1
{{ raise_exception('custom failure') }})J", R"J({})J", "TemplateError",
     R"J(custom failure)J"},
    {R"J({% for x in none %}{% endfor %})J", R"J({})J", "TypeError",
     R"J('NoneType' object is not iterable)J"},
    {R"J(a
b
{{ 'x' + 1 }})J", R"J({})J", "TypeError",
     R"J(can only concatenate str (not "int") to str)J"},
    {R"J({{ undefined_thing.attr }})J", R"J({})J", "UndefinedError",
     R"J('undefined_thing' is undefined)J"},
    {R"J({{ 'a' in none }})J", R"J({})J", "TypeError",
     R"J(argument of type 'NoneType' is not iterable)J"},
    {R"J({{ 1 / 0 }})J", R"J({})J", "ZeroDivisionError",
     R"J(division by zero)J"},
    {R"J({% if %})J", R"J({})J", "TemplateSyntaxError",
     R"J(Expected an expression, got 'end of statement block')J"},
    {R"J({% for x in y %})J", R"J({})J", "TemplateSyntaxError",
     R"J(Unexpected end of template. Jinja was looking for the following tags: 'endfor' or 'else'. The innermost block that needs to be closed is 'for'.)J"},
    {R"J({{ 1 +  }})J", R"J({})J", "TemplateSyntaxError",
     R"J(unexpected 'end of print statement')J"},
    {R"J({% unknowntag %})J", R"J({})J", "TemplateSyntaxError",
     R"J(Encountered unknown tag 'unknowntag'.)J"},
    {R"J({{ x | nosuchfilter }})J", R"J({})J", "TemplateAssertionError",
     R"J(No filter named 'nosuchfilter'.)J"},
    {R"J({{ [1, 2].append(3) }})J", R"J({})J", "SecurityError",
     R"J(access to attribute 'append' of 'list' object is unsafe.)J"},
};
// clang-format on

TEST(Jinja, RaisesWhereJinja2Raises) {
  for (const ErrorCase& c : kErrors) {
    SCOPED_TRACE(c.source);
    try {
      std::string out = render(c.source, c.vars);
      ADD_FAILURE() << "no error, rendered: " << out;
    } catch (const TemplateError& e) {
      EXPECT_EQ(e.type(), c.type) << e.what();
      // Syntax-error wording is our own; runtime messages follow Python's.
      if (std::string(c.type) != "TemplateSyntaxError") {
        EXPECT_EQ(e.message(), c.message) << e.what();
      }
    }
  }
}


TEST(Jinja, ErrorsNameTheTemplateLine) {
  try {
    Template::parse("line one\n{% if true %}\n  {{ raise_exception('roles must alternate') }}\n{% endif %}", "tpl")
        .render(nlohmann::ordered_json::object());
    FAIL() << "expected an error";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.line(), 3);
    EXPECT_EQ(e.type(), "TemplateError");
    EXPECT_STREQ(e.what(), "tpl line 3: roles must alternate");
  }
  try {
    Template::parse("a\nb\n{% for x in %}", "tpl");
    FAIL() << "expected a syntax error";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.type(), "TemplateSyntaxError");
    EXPECT_EQ(e.line(), 3);
  }
  try {
    render("{% for m in messages %}\n{{ m.content + 1 }}\n{% endfor %}", R"({"messages": [{"content": "x"}]})");
    FAIL() << "expected a type error";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.type(), "TypeError");
    EXPECT_EQ(e.line(), 2);
    EXPECT_NE(std::string(e.what()).find("line 2: TypeError: can only concatenate str"), std::string::npos);
  }
  // TemplateError is a moestream::Error (what the CLI and server catch).
  EXPECT_THROW(render("{{ raise_exception('x') }}"), moestream::Error);
}

TEST(Jinja, UndefinedSemantics) {
  EXPECT_EQ(render("[{{ nope }}][{{ nope | length }}][{% for x in nope %}x{% endfor %}][{{ nope is defined }}]"),
            "[][0][][False]");
  EXPECT_EQ(render("{{ d.missing is defined }}{{ d['missing'] is undefined }}{{ nope == nope }}", R"({"d": {}})"),
            "FalseTrueTrue");
  EXPECT_THROW(render("{{ nope.attr }}"), TemplateError);
  EXPECT_THROW(render("{{ nope + 1 }}"), TemplateError);
  EXPECT_THROW(render("{{ nope[0] }}"), TemplateError);
  EXPECT_THROW(render("{{ 'a' + nope }}"), TemplateError);
  EXPECT_EQ(render("{{ 'a' ~ nope ~ 'b' }}"), "ab");
}

TEST(Jinja, KeyOrderAndTypesOfJsonInput) {
  // ordered_json keeps the order given; tojson writes it back unchanged, floats as Python repr.
  const char* vars = R"({"v": {"zeta": 1, "alpha": 2.50, "mid": [1e-7, 1e16, 100.0, -0.0, 12345678901234567890]}})";
  EXPECT_EQ(render("{{ v | tojson }}", vars),
            R"({"zeta": 1, "alpha": 2.5, "mid": [1e-07, 1e+16, 100.0, -0.0, 1.2345678901234567e+19]})");
  EXPECT_EQ(render("{{ v }}", vars), "{'zeta': 1, 'alpha': 2.5, 'mid': [1e-07, 1e+16, 100.0, -0.0, 1.2345678901234567e+19]}");
  EXPECT_EQ(render("{{ v.mid[0] }} {{ v.zeta is integer }} {{ v.alpha is float }}", vars), "1e-07 True True");
}

TEST(Jinja, StringReprEscapes) {
  EXPECT_EQ(render(R"({{ [s] }})", R"({"s": "tab\t nl\n cr\r bs\\ q' zw\u200d nb\u00a0 e\u00e9 ctl\u0001 del\u007f"})"),
            R"(["tab\t nl\n cr\r bs\\ q' zw\u200d nb\xa0 eé ctl\x01 del\x7f"])");
  EXPECT_EQ(render(R"({{ ['plain', 'both \' "'] }})"), R"(['plain', 'both \' "'])");
}

TEST(Jinja, RendersConcurrently) {
  Template t = Template::parse(
      "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length %}"
      "{{ loop.index }}:{{ m.content | upper }};{% endfor %}{{ ns.n }}",
      "t");
  std::vector<std::thread> threads;
  std::vector<std::string> outs(8);
  for (int k = 0; k < 8; ++k) {
    threads.emplace_back([&, k] {
      nlohmann::ordered_json vars = {{"messages", nlohmann::ordered_json::array()}};
      for (int i = 0; i <= k; ++i) vars["messages"].push_back({{"content", std::string(size_t(i + 1), 'a')}});
      for (int rep = 0; rep < 200; ++rep) outs[size_t(k)] = t.render(vars);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(outs[0], "1:A;1");
  EXPECT_EQ(outs[2], "1:A;2:AA;3:AAA;6");
}

TEST(Jinja, StrftimeNowUsesTheGivenTime) {
  RenderOptions o;
  std::tm tm{};
  tm.tm_year = 2026 - 1900;
  tm.tm_mon = 0;
  tm.tm_mday = 15;
  tm.tm_hour = 12;
  tm.tm_isdst = -1;
  o.now = std::mktime(&tm);
  EXPECT_EQ(Template::parse("{{ strftime_now('%Y-%m-%d %H') }}").render(nlohmann::ordered_json::object(), o),
            "2026-01-15 12");
}

}  // namespace
}  // namespace moestream::jinja
