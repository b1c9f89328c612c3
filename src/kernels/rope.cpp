// rope (NOTE [Kernels]): the reference path, and the fused algorithm as an
// autograd Function that launches rope.cu's kernel on a GPU and runs the
// same algorithm in ATen elsewhere.

#include <colossalai/kernels/rope.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "cuda_launch.h"
#include "rope_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace colossalai {
namespace kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A table [T, D] or [B, T, D] as [1 or B, T, 1, D], in float32.
at::Tensor broadcastable(const at::Tensor& table) {
  auto t = table.to(at::kFloat);
  return (t.dim() == 2 ? t.unsqueeze(0) : t).unsqueeze(2);
}

// The rotation (or, `inverse`, its transpose: the backward) of x.
at::Tensor rotate(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin,
    bool inverse) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
    cuda::check_launch(
        cuda::rope(
            cuda::dtype_of(x.scalar_type(), "rope"),
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            out.data_ptr(),
            x.size(0),
            x.size(1),
            x.size(2),
            x.size(3),
            cos.dim() == 3,
            inverse,
            c10::cuda::getCurrentCUDAStream().stream()),
        "rope",
        "the kernel's launch");
    return out;
  }
#endif
  const auto xf = x.to(at::kFloat).chunk(2, -1);
  const auto c = broadcastable(cos).chunk(2, -1);
  const auto s = broadcastable(sin).chunk(2, -1);
  at::Tensor first, second;
  if (inverse) {
    first = xf[0] * c[0] + xf[1] * s[1];
    second = xf[1] * c[1] - xf[0] * s[0];
  } else {
    first = xf[0] * c[0] - xf[1] * s[0];
    second = xf[1] * c[1] + xf[0] * s[1];
  }
  return at::cat({first, second}, -1).to(x.scalar_type());
}

struct RopeFunction : torch::autograd::Function<RopeFunction> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& cos,
      const at::Tensor& sin) {
    auto c = cos.contiguous(), s = sin.contiguous();
    ctx->save_for_backward({c, s});
    return rotate(x.contiguous(), c, s, /*inverse=*/false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {
        rotate(grads[0].contiguous(), saved[0], saved[1], /*inverse=*/true),
        at::Tensor(),
        at::Tensor()};
  }
};

// x [B, T, H, D] with D even, cos and sin [T, D] or [B, T, D] tables of
// its dtype and device.
bool shapes_match(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin) {
  return x.dim() == 4 && x.size(3) % 2 == 0 && cos.sizes() == sin.sizes() &&
      ((cos.dim() == 2 && cos.size(0) == x.size(1)) ||
       (cos.dim() == 3 && cos.size(0) == x.size(0) &&
        cos.size(1) == x.size(1))) &&
      cos.size(-1) == x.size(3) && cos.scalar_type() == x.scalar_type() &&
      sin.scalar_type() == x.scalar_type() && cos.device() == x.device() &&
      sin.device() == x.device();
}

void check(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(
      x.dim() == 4 && x.size(3) % 2 == 0,
      "rope: x must be [B, T, H, D] with D even, got ",
      x.sizes());
  TORCH_CHECK(
      shapes_match(x, cos, sin),
      "rope: cos and sin must be [T, D] or [B, T, D] tables of x's dtype and "
      "device for x ",
      x.sizes(),
      ", got ",
      cos.sizes(),
      " and ",
      sin.sizes());
}

} // namespace

at::Tensor rope_reference(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin) {
  auto c = (cos.dim() == 2 ? cos.unsqueeze(0) : cos).unsqueeze(2);
  auto s = (sin.dim() == 2 ? sin.unsqueeze(0) : sin).unsqueeze(2);
  auto halves = x.chunk(2, -1);
  return x * c + at::cat({-halves[1], halves[0]}, -1) * s;
}

bool rope_fused_applies(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  const auto t = x.scalar_type();
  return x.defined() && cos.defined() && sin.defined() && x.is_cuda() &&
      shapes_match(x, cos, sin) && x.is_contiguous() && cos.is_contiguous() &&
      sin.is_contiguous() &&
      (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
#else
  (void)x;
  (void)cos;
  (void)sin;
  return false;
#endif
}

at::Tensor rope(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin) {
  if (rope_fused_applies(x, cos, sin)) {
    return RopeFunction::apply(x, cos, sin);
  }
  return rope_reference(x, cos, sin);
}

namespace detail {
at::Tensor rope_fused(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin) {
  check(x, cos, sin);
  return RopeFunction::apply(x, cos, sin);
}
} // namespace detail

} // namespace kernels
} // namespace colossalai
