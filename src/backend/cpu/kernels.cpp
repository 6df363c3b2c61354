#include "backend/cpu/kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "backend/cpu/quant_kernels.h"
#include "core/error.h"
#include "core/quant.h"

namespace moestream::cpu {

namespace {

bool cpu_has(KernelLevel level) {
  __builtin_cpu_init();  // needed when this runs during static initialization
  switch (level) {
    case KernelLevel::Scalar:
      return true;
    case KernelLevel::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case KernelLevel::Avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
             cpu_has(KernelLevel::Avx2);
  }
  return false;
}

KernelLevel initial_level() {
  KernelLevel level = best_kernel_level();
  const char* env = std::getenv("MOESTREAM_KERNELS");
  if (env && *env) {
    const std::string want = env;
    KernelLevel asked;
    if (want == "scalar") {
      asked = KernelLevel::Scalar;
    } else if (want == "avx2") {
      asked = KernelLevel::Avx2;
    } else if (want == "avx512") {
      asked = KernelLevel::Avx512;
    } else {
      fail("MOESTREAM_KERNELS='", want, "': expected scalar, avx2 or avx512");
    }
    if (!cpu_has(asked))
      fail("MOESTREAM_KERNELS=", want, ": this CPU does not support it (best: ",
           kernel_level_name(level), ")");
    level = asked;
  }
  return level;
}

std::atomic<KernelLevel>& current_level() {
  static std::atomic<KernelLevel> level{initial_level()};
  return level;
}

const detail::LevelKernels& kernels_for(KernelLevel level) {
  switch (level) {
    case KernelLevel::Avx512: return detail::avx512_kernels();
    case KernelLevel::Avx2: return detail::avx2_kernels();
    default: return detail::scalar_kernels();
  }
}
const detail::LevelKernels& active() { return kernels_for(kernel_level()); }

void check_matrix(const Matrix& w) {
  if (w.quant.bits == 0) {
    if (w.dtype != DType::F32 && w.dtype != DType::BF16 && w.dtype != DType::F16)
      fail("weight ", w.name, ": dtype ", dtype_name(w.dtype), " has no CPU kernel");
    return;
  }
  check_quant_shape(w.quant, w.cols, w.name);
  if (w.quant.scheme == QuantScheme::Fp8) {
    if (w.dtype != DType::F8_E4M3) fail("weight ", w.name, ": FP8 codes must be F8_E4M3, found ", dtype_name(w.dtype));
    if (!w.scales) fail("weight ", w.name, ": FP8 weights need their scales");
    return;
  }
  if (w.quant.scheme == QuantScheme::Mxfp4) {
    if (w.dtype != DType::U8) fail("weight ", w.name, ": MXFP4 codes must be U8, found ", dtype_name(w.dtype));
    if (!w.scales) fail("weight ", w.name, ": MXFP4 weights need their exponents");
    return;
  }
  if (w.dtype != DType::U32)
    fail("weight ", w.name, ": quantized weights must be U32 words, found ", dtype_name(w.dtype));
  if (!w.scales || !w.biases)
    fail("weight ", w.name, ": quantized weights need scales and biases");
}

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

std::string_view kernel_level_name(KernelLevel level) {
  switch (level) {
    case KernelLevel::Scalar: return "scalar";
    case KernelLevel::Avx2: return "avx2";
    case KernelLevel::Avx512: return "avx512";
  }
  return "?";
}

bool kernel_level_supported(KernelLevel level) { return cpu_has(level); }

KernelLevel best_kernel_level() {
  if (cpu_has(KernelLevel::Avx512)) return KernelLevel::Avx512;
  if (cpu_has(KernelLevel::Avx2)) return KernelLevel::Avx2;
  return KernelLevel::Scalar;
}

KernelLevel kernel_level() { return current_level().load(std::memory_order_relaxed); }

void set_kernel_level(KernelLevel level) {
  if (!cpu_has(level))
    fail("kernel level ", kernel_level_name(level), " is not supported by this CPU (best: ",
         kernel_level_name(best_kernel_level()), ")");
  current_level().store(level, std::memory_order_relaxed);
}

float dot_f32(const float* a, const float* b, int64_t n) { return active().dot_f32(a, b, n); }

void axpy(float a, const float* x, float* y, int64_t n) { active().axpy(a, x, y, n); }

void row_to_f32(const Matrix& w, int64_t row, float* dst) {
  check_matrix(w);
  const int64_t n = w.cols;
  if (detail::is_mxfp4(w)) {
    dequantize_mxfp4_row(n, detail::row_codes(w, row), detail::row_exponents(w, row), dst);
    return;
  }
  if (detail::is_fp8(w)) {
    dequantize_fp8_row(n, w.quant.group_size, detail::row_fp8_codes(w, row), detail::row_fp8_scales(w, row), dst);
    return;
  }
  if (w.quant.bits > 0) {
    dequantize_row(w.quant, n, static_cast<const uint32_t*>(w.data) +
                                   row * quant_words_per_row(w.quant, n),
                   detail::row_scales(w, row), detail::row_biases(w, row), dst);
    return;
  }
  switch (w.dtype) {
    case DType::F32: {
      const float* src = static_cast<const float*>(w.data) + row * n;
      std::copy(src, src + n, dst);
      return;
    }
    case DType::BF16: {
      const uint16_t* src = static_cast<const uint16_t*>(w.data) + row * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
      return;
    }
    default: {
      const uint16_t* src = static_cast<const uint16_t*>(w.data) + row * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
      return;
    }
  }
}

float dot_row(const Matrix& w, int64_t row, const float* x) {
  check_matrix(w);
  if (w.quant.bits == 0 && w.dtype == DType::F32)
    return dot_f32(static_cast<const float*>(w.data) + row * w.cols, x, w.cols);
  thread_local std::vector<float> buf;
  buf.resize(size_t(w.cols));
  row_to_f32(w, row, buf.data());
  return dot_f32(buf.data(), x, w.cols);
}

void prepare_input(const Matrix& w, const float* x, int64_t T, bool precise, PreparedInput& in) {
  check_matrix(w);
  in.x = x;
  in.T = T;
  in.cols = w.cols;
  in.precise = precise;
  in.level = kernel_level();
  in.bits = w.quant.bits;
  in.group_size = w.quant.group_size;
  if (in.bits == 0 || detail::is_fp8(w)) return;  // float32 activations as they are

  const int64_t cols = w.cols;
  const int gs = w.quant.group_size;
  const detail::CodeOrder order = detail::code_order(in.level, in.bits, precise);
  in.stride = round_up(cols, 64);
  in.group_stride = round_up(cols / gs, 16);
  if (precise) {
    in.xf.resize(size_t(T * in.stride));
    for (int64_t t = 0; t < T; ++t) {
      float* dst = in.xf.data() + t * in.stride;
      if (order == detail::CodeOrder::Natural) {
        std::copy(x + t * cols, x + (t + 1) * cols, dst);
      } else {
        int position[32];
        for (int e = 0; e < 32; ++e) position[e] = detail::position_in_block(order, e);
        for (int64_t b = 0; b < cols; b += 32)
          for (int e = 0; e < 32; ++e) dst[b + position[e]] = x[t * cols + b + e];
      }
      std::fill(dst + cols, dst + in.stride, 0.0f);
    }
    return;
  }
  in.q.assign(size_t(T * in.stride), 0);
  in.q_scale.assign(size_t(T * in.stride / 4), 0.0f);
  in.group_sum.assign(size_t(T * in.group_stride), 0.0f);
  const detail::LevelKernels& k = kernels_for(in.level);
  for (int64_t t = 0; t < T; ++t)
    k.quantize_activations(x + t * cols, cols, gs, in.bits, in.q.data() + t * in.stride,
                           in.q_scale.data() + t * in.stride / 4,
                           in.group_sum.data() + t * in.group_stride);
}

void matmul_rows(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy, int64_t r0,
                 int64_t r1) {
  // The activation layout depends on bits and group size only, so MXFP4 shares 4-bit group 32's
  // (FP8 reads x as it is).
  if (in.bits != w.quant.bits || in.group_size != w.quant.group_size || in.cols != w.cols)
    fail("weight ", w.name, ": activations were prepared for another matrix");
  const detail::LevelKernels& k = kernels_for(in.level);
  if (w.quant.bits == 0 || detail::is_fp8(w)) {
    k.matmul_plain(w, in, y, ldy, r0, r1);
  } else if (in.precise) {
    k.matmul_quant_precise(w, in, y, ldy, r0, r1);
  } else {
    k.matmul_quant_int8(w, in, y, ldy, r0, r1);
  }
}

}  // namespace moestream::cpu
