// Launchers of the linear-layer kernels (linear.cu): GEMV for a few tokens, dequantized tiles
// through cuBLAS for more, and embedding rows. Pointers are device memory; work goes on `stream`.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/split_rows.cuh"

namespace moestream::cuda {

// The device's SMs (read once).
int sm_count();

struct FormatTag;  // weights.cuh

// Tokens up to which linear() runs the GEMV kernel (weights read once per 4 tokens); above it
// (MOESTREAM_CUDA_GEMM_TOKENS in the environment moves the bound, for tests) the matrix goes
// through cuBLAS in dequantized tiles.
constexpr int64_t kGemvMaxTokens = 8;
int64_t gemm_min_tokens();
// Calls of up to lane_tokens() tokens past kGemvMaxTokens run the few-token kernels too: the
// linears in passes of at most 8 tokens, the experts in work items of 8 rows (the lane-decoded
// kernels). Up to 64 tokens they beat the exact kernels' items of 32 (docs/PERFORMANCE.md);
// MOESTREAM_CUDA_LANE_TOKENS=N moves the bound (0: off).
constexpr int64_t kLaneMaxTokens = 64;
int64_t lane_tokens();
// Whether a call of T tokens takes the FP16 tensor-core paths (GemmMath::Fp16, the expert GEMM
// of moe.h). Opt-in, since they are lossy: with MOESTREAM_CUDA_TENSOR_CORES=1, from 128 tokens
// (prefill; MOESTREAM_CUDA_TENSOR_CORE_TOKENS moves the bound, tests force it with 2). Otherwise
// every product sums float32 values (GEMV, SGEMM without TF32, the expert kernels), as the CPU's
// --precise does. docs/PERFORMANCE.md has their speed and error.
bool tensor_cores_for(int64_t T);

// The slots of GemmScratch::area: linear()'s FP16 tile and activations, the expert GEMM's
// (moe.h) FP16 weights, gathered activations, gate / up outputs, hidden activations, down outputs and the
// device pointer arrays of its grouped GEMMs.
enum GemmArea : int { kAreaTile16, kAreaX16, kAreaExpertW16, kAreaExpertX16, kAreaExpertGate, kAreaExpertUp,
                      kAreaExpertHidden, kAreaExpertDown, kAreaExpertPointers,
                      kAreaExactHi, kAreaExactLo, kAreaExactSum, kAreaExactInv,  // linear_exact_mma's split x
                      kAreaSplitW, kAreaSplitInv, kAreaSplitSums,  // its weights split for cuBLAS
                      kAreaNormHi, kAreaNormLo, kAreaNormSum, kAreaNormInv };  // NormSplit's rows

// A failed cuBLAS call throws Error naming the call site (like MS_CUDA_CHECK).
void check_cublas(cublasStatus_t s, const char* what, const char* file, int line);
#define MS_CUBLAS_CHECK(expr) ::moestream::cuda::check_cublas((expr), #expr, __FILE__, __LINE__)

// Device scratch of the GEMM paths, grown to the largest size seen. `handle` computes in float32
// (pedantic math: no TF32); `handle16` multiplies FP16 operands on the tensor cores with float32
// accumulation.
struct GemmScratch {
  cublasHandle_t handle = nullptr;
  cublasHandle_t handle16 = nullptr;
  float* tile = nullptr;
  size_t tile_floats = 0;
  // Device areas by slot (GemmArea), each grown to the largest size asked for.
  std::vector<std::pair<void*, size_t>> areas;
  void* area(int slot, size_t bytes);
  // x as the RMSNorm before this operation split it (split_rows.cuh), or nothing.
  NormSplit norm_split;
  cublasHandle_t tensor_handle(cudaStream_t stream);
  ~GemmScratch();
};

// Whether the exact tensor-core paths are on (the default; MOESTREAM_CUDA_EXACT_MMA=0 turns them
// off, for comparison): the quantized experts of calls of more than one token (moe.h) and BF16
// linear layers above the GEMV bound, both to float32 accuracy.
bool exact_mma_enabled();

// Quantized matrices above the GEMV bound on the tensor cores to float32 accuracy
// (expert_exact_mma.cu, the experts' kernels with one matrix): codes as FP16 operands, x split
// into two FP16 halves per row, the groups' scales and biases in float32. linear() takes it for
// GemmMath::Fp16 when linear_exact_mma_supported (quantized, cols a multiple of 32, x rows 16-byte
// aligned).
bool linear_exact_mma_supported(FormatTag tag, int64_t cols, const float* x, int64_t ldx);
void linear_exact_mma(const Matrix& w, const float* x, int64_t ldx, int64_t T, const float* bias, float* out,
                      int64_t ldo, GemmScratch& scratch, cudaStream_t stream);
// From T tokens on (128, or MOESTREAM_CUDA_SPLIT_GEMM_TOKENS, at least 9; 0: never) those calls
// go through cuBLAS instead: each weight dequantized and split into two FP16 halves once a call,
// two FP16 GEMMs with float32 sums (lo x lo left out: below 2^-22 of each product).
bool split_gemm_for(int64_t T);
// Up to 4 such matrices over the same x (q, k and v) in one launch, x split once; each output as
// linear_exact_mma computes it (out[i] of row stride w[i].rows), bit for bit below split_gemm_for's
// threshold; from it on the matrices' rows are stacked into one cuBLAS GEMM, whose sums may round
// differently from those of one matrix alone. The caller checks that they share format and width
// (linear_shared_input). False (nothing launched) when they cannot take it.
bool linear_exact_mma_shared(std::span<const Matrix* const> w, const float* x, int64_t ldx, int64_t T,
                             std::span<const float* const> bias, std::span<float* const> out, GemmScratch& scratch,
                             cudaStream_t stream);

// Quantized matrices (q4 and q8 in groups of a power of two from 32 columns) for 2 to
// kGemvMaxTokens tokens on the tensor cores (gemv_mma.cu): codes as FP16 operands, x split into
// two FP16 halves per row (split_rows.cuh), the groups' scales and biases in float32, as
// linear_exact_mma computes but with each lane's codes decoded straight into its fragments. The
// rounding differs from one token's GEMV by float32-level amounts (docs/ARCHITECTURES.md).
// few_mma_enabled: with the exact tensor-core paths, unless MOESTREAM_CUDA_FEW_MMA=0 (then the GEMV
// and the experts' decode kernels take such calls, as before, for comparison).
bool few_mma_enabled();
// How many times the batched experts' down took its stream kernel (expert_few_mma.cu), for the
// tests.
uint64_t down_stream_launches();
bool few_mma_for(const Matrix& m, int64_t T, const float* x, int64_t ldx);
// Up to 4 such matrices of one format and width over x in one launch.
void linear_few_mma(std::span<const Matrix* const> w, const float* x, int64_t ldx, int64_t T,
                    std::span<const float* const> bias, std::span<float* const> out, std::span<const int64_t> ldo,
                    GemmScratch& scratch, cudaStream_t stream);
// Whether these matrices (together in one launch) fit the rows kernel that linear_few_mma takes for
// launches of many waves of tiles: whole rows in 16-byte pieces, one row geometry, the stage within
// a block's shared memory (the tests check that the path they compare was taken).
bool few_rows_fit(std::span<const Matrix* const> w);

// How linear() multiplies above the GEMV bound.
//  Fp16: with MOESTREAM_CUDA_TENSOR_CORES=1 (tensor_cores_for), tiles of W dequantized to FP16,
//        x rounded to FP16 (saturating at +-65504), products on the tensor cores summed in
//        float32: a relative error of about 1e-3 per output (FP16 keeps 11 significant bits), the
//        tolerance docs/ARCHITECTURES.md states. Otherwise float32 accuracy: BF16 weights on the
//        tensor cores with x split into three BF16 parts that sum to it exactly (products exact,
//        sums float32), also from 2 tokens up (a batched decode step); quantized formats through
//        linear_exact_mma; the rest as F32.
//  F32:  tiles dequantized to float32 and SGEMM: the GEMV's float32 arithmetic (the router,
//        whose top-k compares logits).
enum class GemmMath { Fp16, F32 };

// out[t, :] (row stride ldo) = x[t, :] (row stride ldx) @ W^T (+ bias[r]) for t < T.
void linear(const Matrix& w, const float* x, int64_t ldx, int64_t T, const float* bias, float* out,
            int64_t ldo, GemmScratch& scratch, cudaStream_t stream, GemmMath math = GemmMath::Fp16);

// out[i][t, :] (row stride w[i].rows) = x[t, :] @ W[i]^T (+ bias[i]) in one GEMV launch, when the
// call is below the GEMV bound and the matrices (at most 4) share format and width; each row sums
// exactly as linear()'s GEMV does (BF16 from 2 tokens: x split once, each matrix as linear()
// multiplies it). Above the GEMV bound, quantized matrices in one launch of the exact tensor-core
// linear (linear_exact_mma_shared). False (nothing launched) otherwise.
bool linear_shared_input(std::span<const Matrix* const> w, const float* x, int64_t ldx, int64_t T,
                         std::span<const float* const> bias, std::span<float* const> out, GemmScratch& scratch,
                         cudaStream_t stream);

// Rows [r0, r0 + n) of w as FP16 into dst [n, w.cols] (saturating), for the tensor-core paths.
void dequantize_rows_f16(const Matrix& w, int64_t r0, int64_t n, void* dst, cudaStream_t stream);
// dst [T, cols] FP16 = x [T, cols] (row stride ldx), saturating at +-65504.
void to_f16(const float* x, int64_t ldx, int64_t T, int64_t cols, void* dst, cudaStream_t stream);

// out[t, :] = row tokens[t] of table, as float32 (tokens already checked against table.rows).
void embed(const Matrix& table, const int32_t* tokens, int64_t T, float* out, cudaStream_t stream);

}  // namespace moestream::cuda
