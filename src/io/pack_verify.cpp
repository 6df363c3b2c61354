// verify_pack: every byte of a pack checked against the manifest's checksums, problems listed
// rather than thrown, so that one run names every damaged tensor and expert.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "io/pack.h"
#include "io/pack_format.h"

namespace moestream {

namespace {

// Reads [offset, offset + n) of fd into buf; false on a short read.
bool read_at(int fd, uint64_t offset, uint64_t n, std::vector<char>& buf) {
  buf.resize(n);
  for (uint64_t done = 0; done < n;) {
    const ssize_t r = ::pread(fd, buf.data() + done, n - done, off_t(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    done += uint64_t(r);
  }
  return true;
}

void check_experts(const PackManifest& m, PackCheck& check) {
  std::vector<char> block;
  for (size_t f = 0; f < m.expert_files.size(); ++f) {
    const std::string path = m.dir + "/" + m.expert_files[f];
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      check.problems.push_back(path + ": cannot open: " + std::strerror(errno));
      continue;
    }
    for (size_t l = 0; l < m.layers.size(); ++l)
      for (size_t e = 0; e < m.layers[l].size(); ++e) {
        const PackedExpert& pe = m.layers[l][e];
        if (size_t(pe.file) != f) continue;
        const std::string where = path + ": layer " + std::to_string(l) + " expert " + std::to_string(e);
        if (!read_at(fd, pe.offset, pe.size, block))
          check.problems.push_back(where + ": short read");
        else if (XXH64(block.data(), block.size(), 0) != pe.checksum)
          check.problems.push_back(where + ": checksum mismatch");
        ++check.experts;
        check.expert_bytes += pe.size;
      }
    ::close(fd);
  }
}

}  // namespace

PackCheck verify_pack(const std::string& dir) {
  PackCheck check;
  PackManifest m;
  try {
    m = PackManifest::load(dir, /*warn_unchecked=*/false);
  } catch (const Error& e) {
    check.problems.push_back(e.what());
    return check;
  }
  if (!m.has_checksums())
    check.problems.push_back(dir + "/" + kPackManifestName + ": pack format " + std::to_string(m.version) +
                             " has no checksums for the manifest and the resident weights; re-pack it (moestream pack)");
  try {
    const WeightSet weights = WeightSet::open_files({m.dir + "/" + m.weights_file});
    if (m.has_checksums())
      for (std::string& problem : m.weight_problems(weights)) check.problems.push_back(std::move(problem));
    for (const std::string& name : weights.names()) {
      ++check.tensors;
      check.tensor_bytes += weights.get(name).nbytes;
    }
  } catch (const Error& e) {
    check.problems.push_back(e.what());
  }
  check_experts(m, check);
  return check;
}

}  // namespace moestream
