// The compute backend: where activations live and the operations the model code calls.
//
// Model code (src/models) never branches on the device: it loads its weights through
// Backend::load_matrix / load_vector, allocates activation buffers with Backend::alloc, and runs a
// forward pass as a list of the operations below. Each backend keeps op-level dispatch (SIMD
// variant, weight format, kernel choice) to itself. Buffers hold float32 activations, row-major
// [rows, cols]; one row per token.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/quant_format.h"
#include "core/tensor.h"
#include "core/timing.h"
#include "backend/kv_cache.h"

namespace moestream {

class ThreadPool;
class ExpertProvider;  // backend/expert_provider.h

// A weight matrix W (out, in) in its stored format, as the backend will read it.
// Plain: dtype F32/BF16/F16, data rows*cols elements.
// Affine (quant.bits > 0): dtype U32, data rows * (cols * bits / 32) words, scales and biases
//   rows * (cols / group_size) values of quant.scale_dtype.
// Mxfp4: dtype U8, data rows * cols / 2 bytes (a row's 16-byte blocks of 32 codes back to back,
//   which is the checkpoint's [rows, cols / 32, 16] *_blocks tensor), scales rows * cols / 32
//   E8M0 bytes (the *_scales tensor [rows, cols / 32]), biases nullptr.
// Fp8: dtype F8_E4M3, data rows * cols bytes, scales rows * ceil(cols / group_size) float32 (a
//   checkpoint's [ceil(rows / R), ceil(cols / G)] block scales repeated for each row of a block),
//   biases nullptr.
// A backend that cannot compute a scheme must refuse the matrix when it loads, naming it.
struct Matrix {
  std::string name;
  DType dtype = DType::BF16;
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;  // out features, in features (logical, unpacked)
  QuantFormat quant;
  const void* scales = nullptr;
  const void* biases = nullptr;
  explicit operator bool() const { return data != nullptr; }
};

// A float32 vector resident in the backend (norm weights, biases).
struct Vector {
  std::string name;
  const float* data = nullptr;
  int64_t size = 0;
  explicit operator bool() const { return data != nullptr; }
};

// Activations [rows, cols] in backend memory.
struct Buffer {
  float* data = nullptr;
  int64_t rows = 0, cols = 0;
  Buffer rows_view(int64_t begin, int64_t count) const {
    return Buffer{data + begin * cols, count, cols};
  }
};

// cos/sin tables for rotary embeddings: inv_freq per rotated pair and the attention factor.
struct RopeTable {
  std::vector<float> inv_freq;  // [rot_dim / 2]
  float attention_factor = 1.0f;  // multiplies cos and sin (YaRN)
  int rot_dim = 0;               // leading dims of each head that rotate
  bool interleaved = false;      // pairs (2i, 2i+1) instead of (i, i + rot_dim/2)
  int rot_offset = 0;            // dims of each head before the rotated ones (DeepSeek: nope first)
};

struct AttentionParams {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  float scale = 0;      // softmax scale, usually head_dim^-0.5
  int64_t n_past = 0;   // positions already in the cache before this call
  int v_head_dim = 0;   // width of each value head; 0: head_dim (MLA's values are narrower)
  int64_t sliding_window = 0;     // > 0: a query sees only the last sliding_window keys (itself included)
  const Vector* sinks = nullptr;  // per-head logit that joins each softmax denominator (gpt-oss)
  // Values are the first v_head_dim columns of each key head (MLA's latent): v and v_cache unused.
  bool values_in_keys = false;
  // How the caches store rows (backend/kv_cache.h): their cols are kv_row_words of the type, and
  // with a window their rows a ring (position j in row kv_slot(kv, j)).
  KvCacheSpec kv;
};

enum class RouterKind {
  SoftmaxTopK,  // softmax over all experts, take the top k (Qwen, Mixtral, OLMoE)
  // sigmoid scores; experts chosen by score + router_bias within the topk_group best of n_group
  // groups (a group scores the sum of its two best); weights are the unbiased scores (DeepSeek-V3, GLM-4.5)
  SigmoidGroupTopK,
  TopKSoftmax,  // logits (+ router_bias), take the top k, softmax over those k (gpt-oss)
};

enum class ExpertActivation {
  SwiGlu,         // silu(gate) * up
  ClampedSwiGlu,  // gpt-oss: gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate)
};

// A later MoE layer whose experts the lookahead guesses (MoeParams::ahead).
struct LookaheadGuess {
  const Matrix* router = nullptr;
  int layer = -1;
  int top_k = 0;
};

struct MoeParams {
  int n_experts = 0, top_k = 0;
  RouterKind router = RouterKind::SoftmaxTopK;
  bool norm_topk_prob = false;  // renormalize the k selected weights to sum to 1
  int layer = 0;                // for ExpertProvider::request
  const Vector* router_bias = nullptr;  // SigmoidGroupTopK: e_score_correction_bias; TopKSoftmax: logit bias
  int n_group = 1, topk_group = 1;      // SigmoidGroupTopK: experts in n_group groups, keep topk_group
  float routed_scaling_factor = 1.0f;   // multiplies the final routing weights
  ExpertActivation activation = ExpertActivation::SwiGlu;
  float swiglu_limit = 7.0f, swiglu_alpha = 1.702f;  // ClampedSwiGlu
  // Lossy options over the experts the provider has resident (ExpertProvider::resident), off by
  // default. cache_bias B: a resident expert's ranking score (the logit of softmax routers, the
  // biased sigmoid score of SigmoidGroupTopK) gets +B before the top k are picked; the chosen
  // experts' weights still come from the unbiased scores. miss_fallback: a token computes with
  // its chosen experts that are resident, their weights scaled to the sum of all the chosen
  // weights; the others go to ExpertProvider::fetch_later. A token with no resident expert
  // waits for all of them (exact).
  float cache_bias = 0.0f;
  bool miss_fallback = false;
  // Lookahead (ExpertProvider::wants_prefetch), exact: the next MoE layers, nearest first. The
  // backend applies each one's router to this call's input (float32 activations) and hands its
  // top_k best experts to ExpertProvider::prefetch once this call's own reads have started,
  // leaving out those it holds itself (the CUDA tier's VRAM). Set by the model on one-token steps
  // only.
  std::span<const LookaheadGuess> ahead;
};

// ids = the k largest of logits, best first, ties to the lower index (the lookahead's guess).
void top_k_ids(std::span<const float> logits, int k, std::vector<int>& ids);

struct MlpWeights {  // SwiGLU: down(silu(gate x) * up x)
  Matrix gate, up, down;
  Vector gate_bias, up_bias, down_bias;  // empty unless the checkpoint has them (gpt-oss experts)
};

// One expert's share of a MoE call computed apart from the call (Backend::expert_rows): its
// weights, the rows of x it takes, and where its output rows start.
struct ExpertRows {
  MlpWeights weights;
  std::vector<int64_t> tokens;  // rows of x, in the order of the output rows
  int64_t first_row = 0;        // output row of tokens[0]
};

// Column blocks of a buffer: block g starts at column offset + g * stride (stride 0 repeats one).
struct ColumnBlocks {
  int64_t offset = 0, stride = 0;
};

// Gated DeltaNet (the linear attention of Qwen3-Next / Qwen3.5), everything after the input
// projections. Channels of the fused qkv input: q [n_k_heads * k_head_dim], k [same], then v
// [n_v_heads * v_head_dim]; value head h reads key head h / (n_v_heads / n_k_heads).
struct DeltaNetParams {
  int n_k_heads = 0, n_v_heads = 0;
  int k_head_dim = 0, v_head_dim = 0;
  int conv_kernel = 0;     // taps of the causal depthwise conv1d
  float norm_eps = 1e-6f;  // of the gated RMSNorm
};

struct DeltaNetWeights {
  Vector conv;     // [conv_dim * conv_kernel], channel-major: tap j of channel c at c * kernel + j
  Vector A_log;    // [n_v_heads] log of the decay rate
  Vector dt_bias;  // [n_v_heads]
  Vector norm;     // [v_head_dim] gated RMSNorm weight, applied as w (not 1 + w)
};

// What a linear-attention layer carries from one forward call to the next.
struct DeltaNetState {
  Buffer conv;       // [conv_kernel - 1, conv_dim]: the latest conv inputs, oldest first
  Buffer recurrent;  // [n_v_heads * k_head_dim, v_head_dim]: S of each value head
};

// The argument checks of the Backend operations that every backend shares; each fails naming the
// tensor or the operation. load_matrix: t is a 2-D F32, BF16 or F16 tensor.
void check_matrix_tensor(const TensorView& t);
// load_vector: t is a 1-D F32, BF16 or F16 tensor.
void check_vector_tensor(const TensorView& t);
// load_quantized: checks the tensors against f (Backend::load_quantized's layouts; FP8 takes no
// biases, MXFP4 is refused: it reaches a backend only as a routed expert's view) and returns the
// Matrix over the tensors' own memory, for the backend to use in place or copy.
Matrix quantized_matrix_view(const TensorView& words, const TensorView& scales, const TensorView& biases,
                             const QuantFormat& f);
// copy_rows: same cols, 0 <= rows <= both buffers' rows, and no overlap of the rows copied.
void check_copy_rows(const Buffer& src, const Buffer& dst, int64_t rows);
// embed: out holds a row of table.cols per token, and every token id is a row of table.
void check_embed_args(std::span<const int32_t> tokens, const Matrix& table, const Buffer& out);
// Fails naming the mismatch unless the cache has room for q's T new positions after p.n_past (a
// ring always has) and k, v and the caches have the widths p's heads and p.kv give (v unused when
// p.values_in_keys). Every backend's attention() checks its arguments with it.
void check_attention_args(const Buffer& q, const Buffer& k, const Buffer& v, const Buffer& k_cache,
                          const Buffer& v_cache, const AttentionParams& p);

// One sequence's rows in Backend::attention_batch: rows [row0, row0 + rows) of q, k, v and out,
// at positions n_past.., appended to and attending over its own caches.
struct AttentionSpan {
  int64_t row0 = 0, rows = 0, n_past = 0;
  Buffer* k_cache = nullptr;
  Buffer* v_cache = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Time per phase since creation: the backend adds routing and expert compute, the model and
  // the generation loop add theirs.
  PhaseTimes& times() { return times_; }

  virtual Matrix load_matrix(const TensorView& t) = 0;  // t: [out, in]
  // Quantized. Affine: words [out, in * bits / 32] (U32), scales and biases [out, in / group].
  // Fp8: words F8_E4M3 [out, in], scales F32 [out, ceil(in / group)], biases empty (data null).
  virtual Matrix load_quantized(const TensorView& words, const TensorView& scales,
                                const TensorView& biases, const QuantFormat& format) = 0;
  virtual Vector load_vector(const TensorView& t) = 0;  // 1-D, converted to float32
  virtual Buffer alloc(int64_t rows, int64_t cols) = 0;  // zero-filled, lives as long as the backend
  virtual void free(Buffer& b) = 0;
  // Buffers that take memory as they grow (KV caches, SequenceState::reserve): the addresses of all
  // `rows` rows are reserved at once, so a buffer never moves, but memory stands behind the first
  // committed rows only, and nothing may touch the others. Rows committed anew read as zeros.
  // The defaults commit the whole buffer at once (alloc); free() releases either kind.
  virtual Buffer alloc_growable(int64_t rows, int64_t cols) { return alloc(rows, cols); }
  // Commits memory for the first `rows` rows of a growable buffer (never shrinks it); an Error
  // naming the KV memory when there is none left.
  virtual void commit_rows(Buffer& b, int64_t rows) {}
  // Gives back the memory behind the rows after the first `rows` (their contents are lost).
  virtual void decommit_rows(Buffer& b, int64_t rows) {}
  // Bytes that the first `rows` rows of a growable buffer of `cols` columns commit: rounded up to
  // the backend's unit (a page on the CPU, the driver's mapping granularity on CUDA).
  virtual int64_t growable_bytes(int64_t rows, int64_t cols) const {
    return rows * cols * int64_t(sizeof(float));
  }
  // Marks the first `rows` rows of growable buffer b final: nothing writes them again while b lives
  // (a prefix-cache snapshot). The backend may then lend their memory: copy_rows from b into
  // another growable buffer may map the same memory copy-on-write instead of copying it (a later
  // write to either side stays its own), and lent_bytes() tells how much of a buffer is borrowed
  // so. The default does nothing (copies copy).
  virtual void seal_rows(Buffer& b, int64_t rows) {}
  // Bytes at the start of growable buffer b that read a sealed buffer's memory lent by copy_rows,
  // while that buffer lives (memory it already holds); 0 by default.
  virtual int64_t lent_bytes(const Buffer& b) const { return 0; }
  // Rows of growable buffer b from `row` on are about to be written (called before the step that
  // writes them, never inside one): memory there that b borrows from a sealed buffer becomes its
  // own first, holding the same rows, where the backend cannot copy on write by itself (CUDA).
  // The default does nothing.
  virtual void own_rows(Buffer& b, int64_t row) {}
  // Sets `bytes` of memory aside for growable buffers now, before anything else sizes itself by the
  // memory left (the CUDA expert cache): commits take it from there and fail once it is used up.
  // The default does nothing (commits take memory from the system as they come).
  virtual void reserve_growable_pool(int64_t bytes) {}
  virtual void to_host(const Buffer& b, float* dst) = 0;
  // ids[r] = the greedy token of row r of x (ids.size() == x.rows): the lowest column holding the
  // row's largest value, as Sampler's greedy choice; -1 where the row holds a NaN or +inf, or only
  // -inf (the caller reads that row to say which). Only the ids reach the host (a decode step of
  // 8 sequences would otherwise copy and search 8 x 152k logits there). The default reads x back.
  virtual void greedy_rows(const Buffer& x, std::span<int32_t> ids);
  // Host memory for expert weights on their way to this backend (the ExpertStore's slots), 4096
  // aligned. The CUDA backend hands out pinned memory, which copies to the GPU at full PCIe speed.
  virtual void* alloc_host(size_t bytes) { return std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096); }
  virtual void free_host(void* p) { std::free(p); }
  // dst rows [0, rows) = src rows [0, rows): two distinct, non-overlapping buffers of this backend
  // with the same cols, rows <= src.rows and dst.rows (0 copies nothing); an Error otherwise.
  // Ordered like the compute ops: it sees what earlier ops wrote to src, later ops see dst.
  // Sequence snapshots are built on it (SequenceState::clone / restore / truncate).
  virtual void copy_rows(const Buffer& src, Buffer& dst, int64_t rows) = 0;

  // out[t] = table[tokens[t]]      table (vocab, dim)
  virtual void embed(std::span<const int32_t> tokens, const Matrix& table, Buffer& out) = 0;
  // RMSNorm over groups of `group` columns (group = cols: whole row; head_dim: per head).
  virtual void rmsnorm(const Buffer& x, const Vector& w, float eps, int64_t group, Buffer& out) = 0;
  // out (T, out) = x (T, in) @ W^T (+ bias)
  virtual void linear(const Buffer& x, const Matrix& w, const Vector* bias, Buffer& out) = 0;
  // Rotates each head of x (T, n_heads * head_dim) at positions n_past + t.
  virtual void rope(Buffer& x, int n_heads, int head_dim, const RopeTable& rope, int64_t n_past) = 0;
  // Appends k, v (T, kv_dim) to the caches at positions n_past.. (stored as p.kv says), then causal
  // attention of q (T, n_heads * head_dim) over positions [0, n_past + t] (those p.kv's window
  // keeps): out (T, n_heads * head_dim).
  virtual void attention(const Buffer& q, const Buffer& k, const Buffer& v, Buffer& k_cache,
                         Buffer& v_cache, const AttentionParams& p, Buffer& out) = 0;
  virtual void add(Buffer& x, const Buffer& y) = 0;  // x += y

  // Fused steps: each equals the calls its default makes (bit for bit in both backends), so model
  // code may use them everywhere; a backend overrides them to save passes over memory and launches.
  // out[i] = x @ w[i]^T (+ bias[i], when non-null) for matrices reading the same x (q, k and v).
  virtual void linear_shared_input(const Buffer& x, std::span<const Matrix* const> w,
                                   std::span<const Vector* const> bias, std::span<Buffer* const> out);
  // x += y, then out = RMSNorm(x) over whole rows (a residual add and the next norm).
  virtual void add_rmsnorm(Buffer& x, const Buffer& y, const Vector& w, float eps, Buffer& out);
  // out += sigmoid(x @ gate^T) * mlp(x, w): a shared expert scaled by its one-row gate (Qwen3-Next,
  // Qwen3.5). s (x.rows, out.cols) and g (x.rows, 1) are scratch: what mlp() and the gate write.
  virtual void gated_mlp_add(const Buffer& x, const MlpWeights& w, const Matrix& gate, Buffer& s, Buffer& g,
                             Buffer& out);
  // The MoE block of Qwen3-Next and Qwen3.5: moe(x, router, experts, p, out), then
  // gated_mlp_add(x, shared, gate, s, g, out). The shared expert does not depend on the routing,
  // so a backend may compute it while the routed experts run.
  virtual void moe_gated_shared(const Buffer& x, const Matrix& router, ExpertProvider& experts, const MoeParams& p,
                                const MlpWeights& shared, const Matrix& gate, Buffer& s, Buffer& g, Buffer& out);
  // q and k normalized per head of head_dim (each only when its weight is non-empty), then both
  // rotated at positions n_past + t (attention's query and key preparation).
  virtual void qk_norm_rope(Buffer& q, Buffer& k, const Vector& q_norm, const Vector& k_norm, float eps,
                            int n_heads, int n_kv_heads, int head_dim, const RopeTable& rope, int64_t n_past);
  // The attention of several sequences' rows in one call (a batched step): for each span,
  // qk_norm_rope of its rows at its n_past, then attention() over its caches with p.n_past set to
  // its n_past. The default makes those calls span by span.
  virtual void attention_batch(Buffer& q, Buffer& k, const Buffer& v, const Vector& q_norm, const Vector& k_norm,
                               float eps, const RopeTable& rope, std::span<const AttentionSpan> spans,
                               const AttentionParams& p, Buffer& out);
  virtual void clamp(Buffer& x, float limit) = 0;    // x = min(max(x, -limit), limit)
  // dst[t, to block g + i] = src[t, from block g + i] for g < blocks, i < width.
  virtual void copy_columns(const Buffer& src, ColumnBlocks from, Buffer& dst, ColumnBlocks to,
                            int64_t width, int64_t blocks) = 0;
  // One matrix per head: out[t, head h] (w[h].rows) = x[t, head h] (w[h].cols) @ w[h]^T.
  virtual void linear_per_head(const Buffer& x, std::span<const Matrix> w, Buffer& out) = 0;
  // out = dense SwiGLU MLP of x
  virtual void mlp(const Buffer& x, const MlpWeights& w, Buffer& out) = 0;
  // out[job.first_row + i] = expert(x[job.tokens[i]]) for every job (unweighted, with the expert
  // activation of p; weights in host memory): the CPU's share of a GPU's MoE call
  // (--cpu-experts). The CPU backend's, bit for bit as its moe() computes each expert; others fail.
  virtual void expert_rows(const Buffer& x, std::span<const ExpertRows> jobs, const MoeParams& p,
                           Buffer& out);
  // out = sum over the routed experts of weight * expert(x); router (n_experts, dim). The
  // experts' weights come from `experts` (request / next / release, backend/expert_provider.h).
  virtual void moe(const Buffer& x, const Matrix& router, ExpertProvider& experts,
                   const MoeParams& p, Buffer& out) = 0;
  // y[t, i] *= sigmoid(gate[t, i % gate.cols]): gate (T, y.cols) gates each element, gate (T, 1)
  // scales each row (the output gate of gated attention, the shared-expert gate).
  virtual void sigmoid_gate(Buffer& y, const Buffer& gate) = 0;
  // Gated DeltaNet over T tokens, continuing from `state` and updating it:
  //   qkv (T, conv_dim) -> causal conv1d + SiLU -> q, k L2-normalized per head, v
  //   g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)         a, b (T, n_v_heads)
  //   per value head: S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q / sqrt(k_head_dim)
  //   out (T, n_v_heads * v_head_dim) = RMSNorm(o) * norm * silu(z)     z (T, same)
  // Prefill may use a chunked form; it equals the token-by-token recurrence up to rounding.
  virtual void gated_delta_net(const Buffer& qkv, const Buffer& z, const Buffer& b, const Buffer& a,
                               const DeltaNetWeights& w, const DeltaNetParams& p,
                               DeltaNetState& state, Buffer& out) = 0;

 protected:
  PhaseTimes times_;
};

// precise: float32 activations everywhere (the default may quantize activations for speed).
// spin_micros: how long its threads poll for work before they sleep (ThreadPool).
std::unique_ptr<Backend> make_cpu_backend(int n_threads, bool precise,
                                          int spin_micros = 200);  // ThreadPool::kSpinMicros

}  // namespace moestream
