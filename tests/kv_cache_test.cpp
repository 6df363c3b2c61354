// Compact KV caches (--kv-type) and KV windows (--kv-window, --kv-sinks): the packed row
// formats, the CPU attention over them against float32 and against a masked reference, the
// models' logits with each type, the ring's memory bound and truncation, and the flags' errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "backend/kv_cache.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/quant.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

constexpr KvType kCompact[] = {KvType::BF16, KvType::F16, KvType::Fp8, KvType::Q8};

TEST(KvCache, Fp8EncoderIsTheNearestCode) {
  const std::array<float, 256>& table = fp8_e4m3_table();
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(table[size_t(c)])), table[size_t(c)]) << c;
  }
  for (float x : test::gaussian(4000, 7, 30.0f)) {
    const float got = table[f32_to_fp8_e4m3(x)];
    float best = INFINITY;
    for (int c = 0; c < 256; ++c)
      if ((c & 0x7F) != 0x7F) best = std::min(best, std::fabs(table[size_t(c)] - x));
    EXPECT_EQ(std::fabs(got - x), best) << x;
  }
  EXPECT_EQ(table[f32_to_fp8_e4m3(1e6f)], 448.0f);
  EXPECT_EQ(table[f32_to_fp8_e4m3(-1e6f)], -448.0f);
}

TEST(KvCache, F16RowsUnpackAsTheScalarConversion) {
  std::vector<uint16_t> codes(65536);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint16_t(i);
  std::vector<float> got(codes.size());
  kv_load(KvType::F16, reinterpret_cast<const float*>(codes.data()), int64_t(codes.size()), 1, 0,
          int64_t(codes.size()), got.data());
  for (size_t i = 0; i < codes.size(); ++i) {
    const float want = f16_to_f32(codes[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      EXPECT_EQ(got[i], want) << i;
    }
  }
}

TEST(KvCache, PackedRowsRoundTripWithinTheirPrecision) {
  const int64_t heads = 3, width = 20, cols = heads * width;
  std::vector<float> x = test::gaussian(size_t(cols), 3);
  x[5] = 0;
  for (int64_t i = 2 * width; i < cols; ++i) x[size_t(i)] = 0;  // a head of zeros
  for (KvType t : kCompact) {
    std::vector<float> packed(size_t(kv_row_words(t, cols, heads)), -1.0f);
    std::vector<float> back(static_cast<size_t>(width));
    kv_store_row(t, x.data(), cols, heads, packed.data());
    for (int64_t h = 0; h < heads; ++h) {
      kv_load(t, packed.data(), cols, heads, h * width, width, back.data());
      float amax = 0;
      for (int64_t i = 0; i < width; ++i) amax = std::max(amax, std::fabs(x[size_t(h * width + i)]));
      for (int64_t i = 0; i < width; ++i) {
        const float v = x[size_t(h * width + i)], err = std::fabs(back[size_t(i)] - v);
        // bf16 / f16: half an ulp of v; fp8: half a step of 3 mantissa bits (or the subnormal
        // step of the head's scale); q8: half a step of amax / 127.
        const float bound = t == KvType::BF16  ? std::fabs(v) * 0x1p-8f
                            : t == KvType::F16 ? std::fabs(v) * 0x1p-11f
                            : t == KvType::Fp8 ? std::max(std::fabs(v) * 0x1p-4f, amax / 448 * 0x1p-10f)
                                               : amax / 254 * 1.0001f;
        EXPECT_LE(err, bound) << kv_type_name(t) << " head " << h << " col " << i;
      }
    }
  }
  // Out of f16's range: the largest finite value, not an infinity.
  const float big[2] = {1e6f, -1e6f};
  float packed16[1], back16[2];
  kv_store_row(KvType::F16, big, 2, 1, packed16);
  kv_load(KvType::F16, packed16, 2, 1, 0, 2, back16);
  EXPECT_EQ(back16[0], 65504.0f);
  EXPECT_EQ(back16[1], -65504.0f);
  EXPECT_EQ(kv_row_words(KvType::Q8, 128, 2), 2 + 32);
  EXPECT_EQ(kv_row_words(KvType::BF16, 3, 1), 2);
  EXPECT_EQ(kv_row_words(KvType::Fp8, 0, 4), 0);
}

// Attention through the CPU backend over `calls` batches of tokens with random q, k, v; returns
// every output row. kv picks the cache; the cache holds `capacity` positions.
struct AttnCase {
  int n_heads = 4, n_kv_heads = 2, head_dim = 16;
  int64_t sliding_window = 0;
  int v_head_dim = 0;           // MLA: values are the first v_head_dim columns of the keys
  bool values_in_keys = false;
};

AttentionParams attention_params(const AttnCase& c, const KvCacheSpec& kv, int64_t n_past) {
  AttentionParams p;
  p.n_heads = c.n_heads;
  p.n_kv_heads = c.n_kv_heads;
  p.head_dim = c.head_dim;
  p.scale = 1.0f / std::sqrt(float(c.head_dim));
  p.n_past = n_past;
  p.sliding_window = c.sliding_window;
  p.v_head_dim = c.v_head_dim ? c.v_head_dim : c.head_dim;
  p.values_in_keys = c.values_in_keys;
  p.kv = kv;
  return p;
}

std::vector<float> run_attention(const AttnCase& c, const KvCacheSpec& kv, const std::vector<int64_t>& calls,
                                 int64_t capacity) {
  auto be = make_cpu_backend(2, true);
  const int64_t q_dim = int64_t(c.n_heads) * c.head_dim, kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  const int64_t rows = kv_cache_rows(kv, capacity), vd = c.v_head_dim ? c.v_head_dim : c.head_dim;
  const int64_t v_dim = c.values_in_keys ? 0 : int64_t(c.n_kv_heads) * vd, out_dim = int64_t(c.n_heads) * vd;
  Buffer kc = be->alloc(rows, kv_row_words(kv.type, kv_dim, c.n_kv_heads));
  Buffer vc = be->alloc(rows, kv_row_words(kv.type, v_dim, c.n_kv_heads));
  std::vector<float> outs;
  int64_t n_past = 0;
  uint32_t seed = 1;
  for (int64_t T : calls) {
    Buffer q = be->alloc(T, q_dim), k = be->alloc(T, kv_dim), v = be->alloc(T, v_dim), o = be->alloc(T, out_dim);
    for (Buffer* b : {&q, &k, &v}) {
      const std::vector<float> g = test::gaussian(size_t(b->rows * b->cols), seed++, 2.0f);
      std::copy(g.begin(), g.end(), b->data);
    }
    be->attention(q, k, v, kc, vc, attention_params(c, kv, n_past), o);
    outs.insert(outs.end(), o.data, o.data + T * out_dim);
    n_past += T;
  }
  return outs;
}

// The same inputs as run_attention, attended over a full float32 cache with every key outside
// the sinks and the window masked out (and outside the model's sliding window).
std::vector<float> masked_reference(const AttnCase& c, int64_t window, int64_t sinks, const std::vector<int64_t>& calls) {
  const int64_t q_dim = int64_t(c.n_heads) * c.head_dim, kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  std::vector<float> keys, values, outs;
  int64_t n_past = 0;
  uint32_t seed = 1;
  for (int64_t T : calls) {
    const std::vector<float> q = test::gaussian(size_t(T * q_dim), seed++, 2.0f);
    const std::vector<float> k = test::gaussian(size_t(T * kv_dim), seed++, 2.0f);
    const std::vector<float> v = test::gaussian(size_t(T * kv_dim), seed++, 2.0f);
    keys.insert(keys.end(), k.begin(), k.end());
    values.insert(values.end(), v.begin(), v.end());
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < c.n_heads; ++h) {
        const int64_t pos = n_past + t;
        const int kvh = h / (c.n_heads / c.n_kv_heads);
        std::vector<double> w(size_t(pos + 1), 0.0);
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j <= pos; ++j) {
          const bool in_model_window = c.sliding_window == 0 || j > pos - c.sliding_window;
          const bool kept = window == 0 || j < sinks || j > pos - window;
          if (!in_model_window || !kept) {
            w[size_t(j)] = -INFINITY;
            continue;
          }
          double d = 0;
          for (int i = 0; i < c.head_dim; ++i)
            d += double(q[size_t(t * q_dim + h * c.head_dim + i)]) * keys[size_t(j * kv_dim + kvh * c.head_dim + i)];
          w[size_t(j)] = d / std::sqrt(double(c.head_dim));
          mx = std::max(mx, w[size_t(j)]);
        }
        for (double& x : w) sum += (x = std::exp(x - mx));
        for (int i = 0; i < c.head_dim; ++i) {
          double o = 0;
          for (int64_t j = 0; j <= pos; ++j) o += w[size_t(j)] / sum * values[size_t(j * kv_dim + kvh * c.head_dim + i)];
          outs.push_back(float(o));
        }
      }
    n_past += T;
  }
  return outs;
}

TEST(KvCache, EachTypeAttendsLikeFloat32WithinItsBound) {
  const std::vector<int64_t> calls{9, 1, 1, 4};
  // GQA, and MLA's latent cache (one head of [c, k_rope], values its first 32 columns).
  for (const AttnCase c : {AttnCase{}, AttnCase{4, 1, 40, 0, 32, true}}) {
    const std::vector<float> ref = run_attention(c, {}, calls, 32);
    // Measured on these cases (of max|out|, GQA / MLA): bf16 4.8e-3 / 7.0e-3, f16 1.0e-3 / 1.1e-3,
    // fp8 6.5e-2 / 8.0e-2, q8 1.9e-2 / 1.3e-2. Random keys this large make the softmax sharp.
    const std::map<KvType, double> bound{{KvType::BF16, 1e-2}, {KvType::F16, 2e-3}, {KvType::Fp8, 0.1}, {KvType::Q8, 3e-2}};
    for (KvType t : kCompact) {
      KvCacheSpec kv;
      kv.type = t;
      const double err = test::relative_error(run_attention(c, kv, calls, 32), ref);
      EXPECT_LE(err, bound.at(t)) << kv_type_name(t);
      EXPECT_GT(err, 0) << kv_type_name(t);
    }
  }
}

TEST(KvCache, EveryKernelLevelAttendsAlike) {
  // The packed rows are unpacked, then go through the f32 path's dot and axpy kernels at the
  // level in use: every level within float rounding of the scalar one, for every type and a ring.
  const std::vector<int64_t> calls{9, 1, 4};
  const cpu::KernelLevel saved = cpu::kernel_level();
  for (KvType t : {KvType::F32, KvType::BF16, KvType::F16, KvType::Fp8, KvType::Q8}) {
    KvCacheSpec kv;
    kv.type = t;
    kv.window = 5;
    kv.sinks = 1;
    cpu::set_kernel_level(cpu::KernelLevel::Scalar);
    const std::vector<float> scalar = run_attention({}, kv, calls, 32);
    for (cpu::KernelLevel level : test::supported_levels()) {
      cpu::set_kernel_level(level);
      EXPECT_LE(test::relative_error(run_attention({}, kv, calls, 32), scalar), 1e-5)
          << kv_type_name(t) << " " << cpu::kernel_level_name(level);
    }
  }
  cpu::set_kernel_level(saved);
}

TEST(KvCache, WindowedAttentionEqualsTheMaskedFullCache) {
  // 4 sinks + a ring of 6, over 40 positions: a prefill longer than the ring, then batches and
  // single tokens that wrap it several times.
  const std::vector<int64_t> calls{13, 1, 2, 1, 8, 1, 1, 7, 1, 5};
  for (const AttnCase c : {AttnCase{}, AttnCase{4, 4, 8, 0}, AttnCase{4, 2, 16, 8}}) {
    KvCacheSpec kv;
    kv.window = 6;
    kv.sinks = 4;
    const std::vector<float> ring = run_attention(c, kv, calls, 1000);
    EXPECT_LE(test::relative_error(ring, masked_reference(c, 6, 4, calls)), 1e-5);
    kv.ring = false;  // the same mask over a full cache: the very same numbers
    EXPECT_EQ(run_attention(c, kv, calls, 1000), ring);
    kv.ring = true;
    kv.sinks = 0;
    EXPECT_LE(test::relative_error(run_attention(c, kv, calls, 1000), masked_reference(c, 6, 0, calls)), 1e-5);
  }
}

// One prompt of `total` tokens (the same random q, k, v whatever the cut) attended in calls of
// the sizes in `cuts`; returns every output row.
std::vector<float> attend_cut(const AttnCase& c, const KvCacheSpec& kv, int64_t total, const std::vector<int64_t>& cuts) {
  auto be = make_cpu_backend(2, true);
  const int64_t q_dim = int64_t(c.n_heads) * c.head_dim, kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  const int64_t vd = c.v_head_dim ? c.v_head_dim : c.head_dim;
  const int64_t v_dim = c.values_in_keys ? 0 : int64_t(c.n_kv_heads) * vd, out_dim = int64_t(c.n_heads) * vd;
  const std::vector<float> q = test::gaussian(size_t(total * q_dim), 1, 2.0f);
  const std::vector<float> k = test::gaussian(size_t(total * kv_dim), 2, 2.0f);
  const std::vector<float> v = test::gaussian(size_t(total * v_dim), 3, 2.0f);
  Buffer kc = be->alloc(kv_cache_rows(kv, total), kv_row_words(kv.type, kv_dim, c.n_kv_heads));
  Buffer vc = be->alloc(kv_cache_rows(kv, total), kv_row_words(kv.type, v_dim, c.n_kv_heads));
  std::vector<float> outs;
  int64_t n_past = 0;
  for (int64_t T : cuts) {
    Buffer qb = be->alloc(T, q_dim), kb = be->alloc(T, kv_dim), vb = be->alloc(T, v_dim), o = be->alloc(T, out_dim);
    std::copy_n(q.begin() + n_past * q_dim, T * q_dim, qb.data);
    std::copy_n(k.begin() + n_past * kv_dim, T * kv_dim, kb.data);
    std::copy_n(v.begin() + n_past * v_dim, T * v_dim, vb.data);
    be->attention(qb, kb, vb, kc, vc, attention_params(c, kv, n_past), o);
    outs.insert(outs.end(), o.data, o.data + T * out_dim);
    n_past += T;
  }
  return outs;
}

TEST(KvCache, PromptCutIntoCallsAttendsBitForBit) {
  // Several tokens attend by blocks of queries (attention_blocks.h): without a sliding window each
  // output is the same bits however the prompt is cut into calls of several tokens (and the calls
  // into blocks), past the 256-key blocks too, on the f32 cache and a compact one, GQA and MLA.
  for (const AttnCase c : {AttnCase{}, AttnCase{4, 1, 40, 0, 32, true}})
    for (KvType t : {KvType::F32, KvType::BF16}) {
      KvCacheSpec kv;
      kv.type = t;
      const std::vector<float> whole = attend_cut(c, kv, 300, {300});
      EXPECT_EQ(attend_cut(c, kv, 300, {7, 93, 200}), whole) << kv_type_name(t);
      EXPECT_EQ(attend_cut(c, kv, 300, {256, 2, 42}), whole) << kv_type_name(t);
    }
  // And they are the attention: the whole prompt against float64 (masked_reference draws one
  // call's q, k, v from the seeds attend_cut uses).
  EXPECT_LE(test::relative_error(attend_cut({}, {}, 300, {300}), masked_reference({}, 0, 0, {300})), 1e-5);
}

TEST(KvCache, WindowWiderThanTheRunChangesNothing) {
  const std::vector<int64_t> calls{9, 1, 3};
  KvCacheSpec kv;
  kv.window = 100;
  kv.sinks = 2;
  EXPECT_EQ(run_attention({}, kv, calls, 64), run_attention({}, {}, calls, 64));
}

// Logits of one prefill then single tokens, as one vector.
std::vector<float> model_logits(Model& m, int64_t capacity, size_t n_tokens, size_t prefill) {
  const size_t vocab = size_t(m.info().vocab_size);
  std::vector<int32_t> ids(n_tokens);
  for (size_t i = 0; i < n_tokens; ++i) ids[i] = int32_t((i * 37 + 11) % vocab);
  auto seq = m.new_sequence(capacity);
  std::vector<float> out(n_tokens * vocab);
  m.forward(std::span(ids).first(prefill), *seq, std::span(out).first(prefill * vocab));
  for (size_t i = prefill; i < n_tokens; ++i)
    m.forward(std::span(ids).subspan(i, 1), *seq, std::span(out).subspan(i * vocab, vocab));
  return out;
}

std::unique_ptr<Model> load(const std::string& fixture, const KvCacheSpec& kv) {
  ModelOptions opt;
  opt.threads = 2;
  opt.precise = true;
  opt.kv = kv;
  return load_model(test::fixture(fixture), opt);
}

// GQA (Qwen3-MoE), hybrid DeltaNet (Qwen3.5), MLA's latent cache (DeepSeek-V3), sliding-window
// layers with sink logits (gpt-oss).
const char* const kFixtures[] = {"models/qwen3moe_gqa_tied", "families/qwen3_5_moe_text_tiny",
                                 "families/deepseek_v3_tiny", "families/gpt_oss_tiny"};

TEST(KvCache, ModelLogitsWithEachTypeStayNearFloat32) {
  // Per position, max|logit - f32's| / max|f32's logits|. A cache error can flip a router's
  // top-k choice at some position, and then that position's logits move by far more (the tiny
  // DeepSeek-V3 with fp8: 0.59 at 2 of 12 positions, 0.016 to 0.039 elsewhere), so the bound
  // holds for the median position and every position stays finite.
  const size_t n = 12;
  for (const char* f : kFixtures) {
    auto base = load(f, {});
    const std::vector<float> ref = model_logits(*base, 24, n, 8);
    const size_t vocab = size_t(base->info().vocab_size);
    for (KvType t : kCompact) {
      KvCacheSpec kv;
      kv.type = t;
      const std::vector<float> got = model_logits(*load(f, kv), 24, n, 8);
      std::vector<double> err;
      double ref_max = 0;
      for (float x : ref) ref_max = std::max(ref_max, double(std::fabs(x)));
      for (size_t i = 0; i < n; ++i) {
        double e = 0;
        for (size_t j = i * vocab; j < (i + 1) * vocab; ++j) e = std::max(e, double(std::fabs(got[j] - ref[j])));
        ASSERT_TRUE(std::isfinite(e)) << f << " " << kv_type_name(t);
        err.push_back(e / ref_max);
      }
      std::nth_element(err.begin(), err.begin() + long(n / 2), err.end());
      const double median = err[n / 2];
      const double bound = t == KvType::BF16 ? 1e-2 : t == KvType::F16 ? 2e-3 : t == KvType::Fp8 ? 6e-2 : 2e-2;
      EXPECT_LE(median, bound) << f << " " << kv_type_name(t);
      EXPECT_GT(median, 0) << f << " " << kv_type_name(t);
    }
  }
}

TEST(KvCache, ModelRingEqualsMaskingTheFullCache) {
  for (const char* f : kFixtures) {
    KvCacheSpec kv;
    kv.window = 5;
    kv.sinks = 2;
    const std::vector<float> ring = model_logits(*load(f, kv), 64, 20, 11);
    kv.ring = false;
    EXPECT_EQ(model_logits(*load(f, kv), 64, 20, 11), ring) << f;
    // And the window matters: the logits past the ring differ from the full cache's.
    EXPECT_NE(model_logits(*load(f, {}), 64, 20, 11), ring) << f;
  }
}

TEST(KvCache, WindowedSequenceMemoryStopsAtTheRing) {
  for (const char* f : kFixtures) {
    KvCacheSpec kv;
    kv.window = 5;
    kv.sinks = 2;
    auto windowed = load(f, kv), full = load(f, {});
    const int64_t ring_bytes = windowed->new_sequence(7)->bytes();
    EXPECT_EQ(windowed->new_sequence(100000)->bytes(), ring_bytes) << f;
    EXPECT_EQ(full->new_sequence(7)->bytes(), ring_bytes) << f;
    EXPECT_LT(ring_bytes, full->new_sequence(8)->bytes()) << f;
    auto seq = windowed->new_sequence(100000);
    std::vector<int32_t> ids(30, 3);
    std::vector<float> logits(size_t(windowed->info().vocab_size));
    windowed->forward(ids, *seq, logits);
    EXPECT_EQ(seq->bytes(), ring_bytes) << f;
  }
}

TEST(KvCache, CompactTypesShrinkTheCache) {
  // Per position: 16-bit types half of f32; 8-bit codes a quarter plus a float32 scale per head
  // (Qwen3-MoE fixture: 3 layers x K and V x 2 kv heads of 16 dims).
  auto f32 = load(kFixtures[0], {});
  const int64_t per_token = f32->new_sequence(2)->bytes() - f32->new_sequence(1)->bytes();
  EXPECT_EQ(per_token, 3 * 2 * 2 * 16 * 4);
  for (KvType t : kCompact) {
    KvCacheSpec kv;
    kv.type = t;
    auto m = load(kFixtures[0], kv);
    const int64_t bytes = m->new_sequence(2)->bytes() - m->new_sequence(1)->bytes();
    EXPECT_EQ(bytes, t == KvType::BF16 || t == KvType::F16 ? per_token / 2 : per_token / 4 + 3 * 2 * 2 * 4)
        << kv_type_name(t);
  }
}

TEST(KvCache, RingTruncatesOnlyWhileTheRowsSurvive) {
  KvCacheSpec kv;
  kv.window = 4;
  kv.sinks = 1;
  auto m = load(kFixtures[0], kv);
  auto seq = m->new_sequence(100);
  std::vector<int32_t> ids(5, 3);
  std::vector<float> logits(size_t(m->info().vocab_size));
  m->forward(ids, *seq, logits);
  EXPECT_TRUE(seq->can_truncate(2));  // 5 positions, 5 rows: nothing reused yet
  m->forward(ids, *seq, logits);      // 10 positions
  EXPECT_TRUE(seq->can_truncate(9));
  EXPECT_FALSE(seq->can_truncate(8));
  EXPECT_NE(test::error_of([&] { seq->truncate(3); }).find("KV window"), std::string::npos);
  // A snapshot of a wrapped ring continues exactly like the original.
  auto copy = seq->clone();
  std::vector<float> a(logits.size()), b(logits.size());
  m->forward(std::vector<int32_t>{7}, *seq, a);
  m->forward(std::vector<int32_t>{7}, *copy, b);
  EXPECT_EQ(a, b);
}

TEST(KvCache, FlagErrorsAreOneLineNamingTheFlag) {
  const std::string model = test::fixture("models/qwen3moe_gqa_tied");
  for (const auto& [args, flag] : std::vector<std::pair<std::string, std::string>>{
           {"--kv-type q4", "--kv-type"}, {"--kv-window 0", "--kv-window"}, {"--kv-window x", "--kv-window"},
           {"--kv-sinks 4", "--kv-sinks"}, {"--kv-window 8 --kv-sinks -1", "--kv-sinks"}}) {
    const auto r = test::run_cli("logits -m " + model + " --tokens 1,2 -o " + test::temp_dir("kv-flags") + "/l.npy " + args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find(flag), std::string::npos) << args << ": " << r.err;
  }
}

}  // namespace
}  // namespace moestream
