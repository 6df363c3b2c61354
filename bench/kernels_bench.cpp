// GEMV (one token) throughput of the CPU kernels for each weight format, against the memory read
// bandwidth measured in this process with the same number of threads.
//
// Decoding an MoE streams each routed expert's matrices from RAM once per token, so each GEMV
// here reads a different copy of the matrix, cycling through copies that together are several
// times the last-level cache: the bytes counted (codes + scales + biases) come from DRAM. The
// "cached" rows reuse one copy, which shows the kernel's speed when memory is not the limit.
//
//   kernels_bench                                  every benchmark
//   kernels_bench --benchmark_filter=q4            some of them
//   MOESTREAM_KERNELS=avx2 kernels_bench           another SIMD level
//
// Quantized formats run both activation paths: /int8 (precise = false) and /f32 (precise =
// true). Counters: GB/s (weight bytes read per second) and pct_bw (that, as a percentage of the read
// bandwidth measured with the same thread count). Threads: the calling thread plus
// ThreadPool workers, splitting rows as the CPU backend does.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/quant.h"
#include "core/thread_pool.h"

namespace moestream {
namespace {

constexpr size_t kBandwidthBytes = size_t(1) << 30;  // read-bandwidth buffer, well past any cache
constexpr size_t kColdBytes = size_t(768) << 20;     // copies of a matrix add up to at least this

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using Bytes = std::unique_ptr<uint8_t[], AlignedFree>;
Bytes alloc_bytes(size_t n) {
  return Bytes(static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) / 64 * 64)));
}

// ---- memory read bandwidth ------------------------------------------------------------------

uint64_t sum_words(const uint64_t* p, size_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i + 4 <= n; i += 4) a += p[i], b += p[i + 1], c += p[i + 2], d += p[i + 3];
  return a + b + c + d;
}

const uint8_t* bandwidth_buffer() {
  static Bytes buf = [] {
    Bytes b = alloc_bytes(kBandwidthBytes);
    std::memset(b.get(), 1, kBandwidthBytes);
    return b;
  }();
  return buf.get();
}

// Reads the buffer once with `threads` threads (each a contiguous slice); returns seconds.
double read_once(int threads) {
  const uint64_t* p = reinterpret_cast<const uint64_t*>(bandwidth_buffer());
  const size_t words = kBandwidthBytes / 8, per = words / size_t(threads);
  std::vector<uint64_t> sums(static_cast<size_t>(threads));
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t)
    pool.emplace_back([&, t] { sums[size_t(t)] = sum_words(p + per * size_t(t), per); });
  sums[0] = sum_words(p, per);
  for (auto& t : pool) t.join();
  benchmark::DoNotOptimize(sums.data());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Best of several reads, bytes per second; measured once per thread count.
double read_bandwidth(int threads) {
  static std::map<int, double> measured;
  auto it = measured.find(threads);
  if (it != measured.end()) return it->second;
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) best = std::min(best, read_once(threads));
  return measured[threads] = double(kBandwidthBytes) / best;
}

void BM_MemoryRead(benchmark::State& state) {
  const int threads = int(state.range(0));
  for (auto _ : state) state.SetIterationTime(read_once(threads));
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(kBandwidthBytes));
  state.counters["GB/s"] = benchmark::Counter(double(state.iterations()) * kBandwidthBytes / 1e9,
                                              benchmark::Counter::kIsRate);
}

// ---- weight matrices ------------------------------------------------------------------------

struct Format {
  std::string name;  // "bf16", "q4g64", ...
  DType dtype = DType::BF16;
  QuantFormat quant;
};

Format format(const std::string& name) {
  if (name == "bf16") return {name, DType::BF16, {}};
  if (name == "f16") return {name, DType::F16, {}};
  if (name == "mxfp4") return {name, DType::U8, kMxfp4Format};
  if (name == "fp8") return {name, DType::F8_E4M3, fp8_format(128)};
  return {name, DType::U32, parse_quant_format(name)};
}

// `copies` copies of one random rows x cols matrix in `f`, each with its data, scales and biases
// contiguous (as a packed expert is).
struct MatrixSet {
  Bytes memory;
  std::vector<Matrix> matrices;
  int64_t bytes = 0;  // bytes one GEMV reads

  MatrixSet(const Format& f, int64_t rows, int64_t cols, int64_t copies) {
    std::mt19937 rng(1);
    std::normal_distribution<float> dist(0.0f, 0.02f);
    std::vector<float> w(size_t(rows * cols));
    for (float& v : w) v = dist(rng);
    std::vector<uint8_t> one;  // data, then scales, then biases
    int64_t data_bytes = 0, side_bytes = 0;
    if (f.quant.bits == 0) {
      data_bytes = rows * cols * 2;
      one.resize(size_t(data_bytes));
      auto* h = reinterpret_cast<uint16_t*>(one.data());
      for (size_t i = 0; i < w.size(); ++i)
        h[i] = f.dtype == DType::F16 ? f32_to_f16(w[i]) : f32_to_bf16(w[i]);
    } else if (f.quant.scheme == QuantScheme::Fp8) {
      // Codes of a normal spread (random bytes without NaN) and one scale per 128 columns.
      data_bytes = rows * cols;
      const int64_t groups = quant_groups_per_row(f.quant, cols);
      one.resize(size_t(data_bytes + rows * groups * 4));
      for (int64_t i = 0; i < data_bytes; ++i) one[size_t(i)] = uint8_t(rng() % 0x7e) | uint8_t(rng() & 0x80);
      for (int64_t g = 0; g < rows * groups; ++g) {
        const float scale = 1e-3f;
        std::memcpy(one.data() + data_bytes + g * 4, &scale, 4);
      }
    } else if (f.quant.scheme == QuantScheme::Mxfp4) {
      data_bytes = rows * cols / 2;
      one.resize(size_t(data_bytes + rows * cols / 32));
      quantize_mxfp4(w.data(), rows, cols, one.data(), one.data() + data_bytes);
    } else {
      data_bytes = rows * quant_words_per_row(f.quant, cols) * 4;
      side_bytes = rows * quant_groups_per_row(f.quant, cols) * 2;
      one.resize(size_t(data_bytes + 2 * side_bytes));
      quantize_affine(w.data(), rows, cols, f.quant, reinterpret_cast<uint32_t*>(one.data()),
                      reinterpret_cast<uint16_t*>(one.data() + data_bytes),
                      reinterpret_cast<uint16_t*>(one.data() + data_bytes + side_bytes));
    }
    bytes = int64_t(one.size());
    const int64_t stride = (bytes + 4095) / 4096 * 4096;
    memory = alloc_bytes(size_t(stride * copies));
    for (int64_t c = 0; c < copies; ++c) {
      uint8_t* base = memory.get() + c * stride;
      std::memcpy(base, one.data(), one.size());
      Matrix m;
      m.name = f.name;
      m.dtype = f.dtype;
      m.data = base;
      m.rows = rows;
      m.cols = cols;
      m.quant = f.quant;
      if (f.quant.bits) {
        m.scales = base + data_bytes;
        m.biases = f.quant.scheme == QuantScheme::Affine ? base + data_bytes + side_bytes : nullptr;
      }
      matrices.push_back(m);
    }
  }
};

// The benchmarks run in registration order; consecutive ones share a set.
MatrixSet& matrix_set(const Format& f, int64_t rows, int64_t cols, bool cold) {
  static std::unique_ptr<MatrixSet> set;
  static std::string key;
  const std::string want = f.name + "/" + std::to_string(rows) + "x" + std::to_string(cols) +
                           (cold ? "/cold" : "/hot");
  if (!set || key != want) {
    set.reset();  // free the previous set first
    const int64_t one = MatrixSet(f, 1, cols, 1).bytes * rows;
    const int64_t copies = cold ? std::max<int64_t>(1, int64_t(kColdBytes) / one + 1) : 1;
    set = std::make_unique<MatrixSet>(f, rows, cols, copies);
    key = want;
  }
  return *set;
}

void BM_Gemv(benchmark::State& state, Format f, int64_t rows, int64_t cols, int threads,
             bool precise, bool cold) {
  MatrixSet& set = matrix_set(f, rows, cols, cold);
  ThreadPool pool(threads);
  std::vector<float> x(static_cast<size_t>(cols)), y(static_cast<size_t>(rows));
  std::mt19937 rng(2);
  std::normal_distribution<float> dist;
  for (float& v : x) v = dist(rng);
  cpu::PreparedInput in;
  const size_t min_chunk = size_t(std::max<int64_t>(1, 16384 / cols));  // as the CPU backend
  size_t next = 0;
  for (auto _ : state) {
    const Matrix& w = set.matrices[next++ % set.matrices.size()];
    cpu::prepare_input(w, x.data(), 1, precise, in);
    pool.parallel_for(size_t(rows), [&](size_t r0, size_t r1) {
      cpu::matmul_rows(w, in, y.data(), rows, int64_t(r0), int64_t(r1));
    }, min_chunk);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const double bytes = double(state.iterations()) * double(set.bytes);
  state.SetBytesProcessed(int64_t(bytes));
  state.counters["GB/s"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsRate);
  state.counters["pct_bw"] =
      benchmark::Counter(bytes / read_bandwidth(threads) * 100, benchmark::Counter::kIsRate);
}

void register_all() {
  for (int threads : {1, 2})
    benchmark::RegisterBenchmark("memory_read", BM_MemoryRead)
        ->Arg(threads)
        ->ArgName("threads")
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(5);

  struct Shape {
    int64_t rows, cols;
  };
  const Shape experts[] = {{768, 2048}, {2048, 768}};  // gate/up (out, in) and down
  auto add = [](const std::string& fmt, Shape s, int threads, bool precise, bool cold) {
    const std::string name = "gemv/" + fmt + "/" + std::to_string(s.rows) + "x" +
                             std::to_string(s.cols) +
                             (fmt[0] != 'q' && fmt != "mxfp4" ? "" : precise ? "/f32" : "/int8") +
                             (cold ? "" : "/cached") + "/threads:" + std::to_string(threads);
    benchmark::RegisterBenchmark(name.c_str(), BM_Gemv, format(fmt), s.rows, s.cols, threads,
                                 precise, cold)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime()
        ->MinTime(0.3);
  };
  for (const char* fmt : {"bf16", "fp8", "q8g64", "q6g64", "q4g32", "q4g64", "q4g128", "q3g64", "q2g64", "mxfp4"})
    for (Shape s : experts)
      for (bool precise : {false, true}) {
        if (precise && (std::string(fmt) == "bf16" || std::string(fmt) == "fp8")) continue;  // one path
        for (int threads : {1, 2}) add(fmt, s, threads, precise, true);
      }
  for (bool precise : {false, true})
    for (int threads : {1, 2}) add("q4g64", experts[0], threads, precise, false);
  add("fp8", experts[0], 1, false, false);  // compute rate, the matrix in cache
  add("bf16", experts[0], 1, false, false);
  for (int threads : {1, 2}) add("bf16", {151936, 2048}, threads, false, true);
}

}  // namespace
}  // namespace moestream

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("kernel_level",
                              std::string(moestream::cpu::kernel_level_name(
                                  moestream::cpu::kernel_level())));
  moestream::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
