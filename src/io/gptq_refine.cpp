// refine_quantized: after GPTQ, lower the layer's output error further by alternating exact
// coordinate descent on the codes and a least-squares refit of the group parameters (gptq.h).
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "io/gptq.h"

namespace moestream {

namespace {

// The regularized Hessian both GPTQ and the refinement minimize under: dead inputs get a unit
// diagonal, and `damp` times the mean diagonal is added (a ridge that keeps the few-token
// experts from fitting their calibration inputs too closely).
std::vector<double> damped_hessian(const double* h, int64_t n, double damp) {
  std::vector<double> a(h, h + n * n);
  const double mean = unit_dead_inputs(a, n);
  for (int64_t i = 0; i < n; ++i) a[size_t(i * n + i)] += damp * mean;
  return a;
}

// Solves a x = y for a (n, n) symmetric positive semidefinite, in place, with a small ridge
// toward x0 (so directions a does not constrain, such as a group whose codes are all equal,
// stay where they were). False when it still cannot be solved.
bool solve_ridged(std::vector<double>& a, std::vector<double>& y, const std::vector<double>& x0, int64_t n) {
  double trace = 0;
  for (int64_t i = 0; i < n; ++i) trace += a[size_t(i * n + i)];
  const double lambda = 1e-9 * (trace / double(n) + 1e-30);
  for (int64_t i = 0; i < n; ++i) {
    a[size_t(i * n + i)] += lambda;
    y[size_t(i)] += lambda * x0[size_t(i)];
  }
  for (int64_t c = 0; c < n; ++c) {  // Gaussian elimination with partial pivoting
    int64_t p = c;
    for (int64_t r = c + 1; r < n; ++r)
      if (std::fabs(a[size_t(r * n + c)]) > std::fabs(a[size_t(p * n + c)])) p = r;
    if (!(std::fabs(a[size_t(p * n + c)]) > 0)) return false;
    if (p != c) {
      for (int64_t k = 0; k < n; ++k) std::swap(a[size_t(c * n + k)], a[size_t(p * n + k)]);
      std::swap(y[size_t(c)], y[size_t(p)]);
    }
    for (int64_t r = c + 1; r < n; ++r) {
      const double m = a[size_t(r * n + c)] / a[size_t(c * n + c)];
      if (m == 0) continue;
      for (int64_t k = c; k < n; ++k) a[size_t(r * n + k)] -= m * a[size_t(c * n + k)];
      y[size_t(r)] -= m * y[size_t(c)];
    }
  }
  for (int64_t c = n - 1; c >= 0; --c) {
    double s = y[size_t(c)];
    for (int64_t k = c + 1; k < n; ++k) s -= a[size_t(c * n + k)] * y[size_t(k)];
    y[size_t(c)] = s / a[size_t(c * n + c)];
    if (!std::isfinite(y[size_t(c)])) return false;
  }
  return true;
}

// One row's state: codes, group parameters as stored (rounded), the error e = w_hat - w, and
// g = H e, so that the objective is e . g and a code change is scored in O(1).
struct RowState {
  const double* h;  // damped Hessian [cols, cols]
  int64_t cols, gs;
  int top;
  std::vector<uint8_t> q;
  std::vector<double> s, b, e, g;

  double value(int64_t c) const { return s[size_t(c / gs)] * q[size_t(c)] + b[size_t(c / gs)]; }

  double reset(const float* w) {  // e and g from the codes and parameters; returns the objective
    for (int64_t c = 0; c < cols; ++c) e[size_t(c)] = value(c) - double(w[c]);
    double obj = 0;
    for (int64_t i = 0; i < cols; ++i) {
      double t = 0;
      const double* hi = h + i * cols;
      for (int64_t j = 0; j < cols; ++j) t += hi[j] * e[size_t(j)];
      g[size_t(i)] = t;
      obj += e[size_t(i)] * t;
    }
    return obj;
  }

  // Sweeps over the columns, each time moving a code to the level that lowers e^T H e most
  // given all the others (a change of d in column c changes it by 2 d g_c + d^2 H_cc).
  // Returns how much the objective fell.
  double descend(int sweeps) {
    double gain = 0;
    for (int sweep = 0; sweep < sweeps; ++sweep) {
      int64_t changed = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double sc = s[size_t(c / gs)], hcc = h[c * cols + c];
        const int cur = q[size_t(c)];
        int best = cur;
        double best_delta = 0;
        for (int v = 0; v <= top; ++v) {
          if (v == cur) continue;
          const double d = sc * (v - cur), delta = d * (2 * g[size_t(c)] + d * hcc);
          if (delta < best_delta) best_delta = delta, best = v;
        }
        if (best == cur || best_delta > -1e-12 * std::fabs(hcc * sc * sc)) continue;
        const double d = sc * (best - cur);
        q[size_t(c)] = uint8_t(best);
        e[size_t(c)] += d;
        const double* hc = h + c * cols;  // H is symmetric: column c is row c
        for (int64_t i = 0; i < cols; ++i) g[size_t(i)] += d * hc[i];
        gain -= best_delta;
        ++changed;
      }
      if (!changed) break;
    }
    return gain;
  }

  // Every group's (scale, bias) at once, minimizing (A p - w)^T H (A p - w) where column c of
  // A p is s_g q_c + b_g: the normal equations (A^T H A) p = A^T H w, 2 unknowns a group.
  bool refit(const float* w, std::vector<double>& p) const {
    const int64_t groups = cols / gs, n = 2 * groups;
    std::vector<double> ha(size_t(cols * n), 0.0);  // H A [cols, n]
    for (int64_t i = 0; i < cols; ++i) {
      const double* hi = h + i * cols;
      for (int64_t c = 0; c < cols; ++c) {
        ha[size_t(i * n + 2 * (c / gs))] += hi[c] * q[size_t(c)];
        ha[size_t(i * n + 2 * (c / gs) + 1)] += hi[c];
      }
    }
    std::vector<double> m(size_t(n * n), 0.0), y(size_t(n), 0.0), p0(static_cast<size_t>(n));
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t grp = c / gs;
      for (int64_t k = 0; k < n; ++k) {
        m[size_t(2 * grp * n + k)] += q[size_t(c)] * ha[size_t(c * n + k)];
        m[size_t((2 * grp + 1) * n + k)] += ha[size_t(c * n + k)];
        y[size_t(k)] += ha[size_t(c * n + k)] * double(w[c]);
      }
    }
    for (int64_t grp = 0; grp < groups; ++grp) {
      p0[size_t(2 * grp)] = s[size_t(grp)];
      p0[size_t(2 * grp + 1)] = b[size_t(grp)];
    }
    if (!solve_ridged(m, y, p0, n)) return false;
    p = std::move(y);
    return true;
  }
};

}  // namespace

double quantized_error(const float* w, int64_t rows, int64_t cols, const double* h, const QuantFormat& f,
                       const uint32_t* words, const uint16_t* scales, const uint16_t* biases) {
  const int64_t wpr = quant_words_per_row(f, cols), gpr = quant_groups_per_row(f, cols);
  std::vector<float> q(static_cast<size_t>(cols));
  std::vector<double> e(static_cast<size_t>(cols));
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_row(f, cols, words + r * wpr, scales + r * gpr, biases + r * gpr, q.data());
    for (int64_t c = 0; c < cols; ++c) e[size_t(c)] = double(q[size_t(c)]) - w[r * cols + c];
    for (int64_t i = 0; i < cols; ++i) {
      double t = 0;
      for (int64_t j = 0; j < cols; ++j) t += h[i * cols + j] * e[size_t(j)];
      total += e[size_t(i)] * t;
    }
  }
  return total;
}

void refine_quantized(const float* w, int64_t rows, int64_t cols, const double* h, const QuantFormat& f,
                      uint32_t* words, uint16_t* scales, uint16_t* biases, const GptqOptions& options) {
  if (options.refine_rounds <= 0) return;
  const std::vector<double> hd = damped_hessian(h, cols, options.damp);
  const int64_t gs = f.group_size, gpr = quant_groups_per_row(f, cols), wpr = quant_words_per_row(f, cols);
  RowState st{hd.data(), cols, gs, (1 << f.bits) - 1, std::vector<uint8_t>(size_t(cols)), std::vector<double>(size_t(gpr)),
              std::vector<double>(size_t(gpr)), std::vector<double>(size_t(cols)), std::vector<double>(size_t(cols))};
  std::vector<double> p;
  for (int64_t r = 0; r < rows; ++r) {
    const float* wr = w + r * cols;
    uint32_t* row_words = words + r * wpr;
    uint16_t* row_scales = scales + r * gpr;
    uint16_t* row_biases = biases + r * gpr;
    unpack_codes(row_words, cols, f.bits, st.q.data());
    for (int64_t grp = 0; grp < gpr; ++grp) {
      st.s[size_t(grp)] = scale_to_f32(row_scales[grp], f.scale_dtype);
      st.b[size_t(grp)] = scale_to_f32(row_biases[grp], f.scale_dtype);
    }
    double obj = st.reset(wr);
    for (int round = 0; round < options.refine_rounds; ++round) {
      obj -= st.descend(options.refine_sweeps);
      // New parameters, rounded as they will be stored; kept only when the objective falls.
      if (!st.refit(wr, p)) break;
      const std::vector<double> old_s = st.s, old_b = st.b;
      std::vector<uint16_t> new_scales(static_cast<size_t>(gpr)), new_biases(static_cast<size_t>(gpr));
      for (int64_t grp = 0; grp < gpr; ++grp) {
        new_scales[size_t(grp)] = scale_from_f32(float(p[size_t(2 * grp)]), f.scale_dtype);
        new_biases[size_t(grp)] = scale_from_f32(float(p[size_t(2 * grp + 1)]), f.scale_dtype);
        st.s[size_t(grp)] = scale_to_f32(new_scales[size_t(grp)], f.scale_dtype);
        st.b[size_t(grp)] = scale_to_f32(new_biases[size_t(grp)], f.scale_dtype);
      }
      const double refit_obj = st.reset(wr);
      if (!(refit_obj < obj) || !std::isfinite(refit_obj)) {
        st.s = old_s, st.b = old_b;
        st.reset(wr);
        break;
      }
      obj = refit_obj;
      std::copy(new_scales.begin(), new_scales.end(), row_scales);
      std::copy(new_biases.begin(), new_biases.end(), row_biases);
    }
    obj -= st.descend(options.refine_sweeps);  // codes for the final parameters
    std::fill(row_words, row_words + wpr, 0u);
    for (int64_t c = 0; c < cols; ++c) quant_put_code(row_words, c, f.bits, st.q[size_t(c)]);
  }
}

}  // namespace moestream
