// The CPU kernels' several-token path (backend/cpu/gemm.h: rows converted to float in panels,
// an outer-product micro-kernel over blocks of tokens) at shapes that leave partial panels,
// partial token blocks and column tails, for every weight format and SIMD level.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "core/dtype.h"
#include "core/quant.h"
#include "test_util.h"

namespace moestream {
namespace {

using cpu::KernelLevel;
using test::gaussian;

// A weight matrix in one stored format, with the storage behind its Matrix.
struct Weights {
  std::string what;
  std::vector<uint32_t> words;
  std::vector<uint8_t> bytes, exponents;
  std::vector<uint16_t> halves, scales, biases;
  std::vector<float> f32, fscales;
  Matrix m;
  bool quantized() const { return m.quant.bits > 0 && m.quant.scheme != QuantScheme::Fp8; }
  // Row r as floats, by the format's reference conversion.
  std::vector<float> dequantized() const {
    std::vector<float> out(size_t(m.rows * m.cols));
    const KernelLevel saved = cpu::kernel_level();
    cpu::set_kernel_level(KernelLevel::Scalar);
    for (int64_t r = 0; r < m.rows; ++r) cpu::row_to_f32(m, r, out.data() + r * m.cols);
    cpu::set_kernel_level(saved);
    return out;
  }
};

std::unique_ptr<Weights> affine(int bits, int gs, DType dt, int64_t rows, int64_t cols, uint32_t seed) {
  auto w = std::make_unique<Weights>();
  const QuantFormat f{bits, gs, dt};
  w->what = quant_format_name(f);
  const std::vector<float> v = gaussian(size_t(rows * cols), seed, 0.05f);
  w->words.resize(size_t(rows * quant_words_per_row(f, cols)));
  w->scales.resize(size_t(rows * quant_groups_per_row(f, cols)));
  w->biases.resize(w->scales.size());
  quantize_affine(v.data(), rows, cols, f, w->words.data(), w->scales.data(), w->biases.data());
  w->m = Matrix{"w", DType::U32, w->words.data(), rows, cols};
  w->m.quant = f;
  w->m.scales = w->scales.data();
  w->m.biases = w->biases.data();
  return w;
}

std::unique_ptr<Weights> mxfp4(int64_t rows, int64_t cols, uint32_t seed) {
  auto w = std::make_unique<Weights>();
  w->what = "mxfp4";
  std::vector<float> v = gaussian(size_t(rows * cols), seed);
  for (int64_t i = 0; i < rows * cols; ++i) v[size_t(i)] *= std::ldexp(1.0f, int(i / 32 % 7) - 4);
  w->bytes.resize(size_t(rows * cols / 2));
  w->exponents.resize(size_t(rows * cols / 32));
  quantize_mxfp4(v.data(), rows, cols, w->bytes.data(), w->exponents.data(), "w");
  w->m = Matrix{"w", DType::U8, w->bytes.data(), rows, cols};
  w->m.quant = kMxfp4Format;
  w->m.scales = w->exponents.data();
  return w;
}

std::unique_ptr<Weights> fp8(int64_t rows, int64_t cols, int group, uint32_t seed) {
  auto w = std::make_unique<Weights>();
  w->what = "fp8 group " + std::to_string(group);
  std::mt19937 rng(seed);
  w->bytes.resize(size_t(rows * cols));
  for (auto& c : w->bytes) {
    do c = uint8_t(rng()); while ((c & 0x7f) == 0x7f);  // every finite code
  }
  const QuantFormat f = fp8_format(group);
  std::uniform_real_distribution<float> u(-8.0f, 2.0f);
  w->fscales.resize(size_t(rows * quant_groups_per_row(f, cols)));
  for (auto& s : w->fscales) s = std::exp2(u(rng));
  w->m = Matrix{"w", DType::F8_E4M3, w->bytes.data(), rows, cols};
  w->m.quant = f;
  w->m.scales = w->fscales.data();
  return w;
}

std::unique_ptr<Weights> plain(DType dt, int64_t rows, int64_t cols, uint32_t seed) {
  auto w = std::make_unique<Weights>();
  w->what = std::string(dtype_name(dt));
  w->f32 = gaussian(size_t(rows * cols), seed, 0.1f);
  w->halves.resize(w->f32.size());
  for (size_t i = 0; i < w->f32.size(); ++i)
    w->halves[i] = dt == DType::F16 ? f32_to_f16(w->f32[i]) : f32_to_bf16(w->f32[i]);
  w->m = Matrix{"w", dt, dt == DType::F32 ? static_cast<const void*>(w->f32.data()) : w->halves.data(),
                rows, cols};
  return w;
}

// Every format at `rows` rows, with column counts that end in partial vectors or chunks.
std::vector<std::unique_ptr<Weights>> every_format(int64_t rows) {
  std::vector<std::unique_ptr<Weights>> out;
  uint32_t seed = uint32_t(rows);
  for (int bits : {2, 3, 4, 6, 8})
    for (int gs : {32, 64, 128}) {
      // 32 x 3: an odd number of 32-blocks (AVX-512's half chunk); otherwise 3 groups.
      const int64_t cols = gs == 32 ? 96 : 3 * gs;
      out.push_back(affine(bits, gs, gs == 64 ? DType::F16 : DType::BF16, rows, cols, ++seed));
    }
  out.push_back(mxfp4(rows, 160, ++seed));
  out.push_back(fp8(rows, 200, 128, ++seed));  // a partial last group, not a multiple of 16
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (int64_t cols : {7, 45, 130}) out.push_back(plain(dt, rows, cols, ++seed));
  return out;
}

// y (T, rows) at one level and path, rows computed as three uneven ranges (as the thread pool
// splits them, so panels start at odd rows).
std::vector<float> run(const Matrix& w, const std::vector<float>& x, int64_t T, bool precise,
                       KernelLevel level) {
  const KernelLevel saved = cpu::kernel_level();
  cpu::set_kernel_level(level);
  cpu::PreparedInput in;
  cpu::prepare_input(w, x.data(), T, precise, in);
  std::vector<float> y(size_t(T * w.rows), std::nanf(""));
  const int64_t a = w.rows / 3, b = a + (w.rows - a) / 2 + 1;
  cpu::matmul_rows(w, in, y.data(), w.rows, 0, a);
  cpu::matmul_rows(w, in, y.data(), w.rows, a, std::min(b, w.rows));
  cpu::matmul_rows(w, in, y.data(), w.rows, std::min(b, w.rows), w.rows);
  cpu::set_kernel_level(saved);
  return y;
}

// Activations that are unit vectors read back each weight: a product with one non-zero term
// is exact, so every level's several-token path must return the dequantized weights bit for bit.
TEST(CpuGemm, UnitActivationsReadBackEveryWeightExactly) {
  for (int64_t rows : {1, 17, 47, 70})
    for (const auto& w : every_format(rows)) {
      const std::vector<float> wd = w->dequantized();
      const int64_t cols = w->m.cols;
      for (KernelLevel level : test::supported_levels())
        for (int64_t k0 = 0; k0 < cols; k0 += 13) {  // columns k0 .. k0 + 12, one per token
          const int64_t T = std::min<int64_t>(13, cols - k0);
          std::vector<float> x(size_t(T * cols), 0.0f);
          for (int64_t t = 0; t < T; ++t) x[size_t(t * cols + k0 + t)] = 1.0f;
          const std::vector<float> y = run(w->m, x, T, true, level);
          for (int64_t t = 0; t < T; ++t)
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_EQ(y[size_t(t * rows + r)], wd[size_t(r * cols + k0 + t)])
                  << w->what << " " << cpu::kernel_level_name(level) << " rows " << rows << " cols "
                  << cols << " row " << r << " column " << k0 + t;
        }
    }
}

// Every token count 1 .. 13 (full and partial token blocks) and row counts around the panel
// sizes, against float64 products output by output: within 1e-5 of the size of the terms
// summed (sum |w| |x|). The int8 path (quantized formats) is held to its scalar level's results.
TEST(CpuGemm, EveryTokenCountAndRowCountMatchesTheReference) {
  for (int64_t rows : {1, 15, 17, 33, 47, 70})
    for (const auto& w : every_format(rows)) {
      const std::vector<float> wd = w->dequantized();
      const int64_t cols = w->m.cols;
      for (int64_t T = 1; T <= 13; ++T) {
        const std::vector<float> x = gaussian(size_t(T * cols), uint32_t(T * 131 + rows));
        std::vector<double> want(size_t(T * rows)), size(want.size());
        for (int64_t t = 0; t < T; ++t)
          for (int64_t r = 0; r < rows; ++r) {
            double s = 0, a = 0;
            for (int64_t i = 0; i < cols; ++i) {
              const double p = double(wd[size_t(r * cols + i)]) * x[size_t(t * cols + i)];
              s += p;
              a += std::abs(p);
            }
            want[size_t(t * rows + r)] = s;
            size[size_t(t * rows + r)] = a;
          }
        std::vector<float> int8_scalar;
        if (w->quantized()) int8_scalar = run(w->m, x, T, false, KernelLevel::Scalar);
        for (KernelLevel level : test::supported_levels()) {
          const std::vector<float> y = run(w->m, x, T, true, level);
          std::vector<float> y8;
          if (w->quantized() && level != KernelLevel::Scalar) y8 = run(w->m, x, T, false, level);
          for (size_t i = 0; i < want.size(); ++i) {
            ASSERT_LE(std::abs(y[i] - want[i]), 1e-5 * size[i])
                << w->what << " " << cpu::kernel_level_name(level) << " rows " << rows << " T " << T
                << " output " << i;
            if (!y8.empty()) {
              ASSERT_LE(std::abs(y8[i] - int8_scalar[i]), 1e-5 * size[i] + 1e-6)
                  << w->what << " int8 " << cpu::kernel_level_name(level) << " rows " << rows
                  << " T " << T << " output " << i;
            }
          }
        }
      }
    }
}

// One token: a level may compute several rows together (AVX-512: 2- and 4-bit rows four at a
// time, sharing the activations' loads). Each row's value must not depend on which rows it was
// computed with: every range of rows gives the bits of each of its rows computed alone.
TEST(CpuGemm, OneTokenRowsTogetherEqualRowsAlone) {
  for (int64_t rows : {1, 3, 4, 5, 9, 70})
    for (const auto& w : every_format(rows)) {
      const int64_t cols = w->m.cols;
      const std::vector<float> x = gaussian(size_t(cols), uint32_t(rows * 7 + cols));
      for (KernelLevel level : test::supported_levels())
        for (bool precise : {true, false}) {
          const KernelLevel saved = cpu::kernel_level();
          cpu::set_kernel_level(level);
          cpu::PreparedInput in;
          cpu::prepare_input(w->m, x.data(), 1, precise, in);
          std::vector<float> alone(static_cast<size_t>(rows));
          for (int64_t r = 0; r < rows; ++r) cpu::matmul_rows(w->m, in, alone.data(), rows, r, r + 1);
          for (int64_t r0 = 0; r0 < std::min<int64_t>(rows, 6); ++r0) {
            std::vector<float> y(size_t(rows), std::nanf(""));
            cpu::matmul_rows(w->m, in, y.data(), rows, r0, rows);
            for (int64_t r = r0; r < rows; ++r)
              ASSERT_EQ(y[size_t(r)], alone[size_t(r)])
                  << w->what << " " << cpu::kernel_level_name(level) << (precise ? " f32" : " int8")
                  << " rows [" << r0 << ", " << rows << ") row " << r;
          }
          cpu::set_kernel_level(saved);
        }
    }
}

// q, k and v of one format through the CPU backend's linear_shared_input (x prepared once, all
// their rows in one parallel loop) equal three linear() calls bit for bit, the bias included, on
// both activation paths; matrices of different formats go one by one, with the same results.
TEST(CpuGemm, SharedInputEqualsOneLinearPerMatrix) {
  const auto qs = every_format(64), ks = every_format(32), vs = every_format(48);
  std::vector<float> bias = gaussian(48, 9);
  auto floats = [](const Buffer& b) { return std::vector<float>(b.data, b.data + b.rows * b.cols); };
  for (bool precise : {true, false}) {
    auto be = make_cpu_backend(3, precise);
    const Vector bv = be->load_vector(TensorView{"b", DType::F32, {48}, bias.data(), bias.size() * 4});
    for (size_t f = 0; f < qs.size(); ++f)
      for (int64_t T : {1, 5, 40}) {
        // k of the next format when it has the same width: the one-by-one path
        const bool next_same_width = f + 1 < ks.size() && ks[f + 1]->m.cols == qs[f]->m.cols;
        for (const Weights* k : {ks[f].get(), next_same_width ? ks[f + 1].get() : nullptr}) {
          if (!k) continue;
          const int64_t cols = qs[f]->m.cols;
          Buffer x = be->alloc(T, cols);
          const std::vector<float> xv = gaussian(size_t(T * cols), uint32_t(T + f));
          std::copy(xv.begin(), xv.end(), x.data);
          Buffer oq = be->alloc(T, 64), ok = be->alloc(T, 32), ov = be->alloc(T, 48);
          const Matrix* w[3] = {&qs[f]->m, &k->m, &vs[f]->m};
          const Vector* b[3] = {nullptr, nullptr, &bv};
          Buffer* o[3] = {&oq, &ok, &ov};
          be->linear_shared_input(x, w, b, o);
          Buffer lq = be->alloc(T, 64), lk = be->alloc(T, 32), lv = be->alloc(T, 48);
          be->linear(x, qs[f]->m, nullptr, lq);
          be->linear(x, k->m, nullptr, lk);
          be->linear(x, vs[f]->m, &bv, lv);
          const std::string what = qs[f]->what + " / " + k->what + " T=" + std::to_string(T);
          EXPECT_EQ(floats(oq), floats(lq)) << what;
          EXPECT_EQ(floats(ok), floats(lk)) << what;
          EXPECT_EQ(floats(ov), floats(lv)) << what;
        }
      }
  }
}

// The elementwise steps split a prompt's rows over the pool (rmsnorm, add, sigmoid_gate, rope);
// decode rows stay on the caller. Either way every value is computed alone: one thread and three
// give the same bits, at a size that splits and one that does not.
TEST(CpuGemm, ElementwiseStepsGiveTheSameBitsOnAnyThreadCount) {
  auto one = make_cpu_backend(1, true), three = make_cpu_backend(3, true);
  const int64_t cols = 512, heads = 8, head_dim = 64;
  const std::vector<float> norm_w = gaussian(size_t(cols), 1);
  RopeTable rope;
  rope.rot_dim = 32;
  rope.rot_offset = 16;
  for (int i = 0; i < rope.rot_dim / 2; ++i) rope.inv_freq.push_back(std::pow(10000.0f, -2.0f * float(i) / 32.0f));
  for (int64_t T : {1, 300}) {
    std::vector<std::vector<float>> results[2];
    int which = 0;
    for (Backend* be : {one.get(), three.get()}) {
      auto filled = [&](int64_t rows, int64_t c, uint32_t seed) {
        Buffer b = be->alloc(rows, c);
        const std::vector<float> v = gaussian(size_t(rows * c), seed);
        std::copy(v.begin(), v.end(), b.data);
        return b;
      };
      auto floats = [](const Buffer& b) { return std::vector<float>(b.data, b.data + b.rows * b.cols); };
      const Vector w{"norm", const_cast<float*>(norm_w.data()), cols};
      const Vector w_head{"head norm", const_cast<float*>(norm_w.data()), head_dim};
      Buffer x = filled(T, cols, 2), y = filled(T, cols, 3), out = be->alloc(T, cols);
      be->rmsnorm(x, w, 1e-6f, cols, out);
      results[which].push_back(floats(out));
      be->rmsnorm(x, w_head, 1e-6f, head_dim, out);
      results[which].push_back(floats(out));
      be->add(x, y);
      results[which].push_back(floats(x));
      Buffer gate = filled(T, cols, 4), gate1 = filled(T, 1, 5);
      be->sigmoid_gate(x, gate);
      be->sigmoid_gate(x, gate1);
      results[which].push_back(floats(x));
      for (bool interleaved : {false, true}) {
        rope.interleaved = interleaved;
        Buffer q = filled(T, heads * head_dim, 6);
        be->rope(q, int(heads), int(head_dim), rope, 7);
        results[which].push_back(floats(q));
      }
      ++which;
    }
    ASSERT_EQ(results[0].size(), results[1].size());
    for (size_t i = 0; i < results[0].size(); ++i) EXPECT_EQ(results[1][i], results[0][i]) << "step " << i << " T=" << T;
  }
}

}  // namespace
}  // namespace moestream
