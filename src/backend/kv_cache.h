// How a KV cache stores keys and values (--kv-type) and which positions it keeps (--kv-window,
// --kv-sinks). A cache is a Buffer of 32-bit words, one row per kept position; a row packs the
// `cols` values of one token's keys (or values) in `heads` heads:
//   f32        cols floats (the historical layout, read as it is)
//   bf16, f16  cols 16-bit values, two per word (f16 saturating at +-65504)
//   fp8, q8    heads float32 scales (one per head: max|x| / 448 for E4M3 codes, max|x| / 127 for
//              int8 codes), then cols 1-byte codes, four per word
// So copy_rows, snapshots and bytes() work on caches of any type unchanged.
#pragma once

#include <cstdint>
#include <string>

namespace moestream {

enum class KvType : uint8_t { F32, BF16, F16, Fp8, Q8 };

const char* kv_type_name(KvType t);  // "f32", "bf16", "f16", "fp8", "q8"
// false when s is none of those names.
bool parse_kv_type(const std::string& s, KvType& out);

// StreamingLLM-style windows: with window > 0 a query sees the first `sinks` positions and the
// latest `window` ones (itself included), and a layer's cache holds sinks + window rows, the
// window rows a ring. Keys keep the rotary position they were written at (no re-rotation).
struct KvCacheSpec {
  KvType type = KvType::F32;
  int64_t window = 0;
  int64_t sinks = 0;
  bool ring = true;  // false: keep every row and only mask (the reference the ring is tested against)
  // Caches that take memory as sequences grow (Backend::alloc_growable; the server's, whose
  // engine trims them); otherwise each cache is one allocation of its capacity (on CUDA a
  // 2 MiB chunk per small cache cost decode 1-4%: docs/PERFORMANCE.md).
  bool growable = false;
};

// Words of one cache row of cols values in heads heads (0 when cols is 0).
int64_t kv_row_words(KvType t, int64_t cols, int64_t heads);
// Rows of a layer's cache for capacity positions.
inline int64_t kv_cache_rows(const KvCacheSpec& s, int64_t capacity) {
  return s.window > 0 && s.ring && capacity > s.sinks + s.window ? s.sinks + s.window : capacity;
}
// The row holding position pos.
inline int64_t kv_slot(const KvCacheSpec& s, int64_t pos) {
  return s.window <= 0 || !s.ring || pos < s.sinks ? pos : s.sinks + (pos - s.sinks) % s.window;
}
// Whether cutting a sequence at n_past back to n keeps every row that position n will read: true
// unless the ring of `rows` rows has already overwritten one of them.
bool kv_can_truncate(const KvCacheSpec& s, int64_t rows, int64_t n, int64_t n_past);

// Packs row (cols floats in heads heads) into dst (kv_row_words words).
void kv_store_row(KvType t, const float* row, int64_t cols, int64_t heads, float* dst);
// Values [c0, c0 + n) of a packed row as floats; [c0, c0 + n) lies within one head.
void kv_load(KvType t, const float* packed, int64_t cols, int64_t heads, int64_t c0, int64_t n, float* out);

// FP8 E4M3 code of x (round to nearest even, saturating at +-448; x finite).
uint8_t f32_to_fp8_e4m3(float x);

}  // namespace moestream
