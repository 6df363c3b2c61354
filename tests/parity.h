// The parity suite: every reference fixture's logits, greedy tokens, prefill-then-decode and expert
// streaming checked against its transformers reference (ref.json, ref_logits.npy), with the checks
// and bounds that the fixture's parity.json names. A new family needs a fixture and no test code.
//
// parity.json (written by tools/parity_tolerances.py for every make_*fixtures.py script); a check
// whose key is absent is not made on that fixture (its test is not instantiated, not skipped):
//   "model_type":          the model_type the loaded model reports (text_config's in a multimodal
//                          config)
//   "logits":              {"precise": r, "default": r}  max|got - ref| / max|ref| over the logits of
//                          every position of logit_tokens (one prefill), with --precise and without
//   "prefill_then_decode": {"chunks": [n, ...], "max_rel_error": r}  logit_tokens fed as chunks of
//                          these sizes, then one token at a time, against one whole-sequence forward
//   "cli_greedy":          ["--precise", ""]  `moestream run --temp 0` in each of these modes prints
//                          greedy_tokens after prompt_tokens
//   "cli_logits":          {"max_rel_error": r}  `moestream logits --precise` writes the logits of
//                          every position as .npy
//   "streaming":           {"prefill": n, "expert_budgets": [x, ...], "policies": ["lru", ...]}
//                          with an expert cache of x times the largest expert, each policy's logits
//                          (prefill of n, then one token at a time) are bit-identical to the unbounded
//                          run's, with more misses and as many expert requests
//   "int8_activations":    {"max_rel_error": r, "min_rel_error": r}  --int8-activations logits are
//                          this close to the reference and not bit-exact
//
// tests/parity_test.cpp instantiates the suites on the fixtures on disk; a test file may
// instantiate them on fixtures it makes on the fly (MOESTREAM_INSTANTIATE_PARITY).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

namespace moestream::test {

struct ParityCase {
  std::string name;                  // the test name's last part
  nlohmann::json checks;             // the parity.json
  std::function<std::string()> dir;  // the checkpoint directory (made on first call, for rewrites)
};
inline void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.name; }

// The fixtures on disk with a parity.json (test::reference_fixtures()).
std::vector<ParityCase> parity_fixtures();
// The cases whose parity.json names `check`.
std::vector<ParityCase> with_check(const std::vector<ParityCase>& cases, const std::string& check);
inline std::string parity_case_name(const ::testing::TestParamInfo<ParityCase>& info) { return info.param.name; }

class ParityLogits : public ::testing::TestWithParam<ParityCase> {};
class ParityPrefillThenDecode : public ::testing::TestWithParam<ParityCase> {};
class ParityCliGreedy : public ::testing::TestWithParam<ParityCase> {};
class ParityCliLogits : public ::testing::TestWithParam<ParityCase> {};
class ParityStreaming : public ::testing::TestWithParam<ParityCase> {};
class ParityInt8Activations : public ::testing::TestWithParam<ParityCase> {};

}  // namespace moestream::test

// Each suite on the cases (an expression evaluated when the tests are registered) whose parity.json
// names its check. gtest pastes the suite names into identifiers: use it where the Parity* classes
// are visible unqualified (inside moestream::test, or after `using namespace moestream::test`).
#define MOESTREAM_INSTANTIATE_PARITY_ONE(prefix, suite, check, cases)                              \
  INSTANTIATE_TEST_SUITE_P(prefix, suite, ::testing::ValuesIn(::moestream::test::with_check(cases, check)), \
                           ::moestream::test::parity_case_name)
#define MOESTREAM_INSTANTIATE_PARITY(prefix, cases)                                                 \
  MOESTREAM_INSTANTIATE_PARITY_ONE(prefix, ParityLogits, "logits", cases);                          \
  MOESTREAM_INSTANTIATE_PARITY_ONE(prefix, ParityPrefillThenDecode, "prefill_then_decode", cases);  \
  MOESTREAM_INSTANTIATE_PARITY_ONE(prefix, ParityCliGreedy, "cli_greedy", cases);                   \
  MOESTREAM_INSTANTIATE_PARITY_ONE(prefix, ParityCliLogits, "cli_logits", cases);                   \
  MOESTREAM_INSTANTIATE_PARITY_ONE(prefix, ParityStreaming, "streaming", cases);                    \
  MOESTREAM_INSTANTIATE_PARITY_ONE(prefix, ParityInt8Activations, "int8_activations", cases)
