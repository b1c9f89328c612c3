// FP8 linear layers (NOTE [FP8 linear] below; the header says what they
// compute).

#include <colossalai/quantization/fp8_linear.h>
#include <colossalai/utils/compat.h>

#include "../kernels/linear_dtype.h"

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "../kernels/cuda_launch.h"
#include "../kernels/fp8_cast_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cmath>

namespace colossalai {
namespace quantization {

// NOTE [FP8 linear]
// Each operand is cast under one scale, amax / 448 (e4m3) or amax / 57344
// (e5m2), computed on the device: no value is read back to the host, so a
// step stays free of synchronisations. A zero tensor keeps scale 1; an
// infinity makes its operand's scale 0 and its values NaN, so fp16's
// overflow check still sees it in the gradients.
//
// The forward keeps the FP8 operands, not the 16-bit ones: the input costs
// one byte per value until backward. Backward multiplies the e5m2 output
// gradient by them. Only the forward product uses Hopper's fast
// accumulation; both gradient products accumulate exactly in float32, as
// torchao does (ColossalAI uses it for all three).
//
// On a GPU, at::_scaled_mm takes `a` row-major and `b` column-major, so the
// weight's FP8 copy [out, in] serves the forward as its transposed view;
// the gradients need the transposed copies of the weight and of the input
// (one byte per value each). The CPU multiplies the same FP8 values in
// float32 (fp8_mm).

namespace {

thread_local bool fp8_enabled = false;
// Process-wide: a recomputation in backward runs on the autograd engine's
// thread for a GPU's tensors.
std::atomic<int64_t> linear_calls{0};
std::atomic<int64_t> fp8_calls{0};

struct Fp8Operand {
  at::Tensor values;    // float8
  at::Tensor scale_inv; // float32 scalar: what the values are multiplied by
};

Fp8Operand cast_tensorwise(const at::Tensor& x, bool e4m3) {
  const double largest = e4m3 ? 448.0 : 57344.0;
  // Three passes: the largest magnitude (a reduction, no |x| kept), the
  // scaling (a one-element, not zero-dimensional, scale makes the product
  // float32 as it reads x), the cast; on a GPU the last two are one kernel.
  // Row-major whatever the input's strides (a Conv1D weight's transposed
  // view), as the products take it.
  auto amax = at::linalg_vector_norm(x, INFINITY).to(at::kFloat).reshape({1});
  amax = at::where(amax > 0, amax, at::ones_like(amax));
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (x.is_cuda()) {
    // The scaling and the cast in one pass (fp8_cast.cu), the same bytes.
    const c10::cuda::CUDAGuard guard(x.device());
    const auto xc = x.contiguous();
    auto values =
        at::empty(xc.sizes(), xc.options().dtype(compat::float8_type(e4m3)));
    kernels::cuda::check_launch(
        kernels::cuda::scale_cast_fp8(
            kernels::cuda::dtype_of(xc.scalar_type(), "linear_fp8"),
            xc.data_ptr(),
            amax.data_ptr<float>(),
            static_cast<uint8_t*>(values.data_ptr()),
            xc.numel(),
            e4m3,
            c10::cuda::getCurrentCUDAStream().stream()),
        "linear_fp8",
        "the cast kernel's launch");
    return {values, (amax / largest).reshape({})};
  }
#endif
  return {
      (x * (largest / amax)).to(compat::float8_type(e4m3)).contiguous(),
      (amax / largest).reshape({})};
}

// (a * scale_a) @ (b * scale_b) + bias as `dtype`.
at::Tensor fp8_mm(
    const Fp8Operand& a,
    const Fp8Operand& b,
    const at::Tensor& bias,
    at::ScalarType dtype,
    bool fast_accum) {
  if (a.values.is_cuda()) {
    return compat::scaled_mm(
        a.values, b.values, a.scale_inv, b.scale_inv, bias, dtype, fast_accum);
  }
  // On the CPU, the same FP8 values multiplied in float32 (their products
  // are exact there, the sums float32's, as the kernel's): ATen's CPU
  // _scaled_mm, where a build has it, is a reference loop (420 s against
  // 0.03 s for a bf16 product of 256 x 2048 by 2048 x 8192 on one core).
  TORCH_INTERNAL_ASSERT(a.values.device().is_cpu());
  auto y = at::mm(a.values.to(at::kFloat), b.values.to(at::kFloat))
               .mul_(a.scale_inv * b.scale_inv);
  if (bias.defined()) {
    y.add_(bias.to(at::kFloat));
  }
  return y.to(dtype);
}

void check_runs_here(const at::Device& device) {
  TORCH_CHECK(
      compat::has_float8(),
      "linear_fp8: FP8 needs LibTorch 2.1 or later (this is ",
      TORCH_VERSION,
      "); turn use_fp8 off");
  TORCH_CHECK(
      !device.is_cuda() || compat::has_scaled_mm(device),
      "linear_fp8: FP8 matmuls need a GPU of compute capability 8.9 or later "
      "(Ada, Hopper) and LibTorch 2.4 or later; ",
      device,
      " is not one: turn use_fp8 off");
  TORCH_CHECK(
      device.is_cpu() || device.is_cuda(),
      "linear_fp8: runs on the CPU and on CUDA devices, not on ",
      device);
}

struct Fp8Linear : public torch::autograd::Function<Fp8Linear> {
  static at::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const at::Tensor& input,
      const at::Tensor& weight,
      const at::Tensor& bias_or_empty) {
    const at::Tensor bias = kernels::detail::bias_of(bias_or_empty);
    // The casts and products are this op's own: autocast must not touch
    // them (the emulation's float32 product above all).
    c10::impl::ExcludeDispatchKeyGuard no_autocast(
        c10::autocast_dispatch_keyset);
    const int64_t in = input.size(-1);
    const auto x = cast_tensorwise(input.reshape({-1, in}), /*e4m3=*/true);
    const auto w = cast_tensorwise(weight, /*e4m3=*/true);
    const Fp8Operand w_t{w.values.t(), w.scale_inv};
    auto y = fp8_mm(x, w_t, bias, input.scalar_type(), /*fast_accum=*/true);
    const bool need_x = input.requires_grad();
    const bool need_w = weight.requires_grad();
    // Only what the wanted gradients read: x8 for dW, W8 for dx.
    ctx->save_for_backward(
        {need_w ? x.values : at::Tensor(),
         x.scale_inv,
         need_x ? w.values : at::Tensor(),
         w.scale_inv});
    ctx->saved_data["need_x"] = need_x;
    ctx->saved_data["need_w"] = need_w;
    ctx->saved_data["need_b"] = bias.defined() && bias.requires_grad();
    auto shape = input.sizes().vec();
    shape.back() = weight.size(0);
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(
        c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const bool need_x = ctx->saved_data["need_x"].toBool();
    const bool need_w = ctx->saved_data["need_w"].toBool();
    const bool need_b = ctx->saved_data["need_b"].toBool();
    const auto dtype = grads[0].scalar_type();
    const int64_t out = grads[0].size(-1);
    const auto dy2 = grads[0].reshape({-1, out});
    at::Tensor dx, dw, db;
    if (need_x || need_w) {
      const auto dy = cast_tensorwise(dy2, /*e4m3=*/false);
      if (need_x) {
        const Fp8Operand w{saved[2].t().contiguous().t(), saved[3]};
        dx = fp8_mm(dy, w, {}, dtype, /*fast_accum=*/false);
        auto shape = grads[0].sizes().vec();
        shape.back() = w.values.size(1);
        dx = dx.view(shape);
      }
      if (need_w) {
        const Fp8Operand dy_t{dy.values.t().contiguous(), dy.scale_inv};
        const Fp8Operand x{saved[0].t().contiguous().t(), saved[1]};
        dw = fp8_mm(dy_t, x, {}, dtype, /*fast_accum=*/false);
      }
    }
    if (need_b) {
      db = dy2.sum(0);
    }
    return {dx, dw, db};
  }
};

c10::optional<at::Tensor> optional_bias(const at::Tensor& bias) {
  return bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt;
}

// The sizes linear_fp8 multiplies in FP8: rows, input and output features
// all multiples of 16.
bool sizes_allow_fp8(const at::Tensor& input, const at::Tensor& weight) {
  if (weight.dim() != 2 || input.dim() < 1) {
    return false;
  }
  const int64_t in = input.size(-1);
  const int64_t rows = in == 0 ? 0 : input.numel() / in;
  return in > 0 && rows > 0 && in % 16 == 0 && rows % 16 == 0 &&
      weight.size(1) == in && weight.size(0) > 0 && weight.size(0) % 16 == 0;
}

} // namespace

bool linear_fp8_applies(
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& bias) {
  const auto dtype = input.scalar_type();
  return (dtype == at::kBFloat16 || dtype == at::kHalf) &&
      weight.scalar_type() == dtype && weight.device() == input.device() &&
      (!bias.defined() ||
       (bias.scalar_type() == dtype && bias.device() == input.device())) &&
      sizes_allow_fp8(input, weight);
}

at::Tensor linear_fp8(
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& bias) {
  if (!linear_fp8_applies(input, weight, bias)) {
    return at::linear(input, weight, optional_bias(bias));
  }
  check_runs_here(input.device());
  return Fp8Linear::apply(
      input, weight, kernels::detail::bias_slot(bias, weight));
}

at::Tensor linear(
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& bias) {
  if (!fp8_enabled) {
    return at::linear(input, weight, optional_bias(bias));
  }
  linear_calls.fetch_add(1, std::memory_order_relaxed);
  // Sizes first: a product that stays 16-bit casts nothing here.
  if (!weight.requires_grad() || !sizes_allow_fp8(input, weight)) {
    return at::linear(input, weight, optional_bias(bias));
  }
  // Under autocast, the operands as autocast would hand them to the matmul.
  const auto cast = compat::autocast_dtype(input.device().type());
  auto x = input;
  auto w = weight;
  auto b = bias;
  if (cast && at::isFloatingType(input.scalar_type())) {
    x = input.to(*cast);
    w = weight.to(*cast);
    b = bias.defined() ? bias.to(*cast) : bias;
  }
  if (!linear_fp8_applies(x, w, b)) {
    return at::linear(input, weight, optional_bias(bias));
  }
  check_runs_here(x.device());
  fp8_calls.fetch_add(1, std::memory_order_relaxed);
  return Fp8Linear::apply(x, w, kernels::detail::bias_slot(b, w));
}

Fp8LinearScope::Fp8LinearScope(bool enabled) : previous_(fp8_enabled) {
  fp8_enabled = enabled;
}

Fp8LinearScope::~Fp8LinearScope() {
  fp8_enabled = previous_;
}

bool fp8_linear_enabled() {
  return fp8_enabled;
}

std::pair<at::Tensor, at::Tensor> detail::fp8_linear_cast(
    const at::Tensor& x,
    bool e4m3) {
  auto cast = cast_tensorwise(x, e4m3);
  return {cast.values, cast.scale_inv};
}

Fp8LinearCounts fp8_linear_counts() {
  Fp8LinearCounts c;
  c.calls = linear_calls.load(std::memory_order_relaxed);
  c.fp8 = fp8_calls.load(std::memory_order_relaxed);
  return c;
}

} // namespace quantization
} // namespace colossalai
