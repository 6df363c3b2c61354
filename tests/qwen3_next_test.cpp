// Qwen3-Next and Qwen3.5-MoE: their fixture rewritten in the other layouts checkpoints come in
// (multimodal with vision and mtp tensors, fused experts, mlx-lm's layout, both) and checked by the
// parity suite (parity.h) like the fixtures on disk; a resident shared expert; layer_types
// defaults and errors; MLX-quantized rows regrouped. The fixtures on disk (chunk-crossing lengths,
// 3:1 and 2:1 linear:full stacks, GQA in the linear layers, a dense layer, 4-bit MLX checkpoints)
// are tests/parity_test.cpp's; the Gated DeltaNet kernel is tests/deltanet_test.cpp's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "core/dtype.h"
#include "core/quant.h"
#include "core/error.h"
#include "io/npy.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/model.h"
#include "parity.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

using test::load_reference;
using test::Reference;
using test::relative_error;

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

// A checkpoint tensor that owns its bytes, for rewriting fixtures into other layouts.
struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};

std::vector<OwnedTensor> read_tensors(const std::string& dir) {
  const WeightSet weights = WeightSet::open_dir(dir);
  std::vector<OwnedTensor> out;
  for (const auto& name : weights.names()) {
    const TensorView& t = weights.get(name);
    out.push_back({name, t.dtype, t.shape, std::vector<char>(t.as<char>(), t.as<char>() + t.nbytes)});
  }
  return out;
}

std::vector<float> values_f32(const OwnedTensor& t) {
  const size_t n = t.bytes.size() / dtype_size(t.dtype);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    if (t.dtype == DType::F32) {
      std::memcpy(&v[i], t.bytes.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, t.bytes.data() + 2 * i, 2);
      v[i] = bf16_to_f32(h);
    }
  }
  return v;
}

OwnedTensor f32_tensor(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
  OwnedTensor t{name, DType::F32, std::move(shape), std::vector<char>(v.size() * 4)};
  std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
  return t;
}

// A copy of fixture `src` (configs and references) with `tensors` as its weights and config.json
// edited by `edit`, in a fresh directory named `name`.
std::string write_checkpoint(const std::string& name, const std::string& src, const std::vector<OwnedTensor>& tensors,
                             const std::function<void(nlohmann::json&)>& edit = {}) {
  const std::string out = test::temp_dir(name) + "/" + name;
  fs::create_directories(out);
  std::vector<TensorToWrite> list;
  for (const OwnedTensor& t : tensors) list.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
  write_safetensors(out + "/model.safetensors", list, {{"format", "pt"}});
  nlohmann::json config = nlohmann::json::parse(test::read_file(src + "/config.json"));
  if (edit) edit(config);
  std::ofstream(out + "/config.json") << config.dump(2);
  for (const char* f : {"generation_config.json", "ref.json", "ref_logits.npy"})
    if (fs::exists(src + "/" + f)) fs::copy_file(src + "/" + f, out + "/" + f);
  return out;
}

const std::regex kExpertName(R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight)");

// The routed experts of layer `layer` for `proj`, stacked [E, out, in] with bytes as stored.
OwnedTensor stack_experts(const std::vector<OwnedTensor>& tensors, int layer, const std::string& proj,
                          const std::string& name) {
  std::vector<const OwnedTensor*> parts;
  for (int e = 0;; ++e) {
    const std::string want = "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e) + "." + proj + ".weight";
    auto it = std::find_if(tensors.begin(), tensors.end(), [&](const OwnedTensor& t) { return t.name == want; });
    if (it == tensors.end()) break;
    parts.push_back(&*it);
  }
  OwnedTensor t{name, parts.at(0)->dtype, {int64_t(parts.size()), parts[0]->shape[0], parts[0]->shape[1]}, {}};
  for (const OwnedTensor* p : parts) t.bytes.insert(t.bytes.end(), p->bytes.begin(), p->bytes.end());
  return t;
}

// The Qwen3.5 fixture with its experts fused as transformers holds them (and as its save_pretrained
// wrote them before 5.x split them per expert): experts.gate_up_proj [E, 2I, H] (each expert's gate
// rows, then its up rows) and experts.down_proj [E, H, I]. Same model, same reference.
std::string fused_fixture() {
  static const std::string dir = [] {
    const std::string src = test::fixture("families/qwen3_5_moe_text_tiny");
    const std::vector<OwnedTensor> in = read_tensors(src);
    std::vector<OwnedTensor> out;
    std::set<int> layers;
    std::smatch m;
    for (const OwnedTensor& t : in) {
      if (std::regex_match(t.name, m, kExpertName)) {
        layers.insert(std::stoi(m[1]));
        continue;
      }
      out.push_back(t);
    }
    for (int l : layers) {
      const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
      const OwnedTensor gate = stack_experts(in, l, "gate_proj", ""), up = stack_experts(in, l, "up_proj", "");
      const int64_t E = gate.shape[0], I = gate.shape[1], H = gate.shape[2];
      OwnedTensor gate_up{p + "gate_up_proj", gate.dtype, {E, 2 * I, H}, {}};
      const size_t half = gate.bytes.size() / size_t(E);
      for (int64_t e = 0; e < E; ++e) {
        gate_up.bytes.insert(gate_up.bytes.end(), gate.bytes.begin() + long(half * size_t(e)), gate.bytes.begin() + long(half * size_t(e + 1)));
        gate_up.bytes.insert(gate_up.bytes.end(), up.bytes.begin() + long(half * size_t(e)), up.bytes.begin() + long(half * size_t(e + 1)));
      }
      out.push_back(std::move(gate_up));
      out.push_back(stack_experts(in, l, "down_proj", p + "down_proj"));
    }
    return write_checkpoint("qwen3_5_moe_fused", src, out);
  }();
  return dir;
}

// The zero-centred RMSNorm weights (applied as 1 + w), which mlx-lm stores as 1 + w.
bool is_zero_centred_norm(const std::string& name) {
  for (const char* suffix : {"input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight"})
    if (name.size() > std::strlen(suffix) && name.compare(name.size() - std::strlen(suffix), std::string::npos, suffix) == 0)
      return true;
  return name == "model.norm.weight";
}

// The Qwen3-Next fixture in mlx-lm's layout (what its sanitize step makes of a Hub checkpoint):
// experts stacked under mlp.switch_mlp, conv1d weights [channels, kernel, 1], zero-centred norm
// weights stored as 1 + w (float32 here, so the model is exactly the reference's).
std::vector<OwnedTensor> mlx_layout(const std::vector<OwnedTensor>& in) {
  std::vector<OwnedTensor> out;
  std::set<int> layers;
  std::smatch m;
  for (const OwnedTensor& t : in) {
    if (std::regex_match(t.name, m, kExpertName)) {
      layers.insert(std::stoi(m[1]));
    } else if (t.name.find("conv1d.weight") != std::string::npos) {
      out.push_back({t.name, t.dtype, {t.shape[0], t.shape[2], 1}, t.bytes});
    } else if (is_zero_centred_norm(t.name)) {
      std::vector<float> v = values_f32(t);
      for (float& x : v) x += 1.0f;
      out.push_back(f32_tensor(t.name, t.shape, v));
    } else {
      out.push_back(t);
    }
  }
  for (int l : layers)
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
      out.push_back(stack_experts(in, l, proj, "model.layers." + std::to_string(l) + ".mlp.switch_mlp." + proj + ".weight"));
  return out;
}

std::string mlx_layout_fixture() {
  static const std::string dir = [] {
    const std::string src = test::fixture("families/qwen3_next_tiny");
    return write_checkpoint("qwen3_next_mlx_layout", src, mlx_layout(read_tensors(src)));
  }();
  return dir;
}

// The Qwen3.5 text fixture as a multimodal MLX checkpoint names it (mlx-vlm, mlx-lm's
// qwen3_5_moe): mlx_layout() above, then the language model under language_model.model., the head
// as language_model.lm_head, A_log in float32 (mlx-lm's cast_predicate), a vision tower under
// vision_tower. and mtp weights under language_model.mtp. that must be ignored; the config in
// text_config. Unquantized, so the model is exactly the reference's.
std::string mlx_multimodal_fixture() {
  static const std::string dir = [] {
    const std::string src = test::fixture("families/qwen3_5_moe_text_tiny");
    std::vector<OwnedTensor> out;
    for (OwnedTensor t : mlx_layout(read_tensors(src))) {
      if (t.name.size() > 6 && t.name.compare(t.name.size() - 6, 6, ".A_log") == 0) t = f32_tensor(t.name, t.shape, values_f32(t));
      t.name = "language_model." + t.name;  // model.* -> language_model.model.*, lm_head likewise
      out.push_back(std::move(t));
    }
    const std::vector<float> dummy(64, 1.0f);
    for (const char* name : {"vision_tower.patch_embed.proj.weight", "vision_tower.blocks.0.attn.qkv.weight",
                             "language_model.mtp.fc.weight", "language_model.mtp.layers.0.mlp.switch_mlp.gate_proj.weight"})
      out.push_back(f32_tensor(name, {8, 8}, dummy));
    return write_checkpoint("qwen3_5_moe_mlx_multimodal", src, out, [](nlohmann::json& text) {
      text = {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}},
              {"model_type", "qwen3_5_moe"},
              {"tie_word_embeddings", false},
              {"text_config", text},
              {"vision_config", {{"model_type", "qwen3_5_moe"}, {"depth", 1}}}};
    });
  }();
  return dir;
}

// The rewrites above, checked as the fixtures they come from are (tests/parity_test.cpp, with
// that fixture's parity.json).
std::vector<test::ParityCase> rewritten_fixtures() {
  const auto checks_of = [](const std::string& fixture) {
    return nlohmann::json::parse(test::read_file(test::fixture("families/" + fixture + "/parity.json")));
  };
  return {
      {"qwen3_5_moe_multimodal", checks_of("qwen3_5_moe_text_tiny"), multimodal_fixture},
      {"qwen3_5_moe_fused_experts", checks_of("qwen3_5_moe_text_tiny"), fused_fixture},
      {"qwen3_next_mlx_layout", checks_of("qwen3_next_tiny"), mlx_layout_fixture},
      {"qwen3_5_moe_mlx_multimodal", checks_of("qwen3_5_moe_text_tiny"), mlx_multimodal_fixture},
  };
}

using test::ParityCliGreedy;
using test::ParityCliLogits;
using test::ParityInt8Activations;
using test::ParityLogits;
using test::ParityPrefillThenDecode;
using test::ParityStreaming;
MOESTREAM_INSTANTIATE_PARITY(Rewritten, rewritten_fixtures());

// Every fixture of these families on disk (tests/fixtures/families, made by
// tools/make_family_fixtures.py and tools/make_next_fixtures.py) and the rewrites above.
std::vector<test::ParityCase> fixtures() {
  std::vector<test::ParityCase> cases;
  for (const test::ParityCase& c : test::parity_fixtures()) {
    const std::string type = c.checks.value("model_type", "");
    if (type == "qwen3_next" || type == "qwen3_5_moe_text") cases.push_back(c);
  }
  for (test::ParityCase& c : rewritten_fixtures()) cases.push_back(std::move(c));
  return cases;
}

class Qwen3NextFixture : public ::testing::TestWithParam<test::ParityCase> {};

// The shared expert is a plain resident weight: the pack's expert files hold only the routed
// experts, and one decoded token asks the store for exactly top_k experts per MoE layer.
TEST_P(Qwen3NextFixture, SharedExpertIsResidentAndNeverARoutedMiss) {
  const std::string dir = GetParam().dir();
  const std::string pack_dir = ensure_pack(dir, "");
  const PackManifest pack = PackManifest::load(pack_dir);
  const auto config = nlohmann::json::parse(test::read_file(dir + "/config.json"));
  const auto& text = config.contains("text_config") ? config["text_config"] : config;
  const int n_experts = text["num_experts"], top_k = text["num_experts_per_tok"];
  const int n_layers = text["num_hidden_layers"];
  // Qwen3-Next layers listed in mlp_only_layers are dense (decoder_sparse_step is 1 here).
  const std::vector<int> dense_layers = text.value("mlp_only_layers", std::vector<int>{});
  const int n_moe = n_layers - int(dense_layers.size());
  EXPECT_EQ(pack.n_experts, n_experts);
  ASSERT_EQ(int(pack.layers.size()), n_layers);
  for (int l = 0; l < n_layers; ++l) {
    const bool dense = std::find(dense_layers.begin(), dense_layers.end(), l) != dense_layers.end();
    EXPECT_EQ(int(pack.layers[size_t(l)].size()), dense ? 0 : n_experts) << "layer " << l;
  }
  const WeightSet resident = WeightSet::open_files({pack_dir + "/" + pack.weights_file});
  std::set<std::string> shared_modules;  // <layer>.mlp.shared_expert.<proj>, plain or quantized
  for (const auto& name : resident.names())
    if (name.find(".mlp.shared_expert.") != std::string::npos) shared_modules.insert(name.substr(0, name.rfind('.')));
  EXPECT_EQ(int(shared_modules.size()), 3 * n_moe) << "gate/up/down of each layer's shared expert stay resident";
  for (const auto& name : resident.names())
    for (const char* unused : {"model.visual.", "mtp.", "vision_tower.", "language_model.mtp."})
      EXPECT_NE(name.rfind(unused, 0), 0u) << name << " is packed";

  ModelOptions opt;
  opt.threads = 2;
  opt.experts.cache_mb = double(pack.max_expert_size()) * 0.5 / 1e6;  // every routed expert misses
  auto model = load_model(dir, opt);
  std::vector<float> logits(size_t(model->info().vocab_size));
  auto seq = model->new_sequence(4);
  const int32_t token[] = {7};
  model->forward(token, *seq, logits);
  const ExpertStats s = model->expert_stats();
  EXPECT_EQ(s.hits + s.misses, uint64_t(n_moe * top_k));
  EXPECT_EQ(s.misses, uint64_t(n_moe * top_k));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Qwen3NextFixture, ::testing::ValuesIn(fixtures()), test::parity_case_name);

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
  EXPECT_LE(relative_error(test::prefill_logits(*load_model(dir, opt), ref.logit_tokens), ref.logits.data), 1e-3);
}

// mlx-community checkpoints quantize every Linear whose input width the group size divides,
// in_proj_qkvz / in_proj_ba / q_proj included, whose rows the loader regroups (words, scales and
// biases together). The quantized checkpoint must compute what its dequantized float32 copy does.
TEST(Qwen3Next, MlxQuantizedRowsRegroupLikeTheirDequantizedCopy) {
  const std::string src = test::fixture("families/qwen3_next_tiny");
  const QuantFormat f{4, 32, DType::BF16};
  std::vector<OwnedTensor> quantized, dequantized;
  std::set<std::string> quantized_names;
  for (const OwnedTensor& t : mlx_layout(read_tensors(src))) {
    const bool linear = t.dtype == DType::BF16 && t.shape.size() >= 2 && t.shape.back() % f.group_size == 0 &&
                        t.name.size() > 7 && t.name.compare(t.name.size() - 7, 7, ".weight") == 0;
    if (!linear) {
      quantized.push_back(t);
      dequantized.push_back(t);
      continue;
    }
    const int64_t cols = t.shape.back(), rows = int64_t(values_f32(t).size()) / cols;
    const int64_t words_per_row = cols * f.bits / 32, groups = cols / f.group_size;
    const std::vector<float> w = values_f32(t);
    std::vector<uint32_t> words(size_t(rows * words_per_row));
    std::vector<uint16_t> scales(size_t(rows * groups)), biases(size_t(rows * groups));
    quantize_affine(w.data(), rows, cols, f, words.data(), scales.data(), biases.data(), {}, t.name);
    std::vector<float> back(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      dequantize_row(f, cols, words.data() + r * words_per_row, scales.data() + r * groups, biases.data() + r * groups,
                     back.data() + r * cols);
    const std::string module = t.name.substr(0, t.name.size() - 7);
    auto shaped = [&](int64_t last) {
      std::vector<int64_t> shape = t.shape;
      shape.back() = last;
      return shape;
    };
    auto raw = [](const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data, size_t n) {
      const char* p = static_cast<const char*>(data);
      return OwnedTensor{name, dtype, std::move(shape), std::vector<char>(p, p + n)};
    };
    quantized.push_back(raw(t.name, DType::U32, shaped(words_per_row), words.data(), words.size() * 4));
    quantized.push_back(raw(module + ".scales", DType::BF16, shaped(groups), scales.data(), scales.size() * 2));
    quantized.push_back(raw(module + ".biases", DType::BF16, shaped(groups), biases.data(), biases.size() * 2));
    dequantized.push_back(f32_tensor(t.name, t.shape, back));
    quantized_names.insert(t.name);
  }
  for (const char* name : {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.in_proj_ba.weight",
                           "model.layers.3.self_attn.q_proj.weight", "model.layers.0.mlp.switch_mlp.gate_proj.weight"})
    ASSERT_TRUE(quantized_names.count(name)) << name << " was not quantized";
  const std::string q_dir = write_checkpoint("qwen3_next_mlx_q4g32", src, quantized, [&](nlohmann::json& c) {
    c["quantization"] = {{"group_size", f.group_size}, {"bits", f.bits}};
  });
  const std::string d_dir = write_checkpoint("qwen3_next_mlx_dequantized", src, dequantized);

  const Reference ref = load_reference(src);
  auto logits_of = [&](const std::string& dir) {
    ModelOptions opt;
    opt.precise = true;
    opt.threads = 2;
    return test::prefill_logits(*load_model(dir, opt), ref.logit_tokens);
  };
  const std::vector<float> q = logits_of(q_dir), d = logits_of(d_dir);
  // The dequantized copy goes through the plain regrouping, which the fixtures above check against
  // transformers; a row, scale or bias regrouped wrongly on the quantized side shows as O(1) here.
  EXPECT_LE(relative_error(q, d), 1e-4);
}

TEST(Qwen3Next, ConfigErrorsNameTheField) {
  const auto error_of = [](const std::string& dir) { return test::error_of([&] { load_model(dir, ModelOptions{}); }); };
  test::expect_contains(error_of(edited_fixture("bad_kind", [](nlohmann::json& c) { c["layer_types"][1] = "sliding_attention"; })),
                        {"layer_types entry 'sliding_attention'"});
  test::expect_contains(error_of(edited_fixture("short_list", [](nlohmann::json& c) { c["layer_types"].erase(0); })),
                        {"layer_types has 3 entries"});
  test::expect_contains(error_of(edited_fixture("heads", [](nlohmann::json& c) { c["linear_num_value_heads"] = 3; })),
                        {"linear_num_value_heads"});
}

}  // namespace
}  // namespace moestream
