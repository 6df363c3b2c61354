// Building blocks shared by the architecture files: weight lookup, rotary tables, grouped-query
// attention, the MoE feed-forward, KV-cache sequences and checkpoint names. The decoder skeleton
// that puts them together is in moe_decoder.h.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "experts/expert_store.h"
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
  Buffer shared_gate;               // [max_batch, 1]: logit of a sigmoid-gated shared expert
  int moe_top_k = 0;                // ModelOptions::moe_top_k (applied by MoeFeedForward::forward)
  int lookahead_depth = 0;          // MoE layers guessed ahead (upcoming_moe_layers); 0: no lookahead
  std::vector<LookaheadGuess> ahead;  // upcoming_moe_layers' list, kept between calls
  KvCacheSpec kv;                   // ModelOptions::kv: how attention layers store K and V
  bool miss_fallback = false;       // ExpertStoreOptions' lossy routing options (MoeFeedForward::forward)
  float cache_bias = 0.0f;
  std::vector<AttentionSpan> attention_spans;  // GqaAttention::forward's, kept between calls
};

// One sequence's rows in a forward pass: rows [row0, row0 + rows) of the workspace hold its
// tokens at positions state->n_past.. (n_past advances after the last layer). Everything
// row-wise runs over all rows of a pass at once; what depends on the sequence (rotary positions,
// its caches, recurrent state) runs per RowSpan.
struct RowSpan {
  int64_t row0 = 0, rows = 0;
  SequenceState* state = nullptr;
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
  // out (T, hidden) = attention of x (T, hidden), the rows of `seqs` (KvSequence states): each
  // span's k/v appended to its layer-l caches at its n_past, its queries attending to them.
  void forward(Backend& be, Workspace& ws, const Buffer& x, std::span<const RowSpan> seqs, int l,
               const RopeTable& rope, Buffer& out) const;
};

// How many positions of a sequence's K and V caches hold memory (KvSequence's and HybridSequence's
// reserve, trim and bytes_at): grown by reserve(), cut back to n_past by trim(). A position takes
// a row of each cache (of a ring: at most its rows); buffers without data (layers without a
// cache) are skipped.
struct KvReservation {
  int64_t positions = 0;
  void reserve(Backend& be, const KvCacheSpec& kv, std::vector<Buffer>& k, std::vector<Buffer>& v, int64_t n);
  void trim(Backend& be, const KvCacheSpec& kv, std::vector<Buffer>& k, std::vector<Buffer>& v, int64_t n_past);
  // Memory of the first n positions, less what another (sealed) state lends (Backend::lent_bytes).
  static int64_t bytes_at(const Backend& be, const KvCacheSpec& kv, const std::vector<Buffer>& k,
                          const std::vector<Buffer>& v, int64_t n);
  // Seals the rows of the first n positions of each buffer (SequenceState::seal).
  static void seal(Backend& be, std::vector<Buffer>& k, std::vector<Buffer>& v, int64_t n);
  // Before positions from n_past on are written: the rows they may write are each buffer's own
  // (Backend::own_rows); a ring's from its first row past the sinks, where it wraps to.
  static void own(Backend& be, const KvCacheSpec& kv, std::vector<Buffer>& k, std::vector<Buffer>& v, int64_t n_past);
};

// The KV cache of a decoder-only model: one K and one V buffer per layer, rows of
// kv_row_words(kv.type, k_dim, heads) words (V: v_dim, where values are narrower than keys), one
// per position, or with a KV window sinks + window rows (a ring). Rows at n_past and beyond are
// never read, so truncation only moves n_past and a snapshot copies n_past rows per buffer.
class KvSequence : public SequenceState {
 public:
  KvSequence(Backend& be, int n_layers, int64_t capacity, int64_t kv_dim, const KvCacheSpec& kv = {}, int heads = 1);
  KvSequence(Backend& be, int n_layers, int64_t capacity, int64_t k_dim, int64_t v_dim, const KvCacheSpec& kv,
             int heads);
  ~KvSequence() override;
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;
  int64_t capacity() const override { return capacity_; }
  using SequenceState::clone;
  std::unique_ptr<SequenceState> clone(int64_t capacity) const override;
  void restore(const SequenceState& snapshot) override;
  void restore_prefix(const SequenceState& snapshot, int64_t n) override;
  void seal() override;
  bool can_truncate(int64_t n) const override;
  void truncate(int64_t n) override;
  int64_t bytes() const override;
  void reserve(int64_t positions) override;
  void trim() override;
  int64_t held_bytes() const override;
  int64_t bytes_at(int64_t positions) const override;
  std::vector<Buffer> k, v;

 private:
  Backend& be_;
  int64_t capacity_, k_dim_, v_dim_;
  KvCacheSpec kv_;
  int heads_;
  KvReservation reserved_;
};

// One layer's K or V cache for capacity positions of cols values in heads heads, stored as kv says
// (with kv.growable a buffer that holds memory for the positions reserved).
Buffer alloc_kv_cache(Backend& be, const KvCacheSpec& kv, int64_t capacity, int64_t cols, int heads);

// Rows of a snapshot at n_past that hold its positions (all n_past, or the whole ring once it wrapped).
inline int64_t kv_rows_used(const std::vector<Buffer>& caches, int64_t n_past) {
  for (const Buffer& b : caches)
    if (b.data) return std::min(n_past, b.rows);
  return n_past;
}

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
// Bytes of the input embedding table that a decoded token does not read: all but its one row,
// unless the table is also the output head (no lm_head.weight: tied).
int64_t unread_embedding_bytes(const WeightSet& weights);
// info.weight_bytes and info.active_bytes_per_token (non-expert weights but the embedding rows a
// token does not read, plus top_k experts per MoE layer).
void set_weight_bytes(ModelInfo& info, const WeightSet& weights, const PackManifest& pack,
                      const std::vector<bool>& moe_layers, int n_experts, int top_k);

// The feed-forward half of a layer: routed experts, optionally with a shared expert added after
// them, or a dense SwiGLU MLP.
struct MoeFeedForward {
  bool moe = false;
  Matrix router;        // [n_experts, hidden]                                  (moe layers)
  Vector router_bias;   // gpt-oss logit bias / DeepSeek, GLM e_score_correction_bias, or empty
  MlpWeights shared;    // shared experts, or empty
  Matrix shared_gate;   // [1, hidden]: shared expert scaled by sigmoid(shared_gate x) (Qwen3-Next), or empty
  MoeParams routing;    // how tokens are routed (MoeParams::layer is set per call)
  MlpWeights dense;     //                                                      (dense layers)

  // x (T, hidden) += ffn(xn) for layer l; ws.ffn_out, ws.attn_out (shared expert) and
  // ws.shared_gate are scratch. `ahead`, the next MoE layers (upcoming_moe_layers), let the store
  // read ahead while this layer computes: on one-token steps whose store wants guesses, the
  // backend guesses from their routers (MoeParams::ahead). ws.miss_fallback and
  // ws.cache_bias apply to decode steps (one token) with a bounded store only: a prefill batch's
  // tokens choose most of a layer's experts, which it reads anyway. With next_norm (the next
  // layer's input norm, eps), the last residual add also writes ws.xn = rmsnorm(x) with it, fused
  // (Backend::add_rmsnorm, the same values as add then rmsnorm).
  void forward(Backend& be, ExpertStore& experts, Workspace& ws, int l, const Buffer& xn, Buffer& x,
               std::span<const LookaheadGuess> ahead = {}, const Vector* next_norm = nullptr,
               float eps = 0.0f) const;
};

// The lookahead's guesses from layer l (MoeFeedForward::forward's `ahead`): the first
// ws.lookahead_depth layers after l whose feed-forward is MoE (layers[i].ffn), nearest first, each
// with its router and top k (at most ws.moe_top_k), in ws.ahead.
template <class Layers>
std::span<const LookaheadGuess> upcoming_moe_layers(const Layers& layers, int l, Workspace& ws) {
  ws.ahead.clear();
  for (size_t i = size_t(l) + 1; i < layers.size() && int(ws.ahead.size()) < ws.lookahead_depth; ++i) {
    const MoeFeedForward& f = layers[i].ffn;
    if (!f.moe) continue;
    int top_k = std::min<int>(f.routing.top_k, int(f.router.rows));
    if (ws.moe_top_k > 0) top_k = std::min(top_k, ws.moe_top_k);
    ws.ahead.push_back({&f.router, int(i), top_k});
  }
  return ws.ahead;
}

// layers[l + 1].input_norm, which layer l's last residual add computes with it
// (MoeFeedForward::forward's next_norm); null for the last layer.
template <class Layers>
const Vector* next_input_norm(const Layers& layers, int l) {
  return size_t(l) + 1 < layers.size() ? &layers[size_t(l) + 1].input_norm : nullptr;
}

// Routed experts alone (no shared experts): router [n_experts, hidden] and optional logit bias.
MoeFeedForward routed_ffn(Matrix router, const MoeParams& routing, Vector router_bias = {});

// DeepSeek-V3 / GLM-4.5 feed-forward of layer prefix p ("model.layers.L."): routed experts with
// p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias" and shared experts
// p + "mlp.shared_experts.*" [shared_inter] when moe, else the dense MLP p + "mlp.*" [dense_inter].
MoeFeedForward load_shared_expert_ffn(WeightLoader& w, const std::string& p, bool moe, int64_t hidden,
                                      int64_t dense_inter, int64_t shared_inter, const MoeParams& routing);

// Routing of the sigmoid-scored families: SigmoidGroupTopK over n_group groups, keeping
// topk_group of them, weights optionally renormalized, then scaled.
MoeParams sigmoid_group_routing(int n_experts, int top_k, bool norm_topk_prob, int n_group, int topk_group,
                                float routed_scaling_factor);

// Checkpoint names. `model` is the decoder's prefix: "model." (or, for multimodal checkpoints,
// "model.language_model." / "language_model.model.").
// "<model>layers.<l>."
inline std::string layer_prefix(int l, const std::string& model = "model.") {
  return model + "layers." + std::to_string(l) + ".";
}
// How a checkpoint names routed expert weights (for errors about the pack's experts).
enum class ExpertNaming {
  Hub,      // mlp.experts.<e>.{gate,up,down}_proj.weight (Qwen, OLMoE, GLM, DeepSeek)
  Mixtral,  // block_sparse_moe.experts.<e>.w1 / w3 / w2.weight (gate / up / down)
  Stacked,  // mlp.experts.gate_up_proj[<e>] / down_proj[<e>], all experts in one tensor (gpt-oss)
};
// The tensor holding `role` ("gate", "up" or "down") of expert e in layer l.
std::string expert_tensor_name(ExpertNaming naming, int l, int e, const std::string& role,
                               const std::string& model = "model.");

}  // namespace moestream
