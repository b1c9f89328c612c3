#pragma once

#include <colossalai/nn/optimizer/skips_step_on_device.h>
#include <colossalai/nn/optimizer/working_copies.h>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace colossalai {
namespace nn {
namespace optimizer {

/// Options of `HybridAdam` (and `CPUAdam`), with ColossalAI's names and
/// defaults. Every parameter group may carry its own; the two
/// `nvme_offload_*` options belong to the optimizer and are read from the
/// constructor's `defaults` only (a group that sets them differently is
/// rejected).
struct HybridAdamOptions
    : public torch::optim::OptimizerCloneableOptions<HybridAdamOptions> {
  HybridAdamOptions(double lr = 1e-3);
  TORCH_ARG(double, lr) = 1e-3;
  /// Divide the moments by 1 - beta^t (Adam's bias correction).
  TORCH_ARG(bool, bias_correction) = true;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  /// true: decoupled weight decay, p -= lr * weight_decay * p, as
  /// `torch::optim::AdamW`; false: weight_decay * p is added to the
  /// gradient (L2), as `torch::optim::Adam`.
  TORCH_ARG(bool, adamw_mode) = true;
  /// Share in [0, 1] of the optimizer states, by element count, kept in files
  /// under `nvme_offload_dir` and streamed through memory during `step()`.
  TORCH_ARG(double, nvme_offload_fraction) = 0;
  /// Existing writable directory for those files; "" is the system's
  /// temporary directory. Each optimizer uses (and removes) its own
  /// subdirectory in it.
  TORCH_ARG(std::string, nvme_offload_dir) = "";

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(
      const HybridAdamOptions& lhs,
      const HybridAdamOptions& rhs);
  ~HybridAdamOptions() override = default;
  double get_lr() const override;
  void set_lr(const double lr) override;
};

/// Per-parameter state. For a parameter whose state is offloaded the two
/// moments are undefined tensors between steps (the data is in its files);
/// `HybridAdam::fetch_offloaded_states()` brings them back into memory.
struct HybridAdamParamState
    : public torch::optim::OptimizerCloneableParamState<HybridAdamParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(
      const HybridAdamParamState& lhs,
      const HybridAdamParamState& rhs);
  ~HybridAdamParamState() override = default;
};

/// Vector instruction set of the CPU update.
enum class CpuAdamIsa { kAuto, kScalar, kAvx2, kAvx512 };

const char* to_string(CpuAdamIsa isa);

/// Whether this CPU can run `isa` (kAuto and kScalar always can).
bool cpu_adam_isa_supported(CpuAdamIsa isa);

/// The instruction set CPU updates use from now on, process-wide; kAuto
/// picks the best one the CPU supports. Meant for tests and benchmarks: all
/// of them give bit-identical results. Without a call, the environment
/// variable COLOSSALAI_CPU_ADAM_ISA (auto, scalar, avx2 or avx512) is read
/// once, at the first update. Throws if the CPU lacks `isa`.
void set_cpu_adam_isa(CpuAdamIsa isa);

/// The instruction set in use (never kAuto).
CpuAdamIsa cpu_adam_isa();

/// Adam / AdamW for parameters on the CPU (and, in CUDA builds, on GPUs),
/// as ColossalAI's `HybridAdam`. It is a plain `torch::optim::Optimizer`:
/// the update equals `torch::optim::AdamW` (adamw_mode) or
/// `torch::optim::Adam` (not adamw_mode) as LibTorch computes them in fp32,
/// with optional bias correction; amsgrad is not offered.
///
/// CPU parameters must be fp32 (the master copy); their gradients may be
/// fp32, bf16 or fp16. Each parameter is updated in one pass that reads
/// param, grad, exp_avg and exp_avg_sq and writes param, exp_avg and
/// exp_avg_sq, vectorized for AVX-512 or AVX2 (chosen at run time, see
/// `set_cpu_adam_isa`) and split over LibTorch's intra-op threads. GPU
/// parameters (fp32 too; gradients fp32, bf16 or fp16) take the AdamW
/// kernel (`kernels::adamw_step_`, one pass that also writes the working
/// copy) for AdamW with bias correction, LibTorch's fused Adam kernel
/// otherwise.
///
/// Working copies: `set_working_copy(master, working)` names a bf16 / fp16 /
/// fp32 tensor that the same pass overwrites with the updated parameter,
/// rounded to nearest even as `Tensor::to()` does. This is how a ZeRO plugin
/// is meant to use it: each rank registers its fp32 master shard as the
/// parameter, attaches the reduced (bf16 or fp32) gradient shard with
/// `master.mutable_grad() = grad_shard`, and registers its slice of the
/// flat bf16 model parameters as the working copy; `step()` then updates
/// the master shard and states and leaves the rounded shard in place, ready
/// to be all-gathered, without a separate conversion pass.
///
/// NVMe offload: with `nvme_offload_fraction` > 0 the states of the first
/// parameters (in group order, as ColossalAI chooses them) whose element
/// count fits in that share of the total live in two files each (exp_avg,
/// exp_avg_sq) and pass through three reusable buffers during `step()`: a
/// background thread reads the next parameter's states while the current
/// one is updated and writes finished ones back. Resident state for them is
/// bounded by 3 x 2 x 4 bytes x the largest offloaded parameter. Results
/// are bit-identical to keeping everything in memory. `save()` includes the
/// offloaded states.
///
/// Example:
/// \code
///   using colossalai::nn::optimizer::HybridAdam;
///   using colossalai::nn::optimizer::HybridAdamOptions;
///   HybridAdam optimizer(
///       model->parameters(),
///       HybridAdamOptions(1e-3).weight_decay(0.01));
///   loss.backward();
///   optimizer.step();
///   optimizer.zero_grad();
/// \endcode
class HybridAdam : public torch::optim::Optimizer,
                   public WorkingCopies,
                   public SkipsStepOnDevice {
 public:
  explicit HybridAdam(
      std::vector<torch::optim::OptimizerParamGroup> param_groups,
      HybridAdamOptions defaults = {});
  explicit HybridAdam(
      std::vector<torch::Tensor> params,
      HybridAdamOptions defaults = {});
  ~HybridAdam() override;
  HybridAdam(HybridAdam&&);

  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Both refused between step_ahead and step() (half a step).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Makes each step write the updated `param` into `working` (same element
  /// count, contiguous, on the same device, bf16 / fp16 / fp32). Replaces an
  /// earlier registration.
  void set_working_copy(const torch::Tensor& param, torch::Tensor working)
      override;
  void remove_working_copy(const torch::Tensor& param);
  /// The registered working copy, or an undefined tensor.
  torch::Tensor working_copy(const torch::Tensor& param) const;

  /// Called within step() after each host (CPU) parameter's update, on the
  /// stepping thread, in step order, with the parameter itself: lets the
  /// owner of host master shards start a shard's upload to the device while
  /// the host steps the others (ZeRO offload, Gemini). Null: none.
  void set_host_step_hook(std::function<void(const torch::Tensor&)> hook);

  /// NOTE [Host steps overlap the backward]
  /// Takes the coming step's update of `params` (host parameters of this
  /// optimizer whose gradients are final for it) now, on a background
  /// thread: the update waits for `ready()` (e.g. the gradients' copy to
  /// the host landing), then `then()` runs there (e.g. the updated shard's
  /// upload to the device). The next step() waits for these updates first
  /// and leaves their parameters out. They use each group's options as
  /// they are now: step() refuses a group whose options changed since.
  /// Parameters without a gradient are not part of the step. Where one of
  /// the others lies on a GPU, has no states yet (before its first step,
  /// which creates them) or keeps its states in files
  /// (nvme_offload_fraction), none is taken: all are left to step(). Not
  /// for a step a loss scaler may skip (skip_step_if). Returns the number
  /// of parameters taken. A plugin's `overlap_host_step` calls it as each shard's
  /// gradient reaches the host, so the host updates overlap the rest of
  /// the backward.
  size_t step_ahead(
      const std::vector<torch::Tensor>& params,
      std::function<void()> ready = nullptr,
      std::function<void()> then = nullptr);
  /// Waits for every update step_ahead queued; rethrows the first failure.
  void wait_ahead();
  /// Whether step_ahead took any parameter since the last step().
  bool stepped_ahead() const;
  /// Waits for every update step_ahead queued and forgets them: the next
  /// step() updates every parameter with a gradient again. For a step that
  /// will not come (a backward that raised midway), before states are
  /// loaded over it; the parameters keep the updates already made.
  void drop_ahead();

  /// Where every parameter with a gradient lies on one device: on the CPU
  /// (the host step reads the verdict there, for free), or on a GPU with
  /// bias correction on (the AdamW kernel's or ATen's fused update).
  bool skips_step_on_device() const override;
  void skip_step_if(at::Tensor found_inf) override;
  void undo_step_counts() override;

  /// Whether `param`'s states are kept in files (decided at its first step).
  bool is_offloaded(const torch::Tensor& param) const;
  /// The exp_avg and exp_avg_sq files of an offloaded parameter.
  std::vector<std::string> offload_files(const torch::Tensor& param) const;
  /// Elements whose states are offloaded.
  int64_t offloaded_numel() const;
  /// The directory holding this optimizer's files ("" without offload).
  std::string offload_dir() const;
  /// Reads every offloaded state into memory (into `state()`), e.g. before
  /// handing the states to code that reads them directly. The next `step()`
  /// writes them back out and releases them again.
  void fetch_offloaded_states();

 private:
  HybridAdam(
      std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> own,
      std::vector<torch::optim::OptimizerParamGroup>& param_groups,
      HybridAdamOptions defaults);

  struct Items;
  // Appends p's update to `items`: its state created and its step counted
  // (`counted`: recorded for undo_step_counts).
  void add_item(
      size_t group,
      const torch::Tensor& p,
      int64_t total_numel,
      bool counted,
      Items& items);
  // All parameters' elements where states may go to files, else 0.
  int64_t total_numel() const;
  const HybridAdamOptions& checked_options(size_t group) const;

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace optimizer
} // namespace nn
} // namespace colossalai
