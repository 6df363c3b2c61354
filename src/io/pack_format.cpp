// The pack manifest read and validated: every field typed and in range, every offset and size
// inside its file and aligned, formats consistent with their tensors, paths inside the pack,
// and (format 2) the manifest's own checksum and that of weights.safetensors' header.
#include "io/pack_format.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>
#include <thread>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/quant.h"
#include "io/pack.h"
#include "io/safetensors.h"

namespace moestream {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace pack_format {

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

uint64_t manifest_checksum(const json& manifest) {
  json m = manifest;
  m.erase("manifest_xxh64");
  const std::string text = m.dump();
  return XXH64(text.data(), text.size(), 0);
}

uint64_t safetensors_header_checksum(const std::string& path) {
  const std::shared_ptr<MappedFile> f = MappedFile::open(path);
  uint64_t n = 0;
  if (f->size() >= 8)
    for (int i = 7; i >= 0; --i) n = (n << 8) | f->data()[i];
  if (f->size() < 8 || n > f->size() - 8) fail(path, ": not a safetensors file (header length beyond the file)");
  return XXH64(f->data(), 8 + n, 0);
}

std::vector<uint64_t> tensor_checksums(const std::vector<const TensorView*>& tensors) {
  std::vector<uint64_t> sums(tensors.size());
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tensors[a]->nbytes > tensors[b]->nbytes; });
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (size_t i; (i = next++) < order.size();) sums[order[i]] = XXH3_64bits(tensors[order[i]]->data, tensors[order[i]]->nbytes);
  };
  const size_t n_threads = std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), tensors.size());
  std::vector<std::thread> threads;
  for (size_t t = 1; t < n_threads; ++t) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  return sums;
}

json weight_checksums(const std::string& path) {
  json out;
  out["weights_header_xxh64"] = hex64(safetensors_header_checksum(path));
  const std::unique_ptr<SafetensorsFile> file = SafetensorsFile::open(path);
  std::vector<const TensorView*> tensors;
  for (const auto& [name, t] : file->tensors()) tensors.push_back(&t);
  const std::vector<uint64_t> sums = tensor_checksums(tensors);
  json by_name = json::object();
  for (size_t i = 0; i < tensors.size(); ++i) by_name[tensors[i]->name] = hex64(sums[i]);
  out["weights_xxh3"] = by_name;
  return out;
}

}  // namespace pack_format

namespace {

using pack_format::parse_hex64;

// Readers of required members, each failing with one line naming the manifest, the place and the field.
const json& field(const json& j, const char* key, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) fail(where, ": missing field '", key, "'");
  return j.at(key);
}

std::string string_field(const json& j, const char* key, const std::string& where) {
  const json& v = field(j, key, where);
  if (!v.is_string()) fail(where, ": field '", key, "' must be a string, found ", v.dump());
  return v.get<std::string>();
}

uint64_t unsigned_value(const json& v, const char* key, const std::string& where, uint64_t max) {
  // nlohmann reads non-negative integer literals as unsigned, negative ones as signed, and those
  // beyond 64 bits as floating point.
  if (!v.is_number_unsigned() || v.get<uint64_t>() > max)
    fail(where, ": field '", key, "' must be an integer in [0, ", max, "], found ", v.dump());
  return v.get<uint64_t>();
}

uint64_t unsigned_field(const json& j, const char* key, const std::string& where,
                        uint64_t max = std::numeric_limits<uint64_t>::max()) {
  return unsigned_value(field(j, key, where), key, where, max);
}

int int_field(const json& j, const char* key, const std::string& where) {
  return int(unsigned_field(j, key, where, uint64_t(std::numeric_limits<int>::max())));
}

// A path inside the pack directory: relative, without '..' (safetensors.h).
std::string path_field(const json& v, const char* key, const std::string& where) {
  if (!v.is_string()) fail(where, ": field '", key, "' must be a string, found ", v.dump());
  const std::string p = v.get<std::string>();
  if (!is_path_inside(p)) fail(where, ": field '", key, "': path '", p, "' leaves the pack directory");
  return p;
}

const std::set<std::string>& known_roles() {
  static const std::set<std::string> roles = [] {
    std::set<std::string> r;
    for (const std::string w : {"gate", "up", "down"}) {
      for (const std::string suffix : {"", ".scales", ".biases"}) r.insert(w + suffix);
      r.insert(w + "_bias");
    }
    return r;
  }();
  return roles;
}

// The format name PackWriter's callers give an expert with these tensors: its weights' formats
// when they agree, "mixed" otherwise.
std::string format_of(const PackedExpert& pe, const std::string& where) {
  std::set<std::string> formats;
  for (const std::string role : {"gate", "up", "down"}) {
    const PackedTensor* t = pe.find(role);
    if (t->bits) {
      formats.insert(quant_format_name(QuantFormat{t->bits, t->group_size, DType::BF16, t->scheme}));
    } else if (t->dtype == DType::BF16 || t->dtype == DType::F16 || t->dtype == DType::F32) {
      std::string name(dtype_name(t->dtype));
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return char(std::tolower(c)); });
      formats.insert(name);
    } else {
      fail(where, ": tensor '", role, "' of dtype ", dtype_name(t->dtype), " needs bits and group_size");
    }
  }
  return formats.size() == 1 ? *formats.begin() : "mixed";
}

bool is_known_format(const std::string& f) {
  if (f == "bf16" || f == "f16" || f == "f32" || f == "mixed" || f == "mxfp4") return true;
  if (f.rfind("fp8g", 0) == 0) return f.size() > 4 && f.find_first_not_of("0123456789", 4) == std::string::npos;
  try {
    check_quant_format(parse_quant_format(f), f);
    return true;
  } catch (const Error&) {
    return false;
  }
}

PackedTensor read_tensor(const json& t, const PackedExpert& pe, const std::string& where) {
  PackedTensor pt;
  pt.role = string_field(t, "role", where);
  if (!known_roles().count(pt.role)) fail(where, ": unknown tensor role '", pt.role, "'");
  const std::string w = where + ": tensor '" + pt.role + "'";
  const std::string dt = string_field(t, "dtype", w);
  auto parsed = dtype_from_name(dt);
  if (!parsed) fail(w, ": unknown dtype '", dt, "'");
  pt.dtype = *parsed;
  const json& shape = field(t, "shape", w);
  if (!shape.is_array() || shape.size() != 2) fail(w, ": field 'shape' must be [rows, cols], found ", shape.dump());
  uint64_t bytes = dtype_size(pt.dtype);
  for (const json& d : shape) {
    const uint64_t n = unsigned_value(d, "shape", w, uint64_t(1) << 40);
    if (__builtin_mul_overflow(bytes, n, &bytes)) fail(w, ": field 'shape' ", shape.dump(), " overflows");
    pt.shape.push_back(int64_t(n));
  }
  pt.offset = unsigned_field(t, "offset", w);
  pt.nbytes = unsigned_field(t, "nbytes", w);
  if (pt.nbytes != bytes)
    fail(w, ": field 'nbytes' ", pt.nbytes, " does not match dtype ", dt, " shape ", shape.dump(), " (", bytes, " bytes)");
  if (pt.offset % pack_format::kTensorAlignment)
    fail(w, ": field 'offset' ", pt.offset, " is not a multiple of ", pack_format::kTensorAlignment);
  if (pt.offset > pe.size || pt.nbytes > pe.size - pt.offset)
    fail(w, ": field 'offset' ", pt.offset, " + nbytes ", pt.nbytes, " is beyond the expert's ", pe.size, " bytes");
  if (t.contains("bits") || t.contains("group_size")) {
    pt.bits = int_field(t, "bits", w);
    pt.group_size = int_field(t, "group_size", w);
  }
  const std::string scheme = t.contains("scheme") ? string_field(t, "scheme", w) : "affine";
  if (scheme == "mxfp4") {
    pt.scheme = QuantScheme::Mxfp4;
  } else if (scheme == "fp8") {
    pt.scheme = QuantScheme::Fp8;
  } else if (scheme != "affine") {
    fail(w, ": unknown quantization scheme '", scheme, "'");
  }
  return pt;
}

// The tensors of an expert: no role twice, no two overlapping, each weight's scales and biases
// as its format needs, and the expert's format the one its tensors make.
void check_expert(const PackedExpert& pe, const std::string& w) {
  std::vector<const PackedTensor*> by_offset;
  for (const PackedTensor& t : pe.tensors) {
    if (pe.find(t.role) != &t) fail(w, ": tensor '", t.role, "' appears twice");
    by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i - 1]->offset + by_offset[i - 1]->nbytes > by_offset[i]->offset)
      fail(w, ": tensors '", by_offset[i - 1]->role, "' and '", by_offset[i]->role, "' overlap");
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
        fail(w, ": FP8 '", role, "' needs F8_E4M3 codes and F32 scales of shape ", shape_str(groups), " (no biases)");
      continue;
    }
    if (f.scheme == QuantScheme::Mxfp4) {
      const std::vector<int64_t> groups{t->shape[0], t->shape[1] * 2 / 32};
      if (t->dtype != DType::U8 || !sc || sc->shape != groups || bi)
        fail(w, ": MXFP4 '", role, "' needs U8 codes and U8 exponents of shape ", shape_str(groups), " (no biases)");
      continue;
    }
    const int64_t cols = t->shape[1] * 32 / t->bits;
    const std::vector<int64_t> groups{t->shape[0], cols / t->group_size};
    if (t->dtype != DType::U32 || !sc || !bi || sc->shape != groups || bi->shape != groups || bi->dtype != sc->dtype ||
        cols % t->group_size)
      fail(w, ": quantized '", role, "' needs U32 words and scales/biases of shape ", shape_str(groups));
  }
  if (!is_known_format(pe.format)) fail(w, ": unknown format '", pe.format, "'");
  const std::string made = format_of(pe, w);
  if (pe.format != made) fail(w, ": format '", pe.format, "' does not match its tensors (", made, ")");
}

PackedExpert read_expert(const json& x, const PackManifest& m, const std::vector<uint64_t>& file_sizes,
                         const std::string& path, const std::string& w) {
  PackedExpert pe;
  pe.file = int_field(x, "file", w);
  if (size_t(pe.file) >= m.expert_files.size())
    fail(w, ": field 'file' ", pe.file, " is not an index into the ", m.expert_files.size(), " expert_files");
  pe.offset = unsigned_field(x, "offset", w);
  pe.size = unsigned_field(x, "size", w);
  pe.checksum = parse_hex64(string_field(x, "xxh64", w), w);
  pe.format = string_field(x, "format", w);
  if (pe.offset % kPackAlignment) fail(w, ": field 'offset' ", pe.offset, " is not a multiple of ", kPackAlignment);
  if (pe.size % kPackAlignment || pe.size == 0)
    fail(w, ": field 'size' ", pe.size, " is not a positive multiple of ", kPackAlignment);
  if (pe.offset > std::numeric_limits<uint64_t>::max() - pe.size)
    fail(w, ": field 'offset' ", pe.offset, " + size ", pe.size, " overflows");
  const uint64_t file_size = file_sizes[size_t(pe.file)];
  if (pe.offset + pe.size > file_size)
    fail(m.dir, "/", m.expert_files[size_t(pe.file)], ": truncated: ", w.substr(path.size() + 2), " (offset ", pe.offset,
         " + size ", pe.size, " in ", kPackManifestName, ") ends beyond the file's ", file_size, " bytes");
  const json& tensors = field(x, "tensors", w);
  if (!tensors.is_array()) fail(w, ": field 'tensors' must be an array");
  for (const json& t : tensors) pe.tensors.push_back(read_tensor(t, pe, w));
  check_expert(pe, w);
  return pe;
}

// Format 2: the checksums of the resident tensors, and weights.safetensors' header as written.
void read_weight_checksums(const json& j, PackManifest& m, const std::string& path) {
  const std::string weights = m.dir + "/" + m.weights_file;
  const uint64_t header = parse_hex64(string_field(j, "weights_header_xxh64", path), path + ": weights_header_xxh64");
  if (pack_format::safetensors_header_checksum(weights) != header)
    fail(weights, ": header checksum mismatch (the file is damaged; re-pack the model)");
  const json& sums = field(j, "weights_xxh3", path);
  if (!sums.is_object()) fail(path, ": field 'weights_xxh3' must be an object");
  for (const auto& [name, sum] : sums.items()) {
    if (!sum.is_string()) fail(path, ": weights_xxh3 of tensor '", name, "' must be a string");
    m.weight_checksums[name] = parse_hex64(sum.get<std::string>(), path + ": weights_xxh3 of tensor '" + name + "'");
  }
  const std::unique_ptr<SafetensorsFile> file = SafetensorsFile::open(weights);
  for (const auto& [name, view] : file->tensors())
    if (!m.weight_checksums.count(name))
      fail(path, ": weights_xxh3 has no checksum for tensor '", name, "' of ", m.weights_file);
  for (const auto& [name, sum] : m.weight_checksums)
    if (!file->tensors().count(name)) fail(path, ": weights_xxh3 names tensor '", name, "', which ", m.weights_file, " lacks");
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

PackManifest PackManifest::load(const std::string& dir, bool warn_unchecked) {
  const std::string path = dir + "/" + kPackManifestName;
  std::ifstream in(path);
  if (!in) fail(path, ": cannot open (not a moestream pack?)");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail(path, ": invalid JSON: ", e.what());
  }
  if (!j.is_object()) fail(path, ": must be a JSON object");
  PackManifest m;
  m.dir = dir;
  if (string_field(j, "format", path) != "moestream-pack") fail(path, ": 'format' is not moestream-pack");
  m.version = int_field(j, "version", path);
  if (m.version != pack_format::kVersion && m.version != pack_format::kUncheckedVersion)
    fail(path, ": pack format version ", m.version, " is not supported (expected ", pack_format::kVersion, "); re-pack the model");
  if (m.has_checksums()) {
    const uint64_t sum = parse_hex64(string_field(j, "manifest_xxh64", path), path + ": manifest_xxh64");
    if (pack_format::manifest_checksum(j) != sum)
      fail(path, ": checksum mismatch (the manifest is damaged or was edited; re-pack the model)");
  } else if (warn_unchecked) {
    std::fprintf(stderr, "moestream: warning: %s: pack format %d has no checksums for the manifest and the resident "
                 "weights, so their damage goes unseen; re-pack the model to have them\n", path.c_str(), m.version);
  }
  m.model_type = string_field(j, "model_type", path);
  m.weights_file = path_field(field(j, "weights", path), "weights", path);
  const json& files = field(j, "expert_files", path);
  if (!files.is_array()) fail(path, ": field 'expert_files' must be an array");
  for (const json& f : files) m.expert_files.push_back(path_field(f, "expert_files", path));
  m.n_experts = int_field(j, "n_experts", path);
  std::vector<uint64_t> file_sizes;
  for (const auto& f : m.expert_files) {
    std::error_code ec;
    const uint64_t size = fs::file_size(dir + "/" + f, ec);
    if (ec) fail(dir, "/", f, ": expert file missing (", ec.message(), ")");
    file_sizes.push_back(size);
  }
  if (m.has_checksums()) read_weight_checksums(j, m, path);
  const json& layers = field(j, "layers", path);
  if (!layers.is_array()) fail(path, ": 'layers' must be an array");
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string where = path + ": layer " + std::to_string(l);
    auto& experts = m.layers.emplace_back();
    const json& list = layers[l];
    if (!list.is_array()) fail(where, ": must be an array of experts");
    if (!list.empty() && int(list.size()) != m.n_experts)
      fail(where, ": has ", list.size(), " experts, but n_experts is ", m.n_experts);
    for (size_t e = 0; e < list.size(); ++e)
      experts.push_back(read_expert(list[e], m, file_sizes, path, where + " expert " + std::to_string(e)));
  }
  return m;
}

std::vector<std::string> PackManifest::weight_problems(const WeightSet& weights) const {
  std::vector<const TensorView*> tensors;
  for (const std::string& name : weights.names()) tensors.push_back(&weights.get(name));
  const std::vector<uint64_t> sums = pack_format::tensor_checksums(tensors);
  std::vector<std::string> problems;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string where = dir + "/" + weights_file + ": tensor '" + tensors[i]->name + "'";
    auto it = weight_checksums.find(tensors[i]->name);
    if (it == weight_checksums.end())
      problems.push_back(where + " has no checksum in " + kPackManifestName);
    else if (it->second != sums[i])
      problems.push_back(where + ": checksum mismatch (the file is damaged; re-pack the model)");
  }
  return problems;
}

WeightSet PackManifest::open_weights() const {
  WeightSet weights = WeightSet::open_files({dir + "/" + weights_file});
  if (has_checksums())
    if (const std::vector<std::string> problems = weight_problems(weights); !problems.empty()) fail(problems[0]);
  return weights;
}

}  // namespace moestream
