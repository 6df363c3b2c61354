// The row loops the SIMD levels share (quant_avx2.cpp, quant_avx512.cpp). A level supplies the
// ISA-specific steps for one row as static functions of a class `Isa`; QuantLoops<Isa> runs
// them over rows and tokens and dispatches on the weight format:
//
//   one token      each row streamed once, the row about 4 KB ahead prefetched
//                  (Isa::dot_plain_row, Isa::dot_int8_row, Isa::dot_precise_row; where
//                  Isa::int8_rows() / Isa::precise_rows(BITS), Isa::kOneTokenRows rows at a
//                  time by Isa::dot_int8_rows / Isa::dot_precise_rows, which prefetch the next
//                  rows' codes as they go: one_token_steps);
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
    panels(r0, r1, w.cols, in.x, in.cols, in.T, y, ldy,
           ViaRows{w.cols, [&](int64_t r, float* dst) { Isa::plain_row_to_f32(w, r, dst); }});
  }

  template <int BITS, int GS, bool MX>
  static void matmul_int8(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy, int64_t r0,
                          int64_t r1) {
    if (in.T == 1) {
      const TokenInt8 x = token_int8(in, 0);
      const int64_t ahead = prefetch_rows_ahead(row_code_bytes(w));
      if constexpr (Isa::int8_rows()) {
        one_token_steps<GS, MX>(w, r0, r1, ahead, [&](int64_t r, int64_t m, const uint8_t* next, int64_t lines) {
          Isa::template dot_int8_rows<BITS, GS, MX>(w, r, m, x, y + r, next, lines);
        });
      } else {
        for (int64_t r = r0; r < r1; ++r) {
          if (r + ahead < r1) prefetch_quant_row(w, r + ahead);
          y[r] = Isa::template dot_int8_row<BITS, GS, MX>(w, r, x);
        }
      }
      return;
    }
    if constexpr (Isa::kInt8Rows > 1) {
      if (in.T >= Isa::kInt8MinTokens) {
        for (int64_t r = r0; r < r1; r += Isa::kInt8Rows)
          Isa::template int8_rows_times_tokens<BITS, GS, MX>(w, r, std::min(Isa::kInt8Rows, r1 - r), in, y, ldy);
        return;
      }
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
      if constexpr (Isa::precise_rows(BITS)) {
        one_token_steps<GS, MX>(w, r0, r1, ahead, [&](int64_t r, int64_t m, const uint8_t* next, int64_t lines) {
          Isa::template dot_precise_rows<BITS, GS, MX>(w, r, m, in.xf.data(), y + r, next, lines);
        });
      } else {
        for (int64_t r = r0; r < r1; ++r) {
          if (r + ahead < r1) prefetch_quant_row(w, r + ahead);
          y[r] = Isa::template dot_precise_row<BITS, GS, MX>(w, r, in.xf.data());
        }
      }
      return;
    }
    // Columns past w.cols are padding (zero activations), left out of the product.
    if constexpr (Isa::panel_dequantizes(BITS)) {
      panels(r0, r1, w.cols, in.xf.data(), in.stride, in.T, y, ldy, Direct<BITS, GS, MX>{w});
    } else {
      panels(r0, r1, w.cols, in.xf.data(), in.stride, in.T, y, ldy,
             ViaRows{Isa::dequantized_stride(w, in), [&](int64_t r, float* dst) {
                       Isa::template dequantize_row<BITS, GS, MX>(w, r, dst);
                     }});
    }
  }

  // One token over rows [r0, r1) of a quantized matrix, Isa::kOneTokenRows at a time:
  // step(r, m, next, lines) computes rows r .. r + m - 1 and prefetches the codes at next (lines
  // cache lines: the rows `ahead` on, rounded up to whole steps) as it goes; the scales and
  // biases of those rows, a few lines, are prefetched here at its start.
  template <int GS, bool MX, class Step>
  static void one_token_steps(const Matrix& w, int64_t r0, int64_t r1, int64_t ahead, Step step) {
    constexpr int64_t R = Isa::kOneTokenRows;
    const int64_t lead = (ahead + R - 1) / R * R, code_bytes = row_code_bytes(w);
    for (int64_t r = r0; r < r1; r += R) {
      const int64_t m = std::min(R, r1 - r), next = std::min(m, r1 - r - lead);
      const uint8_t* codes = nullptr;
      if (next > 0) {
        codes = static_cast<const uint8_t*>(w.data) + (r + lead) * code_bytes;
        prefetch_quant_sides<GS, MX>(w, r + lead, next);
      }
      step(r, m, codes, next > 0 ? (next * code_bytes + 63) / 64 : 0);
    }
  }

  // Several tokens (gemm.h): rows [r0, r1) in panels of kPanelRows, kPackRows rows at a time
  // from `rows` (below), times the tokens x[t * xs ..], kBlockColumns columns at a time so that
  // the panel block stays in L1 while the tokens pass over it.
  template <class Rows>
  static void panels(int64_t r0, int64_t r1, int64_t K, const float* x, int64_t xs, int64_t T,
                     float* y, int64_t ldy, Rows rows) {
    constexpr int64_t P = Isa::kPanelRows, H = Isa::kPackRows;
    // Aligned to a cache line: each column of the panel is whole lines.
    thread_local std::vector<float> buffer(size_t(P * kBlockColumns + 16));
    float* panel = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / 4 % 16) % 16;
    if (K == 0) {
      for (int64_t t = 0; t < T; ++t) std::fill(y + t * ldy + r0, y + t * ldy + r1, 0.0f);
      return;
    }
    for (int64_t r = r0; r < r1; r += P) {
      const int64_t n = std::min(P, r1 - r);
      for (int64_t h = 0; h < n; h += H) rows.load(r + h, std::min(H, n - h), h / H);
      for (int64_t k0 = 0; k0 < K; k0 += kBlockColumns) {
        const int64_t kn = std::min(kBlockColumns, K - k0);
        for (int64_t h = 0; h < n; h += H) rows.pack(r + h, std::min(H, n - h), h / H, k0, kn, panel + h, P);
        Isa::panel_times_tokens(panel, n, kn, x + k0, xs, T, y + r, ldy, k0 > 0);
      }
    }
  }
  // Rows converted one at a time by row(r, dst) (rs floats, in the activations' order), kept
  // whole, and transposed block by block (Isa::pack_rows).
  template <class Row>
  struct ViaRows {
    int64_t rs;
    Row row;
    // Rows one cache line more than rs apart: at a power-of-two stride the rows read together
    // by the transposition would share one L1 set.
    int64_t stride() const { return rs + 16; }
    float* slot(int s) const {
      thread_local std::vector<float> natural;
      natural.resize(size_t(Isa::kPanelRows * stride()));
      return natural.data() + s * Isa::kPackRows * stride();
    }
    void load(int64_t r, int64_t m, int s) const {
      for (int64_t j = 0; j < m; ++j) row(r + j, slot(s) + j * stride());
    }
    void pack(int64_t, int64_t m, int s, int64_t k0, int64_t kn, float* dst, int64_t ps) const {
      Isa::pack_rows(slot(s) + k0, stride(), m, kn, dst, ps);
    }
  };
  // Spelled out for clang 16 (scripts/fuzz), which does not deduce an aggregate's arguments.
  template <class Row>
  ViaRows(int64_t, Row) -> ViaRows<Row>;
  // Rows dequantized straight into the panel (Isa::dequantize_panel).
  template <int BITS, int GS, bool MX>
  struct Direct {
    const Matrix& w;
    void load(int64_t r, int64_t m, int s) const { Isa::template panel_groups<BITS, GS, MX>(w, r, m, s); }
    void pack(int64_t r, int64_t m, int s, int64_t k0, int64_t kn, float* dst, int64_t ps) const {
      Isa::template dequantize_panel<BITS, GS, MX>(w, r, m, s, k0, kn, dst, ps);
    }
  };

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
