// Safetensors: memory-mapped reading of single files and sharded checkpoints, and atomic writing.
//
// File layout: u64 little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data section; offsets are relative to the data section. Opening validates everything
// (header length within the file, JSON well formed, known dtype, end-begin == numel*size, offsets
// inside the data section, no two tensors overlapping) and throws Error naming file and tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moestream {

// A read-only mapping of a whole file; unmapped on destruction. The file stays open, so that a
// reader can pread it into the mapping's addresses (pack's ReadAhead).
class MappedFile {
 public:
  static std::shared_ptr<MappedFile> open(const std::string& path);
  ~MappedFile();
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  const std::string& path() const { return file_->path(); }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const MappedFile& mapping() const { return *file_; }

 private:
  std::shared_ptr<MappedFile> file_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory: model.safetensors, or the shards named by
// model.safetensors.index.json (every indexed tensor must be found in its shard), or, failing
// both, every *.safetensors file in the directory. A name present in two files is an error.
class WeightSet {
 public:
  static WeightSet open_dir(const std::string& dir);
  static WeightSet open_files(const std::vector<std::string>& paths);

  const TensorView* find(const std::string& name) const;  // nullptr when absent
  const TensorView& get(const std::string& name) const;   // throws Error naming tensor and dir
  bool has(const std::string& name) const { return find(name) != nullptr; }
  std::vector<std::string> names() const;  // sorted
  const MappedFile& mapping_of(const std::string& name) const;  // the file holding it
  const std::string& origin() const { return origin_; }

 private:
  std::string origin_;  // directory or file list, for messages
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

// Whether a relative path names something inside its directory: not empty, not absolute, and no
// '..' component (a checkpoint's index or a pack's manifest must not reach outside the model).
bool is_path_inside(const std::string& relative);

// One tensor to write: bytes must hold numel(shape) * dtype_size(dtype).
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
  std::optional<size_t> nbytes = std::nullopt;  // when given, checked against numel * dtype size
};

// Writes to path + ".tmp-<pid>" and renames into place, so readers never see a partial file.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace moestream
