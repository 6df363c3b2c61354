// Expert streaming: the same results with and without an expert budget, for every policy and
// I/O mode; bounded memory; clear errors for damaged packs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "backend/backend_factory.h"
#include "backend/eviction.h"
#include "experts/expert_store.h"
#include "io/pack.h"
#include "models/model.h"
#include "models/synth.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

std::vector<int32_t> tokens_of(const std::string& dir) {
  auto j = nlohmann::json::parse(test::read_file(dir + "/ref.json"));
  return j["logit_tokens"].get<std::vector<int32_t>>();
}

// Logits of every position (prefill of 20, then one token at a time).
std::vector<float> run_loaded(Model& model, const std::vector<int32_t>& ids) {
  const size_t vocab = size_t(model.info().vocab_size), split = 20;
  std::vector<float> logits(ids.size() * vocab);
  auto seq = model.new_sequence(int64_t(ids.size()));
  model.forward(std::span(ids).first(split), *seq, std::span(logits).first(split * vocab));
  for (size_t i = split; i < ids.size(); ++i)
    model.forward(std::span(ids).subspan(i, 1), *seq, std::span(logits).subspan(i * vocab, vocab));
  return logits;
}

// The same for a model loaded from dir, and the expert stats.
std::vector<float> run_model(const std::string& dir, const ModelOptions& opt, ExpertStats* stats = nullptr) {
  auto model = load_model(dir, opt);
  std::vector<float> logits = run_loaded(*model, tokens_of(dir));
  if (stats) *stats = model->expert_stats();
  return logits;
}

class StreamingFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(StreamingFixture, BitIdenticalUnderEveryBudgetPolicyAndIoMode) {
  const std::string dir = GetParam();
  ModelOptions base;
  base.threads = 2;
  ExpertStats unbounded_stats;
  const std::vector<float> reference = run_model(dir, base, &unbounded_stats);
  EXPECT_EQ(unbounded_stats.hits + unbounded_stats.misses > 0, true);

  const std::string pack_dir = ensure_pack(dir, "");
  const PackManifest pack = PackManifest::load(pack_dir);
  const double one_expert_mb = pack.max_expert_size() / 1e6;
  // Budgets: less than one expert (one slot), two experts (less than a layer's routed set), and
  // about half of the model's experts.
  const double budgets[] = {one_expert_mb * 0.5, one_expert_mb * 2.0,
                            pack.total_expert_bytes() / 2e6};
  for (double mb : budgets) {
    for (const char* policy : {"lru", "lfu", "lcp"}) {
      for (const char* io : {"pread", "uring"}) {
        for (bool direct : {false, true}) {
          ModelOptions opt = base;
          opt.experts.cache_mb = mb;
          opt.experts.policy = policy;
          opt.experts.io = io;
          opt.experts.direct_io = direct;
          opt.experts.read_piece_bytes = direct ? 4096 : 0;  // many pieces an expert, or one read
          ExpertStats s;
          const std::vector<float> got = run_model(dir, opt, &s);
          ASSERT_EQ(got.size(), reference.size());
          EXPECT_EQ(std::memcmp(got.data(), reference.data(), got.size() * sizeof(float)), 0)
              << dir << " budget " << mb << " MB, " << policy << ", " << io << (direct ? ", O_DIRECT" : "");
          EXPECT_LE(s.cache_bytes, std::max<uint64_t>(uint64_t(mb * 1e6), pack.max_expert_size()));
          EXPECT_GT(s.misses, unbounded_stats.misses) << "a bounded cache must re-read experts";
        }
      }
    }
  }
}

// Lookahead reads guessed experts of the next layer ahead: never a different result, and its
// counters add up (guesses made on the decode tokens, reads ahead that were then used). Reads
// ahead by pieces in the gaps (the default, here of 4 KiB so that experts take several, and
// guesses stop part way) and all at once (--lookahead-pieces 0, whose counts below are the
// same from run to run: every guess is read whole as soon as a slot is free).
TEST_P(StreamingFixture, LookaheadKeepsLogitsBitIdentical) {
  const std::string dir = GetParam();
  ModelOptions base;
  base.threads = 2;
  const std::vector<float> reference = run_model(dir, base);
  const PackManifest pack = PackManifest::load(ensure_pack(dir, ""));
  const double one_expert_mb = pack.max_expert_size() / 1e6;
  for (int pieces : {0, 1, 2}) {
    uint64_t reads = 0, used = 0;
    for (double mb : {one_expert_mb * 0.5, one_expert_mb * 2.0, one_expert_mb * 3.0,
                      pack.total_expert_bytes() / 2e6}) {
      ModelOptions opt = base;
      opt.experts.cache_mb = mb;
      opt.experts.lookahead = true;
      opt.experts.lookahead_pieces = pieces;
      if (pieces > 0) opt.experts.read_piece_bytes = 4096;
      ExpertStats s;
      const std::vector<float> got = run_model(dir, opt, &s);
      ASSERT_EQ(got.size(), reference.size());
      EXPECT_EQ(std::memcmp(got.data(), reference.data(), got.size() * sizeof(float)), 0)
          << dir << " budget " << mb << ", pieces " << pieces;
      EXPECT_GT(s.predicted, 0u) << "decode tokens with a bounded cache make guesses";
      EXPECT_LE(s.predicted_right, s.predicted);
      EXPECT_LE(s.prefetch_hits + s.prefetch_wasted, s.prefetch_reads);
      EXPECT_LE(s.bytes_wasted, s.prefetch_wasted * pack.max_expert_size());
      reads += s.prefetch_reads;
      used += s.prefetch_hits;
    }
    if (pieces > 0) continue;  // whether a gap comes before the next request depends on timing
    EXPECT_GT(reads, 0u);
    EXPECT_GT(used, 0u) << "no read ahead was ever used";
  }
  // --lookahead-k 1: the same guesses (the logits are the same), but only the likeliest guessed
  // expert not in memory is read ahead, so fewer reads than with every guess.
  ModelOptions opt = base;
  opt.experts.cache_mb = one_expert_mb * 2.0;
  opt.experts.lookahead = true;
  opt.experts.lookahead_pieces = 0;
  ExpertStats all, one;
  run_model(dir, opt, &all);
  opt.experts.lookahead_k = 1;
  const std::vector<float> got = run_model(dir, opt, &one);
  EXPECT_EQ(std::memcmp(got.data(), reference.data(), got.size() * sizeof(float)), 0) << dir << " --lookahead-k 1";
  ASSERT_GT(one.predicted, 0u);
  EXPECT_EQ(one.predicted, all.predicted);
  EXPECT_EQ(one.predicted_right, all.predicted_right);
  EXPECT_GT(one.prefetch_reads, 0u);
  EXPECT_LT(one.prefetch_reads, all.prefetch_reads);
  // --lookahead-depth 3: each layer is also guessed from two and three MoE layers before; its
  // guess from the layer just before replaces those, so the counts of the latest guesses are the
  // depth-1 run's, and the earlier guesses show as replaced where there are layers to guess ahead.
  opt.experts.lookahead_k = 0;
  opt.experts.lookahead_depth = 3;
  ExpertStats deep;
  const std::vector<float> deep_logits = run_model(dir, opt, &deep);
  EXPECT_EQ(std::memcmp(deep_logits.data(), reference.data(), deep_logits.size() * sizeof(float)), 0)
      << dir << " --lookahead-depth 3";
  EXPECT_EQ(deep.predicted, all.predicted);
  EXPECT_EQ(deep.predicted_right, all.predicted_right);
  EXPECT_EQ(all.reguessed, 0u);
  const auto moe_layers = std::count_if(pack.layers.begin(), pack.layers.end(), [](const auto& l) { return !l.empty(); });
  if (moe_layers >= 3) {
    EXPECT_GT(deep.reguessed, 0u) << dir << ": " << moe_layers << " MoE layers";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, StreamingFixture, ::testing::ValuesIn(test::model_fixtures()),
                         [](const auto& info) { return fs::path(info.param).filename().string(); });
INSTANTIATE_TEST_SUITE_P(MlxFixtures, StreamingFixture, ::testing::ValuesIn(test::model_fixtures("mlx")),
                         [](const auto& info) { return fs::path(info.param).filename().string(); });

// A usage profile pins its hottest experts: read before the first token (--warmup), never
// evicted, so every request for them hits; the logits stay bit-identical.
TEST(ExpertStore, ProfilePinsTheHottestExperts) {
  const std::string dir = test::fixture("models/qwen3moe_gqa_tied");
  ModelOptions base;
  base.threads = 2;
  auto unbounded = load_model(dir, base);
  const std::vector<float> reference = run_loaded(*unbounded, tokens_of(dir));
  const std::vector<std::vector<uint64_t>> usage = unbounded->expert_usage();
  std::vector<std::vector<double>> profile;
  std::vector<std::pair<uint64_t, std::pair<int, int>>> ranked;
  for (size_t l = 0; l < usage.size(); ++l) {
    profile.emplace_back(usage[l].begin(), usage[l].end());
    for (size_t e = 0; e < usage[l].size(); ++e)
      if (usage[l][e]) ranked.push_back({usage[l][e], {int(l), int(e)}});
  }
  ASSERT_GT(ranked.size(), 6u);
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });

  const PackManifest pack = PackManifest::load(ensure_pack(dir, ""));
  ModelOptions opt = base;
  opt.experts.cache_mb = 8.5 * pack.max_expert_size() / 1e6;  // 8 slots, 4 of them pinned
  opt.experts.profile = profile;
  opt.experts.warmup = true;
  ExpertStats s;
  const std::vector<float> got = run_model(dir, opt, &s);
  EXPECT_EQ(got, reference);
  EXPECT_EQ(s.pinned, 4u);
  uint64_t pinned_uses = 0;
  for (size_t i = 0; i < 4; ++i) pinned_uses += ranked[i].first;
  EXPECT_GE(s.hits, pinned_uses) << "every request for a pinned expert is a hit";

  opt.experts.profile = {{1.0}};  // one layer of one count: not this model's shape
  try {
    load_model(dir, opt);
    ADD_FAILURE() << "a profile of another shape was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("profile: 1 layers of counts"), std::string::npos) << e.what();
  }
}

// --warmup on the CPU with a cache that holds every expert reads all of them before the first
// token: every request then hits, and the logits are those of a cold start.
TEST(ExpertStore, WarmupReadsEveryExpertWhenTheyAllFit) {
  const std::string dir = test::fixture("models/qwen3moe_gqa_tied");
  ModelOptions opt;
  opt.threads = 2;
  ExpertStats cold;
  const std::vector<float> reference = run_model(dir, opt, &cold);
  ASSERT_GT(cold.misses, 0u);
  opt.experts.warmup = true;
  ExpertStats warm;
  EXPECT_EQ(run_model(dir, opt, &warm), reference);
  EXPECT_EQ(warm.misses, 0u);
  EXPECT_EQ(warm.hits, cold.hits + cold.misses);
  EXPECT_EQ(warm.bytes_read, PackManifest::load(ensure_pack(dir, "")).total_expert_bytes());
}

// The default expert cache: every expert while they fit in 80% of the memory available at load,
// else that 80% (a model whose experts are larger than the machine streams them instead of
// growing past the memory); a given budget, or an unknown amount of memory, is left as it is.
TEST(ExpertStore, DefaultBudgetKeepsToTheMemoryAvailable) {
  EXPECT_EQ(default_expert_cache_mb(-1, 10e9, 100e9), -1.0);   // 10 GB of experts, 100 GB free
  EXPECT_EQ(default_expert_cache_mb(-1, 80e9, 100e9), -1.0);   // exactly 80%
  EXPECT_DOUBLE_EQ(default_expert_cache_mb(-1, 300e9, 100e9), 80e3);  // 300 GB: an 80 GB cache
  EXPECT_EQ(default_expert_cache_mb(500, 300e9, 100e9), 500.0);  // --expert-cache-mb 500
  EXPECT_EQ(default_expert_cache_mb(0, 300e9, 100e9), 0.0);
  EXPECT_EQ(default_expert_cache_mb(-1, 300e9, 0), -1.0);  // /proc/meminfo unreadable
  // The model takes the default (on this machine the fixture's experts fit: unbounded, budget 0)
  // or the budget given.
  const std::string dir = test::fixture("models/qwen3moe_gqa_tied");
  ModelOptions opt;
  opt.threads = 2;
  ExpertStats s;
  run_model(dir, opt, &s);
  EXPECT_EQ(s.budget_bytes, 0u);
  opt.experts.cache_mb = 0.5;
  run_model(dir, opt, &s);
  EXPECT_EQ(s.budget_bytes, 500000u);
}

// --profile-out writes the run's usage (one count per request, each layer's experts); --profile
// reads it back, and a file that is not a profile is named in a one-line error.
TEST(ExpertStore, CliProfileOutAndIn) {
  const std::string dir = test::fixture("models/qwen3moe_odd_sparse_step");
  const std::string out = (fs::temp_directory_path() / "moestream-profile-test.json").string();
  fs::remove(out);
  auto r = test::run_cli("run -m " + dir + " --tokens 1,2,3 -n 8 --temp 0 --ids --profile-out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(test::read_file(out));
  const PackManifest pack = PackManifest::load(ensure_pack(dir, ""));
  ASSERT_EQ(j["counts"].size(), pack.layers.size());
  uint64_t total = 0;
  for (size_t l = 0; l < pack.layers.size(); ++l) {
    ASSERT_EQ(j["counts"][l].size(), pack.layers[l].size());
    for (const auto& c : j["counts"][l]) total += c.get<uint64_t>();
  }
  EXPECT_GT(total, 0u);
  r = test::run_cli("run -m " + dir + " --tokens 1,2,3 -n 8 --temp 0 --ids --expert-cache-mb 0.05 --warmup --profile " + out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string bad = out + ".bad";
  {
    std::ofstream(bad) << "{\"counts\": 3}";
  }
  r = test::run_cli("run -m " + dir + " --tokens 1,2,3 -n 8 --profile " + bad);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find(bad + ": not a profile"), std::string::npos) << r.err;
  fs::remove(out);
  fs::remove(bad);
}

// `moestream profile` runs a text one token at a time: each token counts its top-k experts in
// every MoE layer (the demo model: 8 layers, 4 of 32 experts).
TEST(ExpertStore, CliProfileCountsEveryTokensExperts) {
  const std::string model = test::source_dir() + "/models/pystd-moe-20m-q4";
  const std::string out = (fs::temp_directory_path() / "moestream-profile-cmd.json").string();
  fs::remove(out);
  auto r = test::run_cli("profile -m " + model + " -f " + model + "/heldout.txt -o " + out + " --max-tokens 25");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(test::read_file(out));
  ASSERT_EQ(j["counts"].size(), 8u);
  for (const auto& layer : j["counts"]) {
    ASSERT_EQ(layer.size(), 32u);
    uint64_t sum = 0;
    for (const auto& c : layer) sum += c.get<uint64_t>();
    EXPECT_EQ(sum, 25u * 4u);
  }
  fs::remove(out);
}

// --moe-top-k (lossy): each decode token asks each MoE layer for K experts; K at or above the
// model's top k changes nothing.
TEST(ExpertStore, MoeTopKRoutesEachTokenToKExperts) {
  const std::string dir = test::fixture("models/qwen3moe_gqa_tied");
  const std::vector<int32_t> ids = tokens_of(dir);
  ModelOptions base;
  base.threads = 2;
  const std::vector<float> reference = run_model(dir, base);
  ModelOptions same = base;
  same.moe_top_k = 64;
  EXPECT_EQ(run_model(dir, same), reference);

  ModelOptions one = base;
  one.moe_top_k = 1;
  auto model = load_model(dir, one);
  std::vector<float> logits(size_t(model->info().vocab_size));
  auto seq = model->new_sequence(8);
  for (int i = 0; i < 5; ++i) model->forward(std::span(ids).subspan(size_t(i), 1), *seq, logits);
  for (const auto& layer : model->expert_usage()) {
    uint64_t sum = 0;
    for (uint64_t c : layer) sum += c;
    if (sum) {
      EXPECT_EQ(sum, 5u);
    }
  }
  EXPECT_NE(run_model(dir, one), reference);
}

TEST(ExpertStore, CliGreedyTokensIdenticalWithTinyBudget) {
  const std::string dir = test::fixture("models/qwen3moe_odd_sparse_step");
  auto j = nlohmann::json::parse(test::read_file(dir + "/ref.json"));
  std::string prompt;
  for (int t : j["prompt_tokens"]) prompt += (prompt.empty() ? "" : ",") + std::to_string(t);
  std::string want;
  for (int t : j["greedy_tokens"]) want += (want.empty() ? "" : " ") + std::to_string(t);
  auto r = test::run_cli("run -m " + dir + " --tokens " + prompt + " -n 24 --temp 0 --ids --precise "
                         "--expert-cache-mb 0.01 --cache-policy lcp --io uring --stats");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, want + "\n");
  const std::string last = r.err.substr(r.err.rfind('{'));
  auto stats = nlohmann::json::parse(last);
  for (const char* key : {"tokens", "tok_per_s", "prefill_tok_per_s", "expert_hits", "expert_misses",
                          "hit_rate", "bytes_read", "read_gb_per_s", "peak_rss_bytes", "expert_cache_bytes"})
    EXPECT_TRUE(stats.contains(key)) << key;
  EXPECT_EQ(stats["tokens"], 24);
  EXPECT_GT(stats["bytes_read"].get<uint64_t>(), 0u);
}

std::string packed_copy(const std::string& name) {
  const std::string dir = test::temp_dir(name) + "/pack";
  fs::copy(ensure_pack(test::fixture("models/qwen3moe_gqa_tied"), ""), dir, fs::copy_options::recursive);
  return dir;
}

std::string run_error(const std::string& dir, double budget_mb) {
  try {
    ModelOptions opt;
    opt.experts.cache_mb = budget_mb;
    run_model(test::fixture("models/qwen3moe_gqa_tied"), opt);  // warm path works
    auto model = load_model(dir, opt);
    std::vector<int32_t> ids = tokens_of(test::fixture("models/qwen3moe_gqa_tied"));
    std::vector<float> logits(size_t(model->info().vocab_size));
    auto seq = model->new_sequence(int64_t(ids.size()));
    model->forward(ids, *seq, logits);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ExpertStore, CorruptedExpertIsNamedNeverUsed) {
  const std::string dir = packed_copy("corrupt-expert");
  const PackManifest m = PackManifest::load(dir);
  const PackedExpert& e = m.expert(1, 3);
  {
    std::fstream f(dir + "/" + m.expert_files[size_t(e.file)], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(e.offset + 100));
    char c = 0x55;
    f.write(&c, 1);
  }
  const std::string msg = run_error(dir, -1);
  EXPECT_NE(msg.find("checksum mismatch"), std::string::npos) << msg;
  EXPECT_NE(msg.find("layer 1 expert 3"), std::string::npos) << msg;
}

// After a read fails its checksum, the store drops that request whole (slots unpinned, reads
// waited for): once the bytes are right again, the same model computes the exact logits.
TEST(ExpertStore, FailedReadLeavesTheStoreUsable) {
  const std::string ref_dir = test::fixture("models/qwen3moe_gqa_tied");
  const std::string dir = packed_copy("recover-expert");
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
  const std::vector<int32_t> ids = tokens_of(ref_dir);
  for (double budget : {-1.0, 0.01, 0.05, -2.0}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    ModelOptions opt;
    // -2: 0.05 MB with lookahead, whose reads ahead of the damaged expert fail quietly and leave
    // the error to the request that needs it.
    opt.experts.cache_mb = budget == -2.0 ? 0.05 : budget;
    opt.experts.lookahead = budget == -2.0;
    opt.experts.read_piece_bytes = budget == 0.01 || budget == -2.0 ? 4096 : 0;  // the damage in one of many pieces
    const std::vector<float> want = run_model(ref_dir, opt);
    auto model = load_model(dir, opt);
    flip();
    for (int attempt = 0; attempt < 2; ++attempt) {  // fails the same way each time, never wedged
      try {
        run_loaded(*model, ids);
        ADD_FAILURE() << "no error for the damaged expert";
      } catch (const Error& err) {
        EXPECT_NE(std::string(err.what()).find("checksum mismatch for layer 1 expert 3"), std::string::npos) << err.what();
      }
    }
    flip();
    EXPECT_EQ(run_loaded(*model, ids), want);
  }
}

// Reads ahead by pieces: a guess starts at once when no read the model waits for is in flight;
// a request for other experts of its layer stops it part way, and a later request for it reads
// only the rest (every byte read once, the checksum over all of it). With one slot, a stopped
// read ahead gives its slot to the request instead of holding it.
TEST(ExpertStore, ReadAheadStopsPartWayAndResumes) {
  const PackManifest pack =
      PackManifest::load(ensure_pack(test::fixture("models/qwen3moe_gqa_tied"), ""));
  auto backend = make_backend(BackendOptions{});
  ASSERT_GE(pack.layers.size(), 2u);
  ASSERT_GE(pack.layers[1].size(), 6u);
  ASSERT_GT(pack.expert(1, 2).size, 2u * 4096) << "the guess must take several pieces";
  auto drain = [](ExpertStore& store, std::vector<int> want) {
    int e;
    MlpWeights w;
    std::vector<int> got;
    while (store.next(e, w)) {
      got.push_back(e);
      store.release(e);
    }
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want);
  };
  ExpertStoreOptions o;
  o.lookahead = true;
  o.lookahead_pieces = 1;
  o.read_piece_bytes = 4096;
  o.cache_mb = 8.5 * double(pack.max_expert_size()) / 1e6;  // 8 slots: nothing is evicted
  {
    auto store = make_expert_store(pack, *backend, o);
    store->request(0, std::vector<int>{0, 1});
    drain(*store, {0, 1});
    store->prefetch(1, std::vector<int>{2});
    EXPECT_EQ(store->stats().prefetch_reads, 1u)
        << "no read was in flight: the guess starts at once";
    store->request(1, std::vector<int>{4, 5});
    drain(*store, {4, 5});
    store->request(1, std::vector<int>{2});
    drain(*store, {2});
    const ExpertStats s = store->stats();
    EXPECT_EQ(s.prefetch_hits, 1u);
    EXPECT_EQ(s.bytes_read, pack.expert(0, 0).size + pack.expert(0, 1).size +
                                pack.expert(1, 4).size + pack.expert(1, 5).size +
                                pack.expert(1, 2).size)
        << "the stopped guess was read again instead of resumed";
  }
  o.cache_mb = 1.5 * double(pack.max_expert_size()) / 1e6;  // one slot
  for (int round = 0; round < 20; ++round) {
    auto store = make_expert_store(pack, *backend, o);
    store->request(0, std::vector<int>{0});
    drain(*store, {0});
    store->prefetch(1, std::vector<int>{2});
    store->request(1, std::vector<int>{3, 4});  // the slot goes from the guess to the request
    drain(*store, {3, 4});
    store->request(1, std::vector<int>{2});
    drain(*store, {2});
    const ExpertStats s = store->stats();
    EXPECT_EQ(s.prefetch_reads, 1u);
    EXPECT_EQ(s.prefetch_wasted, 1u);
    EXPECT_GT(s.bytes_wasted, 0u);
    EXPECT_LE(s.bytes_wasted, pack.expert(1, 2).size);
  }
  // A read ahead in flight when the store goes away, or when a request abandons the one before it
  // (an expert still held, as after a failed computation): neither waits forever.
  o.cache_mb = 8.5 * double(pack.max_expert_size()) / 1e6;
  for (int round = 0; round < 30; ++round) {
    auto store = make_expert_store(pack, *backend, o);
    store->request(0, std::vector<int>{0, 1});
    int e;
    MlpWeights w;
    ASSERT_TRUE(store->next(e, w));  // held, never released
    store->prefetch(1, std::vector<int>{2, 3});
    store->request(0, std::vector<int>{0});
    drain(*store, {0});
    store->prefetch(1, std::vector<int>{2, 3});
    store.reset();
  }
}

// A store that never evicts (unbounded) is lasting: the CUDA tier keeps the addresses it hands
// out and reads those experts in place. preload() shows every expert asked for, at the address a
// later request hands out, and is not counted as the model's use (profiles, hit rate).
TEST(ExpertStore, LastingStoreKeepsAddressesAndPreloadIsNotUse) {
  const PackManifest pack = PackManifest::load(ensure_pack(test::fixture("models/qwen3moe_gqa_tied"), ""));
  auto backend = make_backend(BackendOptions{});
  ExpertStoreOptions bounded;
  bounded.cache_mb = 2.5 * double(pack.max_expert_size()) / 1e6;
  EXPECT_FALSE(make_expert_store(pack, *backend, bounded)->lasting());
  auto store = make_expert_store(pack, *backend, ExpertStoreOptions{});
  ASSERT_TRUE(store->lasting());
  const int n = int(pack.layers[1].size());
  std::vector<int> all;
  for (int e = 0; e < n; ++e) all.push_back(e);
  std::vector<const void*> seen(size_t(n), nullptr);
  int calls = 0;
  store->preload(1, all, [&](int e, const MlpWeights& w) {
    ++calls;
    ASSERT_TRUE(e >= 0 && e < n);
    EXPECT_EQ(seen[size_t(e)], nullptr) << "expert " << e << " shown twice";
    seen[size_t(e)] = w.gate.data;
  });
  EXPECT_EQ(calls, n);
  ExpertStats s = store->stats();
  EXPECT_EQ(s.hits + s.misses, 0u);
  EXPECT_GE(s.bytes_read, uint64_t(n) * 1000);
  for (const auto& layer : store->usage())
    for (uint64_t u : layer) EXPECT_EQ(u, 0u);
  const std::vector<int> some = {2, 5};
  store->request(1, some);
  int e;
  MlpWeights w;
  int handed = 0;
  while (store->next(e, w)) {
    EXPECT_EQ(w.gate.data, seen[size_t(e)]) << "expert " << e << " moved";
    store->release(e);
    ++handed;
  }
  EXPECT_EQ(handed, 2);
  s = store->stats();
  EXPECT_EQ(s.hits, 2u);
  EXPECT_EQ(store->usage()[1][2], 1u);
  EXPECT_EQ(store->usage()[1][5], 1u);
  EXPECT_EQ(store->usage()[1][3], 0u);
}

TEST(ExpertStore, TruncatedExpertFileIsAnErrorAtLoad) {
  const std::string dir = packed_copy("truncated-pack");
  const PackManifest m = PackManifest::load(dir);
  const std::string file = dir + "/" + m.expert_files.back();
  fs::resize_file(file, fs::file_size(file) - 4096);
  const std::string msg = run_error(dir, 0.01);
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find(m.expert_files.back()), std::string::npos) << msg;
}

TEST(ExpertStore, DamagedManifestIsAnError) {
  const std::string dir = packed_copy("bad-manifest");
  std::ofstream(dir + "/" + kPackManifestName) << "{\"format\": \"moestream-pack\", \"version\": 1}";
  const std::string msg = run_error(dir, -1);
  EXPECT_NE(msg.find(kPackManifestName), std::string::npos) << msg;
}

TEST(ExpertStore, EvictionPrioritiesFollowTheirRules) {
  auto lru = make_eviction_policy("lru"), lfu = make_eviction_policy("lfu"), lcp = make_eviction_policy("lcp");
  ExpertUse old_frequent{10, 50}, recent_rare{99, 2};
  EXPECT_LT(lru->priority(old_frequent, 100, 1), lru->priority(recent_rare, 100, 1));
  EXPECT_GT(lfu->priority(old_frequent, 100, 1), lfu->priority(recent_rare, 100, 1));
  // lcp: 50 * 0.25^(90/128) = 18.9 > 2 * 0.25^(1/128) = 1.98; much older, the rare one wins.
  EXPECT_GT(lcp->priority(old_frequent, 100, 1), lcp->priority(recent_rare, 100, 1));
  EXPECT_LT(lcp->priority(ExpertUse{10, 50}, 1000, 1), lcp->priority(ExpertUse{999, 2}, 1000, 1));
  EXPECT_THROW(make_eviction_policy("fifo"), Error);
}

// A synthesized model whose experts are far larger than the budget: peak RSS stays within
// non-expert bytes + budget + 256 MB (it would exceed that if the experts were all kept).
TEST(ExpertStore, PeakRssBoundedByBudget) {
  const std::string dir = test::temp_dir("rss") + "/pack";
  SynthShape shape = synth_preset("small");
  shape.layers = 4;
  shape.experts = 64;
  shape.hidden = 512;
  shape.moe_intermediate = 512;
  write_synthetic_pack(dir, shape, SynthOptions{});
  const PackManifest m = PackManifest::load(dir);
  const uint64_t non_expert = fs::file_size(dir + "/weights.safetensors");
  const double budget_mb = 40;
  const uint64_t bound = non_expert + uint64_t(budget_mb * 1e6) + (256ull << 20);
  ASSERT_GE(m.total_expert_bytes(), uint64_t(8 * budget_mb * 1e6));
  ASSERT_GT(m.total_expert_bytes(), bound) << "the model must not fit in the bound";
  std::string prompt;
  for (int i = 0; i < 96; ++i) prompt += (i ? "," : "") + std::to_string(300 + 7 * i);
  auto r = test::run_cli("run -m " + dir + " --tokens " + prompt + " -n 16 --ids --stats --threads 2 "
                         "--expert-cache-mb " + std::to_string(budget_mb));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto stats = nlohmann::json::parse(r.err.substr(r.err.rfind('{')));
  EXPECT_LE(stats["peak_rss_bytes"].get<uint64_t>(), bound);
  EXPECT_LE(stats["expert_cache_bytes"].get<uint64_t>(), uint64_t(budget_mb * 1e6));
  // Nearly every expert was needed, so without the budget they would all be resident.
  EXPECT_GT(stats["bytes_read"].get<uint64_t>(), m.total_expert_bytes() / 2);
}

}  // namespace
}  // namespace moestream
