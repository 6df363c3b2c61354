// Building blocks shared by the architecture files: weight lookup, rotary tables, grouped-query
// attention, and the decoder-only skeleton (batching, final norm, output head) every family uses.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "io/hf_config.h"
#include "io/pack.h"
#include "models/model.h"

namespace moestream {

class WeightSet;

// Looks tensors up by name once, checks their shape, and hands them to the backend.
class WeightLoader {
 public:
  // (bits, group_size) that config.json's quantization gives a module; (0, 0) when none.
  using QuantLookup = std::function<std::pair<int, int>(const std::string& module)>;

  WeightLoader(const WeightSet& weights, Backend& backend, QuantLookup quantization = {})
      : weights_(weights), backend_(backend), quantization_(std::move(quantization)) {}
  // A weight [rows, cols]: plain (f32/bf16/f16), or affine-quantized as MLX stores it
  // (<module>.weight U32 words with <module>.scales and <module>.biases).
  // Or block-scaled FP8 as a pack stores it (<module>.weight F8_E4M3 with <module>.scales F32
  // [rows, ceil(cols / G)], G from config.json's quantization_config.weight_block_size).
  Matrix matrix(const std::string& name, int64_t rows, int64_t cols);
  // Rows [row0, row0 + n) of the plain or FP8 weight `name` [rows, cols] as a matrix of their
  // own, named `label`.
  Matrix matrix_rows(const std::string& name, int64_t rows, int64_t cols, int64_t row0, int64_t n,
                     const std::string& label);
  // The values of the plain or FP8 weight `name` [rows, cols] as float32, row-major.
  std::vector<float> dense_f32(const std::string& name, int64_t rows, int64_t cols) const;
  Vector vector(const std::string& name, int64_t size);
  Vector optional_vector(const std::string& name, int64_t size);  // empty when absent
  bool has(const std::string& name) const;
  const WeightSet& weights() const { return weights_; }
  Backend& backend() { return backend_; }

 private:
  int fp8_group(const std::string& name, const std::string& module) const;  // G, or an error naming name

  const WeightSet& weights_;
  Backend& backend_;
  QuantLookup quantization_;
};

// config.json's MLX "quantization" (or "quantization_config"): a default and per-module
// overrides, as a lookup for WeightLoader.
WeightLoader::QuantLookup quantization_lookup(const HfConfig& config);

// Rotary tables for the rope types transformers implements that we support; others are an Error.
RopeTable make_rope_table(const RopeParams& params, int rot_dim, const std::string& config_path);
// YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1).
double yarn_mscale(double factor, double mscale);

// Activation buffers of one forward batch, preallocated for max_batch tokens.
struct Workspace {
  int64_t max_batch = 0;
  Buffer x, xn, attn_out, ffn_out;  // [max_batch, hidden]
  Buffer q, k, v;                   // [max_batch, heads * head_dim], [max_batch, kv_dim] x2
  Buffer logits;                    // [max_batch, vocab]
};

// Variants of GqaAttention that a family's config selects.
struct GqaOptions {
  bool qk_norm_whole = false;   // q_norm/k_norm span the whole projection (OLMoE), not one head
  float clip_qkv = 0;           // > 0: q, k, v projections clamped to +-clip_qkv (OLMoE)
  int64_t sliding_window = 0;   // > 0: each query sees only the last sliding_window positions
};

// Grouped-query attention: q/k/v projections (optional biases), optional RMSNorm of each q and k
// head (or of the whole projection), optional clamp, rotary embedding, causal softmax attention
// over the cache (optionally windowed, optionally with per-head sinks), output projection.
struct GqaAttention {
  Matrix q_proj, k_proj, v_proj, o_proj;
  Vector q_bias, k_bias, v_bias, o_bias;  // empty when the checkpoint has none
  Vector q_norm, k_norm;                  // RMSNorm weights [head_dim] (or [q_dim], [kv_dim]), or empty
  Vector sinks;                           // per-head sink logits [n_heads] (gpt-oss), or empty
  AttentionParams params;                 // heads, head_dim, scale, window
  GqaOptions options;
  float norm_eps = 1e-6f;

  static GqaAttention load(WeightLoader& w, const std::string& prefix, int64_t hidden,
                           int n_heads, int n_kv_heads, int head_dim, float norm_eps,
                           const GqaOptions& options = {});
  // out (T, hidden) = attention of x (T, hidden); k/v appended to the caches at n_past.
  void forward(Backend& be, Workspace& ws, const Buffer& x, Buffer& k_cache, Buffer& v_cache,
               int64_t n_past, const RopeTable& rope, Buffer& out) const;
};

// The KV cache of a decoder-only model: one K and one V buffer [capacity, kv_dim] per layer
// (V [capacity, v_dim] where values are narrower than keys). Rows at n_past and beyond are never
// read, so truncation only moves n_past and a snapshot copies n_past rows per buffer.
class KvSequence : public SequenceState {
 public:
  KvSequence(Backend& be, int n_layers, int64_t capacity, int64_t kv_dim);
  KvSequence(Backend& be, int n_layers, int64_t capacity, int64_t k_dim, int64_t v_dim);
  ~KvSequence() override;
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;
  int64_t capacity() const override { return capacity_; }
  using SequenceState::clone;
  std::unique_ptr<SequenceState> clone(int64_t capacity) const override;
  void restore(const SequenceState& snapshot) override;
  bool can_truncate(int64_t n) const override { return n >= 0 && n <= n_past; }
  void truncate(int64_t n) override;
  int64_t bytes() const override;
  std::vector<Buffer> k, v;

 private:
  Backend& be_;
  int64_t capacity_, k_dim_, v_dim_;
};

// Helpers for SequenceState implementations. Buffers with data == nullptr (a layer without that
// kind of state) are skipped; `what` names the buffers in errors ("K cache", "conv state").
// The first `rows` rows of each src buffer into dst, after checking that both lists have the same
// shape (count, columns) and that `rows` fits every buffer.
void copy_state_rows(Backend& be, const std::vector<Buffer>& src, std::vector<Buffer>& dst,
                     int64_t rows, const char* what);
int64_t state_bytes(const std::vector<Buffer>& buffers);  // rows * cols * 4 over the list
// Checks what every restore needs: the same backend (so the same model) and room for n_past.
void check_restore(const Backend& mine, const Backend& theirs, int64_t capacity, int64_t snapshot_n_past);
// The Error of truncate(n) where can_truncate(n) is false: n outside [0, n_past], or (for a
// state with recurrent layers) 0 < n < n_past.
[[noreturn]] void fail_truncate(int64_t n, int64_t n_past);

// Helpers the MoE families share.
struct PackManifest;
// A dense SwiGLU MLP: <prefix>{gate,up,down}_proj.weight, [inter, hidden] x2 and [hidden, inter].
MlpWeights load_mlp(WeightLoader& w, const std::string& prefix, int64_t hidden, int64_t inter);
// The pack has routed experts exactly for the layers marked in moe_layers, n_experts of them, each
// with gate/up [inter, hidden] and down [hidden, inter]; `tensor_name(layer, expert, role)` names
// the checkpoint tensor in errors.
void check_pack_experts(const PackManifest& pack, const std::vector<bool>& moe_layers, int n_experts,
                        int64_t hidden, int64_t inter,
                        const std::function<std::string(int, int, const std::string&)>& tensor_name);
// info.weight_bytes and info.active_bytes_per_token (non-expert weights plus top_k experts per MoE layer).
void set_weight_bytes(ModelInfo& info, const WeightSet& weights, const PackManifest& pack,
                      const std::vector<bool>& moe_layers, int n_experts, int top_k);

// Decoder-only language model skeleton: embedding -> layers -> final norm -> output head. A
// family implements load-time construction and run_layer; batching and logits live here.
class DecoderModel : public Model {
 public:
  const ModelInfo& info() const override { return info_; }
  Backend& backend() override { return *backend_; }
  void forward(std::span<const int32_t> tokens, SequenceState& state,
               std::span<float> logits) override;

 protected:
  // x (T, hidden) in ws.x is updated in place by layer l.
  virtual void run_layer(int layer, int64_t T, SequenceState& state) = 0;
  void init_workspace(int64_t max_batch, int64_t q_dim, int64_t kv_dim);

  // What open_pack takes from the family's config.
  struct Dims {
    std::string model_type;
    int64_t vocab_size = 0, hidden_size = 0;
    int n_layers = 0;
    int64_t max_position = 0;
    float norm_eps = 1e-6f;
  };
  // Opens the pack in `dir`: the backend, the manifest, the non-expert weights, and the ModelInfo
  // fields every family fills the same way (eos ids from config.json / generation_config.json).
  void open_pack(const std::string& dir, const HfConfig& hf, const ModelOptions& options,
                 const Dims& dims);
  // model.embed_tokens, model.norm and lm_head (the embedding when tied and lm_head is absent).
  void load_embeddings(WeightLoader& w, bool tie_word_embeddings);
  // ws_.x[:T] += attn(rmsnorm(ws_.x[:T])) for layer l, timed as the attention phase.
  void attention_residual(const Vector& norm, const GqaAttention& attn, KvSequence& seq, int l,
                          const RopeTable& rope, int64_t T);

  std::unique_ptr<Backend> backend_;
  PackManifest pack_;
  std::unique_ptr<WeightSet> weights_;
  ModelInfo info_;
  Workspace ws_;
  Matrix embed_tokens, lm_head;
  Vector final_norm;
  float norm_eps = 1e-6f;
};

}  // namespace moestream
