// Bounds on what the text side accepts, in one place. Each input below comes from a user (request
// JSON) or from model files, and each was once enough to crash or wedge the process: recursion
// over nesting without a bound overflows the stack, and sizes taken from user numbers can ask for
// terabytes. Real inputs stay far below every limit; the values say how far.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string_view>

namespace moestream::text_limits {

// Containers nested in JSON handed to a chat template (messages, tools, chat_template_kwargs,
// tool-call arguments), counting the outermost. Real tool schemas nest 10-20 levels.
inline constexpr int kMaxJsonDepth = 128;

// Containers nested in a template value while printing, comparing or serializing it. Values from
// JSON are at most kMaxJsonDepth deep; a template wraps them in a few more levels at most.
inline constexpr int kMaxValueDepth = 512;

// Nesting in a template source: brackets, unary operators, if/for/macro blocks, elif chains, and
// the depth of an expression tree (a chain a.b.c or 1 + 2 + 3 is one level per link). Chat
// templates nest under 10 levels and chain under 50; jinja2 itself (compiling to Python) fails
// near 1000.
inline constexpr int kMaxTemplateNesting = 256;
inline constexpr int kMaxExpressionDepth = 1000;

// Macro calls in progress (recursive macros); jinja2 hits Python's recursion limit near 300.
inline constexpr int kMaxMacroDepth = 200;

// Evaluator recursion in one render (expressions, blocks and macro calls together), so that a
// recursive macro whose body is itself deep cannot multiply the two limits above. About 1 KiB of
// stack a level in a release build and about 3 KiB under AddressSanitizer (3000 levels overflowed
// 8 MiB there): 1200 levels stay well inside the 8 MiB of a thread in both.
inline constexpr int kMaxRenderDepth = 1200;

// Evaluations (expressions and statements, plus the items range() makes) in one render: a loop
// over range(100000) inside another would run for hours. A chat template takes ~100 steps a
// message plus ~1,000 for its tools (a 10,000-message conversation with tools is ~1-2M steps); at
// the 1-3M steps a second measured on the 2-core machine this bounds a render to a few seconds.
inline constexpr int64_t kMaxRenderSteps = 5'000'000;

// The largest string a template may build (by repetition, padding, concatenation or output) and
// the most items in a list it builds by repetition or concatenation. A 1M-token conversation is
// about 5 MB; templates build lists of a few items (a value is 24 bytes: 1M items is 24 MB).
inline constexpr size_t kMaxStringBytes = size_t(64) << 20;
inline constexpr size_t kMaxListItems = size_t(1) << 20;

// The bytes one render builds in all: the strings it makes (output included), the slots of the
// lists and dicts it makes, and the temporary copies its builtins make of big values, each
// counted before it is built. Chains of `| join(sep)` over strings multiply a length by the
// separator's at every link, and iterating a string makes a value of ~100 bytes per character:
// the 10M-execution fuzz run found 700-byte templates that reached 5 GB before the step budget,
// which counts what was built after it is built, saw them. A chat template builds a few times its
// output (a 1M-token conversation is ~5 MB), and the step budget already stops a render near
// 160 MB of strings; this bounds a render's memory whatever it builds (peak RSS of the fuzz
// target ~150 MB) and its time (such a render is ~2 s of CPU in the -O1 fuzz build).
inline constexpr uint64_t kMaxRenderBytes = uint64_t(128) << 20;

// PCRE2's match limit (backtracking steps per match attempt) for the tokenizer's split patterns:
// PCRE2's default of 10M plus this many per byte of the text left to scan. The GPT-4 / Qwen
// pattern backtracks once per character of a whitespace run (\s*[\r\n]+ gives back the whole
// run before \s+(?!\S) takes it), so a fixed limit rejected long whitespace; a linear pattern
// needs a few steps a byte, while a catastrophic one still stops.
inline constexpr uint64_t kRegexBaseMatchLimit = 10'000'000;
inline constexpr uint64_t kRegexMatchStepsPerByte = 16;

// Token ids in tokenizer.json (vocab and added tokens). Tables indexed by id are sized by the
// largest one; the largest real vocabularies have about 262k tokens, and 2^24 ids keep such a
// table at 64 MB (the 10M-execution fuzz run found ids near 2^31 asking for gigabytes).
inline constexpr int64_t kMaxTokenId = (int64_t(1) << 24) - 1;

// Containers nested in tokenizer.json. Real files nest 6 levels (post_processor.special_tokens).
inline constexpr int kMaxTokenizerJsonDepth = 64;

}  // namespace moestream::text_limits

namespace moestream {

// Throws Error "<what> is nested more than 128 levels deep" when `j` has more than kMaxJsonDepth
// nested containers (an empty or scalar value is depth 0). Does not recurse. The server may call
// it right after parsing a request, before copying the JSON (nlohmann's copy recurses).
void check_json_depth(const nlohmann::ordered_json& j, std::string_view what);
void check_json_depth(const nlohmann::json& j, std::string_view what);

}  // namespace moestream
