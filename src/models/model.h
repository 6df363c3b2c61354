// What every architecture offers: load from a model directory, start a sequence, run tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/kv_cache.h"
#include "experts/expert_store.h"

namespace moestream {

class Backend;

struct ModelOptions {
  int threads = 0;       // CPU threads; 0 = one per hardware thread
  bool precise = false;  // keep activations in float32 everywhere (the default path may not)
  bool int8_activations = false;  // quantized weights: int8 activations, integer dot products
  ExpertStoreOptions experts;  // expert cache budget, eviction policy, I/O method
  std::string device = "cpu";  // auto | cuda | cpu; gpu_expert_mb: VRAM expert slots (< 0: free VRAM minus a reserve)
  double gpu_expert_mb = -1;
  // CUDA with experts read in place from pinned RAM: the share of a decode step's missed expert
  // bytes computed on the CPU's `threads` threads while the GPU reads the rest (--cpu-experts;
  // 0: none). Not bit-identical to the GPU's own products (float32 rounding).
  double cpu_expert_share = 0;
  // Lossy: > 0 routes each token to at most this many experts (the model's top k at most), their
  // weights renormalized to sum to 1 (--moe-top-k; docs/PERFORMANCE.md has its quality).
  int moe_top_k = 0;
  // How attention layers store K and V (--kv-type) and which positions they keep (--kv-window,
  // --kv-sinks); the default, f32 with no window, is exact.
  KvCacheSpec kv;
  std::string cache_dir;       // where Hugging Face directories are packed; "" = default_cache_dir()
  // Wraps the backend the model makes (a decorator that watches its calls: pack --gptq's
  // calibration recorder); empty: the backend as made.
  std::function<std::unique_ptr<Backend>(std::unique_ptr<Backend>)> wrap_backend;
};

// $MOESTREAM_CACHE, else ~/.cache/moestream.
std::string default_cache_dir();

struct ModelInfo {
  std::string model_type;           // config.json model_type
  std::string dir;                  // where it was loaded from
  int64_t vocab_size = 0;           // rows of the output head
  int n_layers = 0;
  int64_t hidden_size = 0;
  int64_t max_position = 0;         // max_position_embeddings
  int64_t max_batch = 128;          // rows of one forward pass (longer inputs take several)
  std::vector<int32_t> eos_token_ids;  // generation stops on any of these
  int64_t weight_bytes = 0;         // bytes of all weights
  int64_t active_bytes_per_token = 0;  // bytes read per decoded token (non-expert + top-k experts)
};

// Everything a sequence carries between forward calls (KV caches, the conv and recurrent states
// of linear-attention layers), sized for `capacity` positions at creation. The state is one unit:
// a prefix cache snapshots it after a prompt, restores it later to skip recomputing that prompt,
// and cuts it back when a continuation diverges. Only the first n_past positions of a KV cache
// are meaningful; recurrent states summarize all n_past positions at once.
class SequenceState {
 public:
  virtual ~SequenceState() = default;
  int64_t n_past = 0;       // positions already processed
  virtual int64_t capacity() const = 0;

  // A deep copy of everything computed so far, sharing nothing with this state; forwarding
  // either leaves the other unchanged. clone() keeps the capacity; clone(capacity) sizes the
  // copy for `capacity` >= n_past positions (a snapshot need hold no more than n_past). Allocates.
  std::unique_ptr<SequenceState> clone() const { return clone(capacity()); }
  virtual std::unique_ptr<SequenceState> clone(int64_t capacity) const = 0;
  // Makes this state equal to `snapshot`: a state of the same model (from its new_sequence or a
  // clone of one) whose n_past fits this capacity. Copies only what the snapshot computed; never
  // allocates. An Error names the mismatch otherwise.
  virtual void restore(const SequenceState& snapshot) = 0;
  // restore(snapshot) cut to its first n positions (snapshot.can_truncate(n)): only those are
  // copied.
  virtual void restore_prefix(const SequenceState& snapshot, int64_t n) {
    restore(snapshot);
    if (n < n_past) truncate(n);
  }
  // Declares this state final (a prefix cache's entry): it is neither forwarded nor restored into
  // again, and the backend may lend its KV memory to the states restored from it instead of
  // copying it (Backend::seal_rows); those then count only what they hold alone (held_bytes).
  virtual void seal() {}
  // Whether truncate(n) can keep exactly the first n positions: any 0 <= n <= n_past for
  // attention-only models; with recurrent state only n == n_past (nothing to do) or n == 0 (a
  // fresh sequence), since the state after n positions is not kept once later ones are folded in.
  virtual bool can_truncate(int64_t n) const = 0;
  // Keeps the first n positions (n_past = n); an Error when !can_truncate(n). No allocation.
  virtual void truncate(int64_t n) = 0;
  // Bytes of backend memory this state may hold: with all capacity() positions.
  virtual int64_t bytes() const = 0;

  // The KV caches can take memory as a sequence grows (Backend::alloc_growable): a new state holds
  // its whole capacity, trim() gives back what positions past n_past hold, and reserve(n) commits
  // memory for the first n positions again (at most capacity()); forward does so before it writes,
  // and restore for the positions it copies. The engine trims its sequences, so they grow.
  virtual void reserve(int64_t positions) {}
  virtual void trim() {}
  // Bytes of backend memory held now (fixed states plus the committed KV rows), and with
  // `positions` positions committed (in the backend's units of commitment, so never less than held
  // for them).
  virtual int64_t held_bytes() const { return bytes(); }
  virtual int64_t bytes_at(int64_t positions) const { return bytes(); }
};

// One sequence's share of a batched forward step (Model::forward_batch).
struct SequenceBatch {
  std::span<const int32_t> tokens;  // at positions state->n_past..; may be empty (nothing to do)
  SequenceState* state = nullptr;   // distinct for every item of a batch
  std::span<float> logits;          // tokens.size() * vocab floats (every position) or vocab (the last)
  // Instead of logits (then empty): the last token's greedy choice, the lowest id of the largest
  // logit (as Sampler's at temperature 0, with its error for NaN, +inf or all -inf logits), found
  // where the logits are computed; only the id reaches the host.
  int32_t* greedy = nullptr;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelInfo& info() const = 0;
  virtual Backend& backend() = 0;
  virtual std::unique_ptr<SequenceState> new_sequence(int64_t capacity) = 0;
  virtual ExpertStats expert_stats() const = 0;
  // How often each routed expert was requested so far: [layer][expert] (ExpertStore::usage).
  virtual std::vector<std::vector<uint64_t>> expert_usage() const = 0;

  // Processes tokens at positions state.n_past.. and advances state.n_past. Writes the logits of
  // every token (logits.size() == tokens.size() * vocab) or, when logits.size() == vocab, of the
  // last token only. Long inputs are split into batches internally.
  virtual void forward(std::span<const int32_t> tokens, SequenceState& state,
                       std::span<float> logits) = 0;

  // Several sequences at once, as forward would run each: the decode tokens of some and the
  // prompt chunks of others go through the layers together, so each expert (and every other
  // weight) is read once per step for all of them. An item's logits may differ from its lone
  // forward in the last bits (the CPU kernels sum a batch of rows in another order than one row),
  // or by a code step with a compact --kv-type; tests/batch_test.cpp bounds both. Bad input (a logits span, a full context, a token id, a state
  // twice) is an Error before any state moves. The default runs forward per item.
  virtual void forward_batch(std::span<const SequenceBatch> items);
};

// Loads the model in `dir` with the architecture its config.json names (see registry.h). `dir` is
// a pack, or a Hugging Face directory that is packed into the cache on first use (ensure_pack).
std::unique_ptr<Model> load_model(const std::string& dir, const ModelOptions& options);

// The pack for `dir`: dir itself when it is a pack; for a Hugging Face directory, a pack under
// cache_dir/packs (made on first use, reused while the source files are unchanged).
std::string ensure_pack(const std::string& dir, const std::string& cache_dir);

}  // namespace moestream
