#include <colossalai/quantization/bnb.h>

#include "block_scales.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "../kernels/cuda_launch.h"
#include "../kernels/dequantize_4bit_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>

namespace colossalai {
namespace quantization {

void BnbQuantizationConfig::validate() const {
  TORCH_CHECK(
      load_in_4bit() != load_in_8bit(),
      "BnbQuantizationConfig: set exactly one of load_in_4bit and "
      "load_in_8bit (got load_in_4bit=",
      load_in_4bit(),
      ", load_in_8bit=",
      load_in_8bit(),
      ")");
  TORCH_CHECK(
      bnb_4bit_quant_type() == "fp4" || bnb_4bit_quant_type() == "nf4",
      "BnbQuantizationConfig: bnb_4bit_quant_type must be 'fp4' or 'nf4', "
      "got '",
      bnb_4bit_quant_type(),
      "'");
  TORCH_CHECK(
      at::isFloatingType(bnb_4bit_compute_dtype()),
      "BnbQuantizationConfig: bnb_4bit_compute_dtype must be a floating "
      "dtype, got ",
      bnb_4bit_compute_dtype());
  TORCH_CHECK(
      llm_int8_threshold() > 0,
      "BnbQuantizationConfig: llm_int8_threshold must be positive, got ",
      llm_int8_threshold());
}

at::Tensor code_4bit(const std::string& quant_type) {
  // bitsandbytes' tables (its published values, as fp32).
  static const std::vector<float> nf4 = {
      -1.0f,
      -0.6961928009986877f,
      -0.5250730514526367f,
      -0.39491748809814453f,
      -0.28444138169288635f,
      -0.18477343022823334f,
      -0.09105003625154495f,
      0.0f,
      0.07958029955625534f,
      0.16093020141124725f,
      0.24611230194568634f,
      0.33791524171829224f,
      0.44070982933044434f,
      0.5626170039176941f,
      0.7229568362236023f,
      1.0f};
  // FP4 (1 sign, 2 exponent, 1 mantissa bits), normalised by its largest
  // magnitude in fp32 as bitsandbytes' get_4bit_type does.
  static const std::vector<float> fp4 = [] {
    std::vector<float> v = {
        0.0f,
        0.0625f,
        8.0f,
        12.0f,
        4.0f,
        6.0f,
        2.0f,
        3.0f,
        0.0f,
        -0.0625f,
        -8.0f,
        -12.0f,
        -4.0f,
        -6.0f,
        -2.0f,
        -3.0f};
    for (auto& x : v) {
      x /= 12.0f;
    }
    return v;
  }();
  TORCH_CHECK(
      quant_type == "nf4" || quant_type == "fp4",
      "quantize_4bit: quant_type must be 'nf4' or 'fp4', got '",
      quant_type,
      "'");
  const auto& v = quant_type == "nf4" ? nf4 : fp4;
  return at::tensor(v, at::kFloat);
}

namespace {

// torch.linspace(start, end, steps, dtype=float32) as PyTorch 2.x's CPU
// kernel computes it (an fp32 step, each value one fused multiply-add
// rounded once, the second half counted back from `end`), so the map is the
// same whichever LibTorch this runs on (1.13's linspace rounds otherwise).
// The products of an fp32 step and a small count are exact in double, so
// the double sum rounded to float is that multiply-add.
at::Tensor linspace_f32(double start, double end, int64_t steps) {
  const float s = static_cast<float>(start), e = static_cast<float>(end);
  const float step = (e - s) / static_cast<float>(steps - 1);
  std::vector<float> v(steps);
  const int64_t halfway = steps / 2;
  for (int64_t i = 0; i < steps; ++i) {
    v[i] = i < halfway
        ? static_cast<float>(double(step) * double(i) + double(s))
        : static_cast<float>(double(e) - double(step) * double(steps - i - 1));
  }
  return at::tensor(v, at::kFloat);
}

} // namespace

at::Tensor create_dynamic_map(
    bool is_signed,
    int64_t max_exponent_bits,
    int64_t total_bits) {
  // bitsandbytes' construction, step for step in fp32: for each exponent,
  // the midpoints of a linear fraction grid in [0.1, 1], scaled by a power
  // of ten, then 0 and 1, padded to 256 and sorted.
  std::vector<float> data;
  const int64_t non_sign_bits = total_bits - 1;
  const int64_t additional =
      (int64_t(1) << (non_sign_bits - max_exponent_bits)) - 1;
  auto add = [&](int64_t items, int64_t i) {
    auto bounds = linspace_f32(0.1, 1.0, items);
    auto means =
        (bounds.narrow(0, 0, items - 1) + bounds.narrow(0, 1, items - 1)) / 2.0;
    const double scale =
        std::pow(10.0, static_cast<double>(-(max_exponent_bits - 1) + i));
    auto pos = (means * scale).contiguous();
    const float* p = pos.data_ptr<float>();
    data.insert(data.end(), p, p + pos.numel());
    if (is_signed) {
      auto neg = (means * -scale).contiguous();
      const float* n = neg.data_ptr<float>();
      data.insert(data.end(), n, n + neg.numel());
    }
  };
  int64_t i = 0;
  for (; i < max_exponent_bits; ++i) {
    const int64_t items = is_signed
        ? (int64_t(1) << (i + non_sign_bits - max_exponent_bits)) + 1
        : (int64_t(1) << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    add(items, i);
  }
  if (additional > 0) {
    add(additional + 1, i - 1);
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  TORCH_CHECK(
      static_cast<int64_t>(data.size()) == (int64_t(1) << total_bits),
      "create_dynamic_map: ",
      data.size(),
      " values for ",
      total_bits,
      " bits");
  while (data.size() < 256) {
    data.push_back(0.0f);
  }
  std::sort(data.begin(), data.end());
  return at::tensor(data, at::kFloat);
}

namespace {

// Per block of `blocksize` (the last one may be shorter): absmax and the
// values scaled into [-1, 1], as bitsandbytes' CPU path computes them
// (times the reciprocal for whole blocks, divided for the rest).
std::pair<at::Tensor, at::Tensor> scale_blocks(
    const at::Tensor& a,
    int64_t blocksize) {
  TORCH_CHECK(blocksize > 0, "blocksize must be positive, got ", blocksize);
  TORCH_CHECK(a.numel() > 0, "cannot quantize an empty tensor");
  auto flat = a.reshape(-1).to(at::kFloat);
  const int64_t n = flat.numel();
  const int64_t rem = n % blocksize, full = n - rem;
  auto com = flat.narrow(0, 0, full).reshape({full / blocksize, blocksize});
  auto absmax = std::get<0>(com.abs().max(-1));
  auto scaled =
      at::clamp(com * (1.0 / absmax.clamp_min(1e-38)).view({-1, 1}), -1, 1)
          .reshape(-1);
  if (rem > 0) {
    auto tail = flat.narrow(0, full, rem);
    auto am = tail.abs().max().clamp_min(1e-38);
    absmax = at::cat({absmax, am.unsqueeze(0)});
    scaled = at::cat({scaled, at::clamp(tail / am, -1, 1)});
  }
  return {absmax, scaled};
}

at::Tensor scale_back(
    const at::Tensor& values,
    const at::Tensor& absmax,
    int64_t blocksize,
    int64_t n) {
  const int64_t rem = n % blocksize, full = n - rem;
  auto v = values.narrow(0, 0, n);
  auto out = at::empty({n}, v.options());
  out.narrow(0, 0, full)
      .copy_((v.narrow(0, 0, full).view({-1, blocksize}) *
              absmax.narrow(0, 0, full / blocksize).view({-1, 1}))
                 .reshape(-1));
  if (rem > 0) {
    out.narrow(0, full, rem)
        .copy_(v.narrow(0, full, rem) * absmax[full / blocksize]);
  }
  return out;
}

} // namespace

std::pair<at::Tensor, at::Tensor> quantize_blockwise(
    const at::Tensor& a,
    const at::Tensor& code,
    int64_t blocksize) {
  at::Tensor absmax, scaled;
  std::tie(absmax, scaled) = scale_blocks(a, blocksize);
  auto c = code.to(a.device(), at::kFloat);
  auto bounds =
      (c.narrow(0, 0, c.numel() - 1) + c.narrow(0, 1, c.numel() - 1)) / 2;
  auto q = at::bucketize(scaled, bounds, /*out_int32=*/true).to(at::kByte);
  return {q.reshape(a.sizes()), absmax};
}

at::Tensor dequantize_blockwise(
    const at::Tensor& q,
    const at::Tensor& absmax,
    const at::Tensor& code,
    int64_t blocksize) {
  auto values = code.to(q.device(), at::kFloat)
                    .index_select(0, q.reshape(-1).to(at::kLong));
  return scale_back(values, absmax, blocksize, q.numel()).reshape(q.sizes());
}

std::pair<at::Tensor, QuantState4bit> quantize_4bit(
    const at::Tensor& a,
    int64_t blocksize,
    const std::string& quant_type,
    bool compress_statistics) {
  TORCH_CHECK(
      at::isFloatingType(a.scalar_type()),
      "quantize_4bit: a floating tensor is expected, got ",
      a.scalar_type());
  QuantState4bit st;
  st.code = code_4bit(quant_type).to(a.device());
  st.quant_type = quant_type;
  st.blocksize = blocksize;
  st.shape = a.sizes().vec();
  st.dtype = a.scalar_type();
  at::Tensor absmax, scaled;
  std::tie(absmax, scaled) = scale_blocks(a, blocksize);
  if (scaled.numel() % 2 != 0) {
    scaled = at::cat({scaled, at::zeros({1}, scaled.options())});
  }
  // The code sorted: midpoints between neighbours; FP4's indices map back
  // through the sort order.
  // A stable sort: FP4's two zeros keep their order, as in bitsandbytes.
  at::Tensor sorted, order;
  std::tie(sorted, order) =
      at::sort(st.code, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  auto bounds = (sorted.narrow(0, 0, 15) + sorted.narrow(0, 1, 15)) / 2;
  auto q = at::bucketize(scaled, bounds, /*out_int32=*/true).to(at::kLong);
  if (quant_type != "nf4") {
    q = order.index_select(0, q);
  }
  auto q8 = q.to(at::kByte);
  auto pairs = q8.view({-1, 2});
  auto packed =
      at::bitwise_or(
          at::bitwise_left_shift(pairs.select(1, 0), 4), pairs.select(1, 1))
          .unsqueeze(1)
          .contiguous();
  if (compress_statistics) {
    st.nested = true;
    st.offset = absmax.mean();
    st.state2_code = create_dynamic_map(true).to(a.device());
    std::tie(st.absmax, st.state2_absmax) = quantize_blockwise(
        absmax - st.offset, st.state2_code, st.state2_blocksize);
  } else {
    st.absmax = absmax;
  }
  return {packed, st};
}

namespace {

// The per-block scale as fp32 (the nested absmax dequantized).
at::Tensor block_absmax(const QuantState4bit& st) {
  if (!st.nested) {
    return st.absmax.to(at::kFloat);
  }
  return dequantize_blockwise(
             st.absmax, st.state2_absmax, st.state2_code, st.state2_blocksize) +
      st.offset;
}

// One pass over the packed bytes on the CPU: each value is its code times
// its block's scale in fp32, rounded once to T (what the ATen path below
// computes, without its int64 index tensors), looked up in the block's
// table of its 16 values (16 roundings a block, none per value).
template <typename T>
void dequantize_4bit_cpu(
    const uint8_t* packed,
    const detail::CpuScales& scale,
    const float* code,
    int64_t blocksize,
    int64_t n,
    T* out) {
  const int64_t blocks = detail::ceil_div(n, blocksize);
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    float values[16];
    T table[16];
    for (int64_t b = b0; b < b1; ++b) {
      detail::block_table<T>(code, scale(b), values);
      for (int c = 0; c < 16; ++c) {
        table[c] = detail::exact_cast<T>(values[c]);
      }
      const int64_t end = std::min(n, (b + 1) * blocksize);
      int64_t i = b * blocksize;
      if (i % 2 != 0) { // an odd blocksize: this block starts mid-byte
        out[i] = table[packed[i / 2] & 15];
        ++i;
      }
      for (; i + 1 < end; i += 2) {
        const uint8_t byte = packed[i / 2];
        out[i] = table[byte >> 4];
        out[i + 1] = table[byte & 15];
      }
      if (i < end) {
        out[i] = table[packed[i / 2] >> 4];
      }
    }
  });
}

} // namespace

at::Tensor dequantize_4bit(const at::Tensor& packed, const QuantState4bit& st) {
  return dequantize_4bit(packed, st, st.dtype);
}

at::Tensor dequantize_4bit(
    const at::Tensor& packed,
    const QuantState4bit& st,
    at::ScalarType dtype) {
  TORCH_CHECK(
      packed.scalar_type() == at::kByte,
      "dequantize_4bit: packed data must be uint8, got ",
      packed.scalar_type());
  int64_t n = 1;
  for (auto s : st.shape) {
    n *= s;
  }
  TORCH_CHECK(
      packed.numel() == (n + 1) / 2,
      "dequantize_4bit: ",
      packed.numel(),
      " packed bytes for a tensor of ",
      n,
      " values");
  const auto device = packed.device();
  TORCH_CHECK(
      st.blocksize > 0,
      "dequantize_4bit: blocksize must be positive, got ",
      st.blocksize,
      " (a corrupt quantization state)");
  TORCH_CHECK(
      st.code.defined() && st.code.numel() == 16,
      "dequantize_4bit: the code table must hold 16 values, got ",
      st.code.defined() ? st.code.numel() : 0,
      " (a corrupt quantization state)");
  const int64_t blocks = detail::ceil_div(n, st.blocksize);
  auto code = st.code.to(device, at::kFloat).contiguous();
  if (device.is_cpu()) {
    const detail::ScaleTensors scales(st, blocks, device, "dequantize_4bit");
    const auto cpu_scales = scales.cpu();
    auto bytes = packed.contiguous();
    auto out = at::empty(st.shape, at::TensorOptions().dtype(dtype));
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kBFloat16, at::kHalf, dtype, "dequantize_4bit", [&] {
          dequantize_4bit_cpu<scalar_t>(
              bytes.data_ptr<uint8_t>(),
              cpu_scales,
              code.data_ptr<float>(),
              st.blocksize,
              n,
              out.data_ptr<scalar_t>());
        });
    return out;
  }
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (device.is_cuda() &&
      (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16)) {
    const c10::cuda::CUDAGuard guard(device);
    const detail::ScaleTensors scales(st, blocks, device, "dequantize_4bit");
    auto bytes = packed.contiguous();
    auto out = at::empty(st.shape, packed.options().dtype(dtype));
    kernels::cuda::check_launch(
        kernels::cuda::dequantize_4bit(
            kernels::cuda::dtype_of(dtype, "dequantize_4bit"),
            bytes.data_ptr<uint8_t>(),
            scales.cuda(),
            code.data_ptr<float>(),
            st.blocksize,
            detail::exact_log2(st.blocksize),
            n,
            out.data_ptr(),
            c10::cuda::getCurrentCUDAStream().stream()),
        "dequantize_4bit",
        "the kernel's launch");
    return out;
  }
#endif
  // Elsewhere: the same arithmetic as ATen kernels on the device (the
  // state checked as the kernels check it).
  detail::check_scales(st, blocks, "dequantize_4bit");
  auto absmax = block_absmax(st).to(device).contiguous();
  TORCH_CHECK(
      absmax.numel() >= blocks,
      "dequantize_4bit: ",
      absmax.numel(),
      " absmax values for ",
      blocks,
      " blocks (a corrupt quantization state)");
  auto bytes = packed.reshape(-1).to(at::kInt);
  auto idx =
      at::stack(
          {at::bitwise_right_shift(bytes, 4), at::bitwise_and(bytes, 15)}, 1)
          .reshape(-1)
          .narrow(0, 0, n)
          .to(at::kLong);
  auto values = code.index_select(0, idx);
  return scale_back(values, absmax, st.blocksize, n)
      .reshape(st.shape)
      .to(dtype);
}

Int8Rows int8_vectorwise_quant(const at::Tensor& a, double threshold) {
  TORCH_CHECK(
      a.dim() == 2 && at::isFloatingType(a.scalar_type()),
      "int8_vectorwise_quant: a 2-d floating tensor is expected, got ",
      a.scalar_type(),
      " of shape ",
      a.sizes());
  // Read in fp16 as bitsandbytes casts (the products below are fp32).
  auto h = a.to(at::kHalf).to(at::kFloat);
  Int8Rows r;
  if (threshold > 0) {
    auto outliers = h.abs().ge(threshold);
    r.outlier_cols = outliers.any(0).nonzero().reshape(-1);
    h = h.masked_fill(outliers, 0.0);
  } else {
    r.outlier_cols = at::empty({0}, a.options().dtype(at::kLong));
  }
  r.stats = std::get<0>(h.abs().max(1));
  // Python's 127.0 / t is t.reciprocal() * 127 (two roundings). An
  // all-zero row quantizes to zeros (127 / 0 would make NaN).
  auto scale = at::where(
      r.stats.gt(0), r.stats.reciprocal() * 127.0, at::zeros_like(r.stats));
  r.data = at::round(h * scale.unsqueeze(-1)).to(at::kChar);
  if (r.outlier_cols.numel() > 0) {
    r.data.index_fill_(1, r.outlier_cols, 0);
  }
  return r;
}

at::Tensor int8_vectorwise_dequant(
    const at::Tensor& q,
    const at::Tensor& stats) {
  // bitsandbytes multiplies by its fp32 reciprocal of 127.
  return q.to(at::kFloat) * stats.view({-1, 1}) * 7.874015718698502e-3;
}

} // namespace quantization
} // namespace colossalai
