// CPU-vs-CUDA parity of attention over compact and windowed KV caches (--kv-type, --kv-window,
// --kv-sinks): for every type, with and without a ring, the GPU packs the same bytes into the
// caches as the CPU (so both read the same dequantized keys and values) and attends to the same
// outputs up to summation order.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "test_util.h"

namespace moestream {
namespace {

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

class KvPair : public ::testing::Test {
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
  std::vector<float> host(Backend& be, const Buffer& b) {
    std::vector<float> v(size_t(b.rows * b.cols));
    be.to_host(b, v.data());
    return v;
  }
  // The caches hold codes, not floats: compared byte for byte.
  bool same_bytes(const Buf& b) {
    const std::vector<float> c = host(*cpu, b.c), g = host(*gpu, b.g);
    return std::memcmp(c.data(), g.data(), c.size() * sizeof(float)) == 0;
  }
  std::unique_ptr<Backend> cpu, gpu;
};

TEST_F(KvPair, EveryKvTypeWithAndWithoutARingMatchesTheCpu) {
  struct Case {
    int heads, kv_heads, hd, vd;
    int64_t window;  // the model's own sliding window
    bool sinks, values_in_keys;
  };
  for (KvType type : {KvType::F32, KvType::BF16, KvType::F16, KvType::Fp8, KvType::Q8})
    for (int64_t kv_window : {int64_t(0), int64_t(6)})
      for (const Case& c : {Case{8, 2, 64, 64, 0, false, false}, Case{4, 4, 32, 32, 5, true, false},
                            Case{4, 1, 96, 64, 0, false, true}, Case{2, 2, 128, 128, 0, false, false},
                            Case{4, 2, 256, 256, 0, false, false}}) {
        KvCacheSpec kv;
        kv.type = type;
        kv.window = kv_window;
        kv.sinks = kv_window ? 2 : 0;
        AttentionParams p = test::attention_params(c.heads, c.kv_heads, c.hd, c.vd, c.window, c.values_in_keys);
        p.kv = kv;
        std::vector<float> sink = random_values(size_t(c.heads), 3);
        const TensorView sv{"sinks", DType::F32, {c.heads}, sink.data(), sink.size() * 4};
        const Vector sc = cpu->load_vector(sv), sg = gpu->load_vector(sv);
        const int64_t kv_dim = int64_t(c.kv_heads) * c.hd, v_dim = c.values_in_keys ? 0 : int64_t(c.kv_heads) * c.vd;
        const int64_t rows = kv_cache_rows(kv, 64);
        const int64_t kw = kv_row_words(type, kv_dim, c.kv_heads), vw = kv_row_words(type, v_dim, c.kv_heads);
        Buf kc = buf(rows, kw, std::vector<float>(size_t(rows * kw))), vc = buf(rows, vw, std::vector<float>(size_t(rows * vw)));
        int64_t n_past = 0;
        // 40 tokens: a call whose keys and values are split once for the tensor cores (more
        // tokens than a graph step; without a ring).
        for (int64_t T : {int64_t(13), int64_t(1), int64_t(1), int64_t(7), int64_t(1), int64_t(40)}) {
          const uint32_t seed = uint32_t(n_past);
          Buf q = buf(T, int64_t(c.heads) * c.hd, random_values(size_t(T * c.heads * c.hd), 100 + seed));
          Buf k = buf(T, kv_dim, random_values(size_t(T * kv_dim), 200 + seed));
          Buf v = buf(T, v_dim, random_values(size_t(T * v_dim), 300 + seed));
          Buf out = buf(T, int64_t(c.heads) * c.vd, std::vector<float>(size_t(T * c.heads * c.vd), NAN));
          p.n_past = n_past;
          AttentionParams pc = p, pg = p;
          pc.sinks = c.sinks ? &sc : nullptr;
          pg.sinks = c.sinks ? &sg : nullptr;
          cpu->attention(q.c, k.c, v.c, kc.c, vc.c, pc, out.c);
          gpu->attention(q.g, k.g, v.g, kc.g, vc.g, pg, out.g);
          const auto what = [&] {
            return std::string(kv_type_name(type)) + " window " + std::to_string(kv_window) + " heads " +
                   std::to_string(c.heads) + " hd " + std::to_string(c.hd) + " T " + std::to_string(T) + " n_past " +
                   std::to_string(n_past);
          };
          EXPECT_LT(test::relative_error(host(*gpu, out.g), host(*cpu, out.c)), 1e-5) << what();
          EXPECT_TRUE(same_bytes(kc)) << "K cache " << what();
          if (vw) {
            EXPECT_TRUE(same_bytes(vc)) << "V cache " << what();
          }
          n_past += T;
        }
      }
}

}  // namespace
}  // namespace moestream
