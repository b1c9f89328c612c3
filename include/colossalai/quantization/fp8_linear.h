#pragma once

/// FP8 linear layers (ColossalAI's `use_fp8`, `colossalai.quantization.fp8.
/// linear_fp8`): y = x W^T + b with both operands cast to e4m3 under one
/// float32 scale each (the tensor's largest magnitude lands on 448) and
/// multiplied by at::_scaled_mm, which accumulates in float32 and writes
/// the input's dtype. Backward casts the output's gradient to e5m2 (range
/// over precision) and takes both products from the saved FP8 operands:
/// dx = dy8 W8, dW = dy8^T x8. The bias and its gradient stay in the
/// input's dtype. Hopper and Ada GPUs multiply FP8 at twice bf16's rate,
/// and the saved activations take one byte per value instead of two.
///
/// Each operand then carries e4m3's relative rounding of at most 2^-4 (e5m2:
/// 2^-3) on top of the 16-bit training's own; ColossalAI and torchao train
/// with the same tensor-wise scales.
///
/// Only a 16-bit product with every size a multiple of 16 runs in FP8
/// (at::_scaled_mm's condition on a GPU); anything else is at::linear
/// unchanged, as in ColossalAI.
///
/// Plugins with `use_fp8` run the model's forward inside an `Fp8LinearScope`,
/// where `linear` (every layer of `shardformer::layer`, hence every model of
/// `colossalai::models`, the zoo GPT and LoRA's adapters) takes the FP8 path
/// for a weight that trains (requires grad): frozen and quantized bases stay
/// as they are, as ColossalAI rewrites only its trained parameters' linears.
/// LibTorch's own `torch::nn::Linear` computes inside its compiled forward,
/// where no scope reaches: call `linear` in a module's forward to take part.
/// Ops that form their own products stay 16-bit: the fused linear +
/// cross-entropy head, the opt-in MLP recomputation (gelu_linear,
/// silu_mul_linear), grouped expert GEMMs and ring layers.
///
/// Example:
/// \code
///   namespace q = colossalai::quantization;
///   auto y = q::linear_fp8(x.to(at::kBFloat16), w.to(at::kBFloat16), {});
///   {
///     q::Fp8LinearScope fp8;
///     auto z = q::linear(x, w, b); // linear_fp8 when w requires grad
///   }
/// \endcode

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace colossalai {
namespace quantization {

/// y = input W^T + bias through FP8 matmuls where `linear_fp8_applies`,
/// else at::linear. Needs LibTorch 2.1 (float8); on a GPU, compute
/// capability 8.9 or later and LibTorch 2.4 (at::_scaled_mm). The CPU
/// multiplies the same FP8 values in float32 (exact products, float32
/// sums, as the GPU's kernel): numerics to test against, not speed.
at::Tensor linear_fp8(
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& bias);

/// Whether linear_fp8 multiplies in FP8: input and weight of one 16-bit
/// dtype (bf16, fp16) on one device, the bias (if any) too, and the
/// input's rows, its features and the weight's rows all multiples of 16.
bool linear_fp8_applies(
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& bias);

/// at::linear(input, weight, bias), or linear_fp8 inside an Fp8LinearScope
/// when the weight trains (requires grad).
at::Tensor linear(
    const at::Tensor& input,
    const at::Tensor& weight,
    const at::Tensor& bias);

/// While alive, `linear` on this thread takes the FP8 path. Scopes nest;
/// activation checkpointing replays a block's forward under the scope (or
/// not) of its first run.
class Fp8LinearScope {
 public:
  explicit Fp8LinearScope(bool enabled = true);
  ~Fp8LinearScope();
  Fp8LinearScope(const Fp8LinearScope&) = delete;
  Fp8LinearScope& operator=(const Fp8LinearScope&) = delete;

 private:
  bool previous_;
};

/// Whether an Fp8LinearScope is active on this thread.
bool fp8_linear_enabled();

/// What `linear` did inside scopes in this process (any thread: a
/// recomputation in backward may run on autograd's device thread): the
/// calls, and those that ran in FP8. A plugin reads them around its first
/// forward to tell a model `use_fp8` cannot reach.
struct Fp8LinearCounts {
  int64_t calls = 0;
  int64_t fp8 = 0;
};
Fp8LinearCounts fp8_linear_counts();

namespace detail {
/// linear_fp8's cast of one operand (exposed for its tests): the FP8 values
/// (float8 dtype, row-major) and the float32 scalar they are multiplied
/// by, scaled so that the largest magnitude lands on the format's largest
/// finite value. `e4m3`: float8_e4m3fn, else float8_e5m2.
std::pair<at::Tensor, at::Tensor> fp8_linear_cast(
    const at::Tensor& x,
    bool e4m3);
} // namespace detail

} // namespace quantization
} // namespace colossalai
