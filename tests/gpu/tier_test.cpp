// The CUDA expert tier after a failed expert read (issue 21): the request fails naming the expert,
// fails the same way when asked again (never "request before the previous one was consumed"), and
// once the bytes are right again the same loaded model computes the logits of a fresh one, for
// tiered budgets (one VRAM slot, a few) and everything resident.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <span>
#include <utility>

#include "backend/backend_factory.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "io/pack.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

std::vector<float> run(Model& m, const std::vector<int32_t>& ids) {
  std::vector<float> logits(size_t(m.info().vocab_size));
  auto seq = m.new_sequence(int64_t(ids.size()) + 1);
  m.forward(ids, *seq, logits);
  return logits;
}

// The decode the in-place tests run: an 11-token prompt (its logits kept only with keep_prompt),
// 16 one-token steps, then 6 batched steps of three sequences, each logits row to keep().
void decode_cycle(Model& model, bool keep_prompt,
                  const std::function<void(const std::vector<float>&)>& keep) {
  const int64_t vocab = model.info().vocab_size;
  std::vector<float> logits(static_cast<size_t>(vocab));
  auto seq = model.new_sequence(64);
  const std::vector<int32_t> prompt = {5, 17, 33, 2, 90, 144, 7, 61, 230, 12, 48};
  model.forward(prompt, *seq, logits);
  if (keep_prompt) keep(logits);
  const int32_t cycle[] = {3, 40, 77, 120, 161, 202, 9, 250};
  for (int step = 0; step < 16; ++step) {
    model.forward(std::span(&cycle[step % 8], 1), *seq, logits);
    keep(logits);
  }
  constexpr int kSeqs = 3;  // batched steps: a few tokens a call
  std::vector<std::unique_ptr<SequenceState>> states;
  for (int i = 0; i < kSeqs; ++i) states.push_back(model.new_sequence(8));
  std::vector<int32_t> tokens(kSeqs);
  std::vector<std::vector<float>> rows(kSeqs, std::vector<float>(size_t(vocab)));
  for (int step = 0; step < 6; ++step) {
    std::vector<SequenceBatch> items;
    for (int i = 0; i < kSeqs; ++i) {
      tokens[size_t(i)] = cycle[(3 * step + i) % 8];
      items.push_back({std::span(&tokens[size_t(i)], 1), states[size_t(i)].get(), rows[size_t(i)]});
    }
    model.forward_batch(items);
    for (const auto& l : rows) keep(l);
  }
}

// CUDA, float32 activations, the pack cache in `cache`, and the two expert tiers' budgets.
ModelOptions cuda_options(const std::string& cache, double vram_mb, double host_mb) {
  ModelOptions o;
  o.device = "cuda";
  o.precise = true;
  o.cache_dir = cache;
  o.gpu_expert_mb = vram_mb;
  o.experts.cache_mb = host_mb;
  return o;
}

TEST(CudaTier, FailedExpertReadLeavesTheTierUsable) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::string src = test::fixture("models/qwen3moe_gqa_tied");
  const std::string cache = test::temp_dir("gpu-tier-cache");
  const std::string dir = test::temp_dir("gpu-tier-damaged") + "/pack";
  fs::copy(ensure_pack(src, cache), dir, fs::copy_options::recursive);
  const PackManifest m = PackManifest::load(dir);
  const PackedExpert& e = m.expert(1, 3);
  const std::string file = dir + "/" + m.expert_files[size_t(e.file)];
  auto flip = [&] {  // a second flip restores the byte
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(std::streamoff(e.offset + 100));
    char c = 0;
    f.read(&c, 1);
    f.seekp(std::streamoff(e.offset + 100));
    c = char(c ^ 0x55);
    f.write(&c, 1);
  };
  const auto ref = nlohmann::json::parse(test::read_file(src + "/ref.json"));
  const auto ids = ref["logit_tokens"].get<std::vector<int32_t>>();
  // (VRAM, host) budgets: the host round trip; everything in VRAM; a few slots and the rest read
  // in place from an unbounded host tier (whose preload of the layer meets the damaged expert).
  for (const auto& [vram_mb, host_mb] :
       {std::pair{0.0, 0.05}, std::pair{0.05, 0.05}, std::pair{-1.0, -1.0}, std::pair{0.05, -1.0}}) {
    SCOPED_TRACE("gpu expert MB " + std::to_string(vram_mb) + ", host " + std::to_string(host_mb));
    const ModelOptions o = cuda_options(cache, vram_mb, host_mb);
    auto fresh = load_model(dir, o);
    const std::vector<float> want = run(*fresh, ids);
    fresh.reset();
    auto model = load_model(dir, o);
    flip();
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        run(*model, ids);
        ADD_FAILURE() << "no error for the damaged expert";
      } catch (const Error& err) {
        EXPECT_NE(std::string(err.what()).find("checksum mismatch for layer 1 expert 3"), std::string::npos)
            << err.what();
      }
    }
    flip();
    EXPECT_EQ(run(*model, ids), want);
  }
}

// The VRAM slots' eviction policy (--cache-policy): four sequences decode a cycle of tokens
// together, touching more experts per step than the slots hold. Least recently used then evicts
// most experts before their next use; lcp (uses decayed by age, the default) keeps the frequent
// ones (at 25% of the experts in VRAM, 8 sequences of the 16-layer bench model: 27% of the
// selections hit against none; docs/PERFORMANCE.md).
// The logits are the same under both, bit for bit, and equal to everything resident.
TEST(CudaTier, FrequencyPolicyKeepsHitsWhereLruCycles) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::string src = test::fixture("models/qwen3moe_gqa_tied");  // 3 layers of 8 experts, top 2
  const std::string cache = test::temp_dir("gpu-tier-policy");
  const std::string dir = ensure_pack(src, cache);
  const double slot_mb = double((PackManifest::load(dir).max_expert_size() + 255) / 256 * 256) / 1e6;
  struct Result {
    std::vector<float> logits;
    GpuTierStats stats;
  };
  // The policy of the host path: reading in place (below) has its own test.
  setenv("MOESTREAM_CUDA_IN_PLACE", "0", 1);
  auto decode = [&](double vram_mb, const std::string& policy) {
    ModelOptions o = cuda_options(cache, vram_mb, -1);
    o.experts.policy = policy;
    auto model = load_model(dir, o);
    const int64_t vocab = model->info().vocab_size;
    constexpr int kSeqs = 4, kSteps = 24;
    const int32_t cycle[] = {3, 40, 77, 120, 161, 202, 9, 250};
    std::vector<std::unique_ptr<SequenceState>> states;
    for (int i = 0; i < kSeqs; ++i) states.push_back(model->new_sequence(kSteps));
    std::vector<int32_t> tokens(kSeqs);
    std::vector<std::vector<float>> logits(kSeqs, std::vector<float>(size_t(vocab)));
    Result r;
    for (int step = 0; step < kSteps; ++step) {
      std::vector<SequenceBatch> items;
      for (int i = 0; i < kSeqs; ++i) {
        tokens[size_t(i)] = cycle[(step + 2 * i) % 8];
        items.push_back({std::span(&tokens[size_t(i)], 1), states[size_t(i)].get(), logits[size_t(i)]});
      }
      model->forward_batch(items);
      for (const auto& l : logits) r.logits.insert(r.logits.end(), l.begin(), l.end());
    }
    r.stats = *gpu_tier_stats(model->backend());
    return r;
  };
  const Result all = decode(-1, "lcp");
  // A step of the three layers touches about 15 of the 24 experts, a layer's call about 5.
  uint64_t lru_hits = 0, lcp_hits = 0;
  std::string counts;
  for (uint64_t slots : {10, 12, 14}) {
    SCOPED_TRACE(std::to_string(slots) + " slots");
    const Result lru = decode(double(slots) * slot_mb, "lru"), lcp = decode(double(slots) * slot_mb, "lcp");
    EXPECT_EQ(lru.stats.slots, slots);
    EXPECT_EQ(lru.logits, all.logits);
    EXPECT_EQ(lcp.logits, all.logits);
    lru_hits += lru.stats.hits;
    lcp_hits += lcp.stats.hits;
    counts += std::to_string(slots) + " slots: lru " + std::to_string(lru.stats.hits) + "/" +
              std::to_string(lru.stats.hits + lru.stats.misses) + ", lcp " + std::to_string(lcp.stats.hits) + "/" +
              std::to_string(lcp.stats.hits + lcp.stats.misses) + "; ";
  }
  unsetenv("MOESTREAM_CUDA_IN_PLACE");
  EXPECT_GT(lcp_hits, lru_hits + lru_hits / 4) << counts;
  ::testing::Test::RecordProperty("vram_hits", counts);
}

// Decode over a host tier that keeps every expert (the default, unbounded): the experts not in
// VRAM are read in place from pinned memory, steps become CUDA graphs, and misses the policy
// ranks above a slot's expert are promoted into VRAM between steps. The logits of a prefill,
// single-token steps and batched steps equal everything resident, bit for bit, and equal the host
// round trip's (MOESTREAM_CUDA_IN_PLACE=0), which reads nothing in place. With q4 and q8 experts
// the batched steps' lane-decoded kernels copy the lines of experts read in place through shared
// memory (expert_few_mma.cu), which sums as the direct loads do: bit for bit with the staging off
// (MOESTREAM_CUDA_EXPERT_STAGING=0) too, also where a block's warps split a row's lines (hidden
// 1,024).
TEST(CudaTier, ReadInPlaceMatchesResident) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  // 3 layers of 8 bf16 experts, top 2 (hidden 64, expert width 32), as published and packed to q8
  // with groups of 32; 2 layers of q4 experts (gate/up groups of 64, down 32).
  const std::string cache = test::temp_dir("gpu-tier-in-place");
  const std::string q8 = test::temp_dir("gpu-tier-in-place-q8") + "/pack";
  const auto packed = test::run_cli("pack " + test::fixture("models/qwen3moe_gqa_tied") + " " + q8 +
                                    " --quant q8 --group-size 32");
  ASSERT_EQ(packed.exit_code, 0) << packed.err;
  // 2 layers of 8 q4 experts over hidden 1,024 (expert width 384): the batched steps' split kernels
  // with 4 warps a block for gate/up and 2 for down, reading their lines in place
  const std::string wide = test::temp_dir("gpu-tier-in-place-wide") + "/pack";
  const auto made = test::run_cli("synth -o " + wide +
                                  " --preset tiny --layers 2 --hidden 1024 --moe-intermediate 384 --experts 8"
                                  " --top-k 2 --heads 8 --kv-heads 2 --head-dim 128 --vocab 512 --quant q4");
  ASSERT_EQ(made.exit_code, 0) << made.err;
  for (const std::string& dir : {ensure_pack(test::fixture("models/qwen3moe_gqa_tied"), cache), q8,
                                 ensure_pack(test::fixture("models/qwen3moe_mlx_g32"), cache), wide}) {
    SCOPED_TRACE(dir);
    const double slot_mb = double((PackManifest::load(dir).max_expert_size() + 255) / 256 * 256) / 1e6;
    struct Result {
      std::vector<float> logits;
      GpuTierStats stats;
    };
    auto decode = [&](double vram_mb) {
      auto model = load_model(dir, cuda_options(cache, vram_mb, -1));
      Result r;
      decode_cycle(*model, true, [&](const std::vector<float>& l) {
        r.logits.insert(r.logits.end(), l.begin(), l.end());
      });
      r.stats = *gpu_tier_stats(model->backend());
      return r;
    };
    // decode() with one of the backend's switches set to 0.
    auto decode_without = [&](const char* env, double vram_mb) {
      setenv(env, "0", 1);
      Result r = decode(vram_mb);
      unsetenv(env);
      return r;
    };
    const Result all = decode(-1);
    EXPECT_EQ(all.stats.in_place_calls, 0u);
    for (double slots : {0.0, 3.0, 10.0}) {
      SCOPED_TRACE(std::to_string(slots) + " slots");
      const Result in_place = decode(slots * slot_mb);
      EXPECT_EQ(in_place.logits, all.logits);
      EXPECT_GT(in_place.stats.in_place_calls, 0u);
      EXPECT_GT(in_place.stats.bytes_in_place, 0u);
      EXPECT_GT(in_place.stats.misses, 0u);
      EXPECT_GT(in_place.stats.graph_steps, 0u);
      if (slots > 0) {
        EXPECT_GT(in_place.stats.promotions, 0u);
        EXPECT_GT(in_place.stats.hits, 0u);
      }
      // The routing log is written by the steps' routers, replayed as graphs or launched one
      // operation at a time: the same counts and promotions either way.
      const Result launched = decode_without("MOESTREAM_CUDA_GRAPHS", slots * slot_mb);
      EXPECT_EQ(launched.logits, all.logits);
      EXPECT_EQ(launched.stats.graph_steps, 0u);
      EXPECT_EQ(launched.stats.hits, in_place.stats.hits);
      EXPECT_EQ(launched.stats.misses, in_place.stats.misses);
      EXPECT_EQ(launched.stats.bytes_in_place, in_place.stats.bytes_in_place);
      EXPECT_EQ(launched.stats.promotions, in_place.stats.promotions);
      const Result host_path = decode_without("MOESTREAM_CUDA_IN_PLACE", slots * slot_mb);
      EXPECT_EQ(host_path.logits, all.logits);
      EXPECT_EQ(host_path.stats.in_place_calls, 0u);
      EXPECT_EQ(host_path.stats.graph_steps, 0u);
      const Result direct = decode_without("MOESTREAM_CUDA_EXPERT_STAGING", slots * slot_mb);
      EXPECT_EQ(direct.logits, all.logits);
    }
  }
}

// --cpu-experts: a decode over a partial VRAM tier whose calls read in place hand a share of each
// call's misses to the CPU, computed from their pinned host copies while the GPU runs the rest.
// The logits are those of everything resident within float32 rounding (the CPU sums in another
// order), with the same greedy token at every step, one token a step and batched steps of three;
// the steps go through the host (no graph), the CPU takes experts, and at a share of 1 every miss
// (nothing is read in place over PCIe). The split is for calls that miss many experts: with the
// default threshold (4 a call, more than these top-2 fixtures miss) the steps stay graphs and the
// CPU takes none.
TEST(CudaTier, CpuShareOfTheMissesMatchesResident) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::string cache = test::temp_dir("gpu-tier-cpu-share");
  const std::string q8 = test::temp_dir("gpu-tier-cpu-share-q8") + "/pack";
  const auto packed = test::run_cli("pack " + test::fixture("models/qwen3moe_gqa_tied") + " " + q8 +
                                    " --quant q8 --group-size 32");
  ASSERT_EQ(packed.exit_code, 0) << packed.err;
  for (const std::string& dir : {ensure_pack(test::fixture("models/qwen3moe_gqa_tied"), cache), q8,
                                 ensure_pack(test::fixture("models/qwen3moe_mlx_g32"), cache)}) {
    SCOPED_TRACE(dir);
    const double slot_mb =
        double((PackManifest::load(dir).max_expert_size() + 255) / 256 * 256) / 1e6;
    struct Result {
      std::vector<std::vector<float>> steps;  // each step's logits of each sequence
      GpuTierStats stats;
    };
    auto decode = [&](double vram_mb, double share) {
      ModelOptions o = cuda_options(cache, vram_mb, -1);
      o.threads = 2;
      o.cpu_expert_share = share;
      auto model = load_model(dir, o);
      Result r;
      decode_cycle(*model, false, [&](const std::vector<float>& l) { r.steps.push_back(l); });
      r.stats = *gpu_tier_stats(model->backend());
      return r;
    };
    const Result all = decode(-1, 0);
    const Result few = decode(3 * slot_mb, 0.5);
    EXPECT_EQ(few.steps, all.steps);
    EXPECT_EQ(few.stats.cpu_experts, 0u);
    EXPECT_GT(few.stats.graph_steps, 0u);
    EXPECT_GT(few.stats.bytes_in_place, 0u);
    setenv("MOESTREAM_CPU_EXPERT_MIN_MISSES", "0", 1);
    for (double share : {0.5, 1.0}) {
      SCOPED_TRACE("share " + std::to_string(share));
      const Result split = decode(3 * slot_mb, share);
      ASSERT_EQ(split.steps.size(), all.steps.size());
      for (size_t i = 0; i < all.steps.size(); ++i) {
        SCOPED_TRACE("step " + std::to_string(i));
        const std::vector<float>& want = all.steps[i];
        const std::vector<float>& got = split.steps[i];
        float most = 0, diff = 0;
        for (size_t v = 0; v < want.size(); ++v) {
          most = std::max(most, std::abs(want[v]));
          diff = std::max(diff, std::abs(got[v] - want[v]));
        }
        EXPECT_LE(diff, 1e-4f * most);
        EXPECT_EQ(std::max_element(got.begin(), got.end()) - got.begin(),
                  std::max_element(want.begin(), want.end()) - want.begin());
      }
      EXPECT_GT(split.stats.in_place_calls, 0u);
      EXPECT_GT(split.stats.cpu_experts, 0u);
      EXPECT_GT(split.stats.bytes_cpu, 0u);
      EXPECT_EQ(split.stats.graph_steps, 0u);
      if (share == 1.0)
        EXPECT_EQ(split.stats.bytes_in_place, 0u);
      else
        EXPECT_GT(split.stats.bytes_in_place, 0u);
    }
    unsetenv("MOESTREAM_CPU_EXPERT_MIN_MISSES");
  }
}

// A VRAM budget that holds every expert: each layer comes in whole before its first call routes,
// so even the first prompt runs every MoE call as a resident one (no call through the host round
// trip, no miss), and the prompt's logits are those of the same prompt run again once everything
// is in VRAM, bit for bit. Before, a model's first call came before the tier was sized, so the
// first layer was filled only on its next call, through the host round trip.
TEST(CudaTier, FittingBudgetRunsTheFirstPromptResident) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::string src = test::fixture("models/qwen3moe_gqa_tied");  // 3 layers of 8 experts, top 2
  const std::string cache = test::temp_dir("gpu-tier-fill");
  const std::string dir = ensure_pack(src, cache);
  const PackManifest pack = PackManifest::load(dir);
  uint64_t layers = 0, experts = 0;
  for (const auto& l : pack.layers) {
    layers += l.empty() ? 0 : 1;
    experts += l.size();
  }
  ASSERT_GT(layers, 0u);
  auto model = load_model(dir, cuda_options(cache, -1, -1));
  const std::vector<int32_t> prompt = {5, 17, 33, 2, 90, 144, 7, 61, 230, 12, 48};
  const std::vector<float> first = run(*model, prompt);
  const GpuTierStats s = *gpu_tier_stats(model->backend());
  EXPECT_EQ(s.resident_calls, layers);
  EXPECT_EQ(s.misses, 0u);
  EXPECT_EQ(s.prefetched, experts);
  EXPECT_GT(s.bytes_h2d, 0u);
  EXPECT_EQ(run(*model, prompt), first);
  const GpuTierStats again = *gpu_tier_stats(model->backend());
  EXPECT_EQ(again.resident_calls, 2 * layers);
  EXPECT_EQ(again.bytes_h2d, s.bytes_h2d);
}

// Lookahead from disk (--lookahead, a host tier that cannot hold every expert): each decode
// step's MoE call also runs the next MoE layer's router (with --lookahead-depth 2, the next two)
// and hands its top k not in VRAM to the store, which reads them behind the call's own misses. The logits equal everything resident,
// bit for bit; guesses are made, read ahead and used; and no guess names an expert in VRAM (a
// VRAM budget of every expert leaves nothing to guess).
TEST(CudaTier, LookaheadReadsTheNextLayerFromDiskExactly) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::string src =
      test::fixture("models/qwen3moe_gqa_tied");  // 3 layers of 8 experts, top 2
  const std::string cache = test::temp_dir("gpu-tier-lookahead");
  const std::string dir = ensure_pack(src, cache);
  const double slot_mb =
      double((PackManifest::load(dir).max_expert_size() + 255) / 256 * 256) / 1e6;
  struct Result {
    std::vector<float> logits;
    ExpertStats store;
  };
  // pieces 0: every guess read whole at once, so that the counts below do not depend on timing;
  // the default (reads ahead by pieces in the gaps) is checked for exactness.
  auto decode = [&](double vram_mb, double host_mb, bool lookahead, int depth = 1, int pieces = 0) {
    ModelOptions o = cuda_options(cache, vram_mb, host_mb);
    o.experts.lookahead = lookahead;
    o.experts.lookahead_depth = depth;
    o.experts.lookahead_pieces = pieces;
    o.experts.read_piece_bytes = pieces > 0 ? 4096 : o.experts.read_piece_bytes;
    auto model = load_model(dir, o);
    Result r;
    std::vector<float> logits(size_t(model->info().vocab_size));
    auto seq = model->new_sequence(40);
    const std::vector<int32_t> prompt = {5, 17, 33, 2, 90};
    model->forward(prompt, *seq, logits);
    r.logits = logits;
    const int32_t cycle[] = {3, 40, 77, 120, 161, 202, 9, 250};
    for (int step = 0; step < 24; ++step) {
      model->forward(std::span(&cycle[step % 8], 1), *seq, logits);
      r.logits.insert(r.logits.end(), logits.begin(), logits.end());
    }
    r.store = model->expert_stats();
    return r;
  };
  const Result all = decode(-1, -1, false);
  for (double slots : {1.0, 6.0}) {
    SCOPED_TRACE(std::to_string(slots) + " VRAM slots");
    const double host_mb = 6 * slot_mb;  // 6 of the 24 experts
    const Result off = decode(slots * slot_mb, host_mb, false);
    const Result on = decode(slots * slot_mb, host_mb, true);
    EXPECT_EQ(off.logits, all.logits);
    EXPECT_EQ(on.logits, all.logits);
    EXPECT_EQ(off.store.predicted, 0u);
    EXPECT_GT(on.store.predicted, 0u);
    EXPECT_GT(on.store.predicted_right, 0u);
    EXPECT_GT(on.store.prefetch_reads, 0u);
    EXPECT_GT(on.store.prefetch_hits, 0u) << "no read ahead was ever used";
    // --lookahead-depth 2: layer 0 also guesses layer 2, which layer 1 guesses again.
    const Result deep = decode(slots * slot_mb, host_mb, true, 2);
    EXPECT_EQ(deep.logits, all.logits);
    EXPECT_EQ(on.store.reguessed, 0u);
    EXPECT_GT(deep.store.reguessed, 0u);
    EXPECT_GT(deep.store.prefetch_hits, 0u);
    EXPECT_EQ(decode(slots * slot_mb, host_mb, true, 1, 2).logits, all.logits);
    EXPECT_EQ(decode(slots * slot_mb, host_mb, true, 2, 1).logits, all.logits);
  }
  const Result vram_all = decode(-1, 6 * slot_mb, true);  // every expert fits in VRAM
  EXPECT_EQ(vram_all.logits, all.logits);
  EXPECT_EQ(vram_all.store.prefetch_reads, 0u);
}

// A usage profile (--profile) on CUDA when VRAM cannot hold every expert: its hottest experts, up
// to --pin-share of the VRAM slots, are never evicted, and when the steps read in place they are
// promoted into VRAM before any other (the host round trip loads them when first used). Pinning
// the experts this run uses least leaves one slot to the policy, so the run hits less than
// without a profile (if the pinned experts could be evicted, it would hit as often); the logits
// stay those of everything resident, bit for bit, read in place or through the host round trip.
TEST(CudaTier, ProfilePinsItsExpertsInVram) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::string src = test::fixture("models/qwen3moe_gqa_tied");  // 3 layers of 8 experts, top 2
  const std::string cache = test::temp_dir("gpu-tier-profile");
  const std::string dir = ensure_pack(src, cache);
  const double slot_mb = double((PackManifest::load(dir).max_expert_size() + 255) / 256 * 256) / 1e6;
  const std::vector<int32_t> prompt = {5, 17, 33, 2, 90, 144, 7, 61, 230, 12, 48};
  const int32_t cycle[] = {3, 40, 77, 120, 161, 202, 9, 250};
  struct Result {
    std::vector<float> logits;
    GpuTierStats stats;
    std::vector<std::vector<uint64_t>> usage;
  };
  auto decode = [&](ModelOptions o) {
    auto model = load_model(dir, o);
    Result r;
    std::vector<float> logits(size_t(model->info().vocab_size));
    auto seq = model->new_sequence(64);
    model->forward(prompt, *seq, logits);
    r.logits = logits;
    for (int step = 0; step < 24; ++step) {
      model->forward(std::span(&cycle[(5 * step) % 8], 1), *seq, logits);
      r.logits.insert(r.logits.end(), logits.begin(), logits.end());
    }
    if (const auto s = gpu_tier_stats(model->backend())) r.stats = *s;
    r.usage = model->expert_usage();
    return r;
  };
  ModelOptions cpu = cuda_options(cache, -1, -1);
  cpu.device = "cpu";
  const Result counted = decode(cpu);  // the CPU backend counts every use
  const Result all = decode(cuda_options(cache, -1, -1));
  // The experts used least (never used: most of all) as the profile's hottest.
  std::vector<std::vector<double>> coldest;
  for (const auto& layer : counted.usage) {
    coldest.emplace_back();
    for (uint64_t n : layer) coldest.back().push_back(1000.0 - double(n));
  }
  ASSERT_EQ(coldest.size(), 3u);
  ASSERT_EQ(coldest[0].size(), 8u);
  for (const char* in_place : {"1", "0"}) {
    SCOPED_TRACE(std::string("MOESTREAM_CUDA_IN_PLACE=") + in_place);
    setenv("MOESTREAM_CUDA_IN_PLACE", in_place, 1);
    const Result plain = decode(cuda_options(cache, 6 * slot_mb, -1));
    ModelOptions o = cuda_options(cache, 6 * slot_mb, -1);
    o.experts.profile = coldest;
    o.experts.pin_share = 1.0;  // every slot but one
    const Result pinned = decode(o);
    unsetenv("MOESTREAM_CUDA_IN_PLACE");
    EXPECT_EQ(plain.logits, all.logits);
    EXPECT_EQ(pinned.logits, all.logits);
    EXPECT_EQ(plain.stats.pinned, 0u);
    EXPECT_EQ(pinned.stats.pinned, 5u);
    EXPECT_GT(plain.stats.hits, 0u);
    if (std::string(in_place) == "1") {
      EXPECT_LT(pinned.stats.hits, plain.stats.hits) << "pinned experts were evicted";
      EXPECT_GE(pinned.stats.promotions, 5u);
    }
  }
}

}  // namespace
}  // namespace moestream
