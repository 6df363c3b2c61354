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

}  // namespace
}  // namespace moestream
