// Scalar kernels: the reference every SIMD level is tested against. Plain loops, float32 sums,
// codes in natural order.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/quant_kernels.h"
#include "core/quant.h"

namespace moestream::cpu::detail {

namespace {

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void matmul_plain(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy, int64_t r0,
                  int64_t r1) {
  thread_local std::vector<float> row;
  row.resize(size_t(w.cols));
  for (int64_t r = r0; r < r1; ++r) {
    row_to_f32(w, r, row.data());
    for (int64_t t = 0; t < in.T; ++t) y[t * ldy + r] = dot(row.data(), in.x + t * in.cols, w.cols);
  }
}

void matmul_quant_precise(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy,
                          int64_t r0, int64_t r1) {
  thread_local std::vector<float> row;
  row.resize(size_t(w.cols));
  for (int64_t r = r0; r < r1; ++r) {
    row_to_f32(w, r, row.data());
    for (int64_t t = 0; t < in.T; ++t)
      y[t * ldy + r] = dot(row.data(), in.xf.data() + t * in.stride, w.cols);
  }
}

void matmul_quant_int8(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy,
                       int64_t r0, int64_t r1) {
  thread_local std::vector<uint8_t> codes;
  codes.resize(size_t(w.cols));
  const int gs = w.quant.group_size;
  const int64_t groups = row_groups(w);
  const bool mx = is_mxfp4(w);
  thread_local std::vector<float> scales, biases;
  scales.resize(size_t(groups));
  biases.resize(size_t(groups));
  for (int64_t r = r0; r < r1; ++r) {
    unpack_codes(reinterpret_cast<const uint32_t*>(row_codes(w, r)), w.cols, w.quant.bits, codes.data());
    for (int64_t g = 0; g < groups; ++g) {
      if (mx) {  // the affine view of MXFP4 (core/quant.h)
        scales[size_t(g)] = mxfp4_affine_scales()[row_exponents(w, r)[g]];
        biases[size_t(g)] = -kMxfp4AffineBiasCodes * scales[size_t(g)];
      } else {
        scales[size_t(g)] = scale_to_f32(row_scales(w, r)[g], w.quant.scale_dtype);
        biases[size_t(g)] = scale_to_f32(row_biases(w, r)[g], w.quant.scale_dtype);
      }
    }
    if (mx)
      for (uint8_t& c : codes) c = kMxfp4AffineCode[c];
    for (int64_t t = 0; t < in.T; ++t) {
      const int8_t* q = in.q.data() + t * in.stride;
      const float* lane_scale = in.q_scale.data() + t * in.stride / 4;
      const float* group_sum = in.group_sum.data() + t * in.group_stride;
      float acc = 0, acc_bias = 0;
      for (int64_t g = 0; g < groups; ++g) {
        float acc_group = 0;
        for (int64_t b = g * gs / 32; b < (g + 1) * gs / 32; ++b) {
          int32_t isum = 0;
          for (int64_t i = b * 32; i < b * 32 + 32; ++i) isum += int32_t(codes[i]) * q[i];
          acc_group += float(isum) * lane_scale[b * 8];
        }
        acc += scales[size_t(g)] * acc_group;
        acc_bias += biases[size_t(g)] * group_sum[g];
      }
      y[t * ldy + r] = acc + acc_bias;
    }
  }
}

void quantize_activations(const float* x, int64_t cols, int group_size, int bits, int8_t* q,
                          float* lane_scale, float* group_sum) {
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      amax = std::max(amax, std::abs(xb[i]));
      finite = finite && std::isfinite(xb[i]);
    }
    const float dx = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const float inv = finite && amax > 0 ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = finite ? int(std::nearbyint(std::clamp(xb[i] * inv, -127.0f, 127.0f))) : 0;
      q[b * 32 + i] = int8_t(v);
      sum += v;
    }
    std::fill(lane_scale + b * 8, lane_scale + b * 8 + 8, dx);
    group_sum[b * 32 / group_size] += dx * float(sum);
  }
}

}  // namespace

const LevelKernels& scalar_kernels() {
  static const LevelKernels k{dot,          axpy, matmul_plain, matmul_quant_precise,
                              matmul_quant_int8, quantize_activations};
  return k;
}

}  // namespace moestream::cpu::detail
