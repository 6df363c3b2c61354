#include "models/moe_decoder.h"

#include <algorithm>
#include <cstdio>

#include "backend/backend_factory.h"
#include "core/error.h"
#include "core/files.h"
#include "io/hf_config.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "text/sampler.h"

namespace moestream {

std::unique_ptr<SequenceState> MoeDecoder::new_sequence(int64_t capacity) {
  return std::make_unique<KvSequence>(*backend_, int(layers_.size()), capacity, kv_dim_, ws_.kv,
                                      attention_shape_.n_kv_heads);
}

MoeDecoderLayer MoeDecoder::load_layer(WeightLoader& w, int l, const AttentionShape& shape) {
  attention_shape_ = shape;
  const std::string p = layer_prefix(l);
  const int64_t h = info_.hidden_size;
  MoeDecoderLayer layer;
  layer.input_norm = w.vector(p + "input_layernorm.weight", h);
  layer.post_attention_norm = w.vector(p + "post_attention_layernorm.weight", h);
  layer.attn = GqaAttention::load(w, p + "self_attn.", h, shape.n_heads, shape.n_kv_heads, shape.head_dim,
                                  norm_eps, shape.options);
  return layer;
}

void MoeDecoder::finish_load(const HfConfig& hf, const ModelOptions& options, const DecoderConfig& c,
                             ExpertNaming naming) {
  const AttentionShape& a = attention_shape_;
  std::vector<bool> moe_layers;
  for (const MoeDecoderLayer& layer : layers_) moe_layers.push_back(layer.ffn.moe);
  load_experts(options, moe_layers, c.n_experts, c.expert_size, naming);
  rope_ = make_rope_table(c.rope, a.rot_dim > 0 ? a.rot_dim : a.head_dim, hf.path());
  kv_dim_ = int64_t(a.n_kv_heads) * a.head_dim;
  init_workspace(int64_t(a.n_heads) * a.head_dim, kv_dim_);
  set_weight_bytes(info_, *weights_, pack_, moe_layers, c.n_experts, c.top_k);
}

void MoeDecoder::run_layer(int l, int64_t T, std::span<const RowSpan> seqs) {
  const MoeDecoderLayer& layer = layers_[size_t(l)];
  Buffer x = ws_.x.rows_view(0, T), xn = ws_.xn.rows_view(0, T);
  // Layers run in order, and the residual add that ends each layer but the last (whose rows the
  // final norm takes, only those whose logits are wanted) also normalizes x for the next one.
  attention_residual(layer.input_norm, layer.attn, seqs, l, rope_, T, &layer.post_attention_norm, l > 0);
  layer.ffn.forward(*backend_, *experts_, ws_, l, xn, x, upcoming_moe_layers(layers_, l, ws_),
                    next_input_norm(layers_, l), norm_eps);
}


void DecoderModel::open_pack(const std::string& dir, const HfConfig& hf,
                             const ModelOptions& options, const DecoderConfig& c) {
  pack_ = PackManifest::load(dir);
  BackendOptions bo;
  bo.device = options.device;
  bo.threads = options.threads;
  bo.precise = options.precise || !options.int8_activations;
  bo.gpu_expert_mb = options.gpu_expert_mb;
  bo.cpu_expert_share = options.cpu_expert_share;
  bo.max_expert_bytes = pack_.max_expert_size();
  int64_t n_experts = 0;
  for (const auto& layer : pack_.layers) n_experts += int64_t(layer.size());
  const double all_bytes = double(n_experts) * double((pack_.max_expert_size() + 4095) / 4096 * 4096);
  const double available = memory_available();
  expert_cache_mb_ = default_expert_cache_mb(options.experts.cache_mb, all_bytes, available);
  if (options.experts.cache_mb < 0 && expert_cache_mb_ >= 0)
    std::fprintf(stderr,
                 "moestream: the experts take %.1f GB, more than 80%% of the %.1f GB of memory available: they "
                 "stream through a %.1f GB cache (--expert-cache-mb sets it)\n",
                 all_bytes / 1e9, available / 1e9, expert_cache_mb_ / 1e3);
  bo.host_expert_mb = expert_cache_mb_;
  bo.cache_policy = options.experts.policy;
  bo.profile = options.experts.profile;
  bo.pin_share = options.experts.pin_share;
  bo.total_experts = n_experts;
  backend_ = make_backend(bo);
  info_.max_batch = backend_->name().rfind("cuda", 0) == 0 ? kCudaMaxBatch : kCpuMaxBatch;
  if (options.wrap_backend) backend_ = options.wrap_backend(std::move(backend_));
  weights_ = std::make_unique<WeightSet>(pack_.open_weights());  // checks each resident tensor against the manifest
  info_.model_type = c.model_type;
  info_.dir = dir;
  info_.vocab_size = c.vocab_size;
  info_.n_layers = c.n_layers;
  info_.hidden_size = c.hidden_size;
  info_.max_position = c.max_position;
  info_.eos_token_ids = load_generation_defaults(dir, hf).eos_token_ids;
  norm_eps = c.rms_norm_eps;
  ws_.kv = options.kv;
}

void DecoderModel::load_embeddings(WeightLoader& w, bool tie_word_embeddings) {
  const int64_t vocab = info_.vocab_size, h = info_.hidden_size;
  embed_tokens = w.matrix("model.embed_tokens.weight", vocab, h);
  final_norm = w.vector("model.norm.weight", h);
  lm_head = tie_word_embeddings && !w.has("lm_head.weight") ? embed_tokens
                                                           : w.matrix("lm_head.weight", vocab, h);
}

void DecoderModel::attention_residual(const Vector& norm, const GqaAttention& attn,
                                      std::span<const RowSpan> seqs, int l, const RopeTable& rope, int64_t T,
                                      const Vector* next_norm, bool normed) {
  Backend& be = *backend_;
  ScopedTimer timer(be.times().attention);
  Buffer x = ws_.x.rows_view(0, T), xn = ws_.xn.rows_view(0, T), out = ws_.ffn_out.rows_view(0, T);
  if (!normed) be.rmsnorm(x, norm, norm_eps, x.cols, xn);
  attn.forward(be, ws_, xn, seqs, l, rope, out);
  if (next_norm) be.add_rmsnorm(x, out, *next_norm, norm_eps, xn);
  else be.add(x, out);
}

void DecoderModel::load_experts(const ModelOptions& options, const std::vector<bool>& moe_layers, int n_experts,
                                int64_t expert_size, ExpertNaming naming, const std::string& model) {
  check_pack_experts(pack_, moe_layers, n_experts, info_.hidden_size, expert_size,
                     [&](int l, int e, const std::string& role) { return expert_tensor_name(naming, l, e, role, model); });
  ExpertStoreOptions store = options.experts;
  store.cache_mb = expert_cache_mb_;
  experts_ = make_expert_store(pack_, *backend_, store);
  ws_.moe_top_k = options.moe_top_k;
  ws_.lookahead_depth = options.experts.lookahead ? options.experts.lookahead_depth : 0;
  // The CUDA tier routes on the device and has no residency test yet.
  if ((options.experts.miss_fallback || options.experts.cache_bias != 0.0f) && backend_->name().rfind("cpu", 0) != 0)
    fail("--miss-fallback and --cache-bias work on the CPU backend only (use --device cpu)");
  ws_.miss_fallback = options.experts.miss_fallback;
  ws_.cache_bias = options.experts.cache_bias;
}

void DecoderModel::init_workspace(int64_t q_dim, int64_t kv_dim) {
  Backend& be = *backend_;
  const int64_t h = info_.hidden_size, max_batch = info_.max_batch;
  ws_.max_batch = max_batch;
  ws_.x = be.alloc(max_batch, h);
  ws_.xn = be.alloc(max_batch, h);
  ws_.attn_out = be.alloc(max_batch, std::max(h, q_dim));
  ws_.ffn_out = be.alloc(max_batch, h);
  ws_.q = be.alloc(max_batch, q_dim);
  ws_.k = be.alloc(max_batch, kv_dim);
  ws_.v = be.alloc(max_batch, kv_dim);
  ws_.logits = be.alloc(max_batch, info_.vocab_size);
  ws_.shared_gate = be.alloc(max_batch, 1);
}

void DecoderModel::forward(std::span<const int32_t> tokens, SequenceState& state,
                           std::span<float> logits) {
  const SequenceBatch item{tokens, &state, logits};
  forward_batch(std::span(&item, 1));
}

void DecoderModel::forward_batch(std::span<const SequenceBatch> items) {
  const int64_t vocab = info_.vocab_size;
  for (size_t i = 0; i < items.size(); ++i) {
    const SequenceBatch& it = items[i];
    const int64_t n = int64_t(it.tokens.size());
    if (!it.state) fail("forward: item ", i, " of the batch has no sequence state");
    if (it.greedy && !it.logits.empty()) fail("forward: item ", i, " asks for logits and a greedy token; give one");
    if (!it.greedy && int64_t(it.logits.size()) != n * vocab && int64_t(it.logits.size()) != vocab)
      fail("forward: logits span holds ", it.logits.size(), " floats, expected ", vocab, " or ", n * vocab);
    if (it.state->n_past + n > it.state->capacity())
      fail("context full: ", it.state->n_past + n, " positions needed, the sequence holds ", it.state->capacity());
    for (int32_t t : it.tokens)
      if (t < 0 || t >= vocab) fail("token id ", t, " out of range [0, ", vocab, ")");
    for (size_t j = 0; j < i; ++j)
      if (items[j].state == it.state && n > 0 && !items[j].tokens.empty())
        fail("forward: one sequence state appears twice in a batch (items ", j, " and ", i, ")");
  }
  // Memory for the positions this call writes, before any operation (a decode step may become
  // a CUDA graph, and committing memory is no stream operation).
  for (const SequenceBatch& it : items)
    it.state->reserve(it.state->n_past + int64_t(it.tokens.size()));
  Backend& be = *backend_;
  done_.assign(items.size(), 0);
  for (;;) {
    // The next pass: the items' remaining tokens in order, up to max_batch rows.
    pass_tokens_.clear();
    pass_spans_.clear();
    pass_items_.clear();
    int64_t T = 0;
    for (size_t i = 0; i < items.size() && T < ws_.max_batch; ++i) {
      const int64_t left = int64_t(items[i].tokens.size()) - done_[i];
      if (left <= 0) continue;
      const int64_t m = std::min(left, ws_.max_batch - T);
      const auto* first = items[i].tokens.data() + done_[i];
      pass_tokens_.insert(pass_tokens_.end(), first, first + m);
      pass_spans_.push_back({T, m, items[i].state});
      pass_items_.push_back(int64_t(i));
      T += m;
    }
    if (T == 0) break;
    Buffer x = ws_.x.rows_view(0, T);
    {
      ScopedTimer timer(be.times().embed);
      be.embed(pass_tokens_, embed_tokens, x);
    }
    for (int l = 0; l < info_.n_layers; ++l) run_layer(l, T, pass_spans_);
    for (const RowSpan& s : pass_spans_) s.state->n_past += s.rows;

    // Only the rows whose logits are wanted go through the norm and the output head, stacked
    // in pass order.
    // Rows that follow each other in x (a batch of decode rows) go through one norm call.
    ScopedTimer timer(be.times().output_head);
    int64_t rows = 0, run_first = 0, run_rows = 0;
    auto norm_run = [&] {
      if (run_rows == 0) return;
      Buffer xs = ws_.x.rows_view(run_first, run_rows), xn = ws_.xn.rows_view(rows - run_rows, run_rows);
      be.rmsnorm(xs, final_norm, norm_eps, xs.cols, xn);
      run_rows = 0;
    };
    for (size_t k = 0; k < pass_spans_.size(); ++k) {
      const RowSpan& s = pass_spans_[k];
      const SequenceBatch& it = items[size_t(pass_items_[k])];
      const int64_t n = int64_t(it.tokens.size());
      const bool all = !it.greedy && int64_t(it.logits.size()) == n * vocab;
      const bool last = done_[size_t(pass_items_[k])] + s.rows == n;
      if (!all && !last) continue;
      const int64_t first = all ? s.row0 : s.row0 + s.rows - 1, count = all ? s.rows : 1;
      if (run_rows > 0 && first != run_first + run_rows) norm_run();
      if (run_rows == 0) run_first = first;
      run_rows += count;
      rows += count;
    }
    norm_run();
    if (rows > 0) {
      Buffer xn = ws_.xn.rows_view(0, rows), out = ws_.logits.rows_view(0, rows);
      be.linear(xn, lm_head, nullptr, out);
      // Greedy items take their ids from one search over the pass's rows on the backend; the
      // others one copy of the logits to the host for the whole pass (on a GPU each is a
      // synchronization), unless a single item takes every row.
      bool any_greedy = false, any_logits = false;
      for (int64_t k : pass_items_) (items[size_t(k)].greedy ? any_greedy : any_logits) = true;
      if (any_greedy) {
        pass_ids_.resize(size_t(rows));
        be.greedy_rows(out, pass_ids_);
      }
      const bool gathered = any_logits && pass_spans_.size() > 1;
      if (gathered) {
        pass_logits_.resize(size_t(rows * vocab));
        be.to_host(out, pass_logits_.data());
      }
      rows = 0;
      for (size_t k = 0; k < pass_spans_.size(); ++k) {
        const RowSpan& s = pass_spans_[k];
        const size_t i = size_t(pass_items_[k]);
        const SequenceBatch& it = items[i];
        const int64_t n = int64_t(it.tokens.size());
        const bool all = !it.greedy && int64_t(it.logits.size()) == n * vocab;
        if (!all && done_[i] + s.rows != n) continue;
        const int64_t count = all ? s.rows : 1;
        if (it.greedy) {
          *it.greedy = pass_ids_[size_t(rows)];
          if (*it.greedy < 0) {  // NaN, +inf or nothing above -inf: the sampler's words for it
            std::vector<float> row(static_cast<size_t>(vocab));
            be.to_host(out.rows_view(rows, 1), row.data());
            *it.greedy = greedy_choice(row);
          }
        } else {
          float* dst = it.logits.data() + (all ? done_[i] * vocab : 0);
          if (gathered)
            std::copy_n(pass_logits_.data() + rows * vocab, size_t(count * vocab), dst);
          else
            be.to_host(out.rows_view(rows, count), dst);
        }
        rows += count;
      }
    }
    for (size_t k = 0; k < pass_spans_.size(); ++k) done_[size_t(pass_items_[k])] += pass_spans_[k].rows;
  }
}

}  // namespace moestream
