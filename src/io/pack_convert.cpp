// write_pack: a Hugging Face checkpoint converted into a pack, one tensor at a time. The
// checkpoint's tensors are sorted into routed experts and resident tensors; each resident tensor
// is converted and written to weights.safetensors, then each expert, role by role, becomes one
// block of its layer's expert file (PackWriter).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/quant.h"
#include "core/thread_pool.h"
#include "io/gptq.h"
#include "io/pack.h"
#include "io/pack_format.h"
#include "io/pack_pipeline.h"
#include "io/pack_tensors.h"
#include "io/safetensors.h"

namespace moestream {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace packer;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string format_name(DType t) {
  switch (t) {
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::F32: return "f32";
    default: fail("expert tensors of dtype ", dtype_name(t), " cannot be packed yet");
  }
}

// config.json's "quantization" (MLX: a default {bits, group_size} and per-module overrides) or
// "quantization_config" (also its quant_method: "mxfp4" for gpt-oss, "fp8" for DeepSeek-V3 /
// Kimi-K2 with weight_block_size).
struct CheckpointQuantization {
  std::string method;
  std::vector<int64_t> fp8_block;  // fp8: [rows, cols] of a block sharing one scale_inv
  int bits = 0, group_size = 0;
  std::map<std::string, std::pair<int, int>> modules;
  std::pair<int, int> for_module(const std::string& module) const {
    auto it = modules.find(module);
    return it != modules.end() ? it->second : std::pair{bits, group_size};
  }
};

CheckpointQuantization read_quantization(const json& config) {
  CheckpointQuantization q;
  const json* j = config.contains("quantization") ? &config["quantization"]
                  : config.contains("quantization_config") ? &config["quantization_config"] : nullptr;
  if (!j || !j->is_object()) return q;
  if (j->contains("quant_method") && (*j)["quant_method"].is_string()) q.method = (*j)["quant_method"];
  if (q.method == "fp8") {
    if (j->value("fmt", "e4m3") != "e4m3")
      fail("config.json: quantization_config.fmt '", j->value("fmt", ""), "' is not supported (e4m3)");
    const json& bs = j->contains("weight_block_size") ? (*j)["weight_block_size"] : json();
    if (!bs.is_array() || bs.size() != 2 || !bs[0].is_number_integer() || !bs[1].is_number_integer() ||
        bs[0].get<int64_t>() <= 0 || bs[1].get<int64_t>() <= 0)
      fail("config.json: quantization_config.weight_block_size must be two positive integers for fp8");
    q.fp8_block = {bs[0].get<int64_t>(), bs[1].get<int64_t>()};
  }
  q.bits = j->value("bits", 0);
  q.group_size = j->value("group_size", 0);
  for (const auto& [key, value] : j->items())
    if (value.is_object() && value.contains("bits"))
      q.modules[key] = {value.value("bits", q.bits), value.value("group_size", q.group_size)};
  return q;
}

// The checkpoint being packed: its tensors, config.json and quantization.
struct Checkpoint {
  std::string dir;
  WeightSet weights;
  json config;
  CheckpointQuantization quant;
  // FP8 weights and their scale_inv tensors (quant_method "fp8"). They stay FP8 (codes and row
  // scales, QuantScheme::Fp8) unless --quant asks for another format: bf16 dequantizes them to
  // bf16, q<N> requantizes the experts (and with --quant-all the rest) from their exact float32
  // values. The scale_inv tensors themselves are not packed.
  std::map<const TensorView*, const TensorView*> fp8_scales;

  const json& text_config() const { return config.contains("text_config") ? config["text_config"] : config; }
  bool is_fp8_scale(const std::string& name) const {
    if (!ends_with(name, "_scale_inv")) return false;
    const std::string base = name.substr(0, name.size() - 10);
    return weights.has(base) && fp8_scales.count(&weights.get(base)) > 0;
  }
};

Checkpoint open_checkpoint(const std::string& src) {
  Checkpoint c{src, WeightSet::open_dir(src), {}, {}, {}};
  std::ifstream cfg(src + "/config.json");
  if (!cfg) fail(src, "/config.json: not found");
  c.config = json::parse(cfg, nullptr, false);
  if (!c.config.is_object()) fail(src, "/config.json: invalid JSON");
  c.quant = read_quantization(c.config);
  for (const auto& name : c.weights.names()) {
    const TensorView& t = c.weights.get(name);
    if (t.dtype != DType::F8_E4M3 && t.dtype != DType::F8_E5M2) continue;
    if (c.quant.method != "fp8" || t.dtype != DType::F8_E4M3)
      fail("tensor ", name, ": ", dtype_name(t.dtype), " weights are supported as block-scaled E4M3 with quantization_config "
           "{quant_method: fp8, fmt: e4m3}; config.json has quant_method '", c.quant.method, "'");
    if (!c.weights.has(name + "_scale_inv")) fail("tensor ", name, ": FP8 weight without ", name, "_scale_inv");
    c.fp8_scales[&t] = &c.weights.get(name + "_scale_inv");
  }
  return c;
}

using ExpertParts = std::map<std::string, ExpertSource>;  // role -> tensor

// The checkpoint's tensors sorted into routed experts and resident tensors.
struct SortedTensors {
  std::map<int, std::map<int, ExpertParts>> experts;  // [layer][expert]
  std::map<std::string, std::string> modules;         // "layer/role" -> checkpoint module (for its format)
  std::vector<const TensorView*> resident;
  uint64_t total_bytes = 0;
  int n_experts = 0;
};

SortedTensors sort_tensors(const Checkpoint& c, const ExpertTensorParser& parse, const PackOptions& options) {
  SortedTensors s;
  for (const auto& name : c.weights.names()) {
    if (options.skip && options.skip(name)) continue;
    if (c.is_fp8_scale(name)) continue;
    const TensorView& t = c.weights.get(name);
    s.total_bytes += t.nbytes;
    auto ref = parse(name);
    if (!ref) {
      s.resident.push_back(&t);
      continue;
    }
    const std::string module = name.substr(0, name.rfind('.'));
    if (ref->role.find('.') == std::string::npos) s.modules[std::to_string(ref->layer) + "/" + ref->role] = module;
    if (!ref->stacked) {
      auto& slot = s.experts[ref->layer][ref->expert][ref->role];
      if (slot.tensor) fail(c.dir, ": tensors ", slot.tensor->name, " and ", name, " are the same expert part");
      slot = ExpertSource{&t, -1, ref->layout};
      continue;
    }
    // Stacked biases [E, out]; weights [E, out, in], MXFP4 blocks [E, out, in / 32, 16].
    const bool bias = is_bias_role(ref->role);
    if (bias ? t.shape.size() != 2 : t.shape.size() < 3 || t.shape.size() > 4)
      fail("tensor ", name, ": stacked experts need ", bias ? "2" : "3 or 4", " dimensions, found ", shape_str(t.shape));
    if (c.fp8_scales.count(&t)) fail("tensor ", name, ": stacked FP8 experts are not supported");
    for (int64_t e = 0; e < t.shape[0]; ++e) s.experts[ref->layer][int(e)][ref->role] = ExpertSource{&t, e, ref->layout};
  }
  // Every MoE layer has the same experts, each with its three weights.
  for (const auto& [layer, list] : s.experts) s.n_experts = std::max(s.n_experts, list.rbegin()->first + 1);
  for (const auto& [layer, list] : s.experts) {
    if (int(list.size()) != s.n_experts || list.begin()->first != 0)
      fail(c.dir, ": layer ", layer, " has ", list.size(), " experts, other layers have ", s.n_experts);
    for (const auto& [e, parts] : list)
      for (const std::string role : {"gate", "up", "down"})
        if (!parts.count(role) && !(role != "down" && parts.count("gate_up")))
          fail(c.dir, ": layer ", layer, " expert ", e, " has no ", role, " weight");
  }
  return s;
}

// One expert's block as it is written: its tensors, the bytes of those converted, and the
// formats of its weights.
struct ExpertBlock {
  std::deque<std::vector<char>> bytes;  // deque: parts point into it as it grows
  std::deque<TensorView> views;
  std::vector<PackWriter::Part> parts;
  std::set<std::string> formats;
  std::string format() const { return formats.size() == 1 ? *formats.begin() : "mixed"; }
};

// Converts tensors as --quant asks: keep (as they are, FP8 included), bf16, or q<N> (affine).
class Converter {
 public:
  // hessians: GPTQ's calibration (pack --gptq), or nullptr for round to nearest.
  Converter(const Checkpoint& c, const SortedTensors& sorted, const PackOptions& options,
            const ExpertHessians* hessians = nullptr)
      : c_(c), sorted_(sorted), options_(options), hessians_(hessians), keep_(options.quant == "keep"), to_bf16_(options.quant == "bf16"),
        fp8_experts_native_(keep_), fp8_resident_native_(!to_bf16_ && !(options.quant_all && !keep_)),
        fp8_values_(to_bf16_ ? DType::BF16 : DType::F32) {
    if (!keep_ && !to_bf16_) target_ = target_format(options);
  }

  // --quant and --group-size as a format (bits 0 for keep and bf16).
  static QuantFormat target_format(const PackOptions& options) {
    if (options.quant == "keep" || options.quant == "bf16") return {};
    const QuantFormat f = parse_quant_format(options.quant + "g" + std::to_string(options.group_size));
    check_quant_format(f, "--quant");
    return f;
  }

  // Non-expert tensors: as they are, or (--quant-all) linear weights and the embedding quantized.
  // The tensors added may point into this converter's buffers, kept until release_resident().
  void add_resident(const TensorView& source, std::vector<TensorToWrite>& out, ThreadPool& pool) {
    if (c_.fp8_scales.count(&source) && fp8_resident_native_) {
      add_native_fp8_resident(source, out);
      return;
    }
    const TensorView* t = dequantized(&source, owned_, owned_views_);
    if (!quantizes(*t)) {
      out.push_back({t->name, t->dtype, t->shape, t->data});
      return;
    }
    const std::string module = t->name.substr(0, t->name.size() - 7);
    // Routers stay at 8 bits, as mlx-community ships them: routing decisions are sensitive.
    QuantFormat f = target_;
    if (ends_with(t->name, ".mlp.gate.weight")) {
      f.bits = 8;
      quant_overrides_[module] = {{"bits", 8}, {"group_size", f.group_size}};
    }
    const int64_t rows = t->shape[0], cols = t->shape[1];
    auto [words, scales, biases] = quantize_rows(*t, f, pool);
    out.push_back({t->name, DType::U32, {rows, cols * f.bits / 32}, words->data()});
    out.push_back({module + ".scales", DType::BF16, {rows, cols / f.group_size}, scales->data()});
    out.push_back({module + ".biases", DType::BF16, {rows, cols / f.group_size}, biases->data()});
  }
  void release_resident() { owned_.clear(); }
  // What resident_quantization() said when the weights a resumed pack kept were written.
  void restore_resident_quantization(const std::string& text) { restored_ = json::parse(text); }

  // One expert: its weights role by role (gate, up, down), then its biases.
  ExpertBlock expert(int layer, int expert, const ExpertParts& source_parts, Progress& progress) const {
    ExpertBlock b;
    ExpertParts sources = source_parts;
    if (!fp8_experts_native_)
      for (auto& [role, part] : sources) part.tensor = dequantized(part.tensor, b.bytes, b.views);
    const ExpertParts parts = to_pack_layout(sources, b.bytes, b.views);
    const ExpertHessian* h = hessians_ ? hessians_->find(layer, expert) : nullptr;
    if (hessians_ && !keep_ && !to_bf16_) {
      if (h && h->tokens < options_.gptq_min_tokens) h = nullptr;  // too few tokens: round to nearest
      ++(h ? gptq_experts_ : rtn_experts_);
    }
    const QuantFormat target = expert_target(layer, expert);
    for (const std::string role : {"gate", "up", "down"}) add_weight(b, layer, role, parts, target, h, progress);
    if (h && !h->sample.empty()) reconstruct(b, layer, parts, target, *h);
    for (const std::string role : {"gate_bias", "up_bias", "down_bias"})
      if (parts.count(role)) {
        const ExpertSource& bias = parts.at(role);
        b.parts.push_back({role, DType::F32, bias.tensor->shape, bias.data(), bias.nbytes()});
      }
    return b;
  }

  // config.json's "quantization" for --quant-all (routers at 8 bits); null otherwise.
  json resident_quantization() const {
    if (!restored_.is_null()) return restored_;
    if (!options_.quant_all || keep_ || to_bf16_) return nullptr;
    json q = {{"bits", target_.bits}, {"group_size", target_.group_size}};
    q.update(quant_overrides_);
    return q;
  }
  // Experts quantized by GPTQ, and those rounded to nearest for lack of calibration tokens.
  int64_t gptq_experts() const { return gptq_experts_; }
  int64_t rtn_experts() const { return rtn_experts_; }
  // Once no FP8 weights are left in the pack, its config no longer says fp8.
  bool fp8_gone() const { return c_.quant.method == "fp8" && !fp8_resident_native_ && !fp8_experts_native_; }

 private:
  // Whether --quant-all quantizes this resident tensor: float matrices named .weight whose
  // columns are whole groups.
  bool quantizes(const TensorView& t) const {
    const bool is_float = t.dtype == DType::BF16 || t.dtype == DType::F16 || t.dtype == DType::F32;
    return options_.quant_all && !keep_ && !to_bf16_ && is_float && t.shape.size() == 2 && ends_with(t.name, ".weight") &&
           t.shape[1] % target_.group_size == 0;
  }

  // An FP8 weight as it is, with its row scales as <module>.scales.
  void add_native_fp8_resident(const TensorView& source, std::vector<TensorToWrite>& out) {
    const std::string& name = source.name;
    if (name.size() < 8 || !ends_with(name, ".weight")) fail("tensor ", name, ": an FP8 tensor that is not a .weight");
    const std::vector<char>& sc = native_fp8_scales(source, owned_);
    const int64_t rows = source.shape[0];
    out.push_back({name, DType::F8_E4M3, source.shape, source.data});
    out.push_back({name.substr(0, name.size() - 7) + ".scales", DType::F32, {rows, int64_t(sc.size() / 4) / rows}, sc.data()});
  }

  // An expert's quantized format: --quant's, with its bits from --tiered's plan when there is one.
  QuantFormat expert_target(int layer, int expert) const {
    QuantFormat f = target_;
    if (!options_.expert_bits.empty()) f.bits = options_.expert_bits.at(size_t(layer)).at(size_t(expert));
    return f;
  }

  // One weight role of an expert with its scales and biases, converted as --quant asks (in format
  // `target`, by GPTQ when h is given).
  void add_weight(ExpertBlock& b, int layer, const std::string& role, const ExpertParts& parts,
                  const QuantFormat& target, const ExpertHessian* h, Progress& progress) const {
    const ExpertSource& w = parts.at(role);
    const ExpertSource* sc = parts.count(role + ".scales") ? &parts.at(role + ".scales") : nullptr;
    const ExpertSource* bi = parts.count(role + ".biases") ? &parts.at(role + ".biases") : nullptr;
    if (w.tensor->dtype == DType::F8_E4M3) {  // kept native (fp8_experts_native_)
      add_native_fp8_weight(b, role, w);
      progress.add(w.nbytes());
      return;
    }
    const QuantFormat fmt = source_format(layer, role, w, sc, bi);
    const std::vector<int64_t> shape = w.shape();
    if (shape.size() != 2) fail("tensor ", w.tensor->name, ": expected a matrix, found ", shape_str(shape));
    if (keep_)
      keep_weight(b, role, w, sc, bi, fmt);
    else if (to_bf16_)
      bf16_weight(b, role, w, sc, bi, fmt);
    else
      requantize_weight(b, role, w, sc, bi, fmt, target, h ? (role == "down" ? &h->act : &h->in) : nullptr);
    progress.add(w.nbytes() + (sc ? sc->nbytes() : 0) + (bi ? bi->nbytes() : 0));
  }

  // GPTQ's gate, up and down in `b` reconstructed together on the expert's sampled calibration
  // inputs (io/gptq.h), in place; SwiGLU experts without biases only.
  void reconstruct(ExpertBlock& b, int layer, const ExpertParts& parts, const QuantFormat& target,
                   const ExpertHessian& h) const {
    if (parts.count("gate_bias") || parts.count("up_bias") || parts.count("down_bias")) return;
    const auto part = [&](const std::string& role) { return parts.count(role) ? &parts.at(role) : nullptr; };
    const auto written = [&](const std::string& role) {
      for (const PackWriter::Part& p : b.parts)
        if (p.role == role) return const_cast<void*>(p.data);  // in b.bytes, this block's own
      fail("expert block without ", role);
    };
    std::vector<float> w[3];
    QuantizedMatrix q[3];
    const std::string roles[3] = {"gate", "up", "down"};
    for (int i = 0; i < 3; ++i) {
      const ExpertSource &src = parts.at(roles[i]), *sc = part(roles[i] + ".scales"), *bi = part(roles[i] + ".biases");
      w[i] = to_f32(src, sc, bi, source_format(layer, roles[i], src, sc, bi));
      q[i] = {static_cast<uint32_t*>(written(roles[i])), static_cast<uint16_t*>(written(roles[i] + ".scales")),
              static_cast<uint16_t*>(written(roles[i] + ".biases"))};
    }
    const int64_t hidden = std::llround(std::sqrt(double(h.in.size()))), inter = std::llround(std::sqrt(double(h.act.size())));
    if (w[0].size() != size_t(inter * hidden) || w[1].size() != w[0].size() || w[2].size() != w[0].size()) return;
    const ExpertMatrices m{w[0].data(), w[1].data(), w[2].data(), hidden, inter, h.in.data(), h.act.data(), h.tokens};
    GptqOptions g;
    g.clip_search = options_.clip_search;
    reconstruct_expert(h.sample.data(), int64_t(h.sample.size()) / hidden, m, target, q[0], q[1], q[2], g);
  }

  // The checkpoint's format of an expert weight; bits 0: plain.
  QuantFormat source_format(int layer, const std::string& role, const ExpertSource& w, const ExpertSource* sc,
                            const ExpertSource* bi) const {
    if (w.tensor->dtype == DType::U32) {
      if (!sc || !bi) fail("tensor ", w.tensor->name, ": quantized weight without scales and biases");
      const auto [bits, group] = c_.quant.for_module(sorted_.modules.at(std::to_string(layer) + "/" + role));
      if (bits == 0) fail(c_.dir, "/config.json: no \"quantization\" entry for ", w.tensor->name);
      if (sc->shape()[1] * group != w.shape()[1] * 32 / bits)
        fail("tensor ", w.tensor->name, ": shape ", shape_str(w.shape()), " does not fit ", bits,
             "-bit groups of ", group, " with scales ", shape_str(sc->shape()));
      return QuantFormat{bits, group, sc->tensor->dtype};
    }
    if (w.tensor->dtype == DType::U8) {
      check_mxfp4_source(w, sc, bi, c_.quant.method);
      return kMxfp4Format;
    }
    return {};
  }

  void add_native_fp8_weight(ExpertBlock& b, const std::string& role, const ExpertSource& w) const {
    const std::vector<char>& scales = native_fp8_scales(*w.tensor, b.bytes);
    const QuantFormat f = fp8_format(int(c_.quant.fp8_block[1]));
    const std::vector<int64_t> shape = w.shape();
    b.parts.push_back({role, DType::F8_E4M3, shape, w.data(), w.nbytes(), f.bits, f.group_size, f.scheme});
    b.parts.push_back({role + ".scales", DType::F32, {shape[0], quant_groups_per_row(f, shape[1])}, scales.data(),
                       scales.size()});
    b.formats.insert(quant_format_name(f));
  }

  static void keep_weight(ExpertBlock& b, const std::string& role, const ExpertSource& w, const ExpertSource* sc,
                          const ExpertSource* bi, const QuantFormat& fmt) {
    const auto add_raw = [&](const std::string& r, const ExpertSource& x, const QuantFormat& f) {
      b.parts.push_back({r, x.tensor->dtype, x.shape(), x.data(), x.nbytes(), f.bits, f.group_size, f.scheme});
    };
    add_raw(role, w, fmt);
    if (fmt.bits) {
      add_raw(role + ".scales", *sc, {});
      if (bi) add_raw(role + ".biases", *bi, {});
      b.formats.insert(quant_format_name(QuantFormat{fmt.bits, fmt.group_size, DType::BF16, fmt.scheme}));
    } else {
      b.formats.insert(format_name(w.tensor->dtype));
    }
  }

  static void bf16_weight(ExpertBlock& b, const std::string& role, const ExpertSource& w, const ExpertSource* sc,
                          const ExpertSource* bi, const QuantFormat& fmt) {
    const auto [rows, cols] = logical_shape(w, fmt);
    std::vector<float> v = to_f32(w, sc, bi, fmt);
    auto& out = b.bytes.emplace_back(v.size() * 2);
    auto* dst = reinterpret_cast<uint16_t*>(out.data());
    for (size_t i = 0; i < v.size(); ++i) dst[i] = f32_to_bf16(v[i]);
    b.parts.push_back({role, DType::BF16, {rows, cols}, out.data(), out.size()});
    b.formats.insert("bf16");
  }

  // The weight in format `target`: by GPTQ under `hessian` (its input's, [cols, cols]) when
  // given, else rounded to nearest.
  void requantize_weight(ExpertBlock& b, const std::string& role, const ExpertSource& w, const ExpertSource* sc,
                         const ExpertSource* bi, const QuantFormat& fmt, const QuantFormat& target,
                         const std::vector<double>* hessian) const {
    const auto [rows, cols] = logical_shape(w, fmt);
    if (cols % target.group_size)
      fail("tensor ", w.tensor->name, ": ", cols, " columns are not a multiple of --group-size ", target.group_size);
    std::vector<float> v = to_f32(w, sc, bi, fmt);
    if (hessian && hessian->size() != size_t(cols * cols))
      fail("tensor ", w.tensor->name, ": its calibration Hessian does not fit ", cols, " columns");
    auto [words, scales, biases] = quantize(v, rows, cols, target, b.bytes, w.tensor->name, hessian);
    b.parts.push_back({role, DType::U32, {rows, cols * target.bits / 32}, words->data(), words->size(), target.bits,
                       target.group_size});
    b.parts.push_back({role + ".scales", DType::BF16, {rows, cols / target.group_size}, scales->data(), scales->size()});
    b.parts.push_back({role + ".biases", DType::BF16, {rows, cols / target.group_size}, biases->data(), biases->size()});
    b.formats.insert(quant_format_name(target));
  }

  // [out, in] of a weight in the checkpoint's format `fmt`.
  static std::pair<int64_t, int64_t> logical_shape(const ExpertSource& w, const QuantFormat& fmt) {
    const std::vector<int64_t> shape = w.shape();
    return {shape[0], fmt.bits ? shape[1] * int64_t(dtype_size(w.tensor->dtype)) * 8 / fmt.bits : shape[1]};
  }

  // A resident matrix as affine codes, scales and biases (bf16), kept in owned_: quantized by
  // blocks of rows on every thread of `pool` (groups lie within a row, so the bytes are those of
  // one call over the whole matrix), and never all of it in float32 at once (the embedding of a
  // 150k vocabulary would be 1.2 GB).
  std::tuple<std::vector<char>*, std::vector<char>*, std::vector<char>*> quantize_rows(const TensorView& t,
                                                                                       const QuantFormat& f,
                                                                                       ThreadPool& pool) {
    const int64_t rows = t.shape[0], cols = t.shape[1];
    const int64_t words_per_row = cols * f.bits / 32, groups_per_row = cols / f.group_size;
    const uint64_t row_bytes = uint64_t(cols) * dtype_size(t.dtype);
    auto& words = owned_.emplace_back(size_t(rows * words_per_row) * 4);
    auto& scales = owned_.emplace_back(size_t(rows * groups_per_row) * 2);
    auto& biases = owned_.emplace_back(size_t(rows * groups_per_row) * 2);
    auto* w = reinterpret_cast<uint32_t*>(words.data());
    auto* sc = reinterpret_cast<uint16_t*>(scales.data());
    auto* z = reinterpret_cast<uint16_t*>(biases.data());
    // At most about 1 MB of float32 per block, and a few blocks per thread.
    const int64_t block = std::max<int64_t>(
        1, std::min<int64_t>((int64_t(1) << 18) / cols, (rows + 4 * pool.size() - 1) / (4 * pool.size())));
    std::mutex mu;
    std::exception_ptr error;
    pool.parallel_for(size_t((rows + block - 1) / block), [&](size_t b0, size_t b1) {
      try {
        for (int64_t r0 = int64_t(b0) * block; r0 < std::min(rows, int64_t(b1) * block); r0 += block) {
          const int64_t n = std::min(block, rows - r0);
          const TensorView part{t.name, t.dtype, {n, cols}, t.as<char>() + uint64_t(r0) * row_bytes,
                                uint64_t(n) * row_bytes};
          const std::vector<float> values = to_f32(ExpertSource{&part, -1}, nullptr, nullptr, {});
          quantize_affine(values.data(), n, cols, f, w + r0 * words_per_row, sc + r0 * groups_per_row,
                          z + r0 * groups_per_row, QuantizeOptions{options_.clip_search}, t.name);
        }
      } catch (...) {
        std::lock_guard lock(mu);
        if (!error) error = std::current_exception();
      }
    });
    if (error) std::rethrow_exception(error);
    return {&words, &scales, &biases};
  }

  // values [rows, cols] as affine codes, scales and biases (bf16), kept in `bytes`: by GPTQ
  // under `hessian` when given, else rounded to nearest.
  std::tuple<std::vector<char>*, std::vector<char>*, std::vector<char>*> quantize(
      const std::vector<float>& values, int64_t rows, int64_t cols, const QuantFormat& f,
      std::deque<std::vector<char>>& bytes, const std::string& name,
      const std::vector<double>* hessian = nullptr) const {
    auto& words = bytes.emplace_back(size_t(rows * cols * f.bits / 32) * 4);
    auto& scales = bytes.emplace_back(size_t(rows * cols / f.group_size) * 2);
    auto& biases = bytes.emplace_back(size_t(rows * cols / f.group_size) * 2);
    auto* w = reinterpret_cast<uint32_t*>(words.data());
    auto* s = reinterpret_cast<uint16_t*>(scales.data());
    auto* z = reinterpret_cast<uint16_t*>(biases.data());
    if (hessian) {
      GptqOptions g;
      g.clip_search = options_.clip_search;
      quantize_gptq(values.data(), rows, cols, hessian->data(), f, w, s, z, g, name);
    } else {
      quantize_affine(values.data(), rows, cols, f, w, s, z, QuantizeOptions{options_.clip_search}, name);
    }
    return {&words, &scales, &biases};
  }

  // The values of an FP8 tensor (fp8_values_), kept in `bytes` / `views` (t itself when not FP8).
  const TensorView* dequantized(const TensorView* t, std::deque<std::vector<char>>& bytes,
                                std::deque<TensorView>& views) const {
    auto it = c_.fp8_scales.find(t);
    if (it == c_.fp8_scales.end()) return t;
    const std::vector<char>& b = bytes.emplace_back(dequantize_fp8(*t, *it->second, c_.quant.fp8_block, fp8_values_));
    return &views.emplace_back(TensorView{t->name, fp8_values_, t->shape, b.data(), b.size()});
  }

  // A native FP8 weight's row scales (fp8_row_scales), as bytes kept in `bytes`.
  std::vector<char>& native_fp8_scales(const TensorView& t, std::deque<std::vector<char>>& bytes) const {
    check_fp8_native(t, c_.quant.fp8_block);
    const std::vector<float> sc = fp8_row_scales(t, *c_.fp8_scales.at(&t), c_.quant.fp8_block);
    return bytes.emplace_back(reinterpret_cast<const char*>(sc.data()), reinterpret_cast<const char*>(sc.data() + sc.size()));
  }

  const Checkpoint& c_;
  const SortedTensors& sorted_;
  const PackOptions& options_;
  const ExpertHessians* hessians_;
  mutable std::atomic<int64_t> gptq_experts_{0}, rtn_experts_{0};
  const bool keep_, to_bf16_, fp8_experts_native_, fp8_resident_native_;
  const DType fp8_values_;
  QuantFormat target_;
  std::deque<std::vector<char>> owned_;  // converted resident tensors, until they are written
  std::deque<TensorView> owned_views_;
  json quant_overrides_ = json::object();
  json restored_;
};

// Configs, tokenizer and template files travel with the pack.
void copy_side_files(const std::string& src, const std::string& dir) {
  for (const auto& entry : fs::directory_iterator(src)) {
    const std::string name = entry.path().filename().string();
    const std::string ext = entry.path().extension().string();
    if (!entry.is_regular_file() || name == "model.safetensors.index.json") continue;
    if (ext == ".json" || ext == ".jinja" || ext == ".txt" || ext == ".model" || ext == ".tiktoken")
      fs::copy_file(entry.path(), dir + "/" + name);
  }
}

// The pack's config.json records the formats of --quant-all's quantized resident weights, and
// drops quantization_config once no FP8 weight is left.
void rewrite_config(json config, const Converter& converter, const std::string& dir) {
  const json resident = converter.resident_quantization();
  if (resident.is_null() && !converter.fp8_gone()) return;
  if (converter.fp8_gone()) config.erase("quantization_config");
  if (!resident.is_null()) config["quantization"] = resident;
  std::ofstream cfg(dir + "/config.json");
  cfg << config.dump(2) << "\n";
  if (!cfg) fail(dir, "/config.json: write failed");
}

}  // namespace

// The pack of `checkpoint` as `options` ask into `writer` (files it kept from an interrupted run are
// not written again), its experts by GPTQ under `hessians` when given; `report` prints how many
// experts GPTQ took.
static void write_converted(const std::string& src, PackWriter& writer, int n_layers, const Checkpoint& checkpoint,
                            const SortedTensors& sorted, const PackOptions& options, const ExpertHessians* hessians,
                            bool report);

void write_pack(const std::string& src, const std::string& out_arg, const ExpertTensorParser& parse,
                const PackOptions& options) {
  const std::string out = pack_format::without_trailing_slashes(out_arg);
  const QuantFormat target = Converter::target_format(options);  // a bad --quant fails before anything is read
  (void)parse_source_io(options.read_io);
  if (!options.gptq_text.empty() && target.bits == 0)
    fail("--gptq: needs a quantized --quant (q2, q3, q4, q6 or q8), not ", options.quant);
  if (!options.expert_bits.empty() && target.bits == 0)
    fail("--tiered: needs a quantized --quant, not ", options.quant);
  if (!options.gptq_text.empty() && !fs::is_regular_file(options.gptq_text))
    fail("--gptq: ", options.gptq_text, ": no such file");
  if (fs::exists(out)) fail(out, ": already exists (remove it first)");
  const Checkpoint checkpoint = open_checkpoint(src);
  const SortedTensors sorted = sort_tensors(checkpoint, parse, options);
  if (options.opened) options.opened();
  if (sorted.resident.empty() && sorted.experts.empty()) fail(src, ": no weights (its safetensors files hold no tensors)");
  if (sorted.experts.empty()) fail(src, ": no routed-expert weights (is it a Mixture-of-Experts checkpoint?)");
  if (!options.expert_bits.empty())
    for (const auto& [layer, list] : sorted.experts) {
      if (size_t(layer) >= options.expert_bits.size() || options.expert_bits[size_t(layer)].size() != list.size())
        fail("--tiered: the profile has ",
             size_t(layer) < options.expert_bits.size() ? options.expert_bits[size_t(layer)].size() : 0,
             " experts for layer ", layer, ", the checkpoint ", list.size());
      for (int bits : options.expert_bits[size_t(layer)])
        check_quant_format(QuantFormat{bits, target.group_size, target.scale_dtype}, "--tiered");
    }

  const json& text_config = checkpoint.text_config();
  const int n_layers = std::max(sorted.experts.rbegin()->first + 1, text_config.value("num_hidden_layers", 0));
  const std::string model_type = text_config.value("model_type", checkpoint.config.value("model_type", ""));
  PackWriter writer(out, model_type, fs::absolute(src).string());
  writer.resume(pack_key(src, options), options.threads);
  const bool experts_left = std::any_of(sorted.experts.begin(), sorted.experts.end(),
                                        [&](const auto& layer) { return !writer.kept_layer(layer.first); });

  std::unique_ptr<ExpertHessians> hessians;
  if (!options.gptq_text.empty() && experts_left) {
    const auto t0 = std::chrono::steady_clock::now();
    GptqCalibration calib{options.gptq_text, options.gptq_tokens, 512, options.threads, options.skip, "",
                          options.gptq_expert_tokens};
    hessians = std::make_unique<ExpertHessians>(collect_expert_hessians(src, out, parse, calib));
    if (options.progress)
      std::fprintf(stderr, "gptq: calibrated on %lld tokens of %s in %.1f s\n", (long long)hessians->tokens,
                   options.gptq_text.c_str(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    // --gptq-passes: calibrate again on the pack quantized under the last pass's Hessians
    // (io/gptq.h: true sequential).
    for (int pass = 2; pass <= options.gptq_passes; ++pass) {
      PackOptions quiet = options;
      quiet.progress = false;
      calib.quantized_pack = out + ".seq.tmp-" + std::to_string(getpid());  // a PackWriter temporary's name
      fs::remove_all(calib.quantized_pack);
      {
        PackWriter scratch(calib.quantized_pack, model_type, fs::absolute(src).string());
        write_converted(src, scratch, n_layers, checkpoint, sorted, quiet, hessians.get(), false);
      }
      hessians = std::make_unique<ExpertHessians>(collect_expert_hessians(src, out, parse, calib));
      if (options.progress)
        std::fprintf(stderr, "gptq: pass %d calibrated on the pass %d pack (%.1f s in all)\n", pass, pass - 1,
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  write_converted(src, writer, n_layers, checkpoint, sorted, options, hessians.get(), true);
}

static void write_converted(const std::string& src, PackWriter& writer, int n_layers, const Checkpoint& checkpoint,
                            const SortedTensors& sorted, const PackOptions& options, const ExpertHessians* hessians,
                            bool report) {
  Converter converter(checkpoint, sorted, options, hessians);
  Progress progress(options.progress, sorted.total_bytes);
  ThreadPool pool(options.threads);

  // The units of work in the order they are done: each resident tensor, then batches of experts
  // (converted several at a time, as quantizing is most of the work, and written in order, so
  // the pack's bytes depend neither on the thread count nor on the read-ahead).
  struct Item {
    int layer, expert;
    const ExpertParts* parts;
  };
  std::vector<Item> items;
  for (const auto& [layer, list] : sorted.experts)
    for (const auto& [e, parts] : list) {
      if (!writer.kept_layer(layer)) {
        items.push_back({layer, e, &parts});
        continue;
      }
      for (const auto& [role, part] : parts) progress.skip(part.nbytes());
    }
  const size_t batch = size_t(2 * pool.size());
  const std::vector<const TensorView*> resident =
      writer.kept_weights() ? std::vector<const TensorView*>() : sorted.resident;
  std::vector<std::vector<SourceRange>> groups(resident.size() + (items.size() + batch - 1) / batch);
  const auto add_range = [&](std::vector<SourceRange>& group, const TensorView* t, const char* data, uint64_t n) {
    group.push_back({data, n, &checkpoint.weights.mapping_of(t->name), t->name});
    auto scale = checkpoint.fp8_scales.find(t);
    if (scale != checkpoint.fp8_scales.end()) {
      const TensorView* s = scale->second;
      group.push_back({s->as<char>(), s->nbytes, &checkpoint.weights.mapping_of(s->name), s->name});
    }
  };
  for (size_t i = 0; i < resident.size(); ++i) add_range(groups[i], resident[i], resident[i]->as<char>(), resident[i]->nbytes);
  uint64_t batch_bytes = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    std::vector<SourceRange>& group = groups[resident.size() + i / batch];
    for (const auto& [role, part] : *items[i].parts) add_range(group, part.tensor, part.data(), part.nbytes());
    uint64_t bytes = 0;
    for (const SourceRange& r : group) bytes += r.size;
    batch_bytes = std::max(batch_bytes, bytes);
  }
  ReadAhead reads(std::move(groups), ReadOptions{uint64_t(std::max(0, options.read_ahead)) * batch_bytes,
                                                 options.read_threads, parse_source_io(options.read_io),
                                                 options.progress});

  if (writer.kept_weights()) {
    for (const TensorView* t : sorted.resident) progress.skip(t->nbytes);
    converter.restore_resident_quantization(writer.weights_note());
  } else {
    std::vector<TensorToWrite> tensors;
    std::vector<bool> in_use(resident.size());  // written from the source's mapping
    for (size_t i = 0; i < resident.size(); ++i) {
      reads.wait(i);
      progress.add(resident[i]->nbytes);
      const size_t first = tensors.size();
      converter.add_resident(*resident[i], tensors, pool);
      const char* begin = resident[i]->as<char>();
      for (size_t t = first; t < tensors.size(); ++t) {
        const char* at = static_cast<const char*>(tensors[t].data);
        in_use[i] = in_use[i] || (!std::less<const char*>()(at, begin) &&
                                  std::less<const char*>()(at, begin + resident[i]->nbytes));
      }
      if (!in_use[i]) reads.release(i);  // converted (--quant-all): its source is no longer needed
    }
    write_safetensors(writer.tmp_dir() + "/weights.safetensors", tensors, {{"format", "pt"}});
    converter.release_resident();
    for (size_t i = 0; i < resident.size(); ++i)
      if (in_use[i]) reads.release(i);
    writer.weights_written(converter.resident_quantization().dump());
  }

  // While the pool converts a batch, the next ones are read and the one before is written.
  SerialWriter out;
  for (size_t i0 = 0; i0 < items.size(); i0 += batch) {
    const size_t n = std::min(batch, items.size() - i0), group = resident.size() + i0 / batch;
    reads.wait(group);
    auto blocks = std::make_shared<std::vector<ExpertBlock>>(n);
    std::vector<std::exception_ptr> errors(n);
    pool.parallel_for(n, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        try {
          (*blocks)[i] = converter.expert(items[i0 + i].layer, items[i0 + i].expert, *items[i0 + i].parts, progress);
        } catch (...) {
          errors[i] = std::current_exception();
        }
      }
    });
    for (size_t i = 0; i < n; ++i)
      if (errors[i]) {
        out.finish();  // an earlier batch's write error comes first
        std::rethrow_exception(errors[i]);
      }
    out.push([&writer, &reads, &items, blocks, i0, group] {
      for (size_t i = 0; i < blocks->size(); ++i)
        writer.add_expert(items[i0 + i].layer, (*blocks)[i].format(), (*blocks)[i].parts);
      blocks->clear();
      reads.release(group);  // kept parts point into the source until written
    });
  }
  out.finish();

  copy_side_files(src, writer.tmp_dir());
  rewrite_config(checkpoint.config, converter, writer.tmp_dir());
  writer.finish(n_layers);
  if (hessians && report)  // experts without enough calibration tokens were rounded to nearest
    std::fprintf(stderr, "gptq: %lld experts by GPTQ, %lld rounded to nearest (fewer than %lld calibration tokens)\n",
                 (long long)converter.gptq_experts(), (long long)converter.rtn_experts(),
                 (long long)options.gptq_min_tokens);
}

}  // namespace moestream
