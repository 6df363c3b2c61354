// Block-scaled FP8 (DeepSeek-V3 / Kimi-K2's format, core/quant.h): decoding every E4M3 byte as
// torch.float8_e4m3fn does, the format checks, and the CPU kernels at every SIMD level, on one
// and several tokens, against a float64 product with the dequantized weights.
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

TEST(Fp8Format, DecodesEveryE4M3Byte) {
  // E4M3 "fn": bias 7, no infinities, 0x7f / 0xff NaN, largest finite 448 (0x7e).
  EXPECT_EQ(fp8_e4m3_to_f32(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(fp8_e4m3_to_f32(0x80)));
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);       // exponent 7, mantissa 0
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xff)));
  // Monotonic over the positive codes, odd in the sign bit.
  for (int c = 1; c < 0x7f; ++c) {
    EXPECT_GT(fp8_e4m3_to_f32(uint8_t(c)), fp8_e4m3_to_f32(uint8_t(c - 1))) << c;
    EXPECT_EQ(fp8_e4m3_to_f32(uint8_t(c | 0x80)), -fp8_e4m3_to_f32(uint8_t(c))) << c;
  }
}

TEST(Fp8Format, GroupsMayEndPartway) {
  const QuantFormat f = fp8_format(128);
  EXPECT_EQ(quant_format_name(f), "fp8g128");
  EXPECT_NO_THROW(check_quant_shape(f, 48, "w"));  // cols need not be a multiple of anything
  EXPECT_EQ(quant_groups_per_row(f, 48), 1);
  EXPECT_EQ(quant_groups_per_row(f, 300), 3);
  EXPECT_THROW(check_quant_format(fp8_format(48), "w"), Error);  // groups are whole 32-blocks
  QuantFormat bf16_scales = f;
  bf16_scales.scale_dtype = DType::BF16;
  EXPECT_THROW(check_quant_format(bf16_scales, "w"), Error);
}

struct Fp8Matrix {
  int64_t rows, cols;
  int group;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  Matrix matrix() const {
    Matrix m{"fp8", DType::F8_E4M3, codes.data(), rows, cols};
    m.quant = fp8_format(group);
    m.scales = scales.data();
    return m;
  }
};

// Random codes over every finite byte (subnormals and both signs included) and scales of very
// different magnitudes.
Fp8Matrix random_fp8(int64_t rows, int64_t cols, int group, uint32_t seed) {
  std::mt19937 rng(seed);
  Fp8Matrix m{rows, cols, group, std::vector<uint8_t>(size_t(rows * cols)),
              std::vector<float>(size_t(rows * quant_groups_per_row(fp8_format(group), cols)))};
  for (auto& c : m.codes) {
    do c = uint8_t(rng()); while ((c & 0x7f) == 0x7f);
  }
  std::uniform_real_distribution<float> u(-8.0f, 2.0f);
  for (auto& s : m.scales) s = std::exp2(u(rng));
  return m;
}

using test::gaussian;

TEST(Fp8Kernels, RowsDequantizeToCodeTimesScale) {
  const Fp8Matrix m = random_fp8(3, 300, 128, 5);
  const Matrix w = m.matrix();
  const int64_t groups = quant_groups_per_row(w.quant, w.cols);
  std::vector<float> row(size_t(m.cols));
  for (KernelLevel level : test::supported_levels()) {
    cpu::set_kernel_level(level);
    for (int64_t r = 0; r < m.rows; ++r) {
      cpu::row_to_f32(w, r, row.data());
      for (int64_t c = 0; c < m.cols; ++c)
        ASSERT_EQ(row[size_t(c)], fp8_e4m3_to_f32(m.codes[size_t(r * m.cols + c)]) * m.scales[size_t(r * groups + c / 128)])
            << cpu::kernel_level_name(level) << " row " << r << " col " << c;
    }
  }
  cpu::set_kernel_level(cpu::best_kernel_level());
}

TEST(Fp8Kernels, EveryLevelMatchesTheDequantizedProduct) {
  // Columns: under one vector, a partial last group, not a multiple of 8 or 16, DeepSeek's 7168;
  // one token (streamed rows) and several (rows converted once).
  for (int64_t cols : {5, 48, 200, 300, 7168})
    for (int64_t T : {1, 3}) {
      const int64_t rows = 19;
      const Fp8Matrix m = random_fp8(rows, cols, 128, uint32_t(cols * 3 + T));
      const Matrix w = m.matrix();
      const std::vector<float> x = gaussian(size_t(T * cols), uint32_t(cols + T));
      std::vector<double> ref(size_t(T * rows));
      std::vector<float> d(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        dequantize_fp8_row(cols, 128, m.codes.data() + r * cols,
                           m.scales.data() + r * quant_groups_per_row(w.quant, cols), d.data());
        for (int64_t t = 0; t < T; ++t) {
          double s = 0;
          for (int64_t i = 0; i < cols; ++i) s += double(d[size_t(i)]) * x[size_t(t * cols + i)];
          ref[size_t(t * rows + r)] = s;
        }
      }
      double scale = 0;
      for (double v : ref) scale = std::max(scale, std::abs(v));
      for (KernelLevel level : test::supported_levels())
        for (bool precise : {true, false}) {  // FP8 takes float32 activations on both paths
          cpu::set_kernel_level(level);
          cpu::PreparedInput in;
          cpu::prepare_input(w, x.data(), T, precise, in);
          std::vector<float> y(size_t(T * rows), std::nanf(""));
          cpu::matmul_rows(w, in, y.data(), rows, 0, rows);
          double err = 0;
          for (size_t i = 0; i < y.size(); ++i) err = std::max(err, std::abs(double(y[i]) - ref[i]));
          EXPECT_LT(err / scale, 2e-6) << cpu::kernel_level_name(level) << " cols " << cols << " T " << T;
        }
      cpu::set_kernel_level(cpu::best_kernel_level());
    }
}

}  // namespace
}  // namespace moestream
