#pragma once

/// AdamW's update over float32 master weights, with each master's copy in
/// the working dtype written by the same pass (NOTE [Kernels]).
///
/// Mixed precision as ColossalAI trains (bf16 / fp16 parameters, float32
/// masters in the optimizer) steps the masters and then casts them into the
/// parameters: a second pass over the masters after the optimizer's. Here
/// one CUDA kernel (multi-tensor: one launch for every tensor of the call)
/// reads each master, gradient and moment once and writes the master, the
/// moments and the rounded copy. The update is torch.optim.AdamW's
/// (decoupled weight decay, no amsgrad, no maximize), its bias corrections
/// taken in double on the host for each tensor's step.
///
/// Example:
/// \code
///   namespace k = colossalai::kernels;
///   k::adamw_step_(masters, grads, exp_avgs, exp_avg_sqs, bf16_weights,
///                  steps, k::AdamWStepOptions().lr(3e-4).weight_decay(0.1));
/// \endcode

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace colossalai {
namespace kernels {

struct AdamWStepOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, beta1) = 0.9;
  TORCH_ARG(double, beta2) = 0.999;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
};

/// One AdamW step: `params` (float32, updated in place), their `grads`
/// (float32, float16 or bfloat16, one dtype), `exp_avgs` and `exp_avg_sqs`
/// (float32, updated), `steps` (each tensor's step count including this
/// step, >= 1) and `working`: empty, or one tensor per parameter (undefined
/// for none) of the parameter's number of elements in one dtype (float32,
/// float16 or bfloat16) that receives the updated parameter rounded to it.
/// Every tensor contiguous, all on one device. `found_inf`: undefined, or a
/// float32 one-element tensor on that device which, where nonzero, makes
/// the step change nothing (a loss scaler's overflow verdict: the kernel
/// reads it on the device, the reference on the host). The fused kernel
/// runs where adamw_step_fused_applies, the reference elsewhere.
void adamw_step_(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList working,
    at::ArrayRef<int64_t> steps,
    const AdamWStepOptions& options,
    const at::Tensor& found_inf = at::Tensor());

/// The reference: torch.optim.AdamW's single-tensor update in ATen ops,
/// then each working copy's copy_ of its parameter.
void adamw_step_reference_(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList working,
    at::ArrayRef<int64_t> steps,
    const AdamWStepOptions& options,
    const at::Tensor& found_inf = at::Tensor());

/// Whether adamw_step_ runs the fused kernel for these tensors: a build
/// with CUDA kernels and every tensor on one CUDA device.
bool adamw_step_fused_applies(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList working);

/// adamw_step_ split for a step captured in a CUDA graph
/// (booster::GraphedStep). A replayed graph repeats the launches it
/// recorded with the arguments they had, so what changes from step to step
/// (the step counts' bias corrections, the learning rate) must reach the
/// kernel through device memory the host rewrites between replays: the
/// constructor fixes the tensors (their addresses are the graph's), upload()
/// writes one step's scalars on the current stream, outside the capture,
/// and launch() is the update the capture records. beta1, beta2 and eps are
/// the launch's arguments: fixed by the constructor's options. Where the
/// fused kernel does not apply (adamw_step_fused_applies), launch() runs the
/// reference with the last upload's steps and options, so both halves are
/// exercised without a GPU.
///
/// Example:
/// \code
///   k::AdamWStepGraph step(masters, grads, m, v, copies, options);
///   graph.capture_begin(); /* ... */ step.launch(); graph.capture_end();
///   for (...) { step.upload(steps, options.lr(next_lr)); graph.replay(); }
/// \endcode
class AdamWStepGraph {
 public:
  /// `table`: device memory of at least table_bytes(params) bytes for the
  /// scalars the host rewrites, allocated before the capture (memory a
  /// capture allocates may be handed to another of its kernels, which a
  /// replay would then write over the host's values); undefined: allocated
  /// here, for use outside a capture.
  AdamWStepGraph(
      std::vector<at::Tensor> params,
      std::vector<at::Tensor> grads,
      std::vector<at::Tensor> exp_avgs,
      std::vector<at::Tensor> exp_avg_sqs,
      std::vector<at::Tensor> working,
      const AdamWStepOptions& options,
      at::Tensor table = at::Tensor());
  /// Bytes of the device table for these parameters (0 in builds without
  /// the CUDA kernels).
  static int64_t table_bytes(at::TensorList params);
  ~AdamWStepGraph();
  AdamWStepGraph(const AdamWStepGraph&) = delete;
  AdamWStepGraph& operator=(const AdamWStepGraph&) = delete;

  /// The next launch's step counts (one per parameter, >= 1) and learning
  /// rate and weight decay; beta1, beta2 and eps must be the constructor's.
  void upload(at::ArrayRef<int64_t> steps, const AdamWStepOptions& options);
  /// One update with the last upload's scalars; `found_inf` as
  /// adamw_step_'s (a capture records its address).
  void launch(const at::Tensor& found_inf = at::Tensor());

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace kernels
} // namespace colossalai
