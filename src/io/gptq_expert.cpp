// reconstruct_expert: after GPTQ, the codes and group parameters of a whole routed expert moved to
// lower its output error on its calibration tokens, through the SwiGLU (gptq.h).
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "io/gptq.h"

namespace moestream {

namespace {

std::vector<float> dequantized(const QuantFormat& f, int64_t rows, int64_t cols, const QuantizedMatrix& m) {
  std::vector<float> out(size_t(rows * cols));
  const int64_t wpr = quant_words_per_row(f, cols), gpr = quant_groups_per_row(f, cols);
  for (int64_t r = 0; r < rows; ++r)
    dequantize_row(f, cols, m.words + r * wpr, m.scales + r * gpr, m.biases + r * gpr, out.data() + r * cols);
  return out;
}

// out [n, rows] = x [n, cols] w^T (w [rows, cols]).
std::vector<float> times_transposed(const float* x, int64_t n, int64_t cols, const float* w, int64_t rows) {
  std::vector<float> out(size_t(n * rows));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      float s = 0;
      for (int64_t c = 0; c < cols; ++c) s += x[t * cols + c] * w[r * cols + c];
      out[size_t(t * rows + r)] = s;
    }
  return out;
}

float silu(float g) { return g / (1.0f + std::exp(-g)); }

// a = silu(g) * u, elementwise.
std::vector<float> swiglu(const std::vector<float>& g, const std::vector<float>& u) {
  std::vector<float> a(g.size());
  for (size_t i = 0; i < g.size(); ++i) a[i] = silu(g[i]) * u[i];
  return a;
}

// Solves a x = y for a (n, n) symmetric positive definite, by Cholesky, in place (y becomes x).
// False when a is not positive definite.
bool solve_spd(std::vector<double> a, std::vector<double>& y, int64_t n) {
  if (!cholesky_lower(a, n)) return false;
  for (int64_t i = 0; i < n; ++i) {  // L z = y
    double s = y[size_t(i)];
    for (int64_t k = 0; k < i; ++k) s -= a[size_t(i * n + k)] * y[size_t(k)];
    y[size_t(i)] = s / a[size_t(i * n + i)];
  }
  for (int64_t i = n - 1; i >= 0; --i) {  // L^T x = z
    double s = y[size_t(i)];
    for (int64_t k = i + 1; k < n; ++k) s -= a[size_t(k * n + i)] * y[size_t(k)];
    y[size_t(i)] = s / a[size_t(i * n + i)];
  }
  return true;
}

// lin = sum_t w1_t x_t, quad = sum_t w2_t x_t^2, in eight float lanes (so that it vectorizes;
// the order is fixed, so the result does not depend on the thread count).
void moments(const float* w1, const float* w2, const float* x, int64_t n, double& lin, double& quad) {
  float l[8] = {}, q[8] = {};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8)
    for (int k = 0; k < 8; ++k) {
      l[k] += w1[t + k] * x[t + k];
      q[k] += w2[t + k] * x[t + k] * x[t + k];
    }
  lin = 0, quad = 0;
  for (int k = 0; k < 8; ++k) lin += l[k], quad += q[k];
  for (; t < n; ++t) lin += w1[t] * x[t], quad += w2[t] * x[t] * x[t];
}

// One intermediate unit i of the expert (row i of gate and of up) while the rest of the expert
// stays as it is. Over the tokens t: g_t, u_t its gate and up outputs, a_t = silu(g_t) u_t, and
// rho_t = down[:, i] . r_t with r_t the expert's output error; a change da_t of the activation
// changes the squared output error by sum_t 2 da_t rho_t + n da_t^2, n = ||down[:, i]||^2.
struct Unit {
  const float* xt;  // the tokens' inputs, transposed [hidden, T]
  int64_t tokens, hidden, gs;
  int top;
  double n;
  std::vector<float> g, u, a, rho;
  const double* hin = nullptr;  // gate's and up's Hessian over all calibration tokens, or none
  double prior = 0;             // expert_prior times the sample's share of those tokens

  // The row's layer-wise objective over all calibration tokens, e^T H e (e = the dequantized
  // row less the unquantized one), weighted like the sample's curvature in the row's output
  // (coef = prior n mean_t j_t^2, j_t the activation's derivative): a prior against fitting
  // the sample's noise. he = H e.
  struct Prior {
    const double* h = nullptr;
    int64_t cols = 0;
    double coef = 0;
    std::vector<double> he;
    double delta(int64_t c, double d) const { return h ? coef * d * (2 * he[size_t(c)] + d * h[c * cols + c]) : 0; }
    void move(int64_t c, double d) {
      if (h)
        for (int64_t i = 0; i < cols; ++i) he[size_t(i)] += d * h[c * cols + i];
    }
  };
  Prior prior_of(bool gate, const std::vector<uint8_t>& q, const std::vector<float>& s, const std::vector<float>& b,
                 const float* w) const {
    Prior p;
    if (!hin || prior <= 0) return p;
    p.h = hin, p.cols = hidden;
    double jj = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      const float gt = g[size_t(t)], sig = 1.0f / (1.0f + std::exp(-gt));
      const double j = gate ? double(u[size_t(t)]) * sig * (1 + gt * (1 - sig)) : double(gt * sig);
      jj += j * j;
    }
    p.coef = prior * n * jj / double(tokens);
    std::vector<double> e(static_cast<size_t>(hidden));
    for (int64_t c = 0; c < hidden; ++c) e[size_t(c)] = double(s[size_t(c / gs)]) * q[size_t(c)] + b[size_t(c / gs)] - w[c];
    p.he.assign(size_t(hidden), 0.0);
    for (int64_t i = 0; i < hidden; ++i)
      for (int64_t c = 0; c < hidden; ++c) p.he[size_t(i)] += hin[i * hidden + c] * e[size_t(c)];
    return p;
  }

  // Exact change of the error for a new activation of every token, given by new_a(t).
  template <typename F>
  double change(F new_a) const {
    double d = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      const double da = double(new_a(t)) - a[size_t(t)];
      d += da * (2 * rho[size_t(t)] + n * da);
    }
    return d;
  }
  void apply(int64_t t, float new_a) {
    rho[size_t(t)] += float(n * (double(new_a) - a[size_t(t)]));
    a[size_t(t)] = new_a;
  }

  // Coordinate descent over one row's codes q (scales s, biases b per group); `gate` picks
  // which of the unit's two rows. For up, the change is exactly quadratic in the code's step;
  // for gate, the step is chosen by the second-order expansion of silu and kept only when the
  // exact change is a fall. Returns the fall.
  double descend(bool gate, std::vector<uint8_t>& q, const std::vector<float>& s, const std::vector<float>& b,
                 const float* w, int sweeps) {
    double gain = 0;
    Prior pr = prior_of(gate, q, s, b, w);
    std::vector<float> w1(static_cast<size_t>(tokens)), w2(static_cast<size_t>(tokens)), sgate(static_cast<size_t>(tokens));
    for (int sweep = 0; sweep < sweeps; ++sweep) {
      int64_t changed = 0;
      // Per-token weights of the linear and quadratic terms in a step d of the row's output.
      const auto weights = [&] {
        for (int64_t t = 0; t < tokens; ++t) {
          const float gt = g[size_t(t)], sig = 1.0f / (1.0f + std::exp(-gt));
          if (gate) {
            const float s1 = sig * (1 + gt * (1 - sig)), s2 = sig * (1 - sig) * (2 + gt * (1 - 2 * sig));
            const float ut = u[size_t(t)];
            w1[size_t(t)] = rho[size_t(t)] * ut * s1;
            w2[size_t(t)] = float(rho[size_t(t)] * ut * s2 + n * ut * ut * s1 * s1);
          } else {
            const float sg = gt * sig;
            sgate[size_t(t)] = sg;
            w1[size_t(t)] = rho[size_t(t)] * sg;
            w2[size_t(t)] = float(n * sg * sg);
          }
        }
      };
      weights();
      for (int64_t c = 0; c < hidden; ++c) {
        const float* xc = xt + c * tokens;
        double lin = 0, quad = 0;
        moments(w1.data(), w2.data(), xc, tokens, lin, quad);
        const double sc = s[size_t(c / gs)];
        const int cur = q[size_t(c)];
        int best = cur;
        double best_delta = 0;
        for (int v = 0; v <= top; ++v) {
          const double d = sc * (v - cur), delta = d * (2 * lin + d * quad) + pr.delta(c, d);
          if (v != cur && delta < best_delta) best_delta = delta, best = v;
        }
        if (best == cur) continue;
        const float d = float(sc * (best - cur));
        if (gate) {
          const double exact =
              change([&](int64_t t) { return silu(g[size_t(t)] + d * xc[t]) * u[size_t(t)]; }) + pr.delta(c, d);
          if (!(exact < 0)) continue;
          gain -= exact;
          for (int64_t t = 0; t < tokens; ++t) {
            g[size_t(t)] += d * xc[t];
            apply(t, silu(g[size_t(t)]) * u[size_t(t)]);
          }
        } else {  // the change is exactly quadratic in d: no check; silu(g) is unchanged
          gain -= best_delta;
          for (int64_t t = 0; t < tokens; ++t) {
            const float sg = sgate[size_t(t)];
            u[size_t(t)] += d * xc[t];
            apply(t, sg * u[size_t(t)]);
            w1[size_t(t)] = rho[size_t(t)] * sg;
          }
          q[size_t(c)] = uint8_t(best);
          pr.move(c, d);
          ++changed;
          continue;
        }
        q[size_t(c)] = uint8_t(best);
        pr.move(c, d);
        ++changed;
        weights();
      }
      if (!changed) break;
    }
    return gain;
  }

  // Each group's scale and bias by one Gauss-Newton step on the error (exact for up), rounded to
  // the stored dtype and kept only when the exact error falls. Returns the fall.
  double refit(bool gate, const std::vector<uint8_t>& q, std::vector<float>& s, std::vector<float>& b, const float* w,
               DType dtype) {
    double gain = 0;
    Prior pr = prior_of(gate, q, s, b, w);
    std::vector<float> p(static_cast<size_t>(tokens)), z(static_cast<size_t>(tokens)), out(static_cast<size_t>(tokens));
    for (size_t grp = 0; grp < s.size(); ++grp) {
      std::fill(p.begin(), p.end(), 0.0f);
      std::fill(z.begin(), z.end(), 0.0f);
      for (int64_t c = int64_t(grp) * gs; c < int64_t(grp + 1) * gs; ++c) {
        const float* xc = xt + c * tokens;
        for (int64_t t = 0; t < tokens; ++t) {
          p[size_t(t)] += float(q[size_t(c)]) * xc[t];
          z[size_t(t)] += xc[t];
        }
      }
      // The row's output moves by ds p_t + db z_t; da_t = j_t (ds p_t + db z_t) to first order.
      double m00 = 0, m01 = 0, m11 = 0, y0 = 0, y1 = 0;
      for (int64_t t = 0; t < tokens; ++t) {
        const float gt = g[size_t(t)], sig = 1.0f / (1.0f + std::exp(-gt));
        const double j = gate ? double(u[size_t(t)]) * sig * (1 + gt * (1 - sig)) : double(gt * sig);
        const double pj = p[size_t(t)] * j, zj = z[size_t(t)] * j;
        m00 += n * pj * pj, m01 += n * pj * zj, m11 += n * zj * zj;
        y0 -= rho[size_t(t)] * pj, y1 -= rho[size_t(t)] * zj;
      }
      const int64_t c0 = int64_t(grp) * gs;
      // The prior's part: v_c = ds q_c + db over the group's columns.
      const auto prior_change = [&](double ds, double db) {
        if (!pr.h) return 0.0;
        double lin = 0, quad = 0;
        for (int64_t c = c0; c < c0 + gs; ++c) {
          const double vc = ds * q[size_t(c)] + db;
          lin += vc * pr.he[size_t(c)];
          for (int64_t k = c0; k < c0 + gs; ++k) quad += vc * pr.h[c * hidden + k] * (ds * q[size_t(k)] + db);
        }
        return pr.coef * (2 * lin + quad);
      };
      if (pr.h)
        for (int64_t c = c0; c < c0 + gs; ++c) {
          y0 -= pr.coef * q[size_t(c)] * pr.he[size_t(c)], y1 -= pr.coef * pr.he[size_t(c)];
          for (int64_t k = c0; k < c0 + gs; ++k) {
            const double hck = pr.coef * pr.h[c * hidden + k];
            m00 += hck * q[size_t(c)] * q[size_t(k)], m01 += hck * q[size_t(c)], m11 += hck;
          }
        }
      const double det = m00 * m11 - m01 * m01;
      if (!(det > 1e-12 * (m00 * m11)) || !(det > 0)) continue;
      const double ds = (y0 * m11 - y1 * m01) / det, db = (m00 * y1 - m01 * y0) / det;
      const float ns = scale_to_f32(scale_from_f32(float(s[grp] + ds), dtype), dtype);
      const float nb = scale_to_f32(scale_from_f32(float(b[grp] + db), dtype), dtype);
      if (ns == s[grp] && nb == b[grp]) continue;
      const float dsf = ns - s[grp], dbf = nb - b[grp];
      for (int64_t t = 0; t < tokens; ++t) {
        const float shift = dsf * p[size_t(t)] + dbf * z[size_t(t)];
        out[size_t(t)] = gate ? silu(g[size_t(t)] + shift) * u[size_t(t)] : silu(g[size_t(t)]) * (u[size_t(t)] + shift);
      }
      const double exact = change([&](int64_t t) { return out[size_t(t)]; }) + prior_change(dsf, dbf);
      if (!(exact < 0)) continue;
      for (int64_t c = c0; c < c0 + gs; ++c) pr.move(c, dsf * q[size_t(c)] + dbf);
      gain -= exact;
      for (int64_t t = 0; t < tokens; ++t) {
        const float shift = dsf * p[size_t(t)] + dbf * z[size_t(t)];
        (gate ? g : u)[size_t(t)] += shift;
        apply(t, out[size_t(t)]);
      }
      s[grp] = ns, b[grp] = nb;
    }
    return gain;
  }
};

// Rows [rows, cols] of m as codes, scales and biases in float.
struct RowParams {
  std::vector<uint8_t> q;
  std::vector<float> s, b;
  void load(const QuantFormat& f, int64_t cols, const QuantizedMatrix& m, int64_t r) {
    const int64_t wpr = quant_words_per_row(f, cols), gpr = quant_groups_per_row(f, cols);
    q.resize(size_t(cols));
    unpack_codes(m.words + r * wpr, cols, f.bits, q.data());
    s.resize(size_t(gpr)), b.resize(size_t(gpr));
    for (int64_t k = 0; k < gpr; ++k) {
      s[size_t(k)] = scale_to_f32(m.scales[r * gpr + k], f.scale_dtype);
      b[size_t(k)] = scale_to_f32(m.biases[r * gpr + k], f.scale_dtype);
    }
  }
  void store(const QuantFormat& f, int64_t cols, const QuantizedMatrix& m, int64_t r) const {
    const int64_t wpr = quant_words_per_row(f, cols), gpr = quant_groups_per_row(f, cols);
    std::fill(m.words + r * wpr, m.words + (r + 1) * wpr, 0u);
    for (int64_t c = 0; c < cols; ++c) quant_put_code(m.words + r * wpr, c, f.bits, q[size_t(c)]);
    for (int64_t k = 0; k < gpr; ++k) {
      m.scales[r * gpr + k] = scale_from_f32(s[size_t(k)], f.scale_dtype);
      m.biases[r * gpr + k] = scale_from_f32(b[size_t(k)], f.scale_dtype);
    }
  }
};

}  // namespace

double expert_output_error(const float* x, int64_t tokens, const ExpertMatrices& w, const QuantFormat& f,
                           const QuantizedMatrix& gate, const QuantizedMatrix& up, const QuantizedMatrix& down) {
  const int64_t hidden = w.hidden, inter = w.inter;
  const std::vector<float> y = times_transposed(
      swiglu(times_transposed(x, tokens, hidden, w.gate, inter), times_transposed(x, tokens, hidden, w.up, inter)).data(),
      tokens, inter, w.down, hidden);
  const std::vector<float> qg = dequantized(f, inter, hidden, gate), qu = dequantized(f, inter, hidden, up),
                           qd = dequantized(f, hidden, inter, down);
  const std::vector<float> yq = times_transposed(
      swiglu(times_transposed(x, tokens, hidden, qg.data(), inter), times_transposed(x, tokens, hidden, qu.data(), inter))
          .data(),
      tokens, inter, qd.data(), hidden);
  double e = 0;
  for (size_t i = 0; i < y.size(); ++i) e += (double(yq[i]) - y[i]) * (double(yq[i]) - y[i]);
  return e;
}

void reconstruct_expert(const float* x, int64_t tokens, const ExpertMatrices& w, const QuantFormat& f,
                        const QuantizedMatrix& gate, const QuantizedMatrix& up, const QuantizedMatrix& down,
                        const GptqOptions& options) {
  const int64_t hidden = w.hidden, inter = w.inter;
  if (tokens <= 0 || options.expert_rounds <= 0) return;
  std::vector<float> xt(size_t(hidden * tokens));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < hidden; ++c) xt[size_t(c * tokens + t)] = x[t * hidden + c];
  // The unquantized expert's output, the target.
  const std::vector<float> y = times_transposed(
      swiglu(times_transposed(x, tokens, hidden, w.gate, inter), times_transposed(x, tokens, hidden, w.up, inter)).data(),
      tokens, inter, w.down, hidden);

  for (int round = 0; round < options.expert_rounds; ++round) {
    // Gate and up, unit by unit, against the whole expert's error with down as quantized now.
    const std::vector<float> qd = dequantized(f, hidden, inter, down);
    std::vector<float> g = times_transposed(x, tokens, hidden, dequantized(f, inter, hidden, gate).data(), inter);
    std::vector<float> u = times_transposed(x, tokens, hidden, dequantized(f, inter, hidden, up).data(), inter);
    std::vector<float> a = swiglu(g, u);
    std::vector<float> r = times_transposed(a.data(), tokens, inter, qd.data(), hidden);  // [T, hidden]: the error
    for (size_t i = 0; i < r.size(); ++i) r[i] -= y[i];
    Unit unit{xt.data(), tokens, hidden, f.group_size, (1 << f.bits) - 1, 0, {}, {}, {}, {}, w.in_hessian, 0};
    if (w.in_hessian && w.calib_tokens > 0) unit.prior = options.expert_prior * double(tokens) / double(w.calib_tokens);
    RowParams pg, pu;
    for (int64_t i = 0; i < inter; ++i) {
      unit.n = 0;
      for (int64_t k = 0; k < hidden; ++k) unit.n += double(qd[size_t(k * inter + i)]) * qd[size_t(k * inter + i)];
      unit.g.resize(size_t(tokens)), unit.u.resize(size_t(tokens)), unit.a.resize(size_t(tokens)), unit.rho.resize(size_t(tokens));
      for (int64_t t = 0; t < tokens; ++t) {
        unit.g[size_t(t)] = g[size_t(t * inter + i)];
        unit.u[size_t(t)] = u[size_t(t * inter + i)];
        unit.a[size_t(t)] = a[size_t(t * inter + i)];
        double rho = 0;
        for (int64_t k = 0; k < hidden; ++k) rho += double(qd[size_t(k * inter + i)]) * r[size_t(t * hidden + k)];
        unit.rho[size_t(t)] = float(rho);
      }
      pg.load(f, hidden, gate, i);
      pu.load(f, hidden, up, i);
      for (int sweep = 0; sweep < options.expert_sweeps; ++sweep) {
        const float *wg = w.gate + i * hidden, *wu = w.up + i * hidden;
        double gain = unit.descend(true, pg.q, pg.s, pg.b, wg, 1) + unit.descend(false, pu.q, pu.s, pu.b, wu, 1);
        gain += unit.refit(true, pg.q, pg.s, pg.b, wg, f.scale_dtype) + unit.refit(false, pu.q, pu.s, pu.b, wu, f.scale_dtype);
        if (gain == 0) break;
      }
      pg.store(f, hidden, gate, i);
      pu.store(f, hidden, up, i);
      // The unit's new activations reach the error every later unit sees.
      for (int64_t t = 0; t < tokens; ++t) {
        const float da = unit.a[size_t(t)] - a[size_t(t * inter + i)];
        a[size_t(t * inter + i)] = unit.a[size_t(t)];
        if (da == 0) continue;
        for (int64_t k = 0; k < hidden; ++k) r[size_t(t * hidden + k)] += qd[size_t(k * inter + i)] * da;
      }
    }

    // Down, exactly: its rows minimize ||A d - y||^2 over the quantized activations A [T, inter],
    // plus the dampening's ridge toward the unquantized row, which refine_quantized's objective
    // (q - w*)^T H_damped (q - w*) equals up to a constant with w* = H_damped^-1 (A^T y + ridge w).
    std::vector<double> h(size_t(inter * inter), 0.0);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t i = 0; i < inter; ++i) {
        const double ai = a[size_t(t * inter + i)];
        for (int64_t j = 0; j < inter; ++j) h[size_t(i * inter + j)] += ai * a[size_t(t * inter + j)];
      }
    // The layer-wise objective over all calibration tokens, ||A_f (d - w)||^2 with A_f the
    // unquantized activations, as a prior against fitting the sample's noise: weighted
    // expert_prior times the sample's share of the tokens.
    std::vector<double> prior;
    if (w.act_hessian && w.calib_tokens > 0 && options.expert_prior > 0) {
      const double k = options.expert_prior * double(tokens) / double(w.calib_tokens);
      prior.assign(w.act_hessian, w.act_hessian + inter * inter);
      for (size_t i = 0; i < prior.size(); ++i) prior[i] *= k, h[i] += prior[i];
    }
    std::vector<double> hd = h;
    const double mean = unit_dead_inputs(hd, inter);
    for (int64_t i = 0; i < inter; ++i) hd[size_t(i * inter + i)] += options.damp * mean;
    std::vector<float> target(size_t(hidden * inter));
    std::vector<double> rhs(static_cast<size_t>(inter));
    bool solved = true;
    for (int64_t k = 0; k < hidden && solved; ++k) {
      for (int64_t i = 0; i < inter; ++i) {
        double s = 0;
        for (int64_t t = 0; t < tokens; ++t) s += double(a[size_t(t * inter + i)]) * y[size_t(t * hidden + k)];
        rhs[size_t(i)] = s + (hd[size_t(i * inter + i)] - h[size_t(i * inter + i)]) * w.down[k * inter + i];
        if (!prior.empty())
          for (int64_t j = 0; j < inter; ++j) rhs[size_t(i)] += prior[size_t(i * inter + j)] * w.down[k * inter + j];
      }
      solved = solve_spd(hd, rhs, inter);
      for (int64_t i = 0; i < inter; ++i) target[size_t(k * inter + i)] = float(rhs[size_t(i)]);
    }
    if (!solved) return;
    refine_quantized(target.data(), hidden, inter, h.data(), f, down.words, down.scales, down.biases, options);
  }
}

}  // namespace moestream
