// Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5 (qwen3_next.cpp), and what a
// stack mixing it with full attention needs: the hybrid sequence state and the loaders for the
// checkpoints' layouts (fused projections regrouped per head, mlx-lm's norms stored as 1 + w).
//
//   qkv = in_proj_qkv x -> causal conv1d + SiLU (rolling conv state) -> L2-normalized q, k; the
//   gated delta rule with a [k_head_dim, v_head_dim] state per value head (value heads share key
//   heads, GQA-style); RMSNorm(o) * w * silu(in_proj_z x); out_proj.
#pragma once

#include <deque>
#include <string>
#include <vector>

#include "models/blocks.h"

namespace moestream {

// Linear-attention layer weights, in one layout whichever the checkpoint used.
struct LinearAttention {
  Matrix qkv_proj;  // [2 * key_dim + value_dim, hidden]: q | k | v
  Matrix z_proj;    // [value_dim, hidden]: gate of the output norm
  Matrix b_proj;    // [n_v_heads, hidden]: write strength, beta = sigmoid(b x)
  Matrix a_proj;    // [n_v_heads, hidden]: decay input
  Matrix out_proj;  // [hidden, value_dim]
  DeltaNetWeights weights;

  // From prefix p ("model.layers.L.linear_attn."): Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b,
  // in_proj_a (split), or Qwen3-Next's in_proj_qkvz and in_proj_ba with rows grouped per key
  // head, regrouped into `storage`.
  static LinearAttention load(WeightLoader& w, const std::string& p, int64_t hidden, const DeltaNetParams& dp,
                              bool split, std::deque<std::vector<char>>& storage);
};

// Activations of the linear attention for max_batch tokens.
struct DeltaNetBuffers {
  Buffer qkv, z, core, b, a;  // [max_batch, conv_dim], [.., value_dim] x2, [.., n_v_heads] x2
  static DeltaNetBuffers alloc(Backend& be, int64_t max_batch, const DeltaNetParams& dp);
};

// out (T, hidden) = Gated DeltaNet of x (T, hidden), the rows of `seqs` (HybridSequence states):
// projections over all rows, the recurrence per span continuing its layer-l state.
void linear_attention(Backend& be, const LinearAttention& d, const DeltaNetParams& dp, DeltaNetBuffers& buf,
                      const Buffer& x, std::span<const RowSpan> seqs, int l, Buffer& out);

// Widths of the DeltaNet activations.
inline int64_t deltanet_key_dim(const DeltaNetParams& d) { return int64_t(d.n_k_heads) * d.k_head_dim; }
inline int64_t deltanet_value_dim(const DeltaNetParams& d) { return int64_t(d.n_v_heads) * d.v_head_dim; }
inline int64_t deltanet_conv_dim(const DeltaNetParams& d) { return 2 * deltanet_key_dim(d) + deltanet_value_dim(d); }

// The KV cache of the full-attention layers and the conv and recurrent states of the linear ones,
// one sequence state: snapshots copy n_past KV rows and the (small, fixed-size) conv and recurrent
// states whole. A recurrent state cannot be rewound, so truncation keeps everything or resets to
// a fresh sequence, copying the model's zero state into each linear layer.
class HybridSequence final : public SequenceState {
 public:
  // linear_layer: per layer, true for linear attention; kv_dim: values per position of the
  // full-attention layers' K and V, in kv_heads heads, stored as kv says (blocks.h's
  // alloc_kv_cache); `zero`: a zero-filled DeltaNetState of one linear layer.
  // The model owns linear_layer and zero and outlives its sequences.
  HybridSequence(Backend& be, const std::vector<bool>& linear_layer, int64_t kv_dim, int64_t capacity,
                 const DeltaNetState& zero, const KvCacheSpec& kv = {}, int kv_heads = 1);
  ~HybridSequence() override;
  HybridSequence(const HybridSequence&) = delete;
  HybridSequence& operator=(const HybridSequence&) = delete;
  int64_t capacity() const override { return capacity_; }

  using SequenceState::clone;
  std::unique_ptr<SequenceState> clone(int64_t capacity) const override;
  void restore(const SequenceState& snapshot) override;
  void seal() override;
  bool can_truncate(int64_t n) const override { return n == n_past || n == 0; }
  void truncate(int64_t n) override;
  int64_t bytes() const override;
  void reserve(int64_t positions) override;
  void trim() override;
  int64_t held_bytes() const override;
  int64_t bytes_at(int64_t positions) const override;

  DeltaNetState delta(int l) { return DeltaNetState{conv[size_t(l)], recurrent[size_t(l)]}; }

  // Per layer; empty buffers where the layer has no state of that kind.
  std::vector<Buffer> k, v;                // [capacity, kv_dim] for full-attention layers
  std::vector<Buffer> conv, recurrent;     // DeltaNetState of linear-attention layers

 private:
  Backend& be_;
  const std::vector<bool>& linear_layer_;
  int64_t kv_dim_;
  const DeltaNetState& zero_;
  int64_t capacity_;
  KvCacheSpec kv_;
  int kv_heads_;
  KvReservation reserved_;
};

// A zero-centred RMSNorm weight w as the vector 1 + w (added in float32, as transformers does).
// mlx-lm's checkpoints already store 1 + w (`stored_with_offset`), read as they are.
Vector load_offset_norm(WeightLoader& w, const std::string& name, int64_t size, bool stored_with_offset);

// Whether the checkpoint is in mlx-lm's layout, whose sanitize step stores the zero-centred norm
// weights as 1 + w: told by the conv1d weights ([channels, kernel, 1]); where the two layouts
// coincide (a kernel of 1, or no linear-attention layer) by config.json's MLX quantization entry.
bool is_mlx_layout(const WeightSet& weights, const HfConfig& hf, const std::string& first_conv, int kernel);

// Row ranges [begin, begin + count) of a fused weight, taken in order.
struct RowRange {
  int64_t begin, count;
};

// Rows of the fused weight `name` [rows, cols], regrouped into one matrix; plain or MLX-quantized
// (the words, scales and biases of each row move together). The copy lives in `storage`.
Matrix regrouped_rows(WeightLoader& w, const std::string& name, int64_t rows, int64_t cols,
                      const std::vector<RowRange>& ranges, std::deque<std::vector<char>>& storage);

// Rows [offset, offset + width) of each of `groups` consecutive groups of `stride` rows.
std::vector<RowRange> strided(int64_t groups, int64_t stride, int64_t offset, int64_t width);

}  // namespace moestream
