#include "io/pack_tensors.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/quant.h"

namespace moestream::packer {

std::vector<int64_t> ExpertSource::shape() const {
  std::vector<int64_t> s = index < 0 ? tensor->shape : std::vector<int64_t>(tensor->shape.begin() + 1, tensor->shape.end());
  while (s.size() > 2) {
    s[s.size() - 2] *= s.back();
    s.pop_back();
  }
  return s;
}

const char* ExpertSource::data() const {
  const char* base = static_cast<const char*>(tensor->data);
  return index < 0 ? base : base + index * int64_t(tensor->nbytes) / tensor->shape[0];
}

uint64_t ExpertSource::nbytes() const { return index < 0 ? tensor->nbytes : tensor->nbytes / uint64_t(tensor->shape[0]); }

std::vector<float> to_f32(const ExpertSource& w, const ExpertSource* scales, const ExpertSource* biases,
                          const QuantFormat& f) {
  const std::vector<int64_t> shape = w.shape();
  if (f.scheme == QuantScheme::Mxfp4) {
    const int64_t rows = shape[0], cols = shape[1] * 2;
    std::vector<float> out(size_t(rows * cols));
    const auto* codes = reinterpret_cast<const uint8_t*>(w.data());
    const auto* exps = reinterpret_cast<const uint8_t*>(scales->data());
    for (int64_t r = 0; r < rows; ++r)
      dequantize_mxfp4_row(cols, codes + r * cols / 2, exps + r * cols / 32, out.data() + r * cols);
    return out;
  }
  const int bits = f.bits, group = f.group_size;
  if (bits == 0) {
    TensorView v{w.tensor->name, w.tensor->dtype, shape, w.data(), w.nbytes()};
    std::vector<float> out(size_t(v.numel()));
    for (int64_t i = 0; i < v.numel(); ++i) {
      switch (v.dtype) {
        case DType::F32: out[size_t(i)] = v.as<float>()[i]; break;
        case DType::BF16: out[size_t(i)] = bf16_to_f32(v.as<uint16_t>()[i]); break;
        case DType::F16: out[size_t(i)] = f16_to_f32(v.as<uint16_t>()[i]); break;
        default: fail("tensor ", v.name, ": cannot convert ", dtype_name(v.dtype), " to float");
      }
    }
    return out;
  }
  const int64_t rows = shape[0], cols = shape[1] * 32 / bits, groups = cols / group;
  std::vector<float> out(size_t(rows * cols));
  const auto* words = reinterpret_cast<const uint32_t*>(w.data());
  const auto* sc = reinterpret_cast<const uint16_t*>(scales->data());
  const auto* bi = reinterpret_cast<const uint16_t*>(biases->data());
  for (int64_t r = 0; r < rows; ++r)
    dequantize_row(f, cols, words + r * shape[1], sc + r * groups, bi + r * groups, out.data() + r * cols);
  return out;
}

void check_mxfp4_source(const ExpertSource& w, const ExpertSource* scales, const ExpertSource* biases,
                        const std::string& method) {
  const std::string& name = w.tensor->name;
  if (method != "mxfp4")
    fail("tensor ", name, ": U8 expert weights are read as MXFP4 blocks, but config.json's quantization_config.quant_method is '",
         method, "' (expected mxfp4)");
  if (!scales || biases) fail("tensor ", name, ": MXFP4 blocks need their _scales tensor (and no biases)");
  const std::vector<int64_t> shape = w.shape(), want{shape[0], shape[1] * 2 / 32};
  if (shape.size() != 2 || shape[1] % 16 || scales->tensor->dtype != DType::U8 || scales->shape() != want)
    fail("tensor ", scales->tensor->name, ": MXFP4 exponents for blocks ", shape_str(shape), " must be U8 ",
         shape_str(want), ", found ", dtype_name(scales->tensor->dtype), " ", shape_str(scales->shape()));
  const auto* e = reinterpret_cast<const uint8_t*>(scales->data());
  for (uint64_t i = 0; i < scales->nbytes(); ++i)
    if (e[i] > kMxfp4MaxExponent)
      fail("tensor ", scales->tensor->name, ": exponent ", int(e[i]), " at element ", i, " (above ",
           int(kMxfp4MaxExponent), ": a scale beyond float32's range, or NaN)");
}

std::vector<float> fp8_row_scales(const TensorView& w, const TensorView& scale_inv, const std::vector<int64_t>& block) {
  if (w.shape.size() != 2) fail("tensor ", w.name, ": FP8 weights must be matrices, found ", shape_str(w.shape));
  const int64_t rows = w.shape[0], cols = w.shape[1];
  const std::vector<int64_t> want{(rows + block[0] - 1) / block[0], (cols + block[1] - 1) / block[1]};
  if (scale_inv.dtype != DType::F32 || scale_inv.shape != want)
    fail("tensor ", scale_inv.name, ": expected F32 ", shape_str(want), " (blocks of ", block[0], "x", block[1],
         " over ", shape_str(w.shape), "), found ", dtype_name(scale_inv.dtype), " ", shape_str(scale_inv.shape));
  for (int64_t i = 0; i < want[0] * want[1]; ++i)  // the kernels multiply scales by 256 (exact below 2^100)
    if (!(std::abs(scale_inv.as<float>()[i]) <= 0x1p100f))
      fail("tensor ", scale_inv.name, ": scale ", scale_inv.as<float>()[i], " at element ", i, " is not a finite number below 2^100");
  std::vector<float> out(size_t(rows * want[1]));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + r * want[1], scale_inv.as<float>() + (r / block[0]) * want[1], size_t(want[1]) * 4);
  return out;
}

void check_fp8_native(const TensorView& w, const std::vector<int64_t>& block) {
  if (block[1] % 32)
    fail("tensor ", w.name, ": FP8 column blocks of ", block[1], " (weight_block_size) are not a multiple of 32; "
         "pack with --quant bf16 or --quant q8 instead");
  const auto* codes = static_cast<const uint8_t*>(w.data);
  for (uint64_t i = 0; i < w.nbytes; ++i)
    if ((codes[i] & 0x7f) == 0x7f) fail("tensor ", w.name, ": element ", i, " is an FP8 NaN (0x", std::hex, int(codes[i]), ")");
}

std::vector<char> dequantize_fp8(const TensorView& w, const TensorView& scale_inv, const std::vector<int64_t>& block,
                                 DType dtype) {
  const std::vector<float> scales = fp8_row_scales(w, scale_inv, block);
  const int64_t rows = w.shape[0], cols = w.shape[1], groups = int64_t(scales.size()) / rows;
  std::vector<float> row(static_cast<size_t>(cols));
  std::vector<char> out(size_t(rows * cols) * dtype_size(dtype));
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_fp8_row(cols, int(block[1]), static_cast<const uint8_t*>(w.data) + r * cols, scales.data() + r * groups,
                       row.data());
    if (dtype == DType::F32) {
      std::memcpy(out.data() + r * cols * 4, row.data(), size_t(cols) * 4);
    } else {
      auto* dst = reinterpret_cast<uint16_t*>(out.data()) + r * cols;
      for (int64_t c = 0; c < cols; ++c) dst[c] = f32_to_bf16(row[size_t(c)]);
    }
  }
  return out;
}

bool is_bias_role(const std::string& role) {
  return role.size() > 5 && role.compare(role.size() - 5, 5, "_bias") == 0;
}

std::map<std::string, ExpertSource> to_pack_layout(const std::map<std::string, ExpertSource>& parts,
                                                   std::deque<std::vector<char>>& bytes,
                                                   std::deque<TensorView>& views) {
  std::map<std::string, ExpertSource> out;
  const auto add = [&](const std::string& role, const std::string& name, DType dtype,
                       std::vector<int64_t> shape, std::vector<char>&& data) {
    std::vector<char>& b = bytes.emplace_back(std::move(data));
    const TensorView& v = views.emplace_back(TensorView{name, dtype, std::move(shape), b.data(), b.size()});
    out[role] = ExpertSource{&v, -1};
  };
  for (const auto& [role, src] : parts) {
    const std::vector<int64_t> shape = src.shape();
    const std::string& name = src.tensor->name;
    if (is_bias_role(role)) {
      if (shape.size() != 1) fail("tensor ", name, ": expected one bias vector per expert, found ", shape_str(shape));
      const std::vector<float> v = to_f32(src, nullptr, nullptr, {});
      const int64_t n = int64_t(v.size());
      const auto as_bytes = [](const float* f, int64_t count, int64_t stride) {
        std::vector<char> b(size_t(count) * sizeof(float));
        for (int64_t i = 0; i < count; ++i) std::memcpy(b.data() + i * 4, f + i * stride, sizeof(float));
        return b;
      };
      if (role == "gate_up_bias") {
        if (n % 2) fail("tensor ", name, ": interleaved gate/up bias needs an even size, found ", n);
        add("gate_bias", name, DType::F32, {1, n / 2}, as_bytes(v.data(), n / 2, 2));
        add("up_bias", name, DType::F32, {1, n / 2}, as_bytes(v.data() + 1, n / 2, 2));
      } else {
        add(role, name, DType::F32, {1, n}, as_bytes(v.data(), n, 1));
      }
      continue;
    }
    if (src.layout == ExpertLayout::OutIn) {
      out[role] = src;
      continue;
    }
    if (src.layout == ExpertLayout::GateUpRows) {
      // Gate and up are the two halves of the rows: views into the tensor, nothing copied.
      if (role != "gate_up" || shape.size() != 2 || shape[0] % 2 || src.tensor->dtype == DType::U32)
        fail("tensor ", name, ": fused gate/up rows need role gate_up and a plain [2 * inter, in] matrix per expert, found ",
             dtype_name(src.tensor->dtype), " ", shape_str(shape));
      const uint64_t half = src.nbytes() / 2;
      for (int i = 0; i < 2; ++i) {
        const TensorView& v = views.emplace_back(
            TensorView{name, src.tensor->dtype, {shape[0] / 2, shape[1]}, src.data() + i * half, half});
        out[i == 0 ? "gate" : "up"] = ExpertSource{&v, -1};
      }
      continue;
    }
    if (src.layout == ExpertLayout::GateUpInterleavedRows) {
      // MXFP4 codes or exponents: even rows are gate, odd rows up; rows are copied whole.
      const bool scales = role == "gate_up.scales";
      if ((role != "gate_up" && !scales) || shape.size() != 2 || shape[0] % 2)
        fail("tensor ", name, ": interleaved gate/up rows need role gate_up or gate_up.scales and an even row count, found ",
             shape_str(shape));
      const uint64_t row_bytes = src.nbytes() / uint64_t(shape[0]);
      for (int half = 0; half < 2; ++half) {
        std::vector<char> b(size_t(row_bytes) * size_t(shape[0] / 2));
        for (int64_t r = 0; r < shape[0] / 2; ++r)
          std::memcpy(b.data() + r * row_bytes, src.data() + (2 * r + half) * row_bytes, row_bytes);
        add(std::string(half ? "up" : "gate") + (scales ? ".scales" : ""), name, src.tensor->dtype,
            {shape[0] / 2, shape[1]}, std::move(b));
      }
      continue;
    }
    const size_t elem = dtype_size(src.tensor->dtype);
    if (shape.size() != 2 || src.tensor->dtype == DType::U32)
      fail("tensor ", name, ": a transposed expert weight must be a plain matrix, found ",
           dtype_name(src.tensor->dtype), " ", shape_str(shape));
    // Element (r, c) of the stored [in, out'] tensor is W'[c][r]; copy element bytes as they are.
    const int64_t in = shape[0], cols = shape[1];
    const char* data = src.data();
    const auto transpose = [&](int64_t first_col, int64_t step) {
      const int64_t rows_out = (cols - first_col + step - 1) / step;
      std::vector<char> b(size_t(rows_out * in) * elem);
      for (int64_t o = 0; o < rows_out; ++o)
        for (int64_t i = 0; i < in; ++i)
          std::memcpy(b.data() + size_t(o * in + i) * elem, data + size_t(i * cols + first_col + o * step) * elem, elem);
      return b;
    };
    if (src.layout == ExpertLayout::InOut) {
      add(role, name, src.tensor->dtype, {cols, in}, transpose(0, 1));
    } else {
      if (role != "gate_up" || cols % 2)
        fail("tensor ", name, ": interleaved gate/up needs role gate_up and an even column count, found ", shape_str(shape));
      add("gate", name, src.tensor->dtype, {cols / 2, in}, transpose(0, 2));
      add("up", name, src.tensor->dtype, {cols / 2, in}, transpose(1, 2));
    }
  }
  return out;
}

}  // namespace moestream::packer
