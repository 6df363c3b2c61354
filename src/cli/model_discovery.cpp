// Finding models: what `-m` may name (a directory, a Hugging Face repo id in the hub cache), what
// it may not (a GGUF file, said plainly), `moestream list`, and `moestream cache list|prune`.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "cli/cli.h"
#include "core/error.h"

namespace fs = std::filesystem;

namespace moestream::cli {

namespace {

std::optional<nlohmann::json> read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  return j;
}

bool is_gguf_file(const fs::path& path) {
  if (path.extension() == ".gguf") return true;
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string(magic, 4) == "GGUF";
}

// A repo id as the Hub spells it: "org/name", no path-like parts.
bool looks_like_repo_id(const std::string& s) {
  const size_t slash = s.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == s.size()) return false;
  if (s.find('/', slash + 1) != std::string::npos || s[0] == '.' || s[0] == '~') return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum((unsigned char)c) || c == '-' || c == '_' || c == '.' || c == '/'; });
}

// The snapshot directory a repo's cache folder points at: refs/main, else the newest snapshot.
std::optional<fs::path> hub_snapshot(const fs::path& repo_dir) {
  std::ifstream ref(repo_dir / "refs" / "main");
  std::string commit;
  if (ref >> commit && fs::is_directory(repo_dir / "snapshots" / commit)) return repo_dir / "snapshots" / commit;
  std::optional<fs::path> newest;
  fs::file_time_type newest_time;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(repo_dir / "snapshots", ec)) {
    if (!e.is_directory()) continue;
    const auto t = e.last_write_time();
    if (!newest || t > newest_time) newest = e.path(), newest_time = t;
  }
  return newest;
}

uint64_t bytes_under(const fs::path& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code fe;
    if (fs::is_regular_file(it->path(), fe)) total += fs::file_size(it->path(), fe);  // follows the hub's symlinks
  }
  return total;
}

std::string human_bytes(uint64_t b) {
  char buf[32];
  if (b >= (1ull << 30)) std::snprintf(buf, sizeof buf, "%.1f GB", double(b) / 1e9);
  else std::snprintf(buf, sizeof buf, "%.1f MB", double(b) / 1e6);
  return buf;
}

// What a listing says of one model directory or pack.
struct Entry {
  std::string name, family, quant, where, path;
  uint64_t bytes = 0;
  std::string packed;  // for a source: "yes" (a pack of it is in the cache) or "no"; "-" for packs
};

std::string config_family(const nlohmann::json& c) {
  if (c.contains("text_config") && c["text_config"].is_object() && c["text_config"].contains("model_type") &&
      c["text_config"]["model_type"].is_string())
    return c["text_config"]["model_type"].get<std::string>();
  return c.value("model_type", std::string("?"));
}

// The precision a Hugging Face config declares: MLX affine bits, a quantization_config method,
// else the dtype.
std::string config_quant(const nlohmann::json& c) {
  if (c.contains("quantization") && c["quantization"].is_object()) {
    const auto& q = c["quantization"];
    return "mlx q" + std::to_string(q.value("bits", 0)) + "g" + std::to_string(q.value("group_size", 0));
  }
  if (c.contains("quantization_config") && c["quantization_config"].is_object())
    return c["quantization_config"].value("quant_method", std::string("quantized"));
  for (const char* key : {"dtype", "torch_dtype"})
    if (c.contains(key) && c[key].is_string()) return c[key].get<std::string>();
  return "?";
}

// The formats of a pack's experts, e.g. "q4g64" or "q4g64+q2g64".
std::string pack_quant(const nlohmann::json& manifest) {
  std::vector<std::string> formats;
  if (manifest.contains("layers") && manifest["layers"].is_array())
    for (const auto& layer : manifest["layers"])
      if (layer.is_array())
        for (const auto& e : layer)
          if (e.is_object() && e.contains("format") && e["format"].is_string()) {
            const std::string f = e["format"].get<std::string>();
            if (std::find(formats.begin(), formats.end(), f) == formats.end()) formats.push_back(f);
          }
  std::string s;
  for (const auto& f : formats) s += (s.empty() ? "" : "+") + f;
  return s.empty() ? "-" : s;
}

struct CachedPack {
  fs::path dir;
  std::string source;
  fs::file_time_type time;
};

std::string pack_cache_dir() { return default_cache_dir() + "/packs"; }

std::vector<CachedPack> cached_packs() {
  std::vector<CachedPack> packs;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(pack_cache_dir(), ec)) {
    if (!e.is_directory()) continue;
    const auto m = read_json(e.path() / "moestream-pack.json");
    if (!m) continue;
    packs.push_back({e.path(), m->value("source", std::string()), fs::last_write_time(e.path() / "moestream-pack.json")});
  }
  return packs;
}

// Temporary directories of packs being written (`OUT.tmp-PID`): their writer's PID, if any.
std::optional<pid_t> tmp_pack_pid(const fs::path& dir) {
  const std::string name = dir.filename().string();
  const size_t at = name.rfind(".tmp-");
  if (at == std::string::npos) return std::nullopt;
  char* end = nullptr;
  const long pid = std::strtol(name.c_str() + at + 5, &end, 10);
  if (*end != '\0' || pid <= 0) return std::nullopt;
  return pid_t(pid);
}

bool process_alive(pid_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

std::vector<Entry> hub_entries(const std::vector<CachedPack>& packs) {
  std::vector<Entry> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(hf_hub_cache_dir(), ec)) {
    const std::string folder = e.path().filename().string();
    if (!e.is_directory() || folder.rfind("models--", 0) != 0) continue;
    const auto snap = hub_snapshot(e.path());
    if (!snap) continue;
    const auto config = read_json(*snap / "config.json");
    if (!config) continue;
    std::string id = folder.substr(8);
    if (const size_t sep = id.find("--"); sep != std::string::npos) id.replace(sep, 2, "/");
    Entry x{id, config_family(*config), config_quant(*config), "hf cache", snap->string(), bytes_under(*snap), "no"};
    const std::string canon = fs::weakly_canonical(*snap, ec).string();
    for (const auto& p : packs)
      if (p.source == canon || p.source == snap->string()) x.packed = "yes";
    out.push_back(x);
  }
  return out;
}

Entry dir_entry(const fs::path& dir, const std::vector<CachedPack>& packs, const std::string& where) {
  Entry x{dir.filename().string(), "?", "?", where, dir.string(), bytes_under(dir), "-"};
  if (const auto m = read_json(dir / "moestream-pack.json")) {
    x.family = m->value("model_type", std::string("?"));
    x.quant = "pack " + pack_quant(*m);
    return x;
  }
  if (const auto c = read_json(dir / "config.json")) {
    x.family = config_family(*c);
    x.quant = config_quant(*c);
    std::error_code ec;
    const std::string canon = fs::weakly_canonical(dir, ec).string();
    x.packed = "no";
    for (const auto& p : packs)
      if (p.source == canon) x.packed = "yes";
  }
  return x;
}

void print_entries(const std::vector<Entry>& entries) {
  if (entries.empty()) {
    std::printf("no models found (looked in %s and %s)\n", pack_cache_dir().c_str(), hf_hub_cache_dir().c_str());
    return;
  }
  std::printf("%-40s %-18s %-16s %10s  %-8s %-6s %s\n", "NAME", "FAMILY", "QUANT", "SIZE", "WHERE", "PACKED", "PATH");
  for (const Entry& e : entries)
    std::printf("%-40s %-18s %-16s %10s  %-8s %-6s %s\n", e.name.c_str(), e.family.c_str(), e.quant.c_str(),
                human_bytes(e.bytes).c_str(), e.where.c_str(), e.packed.c_str(), e.path.c_str());
}

}  // namespace

std::string hf_hub_cache_dir() {
  if (const char* v = std::getenv("HF_HUB_CACHE"); v && *v) return v;
  if (const char* v = std::getenv("HF_HOME"); v && *v) return std::string(v) + "/hub";
  if (const char* v = std::getenv("XDG_CACHE_HOME"); v && *v) return std::string(v) + "/huggingface/hub";
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : "/tmp") + "/.cache/huggingface/hub";
}

std::string resolve_model_arg(const std::string& arg) {
  std::error_code ec;
  const fs::path p(arg);
  if (fs::is_directory(p, ec)) return arg;
  if (fs::exists(p, ec)) {
    if (is_gguf_file(p))
      fail(arg, ": a GGUF file, which moestream does not read; give the model's Hugging Face directory "
                "(config.json and *.safetensors, e.g. `-m org/name` once it is in the Hugging Face cache) or an "
                "mlx-community quantization of it");
    fail(arg, ": not a directory (-m takes a model directory, a pack, or a Hugging Face repo id)");
  }
  if (looks_like_repo_id(arg)) {
    std::string folder = "models--" + arg;
    folder.replace(folder.find('/'), 1, "--");
    const fs::path repo = fs::path(hf_hub_cache_dir()) / folder;
    if (fs::is_directory(repo, ec)) {
      if (const auto snap = hub_snapshot(repo)) return snap->string();
      fail(arg, ": found in the Hugging Face cache (", repo.string(), ") but it has no snapshot");
    }
    fail(arg, ": no such directory, and not in the Hugging Face cache (", hf_hub_cache_dir(),
         "); `moestream list` shows the models found");
  }
  fail(arg, ": no such model directory");
}

void add_list(CLI::App& app) {
  auto dirs = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = app.add_subcommand("list", "List models: packs in the cache, the Hugging Face cache, and directories given");
  cmd->add_option("DIR", *dirs, "More directories to look in (each a model, or a folder of models)");
  cmd->callback([dirs] {
    const auto packs = cached_packs();
    std::vector<Entry> entries;
    for (const std::string& d : *dirs) {
      if (!fs::is_directory(d)) fail(d, ": not a directory");
      if (fs::exists(fs::path(d) / "config.json") || fs::exists(fs::path(d) / "moestream-pack.json")) {
        entries.push_back(dir_entry(d, packs, "given"));
        continue;
      }
      for (const auto& e : fs::directory_iterator(d))
        if (e.is_directory() && (fs::exists(e.path() / "config.json") || fs::exists(e.path() / "moestream-pack.json")))
          entries.push_back(dir_entry(e.path(), packs, "given"));
    }
    for (const auto& p : packs) entries.push_back(dir_entry(p.dir, packs, "packs"));
    for (auto& e : hub_entries(packs)) entries.push_back(std::move(e));
    print_entries(entries);
  });
}

void add_cache(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("cache", "The pack cache ($MOESTREAM_CACHE/packs): list or prune");
  cmd->require_subcommand(1);
  CLI::App* list = cmd->add_subcommand("list", "Packs in the cache with their size and source");
  list->callback([] {
    const auto packs = cached_packs();
    uint64_t total = 0;
    std::printf("%-56s %10s  %s\n", "PACK", "SIZE", "SOURCE");
    for (const auto& p : packs) {
      const uint64_t b = bytes_under(p.dir);
      total += b;
      std::printf("%-56s %10s  %s%s\n", p.dir.filename().string().c_str(), human_bytes(b).c_str(), p.source.c_str(),
                  p.source.empty() || fs::exists(p.source) ? "" : " (gone)");
    }
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(pack_cache_dir(), ec))
      if (const auto pid = tmp_pack_pid(e.path()))
        std::printf("%-56s %10s  (unfinished pack, %s)\n", e.path().filename().string().c_str(),
                    human_bytes(bytes_under(e.path())).c_str(), process_alive(*pid) ? "being written" : "abandoned");
    std::printf("%zu packs, %s in %s\n", packs.size(), human_bytes(total).c_str(), pack_cache_dir().c_str());
  });
  auto all = std::make_shared<bool>(false);
  auto dry = std::make_shared<bool>(false);
  CLI::App* prune = cmd->add_subcommand(
      "prune", "Remove unfinished packs of dead processes, packs whose source is gone, and older packs of the same source");
  prune->add_flag("--all", *all, "Remove every pack in the cache");
  prune->add_flag("--dry-run", *dry, "Say what would be removed, remove nothing");
  prune->callback([all, dry] {
    std::vector<std::pair<fs::path, std::string>> doomed;  // dir, why
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(pack_cache_dir(), ec))
      if (const auto pid = tmp_pack_pid(e.path()); pid && !process_alive(*pid))
        doomed.push_back({e.path(), "unfinished, its writer (pid " + std::to_string(*pid) + ") is gone"});
    auto packs = cached_packs();
    std::sort(packs.begin(), packs.end(), [](const CachedPack& a, const CachedPack& b) { return a.time > b.time; });
    std::map<std::string, int> seen;
    for (const auto& p : packs) {
      if (*all) doomed.push_back({p.dir, "--all"});
      else if (!p.source.empty() && !fs::exists(p.source)) doomed.push_back({p.dir, "its source is gone"});
      else if (!p.source.empty() && seen[p.source]++ > 0) doomed.push_back({p.dir, "a newer pack of the same source exists"});
    }
    uint64_t freed = 0;
    for (const auto& [dir, why] : doomed) {
      const uint64_t b = bytes_under(dir);
      std::printf("%s %s (%s): %s\n", *dry ? "would remove" : "removed", dir.filename().string().c_str(),
                  human_bytes(b).c_str(), why.c_str());
      if (!*dry) {
        fs::remove_all(dir, ec);
        if (ec) fail(dir.string(), ": cannot remove: ", ec.message());
      }
      freed += b;
    }
    std::printf("%s %s\n", *dry ? "would free" : "freed", human_bytes(freed).c_str());
  });
}

}  // namespace moestream::cli
