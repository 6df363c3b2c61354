// The rate at which kernels read mapped pinned host memory over PCIe, by access pattern, next to
// the copy engine's rate measured in the same process. The expert kernels read the experts of a
// partial VRAM tier in place this way (src/backend/cuda/cuda_expert_tier.cuh), and the size of
// each read decides the rate (docs/PERFORMANCE.md, session 26).
//
// Rows of 1024 bytes (q4 codes of 2048 columns), with a 2-byte scale for each 64 columns; a warp
// reads 16-row tiles over all columns. Patterns:
//   lanes          lane (g, j) reads 8 bytes of rows g and g + 8 a k-block, 4 k-blocks ahead (the
//                  lane-decoded expert kernels' loads, expert_few_mma.cu)
//   lanes+scales   the same with each row's scale a k-block
//   lanes, grouped the same words, a row's 4 k-blocks (one line) loaded back to back
//   lines+scales   8 lanes a row, 16 bytes each: 4 rows x 128 bytes an instruction, the 4 scales
//                  of a row's line in one 8-byte load (the staged path of expert_few_mma.cu)
//   row spans      32 lanes x 16 bytes of one row an instruction (the one-token GEMV's loads)
// Shapes: 768 tiles (8 experts' gate and up of Qwen3-30B-A3B's shape, what one layer of a batched
// step reads in place) and every row of a 512 MiB buffer.
//
//   pcie_read_bench [MiB]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kRowBytes = 1024;
constexpr int kBlocks = 32;  // k-blocks of 32 bytes (64 codes) a row

bool check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    std::fprintf(stderr, "pcie_read_bench: %s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

__device__ __forceinline__ uint32_t mix(uint2 v) {
  return v.x + v.y * 3;
}
__device__ __forceinline__ uint32_t mix(uint4 v) {
  return v.x + v.y * 3 + v.z * 5 + v.w * 7;
}

// This warp's index in the grid.
__device__ __forceinline__ int64_t warp_index() {
  return (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
}

// Lane (g, j)'s 8 bytes of rows g and g + 8 of the tile at row0, at the start of the row.
struct LaneRows {
  const char* r[2];
  __device__ LaneRows(const char* base, int64_t row0) {
    const int lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4;
    r[0] = base + (row0 + g) * kRowBytes + j * 8;
    r[1] = base + (row0 + g + 8) * kRowBytes + j * 8;
  }
};

template <bool SCALES>
__global__ void lanes(const char* base, const uint16_t* scales, int tiles_per_warp,
                      unsigned* sink) {
  const int g = int(threadIdx.x) % 32 / 4;
  const int64_t warp = warp_index();
  uint32_t acc = 0;
  for (int t = 0; t < tiles_per_warp; ++t) {
    const int64_t row0 = (warp * tiles_per_warp + t) * 16;
    const LaneRows rows(base, row0);
    const char* const* r = rows.r;
    const uint16_t* s[2] = {scales + (row0 + g) * kBlocks, scales + (row0 + g + 8) * kBlocks};
    uint2 v[4][2];
    uint16_t sv[4][2] = {};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        v[i][h] = *reinterpret_cast<const uint2*>(r[h] + i * 32);
        if (SCALES) sv[i][h] = s[h][i];
      }
    for (int kb0 = 0; kb0 < kBlocks; kb0 += 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc ^= mix(v[i][0]) + 5 * mix(v[i][1]) + sv[i][0] + sv[i][1];
        const int next = kb0 + i + 4;
        if (next < kBlocks)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            v[i][h] = *reinterpret_cast<const uint2*>(r[h] + next * 32);
            if (SCALES) sv[i][h] = s[h][next];
          }
      }
    }
  }
  if (acc == 0x12345678u) *sink = acc;
}

__global__ void lanes_grouped(const char* base, const uint16_t*, int tiles_per_warp,
                              unsigned* sink) {
  const int64_t warp = warp_index();
  uint32_t acc = 0;
  for (int t = 0; t < tiles_per_warp; ++t) {
    const int64_t row0 = (warp * tiles_per_warp + t) * 16;
    const LaneRows rows(base, row0);
    const char* const* r = rows.r;
    uint2 v[2][4][2];
    auto load = [&](int c, int line) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          v[c][i][h] = *reinterpret_cast<const uint2*>(r[h] + (4 * line + i) * 32);
    };
    load(0, 0);
    load(1, 1);
    for (int line = 0; line < kBlocks / 4; line += 2) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc ^= mix(v[c][i][0]) + 5 * mix(v[c][i][1]);
        if (line + c + 2 < kBlocks / 4) load(c, line + c + 2);
      }
    }
  }
  if (acc == 0x12345678u) *sink = acc;
}

__global__ void lines(const char* base, const uint16_t* scales, int tiles_per_warp,
                      unsigned* sink) {
  const int lane = int(threadIdx.x) % 32;
  const int64_t warp = warp_index();
  uint32_t acc = 0;
  for (int t = 0; t < tiles_per_warp; ++t) {
    const int64_t row0 = (warp * tiles_per_warp + t) * 16;
    const char* p = base + (row0 + lane / 8) * kRowBytes + (lane % 8) * 16;
    const uint16_t* sp = scales + (row0 + lane % 16) * kBlocks;
    uint4 v[2][4];
    uint2 s[2];
    auto load = [&](int c, int line) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        v[c][i] = *reinterpret_cast<const uint4*>(p + int64_t(4 * i) * kRowBytes + line * 128);
      s[c] = *reinterpret_cast<const uint2*>(sp + 4 * line);
    };
    load(0, 0);
    load(1, 1);
    for (int line = 0; line < kRowBytes / 128; line += 2) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc ^= mix(v[c][i]);
        acc += s[c].x + s[c].y;
        if (line + c + 2 < kRowBytes / 128) load(c, line + c + 2);
      }
    }
  }
  if (acc == 0x12345678u) *sink = acc;
}

__global__ void row_spans(const char* base, const uint16_t*, int tiles_per_warp, unsigned* sink) {
  const int lane = int(threadIdx.x) % 32;
  const int64_t warp = warp_index();
  uint32_t acc = 0;
  for (int t = 0; t < tiles_per_warp; ++t) {
    const int64_t row0 = (warp * tiles_per_warp + t) * 16;
#pragma unroll
    for (int r = 0; r < 16; r += 2) {
      uint4 v[4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          v[2 * h + half] = *reinterpret_cast<const uint4*>(base + (row0 + r + h) * kRowBytes +
                                                            half * 512 + lane * 16);
#pragma unroll
      for (int i = 0; i < 4; ++i) acc ^= mix(v[i]);
    }
  }
  if (acc == 0x12345678u) *sink = acc;
}

using Kernel = void (*)(const char*, const uint16_t*, int, unsigned*);

}  // namespace

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? size_t(std::strtoul(argv[1], nullptr, 10)) : 512;
  const size_t bytes = mib << 20;
  const int64_t rows = int64_t(bytes / kRowBytes);
  if (rows < 768 * 16 * 2) {
    std::fprintf(stderr, "pcie_read_bench: %zu MiB is too small (at least 24)\n", mib);
    return 2;
  }
  char* host = nullptr;
  uint16_t* scales = nullptr;
  char* dev = nullptr;
  unsigned* sink = nullptr;
  if (!check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped), "pinned buffer") ||
      !check(cudaHostAlloc(&scales, size_t(rows) * kBlocks * 2, cudaHostAllocMapped),
             "pinned scales") ||
      !check(cudaMalloc(&dev, bytes), "device buffer") ||
      !check(cudaMalloc(&sink, 4), "device sink"))
    return 1;
  for (size_t i = 0; i < bytes; i += 4096) host[i] = char(i);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  float ms = 0;
  double copy = 0;
  for (int rep = 0; rep < 3; ++rep) {
    cudaEventRecord(start);
    cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice);
    cudaEventRecord(stop);
    if (!check(cudaEventSynchronize(stop), "copy")) return 1;
    cudaEventElapsedTime(&ms, start, stop);
    if (bytes / ms / 1e6 > copy) copy = bytes / ms / 1e6;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s: copy engine host-to-device %.1f GB/s (%zu MiB, best of 3)\n", prop.name, copy,
              mib);
  std::printf("%-32s %-16s %8s %8s\n", "shape", "pattern", "GB/s", "of copy");
  struct Shape {
    const char* name;
    int64_t tiles;
    int per_warp;
  };
  const Shape shapes[] = {{"768 tiles, 1 a warp", 768, 1},
                          {"768 tiles, 2 a warp", 768, 2},
                          {"all rows, 1 tile a warp", rows / 16, 1},
                          {"all rows, 4 tiles a warp", rows / 16, 4}};
  const struct {
    const char* name;
    Kernel k;
  } patterns[] = {{"lanes", lanes<false>},
                  {"lanes+scales", lanes<true>},
                  {"lanes, grouped", lanes_grouped},
                  {"lines+scales", lines},
                  {"row spans", row_spans}};
  for (const Shape& s : shapes) {
    const int64_t warps = s.tiles / s.per_warp;
    const unsigned blocks = unsigned((warps + 3) / 4);
    const double moved = double(s.tiles) * 16 * kRowBytes;
    for (const auto& p : patterns) {
      double best = 0;
      for (int rep = 0; rep < 4; ++rep) {  // the first warms up; each reads another region
        const int64_t span = rows - s.tiles * 16;
        const int64_t first = span > 0 ? (int64_t(rep) * s.tiles * 16) % span : 0;
        cudaEventRecord(start);
        p.k<<<blocks, 128>>>(host + first * kRowBytes, scales + first * kBlocks, s.per_warp, sink);
        cudaEventRecord(stop);
        if (!check(cudaEventSynchronize(stop), p.name)) return 1;
        cudaEventElapsedTime(&ms, start, stop);
        if (rep > 0 && moved / ms / 1e6 > best) best = moved / ms / 1e6;
      }
      std::printf("%-32s %-16s %8.1f %7.0f%%\n", s.name, p.name, best, 100 * best / copy);
    }
  }
  return 0;
}
