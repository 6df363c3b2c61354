// moestream bench: prefill and decode speed (pp / tg, as llama-bench), the expert hit rate, and
// the storage read rate achieved next to the raw read rate of the same files, measured in the
// same run with the same I/O method. The ratio of the two is the figure we optimize.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <thread>
#include <cmath>
#include <cstring>

#include "backend/backend_factory.h"
#include "cli/cli.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/async_reader.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/generate.h"

namespace moestream::cli {

namespace {

// Time per phase between two readings of the backend's counters (GPU time only with
// MOESTREAM_CUDA_SYNC=1, which waits for the GPU after every operation).
nlohmann::json phase_seconds(const PhaseTimes& p0, const PhaseTimes& p1) {
  return {{"embed", p1.embed - p0.embed}, {"attention", p1.attention - p0.attention},
          {"routing", p1.routing - p0.routing}, {"expert_compute", p1.expert_compute - p0.expert_compute},
          {"dense_mlp", p1.dense_mlp - p0.dense_mlp}, {"output_head", p1.output_head - p0.output_head}};
}

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// Reads a random sample of experts (up to `budget` bytes) with the store's I/O settings.
double raw_read_gb_per_s(const PackManifest& pack, const ExpertStoreOptions& o, uint64_t budget,
                         uint64_t& bytes_out) {
  std::vector<const PackedExpert*> all;
  for (const auto& layer : pack.layers)
    for (const auto& e : layer) all.push_back(&e);
  if (all.empty()) return 0;
  std::mt19937_64 rng(7);
  std::shuffle(all.begin(), all.end(), rng);
  const size_t slots = size_t(std::max(1, o.io_threads)) * 2;
  const uint64_t slot_bytes = pack.max_expert_size();
  std::vector<char*> buffers;
  for (size_t i = 0; i < slots; ++i)
    buffers.push_back(static_cast<char*>(std::aligned_alloc(kPackAlignment, slot_bytes)));
  std::mutex mu;
  std::condition_variable cv;
  std::vector<size_t> free_slots(slots);
  std::iota(free_slots.begin(), free_slots.end(), 0);
  size_t in_flight = 0;
  int64_t failed = 0;
  std::vector<std::string> paths;
  for (const auto& f : pack.expert_files) paths.push_back(pack.dir + "/" + f);
  ReaderOptions ro{parse_io_method(o.io), o.direct_io, o.io_threads};
  uint64_t bytes = 0;
  auto t0 = clock_type::now();
  {
    auto reader = make_async_reader(paths, ro, [&](const ReadDone& d) {
      std::lock_guard lock(mu);
      if (d.bytes < 0) failed = d.bytes;
      free_slots.push_back(size_t(d.tag));
      --in_flight;
      cv.notify_all();
    });
    for (const PackedExpert* e : all) {
      if (bytes >= budget) break;
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return !free_slots.empty(); });
      const size_t s = free_slots.back();
      free_slots.pop_back();
      ++in_flight;
      lock.unlock();
      reader->submit(e->file, e->offset, e->size, buffers[s], s);
      bytes += e->size;
    }
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return in_flight == 0; });
  }
  const double secs = seconds_since(t0);
  for (char* b : buffers) std::free(b);
  if (failed < 0) fail("bench: raw read failed: ", std::strerror(int(-failed)));
  bytes_out = bytes;
  return bytes / secs / 1e9;
}

// Memory read bandwidth: threads summing disjoint parts of a buffer far larger than the caches,
// best of three passes.
double memory_read_gb_per_s(int threads) {
  const size_t n = (512u << 20) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n, 1);  // integer sums vectorize (float sums would be serialized)
  ThreadPool pool(threads);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<double> partial(size_t(pool.size()) * 16, 0.0);
    auto t0 = clock_type::now();
    pool.parallel_for(size_t(pool.size()), [&](size_t b, size_t e) {
      for (size_t part = b; part < e; ++part) {
        const size_t lo = n / size_t(pool.size()) * part, hi = part + 1 == size_t(pool.size()) ? n : lo + n / size_t(pool.size());
        uint64_t sum = 0;
        for (size_t i = lo; i < hi; ++i) sum += buf[i];
        partial[part * 16] = double(sum);
      }
    });
    const double secs = seconds_since(t0);
    double check = 0;
    for (double v : partial) check += v;
    if (check <= 0) fail("bench: memory bandwidth probe computed nothing");
    best = std::max(best, double(n * sizeof(uint64_t)) / secs / 1e9);
  }
  return best;
}

struct Spread {
  double mean = 0, sd = 0;
};
Spread spread(const std::vector<double>& v) {
  Spread s;
  if (v.empty()) return s;
  for (double x : v) s.mean += x;
  s.mean /= double(v.size());
  if (v.size() > 1) {
    for (double x : v) s.sd += (x - s.mean) * (x - s.mean);
    s.sd = std::sqrt(s.sd / double(v.size() - 1));
  }
  return s;
}

// Parameters of a pack, as llama-bench counts them: experts from their logical shapes, the other
// tensors by element count (affine-quantized ones from their scales: rows x groups x group size;
// their scales and biases are not parameters).
int64_t count_params(const PackManifest& pack) {
  int64_t n = 0;
  for (const auto& layer : pack.layers)
    for (const auto& e : layer)
      for (const char* role : {"gate", "up", "down"})
        if (e.find(role)) {
          const auto shape = e.logical_shape(role);
          n += shape[0] * shape[1];
        }
  auto weights = SafetensorsFile::open(pack.dir + "/" + pack.weights_file);
  const auto& tensors = weights->tensors();
  int group = 64;
  std::ifstream config_file(pack.dir + "/config.json");
  if (const auto config = nlohmann::json::parse(config_file, nullptr, false);
      config.is_object() && config.contains("quantization") && config["quantization"].is_object())
    group = config["quantization"].value("group_size", 64);
  auto ends_with = [](const std::string& s, const std::string& t) {
    return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
  };
  for (const auto& [name, t] : tensors) {
    if (ends_with(name, ".scales") || ends_with(name, ".biases")) continue;
    const std::string stem = ends_with(name, ".weight") ? name.substr(0, name.size() - 7) : name;
    const auto scales = tensors.find(stem + ".scales");
    if (t.dtype == DType::U32 && scales != tensors.end() && scales->second.shape.size() == 2) {
      n += scales->second.shape[0] * scales->second.shape[1] * group;
      continue;
    }
    int64_t elems = 1;
    for (int64_t d : t.shape) elems *= d;
    n += elems;
  }
  return n;
}

std::string params_text(int64_t n) {
  char buf[32];
  if (n >= 1000000000) std::snprintf(buf, sizeof buf, "%.2f B", n / 1e9);
  else std::snprintf(buf, sizeof buf, "%.2f M", n / 1e6);
  return buf;
}

}  // namespace

void add_bench(CLI::App& app) {
  struct Flags {
    ModelFlags model;
    int n_prompt = 512, n_gen = 128;
    double raw_mb = 1024;
    int repetitions = 1;
    int batch = 1;
    bool json = false;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand("bench", "Measure prefill/decode speed and expert streaming against the disk");
  f->model.add_to(*cmd);
  cmd->add_option("-p,--n-prompt", f->n_prompt, "Prompt tokens for the prefill test (default 512; 0 skips it)")->check(kNonNegative);
  cmd->add_option("-n,--n-gen", f->n_gen, "Tokens for the decode test (default 128; 0 skips it)")->check(kNonNegative);
  cmd->add_option("--raw-read-mb", f->raw_mb, "Bytes of experts read for the raw read rate (default 1024)")->check(kNonNegative);
  cmd->add_option("-r,--repetitions", f->repetitions, "Runs of each test; t/s is their mean +- standard deviation (default 1)")
      ->check(kPositive);
  cmd->add_option("-b,--batch", f->batch,
                  "Sequences decoded together in the decode test, one batched forward step for all of them; "
                  "t/s is their aggregate (default 1)")
      ->check(CLI::Range(1, 128));
  cmd->add_flag("--json", f->json, "Print the results as one JSON object");
  cmd->callback([f] {
    ModelOptions opt = f->model.options;
    const std::string pack_dir = ensure_pack(f->model.dir, opt.cache_dir);
    const PackManifest pack = PackManifest::load(pack_dir);

    uint64_t raw_bytes = 0;
    const double raw = raw_read_gb_per_s(pack, opt.experts, uint64_t(f->raw_mb * 1e6), raw_bytes);

    const double mem_bw = memory_read_gb_per_s(opt.threads);
    auto model = load_model(pack_dir, opt);
    const auto& info = model->info();
    std::mt19937 rng(1234);
    std::uniform_int_distribution<int32_t> token(0, int32_t(info.vocab_size - 1));
    std::vector<float> logits(size_t(info.vocab_size));
    // The cache's budget as the model set it (a default one is capped by the memory available).
    const uint64_t budget = model->expert_stats().budget_bytes;
    const double cache_mb = budget > 0 ? double(budget) / 1e6 : -1.0;
    nlohmann::json out = {{"model", pack_dir}, {"model_type", info.model_type},
                          {"weight_bytes", info.weight_bytes},
                          {"expert_bytes", pack.total_expert_bytes()},
                          {"backend", model->backend().name()},
                          {"expert_cache_mb", cache_mb},
                          {"io", opt.experts.io}, {"direct_io", opt.experts.direct_io},
                          {"raw_read_gb_per_s", raw}, {"raw_read_bytes", raw_bytes},
                          {"memory_read_gb_per_s", mem_bw},
                          {"active_bytes_per_token", info.active_bytes_per_token}};
    // On a GPU: the limits the results are measured against (HBM copy, pinned PCIe).
    const std::optional<GpuLimits> gpu = measure_gpu_limits(model->backend());
    if (gpu)
      out["gpu"] = {{"d2d_gb_per_s", gpu->d2d_gb_per_s}, {"h2d_pinned_gb_per_s", gpu->h2d_pinned_gb_per_s},
                    {"h2d_slot_gb_per_s", gpu->h2d_slot_gb_per_s},
                    {"gemv_bf16_gb_per_s", gpu->gemv_bf16_gb_per_s},
                    {"gemv_bf16_head_gb_per_s", gpu->gemv_bf16_head_gb_per_s},
                    {"gemv_q4_expert_gb_per_s", gpu->gemv_q4_gb_per_s},
                    {"launch_us", gpu->launch_us}, {"launch_drain_us", gpu->launch_drain_us},
                    {"round_trip_us", gpu->round_trip_us}};

    if (f->n_prompt > 0) {
      std::vector<int32_t> prompt(size_t(f->n_prompt));
      for (auto& t : prompt) t = token(rng);
      if (opt.experts.warmup) {  // --warmup (ModelFlags): also an untimed prefill before pp
        auto t0 = clock_type::now();
        auto warm = model->new_sequence(f->n_prompt);
        model->forward(prompt, *warm, logits);
        out["warmup_s"] = seconds_since(t0);
      }
      std::vector<double> rates;
      const ExpertStats before = model->expert_stats();
      const PhaseTimes phases_before = model->backend().times();
      for (int rep = 0; rep < f->repetitions; ++rep) {
        auto seq = model->new_sequence(f->n_prompt);
        auto t0 = clock_type::now();
        model->forward(prompt, *seq, logits);
        rates.push_back(f->n_prompt / seconds_since(t0));
      }
      const ExpertStats after = model->expert_stats();
      const Spread pp = spread(rates);
      out["pp"] = {{"tokens", f->n_prompt}, {"tok_per_s", pp.mean}, {"tok_per_s_sd", pp.sd},
                   {"samples", rates}, {"bytes_read", (after.bytes_read - before.bytes_read) / f->repetitions}};
      out["pp"]["phase_s"] = phase_seconds(phases_before, model->backend().times());
    }
    if (f->n_gen > 0) {
      // Each repetition decodes n_gen tokens in each of `batch` sequences after a one-token prompt
      // of their own, all sequences in one forward_batch call per step; the counters below cover
      // all of them, the rate (tokens of all sequences per second) is their mean.
      const int n_seq = f->batch;
      // With --warmup, one untimed repetition first, as llama-bench runs one: the decode steps'
      // first calls (CUDA graphs captured and instantiated, the host tier's layers read, caches
      // filled) would otherwise land in the first timed repetition.
      const int warm = opt.experts.warmup ? 1 : 0;
      std::vector<double> rates;
      ExpertStats before = model->expert_stats();
      std::optional<GpuTierStats> tier_before = gpu_tier_stats(model->backend());
      PhaseTimes phases_before = model->backend().times();
      double secs = 0;
      for (int rep = -warm; rep < f->repetitions; ++rep) {
        if (rep == 0 && warm) {  // the counters start after the untimed repetition
          before = model->expert_stats();
          tier_before = gpu_tier_stats(model->backend());
          phases_before = model->backend().times();
        }
        // Greedy decoding as `run --temp 0` and serve's greedy requests do it: each step's token
        // chosen where the logits are (SequenceBatch::greedy), the same step feeding it back.
        std::vector<std::unique_ptr<SequenceState>> seqs;
        std::vector<int32_t> next(static_cast<size_t>(n_seq));
        std::vector<SequenceBatch> items;
        for (int j = 0; j < n_seq; ++j) {
          seqs.push_back(model->new_sequence(f->n_gen + 1));
          next[size_t(j)] = token(rng);
        }
        for (int j = 0; j < n_seq; ++j)
          items.push_back({std::span(&next[size_t(j)], 1), seqs[size_t(j)].get(), {}, &next[size_t(j)]});
        model->forward_batch(items);
        auto t0 = clock_type::now();
        for (int i = 0; i < f->n_gen; ++i) model->forward_batch(items);
        const double rep_secs = seconds_since(t0);
        if (rep < 0) continue;
        secs += rep_secs;
        rates.push_back(double(f->n_gen) * n_seq / rep_secs);
      }
      const int64_t generated = int64_t(f->n_gen) * f->repetitions * n_seq;
      const Spread tg = spread(rates);
      const ExpertStats after = model->expert_stats();
      const uint64_t hits = after.hits - before.hits, misses = after.misses - before.misses;
      const uint64_t bytes = after.bytes_read - before.bytes_read;
      // Bytes the decode needed: reads ahead evicted unused were the engine's loss, not the
      // model's need, so the disk bound does not count them.
      const uint64_t wasted = after.bytes_wasted - before.bytes_wasted;
      const uint64_t needed = bytes - std::min(bytes, wasted);
      const double busy = after.io_busy_seconds - before.io_busy_seconds;
      const double read = busy > 0 ? bytes / busy / 1e9 : 0;
      // The disk's rate drifts within minutes, so a decode that read from it is measured against
      // the mean of the raw rate before and after it.
      uint64_t raw_after_bytes = 0;
      const double raw_after =
          bytes > 0 && raw > 0
              ? raw_read_gb_per_s(pack, opt.experts, uint64_t(f->raw_mb * 1e6), raw_after_bytes)
              : 0.0;
      const double raw_tg = raw_after > 0 ? (raw + raw_after) / 2 : raw;
      out["tg"] = {
          {"tokens", f->n_gen},
          {"sequences", n_seq},
          {"tok_per_s", tg.mean},
          {"tok_per_s_sd", tg.sd},
          {"samples", rates},
          {"hit_rate", hits + misses ? double(hits) / double(hits + misses) : 0.0},
          {"bytes_read", bytes},
          {"bytes_read_per_token", bytes / uint64_t(generated)},
          {"bytes_wasted", wasted},
          {"bytes_needed_per_token", needed / uint64_t(generated)},
          {"read_gb_per_s", read},
          {"io_wait_s", after.wait_seconds - before.wait_seconds},
          {"raw_read_after_gb_per_s", raw_after},
          {"raw_read_mean_gb_per_s", raw_tg},
          {"read_ratio", raw_tg > 0 ? read / raw_tg : 0.0},
          // Weights touched per token (non-expert + top-k experts) at this speed,
          // against the memory read bandwidth measured above.
          {"weight_gb_per_s", info.active_bytes_per_token * (generated / secs) / 1e9},
          {"weight_bw_ratio", info.active_bytes_per_token * (generated / secs) / 1e9 / mem_bw},
          {"lookahead",
           {{"guessed", after.predicted - before.predicted},
            {"guessed_right", after.predicted_right - before.predicted_right},
            {"reguessed", after.reguessed - before.reguessed},
            {"reads", after.prefetch_reads - before.prefetch_reads},
            {"reads_used", after.prefetch_hits - before.prefetch_hits},
            {"reads_wasted", after.prefetch_wasted - before.prefetch_wasted}}},
          {"fallback",
           {{"steps", after.fallbacks - before.fallbacks},
            {"experts_skipped", after.fallback_skipped - before.fallback_skipped},
            {"reads", after.fallback_reads - before.fallback_reads}}}};
      out["tg"]["phase_s"] = phase_seconds(phases_before, model->backend().times());
      if (gpu && tier_before) {
        // The three bounds of a GPU run: HBM (weights read per token over the device copy rate),
        // PCIe (expert bytes copied up per token over pinned host-to-device), disk (bytes needed
        // per token over the raw read rate, before and after the decode).
        const GpuTierStats t1 = *gpu_tier_stats(model->backend()), &t0s = *tier_before;
        const double tps = generated / secs;
        // Copies and reads in place both cross PCIe.
        const double pcie_per_token =
            double(t1.bytes_h2d - t0s.bytes_h2d + t1.bytes_promoted - t0s.bytes_promoted + t1.bytes_in_place -
                   t0s.bytes_in_place) /
            double(generated);
        const double disk_per_token = double(needed) / double(generated);
        const double hbm_bound = gpu->d2d_gb_per_s * 1e9 / double(info.active_bytes_per_token);
        const double pcie_bound = pcie_per_token > 0 ? gpu->h2d_pinned_gb_per_s * 1e9 / pcie_per_token : 0;
        const double disk_bound =
            disk_per_token > 0 && raw_tg > 0 ? raw_tg * 1e9 / disk_per_token : 0;
        const uint64_t vh = t1.hits - t0s.hits, vm = t1.misses - t0s.misses;
        out["tg"]["gpu"] = {
            {"hbm_bound_tok_per_s", hbm_bound},
            {"of_hbm_bound", tps / hbm_bound},
            {"pcie_bytes_per_token", pcie_per_token},
            {"pcie_bound_tok_per_s", pcie_bound},
            {"of_pcie_bound", pcie_bound > 0 ? tps / pcie_bound : 0.0},
            {"disk_bound_tok_per_s", disk_bound},
            {"of_disk_bound", disk_bound > 0 ? tps / disk_bound : 0.0},
            {"vram_hit_rate", vh + vm ? double(vh) / double(vh + vm) : 1.0},
            {"resident_layer_calls", t1.resident_calls - t0s.resident_calls},
            {"in_place_layer_calls", t1.in_place_calls - t0s.in_place_calls},
            {"in_place_bytes_per_token",
             double(t1.bytes_in_place - t0s.bytes_in_place) / double(generated)},
            {"cpu_expert_bytes_per_token",
             double(t1.bytes_cpu - t0s.bytes_cpu) / double(generated)},
            {"cpu_experts", t1.cpu_experts - t0s.cpu_experts},
            {"cpu_expert_gb_per_s",
             t1.cpu_seconds > t0s.cpu_seconds
                 ? double(t1.bytes_cpu - t0s.bytes_cpu) / (t1.cpu_seconds - t0s.cpu_seconds) / 1e9
                 : 0.0},
            {"cpu_expert_s_per_token", (t1.cpu_seconds - t0s.cpu_seconds) / double(generated)},
            {"split_wait_s_per_token",
             (t1.split_wait_seconds - t0s.split_wait_seconds) / double(generated)},
            {"promotions", t1.promotions - t0s.promotions},
            {"pinned_experts", t1.pinned},
            {"pcie_gb_per_s_while_copying",
             t1.h2d_seconds > t0s.h2d_seconds
                 ? double(t1.bytes_h2d - t0s.bytes_h2d) / (t1.h2d_seconds - t0s.h2d_seconds) / 1e9
                 : 0.0},
            {"vram_expert_bytes", t1.slots * t1.slot_bytes}};
      }
    }
    out["peak_rss_bytes"] = peak_rss_bytes();
    out["expert_cache_bytes"] = model->expert_stats().cache_bytes;

    if (f->json) {
      std::printf("%s\n", out.dump().c_str());
      return;
    }
    std::printf("model: %s (%s, %.2f GB of weights, %.2f GB of experts)\n", pack_dir.c_str(),
                info.model_type.c_str(), info.weight_bytes / 1e9, pack.total_expert_bytes() / 1e9);
    std::printf("backend: %s; expert cache: %s; reads: %s%s, %d in flight\n",
                model->backend().name().c_str(),
                cache_mb < 0 ? "unbounded" : (std::to_string(int64_t(cache_mb)) + " MB").c_str(),
                opt.experts.io.c_str(), opt.experts.direct_io ? " O_DIRECT" : "", opt.experts.io_threads);
    std::printf("raw read of the expert files: %.2f GB/s (%.0f MB, random experts); memory read: %.1f GB/s\n\n",
                raw, raw_bytes / 1e6, mem_bw);
    // llama-bench's columns, then moestream's: the expert hit rate, the storage read rate, and
    // the fraction of the bound the test reached (decode: weights read per second over the
    // memory bandwidth measured above, or the HBM bound on a GPU).
    std::string quant;
    for (const auto& layer : pack.layers)
      for (const auto& e : layer)
        if (quant.find(e.format) == std::string::npos) quant += (quant.empty() ? "" : "+") + e.format;
    char model_name[160];
    std::snprintf(model_name, sizeof model_name, "%s %s", info.model_type.c_str(), quant.empty() ? "dense" : quant.c_str());
    const std::string params = params_text(count_params(pack));
    const int threads = opt.threads > 0 ? opt.threads : int(std::thread::hardware_concurrency());
    auto t_s = [](const nlohmann::json& t) {
      char buf[48];
      std::snprintf(buf, sizeof buf, "%.2f ± %.2f", t["tok_per_s"].get<double>(), t["tok_per_s_sd"].get<double>());
      return std::string(buf);
    };
    std::printf("| %-24s | %9s | %9s | %-7s | %7s | %6s | %18s | %8s | %9s | %8s |\n", "model", "size", "params",
                "backend", "threads", "test", "t/s", "hit rate", "read GB/s", "of bound");
    std::printf("| %.24s | %.9s | %.9s | %.7s | %.7s | %.6s | %.18s | %.8s | %.9s | %.8s |\n",
                "------------------------", "--------:", "--------:", "-------", "------:", "-----:",
                "-----------------:", "-------:", "--------:", "-------:");
    char size_text[32];
    if (info.weight_bytes >= (int64_t(1) << 30)) std::snprintf(size_text, sizeof size_text, "%.2f GiB", info.weight_bytes / 1073741824.0);
    else std::snprintf(size_text, sizeof size_text, "%.2f MiB", info.weight_bytes / 1048576.0);
    const std::string backend_name = model->backend().name().substr(0, model->backend().name().find('('));
    char test[32];
    if (out.contains("pp")) {
      std::snprintf(test, sizeof test, "pp%d", f->n_prompt);
      std::printf("| %-24s | %9s | %9s | %-7s | %7d | %6s | %18s | %8s | %9s | %8s |\n", model_name, size_text,
                  params.c_str(), backend_name.c_str(), threads, test, t_s(out["pp"]).c_str(), "", "", "");
    }
    if (out.contains("tg")) {
      const auto& tg = out["tg"];
      if (f->batch > 1) std::snprintf(test, sizeof test, "tg%dx%d", f->n_gen, f->batch);
      else std::snprintf(test, sizeof test, "tg%d", f->n_gen);
      char hit[16], read[16], bound[16];
      std::snprintf(hit, sizeof hit, "%.1f%%", 100 * tg["hit_rate"].get<double>());
      std::snprintf(read, sizeof read, "%.2f", tg["read_gb_per_s"].get<double>());
      const double of_bound = tg.contains("gpu") ? tg["gpu"]["of_hbm_bound"].get<double>() : tg["weight_bw_ratio"].get<double>();
      std::snprintf(bound, sizeof bound, "%.0f%%", 100 * of_bound);
      std::printf("| %-24s | %9s | %9s | %-7s | %7d | %6s | %18s | %8s | %9s | %8s |\n", model_name, size_text,
                  params.c_str(), backend_name.c_str(), threads, test, t_s(tg).c_str(), hit, read, bound);
      if (tg["bytes_read"].get<uint64_t>() > 0)
        std::printf(
            "\nexpert reads: %.2f MB/token at %.2f GB/s, %.0f%% of the raw read rate of the same "
            "files "
            "(before and after)\n",
            tg["bytes_read_per_token"].get<double>() / 1e6, tg["read_gb_per_s"].get<double>(),
            100 * tg["read_ratio"].get<double>());
      if (const auto& la = tg["lookahead"]; la["guessed"].get<uint64_t>() > 0)
        std::printf(
            "lookahead: %.1f%% of %llu guessed experts chosen; %llu read ahead, %llu of them used, "
            "%llu "
            "evicted unused (%.1f MB)\n",
            100.0 * la["guessed_right"].get<double>() / la["guessed"].get<double>(),
            (unsigned long long)la["guessed"].get<uint64_t>(),
            (unsigned long long)la["reads"].get<uint64_t>(),
            (unsigned long long)la["reads_used"].get<uint64_t>(),
            (unsigned long long)la["reads_wasted"].get<uint64_t>(),
            tg["bytes_wasted"].get<double>() / 1e6);
    }
    if (f->repetitions > 1) std::printf("(%d repetitions of each test; t/s is mean ± standard deviation)\n", f->repetitions);
    if (out.contains("tg"))
      std::printf("\ndecode touches %.1f MB of weights per token: %.2f GB/s, %.0f%% of the memory read bandwidth\n",
                  info.active_bytes_per_token / 1e6, out["tg"]["weight_gb_per_s"].get<double>(),
                  100 * out["tg"]["weight_bw_ratio"].get<double>());
    if (out.contains("tg") && out["tg"].contains("gpu")) {
      const auto& g = out["tg"]["gpu"];
      std::printf("GPU: device copy %.0f GB/s, pinned H2D %.1f GB/s (%.1f GB/s per expert-sized copy)\n",
                  out["gpu"]["d2d_gb_per_s"].get<double>(), out["gpu"]["h2d_pinned_gb_per_s"].get<double>(),
                  out["gpu"]["h2d_slot_gb_per_s"].get<double>());
      std::printf("tg: %.0f%% of the HBM bound (%.0f t/s); VRAM hit rate %.1f%%; PCIe %.1f MB/token (%.1f read in place), "
                  "%.0f%% of its bound (%.1f t/s); disk %.0f%% of its bound (%.1f t/s)\n",
                  100 * g["of_hbm_bound"].get<double>(), g["hbm_bound_tok_per_s"].get<double>(),
                  100 * g["vram_hit_rate"].get<double>(), g["pcie_bytes_per_token"].get<double>() / 1e6,
                  g["in_place_bytes_per_token"].get<double>() / 1e6,
                  100 * g["of_pcie_bound"].get<double>(), g["pcie_bound_tok_per_s"].get<double>(),
                  100 * g["of_disk_bound"].get<double>(), g["disk_bound_tok_per_s"].get<double>());
    }
    std::printf("peak RSS %.1f MB; expert cache %.1f MB\n", peak_rss_bytes() / 1e6,
                model->expert_stats().cache_bytes / 1e6);
  });
}

}  // namespace moestream::cli
