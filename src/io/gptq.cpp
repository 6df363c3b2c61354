// quantize_gptq: GPTQ's column-by-column quantization with error compensation (gptq.h).
#include "io/gptq.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moestream {

bool cholesky_lower(std::vector<double>& a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    double d = a[size_t(j * n + j)];
    for (int64_t k = 0; k < j; ++k) d -= a[size_t(j * n + k)] * a[size_t(j * n + k)];
    if (!(d > 0)) return false;
    const double l = std::sqrt(d);
    a[size_t(j * n + j)] = l;
    for (int64_t i = j + 1; i < n; ++i) {
      double s = a[size_t(i * n + j)];
      for (int64_t k = 0; k < j; ++k) s -= a[size_t(i * n + k)] * a[size_t(j * n + k)];
      a[size_t(i * n + j)] = s / l;
    }
  }
  return true;
}

namespace {

// The upper U with H^-1 = U^T U, from the lower Cholesky factor L of H (H = L L^T):
// H^-1 = L^-T L^-1, and U is the transposed lower Cholesky factor of that. False when H^-1 is
// numerically not positive definite.
bool inverse_cholesky_upper(const std::vector<double>& l, int64_t n, std::vector<double>& u) {
  std::vector<double> li(size_t(n * n), 0.0);  // L^-1, lower
  for (int64_t c = 0; c < n; ++c) {
    li[size_t(c * n + c)] = 1.0 / l[size_t(c * n + c)];
    for (int64_t i = c + 1; i < n; ++i) {
      double s = 0;
      for (int64_t k = c; k < i; ++k) s += l[size_t(i * n + k)] * li[size_t(k * n + c)];
      li[size_t(i * n + c)] = -s / l[size_t(i * n + i)];
    }
  }
  std::vector<double> hinv(size_t(n * n));  // (L^-1)^T L^-1, lower triangle filled
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      double s = 0;
      for (int64_t k = i; k < n; ++k) s += li[size_t(k * n + i)] * li[size_t(k * n + j)];
      hinv[size_t(i * n + j)] = s;
    }
  if (!cholesky_lower(hinv, n)) return false;
  u.assign(size_t(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) u[size_t(j * n + i)] = hinv[size_t(i * n + j)];
  return true;
}

// U for h: dead columns (no input ever) get a unit diagonal, then the dampening; it is raised
// tenfold while the factorization fails (a nearly singular H from few tokens).
std::vector<float> compensation_factor(const double* h, int64_t n, double damp, std::string_view what) {
  std::vector<double> base(h, h + n * n);
  const double mean = unit_dead_inputs(base, n);
  for (int attempt = 0; attempt < 4; ++attempt, damp *= 10) {
    std::vector<double> a = base;
    for (int64_t i = 0; i < n; ++i) a[size_t(i * n + i)] += damp * mean;
    std::vector<double> u;
    if (cholesky_lower(a, n) && inverse_cholesky_upper(a, n, u)) return {u.begin(), u.end()};
  }
  fail(what, ": its calibration Hessian is not positive definite even with dampening ", damp / 10);
}

}  // namespace

double unit_dead_inputs(std::vector<double>& h, int64_t n) {
  double mean = 0;
  for (int64_t i = 0; i < n; ++i) {
    double& d = h[size_t(i * n + i)];
    if (d == 0) d = 1;
    mean += d;
  }
  return mean / double(n);
}

void quantize_gptq(const float* w, int64_t rows, int64_t cols, const double* h, const QuantFormat& f,
                   uint32_t* words, uint16_t* scales, uint16_t* biases, const GptqOptions& options,
                   std::string_view what) {
  check_quant_shape(f, cols, what);
  if (f.scheme != QuantScheme::Affine) fail(what, ": GPTQ writes affine formats only");
  const int64_t gs = f.group_size, gpr = quant_groups_per_row(f, cols), wpr = quant_words_per_row(f, cols);
  const int64_t block = std::max<int64_t>(1, (options.block + gs - 1) / gs) * gs;
  const float top = float((1 << f.bits) - 1);
  const size_t n_rows = size_t(rows);

  // Column order: as stored, or (act_order) by falling diagonal of H, the most active inputs
  // first while the most columns remain to absorb their error.
  std::vector<int64_t> perm(static_cast<size_t>(cols));
  for (int64_t i = 0; i < cols; ++i) perm[size_t(i)] = i;
  if (options.act_order)
    std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return h[a * cols + a] > h[b * cols + b]; });
  std::vector<double> hp(size_t(cols * cols));
  for (int64_t a = 0; a < cols; ++a)
    for (int64_t b = 0; b < cols; ++b) hp[size_t(a * cols + b)] = h[perm[size_t(a)] * cols + perm[size_t(b)]];
  const std::vector<float> u = compensation_factor(hp.data(), cols, options.damp, what);

  std::vector<float> m(size_t(rows * cols));  // the weights in processing order, as they are updated
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) m[size_t(r * cols + k)] = w[r * cols + perm[size_t(k)]];
  std::vector<float> err(n_rows * size_t(block));  // this block's scaled errors [rows, block]
  std::vector<float> scale(n_rows * size_t(gpr)), bias(n_rows * size_t(gpr));  // as float32, [rows, groups]
  std::vector<float> group(n_rows * size_t(gs));
  std::vector<uint32_t> group_words(n_rows * size_t(gs * f.bits / 32));
  std::vector<uint16_t> group_scales(n_rows), group_biases(n_rows);
  const auto keep_params = [&] {
    for (size_t i = 0; i < scale.size(); ++i) {
      scale[i] = scale_to_f32(scales[i], f.scale_dtype);
      bias[i] = scale_to_f32(biases[i], f.scale_dtype);
    }
  };
  if (options.act_order) {  // columns of a group are met out of order: its parameters from the start
    quantize_affine(w, rows, cols, f, words, scales, biases, QuantizeOptions{options.clip_search}, what);
    keep_params();
  }
  std::fill(words, words + rows * wpr, 0u);

  for (int64_t i1 = 0; i1 < cols; i1 += block) {
    const int64_t i2 = std::min(i1 + block, cols);
    for (int64_t k = i1; k < i2; ++k) {
      const int64_t col = perm[size_t(k)], g = col / gs;
      if (!options.act_order && k % gs == 0) {  // a new group: its parameters from its weights as they stand now
        for (int64_t r = 0; r < rows; ++r) std::copy_n(m.data() + r * cols + k, gs, group.data() + r * gs);
        quantize_affine(group.data(), rows, gs, f, group_words.data(), group_scales.data(), group_biases.data(),
                        QuantizeOptions{options.clip_search}, what);
        for (int64_t r = 0; r < rows; ++r) {
          scales[r * gpr + g] = group_scales[size_t(r)];
          biases[r * gpr + g] = group_biases[size_t(r)];
          scale[size_t(r * gpr + g)] = scale_to_f32(group_scales[size_t(r)], f.scale_dtype);
          bias[size_t(r * gpr + g)] = scale_to_f32(group_biases[size_t(r)], f.scale_dtype);
        }
      }
      const float* uk = u.data() + k * cols;
      for (int64_t r = 0; r < rows; ++r) {
        float* row = m.data() + r * cols;
        const float s = scale[size_t(r * gpr + g)], b = bias[size_t(r * gpr + g)];
        const float q = s == 0 ? 0.0f : std::clamp(std::rint((row[k] - b) / s), 0.0f, top);
        quant_put_code(words + r * wpr, col, f.bits, uint32_t(q));
        const float e = (row[k] - std::fma(q, s, b)) / uk[k];
        err[size_t(r * block + (k - i1))] = e;
        for (int64_t j = k + 1; j < i2; ++j) row[j] -= e * uk[j];
      }
    }
    // The block's errors reach the later columns at once (the paper's lazy batch update).
    for (int64_t r = 0; r < rows; ++r) {
      float* row = m.data() + r * cols;
      for (int64_t k = 0; k < i2 - i1; ++k) {
        const float e = err[size_t(r * block + k)];
        if (e == 0) continue;
        const float* uk = u.data() + (i1 + k) * cols;
        for (int64_t j = i2; j < cols; ++j) row[j] -= e * uk[j];
      }
    }
  }
  refine_quantized(w, rows, cols, h, f, words, scales, biases, options);
}

const ExpertHessian* ExpertHessians::find(int layer, int expert) const {
  if (layer < 0 || size_t(layer) >= layers.size() || expert < 0 || size_t(expert) >= layers[size_t(layer)].size())
    return nullptr;
  const ExpertHessian& h = layers[size_t(layer)][size_t(expert)];
  return h.tokens > 0 ? &h : nullptr;
}

void finish_hessians(ExpertHessians& hs) {
  const auto mirror = [](std::vector<double>& a) {
    const int64_t n = int64_t(std::llround(std::sqrt(double(a.size()))));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < i; ++j) a[size_t(i * n + j)] = a[size_t(j * n + i)];
  };
  for (auto& layer : hs.layers)
    for (ExpertHessian& h : layer) {
      mirror(h.in);
      mirror(h.act);
    }
}

}  // namespace moestream
