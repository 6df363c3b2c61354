// Quantization format (core/quant.h) and the CPU kernels for every weight format and SIMD level
// (backend/cpu/kernels.h). Kernels are checked against a float64 product with the dequantized
// weights and against the scalar level.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/error.h"
#include "core/quant.h"
#include "test_util.h"

namespace moestream {
namespace {

using cpu::KernelLevel;

// ---- format names and validation ------------------------------------------------------------

TEST(QuantFormat, ParsesNamesAndSpellsThemBack) {
  EXPECT_EQ(parse_quant_format("q4"), (QuantFormat{4, 64, DType::BF16}));
  EXPECT_EQ(parse_quant_format("q2g32"), (QuantFormat{2, 32, DType::BF16}));
  EXPECT_EQ(parse_quant_format("q8g128-f16"), (QuantFormat{8, 128, DType::F16}));
  EXPECT_EQ(parse_quant_format("q3g64-bf16"), (QuantFormat{3, 64, DType::BF16}));
  for (const char* name : {"q2g32", "q3g64", "q4g128-f16", "q6g64", "q8g32-f16"})
    EXPECT_EQ(quant_format_name(parse_quant_format(name)), name);
}

TEST(QuantFormat, RejectsUnknownNamesWithTheSpec) {
  for (const char* bad : {"", "q", "4", "q5", "q4g48", "q4g", "q4-f32", "q4g64x", "Q4", "q16"}) {
    SCOPED_TRACE(std::string("'") + bad + "'");
    test::expect_contains(test::error_of([&] { parse_quant_format(bad); }), {std::string("'") + bad + "'"});
  }
}

TEST(QuantFormat, ShapeChecksNameTheTensor) {
  test::expect_contains(test::error_of([] { check_quant_shape({4, 64, DType::BF16}, 96, "layers.0.mlp.up_proj"); }),
                        {"layers.0.mlp.up_proj", "96"});
  EXPECT_THROW(check_quant_format({5, 64, DType::BF16}, "w"), Error);
  EXPECT_THROW(check_quant_format({4, 64, DType::F32}, "w"), Error);
  EXPECT_NO_THROW(check_quant_shape({3, 32, DType::F16}, 96, "w"));
}

// ---- bit layout -----------------------------------------------------------------------------

std::vector<uint32_t> pack(const std::vector<uint32_t>& codes, int bits) {
  std::vector<uint32_t> words(codes.size() * bits / 32, 0);
  for (size_t i = 0; i < codes.size(); ++i) quant_put_code(words.data(), int64_t(i), bits, codes[i]);
  return words;
}

TEST(QuantLayout, PowerOfTwoWidthsFillWordsFromTheLowBits) {
  std::vector<uint32_t> c2(16), c4(16), c8(8);
  for (uint32_t i = 0; i < 16; ++i) c2[i] = i % 4, c4[i] = i;
  for (uint32_t i = 0; i < 8; ++i) c8[i] = 0x10 * i + 1;
  EXPECT_EQ(pack(c2, 2), (std::vector<uint32_t>{0xE4E4E4E4u}));
  EXPECT_EQ(pack(c4, 4), (std::vector<uint32_t>{0x76543210u, 0xFEDCBA98u}));
  EXPECT_EQ(pack(c8, 8), (std::vector<uint32_t>{0x31211101u, 0x71615141u}));
}

TEST(QuantLayout, ThreeAndSixBitCodesStraddleWords) {
  // Codes 0..7 repeated: each 24-bit pack is octal 76543210 = 0xFAC688, packs back to back.
  std::vector<uint32_t> c3(32);
  for (uint32_t i = 0; i < 32; ++i) c3[i] = i % 8;
  EXPECT_EQ(pack(c3, 3), (std::vector<uint32_t>{0x88FAC688u, 0xC688FAC6u, 0xFAC688FAu}));
  // Element 10 of a 3-bit row is bits 30..32: two bits in word 0, one in word 1.
  std::vector<uint32_t> one(32, 0);
  one[10] = 7;
  EXPECT_EQ(pack(one, 3), (std::vector<uint32_t>{0xC0000000u, 0x1u, 0x0u}));
  // Codes 0..3 repeated at 6 bits: 0 | 1 << 6 | 2 << 12 | 3 << 18 = 0x0C2040 per 3-byte pack.
  std::vector<uint32_t> c6(16);
  for (uint32_t i = 0; i < 16; ++i) c6[i] = i % 4;
  EXPECT_EQ(pack(c6, 6), (std::vector<uint32_t>{0x400C2040u, 0x20400C20u, 0x0C20400Cu}));
  // Element 5 of a 6-bit row is bits 30..35.
  std::vector<uint32_t> six(16, 0);
  six[5] = 0x3F;
  EXPECT_EQ(pack(six, 6), (std::vector<uint32_t>{0xC0000000u, 0xFu, 0x0u}));
}

// MLX unpacks 3- and 6-bit codes from packs of 3 bytes with these masks
// (mlx/backend/cpu/quantized.cpp, extract_bits; the Metal dequantize uses the same).
void mlx_extract(const uint8_t* w, int bits, uint32_t* out) {
  if (bits == 3) {
    out[0] = w[0] & 0x7;
    out[1] = (w[0] & 0x38) >> 3;
    out[2] = ((w[0] & 0xc0) >> 6) + ((w[1] & 0x1) << 2);
    out[3] = (w[1] & 0xe) >> 1;
    out[4] = (w[1] & 0x70) >> 4;
    out[5] = ((w[1] & 0x80) >> 7) + ((w[2] & 0x3) << 1);
    out[6] = (w[2] & 0x1c) >> 2;
    out[7] = (w[2] & 0xe0) >> 5;
  } else {
    out[0] = w[0] & 0x3f;
    out[1] = ((w[0] >> 6) & 0x03) + ((w[1] & 0x0f) << 2);
    out[2] = ((w[1] >> 4) & 0x0f) + ((w[2] & 0x03) << 4);
    out[3] = (w[2] >> 2) & 0x3f;
  }
}

TEST(QuantLayout, MatchesMlxThreeBytePacks) {
  std::mt19937 rng(7);
  for (int bits : {3, 6}) {
    const int per_pack = bits == 3 ? 8 : 4;
    std::vector<uint32_t> codes(128);
    for (auto& c : codes) c = rng() % (1u << bits);
    const std::vector<uint32_t> words = pack(codes, bits);
    uint8_t bytes[128 * 6 / 8] = {};  // room for the widest (6-bit) codes; 3-bit ones fill half
    ASSERT_EQ(words.size() * 4, size_t(128 * bits / 8));
    std::memcpy(bytes, words.data(), words.size() * 4);  // little-endian words, as MLX's uint32 array
    for (int p = 0; p < 128 / per_pack; ++p) {
      uint32_t got[8];
      mlx_extract(bytes + 3 * p, bits, got);
      for (int k = 0; k < per_pack; ++k) ASSERT_EQ(got[k], codes[p * per_pack + k]) << bits;
    }
    for (int i = 0; i < 128; ++i) EXPECT_EQ(quant_code(words.data(), i, bits), codes[i]);
  }
}

// ---- quantize / dequantize ------------------------------------------------------------------

struct Quantized {
  QuantFormat f;
  int64_t rows, cols;
  std::vector<uint32_t> words;
  std::vector<uint16_t> scales, biases;
  Matrix matrix(const std::string& name = "w") const {
    Matrix m;
    m.name = name;
    m.dtype = DType::U32;
    m.data = words.data();
    m.rows = rows;
    m.cols = cols;
    m.quant = f;
    m.scales = scales.data();
    m.biases = biases.data();
    return m;
  }
  std::vector<float> dequantized() const {
    std::vector<float> out(size_t(rows * cols));
    const int64_t wpr = quant_words_per_row(f, cols), gpr = quant_groups_per_row(f, cols);
    for (int64_t r = 0; r < rows; ++r)
      dequantize_row(f, cols, words.data() + r * wpr, scales.data() + r * gpr,
                     biases.data() + r * gpr, out.data() + r * cols);
    return out;
  }
};

Quantized quantize(const std::vector<float>& w, int64_t rows, int64_t cols, QuantFormat f,
                   bool clip = false) {
  Quantized q{f, rows, cols, {}, {}, {}};
  q.words.resize(size_t(rows * quant_words_per_row(f, cols)));
  q.scales.resize(size_t(rows * quant_groups_per_row(f, cols)));
  q.biases.resize(q.scales.size());
  QuantizeOptions opt;
  opt.clip_search = clip;
  quantize_affine(w.data(), rows, cols, f, q.words.data(), q.scales.data(), q.biases.data(), opt);
  return q;
}

using test::gaussian;

TEST(QuantAffine, FollowsMlxEdgeRules) {
  const QuantFormat f{4, 32, DType::F16};
  std::vector<float> w(32 * 4);
  // Group 0: |min| > |max|: scale > 0, bias = min, zero lands on code 10 exactly.
  for (int i = 0; i < 32; ++i) w[i] = -1.5f + 2.25f * float(i % 16) / 15.0f;
  // Group 1: all positive in [1, 2]: the max is the edge, scale < 0, bias = max.
  for (int i = 0; i < 32; ++i) w[32 + i] = 1.0f + float(i % 16) / 15.0f;
  // Group 2: all zero; group 3: constant 0.5.
  for (int i = 0; i < 32; ++i) w[64 + i] = 0.0f, w[96 + i] = 0.5f;
  const Quantized q = quantize(w, 1, 128, f);
  auto scale = [&](int g) { return scale_to_f32(q.scales[g], f.scale_dtype); };
  auto bias = [&](int g) { return scale_to_f32(q.biases[g], f.scale_dtype); };
  EXPECT_EQ(bias(0), -1.5f);
  EXPECT_EQ(scale(0), scale_to_f32(scale_from_f32(0.15f, DType::F16), DType::F16));
  EXPECT_EQ(quant_code(q.words.data(), 0, 4), 0u);
  EXPECT_EQ(quant_code(q.words.data(), 15, 4), 15u);
  EXPECT_EQ(bias(1), 2.0f);
  EXPECT_LT(scale(1), 0.0f);
  EXPECT_EQ(quant_code(q.words.data(), 32 + 15, 4), 0u);   // 2.0 is the edge
  EXPECT_EQ(quant_code(q.words.data(), 32 + 0, 4), 15u);   // 1.0 the far end
  EXPECT_EQ(bias(2), 0.0f);
  EXPECT_EQ(quant_code(q.words.data(), 64, 4), 0u);
  EXPECT_EQ(bias(3), 0.5f);
  EXPECT_EQ(quant_code(q.words.data(), 96, 4), 0u);
  const std::vector<float> d = q.dequantized();
  EXPECT_EQ(quant_code(q.words.data(), 10, 4), 10u);  // w = 0 falls on a code
  EXPECT_NEAR(d[10], 0.0f, 1e-3f);
  for (int i = 64; i < 96; ++i) EXPECT_EQ(d[i], 0.0f);
  for (int i = 96; i < 128; ++i) EXPECT_EQ(d[i], 0.5f);
}

TEST(QuantAffine, RoundTripErrorIsWithinHalfAStepPlusEdgeSlack) {
  for (int bits : {2, 3, 4, 6, 8})
    for (int gs : {32, 64, 128})
      for (DType dt : {DType::BF16, DType::F16}) {
        const QuantFormat f{bits, gs, dt};
        const int64_t rows = 8, cols = 256;
        const std::vector<float> w = gaussian(size_t(rows * cols), uint32_t(bits * 1000 + gs));
        const Quantized q = quantize(w, rows, cols, f);
        const std::vector<float> d = q.dequantized();
        const double n = double((1 << bits) - 1);
        const double rel = dt == DType::BF16 ? 1.0 / 256 : 1.0 / 2048;  // stored scale rounding
        double sq = 0, sq_w = 0;
        for (int64_t i = 0; i < rows * cols; ++i) {
          const double s = std::abs(scale_to_f32(q.scales[size_t(i / gs)], dt));
          const double b = std::abs(scale_to_f32(q.biases[size_t(i / gs)], dt));
          // Rounding is half a step; MLX moves the step so the edge is exact, which can leave
          // the far end up to one more step out; the stored scale and bias are rounded.
          const double bound = 1.5 * s + n * s * rel + b * rel + 1e-6;
          const double e = std::abs(double(d[size_t(i)]) - double(w[size_t(i)]));
          ASSERT_LE(e, bound) << quant_format_name(f) << " element " << i;
          sq += e * e;
          sq_w += double(w[size_t(i)]) * w[size_t(i)];
        }
        // Gaussian data: about one step in 4.5 sigma of range per group of 64.
        const double expected = 4.5 / n / std::sqrt(12.0);
        EXPECT_LT(std::sqrt(sq / sq_w), 1.6 * expected + 0.004) << quant_format_name(f);
      }
}

TEST(QuantAffine, ClipSearchIsNeverWorseThanRoundToNearest) {
  for (int bits : {2, 3, 4}) {
    const QuantFormat f{bits, 64, DType::BF16};
    const int64_t rows = 16, cols = 512;
    std::vector<float> w = gaussian(size_t(rows * cols), 99u + uint32_t(bits));
    for (size_t i = 0; i < w.size(); i += 97) w[i] *= 6.0f;  // outliers
    const std::vector<float> plain = quantize(w, rows, cols, f).dequantized();
    const std::vector<float> clip = quantize(w, rows, cols, f, true).dequantized();
    int better = 0;
    for (int64_t g = 0; g < rows * cols / 64; ++g) {
      double e_plain = 0, e_clip = 0;
      for (int64_t i = g * 64; i < g * 64 + 64; ++i) {
        e_plain += std::pow(double(plain[size_t(i)]) - w[size_t(i)], 2);
        e_clip += std::pow(double(clip[size_t(i)]) - w[size_t(i)], 2);
      }
      ASSERT_LE(e_clip, e_plain) << "bits " << bits << " group " << g;
      better += e_clip < e_plain;
    }
    if (bits == 2) {
      EXPECT_GT(better, rows * cols / 64 / 4);
    }
  }
}

// ---- kernels --------------------------------------------------------------------------------

// Sets a kernel level for the life of the object.
class LevelScope {
 public:
  explicit LevelScope(KernelLevel level) : saved_(cpu::kernel_level()) {
    cpu::set_kernel_level(level);
  }
  ~LevelScope() { cpu::set_kernel_level(saved_); }

 private:
  KernelLevel saved_;
};

std::vector<float> run(const Matrix& w, const std::vector<float>& x, int64_t T, bool precise,
                       KernelLevel level) {
  LevelScope scope(level);
  cpu::PreparedInput in;
  cpu::prepare_input(w, x.data(), T, precise, in);
  std::vector<float> y(size_t(T * w.rows), std::nanf(""));
  // Two uneven row ranges, as the backend's thread pool would split them.
  const int64_t mid = w.rows / 3;
  cpu::matmul_rows(w, in, y.data(), w.rows, 0, mid);
  cpu::matmul_rows(w, in, y.data(), w.rows, mid, w.rows);
  return y;
}

// The int8 activations x^ the default path uses in place of x, as floats.
std::vector<float> int8_activations(const Matrix& w, const std::vector<float>& x, int64_t T) {
  LevelScope scope(KernelLevel::Scalar);  // natural element order
  cpu::PreparedInput in;
  cpu::prepare_input(w, x.data(), T, false, in);
  std::vector<float> xq(x.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < w.cols; ++i)
      xq[size_t(t * w.cols + i)] = float(in.q[size_t(t * in.stride + i)]) *
                                   in.q_scale[size_t(t * in.stride / 4 + i / 32 * 8)];
  return xq;
}

// float64 y = x W^T for W (rows, cols) given as floats.
std::vector<double> reference(const std::vector<float>& w, int64_t rows, int64_t cols,
                              const std::vector<float>& x, int64_t T) {
  std::vector<double> y(size_t(T * rows));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t i = 0; i < cols; ++i) s += double(w[size_t(r * cols + i)]) * x[size_t(t * cols + i)];
      y[size_t(t * rows + r)] = s;
    }
  return y;
}

template <class A, class B>
double relative_error(const std::vector<A>& got, const std::vector<B>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += std::pow(double(got[i]) - double(want[i]), 2);
    den += double(want[i]) * double(want[i]);
  }
  return std::sqrt(num / den);
}

// Error of the int8 path, relative to the size of the terms summed (sum |w_i x^_i| per output):
// the path sums scale * q x^ and bias * x^ separately, so outputs much smaller than their terms
// carry float32 rounding of the terms' size.
struct Int8Check {
  std::vector<double> want, size;  // float64 W x^ and sum |w| |x^| per output
  Int8Check(const std::vector<float>& wd, int64_t rows, int64_t cols, const std::vector<float>& xq,
            int64_t T) {
    std::vector<float> wa(wd.size()), xa(xq.size());
    for (size_t i = 0; i < wd.size(); ++i) wa[i] = std::abs(wd[i]);
    for (size_t i = 0; i < xq.size(); ++i) xa[i] = std::abs(xq[i]);
    want = reference(wd, rows, cols, xq, T);
    size = reference(wa, rows, cols, xa, T);
  }
  template <class V>
  double error(const std::vector<float>& got, const V& other) const {
    double num = 0, den = 0;
    for (size_t i = 0; i < size.size(); ++i) {
      num += std::pow(double(got[i]) - double(other[i]), 2);
      den += size[i] * size[i];
    }
    return std::sqrt(num / den);
  }
  double error(const std::vector<float>& got) const { return error(got, want); }
};

class QuantKernels : public ::testing::TestWithParam<KernelLevel> {
 protected:
  void SetUp() override {
    if (!cpu::kernel_level_supported(GetParam()))
      GTEST_SKIP() << "CPU lacks " << cpu::kernel_level_name(GetParam());
  }
};

// Every format, awkward shapes, T = 1, 2, 5, both activation paths, against float64 products
// with the dequantized weights: precise with x (within 1e-5 relative over the whole output),
// int8 with the int8 activations x^ it uses (within 1e-5 of the terms' size, see Int8Check);
// the SIMD levels also next to the scalar level's results. How far x^ moves the result from x is
// QuantKernels.Int8PathIsWithinOnePercent's subject.
TEST_P(QuantKernels, EveryQuantizedFormatMatchesTheReference) {
  const KernelLevel level = GetParam();
  int checked = 0;
  for (int bits : {2, 3, 4, 6, 8})
    for (int gs : {32, 64, 128})
      for (DType dt : {DType::BF16, DType::F16})
        for (int64_t rows : {1, 3, 7, 33})
          for (int64_t cols : {int64_t(gs), int64_t(3 * gs), gs == 32 ? int64_t(32 * 67) : 2 * gs}) {
            const QuantFormat f{bits, gs, dt};
            const uint32_t seed = uint32_t(bits * 7919 + gs * 31 + rows * 7 + cols);
            const std::vector<float> w = gaussian(size_t(rows * cols), seed, 0.05f);
            const Quantized q = quantize(w, rows, cols, f);
            const Matrix m = q.matrix();
            const std::vector<float> wd = q.dequantized();
            for (int64_t T : {1, 2, 5}) {
              const std::vector<float> x = gaussian(size_t(T * cols), seed + uint32_t(T));
              SCOPED_TRACE(quant_format_name(f) + " rows " + std::to_string(rows) + " cols " +
                           std::to_string(cols) + " T " + std::to_string(T));
              const auto precise = run(m, x, T, true, level);
              EXPECT_LE(relative_error(precise, reference(wd, rows, cols, x, T)), 1e-5);
              const auto int8 = run(m, x, T, false, level);
              const Int8Check check(wd, rows, cols, int8_activations(m, x, T), T);
              EXPECT_LE(check.error(int8), 1e-5);
              if (level != KernelLevel::Scalar) {  // and next to the scalar reference
                EXPECT_LE(relative_error(precise, run(m, x, T, true, KernelLevel::Scalar)), 1e-5);
                EXPECT_LE(check.error(int8, run(m, x, T, false, KernelLevel::Scalar)), 1e-5);
              }
              ++checked;
            }
          }
  EXPECT_EQ(checked, 5 * 3 * 2 * 4 * 3 * 3);
}

// The int8 path against float64 with the true activations, on an expert-sized matrix.
TEST_P(QuantKernels, Int8PathIsWithinOnePercent) {
  for (int bits : {2, 3, 4, 6, 8})
    for (int gs : {32, 64, 128}) {
      const QuantFormat f{bits, gs, DType::BF16};
      const int64_t rows = 96, cols = 2048, T = 3;
      const Quantized q = quantize(gaussian(size_t(rows * cols), uint32_t(bits + gs), 0.02f),
                                   rows, cols, f);
      const std::vector<float> x = gaussian(size_t(T * cols), 11);
      const double err = relative_error(run(q.matrix(), x, T, false, GetParam()),
                                        reference(q.dequantized(), rows, cols, x, T));
      EXPECT_LE(err, 1e-2) << quant_format_name(f);
    }
}

TEST_P(QuantKernels, PlainFormatsMatchTheReference) {
  const KernelLevel level = GetParam();
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (int64_t rows : {1, 3, 7, 33})
      for (int64_t cols : {1, 7, 32, 45, 256, 1000})
        for (int64_t T : {1, 2, 5}) {
          SCOPED_TRACE(std::string(dtype_name(dt)) + " rows " + std::to_string(rows) + " cols " +
                       std::to_string(cols) + " T " + std::to_string(T));
          const std::vector<float> w32 = gaussian(size_t(rows * cols), uint32_t(rows * cols), 0.1f);
          std::vector<uint16_t> half(w32.size());
          std::vector<float> wd(w32.size());
          for (size_t i = 0; i < w32.size(); ++i) {
            half[i] = dt == DType::F16 ? f32_to_f16(w32[i]) : f32_to_bf16(w32[i]);
            wd[i] = dt == DType::F32 ? w32[i] : dt == DType::F16 ? f16_to_f32(half[i])
                                                                  : bf16_to_f32(half[i]);
          }
          Matrix m;
          m.name = "plain";
          m.dtype = dt;
          m.data = dt == DType::F32 ? static_cast<const void*>(w32.data()) : half.data();
          m.rows = rows;
          m.cols = cols;
          const std::vector<float> x = gaussian(size_t(T * cols), uint32_t(T + cols));
          const auto want = reference(wd, rows, cols, x, T);
          EXPECT_LE(relative_error(run(m, x, T, true, level), want), 1e-5);
          EXPECT_LE(relative_error(run(m, x, T, false, level), want), 1e-5);
        }
}

TEST_P(QuantKernels, LongRowsAndVectorHelpers) {
  LevelScope scope(GetParam());
  // 4096 columns: many batches of groups per row.
  const QuantFormat f{4, 32, DType::BF16};
  const std::vector<float> w = gaussian(size_t(5 * 4096), 5, 0.02f);
  const Quantized q = quantize(w, 5, 4096, f);
  const std::vector<float> x = gaussian(4096, 6);
  const auto want = reference(q.dequantized(), 5, 4096, x, 1);
  EXPECT_LE(relative_error(run(q.matrix(), x, 1, true, GetParam()), want), 1e-5);
  const Int8Check check(q.dequantized(), 5, 4096, int8_activations(q.matrix(), x, 1), 1);
  EXPECT_LE(check.error(run(q.matrix(), x, 1, false, GetParam())), 1e-5);
  // dot_row and row_to_f32 on quantized rows.
  std::vector<float> row(4096);
  cpu::row_to_f32(q.matrix(), 3, row.data());
  const std::vector<float> wd = q.dequantized();
  for (int i = 0; i < 4096; ++i) ASSERT_EQ(row[size_t(i)], wd[size_t(3 * 4096 + i)]);
  EXPECT_NEAR(cpu::dot_row(q.matrix(), 3, x.data()), want[3], 1e-5 * std::abs(want[3]) + 1e-5);
  // dot_f32 and axpy at odd lengths.
  for (int64_t n : {0, 1, 15, 16, 17, 100, 1031}) {
    const std::vector<float> a = gaussian(size_t(n), 1), b = gaussian(size_t(n), 2);
    double d = 0;
    for (int64_t i = 0; i < n; ++i) d += double(a[size_t(i)]) * b[size_t(i)];
    EXPECT_NEAR(cpu::dot_f32(a.data(), b.data(), n), d, 1e-5 * (1 + std::abs(d)));
    std::vector<float> y = b;
    cpu::axpy(0.5f, a.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(y[size_t(i)], b[size_t(i)] + 0.5f * a[size_t(i)]);
  }
}

TEST_P(QuantKernels, NonFiniteActivationsGiveNaNNotGarbage) {
  const QuantFormat f{4, 64, DType::BF16};
  const Quantized q = quantize(gaussian(2 * 128, 3), 2, 128, f);
  std::vector<float> x = gaussian(128, 4);
  x[70] = std::numeric_limits<float>::infinity();
  for (float v : run(q.matrix(), x, 1, false, GetParam())) EXPECT_TRUE(std::isnan(v));
}

INSTANTIATE_TEST_SUITE_P(QuantLevels, QuantKernels,
                         ::testing::Values(KernelLevel::Scalar, KernelLevel::Avx2,
                                           KernelLevel::Avx512),
                         [](const auto& info) {
                           return std::string(cpu::kernel_level_name(info.param));
                         });

TEST(QuantKernelErrors, BadMatricesAreNamed) {
  std::vector<uint32_t> words(64);
  std::vector<uint16_t> sb(4);
  Matrix m;
  m.name = "blk.3.up";
  m.dtype = DType::U32;
  m.data = words.data();
  m.rows = 2;
  m.cols = 128;
  m.quant = {5, 64, DType::BF16};
  m.scales = m.biases = sb.data();
  std::vector<float> x(128);
  cpu::PreparedInput in;
  for (int variant = 0; variant < 3; ++variant) {
    Matrix bad = m;
    if (variant == 1) bad.quant = {4, 64, DType::BF16}, bad.scales = nullptr;
    if (variant == 2) bad.quant = {4, 64, DType::BF16}, bad.dtype = DType::BF16;
    SCOPED_TRACE("variant " + std::to_string(variant));
    test::expect_contains(test::error_of([&] { cpu::prepare_input(bad, x.data(), 1, false, in); }), {"blk.3.up"});
  }
  Matrix i8 = m;
  i8.quant = {};
  i8.dtype = DType::I8;
  EXPECT_THROW(cpu::prepare_input(i8, x.data(), 1, true, in), Error);
}

TEST(QuantKernelLevels, BestIsSupportedAndUnsupportedLevelsAreRefused) {
  EXPECT_TRUE(cpu::kernel_level_supported(cpu::best_kernel_level()));
  EXPECT_TRUE(cpu::kernel_level_supported(KernelLevel::Scalar));
  for (KernelLevel l : {KernelLevel::Avx2, KernelLevel::Avx512})
    if (!cpu::kernel_level_supported(l)) {
      EXPECT_THROW(cpu::set_kernel_level(l), Error);
    }
}

}  // namespace
}  // namespace moestream
