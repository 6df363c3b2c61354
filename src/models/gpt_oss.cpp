// gpt-oss (model_type "gpt_oss"): gpt-oss-20b, gpt-oss-120b, as published (MXFP4 experts) or in
// bf16.
//
// Each layer: x += attn(rmsnorm(x)); x += moe(rmsnorm(x)). Attention is grouped-query with biases
// on q/k/v/o, a learned per-head sink logit in every softmax, YaRN rotary embedding, and a sliding
// window on the layers that layer_types marks "sliding_attention". The router adds a bias to its
// logits, takes the top k and softmaxes over those k. Experts have biases and a clamped SwiGLU:
// gate <= limit, |up| <= limit, out = (up + 1) * gate * sigmoid(1.702 * gate). The checkpoint stacks
// each layer's experts as x @ W with gate and up in alternating columns; the pack stores them as
// [out, in] gate/up/down (see ExpertLayout). The published checkpoints store the experts in MXFP4
// (*_blocks, *_scales, with gate and up in alternating rows); the pack keeps them in MXFP4.
#include <regex>

#include "core/error.h"
#include "io/pack.h"
#include "models/moe_decoder.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct GptOssConfig : DecoderConfig {
  int64_t sliding_window;     // positions a sliding layer sees
  std::vector<bool> sliding;  // per layer: layer_types[l] == "sliding_attention"
  float swiglu_limit;         // clamp of the expert's gate and up projections

  explicit GptOssConfig(const HfConfig& c)
      : DecoderConfig(parse(c, {.rms_norm_eps = 1e-5, .max_position = 131072, .expert_size_field = "intermediate_size"})),
        sliding_window(c.get_int_in("sliding_window", 0, kMaxPositions, 0)),
        sliding(parse_layer_types(c, n_layers, "sliding_attention", "full_attention")),
        swiglu_limit(float(c.get_double("swiglu_limit", 7.0))) {
    // transformers' default: sliding and full layers alternate, starting with sliding.
    if (sliding.empty())
      for (int l = 0; l < n_layers; ++l) sliding.push_back(l % 2 == 0);
    for (bool s : sliding)
      if (s && sliding_window <= 0) fail(c.path(), ": sliding layers need a positive sliding_window");
  }
};

class GptOss final : public MoeDecoder {
 public:
  GptOss(const std::string& dir, const HfConfig& hf, const ModelOptions& options) {
    const GptOssConfig c(hf);
    open_pack(dir, hf, options, c);
    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    const int64_t h = c.hidden_size;
    load_embeddings(w, c.tie_word_embeddings);
    MoeParams routing{c.n_experts, c.top_k, RouterKind::TopKSoftmax};
    routing.activation = ExpertActivation::ClampedSwiGlu;
    routing.swiglu_limit = c.swiglu_limit;
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = layer_prefix(l);
      AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim};
      shape.options.sliding_window = c.sliding[size_t(l)] ? c.sliding_window : 0;
      MoeDecoderLayer layer = load_layer(w, l, shape);
      if (!layer.attn.sinks) fail("tensor ", p, "self_attn.sinks: missing");
      layer.ffn = routed_ffn(w.matrix(p + "mlp.router.weight", c.n_experts, h), routing,
                             w.vector(p + "mlp.router.bias", c.n_experts));
      layers_.push_back(std::move(layer));
    }
    finish_load(hf, options, c, ExpertNaming::Stacked);
    for (int l = 0; l < c.n_layers; ++l)
      for (int e = 0; e < c.n_experts; ++e)
        for (const std::string role : {"gate", "up", "down"}) {
          const std::vector<int64_t> want{1, role == "down" ? h : c.expert_size};
          const PackedTensor* b = pack_.expert(l, e).find(role + "_bias");
          if (!b || b->shape != want)
            fail("tensor ", expert_tensor_name(ExpertNaming::Stacked, l, e, role), " bias: expected shape ", shape_str(want), ", found ",
                 b ? shape_str(b->shape) : std::string("none"));
        }
  }
};

}  // namespace

std::optional<ExpertTensorRef> parse_gpt_oss_expert_tensor(const std::string& name) {
  static const std::regex re(R"(model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?)");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return std::nullopt;
  const int layer = std::stoi(m[1]);
  const std::string proj = m[2], suffix = m[3];
  const bool gate_up = proj == "gate_up_proj", bias = suffix == "_bias";
  if (suffix == "_blocks" || suffix == "_scales") {  // MXFP4: [E, out, in / 32, 16] and [E, out, in / 32]
    const std::string role = std::string(gate_up ? "gate_up" : "down") + (suffix == "_scales" ? ".scales" : "");
    return ExpertTensorRef{layer, -1, role, true, gate_up ? ExpertLayout::GateUpInterleavedRows : ExpertLayout::OutIn};
  }
  const std::string role = std::string(gate_up ? "gate_up" : "down") + (bias ? "_bias" : "");
  const ExpertLayout layout = gate_up ? ExpertLayout::GateUpInterleaved : bias ? ExpertLayout::OutIn : ExpertLayout::InOut;
  return ExpertTensorRef{layer, -1, role, true, layout};
}

std::unique_ptr<Model> load_gpt_oss(const std::string& dir, const HfConfig& config, const ModelOptions& options) {
  return std::make_unique<GptOss>(dir, config, options);
}

}  // namespace moestream
