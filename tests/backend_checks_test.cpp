// The argument checks every backend shares (backend/backend.cpp), through the CPU backend: what
// load_quantized, load_vector, copy_rows and embed refuse, with errors naming the tensor or the
// call. The CUDA backend calls the same functions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/quant.h"

namespace moestream {
namespace {

// The message of the Error `f` throws ("" when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TensorView view(std::string name, DType dtype, std::vector<int64_t> shape, const void* data) {
  TensorView t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data = data;
  t.nbytes = size_t(t.numel()) * dtype_size(dtype);
  return t;
}

TEST(BackendChecks, Fp8WeightsWithBiasesAreRefused) {
  // FP8 has no biases (QuantScheme::Fp8) and its kernels never read any: a bias tensor given
  // with FP8 weights is an error, not something to drop silently.
  auto be = make_cpu_backend(1, true);
  const std::vector<uint8_t> codes(4 * 64, 0x38);
  const std::vector<float> scales(4 * 2, 1.0f), biases(4 * 2, 0.5f);
  const TensorView w = view("layers.0.q_proj.weight", DType::F8_E4M3, {4, 64}, codes.data());
  const TensorView s = view("layers.0.q_proj.weight_scale_inv", DType::F32, {4, 2}, scales.data());
  const TensorView b = view("layers.0.q_proj.biases", DType::F32, {4, 2}, biases.data());
  const std::string msg = error_of([&] { be->load_quantized(w, s, b, fp8_format(32)); });
  EXPECT_NE(msg.find("layers.0.q_proj.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no biases"), std::string::npos) << msg;
  EXPECT_NO_THROW(be->load_quantized(w, s, TensorView{}, fp8_format(32)));
}

TEST(BackendChecks, Mxfp4ThroughLoadQuantizedIsRefusedByName) {
  // MXFP4 reaches a backend only as a routed expert's view, never through load_quantized.
  auto be = make_cpu_backend(1, true);
  const std::vector<uint8_t> codes(4 * 32, 0), exps(4 * 2, 127);
  const TensorView w = view("experts.gate_up_proj_blocks", DType::U8, {4, 32}, codes.data());
  const TensorView s = view("experts.gate_up_proj_scales", DType::U8, {4, 2}, exps.data());
  const std::string msg = error_of([&] { be->load_quantized(w, s, TensorView{}, kMxfp4Format); });
  EXPECT_NE(msg.find("experts.gate_up_proj_blocks"), std::string::npos) << msg;
  EXPECT_NE(msg.find("mxfp4"), std::string::npos) << msg;
}

TEST(BackendChecks, VectorsOfAnUnsupportedDtypeAreRefusedEvenWhenEmpty) {
  auto be = make_cpu_backend(1, true);
  const int32_t none[1] = {0};
  const std::string msg = error_of([&] { be->load_vector(view("norm.weight", DType::I32, {0}, none)); });
  EXPECT_NE(msg.find("norm.weight"), std::string::npos) << msg;
}

TEST(BackendChecks, EmbedNeedsAnOutputOfTheTablesWidthWithARowPerToken) {
  auto be = make_cpu_backend(1, true);
  const std::vector<float> table(8 * 16, 1.0f);
  const Matrix t = be->load_matrix(view("embed_tokens.weight", DType::F32, {8, 16}, table.data()));
  const std::vector<int32_t> tokens{1, 2, 3};
  Buffer wide = be->alloc(3, 32), short_rows = be->alloc(2, 16), ok = be->alloc(3, 16);
  EXPECT_NE(error_of([&] { be->embed(tokens, t, wide); }).find("embed"), std::string::npos);
  EXPECT_NE(error_of([&] { be->embed(tokens, t, short_rows); }).find("embed"), std::string::npos);
  const std::vector<int32_t> bad{1, 8};
  EXPECT_NE(error_of([&] { be->embed(bad, t, ok); }).find("token id 8 out of range"), std::string::npos);
  EXPECT_NO_THROW(be->embed(tokens, t, ok));
}

TEST(BackendChecks, CopyRowsRefusesMismatchedAndOverlappingBuffers) {
  auto be = make_cpu_backend(1, true);
  Buffer a = be->alloc(4, 8), b = be->alloc(4, 8), narrow = be->alloc(4, 4);
  EXPECT_THROW(be->copy_rows(a, narrow, 1), Error);
  EXPECT_THROW(be->copy_rows(a, b, 5), Error);
  EXPECT_THROW(be->copy_rows(a, b, -1), Error);
  Buffer tail = a.rows_view(1, 3);
  EXPECT_THROW(be->copy_rows(a, tail, 2), Error);
  EXPECT_NO_THROW(be->copy_rows(a, b, 4));
  EXPECT_NO_THROW(be->copy_rows(a, tail, 0));
}

// The default greedy_rows (the CPU's): the lowest column of the largest value, -1 for a row with
// NaN or +inf or nothing above -inf, as the sampler's greedy choice and its errors.
TEST(BackendChecks, GreedyRowsFollowTheSampler) {
  auto be = make_cpu_backend(1, true);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> rows = {
      {1, 3, 3, 2},  {-kInf, -kInf, -kInf, -kInf}, {1, std::numeric_limits<float>::quiet_NaN(), 5, 0},  {kInf, 1, 0, 0},
      {-kInf, -5, -kInf, -5}, {0, 0, 0, 0},           {2, -kInf, 7, 7.5f},
  };
  const std::vector<int32_t> want = {1, -1, -1, -1, 1, 0, 3};
  Buffer x = be->alloc(int64_t(rows.size()), 4);
  for (size_t r = 0; r < rows.size(); ++r) std::copy(rows[r].begin(), rows[r].end(), x.data + r * 4);
  std::vector<int32_t> ids(rows.size(), 99);
  be->greedy_rows(x, ids);
  EXPECT_EQ(ids, want);
  std::vector<int32_t> too_few(2);
  EXPECT_NE(error_of([&] { be->greedy_rows(x, too_few); }).find("2 ids for 7 rows"), std::string::npos);
}

// expert_rows (the CPU's share of a GPU's MoE call, --cpu-experts): each job's output rows are its
// expert's mlp() of the rows of x it names (in that order), bit for bit, from the row the job
// starts at; rows
// outside the output or x are refused by name.
TEST(BackendChecks, ExpertRowsAreEachExpertsMlpOfItsRows) {
  auto be = make_cpu_backend(3, true);
  constexpr int64_t dim = 64, inter = 32;
  std::vector<std::vector<float>> data;
  uint32_t state = 12345;
  auto fill = [&](std::vector<float>& v) {
    for (float& f : v) {
      state = state * 1664525u + 1013904223u;
      f = float(int(state >> 9) % 2001 - 1000) / 4000.0f;
    }
  };
  auto matrix = [&](const char* name, int64_t rows, int64_t cols) {
    data.emplace_back(size_t(rows * cols));
    fill(data.back());
    return be->load_matrix(view(name, DType::F32, {rows, cols}, data.back().data()));
  };
  MlpWeights a{matrix("a.gate", inter, dim),
               matrix("a.up", inter, dim),
               matrix("a.down", dim, inter),
               {},
               {},
               {}};
  MlpWeights b{matrix("b.gate", inter, dim),
               matrix("b.up", inter, dim),
               matrix("b.down", dim, inter),
               {},
               {},
               {}};
  Buffer x = be->alloc(3, dim);
  std::vector<float> xs(3 * dim);
  fill(xs);
  std::copy(xs.begin(), xs.end(), x.data);
  const std::vector<ExpertRows> jobs = {{a, {2, 0}, 1}, {b, {1}, 3}};
  Buffer y = be->alloc(4, dim);
  be->expert_rows(x, jobs, MoeParams{}, y);
  // mlp() of the same rows of x, gathered in the job's order
  auto mlp_of = [&](const MlpWeights& w, std::vector<int64_t> ts) {
    Buffer in = be->alloc(int64_t(ts.size()), dim), out = be->alloc(int64_t(ts.size()), dim);
    for (size_t i = 0; i < ts.size(); ++i)
      std::copy(x.data + ts[i] * dim, x.data + (ts[i] + 1) * dim, in.data + int64_t(i) * dim);
    be->mlp(in, w, out);
    return std::vector<float>(out.data, out.data + out.rows * dim);
  };
  auto rows = [&](int64_t r, int64_t n) {
    return std::vector<float>(y.data + r * dim, y.data + (r + n) * dim);
  };
  EXPECT_EQ(rows(0, 1), std::vector<float>(dim, 0.0f));
  EXPECT_EQ(rows(1, 2), mlp_of(a, {2, 0}));
  EXPECT_EQ(rows(3, 1), mlp_of(b, {1}));
  EXPECT_NE(rows(1, 1), rows(3, 1));
  const std::vector<ExpertRows> past_end = {{a, {0, 1}, 3}};
  EXPECT_NE(error_of([&] {
              be->expert_rows(x, past_end, MoeParams{}, y);
            }).find("expert_rows: rows [3, 5) of [4, 64]"),
            std::string::npos);
  const std::vector<ExpertRows> bad_token = {{b, {3}, 0}};
  EXPECT_NE(error_of([&] {
              be->expert_rows(x, bad_token, MoeParams{}, y);
            }).find("expert_rows: row 3 of x [3, 64]"),
            std::string::npos);
}

}  // namespace
}  // namespace moestream
