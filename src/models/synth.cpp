#include "models/synth.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <unistd.h>

#include "core/dtype.h"
#include "core/error.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/blocks.h"

namespace moestream {

namespace {

using json = nlohmann::json;

const char* const kSpecialTokens[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
constexpr int64_t kByteTokens = 256;

// Fast deterministic random numbers (splitmix64); normals by Box-Muller.
struct Rng {
  static constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;  // the state advances by it per draw
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += kGamma);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return float(next() >> 40) * (1.0f / 16777216.0f); }
  float normal() {
    float u = std::max(uniform(), 1e-7f), v = uniform();
    return std::sqrt(-2.0f * std::log(u)) * std::cos(6.2831853f * v);
  }
};

// GPT-2's printable stand-ins for the 256 byte values, as UTF-8 strings.
std::vector<std::string> byte_level_alphabet() {
  std::vector<std::string> out(256);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const int cp = printable ? b : next++;
    std::string s;
    if (cp < 0x80) {
      s += char(cp);
    } else {
      s += char(0xC0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3F));
    }
    out[size_t(b)] = s;
  }
  return out;
}

// Byte tokens, then special tokens, then filler word pieces ("Ġab", "cd", ...) up to vocab.
json tokenizer_json(int64_t vocab_size) {
  json vocab = json::object();
  const auto alphabet = byte_level_alphabet();
  for (int b = 0; b < 256; ++b) vocab[alphabet[size_t(b)]] = b;
  json added = json::array();
  int64_t id = kByteTokens;
  for (const char* t : kSpecialTokens)
    added.push_back({{"id", id++}, {"content", t}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  for (int64_t n = 0; id < vocab_size; ++n) {
    std::string piece = n % 2 ? "" : "\xc4\xa0";  // "Ġ": a leading space
    int64_t k = n / 2;
    do {
      piece += char('a' + k % 26);
      k /= 26;
    } while (k > 0);
    if (piece.size() < 2 + (n % 2 ? 0 : 2)) piece += 'e';  // avoid clashing with byte tokens
    if (vocab.contains(piece)) continue;
    vocab[piece] = id++;
  }
  json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                     {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer", byte_level},
          {"post_processor", nullptr},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
            {"continuing_subword_prefix", ""}, {"end_of_word_suffix", ""}, {"fuse_unk", false},
            {"byte_fallback", false}, {"ignore_merges", false}, {"vocab", vocab},
            {"merges", json::array()}}}};
}

// The id of <|im_end|> in the tokenizer at dir (its end of turn), which must be below vocab.
int32_t tokenizer_eos(const std::string& dir, int64_t vocab) {
  const std::string path = dir + "/tokenizer.json";
  std::ifstream in(path);
  if (!in) fail("--tokenizer: ", path, " not found");
  json t;
  try {
    t = json::parse(in);
  } catch (const std::exception&) {
    fail("--tokenizer: ", path, " is not JSON");
  }
  int64_t most = -1, eos = -1;
  if (t.contains("model") && t["model"].contains("vocab") && t["model"]["vocab"].is_object())
    for (const auto& [piece, id] : t["model"]["vocab"].items())
      if (id.is_number_integer()) most = std::max<int64_t>(most, id.get<int64_t>());
  if (t.contains("added_tokens") && t["added_tokens"].is_array())
    for (const json& a : t["added_tokens"]) {
      if (!a.contains("id") || !a["id"].is_number_integer()) continue;
      most = std::max<int64_t>(most, a["id"].get<int64_t>());
      if (a.value("content", "") == "<|im_end|>") eos = a["id"].get<int64_t>();
    }
  if (most >= vocab) fail("--tokenizer: ", path, " has ids up to ", most, ", at or above --vocab ", vocab);
  if (eos < 0) fail("--tokenizer: ", path, " has no <|im_end|> token");
  return int32_t(eos);
}

void write_json(const std::string& path, const json& j) {
  std::ofstream out(path);
  out << j.dump(1) << "\n";
  out.close();
  if (!out) fail(path, ": write failed");
}

int quant_bits(const std::string& quant) {
  if (quant == "bf16") return 0;
  if (quant == "q8") return 8;
  if (quant == "q4") return 4;
  if (quant == "q2") return 2;
  fail("--quant: '", quant, "' is not available for synth (bf16, q8, q4, q2)");
}

// A random expert matrix [rows, cols] in the requested storage, appended to parts/storage.
void random_matrix(Rng& rng, const std::string& role, int64_t rows, int64_t cols, int bits,
                   int group, std::deque<std::vector<char>>& storage,
                   std::vector<PackWriter::Part>& parts) {
  const float std = 1.0f / std::sqrt(float(cols));
  if (bits == 0) {
    std::vector<char>& b = storage.emplace_back(size_t(rows * cols) * 2);
    auto* w = reinterpret_cast<uint16_t*>(b.data());
    for (int64_t i = 0; i < rows * cols; ++i) w[i] = f32_to_bf16(std * rng.normal());
    parts.push_back({role, DType::BF16, {rows, cols}, b.data(), b.size()});
    return;
  }
  // Uniform random codes; scale and bias make the values zero-mean with about the same spread.
  const int64_t words = rows * cols * bits / 32, groups = rows * (cols / group);
  std::vector<char>& q = storage.emplace_back(size_t(words) * 4);
  auto* qw = reinterpret_cast<uint64_t*>(q.data());
  for (int64_t i = 0; i < words / 2; ++i) qw[i] = rng.next();
  if (words % 2) reinterpret_cast<uint32_t*>(q.data())[words - 1] = uint32_t(rng.next());
  const float levels = float((1 << bits) - 1);
  const float step = std * std::sqrt(12.0f) / levels;  // uniform over levels steps has std * 1
  std::vector<char>& sc = storage.emplace_back(size_t(groups) * 2);
  std::vector<char>& bi = storage.emplace_back(size_t(groups) * 2);
  auto* s = reinterpret_cast<uint16_t*>(sc.data());
  auto* bb = reinterpret_cast<uint16_t*>(bi.data());
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = step * (0.8f + 0.4f * rng.uniform());
    s[g] = f32_to_bf16(scale);
    bb[g] = f32_to_bf16(-scale * levels / 2);
  }
  parts.push_back({role, DType::U32, {rows, cols * bits / 32}, q.data(), q.size(), bits, group});
  parts.push_back({role + ".scales", DType::BF16, {rows, cols / group}, sc.data(), sc.size()});
  parts.push_back({role + ".biases", DType::BF16, {rows, cols / group}, bi.data(), bi.size()});
}

// A Qwen3.5 layer's weights before its router, in the Hub layout (qwen3_next.cpp reads them):
// Gated DeltaNet (split projections, conv1d [channels, 1, kernel]) or gated attention (q_proj
// holds [query, gate] per head), then the shared expert and its gate.
template <class Add, class MatrixFn>
void add_hybrid_layer(const SynthShape& s, const std::string& p, bool linear, Add& add, MatrixFn& matrix) {
  const int64_t h = s.hidden;
  if (linear) {
    const int64_t key_dim = int64_t(s.linear_k_heads) * s.linear_head_dim,
                  value_dim = int64_t(s.linear_v_heads) * s.linear_head_dim, conv_dim = 2 * key_dim + value_dim;
    const std::string a = p + "linear_attn.";
    matrix(a + "in_proj_qkv.weight", conv_dim, h);
    matrix(a + "in_proj_z.weight", value_dim, h);
    matrix(a + "in_proj_b.weight", s.linear_v_heads, h);
    matrix(a + "in_proj_a.weight", s.linear_v_heads, h);
    add(a + "conv1d.weight", {conv_dim, 1, s.linear_conv_kernel}, 1.0f / std::sqrt(float(s.linear_conv_kernel)), 0.0f);
    add(a + "A_log", {s.linear_v_heads}, 0.5f, 0.0f);
    add(a + "dt_bias", {s.linear_v_heads}, 0.5f, 0.0f);
    add(a + "norm.weight", {s.linear_head_dim}, 0.1f, 1.0f);
    matrix(a + "out_proj.weight", h, value_dim);
  } else {
    const int64_t q_dim = int64_t(s.heads) * s.head_dim, kv_dim = int64_t(s.kv_heads) * s.head_dim;
    matrix(p + "self_attn.q_proj.weight", 2 * q_dim, h);
    matrix(p + "self_attn.k_proj.weight", kv_dim, h);
    matrix(p + "self_attn.v_proj.weight", kv_dim, h);
    matrix(p + "self_attn.o_proj.weight", h, q_dim);
    add(p + "self_attn.q_norm.weight", {s.head_dim}, 0.1f, 0.0f);
    add(p + "self_attn.k_norm.weight", {s.head_dim}, 0.1f, 0.0f);
  }
  matrix(p + "mlp.shared_expert.gate_proj.weight", s.shared_intermediate, h);
  matrix(p + "mlp.shared_expert.up_proj.weight", s.shared_intermediate, h);
  matrix(p + "mlp.shared_expert.down_proj.weight", h, s.shared_intermediate);
  matrix(p + "mlp.shared_expert_gate.weight", 1, h);
}

// What the Qwen3.5 MoE models share: 3 Gated DeltaNet layers to 1 gated attention, attention
// with 2 KV heads of 256 (a quarter of each rotated, theta 1e7), DeltaNet 16 key heads of 128 and
// `v_heads` value heads of 128, conv kernel 4, and a shared expert as wide as a routed one.
void qwen35_hybrid(SynthShape& s, int v_heads) {
  s.full_attention_interval = 4;
  s.linear_k_heads = 16;
  s.linear_v_heads = v_heads;
  s.linear_head_dim = 128;
  s.linear_conv_kernel = 4;
  s.shared_intermediate = s.moe_intermediate;
  s.partial_rotary = 0.25;
  s.rope_theta = 10000000.0;
}

}  // namespace

std::vector<std::string> synth_preset_names() {
  return {"tiny", "small", "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b"};
}

SynthShape synth_preset(const std::string& name) {
  SynthShape s;
  if (name == "tiny") {
    s = {512, 64, 2, 4, 2, 16, 8, 2, 32, 96, 0};
  } else if (name == "small") {
    s = {2048, 256, 4, 4, 2, 64, 32, 4, 256, 512, 0};
  } else if (name == "qwen3-30b-a3b") {
    s = {151936, 2048, 48, 32, 4, 128, 128, 8, 768, 6144, 0};
  } else if (name == "qwen3-235b-a22b") {
    s = {151936, 4096, 94, 64, 4, 128, 128, 8, 1536, 12288, 0};
  } else if (name == "qwen3.5-35b-a3b") {
    // Qwen3.5-35B-A3B's text model (Qwen3.6-35B-A3B has the same shape): 40 layers, 256 experts
    // of width 512 with 8 routed + 1 shared per token, hidden 2048, attention 16 query heads,
    // DeltaNet 32 value heads.
    s = {248320, 2048, 40, 16, 2, 256, 256, 8, 512, 0, 0};
    qwen35_hybrid(s, 32);
  } else if (name == "qwen3.5-397b-a17b") {
    // Qwen3.5-397B-A17B's text model (its public config.json): 60 layers, 512 experts of width
    // 1024 with 10 routed + 1 shared per token, hidden 4096, attention 32 query heads, DeltaNet
    // 64 value heads.
    s = {248320, 4096, 60, 32, 2, 256, 512, 10, 1024, 0, 0};
    qwen35_hybrid(s, 64);
  } else {
    std::string names;
    for (const auto& n : synth_preset_names()) names += (names.empty() ? "" : ", ") + n;
    fail("--preset: unknown preset '", name, "' (known: ", names, ")");
  }
  return s;
}

void write_synthetic_pack(const std::string& dir, const SynthShape& s, const SynthOptions& o) {
  const int bits = quant_bits(o.quant);
  if (o.hf && bits) fail("synth --hf writes bf16 experts (--quant bf16): each engine quantizes the checkpoint itself");
  if (bits && (s.hidden % o.group_size || s.moe_intermediate % o.group_size))
    fail("--group-size ", o.group_size, " must divide hidden (", s.hidden, ") and moe-intermediate (", s.moe_intermediate, ")");
  if (s.vocab < kByteTokens + 3) fail("--vocab must be at least ", kByteTokens + 3);
  if (s.heads % s.kv_heads) fail("--heads must be a multiple of --kv-heads");
  if (s.top_k > s.experts || s.top_k < 1) fail("--top-k must be in [1, --experts]");

  const bool hybrid = s.full_attention_interval > 0;
  if (hybrid && (s.first_dense || s.linear_k_heads < 1 || s.linear_v_heads % s.linear_k_heads ||
                 s.linear_head_dim < 1 || s.shared_intermediate < 1))
    fail("synth: a hybrid shape needs linear heads (value heads a multiple of key heads), a shared expert and no dense layers");
  const char* model_type = hybrid ? "qwen3_5_moe_text" : "qwen3_moe";
  std::optional<PackWriter> writer;
  std::string tmp;
  if (o.hf) {
    if (std::filesystem::exists(dir)) fail(dir, ": already exists (remove it first)");
    tmp = dir + ".tmp-" + std::to_string(getpid());
    std::filesystem::remove_all(tmp);
    std::filesystem::create_directories(tmp);
  } else {
    writer.emplace(dir, model_type, "moestream synth");
    tmp = writer->tmp_dir();
  }
  // Every file of the checkpoint goes to tmp, renamed to dir once complete; a failure removes it.
  struct RemoveUnlessDone {
    std::string path;
    bool done = false;
    ~RemoveUnlessDone() {
      std::error_code ec;
      if (!done && !path.empty()) std::filesystem::remove_all(path, ec);
    }
  } cleanup{o.hf ? tmp : std::string()};
  json mlp_only = json::array();
  for (int l = 0; l < s.first_dense; ++l) mlp_only.push_back(l);
  const int32_t eos = o.tokenizer_dir.empty() ? 258 : tokenizer_eos(o.tokenizer_dir, s.vocab);  // <|im_end|>
  json config = {{"architectures", {hybrid ? "Qwen3_5MoeForCausalLM" : "Qwen3MoeForCausalLM"}},
                 {"model_type", model_type},
                 {"vocab_size", s.vocab}, {"hidden_size", s.hidden},
                 {"intermediate_size", s.intermediate}, {"moe_intermediate_size", s.moe_intermediate},
                 {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
                 {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim},
                 {"num_experts", s.experts}, {"num_experts_per_tok", s.top_k},
                 {"norm_topk_prob", true}, {"decoder_sparse_step", 1}, {"mlp_only_layers", mlp_only},
                 {"tie_word_embeddings", false}, {"rms_norm_eps", 1e-6},
                 {"max_position_embeddings", 40960}, {"rope_theta", s.rope_theta},
                 {"hidden_act", "silu"}, {"torch_dtype", "bfloat16"}, {"eos_token_id", eos},
                 {"bos_token_id", nullptr},
                 {"moestream_synth", {{"seed", o.seed}, {"quant", o.quant}, {"zipf", o.zipf}}}};
  // layer_types: every interval-th layer full attention, as full_attention_interval says.
  const auto is_linear = [&](int l) { return hybrid && (l + 1) % s.full_attention_interval != 0; };
  if (hybrid) {
    json types = json::array();
    for (int l = 0; l < s.layers; ++l) types.push_back(is_linear(l) ? "linear_attention" : "full_attention");
    config.erase("mlp_only_layers");
    config.erase("decoder_sparse_step");
    config.erase("intermediate_size");
    config.update({{"layer_types", types}, {"full_attention_interval", s.full_attention_interval},
                   {"linear_num_key_heads", s.linear_k_heads}, {"linear_num_value_heads", s.linear_v_heads},
                   {"linear_key_head_dim", s.linear_head_dim}, {"linear_value_head_dim", s.linear_head_dim},
                   {"linear_conv_kernel_dim", s.linear_conv_kernel},
                   {"shared_expert_intermediate_size", s.shared_intermediate},
                   {"partial_rotary_factor", s.partial_rotary}, {"attention_bias", false}});
  }
  write_json(tmp + "/config.json", config);
  write_json(tmp + "/generation_config.json",
             {{"eos_token_id", {256, eos}}, {"do_sample", true}, {"temperature", 0.8},
              {"top_k", 40}, {"top_p", 0.95}});
  if (o.tokenizer_dir.empty()) {
    write_json(tmp + "/tokenizer.json", tokenizer_json(s.vocab));
    write_json(tmp + "/tokenizer_config.json",
               {{"add_bos_token", false}, {"bos_token", nullptr}, {"eos_token", "<|im_end|>"},
                {"tokenizer_class", "Qwen2Tokenizer"}});
  } else {
    for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
      std::error_code ec;
      std::filesystem::copy_file(o.tokenizer_dir + "/" + f, tmp + "/" + f, ec);
      if (ec) fail("--tokenizer: ", o.tokenizer_dir, "/", f, ": ", ec.message());
    }
  }

  // Non-expert weights (bf16): unit-variance embeddings, norms near 1, projections scaled by
  // 1/sqrt(fan_in). With --zipf, every embedding carries a constant in dimension 0 and each
  // router row reads it with a bias that falls with the expert's rank, so that (as with the
  // Gumbel-max trick) expert e is chosen about rank^-zipf as often as the first.
  Rng rng{o.seed};
  const float marker = o.zipf > 0 ? 4.0f : 0.0f;
  std::vector<std::vector<uint16_t>> storage;
  std::vector<TensorToWrite> tensors;
  // Large tensors are filled by several threads: each normal takes two draws from the counter-
  // based generator, so a chunk starting at element i starts from the state 2 * i draws on and
  // the values do not depend on the thread count.
  const int64_t n_threads = std::max(1u, std::thread::hardware_concurrency());
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float scale, float offset) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<uint16_t>& data = storage.emplace_back(size_t(n));
    const int64_t chunk = std::max<int64_t>(1 << 20, (n + n_threads - 1) / n_threads);
    std::vector<std::thread> workers;
    for (int64_t i0 = 0; i0 < n; i0 += chunk)
      workers.emplace_back([&, i0] {
        Rng r{rng.s + uint64_t(2 * i0) * Rng::kGamma};
        for (int64_t i = i0; i < std::min(n, i0 + chunk); ++i) data[size_t(i)] = f32_to_bf16(offset + scale * r.normal());
      });
    for (auto& w : workers) w.join();
    rng.s += uint64_t(2 * n) * Rng::kGamma;
    tensors.push_back({name, DType::BF16, std::move(shape), nullptr});
    return &data;
  };
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols, float gain = 1.0f) {
    return add(name, {rows, cols}, gain / std::sqrt(float(cols)), 0.0f);
  };
  const int64_t h = s.hidden, q_dim = int64_t(s.heads) * s.head_dim,
                kv_dim = int64_t(s.kv_heads) * s.head_dim;
  auto* embed = add("model.embed_tokens.weight", {s.vocab, h}, 1.0f, 0.0f);
  if (marker > 0)
    for (int64_t v = 0; v < s.vocab; ++v) (*embed)[size_t(v * h)] = f32_to_bf16(marker);
  const float router_gain = 3.0f;
  auto zipf_router = [&](std::vector<uint16_t>& router, int l) {
    if (marker <= 0) return;
    // The marker's share of the normalized hidden state shrinks as layers add to the residual.
    const float marker_in = marker / std::sqrt(1.0f + marker * marker / float(h) + 2.0f * float(l));
    for (int e = 0; e < s.experts; ++e) {
      const float bias = -float(o.zipf) * router_gain * std::log(float(e + 1));
      router[size_t(e * h)] = f32_to_bf16(bias / marker_in);
    }
  };
  // Qwen3.5 stores its RMSNorm weights zero-centred (applied as 1 + w), DeltaNet's gated norm
  // excepted.
  const float norm_offset = hybrid ? 0.0f : 1.0f;
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {h}, 0.1f, norm_offset);
    add(p + "post_attention_layernorm.weight", {h}, 0.1f, norm_offset);
    if (hybrid) {
      add_hybrid_layer(s, p, is_linear(l), add, matrix);
      zipf_router(*matrix(p + "mlp.gate.weight", s.experts, h, router_gain), l);
      continue;
    }
    matrix(p + "self_attn.q_proj.weight", q_dim, h);
    matrix(p + "self_attn.k_proj.weight", kv_dim, h);
    matrix(p + "self_attn.v_proj.weight", kv_dim, h);
    matrix(p + "self_attn.o_proj.weight", h, q_dim);
    add(p + "self_attn.q_norm.weight", {s.head_dim}, 0.1f, 1.0f);
    add(p + "self_attn.k_norm.weight", {s.head_dim}, 0.1f, 1.0f);
    if (l < s.first_dense) {
      matrix(p + "mlp.gate_proj.weight", s.intermediate, h);
      matrix(p + "mlp.up_proj.weight", s.intermediate, h);
      matrix(p + "mlp.down_proj.weight", h, s.intermediate);
      continue;
    }
    zipf_router(*matrix(p + "mlp.gate.weight", s.experts, h, router_gain), l);
  }
  add("model.norm.weight", {h}, 0.1f, norm_offset);
  matrix("lm_head.weight", s.vocab, h);
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].data = storage[i].data();
  // The checkpoint: the non-expert tensors in its first shard, each layer's experts in one more.
  const int n_shards = 1 + (s.layers - s.first_dense);
  json weight_map = json::object();
  uint64_t total_bytes = 0;
  auto shard = [&](int i, const std::vector<TensorToWrite>& ts) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", i + 1, n_shards);
    write_safetensors(tmp + "/" + name, ts, {{"format", "pt"}});
    for (const TensorToWrite& t : ts) {
      weight_map[t.name] = name;
      uint64_t n = 2;  // bf16
      for (int64_t d : t.shape) n *= uint64_t(d);
      total_bytes += n;
    }
  };
  if (o.hf) shard(0, tensors);
  else write_safetensors(tmp + "/weights.safetensors", tensors, {{"format", "pt"}});
  storage.clear();

  const std::string format = bits ? "q" + std::to_string(bits) + "g" + std::to_string(o.group_size) : "bf16";
  std::deque<std::vector<char>> bytes;  // deque: parts point into it as it grows
  std::vector<PackWriter::Part> parts;
  std::vector<TensorToWrite> layer_tensors;
  for (int l = s.first_dense; l < s.layers; ++l) {
    if (o.hf) bytes.clear();
    layer_tensors.clear();
    for (int e = 0; e < s.experts; ++e) {
      if (!o.hf) bytes.clear();
      parts.clear();
      random_matrix(rng, "gate", s.moe_intermediate, h, bits, o.group_size, bytes, parts);
      random_matrix(rng, "up", s.moe_intermediate, h, bits, o.group_size, bytes, parts);
      random_matrix(rng, "down", h, s.moe_intermediate, bits, o.group_size, bytes, parts);
      if (!o.hf) {
        writer->add_expert(l, format, parts);
        continue;
      }
      for (const PackWriter::Part& part : parts)
        layer_tensors.push_back({expert_tensor_name(ExpertNaming::Hub, l, e, part.role), part.dtype, part.shape,
                                 part.data, part.nbytes});
    }
    if (o.hf) shard(1 + l - s.first_dense, layer_tensors);
  }
  if (!o.hf) {
    writer->finish(s.layers);
    return;
  }
  write_json(tmp + "/model.safetensors.index.json",
             {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}});
  std::filesystem::rename(tmp, dir);
  cleanup.done = true;
}

}  // namespace moestream
