#include <colossalai/quantization/quantized_weight.h>

#include <colossalai/utils/compat.h>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>

#include <algorithm>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "../kernels/cuda_launch.h"
#include "../kernels/dequantize_int8_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace colossalai {
namespace quantization {

namespace {

// Keeps the weight's state alive in an autograd context until backward.
struct StateCapsule : torch::CustomClassHolder {
  explicit StateCapsule(std::shared_ptr<const QuantizedWeight> w)
      : weight(std::move(w)) {}
  std::shared_ptr<const QuantizedWeight> weight;
};

// x W^T whose backward dequantizes W again rather than saving it (a saved
// full-precision W per layer would undo the quantization's memory saving
// for a whole forward-backward).
struct QuantizedMatmul : torch::autograd::Function<QuantizedMatmul> {
  static at::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& data,
      std::shared_ptr<const QuantizedWeight> w) {
    at::Tensor y;
    if (w->is_4bit()) {
      const auto compute = w->config().bnb_4bit_compute_dtype();
      // A few tokens read the packed bytes directly (NOTE [Few-row products
      // on quantized weights]). Under autocast at::linear would multiply an
      // fp32 compute dtype's operands in autocast's dtype, and so does the
      // fused product (rounding once to it is rounding twice through
      // fp32); a 16-bit compute dtype autocast changes keeps the
      // composition, which rounds twice. On the CPU a 16-bit dtype keeps it
      // too: rounding each block's 16 values there costs the fused pass
      // about what it saves (bench_qlora's few rows: 0.71-0.97x at 1-4 rows
      // of a 4096 x 4096 weight in bf16, 1.01-1.56x in fp32).
      const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
      auto dtype = compute;
      bool fused = rows <= gemv_max_rows();
      if (const auto autocast = compat::autocast_dtype(x.device().type())) {
        if (compute == at::kFloat) {
          dtype = *autocast;
        } else if (compute != *autocast && compute != at::kDouble) {
          fused = false;
        }
      }
      if (x.device().is_cpu() &&
          (dtype == at::kHalf || dtype == at::kBFloat16)) {
        fused = false;
      }
      if (fused) {
        y = gemv_4bit(x.to(dtype), data, w->state_4bit());
      } else {
        y = at::linear(x.to(compute), w->dequantize(data, compute));
      }
      y = y.to(x.scalar_type());
    } else {
      y = int8_linear(
          x, data, w->scb(), at::Tensor(), w->config().llm_int8_threshold());
    }
    ctx->save_for_backward({data});
    ctx->saved_data["weight"] =
        c10::IValue::make_capsule(c10::make_intrusive<StateCapsule>(w));
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    return y;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const auto data = ctx->get_saved_variables()[0];
    const auto w = c10::static_intrusive_pointer_cast<StateCapsule>(
                       ctx->saved_data["weight"].toCapsule())
                       ->weight;
    const auto dtype =
        static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    at::Tensor grad_x;
    if (grads[0].defined()) {
      // The matmul in the compute dtype (4-bit) or the input's (8-bit), as
      // bitsandbytes' backward.
      const auto compute =
          w->is_4bit() ? w->config().bnb_4bit_compute_dtype() : dtype;
      grad_x = at::matmul(grads[0].to(compute), w->dequantize(data, compute))
                   .to(dtype);
    }
    return {grad_x, at::Tensor(), at::Tensor()};
  }
};

} // namespace

std::pair<at::Tensor, std::shared_ptr<QuantizedWeight>> QuantizedWeight::
    quantize(const at::Tensor& weight, const BnbQuantizationConfig& config) {
  config.validate();
  TORCH_CHECK(
      weight.defined() && weight.dim() == 2 &&
          at::isFloatingType(weight.scalar_type()),
      "QuantizedWeight: a 2-d floating weight [out, in] is expected, got ",
      weight.defined() ? weight.sizes() : at::IntArrayRef(),
      weight.defined() ? " " : "",
      weight.defined() ? c10::toString(weight.scalar_type()) : "nothing");
  auto w = std::make_shared<QuantizedWeight>();
  w->config_ = config;
  w->shape_ = weight.sizes().vec();
  w->dtype_ = weight.scalar_type();
  at::NoGradGuard no_grad;
  at::Tensor data;
  if (config.load_in_4bit()) {
    std::tie(data, w->state4_) = quantize_4bit(
        weight.detach(),
        64,
        config.bnb_4bit_quant_type(),
        config.bnb_4bit_use_double_quant());
  } else {
    // The weight's rows as bitsandbytes' Int8Params stores them (no
    // outliers held back: the threshold is for activations).
    auto rows = int8_vectorwise_quant(weight.detach(), 0.0);
    data = rows.data;
    w->scb_ = rows.stats;
  }
  return {data, w};
}

at::Tensor QuantizedWeight::dequantize(
    const at::Tensor& data,
    c10::optional<at::ScalarType> dtype) const {
  const auto out = dtype.value_or(dtype_);
  if (is_4bit()) {
    return dequantize_4bit(data, state4_, out);
  }
  TORCH_CHECK(
      data.scalar_type() == at::kChar && data.sizes() == shape_,
      "QuantizedWeight: int8 data of shape ",
      at::IntArrayRef(shape_),
      " expected, got ",
      data.scalar_type(),
      " ",
      data.sizes());
  TORCH_CHECK(
      scb_.numel() == shape_[0],
      "QuantizedWeight: ",
      scb_.numel(),
      " row scales (SCB) for ",
      shape_[0],
      " rows");
  // bitsandbytes: CB in the target dtype times SCB / 127 (the row scale
  // rounded to the target dtype, then the product rounded once).
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (data.is_cuda() &&
      (out == at::kFloat || out == at::kHalf || out == at::kBFloat16)) {
    const c10::cuda::CUDAGuard guard(data.device());
    const auto q = data.contiguous();
    const auto scb = scb_.to(data.device(), at::kFloat).contiguous();
    auto y = at::empty(q.sizes(), q.options().dtype(out));
    kernels::cuda::check_launch(
        kernels::cuda::dequantize_int8(
            kernels::cuda::dtype_of(out, "dequantize_int8"),
            q.data_ptr<int8_t>(),
            scb.data_ptr<float>(),
            static_cast<float>(1.0 / 127.0), // as ATen takes the scalar
            q.size(0),
            q.size(1),
            y.data_ptr(),
            c10::cuda::getCurrentCUDAStream().stream()),
        "QuantizedWeight::dequantize",
        "the int8 kernel's launch");
    return y;
  }
#endif
  return data.to(out) *
      (scb_.to(data.device()).unsqueeze(1) * (1.0 / 127.0)).to(out);
}

at::Tensor QuantizedWeight::linear(const at::Tensor& x, const at::Tensor& data)
    const {
  TORCH_CHECK(
      x.size(-1) == shape_[1],
      "quantized linear: the input has ",
      x.size(-1),
      " features, the weight [",
      shape_[0],
      ", ",
      shape_[1],
      "] takes ",
      shape_[1]);
  return QuantizedMatmul::apply(x, data, shared_from_this());
}

void QuantizedWeight::to(const at::Device& device) {
  auto move = [&](at::Tensor& t) {
    if (t.defined()) {
      t = t.to(device);
    }
  };
  move(scb_);
  move(state4_.absmax);
  move(state4_.code);
  move(state4_.offset);
  move(state4_.state2_absmax);
  move(state4_.state2_code);
}

int64_t QuantizedWeight::state_nbytes() const {
  int64_t n = 0;
  for (const auto* t :
       {&scb_,
        &state4_.absmax,
        &state4_.code,
        &state4_.offset,
        &state4_.state2_absmax,
        &state4_.state2_code}) {
    if (t->defined()) {
      n += t->numel() * static_cast<int64_t>(t->element_size());
    }
  }
  return n;
}

} // namespace quantization
} // namespace colossalai
