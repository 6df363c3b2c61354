// PackWriter: a pack written into a temporary directory, expert by expert, and renamed into place.
#include <signal.h>
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/pack.h"
#include "io/pack_format.h"

namespace moestream {

namespace fs = std::filesystem;
using json = nlohmann::json;
using pack_format::align_up;

PackWriter::PackWriter(const std::string& out, const std::string& model_type,
                       const std::string& source)
    : out_(pack_format::without_trailing_slashes(out)), tmp_(out_ + ".tmp-" + std::to_string(getpid())), model_type_(model_type),
      source_(source) {
  if (fs::exists(out_)) fail(out_, ": already exists (remove it first)");
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
  json line = {{"layer", layer_}, {"file", files_.back()}, {"experts", json::array()}};
  for (const std::string& e : layers_json_[size_t(layer_)]) line["experts"].push_back(json::parse(e));
  journal(line.dump());
}

// Moves on to `layer` (or past the last layer: INT_MAX), taking in the layers resume() kept on
// the way; their entries name their file by its index, which is the same as when they were
// written because the layers with experts are the same (the source is).
void PackWriter::next_layer(int layer) {
  close_layer();
  const auto check_count = [this] {
    if (layer_ < 0) return;
    const int n = int(layers_json_[size_t(layer_)].size());
    if (n_experts_ > 0 && n != n_experts_) fail("pack writer: layer ", layer_, " has ", n, " experts, expected ", n_experts_);
    n_experts_ = n;
  };
  check_count();
  for (auto it = kept_layers_.upper_bound(layer_); it != kept_layers_.end() && it->first < layer; ++it) {
    files_.push_back("experts/layer-" + std::to_string(it->first) + ".bin");
    layer_ = it->first;
    layers_json_.resize(size_t(layer_) + 1);
    for (const std::string& e : it->second) {
      json entry = json::parse(e);
      if (entry.value("file", size_t(0)) != files_.size() - 1)
        fail("pack writer: kept layer ", layer_, " was file ", entry.value("file", size_t(0)), ", now ", files_.size() - 1);
      layers_json_[size_t(layer_)].push_back(e);
    }
    check_count();
  }
  if (layer == INT_MAX) return;
  if (kept_layers_.count(layer)) fail("pack writer: layer ", layer, " was kept, not to be written again");
  layer_ = layer;
  layers_json_.resize(size_t(layer) + 1);
  files_.push_back("experts/layer-" + std::to_string(layer) + ".bin");
  const std::string path = tmp_ + "/" + files_.back();
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MS_CHECK_SYS(fd_ >= 0, "open", path);
  pos_ = 0;
}

void PackWriter::weights_written(const std::string& note) {
  weights_checksums_ = pack_format::weight_checksums(tmp_ + "/weights.safetensors").dump();
  journal(json{{"weights", json::parse(weights_checksums_)}, {"note", note}}.dump());
}

void PackWriter::add_expert(int layer, const std::string& format, const std::vector<Part>& parts) {
  if (layer < layer_) fail("pack writer: layer ", layer, " after layer ", layer_);
  if (layer != layer_) next_layer(layer);
  json tensors = json::array();
  block_.clear();
  for (const Part& p : parts) {
    const uint64_t at = align_up(block_.size(), pack_format::kTensorAlignment);
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
                {"xxh64", pack_format::hex64(sum)}, {"format", format}, {"tensors", tensors}};
  layers_json_[size_t(layer)].push_back(entry.dump());
  pos_ += block_.size();
}

void PackWriter::finish(int n_layers) {
  next_layer(INT_MAX);
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
  json manifest = {{"format", "moestream-pack"},   {"version", pack_format::kVersion},
                   {"created_by", "moestream"},    {"source", source_},
                   {"model_type", model_type_},    {"weights", "weights.safetensors"},
                   {"expert_files", files_},       {"n_experts", n_experts_},
                   {"layers", layers}};
  manifest.update(weights_checksums_.empty() ? pack_format::weight_checksums(tmp_ + "/weights.safetensors")
                                             : json::parse(weights_checksums_));
  manifest["manifest_xxh64"] = pack_format::hex64(pack_format::manifest_checksum(manifest));
  const std::string path = tmp_ + "/" + kPackManifestName;
  std::ofstream mf(path);
  mf << manifest.dump(1) << "\n";
  mf.close();
  if (!mf) fail(path, ": write failed");
  fs::remove(tmp_ + "/" + pack_format::kJournalName);
  fs::rename(tmp_, out_);
  finished_ = true;
}

std::vector<AbandonedPack> pack_temporaries(const std::string& dir) {
  std::vector<AbandonedPack> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const size_t at = name.rfind(".tmp-");
    if (at == std::string::npos || !e.is_directory()) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + at + 5, &end, 10);
    if (*end != '\0' || pid <= 0 || pid > INT32_MAX) continue;
    const bool alive = ::kill(pid_t(pid), 0) == 0 || errno == EPERM;
    found.push_back({e.path().string(), int(pid), alive});
  }
  return found;
}

std::vector<AbandonedPack> remove_abandoned_packs(const std::string& dir, const std::string& except) {
  std::vector<AbandonedPack> removed;
  for (const AbandonedPack& a : pack_temporaries(dir)) {
    if (a.writer_alive || (!except.empty() && pack_format::is_temporary_of(a.path, except))) continue;
    std::error_code ec;
    fs::remove_all(a.path, ec);
    if (!ec) removed.push_back(a);
  }
  return removed;
}

}  // namespace moestream
