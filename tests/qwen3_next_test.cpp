// Qwen3-Next and Qwen3.5-MoE against the transformers reference fixtures
// (tools/make_family_fixtures.py), the Gated DeltaNet kernel's two forms against each other, and
// expert streaming with a resident shared expert.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "backend/cpu/deltanet.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/npy.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

struct Reference {
  std::vector<int32_t> logit_tokens, prompt_tokens, greedy_tokens;
  NpyArray logits;
};

Reference load_reference(const std::string& dir) {
  auto j = nlohmann::json::parse(test::read_file(dir + "/ref.json"));
  Reference r;
  r.logit_tokens = j["logit_tokens"].get<std::vector<int32_t>>();
  r.prompt_tokens = j["prompt_tokens"].get<std::vector<int32_t>>();
  r.greedy_tokens = j["greedy_tokens"].get<std::vector<int32_t>>();
  r.logits = read_npy_f32(dir + "/ref_logits.npy");
  return r;
}

// max|a - b| / max|b|
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return num / den;
}

std::string join(const std::vector<int32_t>& ids, const char* sep) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? sep : "") + std::to_string(ids[i]);
  return s;
}

// The Qwen3.5 text fixture rewritten as a multimodal checkpoint: config in text_config, weights
// under model.language_model., plus vision-tower and mtp tensors that must be ignored. Made once
// per test process.
std::string multimodal_fixture() {
  static const std::string dir = [] {
    const std::string src = test::fixture("families/qwen3_5_moe_text_tiny");
    const std::string out = test::temp_dir("qwen3_5_moe_multimodal") + "/qwen3_5_moe_multimodal";
    fs::create_directories(out);
    const WeightSet weights = WeightSet::open_dir(src);
    std::vector<TensorToWrite> tensors;
    std::vector<std::string> names;  // stable storage for the renamed names
    for (const auto& name : weights.names()) {
      const TensorView& t = weights.get(name);
      const std::string renamed =
          name.rfind("model.", 0) == 0 ? "model.language_model." + name.substr(6) : name;
      tensors.push_back({renamed, t.dtype, t.shape, t.data});
    }
    static const std::vector<uint16_t> dummy(64, 0x3f80);  // bf16 1.0
    tensors.push_back({"model.visual.patch_embed.proj.weight", DType::BF16, {8, 8}, dummy.data()});
    tensors.push_back({"mtp.layers.0.mlp.experts.0.gate_proj.weight", DType::BF16, {8, 8}, dummy.data()});
    tensors.push_back({"mtp.fc.weight", DType::BF16, {8, 8}, dummy.data()});
    write_safetensors(out + "/model.safetensors", tensors, {{"format", "pt"}});
    nlohmann::json text = nlohmann::json::parse(test::read_file(src + "/config.json"));
    nlohmann::json config = {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}},
                             {"model_type", "qwen3_5_moe"},
                             {"tie_word_embeddings", false},
                             {"text_config", text},
                             {"vision_config", {{"model_type", "qwen3_5_moe"}, {"depth", 1}}}};
    std::ofstream(out + "/config.json") << config.dump(2);
    fs::copy_file(src + "/generation_config.json", out + "/generation_config.json");
    fs::copy_file(src + "/ref.json", out + "/ref.json");
    fs::copy_file(src + "/ref_logits.npy", out + "/ref_logits.npy");
    return out;
  }();
  return dir;
}

std::vector<std::string> fixtures() {
  return {test::fixture("families/qwen3_next_tiny"), test::fixture("families/qwen3_5_moe_text_tiny"),
          "multimodal"};
}

std::string resolve(const std::string& param) { return param == "multimodal" ? multimodal_fixture() : param; }

class Qwen3NextFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(Qwen3NextFixture, LogitsMatchTransformers) {
  const std::string dir = resolve(GetParam());
  Reference ref = load_reference(dir);
  for (bool precise : {true, false}) {
    ModelOptions opt;
    opt.precise = precise;
    opt.threads = 2;
    auto model = load_model(dir, opt);
    const int64_t vocab = model->info().vocab_size;
    ASSERT_EQ(ref.logits.shape, (std::vector<int64_t>{int64_t(ref.logit_tokens.size()), vocab}));
    std::vector<float> logits(ref.logit_tokens.size() * size_t(vocab));
    auto seq = model->new_sequence(int64_t(ref.logit_tokens.size()));
    model->forward(ref.logit_tokens, *seq, logits);
    const double err = relative_error(logits, ref.logits.data);
    EXPECT_LE(err, precise ? 1e-3 : 3e-2) << dir << (precise ? " --precise" : " default");
    RecordProperty(precise ? "precise_error" : "default_error", std::to_string(err));
  }
}

TEST_P(Qwen3NextFixture, PrefillThenDecodeEqualsWholeSequence) {
  const std::string dir = resolve(GetParam());
  Reference ref = load_reference(dir);
  ModelOptions opt;
  opt.precise = true;
  opt.threads = 2;
  auto model = load_model(dir, opt);
  const size_t n = ref.logit_tokens.size(), vocab = size_t(model->info().vocab_size);
  std::vector<float> whole(n * vocab), stepped(n * vocab);
  auto a = model->new_sequence(int64_t(n));
  model->forward(ref.logit_tokens, *a, whole);
  // 13 tokens as one prefill, then 3 more as a second chunked call, the rest one at a time.
  auto b = model->new_sequence(int64_t(n));
  const size_t split = 13;
  model->forward(std::span(ref.logit_tokens).first(split), *b, std::span(stepped).first(split * vocab));
  model->forward(std::span(ref.logit_tokens).subspan(split, 3), *b,
                 std::span(stepped).subspan(split * vocab, 3 * vocab));
  for (size_t i = split + 3; i < n; ++i)
    model->forward(std::span(ref.logit_tokens).subspan(i, 1), *b,
                   std::span(stepped).subspan(i * vocab, vocab));
  EXPECT_EQ(b->n_past, int64_t(n));
  // Not 1e-5 as for Qwen3-MoE: at a few positions of these random-weight models a DeltaNet head's
  // output has an rms near 5e-4, and the gated RMSNorm scales it (with its float32 rounding) up by
  // ~1000x. Measured: up to 6e-5 at such positions, ~1e-6 elsewhere.
  EXPECT_LE(relative_error(stepped, whole), 2e-4);
}

TEST_P(Qwen3NextFixture, CliGreedyTokensMatchTransformers) {
  const std::string dir = resolve(GetParam());
  Reference ref = load_reference(dir);
  for (const char* mode : {"--precise", ""}) {
    auto r = test::run_cli("run -m " + dir + " --tokens " + join(ref.prompt_tokens, ",") + " -n " +
                           std::to_string(ref.greedy_tokens.size()) + " --temp 0 --ids " + mode);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, join(ref.greedy_tokens, " ") + "\n") << mode;
  }
}

// Logits of every position (prefill of 20, then one token at a time) and the expert stats.
std::vector<float> run_streaming(const std::string& dir, const ModelOptions& opt, ExpertStats& stats) {
  auto model = load_model(dir, opt);
  const std::vector<int32_t> ids = load_reference(dir).logit_tokens;
  const size_t vocab = size_t(model->info().vocab_size), split = 20;
  std::vector<float> logits(ids.size() * vocab);
  auto seq = model->new_sequence(int64_t(ids.size()));
  model->forward(std::span(ids).first(split), *seq, std::span(logits).first(split * vocab));
  for (size_t i = split; i < ids.size(); ++i)
    model->forward(std::span(ids).subspan(i, 1), *seq, std::span(logits).subspan(i * vocab, vocab));
  stats = model->expert_stats();
  return logits;
}

TEST_P(Qwen3NextFixture, StreamingIsBitIdenticalUnderTinyBudgets) {
  const std::string dir = resolve(GetParam());
  ModelOptions base;
  base.threads = 2;
  ExpertStats unbounded;
  const std::vector<float> reference = run_streaming(dir, base, unbounded);
  const PackManifest pack = PackManifest::load(ensure_pack(dir, ""));
  const double one_expert_mb = double(pack.max_expert_size()) / 1e6;
  for (double mb : {one_expert_mb * 0.5, one_expert_mb * 3.0}) {
    for (const char* policy : {"lru", "lcp"}) {
      ModelOptions opt = base;
      opt.experts.cache_mb = mb;
      opt.experts.policy = policy;
      ExpertStats s;
      const std::vector<float> got = run_streaming(dir, opt, s);
      ASSERT_EQ(got.size(), reference.size());
      EXPECT_EQ(std::memcmp(got.data(), reference.data(), got.size() * sizeof(float)), 0)
          << dir << " budget " << mb << " MB, " << policy;
      EXPECT_GT(s.misses, unbounded.misses) << "a bounded cache must re-read experts";
      EXPECT_EQ(s.hits + s.misses, unbounded.hits + unbounded.misses) << "same expert requests";
    }
  }
}

// The shared expert is a plain resident weight: the pack's expert files hold only the routed
// experts, and one decoded token asks the store for exactly top_k experts per MoE layer.
TEST_P(Qwen3NextFixture, SharedExpertIsResidentAndNeverARoutedMiss) {
  const std::string dir = resolve(GetParam());
  const std::string pack_dir = ensure_pack(dir, "");
  const PackManifest pack = PackManifest::load(pack_dir);
  const auto config = nlohmann::json::parse(test::read_file(dir + "/config.json"));
  const auto& text = config.contains("text_config") ? config["text_config"] : config;
  const int n_experts = text["num_experts"], top_k = text["num_experts_per_tok"];
  const int n_layers = text["num_hidden_layers"];
  EXPECT_EQ(pack.n_experts, n_experts);
  ASSERT_EQ(int(pack.layers.size()), n_layers);
  for (const auto& layer : pack.layers) EXPECT_EQ(int(layer.size()), n_experts);
  const WeightSet dense = WeightSet::open_files({pack_dir + "/" + pack.weights_file});
  int shared_tensors = 0;
  for (const auto& name : dense.names()) shared_tensors += name.find(".mlp.shared_expert.") != std::string::npos;
  EXPECT_EQ(shared_tensors, 3 * n_layers) << "gate/up/down of each layer's shared expert stay resident";
  for (const auto& name : dense.names())
    EXPECT_TRUE(name.rfind("model.visual.", 0) != 0 && name.rfind("mtp.", 0) != 0) << name << " is packed";

  ModelOptions opt;
  opt.threads = 2;
  opt.experts.cache_mb = double(pack.max_expert_size()) * 0.5 / 1e6;  // every routed expert misses
  auto model = load_model(dir, opt);
  std::vector<float> logits(size_t(model->info().vocab_size));
  auto seq = model->new_sequence(4);
  const int32_t token[] = {7};
  model->forward(token, *seq, logits);
  const ExpertStats s = model->expert_stats();
  EXPECT_EQ(s.hits + s.misses, uint64_t(n_layers * top_k));
  EXPECT_EQ(s.misses, uint64_t(n_layers * top_k));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Qwen3NextFixture, ::testing::ValuesIn(fixtures()),
                         [](const auto& info) {
                           return info.param == "multimodal" ? std::string("qwen3_5_moe_multimodal")
                                                             : fs::path(info.param).filename().string();
                         });

// A copy of the Qwen3-Next fixture with config.json edited by `edit`.
std::string edited_fixture(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
  const std::string src = test::fixture("families/qwen3_next_tiny");
  const std::string out = test::temp_dir(name) + "/" + name;
  fs::create_directories(out);
  for (const auto& e : fs::directory_iterator(src)) fs::copy_file(e.path(), out + "/" + e.path().filename().string());
  nlohmann::json config = nlohmann::json::parse(test::read_file(src + "/config.json"));
  edit(config);
  std::ofstream(out + "/config.json", std::ios::trunc) << config.dump(2);
  return out;
}

TEST(Qwen3Next, FullAttentionIntervalStandsInForLayerTypes) {
  const std::string dir = edited_fixture("interval", [](nlohmann::json& c) {
    c.erase("layer_types");
    c["full_attention_interval"] = 4;
  });
  Reference ref = load_reference(dir);
  ModelOptions opt;
  opt.precise = true;
  auto model = load_model(dir, opt);
  std::vector<float> logits(ref.logit_tokens.size() * size_t(model->info().vocab_size));
  auto seq = model->new_sequence(int64_t(ref.logit_tokens.size()));
  model->forward(ref.logit_tokens, *seq, logits);
  EXPECT_LE(relative_error(logits, ref.logits.data), 1e-3);
}

TEST(Qwen3Next, ConfigErrorsNameTheField) {
  auto error_of = [](const std::string& dir) -> std::string {
    try {
      load_model(dir, ModelOptions{});
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string bad_kind = edited_fixture("bad_kind", [](nlohmann::json& c) {
    c["layer_types"][1] = "sliding_attention";
  });
  EXPECT_NE(error_of(bad_kind).find("layer_types entry 'sliding_attention'"), std::string::npos)
      << error_of(bad_kind);
  const std::string short_list = edited_fixture("short_list", [](nlohmann::json& c) {
    c["layer_types"].erase(0);
  });
  EXPECT_NE(error_of(short_list).find("layer_types has 3 entries"), std::string::npos) << error_of(short_list);
  const std::string heads = edited_fixture("heads", [](nlohmann::json& c) { c["linear_num_value_heads"] = 3; });
  EXPECT_NE(error_of(heads).find("linear_num_value_heads"), std::string::npos) << error_of(heads);
}

// ---------------------------------------------------------------------------------------------
// The Gated DeltaNet kernel: chunked (prefill) and recurrent (decode) forms agree.

struct DeltaNetCase {
  DeltaNetParams p;
  DeltaNetWeights w;
  std::vector<std::vector<float>> storage;
  std::vector<float> qkv, z, b, a;
  int64_t T;

  DeltaNetCase(int64_t tokens, uint32_t seed) : T(tokens) {
    p.n_k_heads = 2;
    p.n_v_heads = 4;
    p.k_head_dim = 8;
    p.v_head_dim = 6;
    p.conv_kernel = 4;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, size_t n, float scale, float shift) {
      v.resize(n);
      for (float& x : v) x = normal(rng) * scale + shift;
    };
    const int64_t conv_dim = 2 * 16 + 24;
    auto vec = [&](size_t n, float scale, float shift, const char* name) {
      fill(storage.emplace_back(), n, scale, shift);
      return Vector{name, storage.back().data(), int64_t(n)};
    };
    storage.reserve(4);
    w.conv = vec(size_t(conv_dim * 4), 0.5f, 0.0f, "conv");
    w.A_log = vec(4, 0.5f, 0.0f, "A_log");
    w.dt_bias = vec(4, 0.5f, 0.0f, "dt_bias");
    w.norm = vec(6, 0.2f, 1.0f, "norm");
    fill(qkv, size_t(T * conv_dim), 1.0f, 0.0f);
    fill(z, size_t(T * 24), 1.0f, 0.0f);
    fill(b, size_t(T * 4), 1.0f, 0.0f);
    fill(a, size_t(T * 4), 1.0f, -1.0f);
  }

  struct State {
    std::vector<float> conv, recurrent;
    DeltaNetState view() { return DeltaNetState{{conv.data(), 3, 56}, {recurrent.data(), 32, 6}}; }
  };
  State fresh_state() const { return State{std::vector<float>(3 * 56), std::vector<float>(32 * 6)}; }

  // Runs tokens [begin, begin + n) with `form`, returns their outputs [n, 24].
  std::vector<float> run(ThreadPool& pool, State& s, int64_t begin, int64_t n, cpu::DeltaRuleForm form) {
    auto rows = [&](std::vector<float>& v, int64_t cols) {
      return Buffer{v.data() + begin * cols, n, cols};
    };
    std::vector<float> out(size_t(n * 24));
    Buffer o{out.data(), n, 24};
    DeltaNetState view = s.view();
    cpu::DeltaNetScratch scratch;
    cpu::gated_delta_net(pool, rows(qkv, 56), rows(z, 24), rows(b, 4), rows(a, 4), w, p, view, o, scratch, form);
    return out;
  }
};

TEST(GatedDeltaNet, ChunkedFormEqualsRecurrence) {
  ThreadPool pool(2);
  const int64_t T = 2 * cpu::kDeltaNetChunk + 22;  // three chunks, the last one partial
  DeltaNetCase c(T, 1);
  auto s1 = c.fresh_state(), s2 = c.fresh_state();
  // A warm start first, so the chunked form also starts from a non-zero state.
  c.run(pool, s1, 0, 5, cpu::DeltaRuleForm::Recurrent);
  c.run(pool, s2, 0, 5, cpu::DeltaRuleForm::Recurrent);
  const std::vector<float> rec = c.run(pool, s1, 5, T - 5, cpu::DeltaRuleForm::Recurrent);
  const std::vector<float> chunked = c.run(pool, s2, 5, T - 5, cpu::DeltaRuleForm::Chunked);
  EXPECT_LE(relative_error(chunked, rec), 1e-5);
  EXPECT_LE(relative_error(s2.recurrent, s1.recurrent), 1e-5);
  EXPECT_EQ(s2.conv, s1.conv);
}

TEST(GatedDeltaNet, StateCarriesAcrossCalls) {
  ThreadPool pool(1);
  const int64_t T = 30;
  DeltaNetCase c(T, 2);
  auto whole_state = c.fresh_state(), split_state = c.fresh_state();
  const std::vector<float> whole = c.run(pool, whole_state, 0, T, cpu::DeltaRuleForm::Chunked);
  std::vector<float> split;
  // Pieces shorter than the conv kernel exercise the rolling conv state.
  for (auto [begin, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 1}, {3, 11}, {14, 16}}) {
    const auto form = n == 1 ? cpu::DeltaRuleForm::Recurrent : cpu::DeltaRuleForm::Chunked;
    const std::vector<float> part = c.run(pool, split_state, begin, n, form);
    split.insert(split.end(), part.begin(), part.end());
  }
  EXPECT_LE(relative_error(split, whole), 1e-5);
  EXPECT_LE(relative_error(split_state.recurrent, whole_state.recurrent), 1e-5);
}

TEST(GatedDeltaNet, ShapeErrorsNameTheInput) {
  ThreadPool pool(1);
  DeltaNetCase c(3, 3);
  auto s = c.fresh_state();
  DeltaNetState view = s.view();
  std::vector<float> out(3 * 24);
  Buffer o{out.data(), 3, 24};
  Buffer wrong{c.qkv.data(), 3, 50};
  cpu::DeltaNetScratch scratch;
  try {
    cpu::gated_delta_net(pool, wrong, Buffer{c.z.data(), 3, 24}, Buffer{c.b.data(), 3, 4},
                         Buffer{c.a.data(), 3, 4}, c.w, c.p, view, o, scratch, cpu::DeltaRuleForm::Chunked);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qkv is [3, 50], expected [3, 56]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moestream
