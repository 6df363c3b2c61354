// The row loops the SIMD levels share (quant_avx2.cpp, quant_avx512.cpp). A level supplies the
// ISA-specific steps for one row as static functions of a class `Isa`; QuantLoops<Isa> runs
// them over rows and tokens and dispatches on the weight format:
//
//   one token      each row streamed once, the row about 4 KB ahead prefetched
//                  (Isa::dot_plain_row, Isa::dot_int8_row, Isa::dot_precise_row);
//   several tokens each row unpacked (int8 path: Isa::unpack_row into Isa::unpacked_bytes(cols)
//                  bytes, then Isa::dot_int8_unpacked per token) or dequantized / converted to
//                  float (Isa::dequantize_row, Isa::plain_row_to_f32, rows
//                  Isa::dequantized_stride apart), Isa::kPackRows at a time, transposed into
//                  panels of Isa::kPanelRows (Isa::pack_rows) and multiplied by the tokens
//                  (Isa::panel_times_tokens; see gemm.h).
//
// Row functions are templates over BITS (2, 3, 4, 6, 8), GS (32, 64, 128) and MX (MXFP4, which
// runs as 4-bit groups of 32 through core/quant.h's affine view). The loops themselves carry no
// target attribute: they call the level's functions once per row.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend/cpu/gemm.h"
#include "backend/cpu/quant_kernels.h"

namespace moestream::cpu::detail {

// One token's int8 activations, laid out by prepare_input.
struct TokenInt8 {
  const int8_t* q;
  const float* lane_scale;
  const float* group_sum;
};
inline TokenInt8 token_int8(const PreparedInput& in, int64_t t) {
  return TokenInt8{in.q.data() + t * in.stride, in.q_scale.data() + t * in.stride / 4,
                   in.group_sum.data() + t * in.group_stride};
}

template <class Isa>
struct QuantLoops {
  static void matmul_plain(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy, int64_t r0,
                           int64_t r1) {
    if (in.T == 1) {
      const int64_t ahead = prefetch_rows_ahead(w.cols * int64_t(dtype_size(w.dtype)));
      for (int64_t r = r0; r < r1; ++r) {
        if (r + ahead < r1) prefetch_plain_row(w, r + ahead);
        y[r] = Isa::dot_plain_row(w, r, in.x);
      }
      return;
    }
    panels(r0, r1, w.cols, w.cols, in.x, in.cols, in.T, y, ldy,
           [&](int64_t r, float* dst) { Isa::plain_row_to_f32(w, r, dst); });
  }

  template <int BITS, int GS, bool MX>
  static void matmul_int8(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy, int64_t r0,
                          int64_t r1) {
    if (in.T == 1) {
      const TokenInt8 x = token_int8(in, 0);
      const int64_t ahead = prefetch_rows_ahead(row_code_bytes(w));
      for (int64_t r = r0; r < r1; ++r) {
        if (r + ahead < r1) prefetch_quant_row(w, r + ahead);
        y[r] = Isa::template dot_int8_row<BITS, GS, MX>(w, r, x);
      }
      return;
    }
    thread_local std::vector<uint8_t> codes;
    codes.resize(size_t(Isa::unpacked_bytes(w.cols)));
    for (int64_t r = r0; r < r1; ++r) {
      Isa::template unpack_row<BITS, MX>(w, r, codes.data());
      for (int64_t t = 0; t < in.T; ++t)
        y[t * ldy + r] = Isa::template dot_int8_unpacked<BITS, GS, MX>(w, r, codes.data(), token_int8(in, t));
    }
  }

  template <int BITS, int GS, bool MX>
  static void matmul_precise(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy, int64_t r0,
                             int64_t r1) {
    if (in.T == 1) {
      const int64_t ahead = prefetch_rows_ahead(row_code_bytes(w));
      for (int64_t r = r0; r < r1; ++r) {
        if (r + ahead < r1) prefetch_quant_row(w, r + ahead);
        y[r] = Isa::template dot_precise_row<BITS, GS, MX>(w, r, in.xf.data());
      }
      return;
    }
    // Columns past w.cols are padding (zero activations), left out of the product.
    panels(r0, r1, Isa::dequantized_stride(w, in), w.cols, in.xf.data(), in.stride, in.T, y, ldy,
           [&](int64_t r, float* dst) { Isa::template dequantize_row<BITS, GS, MX>(w, r, dst); });
  }

  // Several tokens (gemm.h): rows [r0, r1) converted to float by row(r, dst) (rs floats each),
  // kPackRows at a time, transposed into panels of kPanelRows, times the tokens x[t * xs ..]
  // over K columns.
  template <class Row>
  static void panels(int64_t r0, int64_t r1, int64_t rs, int64_t K, const float* x, int64_t xs,
                     int64_t T, float* y, int64_t ldy, Row&& row) {
    constexpr int64_t P = Isa::kPanelRows, H = Isa::kPackRows;
    // Rows one cache line more than rs apart: at a power-of-two stride the H rows read together
    // by the transposition would share one L1 set.
    const int64_t ns = rs + 16;
    thread_local std::vector<float> natural, panel;
    natural.resize(size_t(H * ns));
    panel.resize(size_t(P * K));
    for (int64_t r = r0; r < r1; r += P) {
      const int64_t n = std::min(P, r1 - r);
      for (int64_t h = 0; h < n; h += H) {
        const int64_t m = std::min(H, n - h);
        for (int64_t j = 0; j < m; ++j) row(r + h + j, natural.data() + j * ns);
        Isa::pack_rows(natural.data(), ns, m, K, panel.data() + h, P);
      }
      Isa::panel_times_tokens(panel.data(), n, K, x, xs, T, y + r, ldy);
    }
  }

  // The instantiation for w's format (MXFP4, or affine bits x group size).
  template <bool INT8>
  static MatmulFn pick(const Matrix& w) {
    if (is_mxfp4(w)) return fn<INT8, 4, 32, true>();
    switch (w.quant.bits) {
      case 2: return by_group<INT8, 2>(w.quant.group_size);
      case 3: return by_group<INT8, 3>(w.quant.group_size);
      case 4: return by_group<INT8, 4>(w.quant.group_size);
      case 6: return by_group<INT8, 6>(w.quant.group_size);
      default: return by_group<INT8, 8>(w.quant.group_size);
    }
  }
  template <bool INT8, int B>
  static MatmulFn by_group(int g) {
    if (g == 32) return fn<INT8, B, 32, false>();
    if (g == 64) return fn<INT8, B, 64, false>();
    return fn<INT8, B, 128, false>();
  }
  template <bool INT8, int B, int G, bool MX>
  static MatmulFn fn() {
    if constexpr (INT8) {
      return &matmul_int8<B, G, MX>;
    } else {
      return &matmul_precise<B, G, MX>;
    }
  }

  static void matmul_quant_int8(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy, int64_t r0,
                                int64_t r1) {
    pick<true>(w)(w, in, y, ldy, r0, r1);
  }
  static void matmul_quant_precise(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy,
                                   int64_t r0, int64_t r1) {
    pick<false>(w)(w, in, y, ldy, r0, r1);
  }

  static const LevelKernels& table() {
    static const LevelKernels k{Isa::dot_f32,         Isa::axpy,         matmul_plain, matmul_quant_precise,
                                matmul_quant_int8, Isa::quantize_activations};
    return k;
  }
};

}  // namespace moestream::cpu::detail
