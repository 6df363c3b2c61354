// The pack manifest read and validated.
#include "io/pack_format.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/quant.h"
#include "io/pack.h"

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

}  // namespace pack_format

namespace {

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
  if (version != pack_format::kVersion)
    fail(path, ": pack format version ", version, " is not supported (expected ", pack_format::kVersion, "); repack the model");
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
      pe.checksum = pack_format::parse_hex64(member<std::string>(x, "xxh64", w), w);
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

}  // namespace moestream
