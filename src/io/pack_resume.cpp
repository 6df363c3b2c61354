// Resuming an interrupted pack. A PackWriter that resume() was called on keeps a journal in its
// temporary directory: first what is being packed (the key: a fingerprint of the source's files
// and the options that change the bytes), then one line per completed file (weights.safetensors
// with its checksums, each layer's expert file with its experts' manifest entries). A run killed
// part way leaves the directory behind; the next pack to the same destination with the same key
// takes it over, checks every journaled file against its checksums, keeps those that match and
// writes the rest, so that the result is the same bytes as a pack that ran through.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/thread_pool.h"
#include "io/pack.h"
#include "io/pack_format.h"

namespace moestream {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// name:size:mtime of every file in `dir` (symlinks followed, as in a hub snapshot), sorted, and
// the directory itself: a copy, an edit or a new shard changes it.
std::string fingerprint(const std::string& dir) {
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    entries.push_back(e.path().filename().string() + ":" + std::to_string(e.file_size()) + ":" +
                      std::to_string(fs::last_write_time(e.path()).time_since_epoch().count()));
  }
  std::sort(entries.begin(), entries.end());
  std::string key = fs::absolute(dir).lexically_normal().string();
  for (const auto& s : entries) key += "\n" + s;
  return pack_format::hex64(XXH64(key.data(), key.size(), 0));
}

uint64_t bytes_under(const fs::path& dir) {
  uint64_t n = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
    if (it->is_regular_file(ec)) n += it->file_size(ec);
  return n;
}

std::string human(uint64_t bytes) {
  char text[32];
  if (bytes >= 1000000000)
    std::snprintf(text, sizeof text, "%.2f GB", bytes / 1e9);
  else
    std::snprintf(text, sizeof text, "%.1f MB", bytes / 1e6);
  return text;
}

// Why a temporary directory with journal `header` cannot be resumed under `key`; empty if it can.
std::string why_not(const json& header, const PackKey& key) {
  if (!header.is_object() || !header.contains("key") || !header["key"].is_object())
    return "it has no journal to resume from";
  PackKey old;
  for (const auto& [k, v] : header["key"].items())
    if (v.is_string()) old[k] = v.get<std::string>();
  if (old == key) return "";
  if (old["revision"] != key.at("revision")) return "it was written by another version of the packer";
  if (old["source"] != key.at("source")) return "its source changed";
  std::string diff;
  for (const auto& [k, v] : key) {
    const std::string before = old.count(k) ? old[k] : "?";
    if (before == v) continue;
    diff += (diff.empty() ? "" : ", ") + k + " " + (before.empty() ? "(none)" : before) + ", now " + (v.empty() ? "(none)" : v);
  }
  return "it was packed with other options (" + diff + ")";
}

json read_journal_header(const std::string& dir) {
  std::ifstream in(dir + "/" + pack_format::kJournalName);
  std::string line;
  if (!in || !std::getline(in, line)) return nullptr;
  return json::parse(line, nullptr, false);
}

// Whether the expert file at `path` holds exactly the blocks `entries` describe, each matching
// its checksum; empty if so, else what is wrong.
std::string check_layer_file(const std::string& path, const std::vector<json>& entries) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "missing";
  std::vector<char> buf;
  uint64_t pos = 0;
  std::string problem;
  for (size_t i = 0; i < entries.size() && problem.empty(); ++i) {
    const json& e = entries[i];
    const uint64_t size = e.value("size", uint64_t(0)), offset = e.value("offset", uint64_t(0));
    if (offset != pos || size == 0) {
      problem = "expert " + std::to_string(i) + " is not where the journal says";
      break;
    }
    buf.resize(size);
    size_t got = 0;
    while (got < size) {
      const ssize_t n = ::pread(fd, buf.data() + got, size - got, off_t(offset + got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += size_t(n);
    }
    if (got != size)
      problem = "shorter than the journal says";
    else if (XXH64(buf.data(), size, 0) != pack_format::parse_hex64(e.value("xxh64", ""), path))
      problem = "expert " + std::to_string(i) + " does not match its checksum";
    pos += size;
  }
  struct stat st {};
  if (problem.empty() && (::fstat(fd, &st) != 0 || uint64_t(st.st_size) != pos)) problem = "longer than the journal says";
  ::close(fd);
  return problem;
}

}  // namespace

namespace pack_format {

bool is_temporary_of(const std::string& path, const std::string& out) {
  const fs::path p = fs::absolute(path).lexically_normal(), o = fs::absolute(out).lexically_normal();
  if (p.parent_path() != o.parent_path()) return false;
  const std::string name = p.filename().string(), base = o.filename().string();
  for (const std::string middle : {".tmp-", ".calib.tmp-"}) {
    const std::string prefix = base + middle;
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    if (name.find_first_not_of("0123456789", prefix.size()) == std::string::npos) return true;
  }
  return false;
}

}  // namespace pack_format

PackKey pack_key(const std::string& src, const PackOptions& options) {
  PackKey key;
  key["revision"] = std::to_string(kPackerRevision);
  key["source"] = fingerprint(src);
  key["--quant"] = options.quant;
  key["--group-size"] = std::to_string(options.group_size);
  key["--quant-all"] = options.quant_all ? "on" : "off";
  key["--clip-search"] = options.clip_search ? "on" : "off";
  std::string gptq;
  if (!options.gptq_text.empty()) {
    const fs::path text = fs::absolute(options.gptq_text);
    std::error_code ec;
    gptq = text.string() + " (" + std::to_string(fs::file_size(text, ec)) + " bytes, " +
           std::to_string(options.gptq_tokens) + " tokens at most, " + std::to_string(options.gptq_min_tokens) +
           " per expert, " + std::to_string(options.gptq_passes) + " passes, " +
           std::to_string(options.gptq_expert_tokens) + " reconstruction tokens, modified " +
           std::to_string(fs::last_write_time(text, ec).time_since_epoch().count()) + ")";
  }
  key["--gptq"] = gptq;
  std::string tiers;
  for (const auto& layer : options.expert_bits) {
    for (int bits : layer) tiers += char('0' + bits);
    tiers += '/';
  }
  key["--tiered"] = tiers.empty() ? "" : "plan " + pack_format::hex64(XXH64(tiers.data(), tiers.size(), 0));
  return key;
}

void PackWriter::journal(const std::string& line) {
  if (!journaling_) return;
  const std::string path = tmp_ + "/" + pack_format::kJournalName;
  std::ofstream out(path, std::ios::app);
  out << line << "\n";
  out.close();
  if (!out) fail(path, ": write failed");
  // Tests stop a pack part way here, as a kill would: nothing is cleaned up.
  static const char* stop = std::getenv("MOESTREAM_PACK_STOP_AFTER");
  if (stop && ++journaled_ == std::atoi(stop)) {
    std::fprintf(stderr, "pack: stopping after %d files (MOESTREAM_PACK_STOP_AFTER)\n", journaled_);
    std::fflush(stderr);
    std::_Exit(1);
  }
}

void PackWriter::resume(const PackKey& key, int threads) {
  // A destination named like a temporary is another pack's scratch pack (GPTQ calibration's),
  // made under a new name by each run and removed by it: nothing to resume or journal.
  if (fs::path(out_).filename().string().find(".tmp-") != std::string::npos) return;
  journaling_ = true;
  const fs::path parent = fs::path(out_).parent_path();
  std::string claimed;
  int claimed_pid = 0;
  for (const AbandonedPack& a : pack_temporaries(parent.empty() ? "." : parent.string())) {
    if (a.writer_alive || a.path == tmp_ || !pack_format::is_temporary_of(a.path, out_)) continue;
    const bool calib = fs::path(a.path).filename().string().compare(fs::path(out_).filename().string().size(), 11,
                                                                     ".calib.tmp-") == 0;
    const std::string why = calib ? "GPTQ calibration's scratch pack" : why_not(read_journal_header(a.path), key);
    if (why.empty() && claimed.empty()) {
      std::error_code ec;
      fs::remove_all(tmp_, ec);
      fs::rename(a.path, tmp_, ec);  // fails if another pack took it first
      if (!ec) {
        claimed = a.path;
        claimed_pid = a.pid;
        continue;
      }
      fs::create_directories(tmp_ + "/experts");
      continue;
    }
    const uint64_t size = bytes_under(a.path);
    std::error_code ec;
    fs::remove_all(a.path, ec);
    if (ec) {
      std::fprintf(stderr, "pack: could not remove %s (%s), an unfinished pack left by process %d: %s\n", a.path.c_str(),
                   human(size).c_str(), a.pid, ec.message().c_str());
      continue;
    }
    std::fprintf(stderr, "pack: removed %s (%s), an unfinished pack left by process %d: %s\n", a.path.c_str(),
                 human(size).c_str(), a.pid, why.empty() ? "another one is resumed" : why.c_str());
  }

  std::vector<std::string> kept_lines;
  if (!claimed.empty()) {
    // The journal's file lines (a torn last line, from a kill during the append, is skipped).
    std::ifstream in(tmp_ + "/" + pack_format::kJournalName);
    std::string line;
    std::getline(in, line);
    json weights;
    std::vector<std::pair<int, json>> layers;
    while (std::getline(in, line)) {
      json j = json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("weights") && j["note"].is_string() && json::accept(j["note"].get<std::string>()))
        weights = j;
      if (j.is_object() && j.contains("layer") && j["layer"].is_number_integer() && j.contains("experts") &&
          j["experts"].is_array() && j.contains("file") && j["file"].is_string())
        layers.emplace_back(j["layer"].get<int>(), j);
    }
    in.close();
    // Checking reads every kept byte (at disk speed, minutes for hundreds of GB): say so first.
    std::fprintf(stderr, "pack: checking the %zu files that process %d completed in %s (%s)\n",
                 layers.size() + (weights.is_null() ? 0 : 1), claimed_pid, claimed.c_str(), human(bytes_under(tmp_)).c_str());
    std::vector<std::string> problems;
    uint64_t kept_bytes = 0;
    if (!weights.is_null()) {
      const std::string path = tmp_ + "/weights.safetensors";
      json sums;
      try {
        sums = pack_format::weight_checksums(path);
      } catch (const std::exception&) {
      }
      if (sums == weights["weights"]) {
        kept_weights_ = true;
        weights_checksums_ = sums.dump();
        weights_note_ = weights["note"].get<std::string>();
        kept_lines.push_back(weights.dump());
        kept_bytes += fs::file_size(path);
      } else {
        problems.push_back("weights.safetensors does not match its checksums");
      }
    }
    std::vector<std::string> layer_problems(layers.size());
    ThreadPool pool(threads);
    pool.parallel_for(layers.size(), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        const json& j = layers[i].second;
        try {
          layer_problems[i] = check_layer_file(tmp_ + "/" + j.value("file", ""), j["experts"].get<std::vector<json>>());
        } catch (const std::exception&) {  // a journal line we cannot read: write the file again
          layer_problems[i] = "its journal entry is unreadable";
        }
      }
    });
    for (size_t i = 0; i < layers.size(); ++i) {
      const json& j = layers[i].second;
      if (!layer_problems[i].empty()) {
        problems.push_back(j.value("file", "") + ": " + layer_problems[i]);
        continue;
      }
      std::vector<std::string>& entries = kept_layers_[layers[i].first];
      for (const json& e : j["experts"]) entries.push_back(e.dump());
      kept_lines.push_back(j.dump());
      kept_bytes += fs::file_size(tmp_ + "/" + j.value("file", ""));
    }
    // Whatever else is there (a file cut short by the kill, configs) is written again.
    for (const auto& e : fs::directory_iterator(tmp_)) {
      const std::string name = e.path().filename().string();
      if (name == "experts") {
        for (const auto& x : fs::directory_iterator(e.path())) {
          bool keep = false;
          for (const auto& [layer, entries] : kept_layers_)
            keep |= x.path().filename() == "layer-" + std::to_string(layer) + ".bin";
          if (!keep) fs::remove_all(x.path());
        }
      } else if (!(name == "weights.safetensors" && kept_weights_) && name != pack_format::kJournalName) {
        fs::remove_all(e.path());
      }
    }
    const size_t total = (weights.is_null() ? 0 : 1) + layers.size();
    std::string note;
    for (const std::string& p : problems) note += "; " + p + ": written again";
    std::fprintf(stderr, "pack: resuming %s, left by process %d: kept %zu of %zu completed files (%s, checksums verified)%s\n",
                 claimed.c_str(), claimed_pid, kept_lines.size(), total, human(kept_bytes).c_str(), note.c_str());
  }
  fs::create_directories(tmp_ + "/experts");
  // Written whole and renamed over the old one, so that a kill now loses nothing kept.
  std::string text = json{{"key", key}}.dump() + "\n";
  for (const std::string& l : kept_lines) text += l + "\n";
  const std::string path = tmp_ + "/" + pack_format::kJournalName;
  std::ofstream out(path + ".new", std::ios::trunc);
  out << text;
  out.close();
  if (!out) fail(path, ".new: write failed");
  fs::rename(path + ".new", path);
}

}  // namespace moestream
