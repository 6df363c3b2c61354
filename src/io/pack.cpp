#include "io/pack.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
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

// Tensor bytes converted to the pack's storage dtype.
std::vector<char> convert(const TensorView& t, DType to) {
  std::vector<char> out(size_t(t.numel()) * dtype_size(to));
  if (t.dtype == to) {
    std::memcpy(out.data(), t.data, out.size());
    return out;
  }
  auto* dst = reinterpret_cast<uint16_t*>(out.data());
  for (int64_t i = 0; i < t.numel(); ++i) {
    float f;
    if (t.dtype == DType::F32) f = t.as<float>()[i];
    else if (t.dtype == DType::F16) f = f16_to_f32(t.as<uint16_t>()[i]);
    else fail("tensor ", t.name, ": cannot convert ", dtype_name(t.dtype), " to ", dtype_name(to));
    dst[i] = f32_to_bf16(f);
  }
  return out;
}

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
  if (bits == 0) return t->shape;
  return {t->shape[0], t->shape[1] * 32 / bits};
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
      if (!pe.format.empty() && pe.format[0] == 'q') {
        if (std::sscanf(pe.format.c_str(), "q%dg%d", &pe.bits, &pe.group_size) != 2 ||
            (pe.bits != 2 && pe.bits != 3 && pe.bits != 4 && pe.bits != 6 && pe.bits != 8) ||
            pe.group_size <= 0)
          fail(w, ": unknown format '", pe.format, "'");
      }
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
        int64_t numel = 1;
        for (int64_t d : pt.shape) numel *= d;
        if (pt.shape.size() != 2 || numel * int64_t(dtype_size(pt.dtype)) != int64_t(pt.nbytes) ||
            pt.offset + pt.nbytes > pe.size)
          fail(w, ": tensor ", pt.role, " has an inconsistent shape, size or offset");
        pe.tensors.push_back(std::move(pt));
      }
      for (const std::string role : {"gate", "up", "down"}) {
        if (!pe.find(role)) fail(w, ": no '", role, "' tensor");
        if (pe.bits && (!pe.find(role + ".scales") || !pe.find(role + ".biases") ||
                        pe.find(role)->dtype != DType::U32))
          fail(w, ": quantized '", role, "' needs U32 words, scales and biases");
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
    tensors.push_back({{"role", p.role}, {"dtype", dtype_name(p.dtype)}, {"shape", p.shape},
                       {"offset", at}, {"nbytes", p.nbytes}});
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

void write_pack(const std::string& src, const std::string& out, const ExpertTensorParser& parse,
                const PackOptions& options) {
  if (options.quant != "keep" && options.quant != "bf16")
    fail("--quant: '", options.quant, "' is not supported yet (supported: keep, bf16)");
  if (fs::exists(out)) fail(out, ": already exists (remove it first)");
  const WeightSet weights = WeightSet::open_dir(src);

  // Sort the checkpoint's tensors into experts [layer][expert][role] and everything else.
  std::map<int, std::map<int, std::map<std::string, const TensorView*>>> experts;
  std::vector<const TensorView*> others;
  uint64_t total_bytes = 0;
  for (const auto& name : weights.names()) {
    const TensorView& t = weights.get(name);
    total_bytes += t.nbytes;
    if (auto ref = parse(name)) {
      auto& slot = experts[ref->layer][ref->expert][ref->role];
      if (slot) fail(src, ": tensors ", slot->name, " and ", name, " are the same expert part");
      slot = &t;
    } else {
      others.push_back(&t);
    }
  }
  int n_experts = 0;
  for (const auto& [layer, list] : experts) n_experts = std::max(n_experts, list.rbegin()->first + 1);
  for (const auto& [layer, list] : experts) {
    if (int(list.size()) != n_experts || list.begin()->first != 0)
      fail(src, ": layer ", layer, " has ", list.size(), " experts, other layers have ", n_experts);
    for (const auto& [e, parts] : list)
      for (const char* role : {"gate", "up", "down"})
        if (!parts.count(role)) fail(src, ": layer ", layer, " expert ", e, " has no ", role, " weight");
  }

  std::string model_type;
  int n_layers = experts.empty() ? 0 : experts.rbegin()->first + 1;
  {
    std::ifstream cfg(src + "/config.json");
    json c = json::parse(cfg, nullptr, false);
    if (c.is_object()) {
      const json& text = c.contains("text_config") ? c["text_config"] : c;
      model_type = text.value("model_type", c.value("model_type", ""));
      n_layers = std::max(n_layers, text.value("num_hidden_layers", 0));
    }
  }
  PackWriter writer(out, model_type, fs::absolute(src).string());
  Progress progress(options.progress, total_bytes);
  std::vector<TensorToWrite> rest;
  for (const TensorView* t : others) {
    rest.push_back({t->name, t->dtype, t->shape, t->data});
    progress.add(t->nbytes);
  }
  write_safetensors(writer.tmp_dir() + "/weights.safetensors", rest, {{"format", "pt"}});

  for (const auto& [layer, list] : experts) {
    for (const auto& [e, parts] : list) {
      std::vector<std::vector<char>> bytes;
      std::vector<PackWriter::Part> out_parts;
      std::string format;
      for (const char* role : {"gate", "up", "down"}) {
        const TensorView& t = *parts.at(role);
        if (t.shape.size() != 2) fail("tensor ", t.name, ": expected a matrix, found ", shape_str(t.shape));
        const DType to = options.quant == "bf16" ? DType::BF16 : t.dtype;
        bytes.push_back(convert(t, to));
        out_parts.push_back({role, to, t.shape, bytes.back().data(), bytes.back().size()});
        if (format.empty()) format = format_name(to);
        else if (format != format_name(to)) format = "mixed";
        progress.add(t.nbytes);
      }
      writer.add_expert(layer, format, out_parts);
    }
  }

  // Configs, tokenizer and template files travel with the pack.
  for (const auto& entry : fs::directory_iterator(src)) {
    const std::string name = entry.path().filename().string();
    const std::string ext = entry.path().extension().string();
    if (!entry.is_regular_file() || name == "model.safetensors.index.json") continue;
    if (ext == ".json" || ext == ".jinja" || ext == ".txt" || ext == ".model" || ext == ".tiktoken")
      fs::copy_file(entry.path(), writer.tmp_dir() + "/" + name);
  }
  writer.finish(n_layers);
}

}  // namespace moestream
