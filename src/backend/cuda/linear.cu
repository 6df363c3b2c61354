// Linear layers: y = x W^T for every weight format (plain, MLX affine, MXFP4, FP8).
//  - GEMV (T <= kGemvMaxTokens): a warp owns kRowsPerWarp rows; each lane walks packs of 32
//    input elements (16-byte weight loads), x staged in shared memory, dequantization folded
//    into the dot product: sum_i (q_i s + b) x_i = s (q . x) + b sum(x) (b = 0 but for affine;
//    the packs' sums of x are staged with x). One token takes the single-token tile
//    (gemv_one.cuh); 2 to 8 a launch of one wave of blocks, each staging x once for the row
//    blocks it takes in turn.
//  - GEMM: tiles of rows dequantized to FP16 and multiplied on the tensor cores (float32 sums),
//    or to float32 and cuBLAS SGEMM (float32 math, no TF32) for GemmMath::F32.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>

#include "backend/cuda/gemv_one.cuh"
#include "backend/cuda/linear.h"
#include "backend/cuda/weights.cuh"
#include "core/quant.h"

namespace moestream::cuda {

FormatTag format_of(const Matrix& m) {
  const QuantFormat& f = m.quant;
  if (f.bits == 0) {
    switch (m.dtype) {
      case DType::F32: return {kF32, false};
      case DType::BF16: return {kBF16, false};
      case DType::F16: return {kF16, false};
      default: fail("matrix ", m.name, " has dtype ", dtype_name(m.dtype), ", which the CUDA backend does not read");
    }
  }
  switch (f.scheme) {
    case QuantScheme::Affine: {
      const int b = f.bits;
      if (b != 2 && b != 3 && b != 4 && b != 6 && b != 8)
        fail("matrix ", m.name, ": ", b, "-bit affine weights are not supported by the CUDA backend");
      if (f.scale_dtype != DType::BF16 && f.scale_dtype != DType::F16)
        fail("matrix ", m.name, ": affine scales of dtype ", dtype_name(f.scale_dtype),
             " are not supported by the CUDA backend (BF16, F16)");
      return {10 + b, f.scale_dtype == DType::F16};
    }
    case QuantScheme::Mxfp4:
      if (f != kMxfp4Format || m.dtype != DType::U8)
        fail("matrix ", m.name, ": MXFP4 must be U8 codes, 4 bits in groups of 32 with U8 exponents, found ",
             dtype_name(m.dtype), " codes, ", f.bits, " bits in groups of ", f.group_size, " with ",
             dtype_name(f.scale_dtype), " exponents");
      return {kMxfp4, false};
    case QuantScheme::Fp8:
      if (m.dtype != DType::F8_E4M3 || f.bits != 8 || f.scale_dtype != DType::F32 || f.group_size < 32 ||
          f.group_size % 32 != 0)
        fail("matrix ", m.name, ": FP8 must be F8_E4M3 codes with F32 scales per group of a multiple of 32 "
             "columns, found ", dtype_name(m.dtype), ", ", f.bits, " bits, ", dtype_name(f.scale_dtype),
             " scales, groups of ", f.group_size);
      return {kFp8, false};
  }
  fail("matrix ", m.name, ": a quantization scheme the CUDA backend does not compute");
}

WeightRef weight_ref(const Matrix& m) {
  WeightRef r;
  r.data = m.data;
  r.scales = m.scales;
  r.biases = static_cast<const uint16_t*>(m.biases);
  r.rows = m.rows;
  r.cols = m.cols;
  if (m.quant.bits) {
    const int g = m.quant.group_size;
    if (g < 32 || g % 32 != 0) fail("cuda: matrix ", m.name, ": group size ", g, " is not a multiple of 32");
    r.group_size = g;
    r.groups_per_row = (m.cols + g - 1) / g;
    r.group_shift = (g & (g - 1)) == 0 ? __builtin_ctz(unsigned(g)) : -1;
  }
  return r;
}

size_t max_gemv_smem() {
  static const size_t limit = [] {
    int dev = 0, v = 0;
    MS_CUDA_CHECK(cudaGetDevice(&dev));
    MS_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return size_t(v);
  }();
  return limit;
}

int sm_count() {
  static const int sms = [] {
    int dev = 0, v = 0;
    MS_CUDA_CHECK(cudaGetDevice(&dev));
    MS_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return sms;
}

namespace {

// Tokens one GEMV pass stages: up to kTokens, or up to kWideTokens for 5 and more (a batched
// decode step then reads the weights once, not twice), as many as shared memory holds; 0 if none.
int gemv_tokens_per_pass(int64_t T, int64_t cols) {
  int nt = T > kTokens ? kWideTokens : kTokens;
  while (nt > 0 && gemv_smem_bytes(cols, nt) > max_gemv_smem()) --nt;
  return nt;
}

// Row block `block` (kGemvRows rows) of out = x W^T for the nt tokens t0.. staged in smem.
template <int KIND, bool SF16, int NT>
__device__ __forceinline__ void gemv_block(const WeightRef& w, int t0, int nt, int nt_max, const float* __restrict__ bias,
                                           float* __restrict__ out, int64_t ldo, int64_t block) {
  extern __shared__ float smem[];
  const float* xs = smem;
  const float* xsum = smem + nt_max * padded_cols(w.cols);
  const int64_t row0 = block * kGemvRows + (threadIdx.x / 32) * kRowsPerWarp;
  float acc[kRowsPerWarp][NT];
  gemv_warp<KIND, SF16, NT>(w, row0, xs, xsum, nt, acc);
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (lane == r * NT + t && t < nt && row0 + r < w.rows)
        out[(t0 + t) * ldo + row0 + r] = acc[r][t] + (bias ? bias[row0 + r] : 0.0f);
}

// Every row block b < n_blocks of the launch, x staged once per pass of nt_max tokens and reused by
// all the blocks a CUDA block takes (b = blockIdx.x, + gridDim.x, ...): a launch of one wave of
// blocks stages x once per block, not once per kGemvRows rows. do_block(b, t0, nt) computes one.
template <int KIND, class DoBlock>
__device__ __forceinline__ void gemv_passes(const float* __restrict__ x, int64_t ldx, int64_t cols, int T, int nt_max,
                                            unsigned n_blocks, DoBlock do_block) {
  extern __shared__ float smem[];
  for (int t0 = 0; t0 < T; t0 += nt_max) {
    const int nt = min(nt_max, T - t0);
    if (t0 > 0) __syncthreads();  // the previous pass's reads of xs are done
    stage_x([&](int t) { return x + (t0 + t) * ldx; }, nt, cols, smem, smem + nt_max * padded_cols(cols),
            is_affine(KIND));
    for (unsigned b = blockIdx.x; b < n_blocks; b += gridDim.x) do_block(b, t0, nt);
  }
}

template <int KIND, bool SF16, int NT>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_kernel(WeightRef w, const float* __restrict__ x, int64_t ldx, int T, int nt_max,
                const float* __restrict__ bias, float* __restrict__ out, int64_t ldo, unsigned n_blocks) {
  wait_prior_grid();
  allow_next_grid();
  gemv_passes<KIND>(x, ldx, w.cols, T, nt_max, n_blocks, [&](unsigned b, int t0, int nt) {
    gemv_block<KIND, SF16, NT>(w, t0, nt, nt_max, bias, out, ldo, b);
  });
}

// Up to kMaxShared matrices of one format and width that read the same x, in one launch: the
// blocks of matrix i are [first_block[i], first_block[i + 1]).
constexpr int kMaxShared = 4;
struct SharedInput {
  WeightRef w[kMaxShared];
  const float* bias[kMaxShared];
  float* out[kMaxShared];
  int64_t ldo[kMaxShared];
  unsigned first_block[kMaxShared + 1];
  int n;
};

template <int KIND, bool SF16, int NT>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_shared_kernel(SharedInput m, const float* __restrict__ x, int64_t ldx, int T, int nt_max) {
  wait_prior_grid();
  allow_next_grid();
  gemv_passes<KIND>(x, ldx, m.w[0].cols, T, nt_max, m.first_block[m.n], [&](unsigned b, int t0, int nt) {
    int i = 0;
    while (i + 1 < m.n && b >= m.first_block[i + 1]) ++i;
    gemv_block<KIND, SF16, NT>(m.w[i], t0, nt, nt_max, m.bias[i], m.out[i], m.ldo[i], b - m.first_block[i]);
  });
}

// Blocks of a GEMV launch: n_blocks row blocks, at most as many as run at once on the device
// (the rest are taken by the same blocks in turn, x staged once for them).
template <class Kernel>
unsigned gemv_grid(Kernel kernel, size_t smem, unsigned n_blocks) {
  // By kernel and shared memory: the instances of one template (each kind, each NT) share Kernel's
  // type, and their registers, hence occupancy, differ.
  thread_local std::map<std::pair<const void*, size_t>, int> per_sm_of;
  auto [it, fresh] = per_sm_of.try_emplace({reinterpret_cast<const void*>(kernel), smem}, 0);
  if (fresh) MS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&it->second, kernel, kGemvWarps * 32, smem));
  const int per_sm = it->second;
  return std::max(1u, std::min(n_blocks, unsigned(std::max(1, per_sm)) * unsigned(sm_count())));
}

// One token through the single-token tile (gemv_one.cuh), for up to kMaxShared matrices of one
// format and width: the blocks of matrix i are [first_block[i], first_block[i + 1]), kOneWarps * R
// rows each. Each row's value is gemv_kernel's, bit for bit; the weights' first loads are issued
// before x is staged and the next ones while the current are computed.
template <int KIND, bool SF16, int R>
__global__ void __launch_bounds__(kOneWarps * 32, 3) gemv_one_kernel(SharedInput m, const float* __restrict__ x) {
  extern __shared__ float smem[];
  int i = 0;
  while (i + 1 < m.n && blockIdx.x >= m.first_block[i + 1]) ++i;
  const WeightRef* const w[1] = {&m.w[i]};
  const int64_t row0 = int64_t(blockIdx.x - m.first_block[i]) * (kOneWarps * R) + (threadIdx.x / 32) * R;
  const int lane = threadIdx.x & 31;
  RawPack<KIND> cur[1][R], next[1][R];
  load_first<KIND, 1, R>(w, row0, cur, next);
  wait_prior_grid();  // the weights' first loads overlap the kernel before
  allow_next_grid();
  stage_row(x, m.w[i].cols, smem);
  float acc[1][R];
  dot_rows<KIND, SF16, 1, R, false>(w, row0, cur, next, smem, acc);
  const float* bias = m.bias[i];
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (lane == r && row0 + r < m.w[i].rows) m.out[i][row0 + r] = acc[0][r] + (bias ? bias[row0 + r] : 0.0f);
}

// Rows [r0, r0 + n) of w as float32 into tile [n, cols].
template <int KIND, bool SF16>
__global__ void dequant_rows_kernel(WeightRef w, int64_t r0, int64_t n, float* __restrict__ tile) {
  const int64_t total = n * w.cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    tile[i] = weight_at<KIND, SF16>(w, r0 + i / w.cols, i % w.cols);
}

template <int KIND, bool SF16>
__global__ void dequant_rows_f16_kernel(WeightRef w, int64_t r0, int64_t n, __half* __restrict__ tile) {
  dequant_rows_f16<KIND, SF16>(w, r0, n, tile);
}

__global__ void to_f16_kernel(const float* __restrict__ x, int64_t ldx, int64_t T, int64_t cols, __half* __restrict__ out) {
  const int64_t total = T * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = to_half_saturated(x[(i / cols) * ldx + i % cols]);
}

// One block per token: row tokens[t] of the table as float32.
template <int KIND, bool SF16>
__global__ void embed_kernel(WeightRef w, const int32_t* __restrict__ tokens, float* __restrict__ out) {
  wait_prior_grid();
  allow_next_grid();
  const int64_t r = tokens[blockIdx.x];
  float* o = out + int64_t(blockIdx.x) * w.cols;
  for (int64_t c = threadIdx.x; c < w.cols; c += blockDim.x) o[c] = weight_at<KIND, SF16>(w, r, c);
}

__global__ void add_bias_kernel(float* out, int64_t ldo, int64_t T, int64_t n, const float* bias) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < T * n) out[(i / n) * ldo + i % n] += bias[i % n];
}


}  // namespace

void check_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) fail(file, ":", line, ": ", what, ": cuBLAS status ", int(s));
}

GemmScratch::~GemmScratch() {
  if (tile) cudaFree(tile);
  for (auto& [p, n] : areas)
    if (p) cudaFree(p);
  if (handle) cublasDestroy(handle);
  if (handle16) cublasDestroy(handle16);
}

void* GemmScratch::area(int slot, size_t bytes) {
  if (areas.size() <= size_t(slot)) areas.resize(size_t(slot) + 1, {nullptr, 0});
  auto& [p, n] = areas[size_t(slot)];
  if (n < bytes) {
    if (p) MS_CUDA_CHECK(cudaFree(p));
    p = nullptr;
    MS_CUDA_CHECK(cudaMalloc(&p, bytes));
    n = bytes;
  }
  return p;
}

cublasHandle_t GemmScratch::tensor_handle(cudaStream_t stream) {
  if (!handle16) {
    MS_CUBLAS_CHECK(cublasCreate(&handle16));
    MS_CUBLAS_CHECK(cublasSetMathMode(handle16, CUBLAS_DEFAULT_MATH));
  }
  MS_CUBLAS_CHECK(cublasSetStream(handle16, stream));
  return handle16;
}

int64_t gemm_min_tokens() {
  static const int64_t n = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_GEMM_TOKENS");
    const int64_t t = v ? std::atoll(v) : 0;
    return t >= 2 ? t : kGemvMaxTokens + 1;  // one token is always the GEMV (and CUDA graphs)
  }();
  return n;
}

int64_t lane_tokens() {
  static const int64_t n = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_LANE_TOKENS");
    return v ? std::max<int64_t>(0, std::atoll(v)) : kLaneMaxTokens;
  }();
  return n;
}

bool exact_mma_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_EXACT_MMA");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

bool tensor_cores_for(int64_t T) {
  static const int64_t min_tokens = [] {
    const char* on = std::getenv("MOESTREAM_CUDA_TENSOR_CORES");
    if (!(on && std::string(on) == "1")) return int64_t(-1);
    const char* v = std::getenv("MOESTREAM_CUDA_TENSOR_CORE_TOKENS");
    const int64_t t = v ? std::atoll(v) : 0;
    return t >= 2 ? t : int64_t(128);
  }();
  return min_tokens > 0 && T >= min_tokens;
}

void dequantize_rows_f16(const Matrix& m, int64_t r0, int64_t n, void* dst, cudaStream_t stream) {
  const WeightRef w = weight_ref(m);
  if (w.cols % 8) fail("cuda: matrix ", m.name, " has ", w.cols, " columns, not a multiple of 8");
  dispatch_format(format_of(m), [&]<int KIND, bool SF16>() {
    const int64_t total = n * w.cols / 8;
    const unsigned blocks = unsigned(std::min<int64_t>((total + 255) / 256, 65535));
    if (blocks == 0) return;
    dequant_rows_f16_kernel<KIND, SF16><<<blocks, 256, 0, stream>>>(w, r0, n, static_cast<__half*>(dst));
    MS_CUDA_CHECK_LAUNCH();
  });
}

void to_f16(const float* x, int64_t ldx, int64_t T, int64_t cols, void* dst, cudaStream_t stream) {
  const int64_t total = T * cols;
  if (total == 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((total + 255) / 256, 65535));
  to_f16_kernel<<<blocks, 256, 0, stream>>>(x, ldx, T, cols, static_cast<__half*>(dst));
  MS_CUDA_CHECK_LAUNCH();
}

namespace {

void add_bias(float* out, int64_t ldo, int64_t T, int64_t n, const float* bias, cudaStream_t stream) {
  add_bias_kernel<<<blocks_for(T * n, 256), 256, 0, stream>>>(out, ldo, T, n, bias);
  MS_CUDA_CHECK_LAUNCH();
}

// The tensor-core GEMM: x to FP16 once, W dequantized to FP16 ~32M elements at a time.
void linear_f16(const Matrix& m, const float* x, int64_t ldx, int64_t T, const float* bias, float* out,
                int64_t ldo, GemmScratch& scratch, cudaStream_t stream) {
  const int64_t rows = m.rows, cols = m.cols;
  cublasHandle_t h = scratch.tensor_handle(stream);
  auto* x16 = static_cast<__half*>(scratch.area(kAreaX16, size_t(T * cols) * sizeof(__half)));
  to_f16(x, ldx, T, cols, x16, stream);
  const int64_t tile_rows = std::min<int64_t>(rows, std::max<int64_t>(64, (int64_t(1) << 25) / cols));
  auto* tile = static_cast<__half*>(scratch.area(kAreaTile16, size_t(tile_rows * cols) * sizeof(__half)));
  const float one = 1.0f, zero = 0.0f;
  for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
    const int64_t n = std::min(tile_rows, rows - r0);
    dequantize_rows_f16(m, r0, n, tile, stream);
    // Column-major view, as in linear(): C (n x T, ld ldo) = tile^T (n x cols) * x16 (cols x T).
    MS_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(T), int(cols), &one, tile, CUDA_R_16F,
                                 int(cols), x16, CUDA_R_16F, int(cols), &zero, out + r0, CUDA_R_32F, int(ldo),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  if (bias) add_bias(out, ldo, T, rows, bias, stream);
}

// x [T, cols] (row stride ldx) as three BF16 matrices [T, cols] one after the other: hi = bf16(x),
// mid = bf16(x - hi), lo = bf16(x - hi - mid). Each difference is exact in float32 and lo takes
// what mid leaves exactly, so hi + mid + lo == x (BF16 has float32's exponent range).
__global__ void split_bf16_kernel(const float* __restrict__ x, int64_t ldx, int64_t T, int64_t cols,
                                  __nv_bfloat16* __restrict__ out) {
  wait_prior_grid();
  allow_next_grid();
  const int64_t n = T * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / cols, c = i % cols;
    const float v = x[t * ldx + c];
    const __nv_bfloat16 hi = __float2bfloat16_rn(v);
    const float r = v - __bfloat162float(hi);
    const __nv_bfloat16 mid = __float2bfloat16_rn(r);
    out[i] = hi;
    out[n + i] = mid;
    out[2 * n + i] = __float2bfloat16_rn(r - __bfloat162float(mid));
  }
}

// BF16 weights times float32 activations on the tensor cores to float32 accuracy: the weights are
// exact BF16 operands, the activations three BF16 parts that sum to them exactly, and every
// product of two BF16 values is exact in the float32 sums; out = W lo + W mid + W hi.
void linear_bf16_split(const Matrix& m, const float* x, int64_t ldx, int64_t T, const float* bias, float* out,
                       int64_t ldo, GemmScratch& scratch, cudaStream_t stream) {
  const int64_t rows = m.rows, cols = m.cols, n = T * cols;
  cublasHandle_t h = scratch.tensor_handle(stream);
  auto* parts = static_cast<__nv_bfloat16*>(scratch.area(kAreaX16, size_t(3 * n) * sizeof(__nv_bfloat16)));
  launch(split_bf16_kernel, unsigned(std::min<int64_t>((n + 255) / 256, 65535)), 256, 0, stream, x,
         ldx, T, cols, parts);
  const float one = 1.0f, zero = 0.0f;
  for (int part = 2; part >= 0; --part) {
    // Column-major view, as in linear(): C (rows x T, ld ldo) += W^T (rows x cols) * part (cols x T).
    MS_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(rows), int(T), int(cols), &one, m.data, CUDA_R_16BF,
                                 int(cols), parts + part * n, CUDA_R_16BF, int(cols), part == 2 ? &zero : &one, out,
                                 CUDA_R_32F, int(ldo), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  if (bias) add_bias(out, ldo, T, rows, bias, stream);
}

// The sums of the three parts' products, in linear_bf16_split's order: out = (lo + mid) + hi.
__global__ void sum_parts_kernel(const float* __restrict__ parts, int64_t T, int64_t rows, const float* bias,
                                 float* __restrict__ out, int64_t ldo) {
  wait_prior_grid();
  allow_next_grid();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * rows) return;
  const int64_t t = i / rows, r = i % rows, n = T * rows;
  const float v = (parts[2 * n + i] + parts[n + i]) + parts[i];
  out[t * ldo + r] = bias ? v + bias[r] : v;
}

// linear_bf16_split for a few tokens (a batched decode step): x split once (split_few), then per
// matrix the three parts as one GEMM of 3T columns, so the weights are read once, not three times,
// and the parts summed (gemm_few).
const __nv_bfloat16* split_few(const float* x, int64_t ldx, int64_t T, int64_t cols, GemmScratch& scratch,
                               cudaStream_t stream) {
  const int64_t n = T * cols;
  auto* parts = static_cast<__nv_bfloat16*>(scratch.area(kAreaX16, size_t(3 * n) * sizeof(__nv_bfloat16)));
  launch(split_bf16_kernel, unsigned(std::min<int64_t>((n + 255) / 256, 65535)), 256, 0, stream, x,
         ldx, T, cols, parts);
  return parts;
}

void gemm_few(const Matrix& m, const __nv_bfloat16* parts, int64_t T, const float* bias, float* out, int64_t ldo,
              GemmScratch& scratch, cudaStream_t stream) {
  const int64_t rows = m.rows, cols = m.cols;
  cublasHandle_t h = scratch.tensor_handle(stream);
  auto* sums = static_cast<float*>(scratch.area(kAreaTile16, size_t(3 * T * rows) * sizeof(float)));
  const float one = 1.0f, zero = 0.0f;
  // Column-major view: C (rows x 3T, ld rows) = W^T (rows x cols) * parts (cols x 3T).
  MS_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(rows), int(3 * T), int(cols), &one, m.data, CUDA_R_16BF,
                               int(cols), parts, CUDA_R_16BF, int(cols), &zero, sums, CUDA_R_32F, int(rows),
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  launch(sum_parts_kernel, blocks_for(T * rows, 256), 256, 0, stream, sums, T, rows, bias, out,
         ldo);
}

// BF16 weights for 2 to kGemvMaxTokens tokens: the tensor cores (linear_bf16_split_few) rather
// than the GEMV, whose per-token work in shared memory outweighs its reads from 5 tokens on.
bool bf16_few_tokens(const FormatTag& tag, int64_t T, int64_t cols, GemmMath math) {
  static const bool gemv = [] {  // MOESTREAM_CUDA_BF16_FEW=gemv: the GEMV instead, for comparison
    const char* v = std::getenv("MOESTREAM_CUDA_BF16_FEW");
    return v && std::string(v) == "gemv";
  }();
  return !gemv && T >= 2 && T < gemm_min_tokens() && math == GemmMath::Fp16 && tag.kind == kBF16 && cols % 8 == 0 &&
         exact_mma_enabled();
}

// One token (x one row) of a format the single-token tile reads (gemv_one.cuh), whole packs, x
// 16-byte aligned: every matrix of m through gemv_one_kernel in one launch (m.first_block filled
// here). False (nothing launched) otherwise, or with MOESTREAM_CUDA_ONE_TOKEN_GEMV=0.
bool gemv_one(const FormatTag& tag, SharedInput& m, const float* x, cudaStream_t stream) {
  const int64_t cols = m.w[0].cols;
  if (one_token_gemv_off() || cols % 32 != 0 || (reinterpret_cast<uintptr_t>(x) & 15) != 0) return false;
  const size_t smem = size_t(padded_cols(cols)) * sizeof(float), limit = max_gemv_smem();
  if (smem > limit) return false;
  bool launched = false;
  dispatch_format(tag, [&]<int KIND, bool SF16>() {
    if constexpr (one_token_kind(KIND)) {
      auto run = [&]<int R>() {
        m.first_block[0] = 0;
        for (int i = 0; i < m.n; ++i) m.first_block[i + 1] = m.first_block[i] + blocks_for(m.w[i].rows, kOneWarps * R);
        static bool configured = false;
        if (!configured) {
          MS_CUDA_CHECK(cudaFuncSetAttribute(gemv_one_kernel<KIND, SF16, R>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)));
          configured = true;
        }
        launch(gemv_one_kernel<KIND, SF16, R>, m.first_block[m.n], kOneWarps * 32, smem, stream, m, x);
      };
      int64_t rows = 0;
      for (int i = 0; i < m.n; ++i) rows += m.w[i].rows;
      with_one_rows<KIND, 1>(rows, run);
      launched = true;
    }
  });
  return launched;
}

}  // namespace

int one_rows_cap() {
  const char* v = std::getenv("MOESTREAM_CUDA_ONE_ROWS");
  return v ? std::atoi(v) : 0;
}

bool one_token_gemv_off() {
  static const bool off = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_ONE_TOKEN_GEMV");
    return v && std::string(v) == "0";
  }();
  return off;
}

bool dependent_launch_on() {
  static const bool on = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_PDL");
    if (v && std::string(v) == "0") return false;
    int device = 0, major = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
               cudaSuccess &&
           major >= 9;
  }();
  return on;
}

namespace {

// Calls of kGemvMaxTokens < T <= lane_tokens(): the few-token kernels in passes of as even a
// split as fits 8 tokens (so no pass has fewer than 2). False where a matrix does not fit them,
// and where the FP16 tensor cores were asked for.
bool linear_few_passes(std::span<const Matrix* const> w, const float* x, int64_t ldx, int64_t T,
                       std::span<const float* const> bias, std::span<float* const> out,
                       std::span<const int64_t> ldo, GemmScratch& scratch, cudaStream_t stream) {
  if (T <= kGemvMaxTokens || T > lane_tokens() || tensor_cores_for(T)) return false;
  for (const Matrix* m : w)
    if (!few_mma_for(*m, kGemvMaxTokens, x, ldx)) return false;
  const int64_t passes = (T + kGemvMaxTokens - 1) / kGemvMaxTokens;
  float* o[kMaxShared] = {};
  for (int64_t p = 0, t0 = 0; p < passes; ++p) {
    const int64_t n = (T - t0 + (passes - p) - 1) / (passes - p);
    for (size_t i = 0; i < w.size(); ++i) o[i] = out[i] + t0 * ldo[i];
    const std::span<float* const> pass_out(o, w.size());
    linear_few_mma(w, x + t0 * ldx, ldx, n, bias, pass_out, ldo, scratch, stream);
    t0 += n;
  }
  return true;
}

}  // namespace

void linear(const Matrix& m, const float* x, int64_t ldx, int64_t T, const float* bias, float* out,
            int64_t ldo, GemmScratch& scratch, cudaStream_t stream, GemmMath math) {
  if (T == 0) return;
  const FormatTag tag = format_of(m);
  const WeightRef w = weight_ref(m);
  const size_t smem_limit = max_gemv_smem();
  const int nt_max = gemv_tokens_per_pass(T, w.cols);
  if (bf16_few_tokens(tag, T, w.cols, math)) {
    gemm_few(m, split_few(x, ldx, T, w.cols, scratch, stream), T, bias, out, ldo, scratch, stream);
    return;
  }
  if (T == 1) {
    SharedInput one{};
    one.n = 1;
    one.w[0] = w;
    one.bias[0] = bias;
    one.out[0] = out;
    one.ldo[0] = ldo;
    if (gemv_one(tag, one, x, stream)) return;
  }
  if (math == GemmMath::Fp16) {
    const Matrix* ms[1] = {&m};
    const float* bs[1] = {bias};
    float* os[1] = {out};
    const int64_t ls[1] = {ldo};
    if (linear_few_passes(ms, x, ldx, T, bs, os, ls, scratch, stream)) return;
    if (T < gemm_min_tokens() && few_mma_for(m, T, x, ldx)) {
      linear_few_mma(ms, x, ldx, T, bs, os, ls, scratch, stream);
      return;
    }
  }
  if (T < gemm_min_tokens() && nt_max > 0) {
    dispatch_format(tag, [&]<int KIND, bool SF16>() {
      auto run = [&]<int NT>() {
        static bool configured = false;
        if (!configured) {
          MS_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<KIND, SF16, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(smem_limit)));
          configured = true;
        }
        const unsigned blocks = blocks_for(w.rows, kGemvRows);
        const size_t smem = gemv_smem_bytes(w.cols, nt_max);
        launch(gemv_kernel<KIND, SF16, NT>, gemv_grid(gemv_kernel<KIND, SF16, NT>, smem, blocks), kGemvWarps * 32,
               smem, stream, w, x, ldx, int(T), nt_max, bias, out, ldo, blocks);
      };
      if (nt_max > kTokens) run.template operator()<kWideTokens>();
      else run.template operator()<kTokens>();
    });
    return;
  }
  if (math == GemmMath::Fp16 && tensor_cores_for(T) && w.cols % 8 == 0) {
    linear_f16(m, x, ldx, T, bias, out, ldo, scratch, stream);
    return;
  }
  if (math == GemmMath::Fp16 && exact_mma_enabled() && tag.kind == kBF16 && w.cols % 8 == 0) {
    linear_bf16_split(m, x, ldx, T, bias, out, ldo, scratch, stream);
    return;
  }
  if (math == GemmMath::Fp16 && linear_exact_mma_supported(tag, w.cols, x, ldx)) {
    linear_exact_mma(m, x, ldx, T, bias, out, ldo, scratch, stream);
    return;
  }
  // GEMM: dequantize up to ~32M elements of W at a time.
  if (!scratch.handle) {
    MS_CUBLAS_CHECK(cublasCreate(&scratch.handle));
    MS_CUBLAS_CHECK(cublasSetMathMode(scratch.handle, CUBLAS_PEDANTIC_MATH));
  }
  MS_CUBLAS_CHECK(cublasSetStream(scratch.handle, stream));
  const int64_t tile_rows = std::min<int64_t>(w.rows, std::max<int64_t>(64, (int64_t(1) << 25) / w.cols));
  const size_t need = size_t(tile_rows * w.cols);
  if (scratch.tile_floats < need) {
    if (scratch.tile) MS_CUDA_CHECK(cudaFree(scratch.tile));
    scratch.tile = nullptr;
    MS_CUDA_CHECK(cudaMalloc(&scratch.tile, need * sizeof(float)));
    scratch.tile_floats = need;
  }
  for (int64_t r0 = 0; r0 < w.rows; r0 += tile_rows) {
    const int64_t n = std::min(tile_rows, w.rows - r0);
    dispatch_format(tag, [&]<int KIND, bool SF16>() {
      const int64_t total = n * w.cols;
      const unsigned blocks = unsigned(std::min<int64_t>((total + 255) / 256, 65535));
      dequant_rows_kernel<KIND, SF16><<<blocks, 256, 0, stream>>>(w, r0, n, scratch.tile);
      MS_CUDA_CHECK_LAUNCH();
    });
    // Column-major view: C (n x T, ld ldo) = tile^T (n x cols) * x (cols x T, ld ldx).
    const float one = 1.0f, zero = 0.0f;
    MS_CUBLAS_CHECK(cublasSgemm(scratch.handle, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(T), int(w.cols), &one,
                                scratch.tile, int(w.cols), x, int(ldx), &zero, out + r0, int(ldo)));
  }
  if (bias) {
    add_bias_kernel<<<blocks_for(T * w.rows, 256), 256, 0, stream>>>(out, ldo, T, w.rows, bias);
    MS_CUDA_CHECK_LAUNCH();
  }
}

bool linear_shared_input(std::span<const Matrix* const> w, const float* x, int64_t ldx, int64_t T,
                         std::span<const float* const> bias, std::span<float* const> out, GemmScratch& scratch,
                         cudaStream_t stream) {
  if (T == 0 || w.empty() || w.size() > size_t(kMaxShared)) return false;
  const FormatTag tag = format_of(*w[0]);
  for (const Matrix* m : w)
    if (!(format_of(*m) == tag) || m->cols != w[0]->cols) return false;
  int64_t rows[kMaxShared] = {};
  for (size_t i = 0; i < w.size(); ++i) rows[i] = w[i]->rows;
  const std::span<const int64_t> ldo_rows(rows, w.size());
  if (linear_few_passes(w, x, ldx, T, bias, out, ldo_rows, scratch, stream)) return true;
  if (T >= gemm_min_tokens())  // as linear() computes them: the exact path unless FP16 was asked for
    return !tensor_cores_for(T) && linear_exact_mma_shared(w, x, ldx, T, bias, out, scratch, stream);
  if (bf16_few_tokens(tag, T, w[0]->cols, GemmMath::Fp16)) {  // as linear() computes each, x split once
    const __nv_bfloat16* parts = split_few(x, ldx, T, w[0]->cols, scratch, stream);
    for (size_t i = 0; i < w.size(); ++i) gemm_few(*w[i], parts, T, bias[i], out[i], w[i]->rows, scratch, stream);
    return true;
  }
  if (std::all_of(w.begin(), w.end(), [&](const Matrix* m) { return few_mma_for(*m, T, x, ldx); })) {
    // as linear() computes each, x split once
    linear_few_mma(w, x, ldx, T, bias, out, ldo_rows, scratch, stream);
    return true;
  }
  const size_t smem_limit = max_gemv_smem();
  const int nt_max = gemv_tokens_per_pass(T, w[0]->cols);
  if (nt_max == 0) return false;
  SharedInput m{};
  m.n = int(w.size());
  for (int i = 0; i < m.n; ++i) {
    m.w[i] = weight_ref(*w[size_t(i)]);
    m.bias[i] = bias[size_t(i)];
    m.out[i] = out[size_t(i)];
    m.ldo[i] = w[size_t(i)]->rows;
  }
  if (T == 1 && gemv_one(tag, m, x, stream)) return true;
  m.first_block[0] = 0;
  for (int i = 0; i < m.n; ++i) m.first_block[i + 1] = m.first_block[i] + blocks_for(w[size_t(i)]->rows, kGemvRows);
  dispatch_format(tag, [&]<int KIND, bool SF16>() {
    auto run = [&]<int NT>() {
      static bool configured = false;
      if (!configured) {
        MS_CUDA_CHECK(cudaFuncSetAttribute(gemv_shared_kernel<KIND, SF16, NT>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_limit)));
        configured = true;
      }
      const size_t smem = gemv_smem_bytes(w[0]->cols, nt_max);
      launch(gemv_shared_kernel<KIND, SF16, NT>, gemv_grid(gemv_shared_kernel<KIND, SF16, NT>, smem, m.first_block[m.n]),
             kGemvWarps * 32, smem, stream, m, x, ldx, int(T), nt_max);
    };
    if (nt_max > kTokens) run.template operator()<kWideTokens>();
    else run.template operator()<kTokens>();
  });
  return true;
}

void embed(const Matrix& table, const int32_t* tokens, int64_t T, float* out, cudaStream_t stream) {
  if (T == 0) return;
  const WeightRef w = weight_ref(table);
  dispatch_format(format_of(table), [&]<int KIND, bool SF16>() {
    launch(embed_kernel<KIND, SF16>, unsigned(T), 256, 0, stream, w, tokens, out);
  });
}

}  // namespace moestream::cuda
