// silu_mul (NOTE [Kernels]): the reference path, and the fused algorithm as
// an autograd Function that launches silu_mul.cu's kernels on a GPU and
// runs the same algorithm in ATen elsewhere.

#include <colossalai/kernels/silu_mul.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "cuda_launch.h"
#include "silu_mul_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace colossalai {
namespace kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor fused_forward(const at::Tensor& gate, const at::Tensor& up) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (gate.is_cuda()) {
    const c10::cuda::CUDAGuard guard(gate.device());
    auto out = at::empty_like(gate, at::MemoryFormat::Contiguous);
    cuda::check_launch(
        cuda::silu_mul_forward(
            cuda::dtype_of(gate.scalar_type(), "silu_mul"),
            gate.data_ptr(),
            up.data_ptr(),
            out.data_ptr(),
            gate.numel(),
            c10::cuda::getCurrentCUDAStream().stream()),
        "silu_mul",
        "the forward kernel's launch");
    return out;
  }
#endif
  const auto g = gate.to(at::kFloat);
  return (g * at::sigmoid(g) * up.to(at::kFloat)).to(gate.scalar_type());
}

std::pair<at::Tensor, at::Tensor> fused_backward(
    const at::Tensor& dout,
    const at::Tensor& gate,
    const at::Tensor& up) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (gate.is_cuda()) {
    const c10::cuda::CUDAGuard guard(gate.device());
    auto d_gate = at::empty_like(gate, at::MemoryFormat::Contiguous);
    auto d_up = at::empty_like(up, at::MemoryFormat::Contiguous);
    cuda::check_launch(
        cuda::silu_mul_backward(
            cuda::dtype_of(gate.scalar_type(), "silu_mul"),
            dout.data_ptr(),
            gate.data_ptr(),
            up.data_ptr(),
            d_gate.data_ptr(),
            d_up.data_ptr(),
            gate.numel(),
            c10::cuda::getCurrentCUDAStream().stream()),
        "silu_mul",
        "the backward kernel's launch");
    return {d_gate, d_up};
  }
#endif
  const auto type = gate.scalar_type();
  const auto d = dout.to(at::kFloat), x = gate.to(at::kFloat);
  const auto s = at::sigmoid(x);
  auto d_gate = (d * up.to(at::kFloat) * s * (1 + x * (1 - s))).to(type);
  auto d_up = (d * x * s).to(type);
  return {d_gate, d_up};
}

struct SiluMulFunction : torch::autograd::Function<SiluMulFunction> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& gate,
      const at::Tensor& up) {
    auto g = gate.contiguous(), u = up.contiguous();
    ctx->save_for_backward({g, u});
    return fused_forward(g, u);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto g = fused_backward(grads[0].contiguous(), saved[0], saved[1]);
    return {g.first, g.second};
  }
};

void check(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(
      gate.defined() && up.defined() && gate.sizes() == up.sizes() &&
          gate.scalar_type() == up.scalar_type() &&
          gate.device() == up.device() &&
          at::isFloatingType(gate.scalar_type()),
      "silu_mul: gate and up must be floating tensors of one shape, dtype and "
      "device, got ",
      gate.sizes(),
      " ",
      gate.scalar_type(),
      " on ",
      gate.device(),
      " and ",
      up.sizes(),
      " ",
      up.scalar_type(),
      " on ",
      up.device());
}

} // namespace

at::Tensor silu_mul_reference(const at::Tensor& gate, const at::Tensor& up) {
  return at::silu(gate) * up;
}

bool silu_mul_fused_applies(const at::Tensor& gate, const at::Tensor& up) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  const auto t = gate.scalar_type();
  return gate.defined() && up.defined() && gate.is_cuda() &&
      up.device() == gate.device() && up.scalar_type() == t &&
      gate.sizes() == up.sizes() &&
      (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
#else
  (void)gate;
  (void)up;
  return false;
#endif
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  if (silu_mul_fused_applies(gate, up)) {
    return SiluMulFunction::apply(gate, up);
  }
  return silu_mul_reference(gate, up);
}

namespace detail {
at::Tensor silu_mul_fused(const at::Tensor& gate, const at::Tensor& up) {
  check(gate, up);
  return SiluMulFunction::apply(gate, up);
}
} // namespace detail

} // namespace kernels
} // namespace colossalai
