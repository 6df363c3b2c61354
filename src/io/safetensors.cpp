#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moestream {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// No real checkpoint header comes near this; a larger value means a corrupt or foreign file.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void write_u64_le(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}

// numel * elem_size, or nullopt on overflow.
std::optional<uint64_t> byte_count(const std::vector<int64_t>& shape, size_t elem_size) {
  uint64_t n = elem_size;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / uint64_t(d)) return std::nullopt;
    n *= uint64_t(d);
  }
  return n;
}

// A JSON integer as int64 (nlohmann parses non-negative literals as unsigned, negative as signed).
std::optional<int64_t> as_int64(const json& j) {
  if (j.is_number_unsigned()) {
    uint64_t u = j.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return int64_t(u);
  }
  if (j.is_number_integer()) return j.get<int64_t>();
  return std::nullopt;
}

struct Extent {
  uint64_t begin, end;
  const std::string* name;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// MappedFile

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MS_CHECK_SYS(fd >= 0, "open", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    errno = e;
    MS_CHECK_SYS(false, "fstat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file");
  }
  std::shared_ptr<MappedFile> f(new MappedFile());
  f->path_ = path;
  f->size_ = size_t(st.st_size);
  f->fd_ = fd;  // closed by the destructor, also when mmap fails
  if (f->size_ > 0) {  // mmap of length 0 is invalid; an empty file maps to nothing
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    MS_CHECK_SYS(p != MAP_FAILED, "mmap", path);
    f->data_ = static_cast<const uint8_t*>(p);
  }
  return f;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> st(new SafetensorsFile());
  st->file_ = MappedFile::open(path);
  const uint8_t* base = st->file_->data();
  const uint64_t file_size = st->file_->size();

  if (file_size < 8)
    fail(path, ": not a safetensors file: ", file_size,
         " bytes, shorter than the 8-byte header length");
  const uint64_t header_len = read_u64_le(base);
  if (header_len > kMaxHeaderBytes)
    fail(path, ": header length ", header_len, " is too large (limit ", kMaxHeaderBytes,
         " bytes); not a safetensors file or corrupt");
  if (header_len > file_size - 8)
    fail(path, ": header length ", header_len, " is too large: only ", file_size - 8,
         " bytes follow the length field (truncated file?)");

  const char* hbegin = reinterpret_cast<const char*>(base + 8);
  json header;
  try {
    header = json::parse(hbegin, hbegin + header_len);
  } catch (const json::exception& e) {
    fail(path, ": header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) fail(path, ": header must be a JSON object, found ", header.type_name());

  const uint8_t* data_section = base + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;
  std::vector<Extent> extents;

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object())
        fail(path, ": __metadata__ must be an object, found ", entry.type_name());
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string())
          fail(path, ": __metadata__ value for '", key, "' must be a string, found ",
               value.type_name());
        st->metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const auto&... what) { fail(path, ": tensor '", name, "': ", what...); };
    if (!entry.is_object()) bad("entry must be an object, found ", entry.type_name());

    auto dt = entry.find("dtype");
    if (dt == entry.end()) bad("missing 'dtype'");
    if (!dt->is_string()) bad("'dtype' must be a string, found ", dt->type_name());
    const std::string dtype_str = dt->get<std::string>();
    std::optional<DType> dtype = dtype_from_name(dtype_str);
    if (!dtype) bad("unknown dtype '", dtype_str, "'");

    auto sh = entry.find("shape");
    if (sh == entry.end()) bad("missing 'shape'");
    if (!sh->is_array()) bad("'shape' must be an array, found ", sh->type_name());
    std::vector<int64_t> shape;
    for (const json& d : *sh) {
      std::optional<int64_t> v = as_int64(d);
      if (!v) bad("'shape' must hold integers, found ", d.dump());
      if (*v < 0) bad("negative dimension ", *v, " in shape ", sh->dump());
      shape.push_back(*v);
    }

    auto off = entry.find("data_offsets");
    if (off == entry.end()) bad("missing 'data_offsets'");
    std::optional<int64_t> b, e;
    if (off->is_array() && off->size() == 2) b = as_int64((*off)[0]), e = as_int64((*off)[1]);
    if (!b || !e) bad("'data_offsets' must be [begin, end] with two integers, found ", off->dump());
    if (*b < 0 || *e < 0) bad("negative data offset in ", off->dump());
    const uint64_t begin = uint64_t(*b), end = uint64_t(*e);
    if (begin > end) bad("data_offsets begin ", begin, " > end ", end);

    std::optional<uint64_t> expected = byte_count(shape, dtype_size(*dtype));
    if (!expected) bad("byte size of shape ", shape_str(shape), " overflows");
    if (end - begin != *expected)
      bad("size mismatch: dtype ", dtype_str, " shape ", shape_str(shape), " needs ", *expected,
          " bytes, data_offsets [", begin, ", ", end, "] hold ", end - begin);
    if (end > data_size)
      bad("data_offsets end ", end, " is beyond the data section of ", data_size,
          " bytes (truncated file)");

    TensorView view;
    view.name = name;
    view.dtype = *dtype;
    view.shape = std::move(shape);
    view.data = data_section + begin;
    view.nbytes = size_t(end - begin);
    auto [it, inserted] = st->tensors_.emplace(name, std::move(view));
    if (begin != end) extents.push_back({begin, end, &it->first});
  }

  // Zero-size tensors occupy no bytes and cannot overlap anything, so they are not listed.
  std::sort(extents.begin(), extents.end(),
            [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < extents.size(); ++i) {
    const Extent &prev = extents[i - 1], &cur = extents[i];
    if (cur.begin < prev.end)
      fail(path, ": tensors '", *prev.name, "' [", prev.begin, ", ", prev.end, ") and '", *cur.name,
           "' [", cur.begin, ", ", cur.end, ") are overlapping");
  }
  return st;
}

// ---------------------------------------------------------------------------------------------
// WeightSet

namespace {

void add_file(std::vector<std::unique_ptr<SafetensorsFile>>& files,
              std::map<std::string, const TensorView*>& index, std::unique_ptr<SafetensorsFile> f) {
  for (const auto& [name, view] : f->tensors()) {
    auto [it, inserted] = index.emplace(name, &view);
    if (!inserted) {
      for (const auto& other : files)
        if (other->tensors().count(name))
          fail("tensor '", name, "' appears in both ", other->path(), " and ", f->path());
    }
  }
  files.push_back(std::move(f));
}

void read_json_file(const std::string& path, json& out) {
  std::shared_ptr<MappedFile> f = MappedFile::open(path);
  const char* p = reinterpret_cast<const char*>(f->data());
  try {
    out = json::parse(p, p + f->size());
  } catch (const json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
}

}  // namespace

bool is_path_inside(const std::string& relative) {
  if (relative.empty() || relative[0] == '/' || relative.find('\0') != std::string::npos) return false;
  for (const auto& part : fs::path(relative))
    if (part == "..") return false;
  return true;
}

WeightSet WeightSet::open_dir(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail(dir, ": not a directory (expected a checkpoint directory)");

  WeightSet ws;
  ws.origin_ = dir;
  const fs::path root(dir);
  const fs::path index_path = root / "model.safetensors.index.json";

  if (fs::exists(index_path, ec)) {
    const std::string ipath = index_path.string();
    json index;
    read_json_file(ipath, index);
    if (!index.is_object()) fail(ipath, ": must be a JSON object, found ", index.type_name());
    auto wm = index.find("weight_map");
    if (wm == index.end()) fail(ipath, ": missing field 'weight_map'");
    if (!wm->is_object()) fail(ipath, ": 'weight_map' must be an object, found ", wm->type_name());

    std::map<std::string, SafetensorsFile*> shards;  // shard filename -> opened file
    for (const auto& [tensor, shard] : wm->items()) {
      if (!shard.is_string())
        fail(ipath, ": weight_map entry for tensor '", tensor, "' must be a string, found ",
             shard.type_name());
      const std::string shard_name = shard.get<std::string>();
      auto it = shards.find(shard_name);
      if (it == shards.end()) {
        if (!is_path_inside(shard_name))
          fail(ipath, ": shard '", shard_name, "' (named for tensor '", tensor, "') is outside ", dir);
        const fs::path shard_path = root / shard_name;
        if (!fs::is_regular_file(shard_path, ec))
          fail(ipath, ": shard '", shard_name, "' (named for tensor '", tensor,
               "') does not exist in ", dir);
        ws.files_.push_back(SafetensorsFile::open(shard_path.string()));
        it = shards.emplace(shard_name, ws.files_.back().get()).first;
      }
      auto t = it->second->tensors().find(tensor);
      if (t == it->second->tensors().end())
        fail(ipath, ": tensor '", tensor, "' is mapped to shard '", shard_name,
             "' but that shard does not contain it");
      ws.index_.emplace(tensor, &t->second);
    }
    return ws;
  }

  std::vector<std::string> paths;
  const fs::path single = root / "model.safetensors";
  if (fs::is_regular_file(single, ec)) {
    paths.push_back(single.string());
  } else {
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      if (entry.is_regular_file() && entry.path().extension() == ".safetensors")
        paths.push_back(entry.path().string());
    }
    if (ec) fail(dir, ": cannot list directory: ", ec.message());
    std::sort(paths.begin(), paths.end());
  }
  if (paths.empty()) fail(dir, ": no *.safetensors files and no model.safetensors.index.json");
  for (const auto& p : paths) add_file(ws.files_, ws.index_, SafetensorsFile::open(p));
  return ws;
}

WeightSet WeightSet::open_files(const std::vector<std::string>& paths) {
  if (paths.empty()) fail("WeightSet::open_files: no files given");
  WeightSet ws;
  for (size_t i = 0; i < paths.size(); ++i) ws.origin_ += (i ? ", " : "") + paths[i];
  for (const auto& p : paths) add_file(ws.files_, ws.index_, SafetensorsFile::open(p));
  return ws;
}

const TensorView* WeightSet::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

const MappedFile& WeightSet::mapping_of(const std::string& name) const {
  for (const auto& f : files_)
    if (f->tensors().count(name)) return f->mapping();
  (void)get(name);  // names the missing tensor
  fail("tensor '", name, "' not found in ", origin_);
}

const TensorView& WeightSet::get(const std::string& name) const {
  if (const TensorView* t = find(name)) return *t;
  // Suggest up to three names sharing the longest prefix with the one asked for.
  auto common = [&](const std::string& s) {
    size_t n = 0;
    while (n < s.size() && n < name.size() && s[n] == name[n]) ++n;
    return n;
  };
  size_t best = 0;
  for (const auto& [candidate, view] : index_) best = std::max(best, common(candidate));
  std::string hint;
  if (best > 0) {
    int shown = 0;
    for (const auto& [candidate, view] : index_) {
      if (common(candidate) != best) continue;
      hint += (shown ? ", " : "; did you mean: ") + candidate;
      if (++shown == 3) break;
    }
  }
  fail("tensor '", name, "' not found in ", origin_, hint);
}

std::vector<std::string> WeightSet::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, view] : index_) out.push_back(name);
  return out;
}

// ---------------------------------------------------------------------------------------------
// write_safetensors

namespace {

// Removes the temp file unless disarmed, so a failed write leaves nothing behind.
struct TempFile {
  std::string path;
  int fd = -1;
  bool keep = false;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!keep) ::unlink(path.c_str());
  }
};

void write_all(TempFile& tmp, const std::string& target, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t w = ::write(tmp.fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail(target, ": write to ", tmp.path, " failed: ", std::strerror(errno));
    p += w;
    n -= size_t(w);
  }
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  std::vector<uint64_t> sizes;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      fail(path, ": invalid tensor name '", t.name, "'");
    if (header.contains(t.name)) fail(path, ": tensor '", t.name, "' given twice");
    std::optional<uint64_t> n = byte_count(t.shape, dtype_size(t.dtype));
    if (!n) fail(path, ": tensor '", t.name, "': invalid shape ", shape_str(t.shape));
    if (t.nbytes && *t.nbytes != *n)
      fail(path, ": tensor '", t.name, "': dtype ", dtype_name(t.dtype), " shape ",
           shape_str(t.shape), " needs ", *n, " bytes, buffer holds ", *t.nbytes);
    if (*n > 0 && t.data == nullptr) fail(path, ": tensor '", t.name, "': data is null");
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + *n}}};
    sizes.push_back(*n);
    offset += *n;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": cannot encode header: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // data section starts 8-byte aligned

  TempFile tmp;
  tmp.path = path + ".tmp-" + std::to_string(::getpid());
  tmp.fd = ::open(tmp.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (tmp.fd < 0) {
    tmp.keep = true;  // nothing was created
    fail(path, ": cannot create ", tmp.path, ": ", std::strerror(errno));
  }
  uint8_t len[8];
  write_u64_le(len, text.size());
  write_all(tmp, path, len, 8);
  write_all(tmp, path, text.data(), text.size());
  for (size_t i = 0; i < tensors.size(); ++i) write_all(tmp, path, tensors[i].data, sizes[i]);

  struct stat st {};
  if (::fstat(tmp.fd, &st) != 0)
    fail(path, ": fstat of ", tmp.path, " failed: ", std::strerror(errno));
  if (uint64_t(st.st_size) != 8 + text.size() + offset)
    fail(path, ": wrote ", st.st_size, " bytes to ", tmp.path, ", expected ",
         8 + text.size() + offset);
  int rc = ::close(tmp.fd);
  tmp.fd = -1;
  if (rc != 0) fail(path, ": close of ", tmp.path, " failed: ", std::strerror(errno));
  if (::rename(tmp.path.c_str(), path.c_str()) != 0)
    fail(path, ": rename from ", tmp.path, " failed: ", std::strerror(errno));
  tmp.keep = true;
}

}  // namespace moestream
