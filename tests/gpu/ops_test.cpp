// Every CUDA backend operation against the CPU backend (the reference) on random inputs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/backend_factory.h"
#include "backend/expert_provider.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/linear.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/quant.h"
#include "test_util.h"

namespace moestream {
namespace {

std::vector<float> random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The tolerance of a CUDA linear layer of T tokens against the CPU's float32: float32 sums (GEMV
// or SGEMM) unless cuda::tensor_cores_for(T), FP16 operands on the tensor cores then (linear.h:
// about 1e-3 of the largest output; `layers` in a chain).
double linear_tolerance(int64_t T, int layers = 1) {
  return T < cuda::gemm_min_tokens() || !cuda::tensor_cores_for(T) ? 1e-5 : 3e-3 * layers;
}

// The two backends side by side, with helpers to put the same data in both.
class Pair : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_device_available(&why)) GTEST_SKIP() << why;
    cpu = make_cpu_backend(2, true);
    gpu = make_cuda_backend(CudaOptions{});
  }
  struct Buf {
    Buffer c, g;
  };
  Buf buf(int64_t rows, int64_t cols, const std::vector<float>& data) {
    Buf b{cpu->alloc(rows, cols), gpu->alloc(rows, cols)};
    std::memcpy(b.c.data, data.data(), data.size() * sizeof(float));
    EXPECT_EQ(cudaMemcpy(b.g.data, data.data(), data.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    return b;
  }
  Buf buf(int64_t rows, int64_t cols, uint32_t seed) { return buf(rows, cols, random(size_t(rows * cols), seed)); }
  Buf zeros(int64_t rows, int64_t cols) { return Buf{cpu->alloc(rows, cols), gpu->alloc(rows, cols)}; }
  // Poisoned output: NaN everywhere, so an element the kernel misses shows.
  Buf poisoned(int64_t rows, int64_t cols) { return buf(rows, cols, std::vector<float>(size_t(rows * cols), NAN)); }
  std::vector<float> host(Backend& be, const Buffer& b) {
    std::vector<float> v(size_t(b.rows * b.cols));
    be.to_host(b, v.data());
    return v;
  }
  double err(const Buf& b) { return test::relative_error(host(*gpu, b.g), host(*cpu, b.c)); }
  // The largest relative error of a segment of `width` values (a head of a token), each against its
  // own largest: a head whose outputs are small cannot hide behind the others.
  double segment_err(const Buf& b, int64_t width) {
    const std::vector<float> g = host(*gpu, b.g), c = host(*cpu, b.c);
    double worst = 0;
    for (size_t i = 0; i < g.size(); i += size_t(width))
      worst = std::max(worst, test::relative_error(std::vector<float>(g.begin() + long(i), g.begin() + long(i + width)),
                                                   std::vector<float>(c.begin() + long(i), c.begin() + long(i + width))));
    return worst;
  }
  // p's attention on both backends, with the sinks sc and sg (CPU, GPU) when `sinks`.
  void attend(Buf& q, Buf& k, Buf& v, Buf& kc, Buf& vc, const AttentionParams& p, bool sinks, const Vector& sc,
              const Vector& sg, Buf& out) {
    AttentionParams pc = p, pg = p;
    pc.sinks = sinks ? &sc : nullptr;
    pg.sinks = sinks ? &sg : nullptr;
    cpu->attention(q.c, k.c, v.c, kc.c, vc.c, pc, out.c);
    gpu->attention(q.g, k.g, v.g, kc.g, vc.g, pg, out.g);
  }

  std::unique_ptr<Backend> cpu, gpu;
};

// A device copy of host bytes, freed with the last owner.
std::shared_ptr<void> device_copy(const void* src, size_t bytes) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
}

struct HostMatrix {
  std::vector<uint32_t> words;
  std::vector<uint16_t> scales, biases, half;
  std::vector<uint8_t> codes, exponents;  // MXFP4 (codes, E8M0 exponents) and FP8 (codes)
  std::vector<float> f32;                 // plain and affine: the values; FP8: the scales
  TensorView w, s, b;
  QuantFormat quant;
  // MXFP4 reaches a backend only as a routed expert's Matrix view (no load_quantized): the view
  // of the host bytes for the CPU and of device copies for the GPU.
  Matrix host_view, device_view;
  std::shared_ptr<void> device_codes, device_exponents;
};

// A random (rows, cols) matrix in `format`: "f32", "bf16", "f16", an affine quant spec such as
// "q4g64", "mxfp4" or "fp8g<G>". MXFP4 and FP8 take random codes (every code but FP8's NaNs) and
// scales; `wide_scales` spreads MXFP4 exponents over 0..252 (too wide for a dot product).
// `small_rows` makes every third row 2^-20 of the others (its values, or its scales).
HostMatrix make_matrix(int64_t rows, int64_t cols, const std::string& format, uint32_t seed, bool wide_scales = false,
                       bool small_rows = false) {
  HostMatrix m;
  std::mt19937 rng(seed);
  if (format == "mxfp4") {
    m.quant = kMxfp4Format;
    m.codes.resize(size_t(rows * cols / 2));
    m.exponents.resize(size_t(rows * cols / 32));
    for (uint8_t& c : m.codes) c = uint8_t(rng());
    for (uint8_t& e : m.exponents) e = uint8_t(wide_scales ? rng() % (kMxfp4MaxExponent + 1) : 118 + rng() % 12);
    if (small_rows)
      for (int64_t r = 0; r < rows; r += 3)
        for (int64_t g = 0; g < cols / 32; ++g) m.exponents[size_t(r * (cols / 32) + g)] -= 20;
    m.host_view = Matrix{"w", DType::U8, m.codes.data(), rows, cols, m.quant, m.exponents.data(), nullptr};
    m.device_codes = device_copy(m.codes.data(), m.codes.size());
    m.device_exponents = device_copy(m.exponents.data(), m.exponents.size());
    m.device_view = Matrix{"w", DType::U8, m.device_codes.get(), rows, cols, m.quant, m.device_exponents.get(), nullptr};
    return m;
  }
  if (format.rfind("fp8g", 0) == 0) {
    const int g = std::stoi(format.substr(4));
    m.quant = QuantFormat{8, g, DType::F32, QuantScheme::Fp8};
    const int64_t groups = (cols + g - 1) / g;
    m.codes.resize(size_t(rows * cols));
    for (uint8_t& c : m.codes) {
      c = uint8_t(rng() % 254);  // 0x7f and 0xff (NaN) skipped
      if (c >= 0x7f) ++c;
    }
    std::uniform_real_distribution<float> u(1.0f, 2.0f);
    for (int64_t i = 0; i < rows * groups; ++i)
      m.f32.push_back(std::ldexp(u(rng), -int(4 + rng() % 8) - (small_rows && (i / groups) % 3 == 0 ? 20 : 0)));
    m.w = TensorView{"w", DType::F8_E4M3, {rows, cols}, m.codes.data(), m.codes.size()};
    m.s = TensorView{"w.scales", DType::F32, {rows, groups}, m.f32.data(), m.f32.size() * 4};
    return m;
  }
  m.f32 = random(size_t(rows * cols), seed, 0.1f);
  if (small_rows)
    for (int64_t r = 0; r < rows; r += 3)
      for (int64_t c = 0; c < cols; ++c) m.f32[size_t(r * cols + c)] *= 0x1p-20f;
  if (format == "f32") {
    m.w = TensorView{"w", DType::F32, {rows, cols}, m.f32.data(), m.f32.size() * 4};
  } else if (format == "bf16" || format == "f16") {
    for (float x : m.f32) m.half.push_back(format == "bf16" ? f32_to_bf16(x) : f32_to_f16(x));
    m.w = TensorView{"w", format == "bf16" ? DType::BF16 : DType::F16, {rows, cols}, m.half.data(), m.half.size() * 2};
  } else {
    const QuantFormat f = parse_quant_format(format);
    m.quant = f;
    m.words.resize(size_t(rows * quant_words_per_row(f, cols)));
    m.scales.resize(size_t(rows * quant_groups_per_row(f, cols)));
    m.biases.resize(m.scales.size());
    quantize_affine(m.f32.data(), rows, cols, f, m.words.data(), m.scales.data(), m.biases.data());
    m.w = TensorView{"w", DType::U32, {rows, quant_words_per_row(f, cols)}, m.words.data(), m.words.size() * 4};
    m.s = TensorView{"w.scales", f.scale_dtype, {rows, quant_groups_per_row(f, cols)}, m.scales.data(), m.scales.size() * 2};
    m.b = TensorView{"w.biases", f.scale_dtype, {rows, quant_groups_per_row(f, cols)}, m.biases.data(), m.biases.size() * 2};
  }
  return m;
}

Matrix load(Backend& be, const HostMatrix& m, const std::string& format) {
  if (format == "f32" || format == "bf16" || format == "f16") return be.load_matrix(m.w);
  if (format == "mxfp4") return be.name().rfind("cuda", 0) == 0 ? m.device_view : m.host_view;
  return be.load_quantized(m.w, m.s, m.b, m.quant);
}

// q, k and v ([rows[i], cols] in `fmt`, seeds seed, seed + 1, seed + 2; v with a bias) on the CPU
// and the GPU; run() multiplies them with x through each backend's linear_shared_input.
struct Qkv {
  HostMatrix h[3];
  Matrix c[3], g[3];
  std::vector<float> bias_values;
  Vector bc, bg;
  Qkv(Backend& cpu, Backend& gpu, const std::string& fmt, const std::array<int64_t, 3>& rows, int64_t cols,
      uint32_t seed) {
    for (int i = 0; i < 3; ++i) {
      h[i] = make_matrix(rows[size_t(i)], cols, fmt, seed + uint32_t(i));
      c[i] = load(cpu, h[i], fmt);
      g[i] = load(gpu, h[i], fmt);
    }
    bias_values = random(size_t(rows[2]), seed + 3);
    const TensorView bt{"b", DType::F32, {rows[2]}, bias_values.data(), bias_values.size() * 4};
    bc = cpu.load_vector(bt);
    bg = gpu.load_vector(bt);
  }
  void run(Backend& cpu, Backend& gpu, const Buffer& xc, const Buffer& xg, Buffer* const (&oc)[3],
           Buffer* const (&og)[3]) const {
    const Matrix* wc[3] = {&c[0], &c[1], &c[2]};
    const Matrix* wg[3] = {&g[0], &g[1], &g[2]};
    const Vector* bcs[3] = {nullptr, nullptr, &bc};
    const Vector* bgs[3] = {nullptr, nullptr, &bg};
    cpu.linear_shared_input(xc, wc, bcs, oc);
    gpu.linear_shared_input(xg, wg, bgs, og);
  }
};

const std::vector<std::string> kFormats = {"f32",    "bf16",  "f16",   "q2g64",     "q3g64",     "q4g64",  "q4g32",
                                           "q4g128", "q6g64", "q8g64", "q4g64-f16", "q3g32-f16", "q8g128", "mxfp4",
                                           "fp8g128", "fp8g32"};

TEST_F(Pair, LinearEveryFormatGemvAndGemm) {
  for (const std::string& fmt : kFormats)
    for (int64_t T : {1, 3, 4, 8, 37})
      for (auto [rows, cols] : {std::pair<int64_t, int64_t>{100, 256}, {33, 384}}) {
        HostMatrix hm = make_matrix(rows, cols, fmt, 7);
        Matrix wc = load(*cpu, hm, fmt), wg = load(*gpu, hm, fmt);
        Buf x = buf(T, cols, 11), out = poisoned(T, rows);
        cpu->linear(x.c, wc, nullptr, out.c);
        gpu->linear(x.g, wg, nullptr, out.g);
        EXPECT_LT(err(out), linear_tolerance(T)) << fmt << " T=" << T << " [" << rows << ", " << cols << "]";
      }
}

// Many tokens of a quantized matrix go through cuBLAS with the weights split into two FP16 halves
// (split_gemm_linears in expert_exact_mma.cu): every quantized format, rows short and long,
// against the CPU's float32 per token; weight rows 2^20 apart and tokens up to 2^40 apart in
// magnitude, so that a row or token scaled wrongly shows; q, k and v sharing x in two passes (the
// pass boundary inside k).
TEST_F(Pair, LinearSplitGemmEveryQuantFormat) {
  if (cuda::tensor_cores_for(128)) GTEST_SKIP() << "MOESTREAM_CUDA_TENSOR_CORES=1 takes these calls";
  ASSERT_TRUE(cuda::split_gemm_for(128) && !cuda::split_gemm_for(127));
  for (const std::string& fmt : kFormats) {
    if (fmt == "f32" || fmt == "bf16" || fmt == "f16") continue;
    for (int64_t T : {128, 300})
      // 4,608 columns: a thread's third chunk of 8 is decoded again in the second pass (kKeep)
      for (auto [rows, cols] : {std::pair<int64_t, int64_t>{100, 256}, {33, 384}, {20, 4608}}) {
        HostMatrix hm = make_matrix(rows, cols, fmt, 7, false, true);
        Matrix wc = load(*cpu, hm, fmt), wg = load(*gpu, hm, fmt);
        std::vector<float> xv = random(size_t(T * cols), 11);
        for (int64_t t = 0; t < T; t += 2)  // tokens 0, 4, 8, ... 2^20 larger; 2, 6, 10, ... 2^-20 smaller
          for (int64_t c = 0; c < cols; ++c) xv[size_t(t * cols + c)] *= t % 4 == 0 ? 0x1p20f : 0x1p-20f;
        Buf x = buf(T, cols, xv), out = poisoned(T, rows);
        cpu->linear(x.c, wc, nullptr, out.c);
        gpu->linear(x.g, wg, nullptr, out.g);
        EXPECT_LT(segment_err(out, rows), 1e-5) << fmt << " T=" << T << " [" << rows << ", " << cols << "]";
        // the small rows of each token against their own largest
        const std::vector<float> g = host(*gpu, out.g), c = host(*cpu, out.c);
        for (int64_t t = 0; t < T; ++t) {
          std::vector<float> gs, cs;
          for (int64_t r = 0; r < rows; r += 3) {
            gs.push_back(g[size_t(t * rows + r)]);
            cs.push_back(c[size_t(t * rows + r)]);
          }
          ASSERT_LT(test::relative_error(gs, cs), 1e-5) << fmt << " T=" << T << " token " << t << " small rows";
        }
      }
  }
  for (const std::string fmt : {"q4g64", "q8g128"}) {
    const Qkv m(*cpu, *gpu, fmt, {1500, 600, 600}, 256, 41);
    const int64_t T = 2100;  // 2^22 / T = 1997 rows a pass
    Buf x = buf(T, 256, 45);
    Buf oq = poisoned(T, 1500), ok = poisoned(T, 600), ov = poisoned(T, 600);
    m.run(*cpu, *gpu, x.c, x.g, {&oq.c, &ok.c, &ov.c}, {&oq.g, &ok.g, &ov.g});
    EXPECT_LT(std::max({segment_err(oq, 1500), segment_err(ok, 600), segment_err(ov, 600)}), 1e-5) << fmt;
  }
}

// Whether a call of T tokens of matrix w takes the few-token tensor-core path (gemv_mma.cu), whose
// token rows differ from one token's by rounding; else the GEMV, equal to it bit for bit.
bool few_mma(const Matrix& w, int64_t T, const Buffer& x) { return cuda::few_mma_for(w, T, x.data, x.cols); }

// The rows of several tokens against each token alone: bit for bit through the GEMV, within
// float32 rounding (2e-6 of the row's largest) through the few-token tensor-core path.
void expect_lone_rows(const std::vector<float>& many, const std::vector<float>& lone, bool mma, const std::string& what) {
  if (mma) EXPECT_LT(test::relative_error(many, lone), 2e-6) << what;
  else EXPECT_EQ(many, lone) << what;
}

// 2 to 8 tokens of q4 (k-blocks of 64 columns for groups of 64 and 128, of 32 for groups of 32)
// and q8, BF16 and F16 scales, through the few-token tensor-core path, and 9 to 64 tokens through
// it in passes of up to 8 (lane_tokens), against the CPU's float32 per token: 100 rows (the last
// block partial), tokens 2^20 larger and smaller than their neighbours (a token scaled wrongly
// shows), a bias; q, k and v sharing x in one launch.
TEST_F(Pair, FewTokenTensorCoresEveryQ4AndQ8Layout) {
  for (const std::string fmt : {"q4g32", "q4g64", "q4g128", "q4g64-f16", "q8g64", "q8g128"})
    for (int64_t T : {2, 5, 8, 9, 37, 64}) {
      SCOPED_TRACE(fmt + " T=" + std::to_string(T));
      constexpr int64_t rows = 100, cols = 384;
      HostMatrix hm = make_matrix(rows, cols, fmt, 7);
      Matrix wc = load(*cpu, hm, fmt), wg = load(*gpu, hm, fmt);
      std::vector<float> xv = random(size_t(T * cols), 11);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < cols; ++c) xv[size_t(t * cols + c)] *= t % 3 == 1 ? 0x1p20f : t % 3 == 2 ? 0x1p-20f : 1.0f;
      const std::vector<float> bv = random(size_t(rows), 12);
      const TensorView bt{"b", DType::F32, {rows}, bv.data(), bv.size() * 4};
      const Vector bc = cpu->load_vector(bt), bg = gpu->load_vector(bt);
      Buf x = buf(T, cols, xv), out = poisoned(T, rows);
      ASSERT_TRUE(few_mma(wg, std::min<int64_t>(T, 8), x.g));
      ASSERT_TRUE(T <= 8 || T <= cuda::lane_tokens());  // in passes of up to 8
      cpu->linear(x.c, wc, &bc, out.c);
      gpu->linear(x.g, wg, &bg, out.g);
      EXPECT_LT(segment_err(out, rows), 1e-5);
      const Qkv m(*cpu, *gpu, fmt, {160, 48, 40}, cols, 41);
      Buf oq = poisoned(T, 160), ok = poisoned(T, 48), ov = poisoned(T, 40);
      m.run(*cpu, *gpu, x.c, x.g, {&oq.c, &ok.c, &ov.c}, {&oq.g, &ok.g, &ov.g});
      EXPECT_LT(std::max({segment_err(oq, 160), segment_err(ok, 48), segment_err(ov, 40)}), 1e-5) << "q, k, v";
    }
}

// One token goes through the single-token tile (gemv_one.cuh) for the kinds it reads (bf16 also
// does, but its several-token path is the tensor cores', so it is checked against the CPU only, by
// Pair.LinearEveryFormatGemvAndGemm); its rows must equal, bit for bit, the GEMV of several tokens
// (gemv_kernel, whose token sums do not depend on how many it takes), alone and as one of several
// matrices sharing x, and agree within rounding with the few-token tensor-core path that q4 and q8
// take (few_mma). Rows past a whole block (100, 33) and widths of one and several passes of 32 packs.
TEST_F(Pair, OneTokenGemvEqualsTheGemvBitForBit) {
  for (const std::string fmt :
       {"q4g64", "q4g32", "q4g64-f16", "mxfp4", "q8g64", "q8g128", "q2g64", "q2g128", "q3g64", "q6g64", "fp8g128"})
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{100, 256}, {33, 2048}, {200, 4096}}) {
      SCOPED_TRACE(fmt + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
      HostMatrix hm = make_matrix(rows, cols, fmt, 7), hm2 = make_matrix(rows / 2 + 1, cols, fmt, 8);
      Matrix w = load(*gpu, hm, fmt), w2 = load(*gpu, hm2, fmt);
      const std::vector<float> xv = random(size_t(3 * cols), 11);
      Buf x3 = buf(3, cols, xv), x1 = buf(1, cols, std::vector<float>(xv.begin(), xv.begin() + cols));
      Buf many = poisoned(3, rows), one = poisoned(1, rows), one2 = poisoned(1, w2.rows), many2 = poisoned(3, w2.rows);
      const bool mma = few_mma(w, 3, x3.g);
      EXPECT_EQ(mma, fmt.starts_with("q4") || fmt.starts_with("q8"));
      gpu->linear(x3.g, w, nullptr, many.g);
      gpu->linear(x1.g, w, nullptr, one.g);
      const std::vector<float> m = host(*gpu, many.g), o = host(*gpu, one.g);
      expect_lone_rows(std::vector<float>(m.begin(), m.begin() + rows), o, mma, "alone");
      const Matrix* ws[2] = {&w, &w2};
      const Vector* bs[2] = {nullptr, nullptr};
      Buffer* outs1[2] = {&one.g, &one2.g};
      Buffer* outs3[2] = {&many.g, &many2.g};
      gpu->linear_shared_input(x1.g, ws, bs, outs1);
      gpu->linear_shared_input(x3.g, ws, bs, outs3);
      EXPECT_EQ(host(*gpu, one.g), o);
      EXPECT_EQ(host(*gpu, many.g), m) << "shared x, first matrix";
      const std::vector<float> m2 = host(*gpu, many2.g);
      expect_lone_rows(std::vector<float>(m2.begin(), m2.begin() + w2.rows), host(*gpu, one2.g), mma, "shared x");
    }
}

// The single-token GEMV takes 4, 2 or 1 rows a warp, by the launch's size (gemv_one.cuh's
// with_one_rows: at least two blocks an SM), the router's the same. A row sums the same way
// whatever the rows a warp, so capping them (MOESTREAM_CUDA_ONE_ROWS) changes no bit: a matrix of
// 20,011 rows (R = 4 by default; 6 for q2, 2 for q8, 1 for bf16), and q, k and v of one launch.
TEST_F(Pair, OneTokenGemvRowsPerWarpChangeNoBit) {
  for (const std::string fmt : {"q4g64", "mxfp4", "q8g64", "bf16", "q2g128"}) {
    SCOPED_TRACE(fmt);
    constexpr int64_t kCols = 512;
    HostMatrix hm = make_matrix(20011, kCols, fmt, 31), hk = make_matrix(517, kCols, fmt, 32);
    Matrix w = load(*gpu, hm, fmt), wk = load(*gpu, hk, fmt);
    Buf x = buf(1, kCols, random(size_t(kCols), 33));
    auto run = [&](const char* cap) {
      if (cap) setenv("MOESTREAM_CUDA_ONE_ROWS", cap, 1);
      Buf o = poisoned(1, w.rows), q = poisoned(1, w.rows), k = poisoned(1, wk.rows);
      gpu->linear(x.g, w, nullptr, o.g);
      const Matrix* ws[2] = {&w, &wk};
      const Vector* bs[2] = {nullptr, nullptr};
      Buffer* outs[2] = {&q.g, &k.g};
      gpu->linear_shared_input(x.g, ws, bs, outs);
      unsetenv("MOESTREAM_CUDA_ONE_ROWS");
      std::vector<float> all = host(*gpu, o.g), qv = host(*gpu, q.g), kv = host(*gpu, k.g);
      EXPECT_EQ(qv, all) << "shared input";
      all.insert(all.end(), kv.begin(), kv.end());
      return all;
    };
    const std::vector<float> chosen = run(nullptr);
    for (const char* cap : {"1", "2", "4"}) EXPECT_EQ(run(cap), chosen) << "at most " << cap << " rows a warp";
  }
}

// The GEMV of 2 to 8 tokens launches one wave of blocks, each taking row blocks in turn, and the
// few-token tensor-core path a block per 16 rows: a matrix of more row blocks than the device runs
// at once (an LM head's 20,011 rows of 256 columns) gives every token its lone value (bit for bit
// through the GEMV, mxfp4 here; within rounding through the tensor cores, q4 and q8), alone and
// with a second matrix of the same input.
TEST_F(Pair, FewTokenGemvOverManyRowBlocksEqualsLoneTokens) {
  constexpr int64_t kRows = 20011, kCols = 256;
  for (const std::string fmt : {"q4g64", "q8g64", "mxfp4"}) {
    HostMatrix hm = make_matrix(kRows, kCols, fmt, 21), hm2 = make_matrix(kRows / 3, kCols, fmt, 22);
    Matrix w = load(*gpu, hm, fmt), w2 = load(*gpu, hm2, fmt);
    const std::vector<float> xv = random(size_t(8 * kCols), 23);
    std::vector<std::vector<float>> lone, lone2;  // [token][row]
    for (int t = 0; t < 8; ++t) {
      Buf x1 = buf(1, kCols, std::vector<float>(xv.begin() + t * kCols, xv.begin() + (t + 1) * kCols));
      Buf o = poisoned(1, kRows), o2 = poisoned(1, w2.rows);
      gpu->linear(x1.g, w, nullptr, o.g);
      gpu->linear(x1.g, w2, nullptr, o2.g);
      lone.push_back(host(*gpu, o.g));
      lone2.push_back(host(*gpu, o2.g));
    }
    for (int64_t T : {3, 8}) {
      SCOPED_TRACE(fmt + " T=" + std::to_string(T));
      Buf x = buf(T, kCols, std::vector<float>(xv.begin(), xv.begin() + T * kCols));
      Buf many = poisoned(T, kRows), many2 = poisoned(T, w2.rows);
      const bool mma = few_mma(w, T, x.g);
      EXPECT_EQ(mma, fmt != "mxfp4");
      gpu->linear(x.g, w, nullptr, many.g);
      std::vector<float> m = host(*gpu, many.g);
      for (int64_t t = 0; t < T; ++t)
        expect_lone_rows(std::vector<float>(m.begin() + t * kRows, m.begin() + (t + 1) * kRows), lone[size_t(t)], mma,
                         "token " + std::to_string(t));
      const std::vector<float> alone = m;
      const Matrix* ws[2] = {&w, &w2};
      const Vector* bs[2] = {nullptr, nullptr};
      Buffer* outs[2] = {&many.g, &many2.g};
      gpu->linear_shared_input(x.g, ws, bs, outs);
      m = host(*gpu, many.g);
      EXPECT_EQ(m, alone) << "shared x, first matrix";
      const std::vector<float> m2 = host(*gpu, many2.g);
      for (int64_t t = 0; t < T; ++t)
        expect_lone_rows(std::vector<float>(m2.begin() + t * w2.rows, m2.begin() + (t + 1) * w2.rows),
                         lone2[size_t(t)], mma, "shared x, token " + std::to_string(t));
    }
  }
}

// A matrix of many waves of 16-row tiles (an LM head) goes through the rows kernel: a grid that
// stays, units of two tiles copied whole into shared memory ahead, each warp loading a k-block's x
// once for both, the tile kernel's k-blocks and order of sums. Its rows equal, bit for bit, the
// tile kernel's (MOESTREAM_CUDA_FEW_ROWS=0): every layout (k-blocks of 32 and 64 columns, q8, F16
// scales), 2 to 8 tokens, a partial last unit, q, k and v in one launch (MOESTREAM_CUDA_FEW_ROWS=2
// takes the rows kernel for any size), and a head of 60,013 rows (the rows kernel by its size, each
// block refilling its stages over several units).
TEST_F(Pair, FewTokenRowsKernelEqualsTheTileKernel) {
  auto rows_with = [&](const char* mode, auto&& f) {  // the tile kernel of 8 warps, as the rows kernel's
    setenv("MOESTREAM_CUDA_FEW_ROWS", mode, 1);
    setenv("MOESTREAM_CUDA_FEW_WARPS", "8", 1);
    auto r = f();
    unsetenv("MOESTREAM_CUDA_FEW_ROWS");
    unsetenv("MOESTREAM_CUDA_FEW_WARPS");
    return r;
  };
  for (const std::string fmt : {"q4g32", "q4g64", "q4g128", "q4g64-f16", "q8g64", "q8g128"})
    for (int64_t T : {2, 5, 8}) {
      SCOPED_TRACE(fmt + " T=" + std::to_string(T));
      constexpr int64_t cols = 1024;  // q8's stage of 2,048 columns would not fit
      HostMatrix hm = make_matrix(100, cols, fmt, 51);
      Matrix wg = load(*gpu, hm, fmt);
      const Qkv m(*cpu, *gpu, fmt, {160, 48, 40}, cols, 52);
      Buf x = buf(T, cols, 53);
      ASSERT_TRUE(few_mma(wg, T, x.g));
      const Matrix* one[1] = {&wg};
      ASSERT_TRUE(cuda::few_rows_fit(one)) << "the rows kernel would not be taken";
      auto run = [&] {
        Buf o = poisoned(T, 100), oq = poisoned(T, 160), ok = poisoned(T, 48), ov = poisoned(T, 40);
        gpu->linear(x.g, wg, nullptr, o.g);
        m.run(*cpu, *gpu, x.c, x.g, {&oq.c, &ok.c, &ov.c}, {&oq.g, &ok.g, &ov.g});
        return std::vector<std::vector<float>>{host(*gpu, o.g), host(*gpu, oq.g), host(*gpu, ok.g), host(*gpu, ov.g)};
      };
      const auto tile = rows_with("0", run), rows = rows_with("2", run);
      for (size_t i = 0; i < tile.size(); ++i) EXPECT_EQ(rows[i], tile[i]) << "matrix " << i;  // NaN (unwritten) fails
    }
  for (const std::string fmt : {"q4g64", "q8g64"}) {
    SCOPED_TRACE(fmt + " head");
    constexpr int64_t kRows = 60013, kCols = 512, T = 8;  // several units a block on any GPU
    HostMatrix hm = make_matrix(kRows, kCols, fmt, 54);
    Matrix wg = load(*gpu, hm, fmt);
    Buf x = buf(T, kCols, 55);
    const Matrix* one[1] = {&wg};
    ASSERT_TRUE(cuda::few_rows_fit(one));
    auto run = [&] {
      Buf o = poisoned(T, kRows);
      gpu->linear(x.g, wg, nullptr, o.g);
      return host(*gpu, o.g);
    };
    const std::vector<float> tile = rows_with("0", run), chosen = rows_with("1", run);
    EXPECT_EQ(chosen, tile);
  }
}

// A matrix of one wave of 16-row tiles and at least 64 k-blocks (o_proj at 2-8 tokens) takes the
// tile kernel with 16 warps a block instead of 8: each token's rows equal its lone token's within
// float32 rounding and the 8 warps' rows within the rounding of adding 16 warps' sums instead of 8
// (MOESTREAM_CUDA_FEW_WARPS=8); q4 in k-blocks of 64 (4,096 columns) and 32 columns (groups of 32),
// q8, a partial last tile, a bias.
TEST_F(Pair, FewTokenGemvOfSixteenWarpsEqualsLoneTokens) {
  struct Shape {
    std::string fmt;
    int64_t cols;
  };
  for (const Shape& sh : {Shape{"q4g64", 4096}, Shape{"q4g32", 2048}, Shape{"q8g64", 2048}}) {
    constexpr int64_t kRows = 1000;  // 63 tiles, the last partial
    const Matrix w = load(*gpu, make_matrix(kRows, sh.cols, sh.fmt, 131), sh.fmt);
    const std::vector<float> bv = random(kRows, 132);
    const Vector bias = gpu->load_vector(TensorView{"b", DType::F32, {kRows}, bv.data(), bv.size() * 4});
    const std::vector<float> xv = random(size_t(8 * sh.cols), 133);
    for (int64_t T : {2, 8}) {
      SCOPED_TRACE(sh.fmt + " T=" + std::to_string(T));
      Buf x = buf(T, sh.cols, std::vector<float>(xv.begin(), xv.begin() + T * sh.cols));
      ASSERT_TRUE(few_mma(w, T, x.g));
      auto run = [&] {
        Buf o = poisoned(T, kRows);
        gpu->linear(x.g, w, &bias, o.g);
        return host(*gpu, o.g);
      };
      const std::vector<float> sixteen = run();
      setenv("MOESTREAM_CUDA_FEW_WARPS", "8", 1);
      const std::vector<float> eight = run();
      unsetenv("MOESTREAM_CUDA_FEW_WARPS");
      EXPECT_LT(test::relative_error(sixteen, eight), 1e-6);
      EXPECT_NE(sixteen, eight) << "the same sums: the 16-warp kernel was not taken";
      for (int64_t t = 0; t < T; ++t) {
        Buf x1 = buf(1, sh.cols, std::vector<float>(xv.begin() + t * sh.cols, xv.begin() + (t + 1) * sh.cols));
        Buf o1 = poisoned(1, kRows);
        gpu->linear(x1.g, w, &bias, o1.g);
        expect_lone_rows(std::vector<float>(sixteen.begin() + t * kRows, sixteen.begin() + (t + 1) * kRows),
                         host(*gpu, o1.g), true, "token " + std::to_string(t));
      }
    }
  }
}

// Rows that are not a multiple of 32 (FP8: nor of its group, the last group partial).
TEST_F(Pair, LinearOddWidthWithBias) {
  for (std::string fmt : {"f32", "bf16", "fp8g32", "fp8g128"}) {
    HostMatrix hm = make_matrix(21, 70, fmt, 3);
    std::vector<float> bias = random(21, 4);
    const TensorView bv{"bias", DType::F32, {21}, bias.data(), bias.size() * 4};
    const Vector bc = cpu->load_vector(bv), bg = gpu->load_vector(bv);
    Matrix wc = load(*cpu, hm, fmt), wg = load(*gpu, hm, fmt);
    for (int64_t T : {1, 2, 20}) {
      Buf x = buf(T, 70, 5), out = poisoned(T, 21);
      cpu->linear(x.c, wc, &bc, out.c);
      gpu->linear(x.g, wg, &bg, out.g);
      EXPECT_LT(err(out), 1e-5) << fmt << " T=" << T;  // 70 columns (not a multiple of 8): float32 GEMM
    }
  }
}

// FP8 with partial last groups and packs: cols not a multiple of 32 or of G, cols < G, a group
// size that is not a power of two; GEMV and cuBLAS paths.
TEST_F(Pair, LinearFp8PartialGroups) {
  struct Case {
    int64_t rows, cols;
    int group;
  };
  for (const Case& c : {Case{33, 200, 64}, Case{21, 48, 128}, Case{40, 200, 96}, Case{7, 1000, 128}, Case{192, 48, 128}})
    for (int64_t T : {1, 3, 4, 8, 37}) {
      const std::string fmt = "fp8g" + std::to_string(c.group);
      HostMatrix hm = make_matrix(c.rows, c.cols, fmt, 13);
      Matrix wc = load(*cpu, hm, fmt), wg = load(*gpu, hm, fmt);
      Buf x = buf(T, c.cols, 17), out = poisoned(T, c.rows);
      cpu->linear(x.c, wc, nullptr, out.c);
      gpu->linear(x.g, wg, nullptr, out.g);
      EXPECT_LT(err(out), linear_tolerance(T)) << fmt << " T=" << T << " [" << c.rows << ", " << c.cols << "]";
    }
}

// greedy_rows on the GPU against the CPU's (the sampler's choice): a vocabulary of 151,936 (many
// chunks, the last partial), ties within and across chunks, NaN, +inf, all -inf, a row of one
// finite value; then narrow rows.
TEST_F(Pair, GreedyRowsMatchTheCpu) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (const int64_t cols : {int64_t(151936), int64_t(1000), int64_t(1)}) {
    SCOPED_TRACE(cols);
    const int64_t rows = 8;
    std::vector<float> v = random(size_t(rows * cols), 11);
    auto at = [&](int64_t r, int64_t c) -> float& { return v[size_t(r * cols + std::min(c, cols - 1))]; };
    at(0, 5000) = at(0, 140000) = at(0, 4095) = 50.0f;  // ties across chunks: the lowest column
    at(1, cols - 1) = 60.0f;                             // the last column
    at(2, 100000) = NAN;
    for (int64_t c = 0; c < cols; ++c) at(3, c) = -kInf;
    at(4, 7) = kInf;
    for (int64_t c = 0; c < cols; ++c) at(5, c) = -kInf;
    at(5, 77777) = -3.0f;
    at(6, 0) = 40.0f;  // the first column
    Buf x = buf(rows, cols, v);
    std::vector<int32_t> want(static_cast<size_t>(rows)), got(static_cast<size_t>(rows), 99);
    cpu->greedy_rows(x.c, want);
    gpu->greedy_rows(x.g, got);
    EXPECT_EQ(got, want);
    if (cols == 151936) {
      EXPECT_EQ(want, (std::vector<int32_t>{4095, 151935, -1, -1, -1, 77777, 0, want[7]}));
    }
  }
}

TEST_F(Pair, Embed) {
  // Bit-exact rows: MXFP4 with exponents from the subnormal scales to the limit, FP8 with every
  // code and a partial last group.
  for (std::string fmt : {"bf16", "q4g64", "q6g32", "mxfp4", "fp8g128", "fp8g64"}) {
    const int64_t cols = fmt == "fp8g64" ? 100 : 128;
    HostMatrix hm = make_matrix(50, cols, fmt, 9, true);
    Matrix wc = load(*cpu, hm, fmt), wg = load(*gpu, hm, fmt);
    const std::vector<int32_t> tokens{3, 49, 0, 3, 17};
    Buf out = poisoned(5, cols);
    cpu->embed(tokens, wc, out.c);
    gpu->embed(tokens, wg, out.g);
    EXPECT_EQ(err(out), 0.0) << fmt;
  }
  HostMatrix hm = make_matrix(5, 32, "f32", 1);
  Matrix wg = gpu->load_matrix(hm.w);
  Buf out = zeros(1, 32);
  const std::vector<int32_t> bad{5};
  EXPECT_THROW(gpu->embed(bad, wg, out.g), Error);
}

TEST_F(Pair, RmsNormWholeRowsAndGroups) {
  for (int64_t group : {256, 64}) {
    std::vector<float> w = random(size_t(group), 2);
    const TensorView wv{"norm", DType::F32, {group}, w.data(), w.size() * 4};
    const Vector wc = cpu->load_vector(wv), wg = gpu->load_vector(wv);
    Buf x = buf(5, 256, 1), out = poisoned(5, 256);
    cpu->rmsnorm(x.c, wc, 1e-6f, group, out.c);
    gpu->rmsnorm(x.g, wg, 1e-6f, group, out.g);
    EXPECT_LT(err(out), 1e-6) << group;
    cpu->rmsnorm(x.c, wc, 1e-6f, group, x.c);  // in place
    gpu->rmsnorm(x.g, wg, 1e-6f, group, x.g);
    EXPECT_LT(err(x), 1e-6) << group;
  }
}

TEST_F(Pair, Rope) {
  for (bool interleaved : {false, true}) {
    RopeTable r;
    r.rot_dim = 32;
    r.interleaved = interleaved;
    r.rot_offset = interleaved ? 16 : 0;
    r.attention_factor = interleaved ? 1.2f : 1.0f;
    for (int i = 0; i < 16; ++i) r.inv_freq.push_back(1.0f / std::pow(10000.0f, float(2 * i) / 32));
    Buf x = buf(6, 4 * 48, 8);
    cpu->rope(x.c, 4, 48, r, 1000);
    gpu->rope(x.g, 4, 48, r, 1000);
    EXPECT_LT(err(x), 1e-5) << interleaved;
  }
}

TEST_F(Pair, AttentionDecodePrefillWindowSinksMla) {
  struct Case {
    int heads, kv_heads, hd, vd;
    int64_t window;
    bool sinks, values_in_keys;
  };
  // Prefill takes the tensor cores for 64, 128 and 256 dims; with MOESTREAM_CUDA_ATTN_MMA=0 the
  // float32 tiled kernel takes them (heads per KV head dividing 32). The rest (32 dims and MLA's
  // 96/64 here) goes through the per-row kernel either way.
  for (const char* mma : {"1", "0"}) {
    setenv("MOESTREAM_CUDA_ATTN_MMA", mma, 1);
    for (const Case& c :
         {Case{8, 2, 64, 64, 0, false, false}, Case{4, 4, 32, 32, 5, true, false}, Case{4, 1, 96, 64, 0, false, true},
          Case{2, 2, 128, 128, 0, false, false}, Case{8, 2, 64, 64, 5, true, false},
          Case{16, 1, 128, 128, 0, true, false}, Case{6, 3, 256, 256, 9, false, false}}) {
      AttentionParams p = test::attention_params(c.heads, c.kv_heads, c.hd, c.vd, c.window, c.values_in_keys);
      std::vector<float> sink = random(size_t(c.heads), 3);
      const TensorView sv{"sinks", DType::F32, {c.heads}, sink.data(), sink.size() * 4};
      const Vector sc = cpu->load_vector(sv), sg = gpu->load_vector(sv);
      const int64_t kv_dim = int64_t(c.kv_heads) * c.hd, v_dim = int64_t(c.kv_heads) * c.vd, cap = 64;
      Buf kc = zeros(cap, kv_dim), vc = zeros(cap, c.values_in_keys ? 1 : v_dim);
      int64_t n_past = 0;
      for (int64_t T : {int64_t(13), int64_t(1), int64_t(1), int64_t(7), int64_t(40)}) {
        Buf q = buf(T, int64_t(c.heads) * c.hd, 100 + uint32_t(n_past)), k = buf(T, kv_dim, 200 + uint32_t(n_past));
        Buf v = buf(T, c.values_in_keys ? 1 : v_dim, 300 + uint32_t(n_past)),
            out = poisoned(T, int64_t(c.heads) * c.vd);
        p.n_past = n_past;
        attend(q, k, v, kc, vc, p, c.sinks, sc, sg, out);
        EXPECT_LT(err(out), 1e-5) << "mma " << mma << " heads " << c.heads << " hd " << c.hd << " T " << T << " n_past "
                                  << n_past;
        n_past += T;
      }
    }
  }
  unsetenv("MOESTREAM_CUDA_ATTN_MMA");
}

// The tensor-core prefill kernel over many key tiles: a 300-token prompt, a decode step, then 77
// more tokens, with key and value magnitudes that change from tile to tile (each tile's values
// are split under their own power of two, and the value sums are carried across tile scales) and
// query rows of different magnitudes: heads of 64, 128 and 256 dims, groups that do and do not
// divide the kernel's 64 rows, with and without a sliding window and sinks.
TEST_F(Pair, AttentionPrefillTensorCoresManyTiles) {
  for (const char* split : {"1", "0"}) {  // keys and values split once per call, or by each block
    setenv("MOESTREAM_CUDA_ATTN_SPLIT", split, 1);
    struct Case {
      int heads, kv_heads, hd;
      int64_t window;
      bool sinks;
    };
    // Groups of 8, 2, 1, and 12 and 3 (GLM-4.5's 96 / 8 heads; 64 rows a block hold 5 tokens of 12);
    // Qwen3-Next's 16 / 2 heads of 256 dims (two warps a row's value dims), and 12 a group of them.
    for (const Case& c : {Case{32, 4, 128, 0, false}, Case{8, 4, 64, 100, true}, Case{6, 6, 128, 0, false},
                          Case{24, 2, 128, 0, false}, Case{6, 2, 64, 50, true}, Case{16, 2, 256, 0, false},
                          Case{4, 2, 256, 70, true}, Case{24, 2, 256, 0, false}}) {
      AttentionParams p = test::attention_params(c.heads, c.kv_heads, c.hd, 0, c.window);
      std::vector<float> sink = random(size_t(c.heads), 3);
      const TensorView sv{"sinks", DType::F32, {c.heads}, sink.data(), sink.size() * 4};
      const Vector sc = cpu->load_vector(sv), sg = gpu->load_vector(sv);
      const int64_t kv_dim = int64_t(c.kv_heads) * c.hd, q_dim = int64_t(c.heads) * c.hd, cap = 400;
      Buf kc = zeros(cap, kv_dim), vc = zeros(cap, kv_dim);
      int64_t n_past = 0;
      for (int64_t T : {int64_t(300), int64_t(1), int64_t(77)}) {
        const uint32_t seed = uint32_t(n_past);
        std::vector<float> qv = random(size_t(T * q_dim), 100 + seed), kv = random(size_t(T * kv_dim), 200 + seed),
                           vv = random(size_t(T * kv_dim), 300 + seed);
        for (int64_t t = 0; t < T; ++t) {
          const int64_t pos = n_past + t;
          const float qs = std::ldexp(1.0f, -int(t % 7)), ks = std::ldexp(1.0f, int(pos / 32 % 5) - 2),
                      vs = std::ldexp(1.0f, 3 * int(pos / 32 % 9) - 12);
          for (int64_t i = 0; i < q_dim; ++i) qv[size_t(t * q_dim + i)] *= qs;
          for (int64_t i = 0; i < kv_dim; ++i) {
            kv[size_t(t * kv_dim + i)] *= ks;
            vv[size_t(t * kv_dim + i)] *= vs;
          }
        }
        Buf q = buf(T, q_dim, qv), k = buf(T, kv_dim, kv), v = buf(T, kv_dim, vv), out = poisoned(T, q_dim);
        p.n_past = n_past;
        attend(q, k, v, kc, vc, p, c.sinks, sc, sg, out);
        const std::string what = std::string("split ") + split + " heads " + std::to_string(c.heads) + " hd " +
                                 std::to_string(c.hd) + " T " + std::to_string(T) + " n_past " + std::to_string(n_past);
        EXPECT_LT(err(out), 1e-5) << what;
        EXPECT_LT(segment_err(out, c.hd), 1e-4) << what;
        if (T > 1) {
          // The tensor cores ran: the float32 kernel's rounding differs somewhere in these outputs.
          EXPECT_EQ(cuda::attention_split_bytes(p, T) > 0, std::string(split) == "1") << what;
          Buf f32 = poisoned(T, q_dim);
          AttentionParams pg = p;
          pg.sinks = c.sinks ? &sg : nullptr;
          setenv("MOESTREAM_CUDA_ATTN_MMA", "0", 1);
          gpu->attention(q.g, k.g, v.g, kc.g, vc.g, pg, f32.g);
          unsetenv("MOESTREAM_CUDA_ATTN_MMA");
          EXPECT_NE(host(*gpu, f32.g), host(*gpu, out.g)) << what;
        }
        n_past += T;
      }
    }
  }
  unsetenv("MOESTREAM_CUDA_ATTN_SPLIT");
}

// Value tiles 2^100 and 2^190 apart (the sums' units move by at most 2^64 a tile, the rest goes
// into that tile's probabilities): finite and within 1e-5 of the CPU, in both orders.
TEST_F(Pair, AttentionPrefillTensorCoresExtremeValueRanges) {
  const AttentionParams p = test::attention_params(8, 2, 128);
  const int64_t T = 96, q_dim = 8 * 128, kv_dim = 2 * 128;
  const Vector none;
  for (const std::vector<int>& exps : {std::vector<int>{0, -100, 90}, std::vector<int>{90, -100, 0}}) {
    std::vector<float> vv = random(size_t(T * kv_dim), 7);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < kv_dim; ++i) vv[size_t(t * kv_dim + i)] = std::ldexp(vv[size_t(t * kv_dim + i)], exps[size_t(t / 32)]);
    Buf q = buf(T, q_dim, 5), k = buf(T, kv_dim, 6), v = buf(T, kv_dim, vv), out = poisoned(T, q_dim);
    Buf kc = zeros(T, kv_dim), vc = zeros(T, kv_dim);
    attend(q, k, v, kc, vc, p, false, none, none, out);
    EXPECT_LT(err(out), 1e-5) << exps[0] << " " << exps[1] << " " << exps[2];
  }
}

TEST_F(Pair, ElementwiseOps) {
  Buf x = buf(4, 96, 1), y = buf(4, 96, 2);
  cpu->add(x.c, y.c);
  gpu->add(x.g, y.g);
  EXPECT_EQ(err(x), 0.0);
  cpu->clamp(x.c, 0.5f);
  gpu->clamp(x.g, 0.5f);
  EXPECT_EQ(err(x), 0.0);
  Buf gate = buf(4, 96, 3), gate1 = buf(4, 1, 4);
  cpu->sigmoid_gate(x.c, gate.c);
  gpu->sigmoid_gate(x.g, gate.g);
  cpu->sigmoid_gate(x.c, gate1.c);
  gpu->sigmoid_gate(x.g, gate1.g);
  EXPECT_LT(err(x), 1e-6);
  Buf dst = buf(4, 64, 5);
  cpu->copy_columns(y.c, ColumnBlocks{8, 24}, dst.c, ColumnBlocks{1, 20}, 12, 3);
  gpu->copy_columns(y.g, ColumnBlocks{8, 24}, dst.g, ColumnBlocks{1, 20}, 12, 3);
  EXPECT_EQ(err(dst), 0.0);
  Buf rows = zeros(4, 96);
  cpu->copy_rows(y.c, rows.c, 3);
  gpu->copy_rows(y.g, rows.g, 3);
  EXPECT_EQ(err(rows), 0.0);
}

TEST_F(Pair, LinearPerHeadAndMlp) {
  std::vector<HostMatrix> hms;
  std::vector<Matrix> wc, wg;
  for (int h = 0; h < 3; ++h) hms.push_back(make_matrix(16, 32, "f32", 20 + h));
  for (auto& hm : hms) {
    wc.push_back(cpu->load_matrix(hm.w));
    wg.push_back(gpu->load_matrix(hm.w));
  }
  for (int64_t T : {1, 12}) {
    Buf x = buf(T, 96, 6), out = poisoned(T, 48);
    cpu->linear_per_head(x.c, wc, out.c);
    gpu->linear_per_head(x.g, wg, out.g);
    EXPECT_LT(err(out), linear_tolerance(T)) << T;
  }
  for (std::string fmt : {"bf16", "q4g64", "mxfp4", "fp8g128"}) {
    HostMatrix g = make_matrix(128, 64, fmt, 1), u = make_matrix(128, 64, fmt, 2), d = make_matrix(64, 128, fmt, 3);
    MlpWeights mc{load(*cpu, g, fmt), load(*cpu, u, fmt), load(*cpu, d, fmt), {}, {}, {}};
    MlpWeights mg{load(*gpu, g, fmt), load(*gpu, u, fmt), load(*gpu, d, fmt), {}, {}, {}};
    for (int64_t T : {1, 9}) {
      Buf x = buf(T, 64, 7), out = poisoned(T, 64);
      cpu->mlp(x.c, mc, out.c);
      gpu->mlp(x.g, mg, out.g);
      EXPECT_LT(err(out), linear_tolerance(T, 2)) << fmt << " T=" << T;
    }
  }
}

// The shared expert scaled by its gate row (Qwen3-Next, Qwen3.5): CUDA's fused launches give its
// unfused steps' output bit for bit (the gate row in the gate/up launch, sigmoid and add in one),
// and the CPU's within the linears' tolerance; one token, a few, and a prefill chunk.
TEST_F(Pair, GatedMlpAddEqualsItsStepsBitForBit) {
  for (std::string fmt : {"bf16", "q4g64", "mxfp4"}) {
    HostMatrix g = make_matrix(128, 64, fmt, 1), u = make_matrix(128, 64, fmt, 2), d = make_matrix(64, 128, fmt, 3);
    HostMatrix gate = make_matrix(1, 64, fmt, 4);
    MlpWeights mc{load(*cpu, g, fmt), load(*cpu, u, fmt), load(*cpu, d, fmt), {}, {}, {}};
    MlpWeights mg{load(*gpu, g, fmt), load(*gpu, u, fmt), load(*gpu, d, fmt), {}, {}, {}};
    const Matrix gc = load(*cpu, gate, fmt), gg = load(*gpu, gate, fmt);
    for (int64_t T : {1, 5, 96}) {
      SCOPED_TRACE(fmt + " T=" + std::to_string(T));
      Buf x = buf(T, 64, 7), out = buf(T, 64, 8), steps = buf(T, 64, 8);
      Buf s = poisoned(T, 64), sg = poisoned(T, 1), s2 = poisoned(T, 64), sg2 = poisoned(T, 1);
      cpu->gated_mlp_add(x.c, mc, gc, s.c, sg.c, out.c);
      gpu->gated_mlp_add(x.g, mg, gg, s.g, sg.g, out.g);
      gpu->Backend::gated_mlp_add(x.g, mg, gg, s2.g, sg2.g, steps.g);
      EXPECT_EQ(host(*gpu, out.g), host(*gpu, steps.g));
      EXPECT_LT(err(out), linear_tolerance(T, 2));
    }
  }
}

// The small shape (value heads of 48: a partial tile of columns) and Qwen3.5's (16 key and 32 value
// heads of 128).
TEST_F(Pair, GatedDeltaNetPrefillThenDecode) {
  for (const auto& [nk, nv, dk, dv] : {std::array<int, 4>{2, 4, 32, 48}, std::array<int, 4>{16, 32, 128, 128}}) {
    SCOPED_TRACE(std::to_string(nv) + " value heads of " + std::to_string(dv));
    DeltaNetParams p;
    p.n_k_heads = nk;
    p.n_v_heads = nv;
    p.k_head_dim = dk;
    p.v_head_dim = dv;
    p.conv_kernel = 4;
    const int64_t key_dim = int64_t(nk) * dk, value_dim = int64_t(nv) * dv, conv_dim = 2 * key_dim + value_dim;
    std::vector<float> conv = random(size_t(conv_dim * 4), 1, 0.3f), A_log = random(size_t(nv), 2, 0.5f),
                       dt = random(size_t(nv), 3, 0.5f), norm = random(size_t(dv), 4);
    auto vec = [&](Backend& be, const char* name, std::vector<float>& v) {
      return be.load_vector(TensorView{name, DType::F32, {int64_t(v.size())}, v.data(), v.size() * 4});
    };
    DeltaNetWeights wc{vec(*cpu, "conv", conv), vec(*cpu, "A_log", A_log), vec(*cpu, "dt", dt), vec(*cpu, "norm", norm)};
    DeltaNetWeights wg{vec(*gpu, "conv", conv), vec(*gpu, "A_log", A_log), vec(*gpu, "dt", dt), vec(*gpu, "norm", norm)};
    Buf sconv = zeros(3, conv_dim), srec = zeros(int64_t(nv) * dk, dv);
    DeltaNetState stc{sconv.c, srec.c}, stg{sconv.g, srec.g};
    uint32_t seed = 50;
    for (int64_t T : {int64_t(70), int64_t(1), int64_t(1), int64_t(2)}) {
      Buf qkv = buf(T, conv_dim, seed++), z = buf(T, value_dim, seed++), b = buf(T, nv, seed++), a = buf(T, nv, seed++);
      Buf out = poisoned(T, value_dim);
      cpu->gated_delta_net(qkv.c, z.c, b.c, a.c, wc, p, stc, out.c);
      gpu->gated_delta_net(qkv.g, z.g, b.g, a.g, wg, p, stg, out.g);
      EXPECT_LT(err(out), 1e-4) << "T " << T;
      EXPECT_LT(test::relative_error(host(*gpu, stg.recurrent), host(*cpu, stc.recurrent)), 1e-4) << "T " << T;
      EXPECT_EQ(test::relative_error(host(*gpu, stg.conv), host(*cpu, stc.conv)), 0.0) << "T " << T;
    }
  }
}

// MXFP4 comes only as routed experts' views; load_quantized takes affine and FP8 matrices.
TEST_F(Pair, LoadQuantizedRefusesMxfp4AndBadFp8) {
  std::vector<uint8_t> blocks(64 * 16), scales(64);
  const TensorView w{"mx", DType::U8, {64, 16}, blocks.data(), blocks.size()};
  const TensorView s{"mx.scales", DType::U8, {64, 1}, scales.data(), scales.size()};
  EXPECT_THROW(gpu->load_quantized(w, s, TensorView{}, kMxfp4Format), Error);
  HostMatrix hm = make_matrix(8, 100, "fp8g64", 1);
  EXPECT_THROW(gpu->load_quantized(hm.w, hm.s, TensorView{}, QuantFormat{8, 48, DType::F32, QuantScheme::Fp8}), Error);
  const TensorView short_scales{"w.scales", DType::F32, {8, 1}, hm.f32.data(), 8 * 4};
  EXPECT_THROW(gpu->load_quantized(hm.w, short_scales, TensorView{}, hm.quant), Error);
}

// Routed experts of one layer in host memory, each expert's three matrices in one block (the
// CUDA tier copies an expert as one extent, as it does from a pack), handed out as requested.
class HostExperts : public ExpertProvider {
 public:
  HostExperts(int n, int64_t dim, int64_t inter, const std::string& format, uint32_t seed) {
    for (int e = 0; e < n; ++e) {
      const uint32_t s = seed + 10 * uint32_t(e);
      Expert& x = experts_.emplace_back();
      x.m = {make_matrix(inter, dim, format, s), make_matrix(inter, dim, format, s + 1), make_matrix(dim, inter, format, s + 2)};
      // The arrays of each matrix: data, scales, biases (empty where the format has none).
      std::vector<std::pair<const void*, size_t>> parts;
      for (const HostMatrix& m : x.m) {
        if (!m.codes.empty()) parts.push_back({m.codes.data(), m.codes.size()});
        else if (!m.words.empty()) parts.push_back({m.words.data(), m.words.size() * 4});
        else if (!m.half.empty()) parts.push_back({m.half.data(), m.half.size() * 2});
        else parts.push_back({m.f32.data(), m.f32.size() * 4});
        if (!m.exponents.empty()) parts.push_back({m.exponents.data(), m.exponents.size()});
        else if (!m.scales.empty()) parts.push_back({m.scales.data(), m.scales.size() * 2});
        else if (!m.codes.empty()) parts.push_back({m.f32.data(), m.f32.size() * 4});  // FP8's scales
        else parts.push_back({nullptr, 0});
        parts.push_back({m.biases.empty() ? nullptr : m.biases.data(), m.biases.size() * 2});
      }
      std::vector<size_t> at;
      size_t total = 0;
      for (auto& [ptr, bytes] : parts) {
        at.push_back(total);
        total += (bytes + 255) / 256 * 256;
      }
      x.block.resize(total / 8 + 1);
      char* base = reinterpret_cast<char*>(x.block.data());
      for (size_t i = 0; i < parts.size(); ++i)
        if (parts[i].first) std::memcpy(base + at[i], parts[i].first, parts[i].second);
      Matrix* views[3] = {&x.w.gate, &x.w.up, &x.w.down};
      for (int j = 0; j < 3; ++j) {
        const HostMatrix& m = x.m[size_t(j)];
        Matrix& v = *views[j];
        v.name = "expert " + std::to_string(e);
        v.rows = j < 2 ? inter : dim;
        v.cols = j < 2 ? dim : inter;
        v.quant = m.quant;
        v.dtype = format == "f32" ? DType::F32 : format == "bf16" ? DType::BF16 : format == "f16" ? DType::F16
                  : format == "mxfp4" ? DType::U8 : format.rfind("fp8", 0) == 0 ? DType::F8_E4M3 : DType::U32;
        v.data = base + at[size_t(3 * j)];
        v.scales = parts[size_t(3 * j + 1)].first ? base + at[size_t(3 * j + 1)] : nullptr;
        v.biases = parts[size_t(3 * j + 2)].first ? base + at[size_t(3 * j + 2)] : nullptr;
      }
    }
  }
  void request(int, std::span<const int> ids) override { pending_.assign(ids.begin(), ids.end()); }
  bool next(int& expert, MlpWeights& w) override {
    if (pending_.empty()) return false;
    expert = pending_.back();
    pending_.pop_back();
    w = experts_[size_t(expert)].w;
    return true;
  }
  void release(int) override {}

 private:
  struct Expert {
    std::vector<HostMatrix> m;
    std::vector<uint64_t> block;
    MlpWeights w;
  };
  std::vector<Expert> experts_;
  std::vector<int> pending_;
};

// The MoE layer for experts of every format against the CPU's float32, for one token (the decode
// kernels), a few, 37 (q4 and q8 in work items of 8 rows: lane_tokens), and enough that some
// experts take more than one pass of 32 tokens (the exact tensor-core kernels for quantized
// experts, the CUDA-core ones for plain); token rows scaled from 1e-3 to 1e3, widths with a
// half-empty last step of 64 columns and a partial row tile.
TEST_F(Pair, MoeEveryExpertFormat) {
  const int E = 8;
  for (const std::string& fmt : kFormats) {
    if (fmt == "f32" || fmt == "f16") continue;  // packs hold experts in bf16 or quantized
    SCOPED_TRACE(fmt);
    // Widths must be whole groups: the odd widths for the formats of 32-column groups.
    const bool g32 = fmt == "bf16" || fmt == "mxfp4" || fmt.find("g32") != std::string::npos;
    const int64_t dim = g32 ? 288 : 384, inter = g32 ? 160 : 256;
    HostExperts experts(E, dim, inter, fmt, 40);
    CudaOptions o;
    o.gpu_expert_mb = 64;
    o.total_experts = E;
    std::unique_ptr<Backend> g = make_cuda_backend(o);
    HostMatrix r = make_matrix(E, dim, "f32", 9);
    const Matrix rc = cpu->load_matrix(r.w), rg = g->load_matrix(r.w);
    MoeParams p;
    p.n_experts = E;
    p.top_k = 2;
    p.norm_topk_prob = true;
    for (int64_t T : {1, 5, 37, 150}) {
      std::vector<float> xv = random(size_t(T * dim), 11);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < dim; ++c) xv[size_t(t * dim + c)] *= std::pow(10.0f, float(t % 7) - 3.0f);
      Buffer xc = cpu->alloc(T, dim), xg = g->alloc(T, dim), oc = cpu->alloc(T, dim), og = g->alloc(T, dim);
      std::memcpy(xc.data, xv.data(), xv.size() * sizeof(float));
      ASSERT_EQ(cudaMemcpy(xg.data, xv.data(), xv.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
      cpu->moe(xc, rc, experts, p, oc);
      g->moe(xg, rg, experts, p, og);
      std::vector<float> want = host(*cpu, oc), got(want.size());
      g->to_host(og, got.data());
      // Each token against its own scale (rows differ by up to 10^6).
      double worst = 0;
      for (int64_t t = 0; t < T; ++t) {
        std::vector<float> a(got.begin() + t * dim, got.begin() + (t + 1) * dim);
        std::vector<float> b(want.begin() + t * dim, want.begin() + (t + 1) * dim);
        worst = std::max(worst, test::relative_error(a, b));
      }
      std::printf("[ moe      ] %s experts, T=%d: max rel err %.2e per token\n", fmt.c_str(), int(T), worst);
      EXPECT_LT(worst, 2e-5) << "T=" << T;
    }
  }
}

// A decode step of several tokens routes them in one launch (route_few, grid row per token) and
// runs its experts' rows on the tensor cores in chunks of up to 8 (few_mma_enabled; else chunks of
// an expert's rows against one read of its weights on the CUDA cores), resident or through the
// host round trip: each token's MoE output equals its lone step's within float32 rounding (1e-5 of
// its largest; bit for bit on the CUDA cores), for the routers the single-token tile reads, 160 experts (20 blocks a
// token), through the host round trip (first round) and resident (second), and the two rounds
// agree bit for bit (how a call's experts are batched does not change any row). Tokens repeat in
// the second half of the inputs, so that experts get 2 to 8 rows (chunks with a remainder, and
// several chunks of one expert), and a repeated token gets its first's output bit for bit. The
// experts in q4 (groups of 64: k-blocks of 64 columns; of 32: k-blocks of 32; F16 scales) and q8:
// the lane-decoded kernels of each layout (expert_few_mma.cu), 4 to 8 k-blocks of gate/up and 1 or
// 2 of down.
TEST_F(Pair, MoeOfFewTokensMatchesLoneTokens) {
  const int E = 160;
  const int64_t dim = 256, inter = 64;
  const bool mma = cuda::few_mma_enabled();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"q4g64", "bf16"}, {"q4g64", "q8g64"}, {"q4g32", "bf16"}, {"q4g64-f16", "bf16"}, {"q8g64", "bf16"}};
  for (const auto& [expert_fmt, fmt] : cases) {
    HostExperts experts(E, dim, inter, expert_fmt, 48);
    CudaOptions o;
    o.gpu_expert_mb = 64;
    o.total_experts = E;
    std::unique_ptr<Backend> g = make_cuda_backend(o);
    HostMatrix r = make_matrix(E, dim, fmt, 49);
    const Matrix rg = load(*g, r, fmt);
    MoeParams p;
    p.n_experts = E;
    p.top_k = 6;
    p.norm_topk_prob = true;
    std::map<int64_t, std::vector<float>> first_round;
    for (int round = 0; round < 2; ++round) {
      for (int64_t T : {2, 5, 8, -3, -5, -8}) {
        const int64_t key = T;
        const int64_t distinct = T > 0 ? T : T == -8 ? 1 : 2;  // rows of x before they repeat
        T = T > 0 ? T : -T;
        SCOPED_TRACE(expert_fmt + " experts, " + fmt + " router, round " + std::to_string(round) + " T=" +
                     std::to_string(T) + " distinct " + std::to_string(distinct));
        const std::vector<float> rows = random(size_t(distinct * dim), uint32_t(50 + T + distinct));
        std::vector<float> xv(size_t(T * dim));
        for (int64_t t = 0; t < T; ++t)
          std::copy_n(rows.begin() + (t % distinct) * dim, dim, xv.begin() + t * dim);
        Buffer x = g->alloc(T, dim), out = g->alloc(T, dim), lone = g->alloc(1, dim);
        ASSERT_EQ(cudaMemcpy(x.data, xv.data(), xv.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
        g->moe(x, rg, experts, p, out);
        const std::vector<float> all = host(*g, out);
        if (round == 0) first_round[key] = all;
        else EXPECT_EQ(all, first_round[key]) << "resident against the host round trip";
        for (int64_t t = 0; t < T; ++t) {
          g->moe(x.rows_view(t, 1), rg, experts, p, lone);
          const std::vector<float> want = host(*g, lone);
          const std::vector<float> got(all.begin() + t * dim, all.begin() + (t + 1) * dim);
          if (mma) EXPECT_LT(test::relative_error(got, want), 1e-5) << "token " << t;  // two products
          else EXPECT_EQ(got, want) << "token " << t;
          EXPECT_TRUE(std::equal(got.begin(), got.end(), all.begin() + (t % distinct) * dim)) << "token " << t;
        }
      }
    }
  }
}

// The lane kernels split each row's columns across a block's warps (2 to 4 parts of whole 128-byte
// lines: gate/up over 1,024 columns 4 parts, down over 384 or 768 columns 2 or 3; q8 twice the
// lines) and add the parts in warp order. Every expert staged (the default where the arrays are
// aligned) equals, bit for bit, the kernels that check each expert, whose resident experts take
// their own loads over the same k-blocks (MOESTREAM_CUDA_EXPERT_SPLIT=mixed); the blocks of whole
// rows (MOESTREAM_CUDA_EXPERT_SPLIT=0) and each token's lone step agree within float32 rounding.
// Down runs as a stream of items a block (down_stream_kernel, every expert staged), bit for bit its
// split kernel (MOESTREAM_CUDA_DOWN_STREAM=0), with its grid of item rows as the SMs hold it or
// capped at 2 (many items a block, both scale buffers reused).
TEST_F(Pair, SplitExpertKernelsEqualTheirDirectLoadsAndLoneTokens) {
  if (!cuda::few_mma_enabled()) GTEST_SKIP() << "the few-token tensor-core paths are off";
  constexpr int E = 24;
  constexpr int64_t dim = 1024;
  for (const std::string fmt : {"q4g64", "q4g32", "q4g64-f16", "q8g64"})
    for (int64_t inter : {384, 768}) {
      SCOPED_TRACE(fmt + " inter " + std::to_string(inter));
      HostExperts experts(E, dim, inter, fmt, 141);
      CudaOptions o;
      o.gpu_expert_mb = 96;
      o.total_experts = E;
      std::unique_ptr<Backend> g = make_cuda_backend(o);
      const Matrix rg = load(*g, make_matrix(E, dim, "bf16", 142), "bf16");
      MoeParams p;
      p.n_experts = E;
      p.top_k = 6;
      p.norm_topk_prob = true;
      constexpr int64_t T = 8;
      const std::vector<float> xv = random(size_t(T * dim), 143);
      Buffer x = g->alloc(T, dim), out = g->alloc(T, dim), lone = g->alloc(1, dim);
      ASSERT_EQ(cudaMemcpy(x.data, xv.data(), xv.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
      auto run = [&](const char* split, const char* stream = nullptr) {
        if (split) setenv("MOESTREAM_CUDA_EXPERT_SPLIT", split, 1);
        if (stream) setenv("MOESTREAM_CUDA_DOWN_STREAM", stream, 1);
        g->moe(x, rg, experts, p, out);
        unsetenv("MOESTREAM_CUDA_EXPERT_SPLIT");
        unsetenv("MOESTREAM_CUDA_DOWN_STREAM");
        return host(*g, out);
      };
      run(nullptr);  // the experts into VRAM
      const uint64_t streams = cuda::down_stream_launches();
      const std::vector<float> staged = run(nullptr);
      EXPECT_GT(cuda::down_stream_launches(), streams) << "down's stream kernel taken";
      const std::vector<float> split = run(nullptr, "0"), capped = run(nullptr, "2"),
                               mixed = run("mixed"), whole = run("0");
      EXPECT_EQ(staged, split) << "down's stream against its split kernel";
      EXPECT_EQ(staged, capped) << "two item rows of stream blocks";
      EXPECT_EQ(staged, mixed) << "the staging against the direct loads";
      EXPECT_LT(test::relative_error(staged, whole), 1e-5);
      EXPECT_NE(staged, whole) << "the same sums: the split kernels were not taken";
      for (int64_t t = 0; t < T; ++t) {
        g->moe(x.rows_view(t, 1), rg, experts, p, lone);
        const std::vector<float> got(staged.begin() + t * dim, staged.begin() + (t + 1) * dim);
        EXPECT_LT(test::relative_error(got, host(*g, lone)), 1e-5) << "token " << t;
      }
    }
}

// A batched step's RMSNorm splits its rows for the tensor-core products after it (NormSplit): q, k
// and v and the experts take those instead of splitting x themselves, with the same values, so
// every output equals, bit for bit, a backend that never does (MOESTREAM_CUDA_NORM_SPLIT=0). q4 asks
// for q4's column order, q8 for the plain one (a norm's first split is in q4's order, then it
// learns). A write to the norm's output between it and the product (copy_rows here) drops the split.
TEST_F(Pair, NormSplitEqualsTheProductsOwnSplit) {
  if (!cuda::few_mma_enabled()) GTEST_SKIP() << "the few-token tensor-core paths are off";
  constexpr int E = 16;
  constexpr int64_t inter = 64;
  MoeParams p;
  p.n_experts = E;
  p.top_k = 4;
  p.norm_topk_prob = true;
  for (const std::string fmt : {"q4g64", "q8g64"})
    for (int64_t dim : {256, 2048}) {
      // backends of their own: the expert tier sizes its slots by the first experts it sees
      CudaOptions o;
      o.gpu_expert_mb = 64;
      o.total_experts = E;
      setenv("MOESTREAM_CUDA_NORM_SPLIT", "0", 1);
      std::unique_ptr<Backend> plain = make_cuda_backend(o);
      unsetenv("MOESTREAM_CUDA_NORM_SPLIT");
      std::unique_ptr<Backend> split = make_cuda_backend(o);
      const Qkv m(*plain, *split, fmt, {160, 48, 40}, dim, 41);
      HostExperts experts0(E, dim, inter, fmt, 48), experts1(E, dim, inter, fmt, 48);
      HostExperts* experts[2] = {&experts0, &experts1};
      const HostMatrix router = make_matrix(E, dim, "bf16", 49);
      const Matrix routers[2] = {load(*plain, router, "bf16"), load(*split, router, "bf16")};
      const std::vector<float> wv = random(size_t(dim), 3);
      const TensorView wt{"norm", DType::F32, {dim}, wv.data(), wv.size() * 4};
      for (int64_t T : {2, 8}) {
        SCOPED_TRACE(fmt + " dim " + std::to_string(dim) + " T=" + std::to_string(T));
        // norms of their own each time: each learns what the product after it asks for
        const Vector norms[2] = {plain->load_vector(wt), split->load_vector(wt)};
        const std::vector<float> rv = random(size_t(T * dim), 4), yv = random(size_t(T * dim), 5, 0.5f),
                                 other = random(size_t(T * dim), 6);
        const uint64_t before = gpu_tier_stats(*split)->norm_splits;
        std::vector<std::vector<float>> outs[2];
        for (int b = 0; b < 2; ++b) {
          Backend& be = b ? *split : *plain;
          auto up = [&](const std::vector<float>& v) {
            Buffer d = be.alloc(T, dim);
            EXPECT_EQ(cudaMemcpy(d.data, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
            return d;
          };
          Buffer r = up(rv), y = up(yv), ob = up(other), xn = be.alloc(T, dim), mo = be.alloc(T, dim);
          Buffer q = be.alloc(T, 160), k = be.alloc(T, 48), v = be.alloc(T, 40);
          const Matrix* w3[3] = {&(b ? m.g : m.c)[0], &(b ? m.g : m.c)[1], &(b ? m.g : m.c)[2]};
          const Vector* b3[3] = {nullptr, nullptr, b ? &m.bg : &m.bc};
          Buffer* o3[3] = {&q, &k, &v};
          // twice each: a q8 norm's first split is in q4's order and is not taken; its second is
          for (int round = 0; round < 2; ++round) {
            be.add_rmsnorm(r, y, norms[b], 1e-6f, xn);
            be.linear_shared_input(xn, w3, b3, o3);
            outs[b].push_back(host(be, q));
            outs[b].push_back(host(be, v));
          }
          const Vector moe_norm = be.load_vector(wt);  // another norm, learning on its own
          for (int round = 0; round < 2; ++round) {
            be.add_rmsnorm(r, y, moe_norm, 1e-6f, xn);
            be.moe(xn, routers[b], *experts[b], p, mo);
            outs[b].push_back(host(be, mo));
          }
          // the norm's output overwritten before the product: q is of what was copied in
          be.add_rmsnorm(r, y, norms[b], 1e-6f, xn);
          be.copy_rows(ob, xn, T);
          be.linear(xn, *w3[0], nullptr, q);
          outs[b].push_back(host(be, q));
          outs[b].push_back(host(be, r));
          be.linear(ob, *w3[0], nullptr, q);
          outs[b].push_back(host(be, q));
        }
        for (size_t i = 0; i < outs[0].size(); ++i) EXPECT_EQ(outs[1][i], outs[0][i]) << "output " << i;
        EXPECT_EQ(outs[1][outs[1].size() - 3], outs[1].back()) << "the norm's split outlived a write to its rows";
        // taken by q, k, v in both rounds in q4, in the second in q8; by the experts the same
        EXPECT_EQ(gpu_tier_stats(*split)->norm_splits - before, fmt == "q4g64" ? 4u : 2u);
      }
      EXPECT_EQ(gpu_tier_stats(*plain)->norm_splits, 0u);
    }
}

// Qwen3.5's MoE block with one token: its shared expert on a second stream beside the routed
// experts (moe_gated_shared) gives the two calls' output bit for bit, call after call (the streams
// fork and join each time), and a few tokens (one stream) too; resident experts and experts read
// through the host.
TEST_F(Pair, MoeBlockWithSharedExpertEqualsItsParts) {
  const int E = 64;
  const int64_t dim = 256, inter = 64;
  for (const int vram_mb : {64, 0}) {
    SCOPED_TRACE("VRAM tier of " + std::to_string(vram_mb) + " MB");
    HostExperts experts(E, dim, inter, "q4g64", 71);
    CudaOptions o;
    o.gpu_expert_mb = vram_mb;
    o.total_experts = E;
    std::unique_ptr<Backend> g = make_cuda_backend(o);
    const Matrix router = load(*g, make_matrix(E, dim, "bf16", 72), "bf16");
    HostMatrix sg = make_matrix(128, dim, "bf16", 73), su = make_matrix(128, dim, "bf16", 74),
               sd = make_matrix(dim, 128, "bf16", 75), gate = make_matrix(1, dim, "bf16", 76);
    const MlpWeights shared{load(*g, sg, "bf16"), load(*g, su, "bf16"), load(*g, sd, "bf16"), {}, {}, {}};
    const Matrix gate_g = load(*g, gate, "bf16");
    MoeParams p;
    p.n_experts = E;
    p.top_k = 8;
    p.norm_topk_prob = true;
    for (int64_t T : {1, 1, 1, 3}) {
      SCOPED_TRACE("T=" + std::to_string(T));
      const std::vector<float> xv = random(size_t(T * dim), uint32_t(80 + T));
      Buffer x = g->alloc(T, dim), out = g->alloc(T, dim), parts = g->alloc(T, dim);
      Buffer s = g->alloc(T, dim), s2 = g->alloc(T, dim), gv = g->alloc(T, 1), gv2 = g->alloc(T, 1);
      ASSERT_EQ(cudaMemcpy(x.data, xv.data(), xv.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
      g->moe_gated_shared(x, router, experts, p, shared, gate_g, s, gv, out);
      g->Backend::moe_gated_shared(x, router, experts, p, shared, gate_g, s2, gv2, parts);
      EXPECT_EQ(host(*g, out), host(*g, parts));
    }
  }
}

// One token's router logits and routing in one launch (moe.cu's route_few) for routers the
// single-token tile reads: 160 experts make 10-20 blocks, of which the last to finish routes;
// 512 (Qwen3.5-397B-A17B's) take the logits and route_kernel; five calls in a row (route_few's
// counter of finished blocks must start at 0 each time), the three router kinds (grouped sigmoid with its bias), against the CPU; "ties": a
// router whose rows repeat in threes, so that the k-th pick splits equal scores (the lower id
// wins, as the CPU's). A wrong expert would move a token's output by far more than 2e-5.
TEST_F(Pair, OneTokenRouterOfManyExpertsMatchesTheCpu) {
  for (const int E : {160, 512}) {
    const int64_t dim = 256, inter = 64;
    HostExperts experts(E, dim, inter, "q4g64", 41);
    const std::vector<float> bias_values = random(size_t(E), 42);
    const TensorView bias_view{"e_score_correction_bias", DType::F32, {E}, bias_values.data(), bias_values.size() * 4};
    const Vector bias_c = cpu->load_vector(bias_view);
    for (const std::string name : {"bf16", "q8g64", "q4g64", "ties"})
      for (RouterKind kind : {RouterKind::SoftmaxTopK, RouterKind::TopKSoftmax, RouterKind::SigmoidGroupTopK}) {
        SCOPED_TRACE(std::to_string(E) + " experts, " + name + " router kind " + std::to_string(int(kind)));
        const std::string fmt = name == "ties" ? "bf16" : name;
        CudaOptions o;
        o.gpu_expert_mb = 64;
        o.total_experts = E;
        std::unique_ptr<Backend> g = make_cuda_backend(o);
        HostMatrix r = make_matrix(E, dim, fmt, 9);
        if (name == "ties")
          for (int64_t e = 0; e < E; ++e)
            std::copy_n(r.half.begin() + (e / 3 * 3) * dim, dim, r.half.begin() + e * dim);
        const Matrix rc = load(*cpu, r, fmt), rg = load(*g, r, fmt);
        const Vector bias_g = g->load_vector(bias_view);
        MoeParams p;
        p.n_experts = E;
        p.top_k = 8;
        p.router = kind;
        p.norm_topk_prob = true;
        if (kind == RouterKind::SigmoidGroupTopK) {
          p.n_group = 8;
          p.topk_group = 4;
          p.routed_scaling_factor = 2.5f;
        }
        MoeParams pc = p;
        if (kind == RouterKind::SigmoidGroupTopK) {
          p.router_bias = &bias_g;
          pc.router_bias = &bias_c;
        }
        for (int call = 0; call < 5; ++call) {
          const std::vector<float> xv = random(size_t(dim), 50 + uint32_t(call));
          Buffer xc = cpu->alloc(1, dim), xg = g->alloc(1, dim), oc = cpu->alloc(1, dim), og = g->alloc(1, dim);
          std::memcpy(xc.data, xv.data(), xv.size() * sizeof(float));
          ASSERT_EQ(cudaMemcpy(xg.data, xv.data(), xv.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
          cpu->moe(xc, rc, experts, pc, oc);
          g->moe(xg, rg, experts, p, og);
          EXPECT_LT(test::relative_error(host(*g, og), host(*cpu, oc)), 2e-5) << "call " << call;
        }
      }
  }
}

// The fused steps of backend.h against the ops they replace, on the GPU (bit for bit: the model
// code uses them wherever it can, so they must not move a logit) and against the CPU.
TEST_F(Pair, FusedStepsEqualTheirParts) {
  auto same = [&](const Buffer& a, const Buffer& b) { return host(*gpu, a) == host(*gpu, b); };
  // q, k and v projections in one launch (GEMV sizes) or, above the GEMV bound, one by one.
  for (const std::string fmt : {"bf16", "q4g64", "fp8g128"}) {
    const Qkv m(*cpu, *gpu, fmt, {64, 32, 48}, 256, 31);
    for (int64_t T : {1, 3, 12}) {
      Buf x = buf(T, 256, 35);
      Buf oq = poisoned(T, 64), ok = poisoned(T, 32), ov = poisoned(T, 48);
      m.run(*cpu, *gpu, x.c, x.g, {&oq.c, &ok.c, &ov.c}, {&oq.g, &ok.g, &ov.g});
      Buffer lq = gpu->alloc(T, 64), lk = gpu->alloc(T, 32), lv = gpu->alloc(T, 48);
      gpu->linear(x.g, m.g[0], nullptr, lq);
      gpu->linear(x.g, m.g[1], nullptr, lk);
      gpu->linear(x.g, m.g[2], &m.bg, lv);
      EXPECT_TRUE(same(oq.g, lq) && same(ok.g, lk) && same(ov.g, lv)) << fmt << " T=" << T;
      EXPECT_LT(std::max({err(oq), err(ok), err(ov)}), linear_tolerance(T)) << fmt << " T=" << T;
    }
  }
  // Residual add and the next RMSNorm.
  for (int64_t T : {1, 5}) {
    std::vector<float> xv = random(size_t(T * 2048), 36), wv = random(2048, 37);
    const TensorView wt{"w", DType::F32, {2048}, wv.data(), 2048 * 4};
    const Vector wg = gpu->load_vector(wt), wc = cpu->load_vector(wt);
    Buf x = buf(T, 2048, xv), y = buf(T, 2048, 38), out = poisoned(T, 2048);
    Buf x2 = buf(T, 2048, xv), out2 = poisoned(T, 2048);
    gpu->add_rmsnorm(x.g, y.g, wg, 1e-6f, out.g);
    cpu->add_rmsnorm(x.c, y.c, wc, 1e-6f, out.c);
    gpu->add(x2.g, y.g);
    gpu->rmsnorm(x2.g, wg, 1e-6f, 2048, out2.g);
    EXPECT_TRUE(same(x.g, x2.g) && same(out.g, out2.g)) << "T=" << T;
    EXPECT_LT(err(out), 1e-5);
  }
  // Per-head q/k norms and RoPE (rotating all of each head, or part of it after an offset).
  for (int head_dim : {64, 128}) {
    for (bool partial : {false, true}) {
      RopeTable r;
      r.rot_dim = partial ? 32 : head_dim;
      r.rot_offset = partial ? 16 : 0;
      r.interleaved = partial;
      for (int i = 0; i < r.rot_dim / 2; ++i) r.inv_freq.push_back(1.0f / std::pow(10000.0f, float(2 * i) / float(r.rot_dim)));
      std::vector<float> qn = random(size_t(head_dim), 40), kn = random(size_t(head_dim), 41);
      const TensorView qt{"qn", DType::F32, {head_dim}, qn.data(), qn.size() * 4}, kt{"kn", DType::F32, {head_dim}, kn.data(), kn.size() * 4};
      const Vector qg = gpu->load_vector(qt), kg = gpu->load_vector(kt), qc = cpu->load_vector(qt), kc = cpu->load_vector(kt);
      for (bool norms : {true, false}) {
        const int64_t T = 3;
        std::vector<float> qv = random(size_t(T * 8 * head_dim), 42), kv = random(size_t(T * 2 * head_dim), 43);
        Buf q = buf(T, 8 * head_dim, qv), k = buf(T, 2 * head_dim, kv), q2 = buf(T, 8 * head_dim, qv), k2 = buf(T, 2 * head_dim, kv);
        const Vector none;
        gpu->qk_norm_rope(q.g, k.g, norms ? qg : none, norms ? kg : none, 1e-6f, 8, 2, head_dim, r, 77);
        cpu->qk_norm_rope(q.c, k.c, norms ? qc : none, norms ? kc : none, 1e-6f, 8, 2, head_dim, r, 77);
        if (norms) {
          gpu->rmsnorm(q2.g, qg, 1e-6f, head_dim, q2.g);
          gpu->rmsnorm(k2.g, kg, 1e-6f, head_dim, k2.g);
        }
        gpu->rope(q2.g, 8, head_dim, r, 77);
        gpu->rope(k2.g, 2, head_dim, r, 77);
        EXPECT_TRUE(same(q.g, q2.g) && same(k.g, k2.g)) << head_dim << " partial " << partial << " norms " << norms;
        EXPECT_LT(std::max(err(q), err(k)), 1e-5) << head_dim << " partial " << partial << " norms " << norms;
      }
    }
  }
}

// A batched decode step's rows against lone one-token steps: quantized weights through the GEMV
// of up to 8 tokens in one pass (bit for bit: each token's sums are the lone token's), BF16
// weights on the tensor cores from 2 tokens (float32 rounding), and attention_batch's three
// launches for several sequences (bit for bit against the span-by-span calls).
TEST_F(Pair, BatchedDecodeRowsEqualLoneRows) {
  auto same = [&](const Buffer& a, const Buffer& b) { return host(*gpu, a) == host(*gpu, b); };
  for (const std::string fmt : {"bf16", "q4g64", "fp8g128"}) {
    const Matrix w = load(*gpu, make_matrix(96, 512, fmt, 61), fmt);
    for (int64_t T : {2, 5, 8}) {
      Buf x = buf(T, 512, 62);
      Buffer all = gpu->alloc(T, 96);
      gpu->linear(x.g, w, nullptr, all);
      for (int64_t t = 0; t < T; ++t) {
        Buffer one = gpu->alloc(1, 96);
        gpu->linear(x.g.rows_view(t, 1), w, nullptr, one);
        if (fmt == "bf16" || few_mma(w, T, x.g))
          EXPECT_LT(test::relative_error(host(*gpu, all.rows_view(t, 1)), host(*gpu, one)), fmt == "bf16" ? 1e-6 : 2e-6)
              << fmt << " T=" << T;
        else
          EXPECT_TRUE(same(all.rows_view(t, 1), one)) << fmt << " T=" << T << " row " << t;
      }
    }
  }
  const int heads = 8, kv_heads = 2, hd = 128, cap = 32;
  RopeTable r;
  r.rot_dim = hd;
  for (int i = 0; i < hd / 2; ++i) r.inv_freq.push_back(1.0f / std::pow(10000.0f, float(2 * i) / float(hd)));
  std::vector<float> qn = random(hd, 63), kn = random(hd, 64);
  const TensorView qt{"qn", DType::F32, {hd}, qn.data(), qn.size() * 4}, kt{"kn", DType::F32, {hd}, kn.data(), kn.size() * 4};
  const Vector qg = gpu->load_vector(qt), kg = gpu->load_vector(kt);
  AttentionParams p;
  p.n_heads = heads;
  p.n_kv_heads = kv_heads;
  p.head_dim = hd;
  p.scale = 1.0f / std::sqrt(float(hd));
  const std::vector<int64_t> n_past = {5, 0, 17};
  const int64_t S = int64_t(n_past.size());
  std::vector<float> qv = random(size_t(S * heads * hd), 65), kv = random(size_t(S * kv_heads * hd), 66),
                     vv = random(size_t(S * kv_heads * hd), 67);
  Buf q = buf(S, heads * hd, qv), k = buf(S, kv_heads * hd, kv), v = buf(S, kv_heads * hd, vv);
  Buf q2 = buf(S, heads * hd, qv), k2 = buf(S, kv_heads * hd, kv), v2 = buf(S, kv_heads * hd, vv);
  std::vector<Buf> kc, vc, kc2, vc2;
  for (int64_t i = 0; i < S; ++i) {
    const std::vector<float> ck = random(size_t(cap * kv_heads * hd), 70 + uint32_t(i)),
                             cv = random(size_t(cap * kv_heads * hd), 80 + uint32_t(i));
    kc.push_back(buf(cap, kv_heads * hd, ck));
    vc.push_back(buf(cap, kv_heads * hd, cv));
    kc2.push_back(buf(cap, kv_heads * hd, ck));
    vc2.push_back(buf(cap, kv_heads * hd, cv));
  }
  std::vector<AttentionSpan> spans, spans2;
  for (int64_t i = 0; i < S; ++i) {
    spans.push_back({i, 1, n_past[size_t(i)], &kc[size_t(i)].g, &vc[size_t(i)].g});
    spans2.push_back({i, 1, n_past[size_t(i)], &kc2[size_t(i)].g, &vc2[size_t(i)].g});
  }
  Buf out = poisoned(S, heads * hd), out2 = poisoned(S, heads * hd);
  gpu->attention_batch(q.g, k.g, v.g, qg, kg, 1e-6f, r, spans, p, out.g);
  gpu->Backend::attention_batch(q2.g, k2.g, v2.g, qg, kg, 1e-6f, r, spans2, p, out2.g);
  EXPECT_TRUE(same(q.g, q2.g) && same(k.g, k2.g)) << "rotated q, k";
  EXPECT_TRUE(same(out.g, out2.g)) << "attention";
  for (int64_t i = 0; i < S; ++i)
    EXPECT_TRUE(same(kc[size_t(i)].g, kc2[size_t(i)].g) && same(vc[size_t(i)].g, vc2[size_t(i)].g)) << "caches of " << i;
  // And against the CPU's span-by-span calls.
  const Vector qc = cpu->load_vector(qt), kcn = cpu->load_vector(kt);
  std::vector<AttentionSpan> cspans;
  for (int64_t i = 0; i < S; ++i) cspans.push_back({i, 1, n_past[size_t(i)], &kc[size_t(i)].c, &vc[size_t(i)].c});
  cpu->attention_batch(q.c, k.c, v.c, qc, kcn, 1e-6f, r, cspans, p, out.c);
  EXPECT_LT(err(out), 1e-5);
}

// MOESTREAM_CUDA_PROFILE=1: at the backend's end, GPU time per operation on stderr, with the
// weight bytes read per second of each linear layer (the first call of each apart).
TEST_F(Pair, ProfileByOperation) {
  ::setenv("MOESTREAM_CUDA_PROFILE", "1", 1);
  std::unique_ptr<Backend> prof = make_cuda_backend(CudaOptions{});
  ::unsetenv("MOESTREAM_CUDA_PROFILE");
  HostMatrix hm = make_matrix(64, 256, "bf16", 5);
  Matrix w = load(*prof, hm, "bf16");
  Buffer x = prof->alloc(1, 256), y = prof->alloc(1, 64);
  for (int i = 0; i < 3; ++i) prof->linear(x, w, nullptr, y);
  prof->rmsnorm(y, prof->load_vector(TensorView{"n", DType::F32, {64}, hm.f32.data(), 64 * 4}), 1e-6f, 64, y);
  ::testing::internal::CaptureStderr();
  prof.reset();
  const std::string table = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(table.find("GPU time by operation"), std::string::npos) << table;
  EXPECT_NE(table.find("        2 "), std::string::npos) << table;  // three linear calls: the first apart
  EXPECT_NE(table.find("linear [64 x 256 BF16] T=1"), std::string::npos) << table;
  EXPECT_NE(table.find("rmsnorm T=1"), std::string::npos) << table;
}

}  // namespace
}  // namespace moestream
