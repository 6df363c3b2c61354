// MXFP4 (gpt-oss's expert format, core/quant.h): decoding as transformers' integrations/mxfp4.py
// does, quantizing, and the CPU kernels at every SIMD level and on both activation paths against
// a float64 product with the dequantized weights.
#include <gtest/gtest.h>

#include <cmath>
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

TEST(Mxfp4Format, IsOneFixedFormat) {
  EXPECT_NO_THROW(check_quant_shape(kMxfp4Format, 96, "w"));
  EXPECT_EQ(quant_format_name(kMxfp4Format), "mxfp4");
  QuantFormat f = kMxfp4Format;
  f.group_size = 64;
  EXPECT_THROW(check_quant_format(f, "w"), Error);
  f = kMxfp4Format;
  f.scale_dtype = DType::BF16;
  EXPECT_THROW(check_quant_format(f, "w"), Error);
  test::expect_contains(test::error_of([] { check_quant_shape(kMxfp4Format, 48, "model.layers.0.mlp.experts.down_proj"); }),
                        {"model.layers.0.mlp.experts.down_proj"});
}

// transformers' FP4_VALUES, indexed by the 4-bit code; the block's value is
// ldexp(FP4_VALUES[code], scale - 127), low nibble first.
constexpr float kTransformersFp4[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

TEST(Mxfp4Layout, DecodesLikeTransformers) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(fp4_value(uint8_t(c)), kTransformersFp4[c]) << c;
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
  // One row of two groups: byte j holds elements 2j (low nibble) and 2j + 1 (high nibble).
  std::vector<uint8_t> codes(32);
  for (int j = 0; j < 32; ++j) codes[size_t(j)] = uint8_t((j * 7 + 3) % 256);
  const uint8_t exps[2] = {126, 131};
  std::vector<float> out(64);
  dequantize_mxfp4_row(64, codes.data(), exps, out.data());
  for (int i = 0; i < 64; ++i) {
    const uint8_t byte = codes[size_t(i / 2)];
    const int code = i % 2 ? byte >> 4 : byte & 15;
    EXPECT_EQ(out[size_t(i)], std::ldexp(kTransformersFp4[code], exps[i / 32] - 127)) << i;
  }
}

TEST(Mxfp4Layout, AffineViewIsExact) {
  // The kernels' view: code' * scale' + bias' with one fma equals fp4 * 2^(e - 127) exactly.
  for (int e : {0, 1, 2, 100, 127, 128, 200, 252})
    for (int c = 0; c < 16; ++c) {
      const float s = mxfp4_affine_scales()[size_t(e)];
      const float v = std::fma(float(kMxfp4AffineCode[size_t(c)]), s, -kMxfp4AffineBiasCodes * s);
      EXPECT_EQ(v, fp4_value(uint8_t(c)) * e8m0_to_f32(uint8_t(e))) << "e " << e << " code " << c;
    }
}

using test::gaussian;

struct Mx {
  int64_t rows, cols;
  std::vector<uint8_t> codes, exps;
  Matrix matrix() const {
    Matrix m{"mx", DType::U8, codes.data(), rows, cols};
    m.quant = kMxfp4Format;
    m.scales = exps.data();
    return m;
  }
  std::vector<float> dequantized() const {
    std::vector<float> out(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      dequantize_mxfp4_row(cols, codes.data() + r * cols / 2, exps.data() + r * cols / 32, out.data() + r * cols);
    return out;
  }
};

Mx quantized(int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<float> w = gaussian(size_t(rows * cols), seed);
  // Groups of very different magnitudes, as real expert weights have.
  for (int64_t i = 0; i < rows * cols; ++i) w[size_t(i)] *= std::ldexp(1.0f, int(i / 32 % 7) - 4);
  Mx m{rows, cols, std::vector<uint8_t>(size_t(rows * cols / 2)), std::vector<uint8_t>(size_t(rows * cols / 32))};
  quantize_mxfp4(w.data(), rows, cols, m.codes.data(), m.exps.data(), "test");
  return m;
}

TEST(Mxfp4Quantize, RoundsToTheNearestValueWithoutClipping) {
  const int64_t rows = 5, cols = 96;
  std::vector<float> w = gaussian(size_t(rows * cols), 11);
  w[3] = 0.0f;
  Mx m{rows, cols, std::vector<uint8_t>(size_t(rows * cols / 2)), std::vector<uint8_t>(size_t(rows * cols / 32))};
  quantize_mxfp4(w.data(), rows, cols, m.codes.data(), m.exps.data(), "test");
  const std::vector<float> d = m.dequantized();
  EXPECT_EQ(d[3], 0.0f);
  EXPECT_FALSE(std::signbit(d[3]));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < cols / 32; ++g) {
      const float s = e8m0_to_f32(m.exps[size_t(r * cols / 32 + g)]);
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(w[size_t(r * cols + g * 32 + i)]));
      EXPECT_LE(amax, 6.0f * s);        // no clipping
      EXPECT_GT(amax, 6.0f * s / 2.0f);  // and the smallest such exponent
      for (int i = 0; i < 32; ++i) {
        const size_t k = size_t(r * cols + g * 32 + i);
        // The gap between neighbouring E2M1 magnitudes is at most 2 * s (between 4 and 6).
        const float a = std::abs(w[k]) / s;
        const float step = a < 2 ? 0.5f : a < 4 ? 1.0f : 2.0f;
        EXPECT_LE(std::abs(d[k] - w[k]), step * s / 2 * (1 + 1e-6f)) << k;
      }
    }
  // Values already on the grid come back exactly.
  Mx m2{rows, cols, std::vector<uint8_t>(size_t(rows * cols / 2)), std::vector<uint8_t>(size_t(rows * cols / 32))};
  quantize_mxfp4(d.data(), rows, cols, m2.codes.data(), m2.exps.data(), "test");
  EXPECT_EQ(m2.dequantized(), d);
  std::vector<float> bad(32, 1.0f);
  bad[7] = std::nanf("");
  uint8_t c[16], e[1];
  EXPECT_THROW(quantize_mxfp4(bad.data(), 1, 32, c, e, "w"), Error);
}

// y (T, rows) with the given level and path, and the float64 product with the dequantized weights.
std::vector<float> run(const Mx& m, const std::vector<float>& x, int64_t T, KernelLevel level, bool precise) {
  cpu::set_kernel_level(level);
  const Matrix w = m.matrix();
  cpu::PreparedInput in;
  cpu::prepare_input(w, x.data(), T, precise, in);
  std::vector<float> y(size_t(T * m.rows));
  cpu::matmul_rows(w, in, y.data(), m.rows, 0, m.rows);
  cpu::set_kernel_level(cpu::best_kernel_level());
  return y;
}

std::vector<double> reference(const Mx& m, const std::vector<float>& x, int64_t T) {
  const std::vector<float> d = m.dequantized();
  std::vector<double> y(size_t(T * m.rows));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < m.rows; ++r) {
      double s = 0;
      for (int64_t i = 0; i < m.cols; ++i) s += double(d[size_t(r * m.cols + i)]) * x[size_t(t * m.cols + i)];
      y[size_t(t * m.rows + r)] = s;
    }
  return y;
}

// max |y - ref| / max |ref|
double rel_error(const std::vector<float>& y, const std::vector<double>& ref) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    err = std::max(err, std::abs(double(y[i]) - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return err / scale;
}

TEST(Mxfp4Kernels, EveryLevelAndPathMatchesTheDequantizedProduct) {
  // 96 columns: an odd number of 32-blocks (AVX-512's half chunk); 2880 as in gpt-oss; one and
  // several tokens (the single-token and the unpack-once paths).
  for (int64_t cols : {96, 256, 2880})
    for (int64_t T : {1, 3}) {
      const Mx m = quantized(37, cols, uint32_t(cols + T));
      const std::vector<float> x = gaussian(size_t(T * cols), uint32_t(7 * cols + T));
      const std::vector<double> ref = reference(m, x, T);
      const std::vector<float> scalar = run(m, x, T, KernelLevel::Scalar, true);
      for (KernelLevel level : test::supported_levels()) {
        const std::string what = std::string(cpu::kernel_level_name(level)) + " cols " +
                                 std::to_string(cols) + " T " + std::to_string(T);
        const std::vector<float> precise = run(m, x, T, level, true);
        EXPECT_LT(rel_error(precise, ref), 2e-6) << what;
        std::vector<double> scalar_d(scalar.begin(), scalar.end());
        EXPECT_LT(rel_error(precise, scalar_d), 2e-6) << what;
        // int8 activations: the only approximation is x^ in place of x (about 0.5%).
        EXPECT_LT(rel_error(run(m, x, T, level, false), ref), 1.5e-2) << what;
      }
    }
}

TEST(Mxfp4Kernels, EveryExponentUpToTheLimit) {
  // One exponent per row, from the subnormal scales (e < 2) to kMxfp4MaxExponent, random codes;
  // the activations scaled so that the products stay within float32 (2^-64 for the large ones).
  struct Case {
    std::vector<int> exps;
    float x_scale;
  };
  const std::vector<Case> cases = {{{0, 1, 2, 3, 64, 127, 128, 160}, 1.0f},
                                   {{180, 200, 240, 251, int(kMxfp4MaxExponent)}, std::ldexp(1.0f, -64)}};
  const int64_t cols = 96;
  for (const Case& c : cases) {
    const size_t rows = c.exps.size();
    Mx m{int64_t(rows), cols, std::vector<uint8_t>(rows * cols / 2), std::vector<uint8_t>(rows * cols / 32)};
    std::mt19937 rng(17);
    for (auto& code : m.codes) code = uint8_t(rng());
    for (size_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < cols / 32; ++g) m.exps[r * cols / 32 + size_t(g)] = uint8_t(c.exps[r]);
    std::vector<float> x = gaussian(size_t(cols), 18);
    for (float& v : x) v = (std::abs(v) < 0.25f ? 0.25f : v) * c.x_scale;  // products stay normal
    const std::vector<double> ref = reference(m, x, 1);
    const std::vector<float> d = m.dequantized();
    for (KernelLevel level : test::supported_levels()) {
      const std::vector<float> y = run(m, x, 1, level, true);
      for (size_t r = 0; r < rows; ++r) {
        double scale = 0;
        for (int64_t i = 0; i < cols; ++i) scale += std::abs(double(d[r * cols + size_t(i)]) * x[size_t(i)]);
        EXPECT_LE(std::abs(double(y[r]) - ref[r]), 1e-5 * scale)
            << cpu::kernel_level_name(level) << " exponent " << c.exps[r];
      }
    }
  }
}

TEST(Mxfp4Kernels, Int8LevelsAgreeWithTheScalarLevel) {
  const Mx m = quantized(19, 160, 5);
  const std::vector<float> x = gaussian(2 * 160, 6);
  const std::vector<float> scalar = run(m, x, 2, KernelLevel::Scalar, false);
  const std::vector<double> scalar_d(scalar.begin(), scalar.end());
  for (KernelLevel level : test::supported_levels())
    EXPECT_LT(rel_error(run(m, x, 2, level, false), scalar_d), 1e-5) << cpu::kernel_level_name(level);
}

TEST(Mxfp4Kernels, RowToFloatIsTheExactDequantization) {
  const Mx m = quantized(3, 64, 9);
  const std::vector<float> d = m.dequantized();
  std::vector<float> row(64);
  for (int64_t r = 0; r < 3; ++r) {
    cpu::row_to_f32(m.matrix(), r, row.data());
    EXPECT_EQ(row, std::vector<float>(d.begin() + r * 64, d.begin() + (r + 1) * 64));
  }
}

TEST(Mxfp4Kernels, WrongStorageIsNamed) {
  const Mx m = quantized(2, 64, 3);
  Matrix w = m.matrix();
  w.name = "model.layers.3.mlp.experts.gate_up_proj";
  w.dtype = DType::U32;
  cpu::PreparedInput in;
  std::vector<float> x(64, 1.0f);
  test::expect_contains(test::error_of([&] { cpu::prepare_input(w, x.data(), 1, true, in); }),
                        {"model.layers.3.mlp.experts.gate_up_proj"});
  w = m.matrix();
  w.scales = nullptr;
  EXPECT_THROW(cpu::prepare_input(w, x.data(), 1, true, in), Error);
}

}  // namespace
}  // namespace moestream
