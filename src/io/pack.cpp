#include "io/pack.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <tuple>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/quant.h"
#include "io/safetensors.h"

namespace moestream {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr int kFormatVersion = 1;
constexpr uint64_t kTensorAlignment = 64;  // tensors inside an expert block

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)v);
  return buf;
}

uint64_t parse_hex64(const std::string& s, const std::string& where) {
  if (s.size() != 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos)
    fail(where, ": checksum must be 16 lowercase hex digits, found '", s, "'");
  return std::stoull(s, nullptr, 16);
}

// Reads a required member with a message naming the manifest and the member.
template <class T>
T member(const json& j, const char* key, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) fail(where, ": missing field '", key, "'");
  try {
    return j.at(key).get<T>();
  } catch (const json::exception&) {
    fail(where, ": field '", key, "' has the wrong type");
  }
}

// A progress line on stderr (only when it is a terminal): done/total bytes, rate and ETA.
class Progress {
 public:
  Progress(bool enabled, uint64_t total) : on_(enabled && isatty(2)), total_(total) {}
  void add(uint64_t bytes) {
    done_ += bytes;
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::milliseconds(200) && done_ < total_) return;
    last_ = now;
    const double s = std::chrono::duration<double>(now - start_).count();
    const double rate = s > 0 ? done_ / s : 0;
    const double eta = rate > 0 ? (total_ - done_) / rate : 0;
    const int width = 30, filled = total_ ? int(width * double(done_) / double(total_)) : width;
    std::fprintf(stderr, "\rpacking [%.*s%*s] %5.1f%% %.2f/%.2f GB %6.1f MB/s ETA %4.0fs", filled,
                 "##############################", width - filled, "",
                 total_ ? 100.0 * double(done_) / double(total_) : 100.0, done_ / 1e9, total_ / 1e9,
                 rate / 1e6, eta);
    if (done_ >= total_) std::fprintf(stderr, "\n");
  }

 private:
  bool on_;
  uint64_t total_, done_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_{};
};

std::string format_name(DType t) {
  switch (t) {
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::F32: return "f32";
    default: fail("expert tensors of dtype ", dtype_name(t), " cannot be packed yet");
  }
}

}  // namespace

const PackedTensor* PackedExpert::find(const std::string& role) const {
  for (const auto& t : tensors)
    if (t.role == role) return &t;
  return nullptr;
}

std::vector<int64_t> PackedExpert::logical_shape(const std::string& role) const {
  const PackedTensor* t = find(role);
  if (!t) return {};
  if (t->bits == 0) return t->shape;
  return {t->shape[0], t->shape[1] * int64_t(dtype_size(t->dtype)) * 8 / t->bits};
}

QuantFormat PackedExpert::quant_format(const std::string& role) const {
  const PackedTensor* t = find(role);
  if (!t || t->bits == 0) return {};
  const PackedTensor* scales = find(role + ".scales");
  return QuantFormat{t->bits, t->group_size, scales ? scales->dtype : DType::BF16, t->scheme};
}

bool is_pack_dir(const std::string& dir) { return fs::exists(dir + "/" + kPackManifestName); }

uint64_t PackManifest::total_expert_bytes() const {
  uint64_t n = 0;
  for (const auto& l : layers)
    for (const auto& e : l) n += e.size;
  return n;
}

uint64_t PackManifest::max_expert_size() const {
  uint64_t n = 0;
  for (const auto& l : layers)
    for (const auto& e : l) n = std::max(n, e.size);
  return n;
}

const PackedExpert& PackManifest::expert(int layer, int e) const {
  if (layer < 0 || size_t(layer) >= layers.size() || e < 0 || size_t(e) >= layers[size_t(layer)].size())
    fail(dir, ": the pack has no expert ", e, " in layer ", layer);
  return layers[size_t(layer)][size_t(e)];
}

PackManifest PackManifest::load(const std::string& dir) {
  const std::string path = dir + "/" + kPackManifestName;
  std::ifstream in(path);
  if (!in) fail(path, ": cannot open (not a moestream pack?)");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail(path, ": invalid JSON: ", e.what());
  }
  PackManifest m;
  m.dir = dir;
  if (member<std::string>(j, "format", path) != "moestream-pack") fail(path, ": 'format' is not moestream-pack");
  const int version = member<int>(j, "version", path);
  if (version != kFormatVersion)
    fail(path, ": pack format version ", version, " is not supported (expected ", kFormatVersion, "); repack the model");
  m.model_type = member<std::string>(j, "model_type", path);
  m.weights_file = member<std::string>(j, "weights", path);
  m.expert_files = member<std::vector<std::string>>(j, "expert_files", path);
  m.n_experts = member<int>(j, "n_experts", path);
  std::vector<uint64_t> file_sizes;
  for (const auto& f : m.expert_files) {
    std::error_code ec;
    const uint64_t size = fs::file_size(dir + "/" + f, ec);
    if (ec) fail(dir, "/", f, ": expert file missing (", ec.message(), ")");
    file_sizes.push_back(size);
  }
  const json& layers = j.at("layers");
  if (!layers.is_array()) fail(path, ": 'layers' must be an array");
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string where = path + ": layer " + std::to_string(l);
    auto& experts = m.layers.emplace_back();
    const json& list = layers[l];
    if (!list.is_array()) fail(where, ": must be an array of experts");
    if (!list.empty() && int(list.size()) != m.n_experts)
      fail(where, ": has ", list.size(), " experts, expected ", m.n_experts);
    for (size_t e = 0; e < list.size(); ++e) {
      const std::string w = where + " expert " + std::to_string(e);
      const json& x = list[e];
      PackedExpert pe;
      pe.file = member<int>(x, "file", w);
      pe.offset = member<uint64_t>(x, "offset", w);
      pe.size = member<uint64_t>(x, "size", w);
      pe.checksum = parse_hex64(member<std::string>(x, "xxh64", w), w);
      pe.format = member<std::string>(x, "format", w);
      if (pe.file < 0 || size_t(pe.file) >= m.expert_files.size()) fail(w, ": file index ", pe.file, " out of range");
      if (pe.offset % kPackAlignment || pe.size % kPackAlignment || pe.size == 0)
        fail(w, ": offset and size must be positive multiples of ", kPackAlignment);
      if (pe.offset + pe.size > file_sizes[size_t(pe.file)])
        fail(dir, "/", m.expert_files[size_t(pe.file)], ": truncated: layer ", l, " expert ", e,
             " ends at byte ", pe.offset + pe.size, " but the file has ", file_sizes[size_t(pe.file)]);
      for (const json& t : member<json>(x, "tensors", w)) {
        PackedTensor pt;
        pt.role = member<std::string>(t, "role", w);
        const std::string dt = member<std::string>(t, "dtype", w);
        auto parsed = dtype_from_name(dt);
        if (!parsed) fail(w, ": tensor ", pt.role, " has unknown dtype '", dt, "'");
        pt.dtype = *parsed;
        pt.shape = member<std::vector<int64_t>>(t, "shape", w);
        pt.offset = member<uint64_t>(t, "offset", w);
        pt.nbytes = member<uint64_t>(t, "nbytes", w);
        pt.bits = t.value("bits", 0);
        pt.group_size = t.value("group_size", 0);
        const std::string scheme = t.value("scheme", "affine");
        if (scheme == "mxfp4") {
          pt.scheme = QuantScheme::Mxfp4;
        } else if (scheme == "fp8") {
          pt.scheme = QuantScheme::Fp8;
        } else if (scheme != "affine") {
          fail(w, ": tensor ", pt.role, " has unknown quantization scheme '", scheme, "'");
        }
        int64_t numel = 1;
        for (int64_t d : pt.shape) numel *= d;
        if (pt.shape.size() != 2 || numel * int64_t(dtype_size(pt.dtype)) != int64_t(pt.nbytes) ||
            pt.offset + pt.nbytes > pe.size)
          fail(w, ": tensor ", pt.role, " has an inconsistent shape, size or offset");
        pe.tensors.push_back(std::move(pt));
      }
      for (const std::string role : {"gate", "up", "down"}) {
        const PackedTensor* b = pe.find(role + "_bias");
        const PackedTensor* t = pe.find(role);
        if (b && (b->dtype != DType::F32 || b->shape[0] != 1 || !t || b->shape[1] != t->shape[0]))
          fail(w, ": '", role, "_bias' must be F32 [1, rows of '", role, "']");
        if (!t) fail(w, ": no '", role, "' tensor");
        if (t->bits == 0) continue;
        const PackedTensor *sc = pe.find(role + ".scales"), *bi = pe.find(role + ".biases");
        const QuantFormat f = pe.quant_format(role);
        check_quant_format(f, w + " " + role);
        if (f.scheme == QuantScheme::Fp8) {
          const std::vector<int64_t> groups{t->shape[0], quant_groups_per_row(f, t->shape[1])};
          if (t->dtype != DType::F8_E4M3 || !sc || sc->dtype != DType::F32 || sc->shape != groups || bi)
            fail(w, ": FP8 '", role, "' needs F8_E4M3 codes and F32 scales of shape ", shape_str(groups),
                 " (no biases)");
          continue;
        }
        if (f.scheme == QuantScheme::Mxfp4) {
          const std::vector<int64_t> groups{t->shape[0], t->shape[1] * 2 / 32};
          if (t->dtype != DType::U8 || !sc || sc->shape != groups || bi)
            fail(w, ": MXFP4 '", role, "' needs U8 codes and U8 exponents of shape ", shape_str(groups),
                 " (no biases)");
          continue;
        }
        const int64_t cols = t->shape[1] * 32 / t->bits;
        const std::vector<int64_t> groups{t->shape[0], cols / t->group_size};
        if (t->dtype != DType::U32 || !sc || !bi || sc->shape != groups || bi->shape != groups ||
            bi->dtype != sc->dtype || cols % t->group_size)
          fail(w, ": quantized '", role, "' needs U32 words and scales/biases of shape ", shape_str(groups));
      }
      experts.push_back(std::move(pe));
    }
  }
  return m;
}

PackWriter::PackWriter(const std::string& out, const std::string& model_type,
                       const std::string& source)
    : out_(out), tmp_(out + ".tmp-" + std::to_string(getpid())), model_type_(model_type),
      source_(source) {
  if (fs::exists(out)) fail(out, ": already exists (remove it first)");
  fs::remove_all(tmp_);
  fs::create_directories(tmp_ + "/experts");
}

PackWriter::~PackWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) {
    std::error_code ec;
    fs::remove_all(tmp_, ec);
  }
}

void PackWriter::close_layer() {
  if (fd_ < 0) return;
  if (::close(fd_) != 0) fail(tmp_, "/", files_.back(), ": close failed: ", std::strerror(errno));
  fd_ = -1;
}

void PackWriter::add_expert(int layer, const std::string& format, const std::vector<Part>& parts) {
  if (layer < layer_) fail("pack writer: layer ", layer, " after layer ", layer_);
  if (layer != layer_) {
    close_layer();
    if (layer_ >= 0 && int(layers_json_[size_t(layer_)].size()) != n_experts_ && n_experts_ > 0)
      fail("pack writer: layer ", layer_, " has ", layers_json_[size_t(layer_)].size(), " experts, expected ", n_experts_);
    if (layer_ >= 0 && n_experts_ == 0) n_experts_ = int(layers_json_[size_t(layer_)].size());
    layer_ = layer;
    layers_json_.resize(size_t(layer) + 1);
    files_.push_back("experts/layer-" + std::to_string(layer) + ".bin");
    const std::string path = tmp_ + "/" + files_.back();
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    MS_CHECK_SYS(fd_ >= 0, "open", path);
    pos_ = 0;
  }
  json tensors = json::array();
  block_.clear();
  for (const Part& p : parts) {
    const uint64_t at = align_up(block_.size(), kTensorAlignment);
    block_.resize(at);
    const char* bytes = static_cast<const char*>(p.data);
    block_.insert(block_.end(), bytes, bytes + p.nbytes);
    json entry = {{"role", p.role}, {"dtype", dtype_name(p.dtype)}, {"shape", p.shape},
                  {"offset", at}, {"nbytes", p.nbytes}};
    if (p.bits) {
      entry["bits"] = p.bits;
      entry["group_size"] = p.group_size;
      if (p.scheme == QuantScheme::Mxfp4) entry["scheme"] = "mxfp4";
      if (p.scheme == QuantScheme::Fp8) entry["scheme"] = "fp8";
    }
    tensors.push_back(entry);
  }
  block_.resize(align_up(block_.size(), kPackAlignment));
  const uint64_t sum = XXH64(block_.data(), block_.size(), 0);
  for (size_t done = 0; done < block_.size();) {
    ssize_t n = ::write(fd_, block_.data() + done, block_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    MS_CHECK_SYS(n > 0, "write", tmp_ + "/" + files_.back());
    done += size_t(n);
  }
  json entry = {{"file", files_.size() - 1}, {"offset", pos_}, {"size", block_.size()},
                {"xxh64", hex64(sum)}, {"format", format}, {"tensors", tensors}};
  layers_json_[size_t(layer)].push_back(entry.dump());
  pos_ += block_.size();
}

void PackWriter::finish(int n_layers) {
  close_layer();
  if (layer_ >= 0 && n_experts_ == 0) n_experts_ = int(layers_json_[size_t(layer_)].size());
  if (int(layers_json_.size()) > n_layers) fail("pack writer: experts for layer ", layers_json_.size() - 1, " of ", n_layers);
  layers_json_.resize(size_t(n_layers));
  json layers = json::array();
  for (const auto& list : layers_json_) {
    if (!list.empty() && int(list.size()) != n_experts_)
      fail("pack writer: a layer has ", list.size(), " experts, expected ", n_experts_);
    json arr = json::array();
    for (const auto& e : list) arr.push_back(json::parse(e));
    layers.push_back(arr);
  }
  json manifest = {{"format", "moestream-pack"},   {"version", kFormatVersion},
                   {"created_by", "moestream"},    {"source", source_},
                   {"model_type", model_type_},    {"weights", "weights.safetensors"},
                   {"expert_files", files_},       {"n_experts", n_experts_},
                   {"layers", layers}};
  const std::string path = tmp_ + "/" + kPackManifestName;
  std::ofstream mf(path);
  mf << manifest.dump(1) << "\n";
  mf.close();
  if (!mf) fail(path, ": write failed");
  fs::rename(tmp_, out_);
  finished_ = true;
}

namespace {

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

// One expert's tensor: a whole checkpoint tensor, or expert `index` of a stacked one.
struct ExpertSource {
  const TensorView* tensor = nullptr;
  int64_t index = -1;
  ExpertLayout layout = ExpertLayout::OutIn;

  // The expert's shape; dimensions after the second are flattened into it (MXFP4 blocks
  // [rows, cols / 32, 16] are [rows, cols / 2] bytes).
  std::vector<int64_t> shape() const {
    std::vector<int64_t> s = index < 0 ? tensor->shape : std::vector<int64_t>(tensor->shape.begin() + 1, tensor->shape.end());
    while (s.size() > 2) {
      s[s.size() - 2] *= s.back();
      s.pop_back();
    }
    return s;
  }
  const char* data() const {
    const char* base = static_cast<const char*>(tensor->data);
    return index < 0 ? base : base + index * int64_t(tensor->nbytes) / tensor->shape[0];
  }
  uint64_t nbytes() const { return index < 0 ? tensor->nbytes : tensor->nbytes / uint64_t(tensor->shape[0]); }
};

// The float32 values of a weight, dequantizing it when it is quantized (f.bits > 0).
std::vector<float> to_f32(const ExpertSource& w, const ExpertSource* scales, const ExpertSource* biases,
                          const QuantFormat& f) {
  const std::vector<int64_t> shape = w.shape();
  if (f.scheme == QuantScheme::Mxfp4) {
    const int64_t rows = shape[0], cols = shape[1] * 2;
    std::vector<float> out(size_t(rows * cols));
    const auto* codes = reinterpret_cast<const uint8_t*>(w.data());
    const auto* exps = reinterpret_cast<const uint8_t*>(scales->data());
    for (int64_t r = 0; r < rows; ++r)
      dequantize_mxfp4_row(cols, codes + r * cols / 2, exps + r * cols / 32, out.data() + r * cols);
    return out;
  }
  const int bits = f.bits, group = f.group_size;
  if (bits == 0) {
    TensorView v{w.tensor->name, w.tensor->dtype, shape, w.data(), w.nbytes()};
    std::vector<float> out(size_t(v.numel()));
    for (int64_t i = 0; i < v.numel(); ++i) {
      switch (v.dtype) {
        case DType::F32: out[size_t(i)] = v.as<float>()[i]; break;
        case DType::BF16: out[size_t(i)] = bf16_to_f32(v.as<uint16_t>()[i]); break;
        case DType::F16: out[size_t(i)] = f16_to_f32(v.as<uint16_t>()[i]); break;
        default: fail("tensor ", v.name, ": cannot convert ", dtype_name(v.dtype), " to float");
      }
    }
    return out;
  }
  const int64_t rows = shape[0], cols = shape[1] * 32 / bits, groups = cols / group;
  std::vector<float> out(size_t(rows * cols));
  const auto* words = reinterpret_cast<const uint32_t*>(w.data());
  const auto* sc = reinterpret_cast<const uint16_t*>(scales->data());
  const auto* bi = reinterpret_cast<const uint16_t*>(biases->data());
  for (int64_t r = 0; r < rows; ++r)
    dequantize_row(f, cols, words + r * shape[1], sc + r * groups, bi + r * groups, out.data() + r * cols);
  return out;
}

// A gpt-oss MXFP4 expert weight: U8 codes [rows, cols / 2] and U8 exponents [rows, cols / 32]
// under quantization_config.quant_method "mxfp4"; exponents above kMxfp4MaxExponent (scales
// beyond float32's range, or NaN) are refused.
void check_mxfp4_source(const ExpertSource& w, const ExpertSource* scales, const ExpertSource* biases,
                        const std::string& method) {
  const std::string& name = w.tensor->name;
  if (method != "mxfp4")
    fail("tensor ", name, ": U8 expert weights are read as MXFP4 blocks, but config.json's quantization_config.quant_method is '",
         method, "' (expected mxfp4)");
  if (!scales || biases) fail("tensor ", name, ": MXFP4 blocks need their _scales tensor (and no biases)");
  const std::vector<int64_t> shape = w.shape(), want{shape[0], shape[1] * 2 / 32};
  if (shape.size() != 2 || shape[1] % 16 || scales->tensor->dtype != DType::U8 || scales->shape() != want)
    fail("tensor ", scales->tensor->name, ": MXFP4 exponents for blocks ", shape_str(shape), " must be U8 ",
         shape_str(want), ", found ", dtype_name(scales->tensor->dtype), " ", shape_str(scales->shape()));
  const auto* e = reinterpret_cast<const uint8_t*>(scales->data());
  for (uint64_t i = 0; i < scales->nbytes(); ++i)
    if (e[i] > kMxfp4MaxExponent)
      fail("tensor ", scales->tensor->name, ": exponent ", int(e[i]), " at element ", i, " (above ",
           int(kMxfp4MaxExponent), ": a scale beyond float32's range, or NaN)");
}

// The block scales (scale_inv) of a block-scaled FP8 weight (DeepSeek-V3 / Kimi-K2 checkpoints),
// checked against the weight's shape and repeated for each row of their block: F32
// [rows, ceil(cols / block[1])], the scales of QuantScheme::Fp8 (core/quant.h).
std::vector<float> fp8_row_scales(const TensorView& w, const TensorView& scale_inv, const std::vector<int64_t>& block) {
  if (w.shape.size() != 2) fail("tensor ", w.name, ": FP8 weights must be matrices, found ", shape_str(w.shape));
  const int64_t rows = w.shape[0], cols = w.shape[1];
  const std::vector<int64_t> want{(rows + block[0] - 1) / block[0], (cols + block[1] - 1) / block[1]};
  if (scale_inv.dtype != DType::F32 || scale_inv.shape != want)
    fail("tensor ", scale_inv.name, ": expected F32 ", shape_str(want), " (blocks of ", block[0], "x", block[1],
         " over ", shape_str(w.shape), "), found ", dtype_name(scale_inv.dtype), " ", shape_str(scale_inv.shape));
  for (int64_t i = 0; i < want[0] * want[1]; ++i)  // the kernels multiply scales by 256 (exact below 2^100)
    if (!(std::abs(scale_inv.as<float>()[i]) <= 0x1p100f))
      fail("tensor ", scale_inv.name, ": scale ", scale_inv.as<float>()[i], " at element ", i, " is not a finite number below 2^100");
  std::vector<float> out(size_t(rows * want[1]));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + r * want[1], scale_inv.as<float>() + (r / block[0]) * want[1], size_t(want[1]) * 4);
  return out;
}

// The FP8 weight w with its row scales, packed as it is: its codes must not hold NaN (0x7f, 0xff)
// and the column block must be a multiple of 32 (the kernels' unit).
void check_fp8_native(const TensorView& w, const std::vector<int64_t>& block) {
  if (block[1] % 32)
    fail("tensor ", w.name, ": FP8 column blocks of ", block[1], " (weight_block_size) are not a multiple of 32; "
         "pack with --quant bf16 or --quant q8 instead");
  const auto* codes = static_cast<const uint8_t*>(w.data);
  for (uint64_t i = 0; i < w.nbytes; ++i)
    if ((codes[i] & 0x7f) == 0x7f) fail("tensor ", w.name, ": element ", i, " is an FP8 NaN (0x", std::hex, int(codes[i]), ")");
}

// A block-scaled FP8 weight dequantized to `dtype` (F32: exact; BF16: rounded to nearest even):
// w[r][c] = fp8[r][c] * scale_inv[r / block[0]][c / block[1]], one float32 multiply.
std::vector<char> dequantize_fp8(const TensorView& w, const TensorView& scale_inv, const std::vector<int64_t>& block,
                                 DType dtype) {
  const std::vector<float> scales = fp8_row_scales(w, scale_inv, block);
  const int64_t rows = w.shape[0], cols = w.shape[1], groups = int64_t(scales.size()) / rows;
  std::vector<float> row(static_cast<size_t>(cols));
  std::vector<char> out(size_t(rows * cols) * dtype_size(dtype));
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_fp8_row(cols, int(block[1]), static_cast<const uint8_t*>(w.data) + r * cols, scales.data() + r * groups,
                       row.data());
    if (dtype == DType::F32) {
      std::memcpy(out.data() + r * cols * 4, row.data(), size_t(cols) * 4);
    } else {
      auto* dst = reinterpret_cast<uint16_t*>(out.data()) + r * cols;
      for (int64_t c = 0; c < cols; ++c) dst[c] = f32_to_bf16(row[size_t(c)]);
    }
  }
  return out;
}

bool is_bias_role(const std::string& role) {
  return role.size() > 5 && role.compare(role.size() - 5, 5, "_bias") == 0;
}

// An expert's tensors as the pack stores them: weights [out, in] (gate_up split into gate and up),
// biases as F32 [1, out]. Converted tensors live in `bytes` and `views`.
std::map<std::string, ExpertSource> to_pack_layout(const std::map<std::string, ExpertSource>& parts,
                                                   std::deque<std::vector<char>>& bytes,
                                                   std::deque<TensorView>& views) {
  std::map<std::string, ExpertSource> out;
  const auto add = [&](const std::string& role, const std::string& name, DType dtype,
                       std::vector<int64_t> shape, std::vector<char>&& data) {
    std::vector<char>& b = bytes.emplace_back(std::move(data));
    const TensorView& v = views.emplace_back(TensorView{name, dtype, std::move(shape), b.data(), b.size()});
    out[role] = ExpertSource{&v, -1};
  };
  for (const auto& [role, src] : parts) {
    const std::vector<int64_t> shape = src.shape();
    const std::string& name = src.tensor->name;
    if (is_bias_role(role)) {
      if (shape.size() != 1) fail("tensor ", name, ": expected one bias vector per expert, found ", shape_str(shape));
      const std::vector<float> v = to_f32(src, nullptr, nullptr, {});
      const int64_t n = int64_t(v.size());
      const auto as_bytes = [](const float* f, int64_t count, int64_t stride) {
        std::vector<char> b(size_t(count) * sizeof(float));
        for (int64_t i = 0; i < count; ++i) std::memcpy(b.data() + i * 4, f + i * stride, sizeof(float));
        return b;
      };
      if (role == "gate_up_bias") {
        if (n % 2) fail("tensor ", name, ": interleaved gate/up bias needs an even size, found ", n);
        add("gate_bias", name, DType::F32, {1, n / 2}, as_bytes(v.data(), n / 2, 2));
        add("up_bias", name, DType::F32, {1, n / 2}, as_bytes(v.data() + 1, n / 2, 2));
      } else {
        add(role, name, DType::F32, {1, n}, as_bytes(v.data(), n, 1));
      }
      continue;
    }
    if (src.layout == ExpertLayout::OutIn) {
      out[role] = src;
      continue;
    }
    if (src.layout == ExpertLayout::GateUpRows) {
      // Gate and up are the two halves of the rows: views into the tensor, nothing copied.
      if (role != "gate_up" || shape.size() != 2 || shape[0] % 2 || src.tensor->dtype == DType::U32)
        fail("tensor ", name, ": fused gate/up rows need role gate_up and a plain [2 * inter, in] matrix per expert, found ",
             dtype_name(src.tensor->dtype), " ", shape_str(shape));
      const uint64_t half = src.nbytes() / 2;
      for (int i = 0; i < 2; ++i) {
        const TensorView& v = views.emplace_back(
            TensorView{name, src.tensor->dtype, {shape[0] / 2, shape[1]}, src.data() + i * half, half});
        out[i == 0 ? "gate" : "up"] = ExpertSource{&v, -1};
      }
      continue;
    }
    if (src.layout == ExpertLayout::GateUpInterleavedRows) {
      // MXFP4 codes or exponents: even rows are gate, odd rows up; rows are copied whole.
      const bool scales = role == "gate_up.scales";
      if ((role != "gate_up" && !scales) || shape.size() != 2 || shape[0] % 2)
        fail("tensor ", name, ": interleaved gate/up rows need role gate_up or gate_up.scales and an even row count, found ",
             shape_str(shape));
      const uint64_t row_bytes = src.nbytes() / uint64_t(shape[0]);
      for (int half = 0; half < 2; ++half) {
        std::vector<char> b(size_t(row_bytes) * size_t(shape[0] / 2));
        for (int64_t r = 0; r < shape[0] / 2; ++r)
          std::memcpy(b.data() + r * row_bytes, src.data() + (2 * r + half) * row_bytes, row_bytes);
        add(std::string(half ? "up" : "gate") + (scales ? ".scales" : ""), name, src.tensor->dtype,
            {shape[0] / 2, shape[1]}, std::move(b));
      }
      continue;
    }
    const size_t elem = dtype_size(src.tensor->dtype);
    if (shape.size() != 2 || src.tensor->dtype == DType::U32)
      fail("tensor ", name, ": a transposed expert weight must be a plain matrix, found ",
           dtype_name(src.tensor->dtype), " ", shape_str(shape));
    // Element (r, c) of the stored [in, out'] tensor is W'[c][r]; copy element bytes as they are.
    const int64_t in = shape[0], cols = shape[1];
    const char* data = src.data();
    const auto transpose = [&](int64_t first_col, int64_t step) {
      const int64_t rows_out = (cols - first_col + step - 1) / step;
      std::vector<char> b(size_t(rows_out * in) * elem);
      for (int64_t o = 0; o < rows_out; ++o)
        for (int64_t i = 0; i < in; ++i)
          std::memcpy(b.data() + size_t(o * in + i) * elem, data + size_t(i * cols + first_col + o * step) * elem, elem);
      return b;
    };
    if (src.layout == ExpertLayout::InOut) {
      add(role, name, src.tensor->dtype, {cols, in}, transpose(0, 1));
    } else {
      if (role != "gate_up" || cols % 2)
        fail("tensor ", name, ": interleaved gate/up needs role gate_up and an even column count, found ", shape_str(shape));
      add("gate", name, src.tensor->dtype, {cols / 2, in}, transpose(0, 2));
      add("up", name, src.tensor->dtype, {cols / 2, in}, transpose(1, 2));
    }
  }
  return out;
}

}  // namespace

void write_pack(const std::string& src, const std::string& out, const ExpertTensorParser& parse,
                const PackOptions& options) {
  const bool to_bf16 = options.quant == "bf16", keep = options.quant == "keep";
  QuantFormat target;
  if (!keep && !to_bf16) {
    target = parse_quant_format(options.quant + "g" + std::to_string(options.group_size));
    check_quant_format(target, "--quant");
  }
  if (fs::exists(out)) fail(out, ": already exists (remove it first)");
  const WeightSet weights = WeightSet::open_dir(src);
  json config;
  {
    std::ifstream cfg(src + "/config.json");
    if (!cfg) fail(src, "/config.json: not found");
    config = json::parse(cfg, nullptr, false);
    if (!config.is_object()) fail(src, "/config.json: invalid JSON");
  }
  const json& text_config = config.contains("text_config") ? config["text_config"] : config;
  const CheckpointQuantization checkpoint_quant = read_quantization(config);

  // Sort the checkpoint's tensors into experts [layer][expert][role] and everything else.
  std::map<int, std::map<int, std::map<std::string, ExpertSource>>> experts;
  std::map<std::string, std::string> modules;  // "layer/role" -> checkpoint module (for its format)
  std::vector<const TensorView*> others;
  uint64_t total_bytes = 0;
  // FP8 weights and their scale_inv tensors (quant_method "fp8"). They stay FP8 (codes and row
  // scales, QuantScheme::Fp8) unless --quant asks for another format: bf16 dequantizes them to
  // bf16, q<N> requantizes the experts (and with --quant-all the rest) from their exact float32
  // values. The scale_inv tensors themselves are not packed.
  std::map<const TensorView*, const TensorView*> fp8_scales;
  for (const auto& name : weights.names()) {
    const TensorView& t = weights.get(name);
    if (t.dtype != DType::F8_E4M3 && t.dtype != DType::F8_E5M2) continue;
    if (checkpoint_quant.method != "fp8" || t.dtype != DType::F8_E4M3)
      fail("tensor ", name, ": ", dtype_name(t.dtype), " weights are supported as block-scaled E4M3 with quantization_config "
           "{quant_method: fp8, fmt: e4m3}; config.json has quant_method '", checkpoint_quant.method, "'");
    if (!weights.has(name + "_scale_inv")) fail("tensor ", name, ": FP8 weight without ", name, "_scale_inv");
    fp8_scales[&t] = &weights.get(name + "_scale_inv");
  }
  const auto is_fp8_scale = [&](const std::string& name) {
    const size_t n = name.size();
    if (n < 10 || name.compare(n - 10, 10, "_scale_inv") != 0) return false;
    const std::string base = name.substr(0, n - 10);
    return weights.has(base) && fp8_scales.count(&weights.get(base)) > 0;
  };
  const bool fp8_experts_native = keep;
  const bool fp8_rest_native = !to_bf16 && !(options.quant_all && !keep);
  const DType fp8_values = to_bf16 ? DType::BF16 : DType::F32;
  // The values of an FP8 tensor (fp8_values), kept in `bytes` / `views` (t itself when not FP8).
  const auto dequantized = [&](const TensorView* t, std::deque<std::vector<char>>& bytes,
                               std::deque<TensorView>& views) -> const TensorView* {
    auto it = fp8_scales.find(t);
    if (it == fp8_scales.end()) return t;
    const std::vector<char>& b = bytes.emplace_back(dequantize_fp8(*t, *it->second, checkpoint_quant.fp8_block, fp8_values));
    return &views.emplace_back(TensorView{t->name, fp8_values, t->shape, b.data(), b.size()});
  };
  // A native FP8 weight's row scales (fp8_row_scales), as bytes kept in `bytes`.
  const auto native_fp8_scales = [&](const TensorView& t, std::deque<std::vector<char>>& bytes) -> std::vector<char>& {
    check_fp8_native(t, checkpoint_quant.fp8_block);
    const std::vector<float> sc = fp8_row_scales(t, *fp8_scales.at(&t), checkpoint_quant.fp8_block);
    return bytes.emplace_back(reinterpret_cast<const char*>(sc.data()), reinterpret_cast<const char*>(sc.data() + sc.size()));
  };
  for (const auto& name : weights.names()) {
    if (options.skip && options.skip(name)) continue;
    if (is_fp8_scale(name)) continue;
    const TensorView& t = weights.get(name);
    total_bytes += t.nbytes;
    auto ref = parse(name);
    if (!ref) {
      others.push_back(&t);
      continue;
    }
    const std::string module = name.substr(0, name.rfind('.'));
    if (ref->role.find('.') == std::string::npos)
      modules[std::to_string(ref->layer) + "/" + ref->role] = module;
    if (!ref->stacked) {
      auto& slot = experts[ref->layer][ref->expert][ref->role];
      if (slot.tensor) fail(src, ": tensors ", slot.tensor->name, " and ", name, " are the same expert part");
      slot = ExpertSource{&t, -1, ref->layout};
      continue;
    }
    // Stacked biases [E, out]; weights [E, out, in], MXFP4 blocks [E, out, in / 32, 16].
    const bool bias = is_bias_role(ref->role);
    if (bias ? t.shape.size() != 2 : t.shape.size() < 3 || t.shape.size() > 4)
      fail("tensor ", name, ": stacked experts need ", bias ? "2" : "3 or 4", " dimensions, found ", shape_str(t.shape));
    if (fp8_scales.count(&t)) fail("tensor ", name, ": stacked FP8 experts are not supported");
    for (int64_t e = 0; e < t.shape[0]; ++e) experts[ref->layer][int(e)][ref->role] = ExpertSource{&t, e, ref->layout};
  }
  int n_experts = 0;
  for (const auto& [layer, list] : experts) n_experts = std::max(n_experts, list.rbegin()->first + 1);
  for (const auto& [layer, list] : experts) {
    if (int(list.size()) != n_experts || list.begin()->first != 0)
      fail(src, ": layer ", layer, " has ", list.size(), " experts, other layers have ", n_experts);
    for (const auto& [e, parts] : list)
      for (const std::string role : {"gate", "up", "down"})
        if (!parts.count(role) && !(role != "down" && parts.count("gate_up")))
          fail(src, ": layer ", layer, " expert ", e, " has no ", role, " weight");
  }

  int n_layers = experts.empty() ? 0 : experts.rbegin()->first + 1;
  n_layers = std::max(n_layers, text_config.value("num_hidden_layers", 0));
  const std::string model_type = text_config.value("model_type", config.value("model_type", ""));
  PackWriter writer(out, model_type, fs::absolute(src).string());
  Progress progress(options.progress, total_bytes);

  // Non-expert tensors: as they are, or (--quant-all) linear weights and the embedding quantized.
  std::vector<TensorToWrite> rest;
  std::deque<std::vector<char>> owned;  // deque: references stay valid as it grows
  std::deque<TensorView> owned_views;
  json quant_overrides = json::object();
  for (const TensorView* source : others) {
    progress.add(source->nbytes);
    if (fp8_scales.count(source) && fp8_rest_native) {
      const std::string& name = source->name;
      if (name.size() < 8 || name.compare(name.size() - 7, 7, ".weight") != 0)
        fail("tensor ", name, ": an FP8 tensor that is not a .weight");
      const std::vector<char>& sc = native_fp8_scales(*source, owned);
      const int64_t rows = source->shape[0];
      rest.push_back({name, DType::F8_E4M3, source->shape, source->data});
      rest.push_back({name.substr(0, name.size() - 7) + ".scales", DType::F32,
                      {rows, int64_t(sc.size() / 4) / rows}, sc.data()});
      continue;
    }
    const TensorView* t = dequantized(source, owned, owned_views);
    const bool is_float = t->dtype == DType::BF16 || t->dtype == DType::F16 || t->dtype == DType::F32;
    const std::string module = t->name.size() > 7 ? t->name.substr(0, t->name.size() - 7) : "";
    if (!options.quant_all || keep || to_bf16 || !is_float || t->shape.size() != 2 ||
        t->name.compare(t->name.size() - 7, 7, ".weight") != 0 || t->shape[1] % target.group_size) {
      rest.push_back({t->name, t->dtype, t->shape, t->data});
      continue;
    }
    // Routers stay at 8 bits, as mlx-community ships them: routing decisions are sensitive.
    QuantFormat f = target;
    if (t->name.size() > 16 && t->name.compare(t->name.size() - 16, 16, ".mlp.gate.weight") == 0) {
      f.bits = 8;
      quant_overrides[module] = {{"bits", 8}, {"group_size", f.group_size}};
    }
    const ExpertSource whole{t, -1};
    const std::vector<float> values = to_f32(whole, nullptr, nullptr, {});
    const int64_t rows = t->shape[0], cols = t->shape[1];
    auto& words = owned.emplace_back(size_t(rows * cols * f.bits / 32) * 4);
    auto& scales = owned.emplace_back(size_t(rows * cols / f.group_size) * 2);
    auto& biases = owned.emplace_back(size_t(rows * cols / f.group_size) * 2);
    quantize_affine(values.data(), rows, cols, f, reinterpret_cast<uint32_t*>(words.data()),
                    reinterpret_cast<uint16_t*>(scales.data()), reinterpret_cast<uint16_t*>(biases.data()),
                    QuantizeOptions{options.clip_search}, t->name);
    rest.push_back({t->name, DType::U32, {rows, cols * f.bits / 32}, words.data()});
    rest.push_back({module + ".scales", DType::BF16, {rows, cols / f.group_size}, scales.data()});
    rest.push_back({module + ".biases", DType::BF16, {rows, cols / f.group_size}, biases.data()});
  }
  write_safetensors(writer.tmp_dir() + "/weights.safetensors", rest, {{"format", "pt"}});
  owned.clear();

  for (const auto& [layer, list] : experts) {
    for (const auto& [e, source_parts] : list) {
      std::deque<std::vector<char>> bytes;
      std::deque<TensorView> converted;
      std::map<std::string, ExpertSource> sources = source_parts;
      if (!fp8_experts_native)
        for (auto& [role, part] : sources) part.tensor = dequantized(part.tensor, bytes, converted);
      const std::map<std::string, ExpertSource> parts = to_pack_layout(sources, bytes, converted);
      std::vector<PackWriter::Part> out_parts;
      std::set<std::string> formats;
      for (const std::string role : {"gate", "up", "down"}) {
        const ExpertSource& w = parts.at(role);
        const ExpertSource* sc = parts.count(role + ".scales") ? &parts.at(role + ".scales") : nullptr;
        const ExpertSource* bi = parts.count(role + ".biases") ? &parts.at(role + ".biases") : nullptr;
        QuantFormat fmt;  // of the checkpoint's weight; bits 0: plain
        if (w.tensor->dtype == DType::U32) {
          if (!sc || !bi) fail("tensor ", w.tensor->name, ": quantized weight without scales and biases");
          const auto [bits, group] = checkpoint_quant.for_module(modules.at(std::to_string(layer) + "/" + role));
          if (bits == 0) fail(src, "/config.json: no \"quantization\" entry for ", w.tensor->name);
          if (sc->shape()[1] * group != w.shape()[1] * 32 / bits)
            fail("tensor ", w.tensor->name, ": shape ", shape_str(w.shape()), " does not fit ", bits,
                 "-bit groups of ", group, " with scales ", shape_str(sc->shape()));
          fmt = QuantFormat{bits, group, sc->tensor->dtype};
        } else if (w.tensor->dtype == DType::U8) {
          check_mxfp4_source(w, sc, bi, checkpoint_quant.method);
          fmt = kMxfp4Format;
        } else if (w.tensor->dtype == DType::F8_E4M3) {  // kept native (fp8_experts_native)
          const std::vector<char>& scales = native_fp8_scales(*w.tensor, bytes);
          const QuantFormat f = fp8_format(int(checkpoint_quant.fp8_block[1]));
          const std::vector<int64_t> shape = w.shape();
          out_parts.push_back({role, DType::F8_E4M3, shape, w.data(), w.nbytes(), f.bits, f.group_size, f.scheme});
          out_parts.push_back({role + ".scales", DType::F32, {shape[0], quant_groups_per_row(f, shape[1])},
                               scales.data(), scales.size()});
          formats.insert(quant_format_name(f));
          progress.add(w.nbytes());
          continue;
        }
        const std::vector<int64_t> shape = w.shape();
        if (shape.size() != 2) fail("tensor ", w.tensor->name, ": expected a matrix, found ", shape_str(shape));
        const int64_t rows = shape[0];
        const int64_t cols = fmt.bits ? shape[1] * int64_t(dtype_size(w.tensor->dtype)) * 8 / fmt.bits : shape[1];
        auto add_raw = [&](const std::string& r, const ExpertSource& x, const QuantFormat& f) {
          out_parts.push_back({r, x.tensor->dtype, x.shape(), x.data(), x.nbytes(), f.bits, f.group_size, f.scheme});
        };
        if (keep) {
          add_raw(role, w, fmt);
          if (fmt.bits) {
            add_raw(role + ".scales", *sc, {});
            if (bi) add_raw(role + ".biases", *bi, {});
            formats.insert(quant_format_name(QuantFormat{fmt.bits, fmt.group_size, DType::BF16, fmt.scheme}));
          } else {
            formats.insert(format_name(w.tensor->dtype));
          }
        } else if (to_bf16) {
          std::vector<float> v = to_f32(w, sc, bi, fmt);
          auto& b = bytes.emplace_back(v.size() * 2);
          auto* dst = reinterpret_cast<uint16_t*>(b.data());
          for (size_t i = 0; i < v.size(); ++i) dst[i] = f32_to_bf16(v[i]);
          out_parts.push_back({role, DType::BF16, {rows, cols}, b.data(), b.size()});
          formats.insert("bf16");
        } else {
          if (cols % target.group_size)
            fail("tensor ", w.tensor->name, ": ", cols, " columns are not a multiple of --group-size ", target.group_size);
          std::vector<float> v = to_f32(w, sc, bi, fmt);
          auto& words = bytes.emplace_back(size_t(rows * cols * target.bits / 32) * 4);
          auto& scales = bytes.emplace_back(size_t(rows * cols / target.group_size) * 2);
          auto& biases = bytes.emplace_back(size_t(rows * cols / target.group_size) * 2);
          quantize_affine(v.data(), rows, cols, target, reinterpret_cast<uint32_t*>(words.data()),
                          reinterpret_cast<uint16_t*>(scales.data()),
                          reinterpret_cast<uint16_t*>(biases.data()), QuantizeOptions{options.clip_search},
                          w.tensor->name);
          out_parts.push_back({role, DType::U32, {rows, cols * target.bits / 32}, words.data(), words.size(),
                               target.bits, target.group_size});
          out_parts.push_back({role + ".scales", DType::BF16, {rows, cols / target.group_size}, scales.data(), scales.size()});
          out_parts.push_back({role + ".biases", DType::BF16, {rows, cols / target.group_size}, biases.data(), biases.size()});
          formats.insert(quant_format_name(target));
        }
        progress.add(w.nbytes() + (sc ? sc->nbytes() : 0) + (bi ? bi->nbytes() : 0));
      }
      for (const std::string role : {"gate_bias", "up_bias", "down_bias"})
        if (parts.count(role)) {
          const ExpertSource& b = parts.at(role);
          out_parts.push_back({role, DType::F32, b.tensor->shape, b.data(), b.nbytes()});
        }
      writer.add_expert(layer, formats.size() == 1 ? *formats.begin() : "mixed", out_parts);
    }
  }

  // Configs, tokenizer and template files travel with the pack; with --quant-all the config
  // records the formats of the quantized non-expert weights.
  for (const auto& entry : fs::directory_iterator(src)) {
    const std::string name = entry.path().filename().string();
    const std::string ext = entry.path().extension().string();
    if (!entry.is_regular_file() || name == "model.safetensors.index.json") continue;
    if (ext == ".json" || ext == ".jinja" || ext == ".txt" || ext == ".model" || ext == ".tiktoken")
      fs::copy_file(entry.path(), writer.tmp_dir() + "/" + name);
  }
  // Once no FP8 weights are left in the pack, its config no longer says fp8.
  const bool fp8_gone = checkpoint_quant.method == "fp8" && !fp8_rest_native && !fp8_experts_native;
  const bool rewrite_config = (options.quant_all && !keep && !to_bf16) || fp8_gone;
  if (fp8_gone) config.erase("quantization_config");
  if (rewrite_config) {
    if (options.quant_all && !keep && !to_bf16) {
      json q = {{"bits", target.bits}, {"group_size", target.group_size}};
      q.update(quant_overrides);
      config["quantization"] = q;
    }
    std::ofstream cfg(writer.tmp_dir() + "/config.json");
    cfg << config.dump(2) << "\n";
    if (!cfg) fail(writer.tmp_dir(), "/config.json: write failed");
  }
  writer.finish(n_layers);
}

}  // namespace moestream
