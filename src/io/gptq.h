// GPTQ for pack --gptq (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for
// Generative Pre-trained Transformers"), written from the paper's description.
//
// A linear layer y = W x (W [out, in]) is quantized one input column at a time. With H = sum over
// calibration inputs of x x^T, the error a column's rounding adds to the layer's output on those
// inputs is spread over the columns not yet quantized, in the proportions H^-1 gives, so that the
// output error ||X W^T - X Q^T|| shrinks instead of each weight's own error. As in the paper:
// H's diagonal gets a dampening of `damp` times its mean; the updates use the upper Cholesky
// factor U of H^-1 (H^-1 = U^T U), whose row i holds what column i's error does to the later
// columns; columns are processed in lazy blocks, later columns updated once per block.
//
// The result is the same affine layout quantize_affine writes (MLX's, core/quant.h), so the
// kernels need no change. A group's scale and bias are computed with MLX's rule (clip search
// included when asked): in stored column order from the group's weights as they stand when its
// first column is reached, i.e. after the updates from earlier groups; with act order (the
// default) from the original weights. Each column's codes use the stored (rounded) scale and
// bias, so the error that is spread is the one the kernels will see.
//
// Calibration (gptq_recorder.cpp) runs the model on a text and collects, for every routed expert,
// the Hessian of its gate/up input (the tokens routed to it) and of its down input (the SwiGLU
// activation of those tokens).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/quant.h"
#include "io/pack.h"

namespace moestream {

class Backend;

struct GptqOptions {
  double damp = 0.01;       // added to H's diagonal: this fraction of its mean
  int64_t block = 128;      // columns per lazy block (rounded up to a multiple of the group size)
  bool clip_search = false; // group parameters by QuantizeOptions::clip_search
  // Columns by falling diagonal of H (the paper's "act order"); then each group's parameters are
  // computed up front from the original weights, since its columns are met out of order. Lower
  // error than in stored order on the tests' synthetic layer and on the trained model (PERFORMANCE.md).
  bool act_order = true;
  // Rounds of refinement after the column pass (refine_quantized); 0: plain GPTQ. Lower output
  // error and perplexity than plain GPTQ at 2, 3 and 4 bits on the trained model (PERFORMANCE.md).
  int refine_rounds = 4;
  int refine_sweeps = 4;  // coordinate-descent sweeps over a row's codes per round, at most
  // Rounds of reconstruct_expert (gate and up unit by unit, then down) when calibration kept
  // the expert's inputs; 0: none.
  int expert_rounds = 1;
  int expert_sweeps = 2;  // code sweeps and group refits per unit and round, at most
  double expert_prior = 1;  // weight of down's layer-wise objective in reconstruct_expert
};

// h (n, n) as GPTQ and the refinement regularize it: a zero diagonal entry (an input no
// calibration token had) becomes 1. Returns the mean of the diagonal then, which the dampening
// (`damp` times it, added to the diagonal) is scaled by.
double unit_dead_inputs(std::vector<double>& h, int64_t n);

// a (n, n) symmetric positive definite -> its lower Cholesky factor in place (the upper triangle
// is left as it was). False when a is not positive definite.
bool cholesky_lower(std::vector<double>& a, int64_t n);

// Quantizes w (rows, cols) float32 to f (affine) with error compensation under h (cols, cols,
// symmetric, row-major; the sum of x x^T over calibration inputs x [cols]). Writes words, scales
// and biases as quantize_affine does. `what` names the matrix in errors.
void quantize_gptq(const float* w, int64_t rows, int64_t cols, const double* h, const QuantFormat& f,
                   uint32_t* words, uint16_t* scales, uint16_t* biases, const GptqOptions& options = {},
                   std::string_view what = "matrix");

// GPTQ's column pass is greedy: each code is chosen once, given the columns before it, and the
// group parameters are fixed before the codes. refine_quantized lowers the same objective,
// tr((W - Q) H (W - Q)^T) with H dampened as GPTQ dampens it, row by row from where GPTQ left
// off: exact coordinate descent on the codes (each code moved to the level that lowers the
// objective most given all the others), then every group's scale and bias refitted at once by
// least squares given the codes (2 unknowns a group, closed form), rounded to the stored dtype
// and kept only if the objective still falls; options.refine_rounds times, then a last descent.
// The objective never rises.
void refine_quantized(const float* w, int64_t rows, int64_t cols, const double* h, const QuantFormat& f,
                      uint32_t* words, uint16_t* scales, uint16_t* biases, const GptqOptions& options);

// tr((W - Q) H (W - Q)^T) for Q the dequantized words, scales and biases: the squared output
// error over the calibration inputs whose x x^T sum to h.
double quantized_error(const float* w, int64_t rows, int64_t cols, const double* h, const QuantFormat& f,
                       const uint32_t* words, const uint16_t* scales, const uint16_t* biases);

// A routed expert's unquantized weights, y = down (silu(gate x) * (up x)): gate and up
// [inter, hidden], down [hidden, inter], float32.
struct ExpertMatrices {
  const float *gate, *up, *down;
  int64_t hidden, inter;
  // The calibration Hessians over all the expert's tokens (ExpertHessian::in [hidden, hidden],
  // ::act [inter, inter]) and their count: reconstruct_expert's priors (GptqOptions::
  // expert_prior). Optional.
  const double* in_hessian = nullptr;
  const double* act_hessian = nullptr;
  int64_t calib_tokens = 0;
};

// A quantized matrix in quantize_affine's layout, changed in place.
struct QuantizedMatrix {
  uint32_t* words;
  uint16_t* scales;
  uint16_t* biases;
};

// GPTQ and its refinement each lower one matrix's own output error; how the errors of gate, up
// and down combine through the SwiGLU is left out. reconstruct_expert starts from their result
// (all three in format f) and lowers the whole expert's squared output error on x (tokens,
// hidden), a sample of the calibration inputs routed to it. Gate and up unit by unit (row i of
// each): exact coordinate descent on the codes against the expert's error (up's effect on it is
// quadratic; gate's steps are chosen by silu's second-order expansion and kept only when the
// exact error falls), then one Gauss-Newton step on each group's scale and bias, kept only when
// the exact error falls. Then down, whose effect is quadratic, by refine_quantized under the
// quantized activations with the unquantized expert's output as target. A few thousand tokens
// do not pin down tens of thousands of codes: fitted alone, the sample's error falls and other
// tokens' rises (PERFORMANCE.md). So each matrix's layer-wise objective over all calibration
// tokens (w's Hessians, as GPTQ minimizes it) is added as a prior, scaled to the sample's size
// and to the expert's sensitivity to that matrix, times options.expert_prior. The sum never
// rises. options.expert_rounds times; deterministic.
void reconstruct_expert(const float* x, int64_t tokens, const ExpertMatrices& w, const QuantFormat& f,
                        const QuantizedMatrix& gate, const QuantizedMatrix& up, const QuantizedMatrix& down,
                        const GptqOptions& options);
// sum over the tokens of ||expert_q(x) - expert(x)||^2 (SwiGLU experts).
double expert_output_error(const float* x, int64_t tokens, const ExpertMatrices& w, const QuantFormat& f,
                           const QuantizedMatrix& gate, const QuantizedMatrix& up, const QuantizedMatrix& down);

// What calibration saw of one routed expert.
struct ExpertHessian {
  int64_t tokens = 0;       // tokens routed to it
  std::vector<double> in;   // [hidden, hidden]: sum of x x^T over those tokens (gate and up)
  std::vector<double> act;  // [inter, inter]: the same over its activations (down's input)
  // [rows, hidden]: up to ExpertHessians::sample_cap of those tokens' inputs, a uniform sample
  // (reservoir sampling with a fixed hash, so the same run keeps the same rows).
  std::vector<float> sample;
};

struct ExpertHessians {
  std::vector<std::vector<ExpertHessian>> layers;  // [layer][expert]; empty for layers without experts
  int64_t tokens = 0;                              // calibration tokens run through the model
  int64_t sample_cap = 0;                          // inputs kept per expert (ExpertHessian::sample)
  const ExpertHessian* find(int layer, int expert) const;  // nullptr when never routed to
};

// A backend decorator that forwards every call to `inner` (the CPU backend) and, in moe(),
// adds the inputs of each routed expert to `out` (upper triangles only, until
// finish_hessians). The routing is the inner backend's own: each token is routed alone through
// inner's moe() with an expert provider that notes the requested experts and hands none out.
std::unique_ptr<Backend> make_hessian_recorder(std::unique_ptr<Backend> inner, ExpertHessians& out);
// Mirrors the recorded upper triangles into full symmetric matrices.
void finish_hessians(ExpertHessians& h);

struct GptqCalibration {
  std::string text_path;     // calibration text (never the text quality is measured on)
  int64_t max_tokens = 0;    // tokens of it to run; <= 0: all
  int64_t ctx = 512;         // tokens per window (a fresh sequence each)
  int threads = 0;
  std::function<bool(const std::string& name)> skip;  // PackOptions::skip
  // When set, the model to calibrate on instead of a bf16 copy of the checkpoint: a pack whose
  // experts are already quantized (pack --gptq-passes), removed afterwards. Each layer's
  // Hessians then see the inputs that the quantized layers before it produce, and down's the
  // activations of its own quantized gate and up: the paper's "true sequential" quantization,
  // with one calibration run per pass instead of one per layer.
  std::string quantized_pack;
  int64_t sample_tokens = 0;  // ExpertHessians::sample_cap
};

// Packs `src` as bf16 into a temporary directory beside `out` (removed afterwards; or takes
// c.quantized_pack), runs that model on the calibration text on the CPU with the recorder, and
// returns the experts' Hessians.
ExpertHessians collect_expert_hessians(const std::string& src, const std::string& out,
                                       const ExpertTensorParser& experts, const GptqCalibration& c);

}  // namespace moestream
