#include <signal.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>

#include "backend/backend_factory.h"
#include "cli/cli.h"
#include "core/error.h"
#include "core/files.h"

namespace moestream::cli {

std::vector<int32_t> parse_token_list(const std::string& text, const std::string& flag) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    char* end = nullptr;
    errno = 0;
    long long v = item.empty() ? -1 : std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno != 0 || v < 0 || v > INT32_MAX)
      fail(flag, ": '", item, "' is not a token id (expected comma-separated non-negative integers)");
    ids.push_back(int32_t(v));
    pos = comma + 1;
  }
  return ids;
}

namespace {

// counts[layer][expert] of a profile file (--profile-out's, or a model's routing_profile.json).
bool read_profile(const std::string& path, std::vector<std::vector<double>>& counts, std::string& why) {
  const std::optional<std::string> text = try_read_file(path);
  if (!text) {
    why = "cannot read the file";
    return false;
  }
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("counts") || !j["counts"].is_array()) {
    why = "not a profile (a JSON object with counts[layer][expert])";
    return false;
  }
  counts.clear();
  for (const auto& layer : j["counts"]) {
    if (!layer.is_array()) {
      why = "counts must be an array per layer";
      return false;
    }
    std::vector<double>& row = counts.emplace_back();
    for (const auto& c : layer) {
      if (!c.is_number() || c.get<double>() < 0) {
        why = "counts must be numbers >= 0";
        return false;
      }
      row.push_back(c.get<double>());
    }
  }
  return true;
}

}  // namespace

void ModelFlags::add_to(CLI::App& cmd, bool required) {
  auto* m = cmd.add_option("-m,--model", dir,
                           "Model: a pack, a Hugging Face directory (packed into the cache on first use), or a repo id "
                           "(org/name) in the Hugging Face cache");
  m->transform(CLI::Validator(
      [](std::string& value) {
        value = resolve_model_arg(value);
        return std::string();
      },
      "DIR|ORG/NAME"));
  if (required) m->required();
  cmd.add_option("-t,--threads", options.threads, "CPU threads (default: all hardware threads)")
      ->check(kNonNegative);
  cmd.add_option("-c,--ctx-size,--ctx", ctx, "Context length in tokens (default: the command's; see its help)")
      ->check(kNonNegative);
  cmd.add_flag("--precise", options.precise, "Keep activations in float32 everywhere (exact)");
  cmd.add_flag("--int8-activations", options.int8_activations,
               "With quantized weights, quantize activations to int8 for integer dot products "
               "(faster decode, about 1% less exact; --precise overrides it)");
  ExpertStoreOptions& e = options.experts;
  cmd.add_option("--expert-cache-mb", e.cache_mb, "Memory for expert weights in MB (default: every expert, or 80% of the memory available at start "
                 "when they take more)")
      ->check(kNonNegative);
  cmd.add_option("--cache-policy", e.policy, "Expert cache eviction: lru | lfu | lcp (default lcp)")
      ->check(CLI::IsMember({"lru", "lfu", "lcp"}));
  cmd.add_option("--io", e.io, "Expert reads: pread | uring (default pread)")
      ->check(CLI::IsMember({"pread", "uring"}));
  cmd.add_flag("--direct-io", e.direct_io, "Read experts with O_DIRECT (bypass the page cache)");
  cmd.add_option("--io-threads", e.io_threads, "Expert reads in flight (default 4)")->check(kPositive);
  cmd.add_option("--moe-top-k", options.moe_top_k,
                 "Lossy: route each token to at most K experts, their weights renormalized (default: the model's)")
      ->check(kPositive);
  cmd.add_flag("--miss-fallback", e.miss_fallback,
               "Lossy, CPU decode with --expert-cache-mb: a token whose chosen experts are not all in memory "
               "computes with those that are (weights renormalized) and the rest are read in the background");
  cmd.add_option("--cache-bias", e.cache_bias,
                 "Lossy, CPU decode with --expert-cache-mb: add B to the router logit of experts in memory "
                 "before picking the top k (weights from the true logits; default 0: off)")
      ->check(kNonNegative);
  cmd.add_flag(
      "--lookahead,!--no-lookahead", e.lookahead,
      "Decode with a bounded expert cache (CPU; CUDA with --host-expert-mb): read the next layer's "
      "guessed experts ahead (default off: docs/PERFORMANCE.md)");
  cmd.add_option("--lookahead-k", e.lookahead_k,
                 "With --lookahead: read ahead only the N most likely of a layer's guessed experts that are "
                 "not in memory (default 0: every one; a guess is the layer's top k)")
      ->check(kNonNegative);
  cmd.add_option("--lookahead-depth", e.lookahead_depth,
                 "With --lookahead: guess the next D MoE layers' experts from each layer's input, so that "
                 "reads of several layers are in flight at once (default 1)")
      ->check(CLI::Range(1, 8));
  cmd.add_option(
         "--lookahead-pieces", e.lookahead_pieces,
         "With --lookahead: read ahead N pieces at a time, only while no read the model waits for "
         "is in flight (default 2; 0: every piece of every guess at once)")
      ->check(kNonNegative);
  cmd.add_option("--profile", profile_in,
                 "Expert usage profile (JSON with counts[layer][expert], e.g. from --profile-out): with "
                 "--expert-cache-mb, its hottest experts are never evicted; on CUDA when VRAM cannot hold every "
                 "expert, its hottest are loaded into VRAM first and kept there (--pin-share of the slots)")
      ->check(CLI::Validator(
          [&e](std::string& path) {
            std::string why;
            if (!read_profile(path, e.profile, why)) return path + ": " + why;
            return std::string();
          },
          "FILE"));
  cmd.add_option("--pin-share", e.pin_share, "Share of the expert cache (on CUDA: of the VRAM expert slots) the profile may pin (default 0.5)")
      ->check(CLI::Range(0.0, 1.0));
  cmd.add_flag("--warmup", e.warmup,
               "Read the profile's pinned experts before the first token (CPU with a cache that holds every "
               "expert: all of them, if they fit in 80% of the available memory; bench: also one untimed prefill and one "
               "untimed decode repetition first, so that pp and tg measure warm expert tiers and graphs; GPU: everything "
               "loaded and pinned)");
  cmd.add_option("--profile-out", profile_out,
                 "Write how often each expert was used to FILE at the end (JSON counts[layer][expert]; run, "
                 "perplexity, logits)");
  options.device = "auto";
  cmd.add_option("--device", options.device, "Where to compute: auto (the GPU when there is one) | cuda | cpu")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}));
  cmd.add_option("--gpu-expert-mb", options.gpu_expert_mb,
                 "CUDA: VRAM for expert weights in MB (default: free VRAM minus a reserve)")
      ->check(kNonNegative);
  cmd.add_option(
         "--cpu-experts", options.cpu_expert_share,
         "CUDA, experts in pinned RAM beyond --gpu-expert-mb: compute this share (0-1) of a decode "
         "step's missed expert bytes on the CPU (--threads) while the GPU reads the rest over PCIe "
         "(default 0: none; not bit-identical to the GPU's own sums)")
      ->check(CLI::Range(0.0, 1.0));
  cmd.add_option("--host-expert-mb", e.cache_mb,
                 "CUDA: pinned RAM for experts between disk and VRAM, in MB (the same budget as --expert-cache-mb)")
      ->check(kNonNegative);
  cmd.add_option_function<std::string>(
         "--kv-type",
         [this](const std::string& name) {
           if (!parse_kv_type(name, options.kv.type))
             throw CLI::ValidationError("--kv-type", "'" + name + "' is not a KV cache type (f32, bf16, f16, fp8, q8)");
         },
         "How the KV cache stores keys and values: f32 (default, exact) | bf16 | f16 | fp8 | q8 (docs/PERFORMANCE.md "
         "has their quality)")
      ->type_name("TYPE");
  auto* window = cmd.add_option("--kv-window", options.kv.window,
                                "Lossy: attention keeps only the latest N positions (plus --kv-sinks), in a cache "
                                "of that many rows whatever the length (default: every position)")
                     ->check(kPositive);
  cmd.add_option("--kv-sinks", options.kv.sinks, "With --kv-window: also keep the first S positions (default 0)")
      ->check(kNonNegative)
      ->needs(window);
  cmd.add_flag("--stats", stats, "Print one JSON line of statistics on stderr at the end");
  cmd.add_flag("--timing", timing, "Print time per phase on stderr at the end");
}

namespace {
std::atomic<int> g_interrupts{0};
std::atomic<bool> g_exit_on_second{false};

void on_interrupt(int) {
  if (g_interrupts.fetch_add(1) + 1 >= 2 && g_exit_on_second) {
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
  }
}
}  // namespace

void catch_interrupts(bool exit_on_second) {
  g_exit_on_second = exit_on_second;
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a read waiting for the user returns with EINTR
  sigaction(SIGINT, &sa, nullptr);
}

int interrupts() { return g_interrupts.load(); }
void reset_interrupts() { g_interrupts = 0; }

uint64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

void check_profile_out(const ModelFlags& flags, Model& model) {
  // The CUDA tier routes on the device: the expert store sees only its misses, not every use.
  if (!flags.profile_out.empty() && model.backend().name().rfind("cpu", 0) != 0)
    fail("--profile-out: expert use is counted on the CPU backend only; run with --device cpu");
}

void report(const ModelFlags& flags, Model& model, const RunCounters& c) {
  const ExpertStats s = model.expert_stats();
  if (!flags.profile_out.empty()) {  // check_profile_out ran right after the model loaded
    const nlohmann::json j = {{"note", "counts[layer][expert]: how often each expert was requested (moestream --profile-out)"},
                              {"tokens", c.prompt_tokens + c.generated_tokens},
                              {"counts", model.expert_usage()}};
    const std::string tmp = flags.profile_out + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out << j.dump() << "\n";
      if (!out.flush()) fail(flags.profile_out, ": cannot write the profile");
    }
    std::error_code ec;
    std::filesystem::rename(tmp, flags.profile_out, ec);
    if (ec) fail(flags.profile_out, ": cannot write the profile: ", ec.message());
  }
  if (flags.stats) {
    nlohmann::json j = {
        {"tokens", c.generated_tokens},
        {"prompt_tokens", c.prompt_tokens},
        {"tok_per_s", c.decode_seconds > 0 && c.generated_tokens > 1 ? (c.generated_tokens - 1) / c.decode_seconds : 0.0},
        {"prefill_tok_per_s", c.prefill_seconds > 0 ? c.prompt_tokens / c.prefill_seconds : 0.0},
        {"expert_hits", s.hits},
        {"expert_misses", s.misses},
        {"hit_rate", s.hit_rate()},
        {"bytes_read", s.bytes_read},
        {"lookahead_guessed", s.predicted},
        {"lookahead_guessed_right", s.predicted_right},
        {"lookahead_reguessed", s.reguessed},
        {"lookahead_reads", s.prefetch_reads},
        {"lookahead_reads_used", s.prefetch_hits},
        {"lookahead_reads_wasted", s.prefetch_wasted},
        {"fallbacks", s.fallbacks},
        {"fallback_experts_skipped", s.fallback_skipped},
        {"fallback_reads", s.fallback_reads},
        {"read_gb_per_s", s.read_gb_per_s()},
        {"io_wait_s", s.wait_seconds},
        {"peak_rss_bytes", peak_rss_bytes()},
        {"expert_cache_bytes", s.cache_bytes},
        {"expert_budget_bytes", s.budget_bytes},
        {"weight_bytes", model.info().weight_bytes}};
    j["device"] = model.backend().name();
    // KV bytes per position of context: what one more position adds to a fresh sequence (with a
    // window, until the ring is full; after that nothing).
    const KvCacheSpec& kv = flags.options.kv;
    j["kv_type"] = kv_type_name(kv.type);
    j["kv_bytes_per_token"] = model.new_sequence(2)->bytes() - model.new_sequence(1)->bytes();
    if (kv.window > 0) j["kv_ring_positions"] = kv.sinks + kv.window;
    if (const auto g = gpu_tier_stats(model.backend())) {
      const uint64_t n = g->hits + g->misses;
      j["vram_expert_hits"] = g->hits;
      j["vram_expert_misses"] = g->misses;
      j["vram_hit_rate"] = n ? double(g->hits) / double(n) : 0.0;
      j["vram_resident_layer_calls"] = g->resident_calls;
      j["vram_prefetched"] = g->prefetched;
      j["vram_expert_slots"] = g->slots;
      j["vram_expert_bytes"] = g->slots * g->slot_bytes;
      j["host_tier_hit_rate"] = s.hit_rate();
      j["pinned_host_bytes"] = g->pinned_bytes;
      j["pcie_bytes"] = g->bytes_h2d + g->bytes_promoted;
      j["pcie_gb_per_s"] = g->h2d_seconds > 0 ? double(g->bytes_h2d) / g->h2d_seconds / 1e9 : 0.0;
      j["vram_in_place_layer_calls"] = g->in_place_calls;
      j["pcie_bytes_read_in_place"] = g->bytes_in_place;
      if (g->cpu_experts) {
        j["cpu_experts"] = g->cpu_experts;
        j["cpu_expert_bytes"] = g->bytes_cpu;
      }
      j["vram_promotions"] = g->promotions;
      j["vram_pinned_experts"] = g->pinned;
      j["pcie_bytes_promoted"] = g->bytes_promoted;
    }
    std::fprintf(stderr, "%s\n", j.dump().c_str());
  }
  if (flags.timing) {
    const PhaseTimes& t = model.backend().times();
    const double compute = std::max(0.0, t.expert_compute - s.wait_seconds);
    const double total = t.embed + t.attention + t.routing + t.expert_compute + t.dense_mlp +
                         t.output_head + t.sampling;
    auto row = [&](const char* name, double v) {
      std::fprintf(stderr, "  %-22s %9.3f s  %5.1f%%\n", name, v, total > 0 ? 100 * v / total : 0);
    };
    std::fprintf(stderr, "time per phase:\n");
    row("attention", t.attention);
    row("routing", t.routing);
    row("expert compute", compute);
    row("waiting on expert I/O", s.wait_seconds);
    row("dense MLP", t.dense_mlp);
    row("embedding", t.embed);
    row("output head", t.output_head);
    row("sampling", t.sampling);
    row("total", total);
  }
}

}  // namespace moestream::cli
