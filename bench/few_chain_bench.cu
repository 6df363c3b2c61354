// What bounds a warp's k-blocks in the few-token tensor-core kernels (gemv_mma.cu, the experts'
// lanes in expert_few_mma.cu): the same device functions (few_mma.cuh) run in a loop, one step
// added at a time, on data that stays in L1, for 1 to 32 warps an SM. Each line gives the cycles
// one k-block (16 rows x 64 columns of q4, 8 tokens) costs a warp, and k-blocks per microsecond on
// the whole GPU, times 576 bytes (a k-block's codes, scales and biases) as the weight rate that
// would sustain. Modes:
//   0  the k-block's 8 products on one accumulator, and its scaling (add_block) only
//   1  + the decode of its 4 words (code_pairs), the words in registers
//   2  + x's B fragments and pack sums loaded from global memory (XBlock::load; 64 KB, in L1)
//   3  + the words loaded from global memory 4 k-blocks ahead (128 KB, in L1 and L2)
//   4  mode 3 with two k-blocks in flight a warp (two accumulators)
//   5  mode 3 with x's fragments from shared memory (the block's 8 token rows, padded: 4 requests
//      a 16-byte load instead of 8)
//   6  mode 3 with each x load serving two row tiles (two k-blocks' products on one B; counted
//      as two k-blocks)
// The kernels' scale and bias loads and their weights' trip from DRAM are not here.
//
//   few_chain_bench
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <utility>
#include <vector>

#include "backend/cuda/few_mma.cuh"

namespace {

using namespace moestream::cuda;
using L = Layout<kQ4, true>;
constexpr int kCols = 2048, kXRows = 8, kReps = 200;  // x: 8 token rows of kCols

template <int MODE>
__global__ void chain_kernel(const uint32_t* words, const __half* xhi, const __half* xlo, const float* sums, int reps,
                             unsigned long long* cycles, float* out) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4;
  const int warp = int(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32);
  FewB b{xhi + g * kCols + j * L::kCodes, xlo + g * kCols + j * L::kCodes, sums + (2 * j) * (kCols / 32),
         sums + (2 * j + 1) * (kCols / 32)};
  if constexpr (MODE == 5) {  // x's 8 rows into shared memory, rows kCols + 8 halves apart
    extern __shared__ __align__(16) __half xs[];
    for (int i = int(threadIdx.x); i < kXRows * kCols / 8; i += int(blockDim.x)) {
      const int r = i / (kCols / 8), c = (i % (kCols / 8)) * 8;
      *reinterpret_cast<uint4*>(xs + r * (kCols + 8) + c) = *reinterpret_cast<const uint4*>(xhi + r * kCols + c);
      *reinterpret_cast<uint4*>(xs + (kXRows + r) * (kCols + 8) + c) = *reinterpret_cast<const uint4*>(xlo + r * kCols + c);
    }
    __syncthreads();
    b.hi = xs + g * (kCols + 8) + j * L::kCodes;
    b.lo = xs + (kXRows + g) * (kCols + 8) + j * L::kCodes;
  }
  float acc[4] = {0, 0, 0, 0}, acc2[4] = {0, 0, 0, 0};
  uint32_t w0[2] = {0x12345678u ^ lane, 0x9abcdef0u ^ lane}, w1[2] = {0x0f1e2d3cu ^ lane, 0x4b5a6978u ^ lane};
  XBlock<kQ4, true> xb;
  xb.load(b, 0);
  const float scale[2] = {1.0f, 0.5f}, bias[2] = {0.25f, 0.125f};
  const uint32_t* mine = words + (warp % 64) * 512 + lane * 2;  // one of 64 tiles' words
  const unsigned long long t0 = clock64();
  for (int r = 0; r < reps; ++r) {
#pragma unroll 4
    for (int kb = 0; kb < 32; kb += MODE == 4 || MODE == 6 ? 2 : 1) {
      if constexpr (MODE >= 3) {
        const uint2 a = *reinterpret_cast<const uint2*>(mine + ((kb + 4) % 32) * 16);
        const uint2 c = *reinterpret_cast<const uint2*>(mine + ((kb + 4) % 32) * 16 + 8);
        w0[0] ^= a.x; w0[1] ^= a.y; w1[0] ^= c.x; w1[1] ^= c.y;
      } else if constexpr (MODE >= 1) {
        w0[0] += kb; w1[1] += r;  // new words each k-block, so nothing is hoisted
      }
      if constexpr (MODE >= 2) xb.load(b, kb);
      uint32_t ha[L::kPairs], hb[L::kPairs];
      if constexpr (MODE >= 1) {
        code_pairs<kQ4, 2>(w0, ha);
        code_pairs<kQ4, 2>(w1, hb);
      } else {
#pragma unroll
        for (int i = 0; i < L::kPairs; ++i) ha[i] = hb[i] = 0x3c003c00u + i;
      }
      add_block<kQ4, true>(ha, hb, xb, scale, bias, acc);
      if constexpr (MODE == 6) {
        uint32_t hc[L::kPairs], hd[L::kPairs];
        code_pairs<kQ4, 2>(w1, hc);
        code_pairs<kQ4, 2>(w0, hd);
        add_block<kQ4, true>(hc, hd, xb, scale, bias, acc2);
      }
      if constexpr (MODE == 4) {
        XBlock<kQ4, true> xb2;
        xb2.load(b, kb + 1);
        uint32_t hc[L::kPairs], hd[L::kPairs];
        code_pairs<kQ4, 2>(w1, hc);
        code_pairs<kQ4, 2>(w0, hd);
        add_block<kQ4, true>(hc, hd, xb2, scale, bias, acc2);
      }
    }
  }
  const unsigned long long t1 = clock64();
  if (lane == 0) cycles[warp] = t1 - t0;
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc[0] + acc[1] + acc[2] + acc[3] + acc2[0] + acc2[3];
}

bool check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "few_chain_bench: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

template <int MODE>
bool run(int warps, int blocks_per_sm, int sms, const uint32_t* words, const __half* xhi, const __half* xlo,
         const float* sums) {
  const int blocks = blocks_per_sm * sms, n_warps = blocks * warps;
  unsigned long long* cycles = nullptr;
  float* out = nullptr;
  cudaEvent_t e0, e1;
  if (!check(cudaMalloc(&cycles, size_t(n_warps) * sizeof(unsigned long long)), "cudaMalloc") ||
      !check(cudaMalloc(&out, size_t(n_warps) * 32 * sizeof(float)), "cudaMalloc") ||
      !check(cudaEventCreate(&e0), "cudaEventCreate") || !check(cudaEventCreate(&e1), "cudaEventCreate"))
    return false;
  const size_t smem = MODE == 5 ? size_t(2 * kXRows) * (kCols + 8) * 2 : 0;
  if (MODE == 5 && !check(cudaFuncSetAttribute(chain_kernel<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                          "cudaFuncSetAttribute"))
    return false;
  chain_kernel<MODE><<<blocks, warps * 32, smem>>>(words, xhi, xlo, sums, 2, cycles, out);  // warm-up
  cudaEventRecord(e0);
  chain_kernel<MODE><<<blocks, warps * 32, smem>>>(words, xhi, xlo, sums, kReps, cycles, out);
  cudaEventRecord(e1);
  if (!check(cudaEventSynchronize(e1), "chain_kernel")) return false;
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  std::vector<unsigned long long> c(static_cast<size_t>(n_warps));
  if (!check(cudaMemcpy(c.data(), cycles, c.size() * sizeof(c[0]), cudaMemcpyDeviceToHost), "cudaMemcpy")) return false;
  double mean = 0;
  for (unsigned long long v : c) mean += double(v);
  mean /= double(n_warps);
  const double kblocks = double(n_warps) * kReps * 32;
  std::printf("mode %d  %2d warps a block, %d blocks an SM (%2d warps an SM): %7.1f cycles a k-block a warp, "
              "%8.1f k-blocks/us (%5.2f TB/s of q4 weights)\n",
              MODE, warps, blocks_per_sm, warps * blocks_per_sm, mean / (kReps * 32), kblocks / (ms * 1e3),
              kblocks * 576 / (ms * 1e-3) / 1e12);
  cudaFree(cycles);
  cudaFree(out);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return true;
}

}  // namespace

int main() {
  int sms = 0;
  uint32_t* words = nullptr;
  __half *xhi = nullptr, *xlo = nullptr;
  float* sums = nullptr;
  const size_t word_bytes = 64 * 512 * 4 + 4096, x_bytes = size_t(kXRows) * kCols * 2;
  if (!check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "no CUDA device") ||
      !check(cudaMalloc(&words, word_bytes), "cudaMalloc") || !check(cudaMalloc(&xhi, x_bytes), "cudaMalloc") ||
      !check(cudaMalloc(&xlo, x_bytes), "cudaMalloc") ||
      !check(cudaMalloc(&sums, size_t(kXRows) * (kCols / 32) * 4), "cudaMalloc"))
    return 1;
  cudaMemset(words, 0x5a, word_bytes);
  cudaMemset(xhi, 0x1c, x_bytes);  // small finite halves
  cudaMemset(xlo, 0x0c, x_bytes);
  cudaMemset(sums, 0, size_t(kXRows) * (kCols / 32) * 4);
  for (auto [w, b] : {std::pair{1, 1}, {4, 1}, {8, 1}, {8, 2}, {8, 3}, {16, 1}, {16, 2}}) {
    const bool ok = run<0>(w, b, sms, words, xhi, xlo, sums) && run<1>(w, b, sms, words, xhi, xlo, sums) &&
                    run<2>(w, b, sms, words, xhi, xlo, sums) && run<3>(w, b, sms, words, xhi, xlo, sums) &&
                    run<4>(w, b, sms, words, xhi, xlo, sums) && run<5>(w, b, sms, words, xhi, xlo, sums) &&
                    run<6>(w, b, sms, words, xhi, xlo, sums);
    if (!ok) return 1;
  }
  return 0;
}
