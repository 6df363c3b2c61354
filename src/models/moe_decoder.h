// The decoder skeletons the families build on:
//
//   DecoderModel  embedding -> layers -> final norm -> output head, batched in chunks of
//                 info_.max_batch tokens; owns the backend, the pack, the non-expert weights and the
//                 expert store. A family loads its layers and implements run_layer (DeepSeek-V3
//                 with latent attention, Qwen3-Next / Qwen3.5 with Gated DeltaNet layers).
//   MoeDecoder    a DecoderModel whose every layer is x += attn(rmsnorm(x)); x += ffn(rmsnorm(x))
//                 with grouped-query attention (Mixtral, OLMoE, Qwen3-MoE, GLM-4.5, gpt-oss).
//                 A family parses its config, fills layers_ with the checkpoint's names, then
//                 calls finish_load; the forward pass is the same for all of them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "experts/expert_store.h"
#include "io/safetensors.h"  // WeightSet, destroyed with the model
#include "models/blocks.h"
#include "models/decoder_config.h"

namespace moestream {

class DecoderModel : public Model {
 public:
  const ModelInfo& info() const override { return info_; }
  Backend& backend() override { return *backend_; }
  ExpertStats expert_stats() const override { return experts_->stats(); }
  std::vector<std::vector<uint64_t>> expert_usage() const override { return experts_->usage(); }
  void forward(std::span<const int32_t> tokens, SequenceState& state,
               std::span<float> logits) override;
  // Passes of up to info().max_batch rows: the items' tokens stacked in order, an item that does
  // not fit continuing in the next pass.
  void forward_batch(std::span<const SequenceBatch> items) override;

 protected:
  // Rows per forward pass (the prefill chunk): 128 on the CPU; 512 on CUDA, whose tensor-core
  // expert kernels read each expert's weights once per pass (at 512 tokens a pass gives the
  // Qwen3-30B-A3B shape's experts 32 rows each instead of 8).
  static constexpr int64_t kCpuMaxBatch = 128, kCudaMaxBatch = 512;  // info_.max_batch

  // x (T, hidden) in ws.x is updated in place by layer l; T = the rows of seqs (in order, from 0).
  virtual void run_layer(int layer, int64_t T, std::span<const RowSpan> seqs) = 0;
  // ws_ for info_.max_batch tokens; q_dim and kv_dim size the attention projections.
  void init_workspace(int64_t q_dim, int64_t kv_dim);

  // Opens the pack in `dir`: the backend, the manifest, the non-expert weights, and the ModelInfo
  // fields every family fills the same way (eos ids from config.json / generation_config.json).
  void open_pack(const std::string& dir, const HfConfig& hf, const ModelOptions& options,
                 const DecoderConfig& c);
  // model.embed_tokens, model.norm and lm_head (the embedding when tied and lm_head is absent).
  void load_embeddings(WeightLoader& w, bool tie_word_embeddings);
  // Checks that the pack holds experts [expert_size wide] exactly for the layers marked in
  // moe_layers, then opens the expert store.
  void load_experts(const ModelOptions& options, const std::vector<bool>& moe_layers, int n_experts,
                    int64_t expert_size, ExpertNaming naming, const std::string& model = "model.");
  // ws_.x[:T] += attn(rmsnorm(ws_.x[:T])) for layer l, timed as the attention phase; with next_norm,
  // also ws_.xn[:T] = rmsnorm(ws_.x[:T]) with it (the FFN's input), fused with the add. normed:
  // ws_.xn[:T] already holds rmsnorm(ws_.x[:T]) with `norm` (the previous layer's last add wrote it).
  void attention_residual(const Vector& norm, const GqaAttention& attn, std::span<const RowSpan> seqs, int l,
                          const RopeTable& rope, int64_t T, const Vector* next_norm = nullptr, bool normed = false);

  std::unique_ptr<Backend> backend_;
  PackManifest pack_;
  std::unique_ptr<WeightSet> weights_;
  std::unique_ptr<ExpertStore> experts_;
  double expert_cache_mb_ = -1;  // the expert cache's budget (default_expert_cache_mb), host tier's on CUDA
  ModelInfo info_;
  Workspace ws_;
  Matrix embed_tokens, lm_head;
  Vector final_norm;
  float norm_eps = 1e-6f;

 private:
  // Scratch of forward_batch, kept between calls.
  std::vector<int32_t> pass_tokens_;
  std::vector<RowSpan> pass_spans_;
  std::vector<int64_t> pass_items_, done_;
  std::vector<float> pass_logits_;
  std::vector<int32_t> pass_ids_;
};

struct MoeDecoderLayer {
  Vector input_norm, post_attention_norm;
  GqaAttention attn;
  MoeFeedForward ffn;
};

class MoeDecoder : public DecoderModel {
 public:
  std::unique_ptr<SequenceState> new_sequence(int64_t capacity) override;

 protected:
  // Norms and attention of layer l from "model.layers.<l>.{input,post_attention}_layernorm" and
  // "model.layers.<l>.self_attn."; the family adds ffn.
  struct AttentionShape {
    int n_heads = 0, n_kv_heads = 0, head_dim = 0;
    int rot_dim = 0;  // rotated dims of each head (partial rotary); 0: head_dim
    GqaOptions options;
  };
  MoeDecoderLayer load_layer(WeightLoader& w, int l, const AttentionShape& shape);

  // After layers_ is filled: the pack holds experts of c's shape exactly for the MoE layers; the
  // expert store, rotary table, workspace and weight sizes.
  void finish_load(const HfConfig& hf, const ModelOptions& options, const DecoderConfig& c,
                   ExpertNaming naming = ExpertNaming::Hub);

  void run_layer(int l, int64_t T, std::span<const RowSpan> seqs) override;

  std::vector<MoeDecoderLayer> layers_;
  RopeTable rope_;
  AttentionShape attention_shape_;  // of every layer (load_layer records it)
  int64_t kv_dim_ = 0;
};

}  // namespace moestream
