#pragma once

// HybridAdam's internals shared by its source files: the offload
// bookkeeping, the step paths' work items and HybridAdam::Impl.

#include <colossalai/nn/optimizer/hybrid_adam.h>

#include "cpu_adam_kernel.h"
#include "state_offload.h"

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <system_error>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace colossalai {
namespace nn {
namespace optimizer {
namespace detail {

// A parameter's offload bookkeeping.
struct Record {
  bool offload = false;
  int64_t numel = 0;
  std::string exp_avg_path;
  std::string exp_avg_sq_path;
  // The files hold the current states.
  bool on_disk = false;
};

struct CpuItem {
  torch::Tensor param;   // contiguous fp32: the parameter or a copy of it
  torch::Tensor target;  // the parameter, when `param` is a copy
  torch::Tensor grad;    // contiguous
  torch::Tensor working; // undefined: none
  HybridAdamParamState* state = nullptr;
  Record* record = nullptr;
  detail::AdamScalars scalars;
};

// A state tensor as the kernel needs it: contiguous fp32 on the CPU.
torch::Tensor as_kernel_state(const torch::Tensor& t, int64_t numel);

// Updates one host parameter with the given state buffers, then calls
// `hook` (if any) with the parameter.
void run_cpu_item(
    const CpuItem& it,
    float* exp_avg,
    float* exp_avg_sq,
    const std::function<void(const torch::Tensor&)>& hook);

#ifdef COLOSSALAI_WITH_CUDA
struct DeviceItem {
  torch::Tensor param;
  torch::Tensor grad; // fp32, or bf16 / fp16 (converted as the update goes)
  torch::Tensor working;
  HybridAdamParamState* state = nullptr;
  detail::AdamScalars scalars;
  const HybridAdamOptions* options = nullptr; // the parameter's group's
  bool done = false; // updated (and its working copy written) already
};

// GPU parameters: LibTorch's fused Adam / AdamW kernel where it has one and
// bias correction is on; otherwise the same arithmetic as the CPU kernel as
// multi-tensor (_foreach) ATen ops, with per-parameter constants as scalar
// lists.
// `found_inf`: undefined, or a loss scaler's verdict on the items' device
// that, where 1, leaves them as they are (the kernels read it there; the
// multi-tensor ops' items, where any, have it read on the host).
void device_update(
    std::vector<DeviceItem>& items,
    const torch::Tensor& found_inf = torch::Tensor());
#endif

} // namespace detail

// One step's work: host parameters with states in memory, with states in
// files, and device parameters.
struct HybridAdam::Items {
  std::vector<detail::CpuItem> resident;
  std::vector<detail::CpuItem> offloaded;
#ifdef COLOSSALAI_WITH_CUDA
  std::vector<detail::DeviceItem> device;
#endif
};

struct HybridAdam::Impl {
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> working;
  std::function<void(const torch::Tensor&)> host_step_hook;
  // SkipsStepOnDevice: the next step's verdict; the parameters whose step
  // counts the last step given one advanced.
  torch::Tensor found_inf;
  std::vector<torch::Tensor> stepped;

  double fraction = 0;
  std::string dir; // this optimizer's own subdirectory
  int64_t offloaded_numel = 0;
  int64_t next_file = 0;
  std::unordered_map<const c10::TensorImpl*, detail::Record> records;
  std::unique_ptr<detail::SerialWorker> worker;
  // Three buffers: the parameter being updated, the next one being read,
  // the previous one being written back.
  std::array<torch::Tensor, 3> slot_exp_avg;
  std::array<torch::Tensor, 3> slot_exp_avg_sq;

  // Updates queued by step_ahead (NOTE [Host steps overlap the backward]):
  // their parameters, the options each group had then, the jobs.
  std::unordered_set<const c10::TensorImpl*> ahead;
  std::unordered_map<size_t, std::unique_ptr<HybridAdamOptions>>
      ahead_options;
  std::unique_ptr<detail::SerialWorker> ahead_worker;
  std::vector<std::future<void>> ahead_jobs;

  ~Impl() {
    ahead_worker.reset(); // finishes queued updates while their states live
    worker.reset(); // finishes pending writes before the files go
    if (!dir.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  }

  // Decides, once per parameter, whether its states live in files: the
  // first parameters that fit in the offload share, as ColossalAI does.
  detail::Record& record_for(const torch::Tensor& p, int64_t total_numel) {
    auto [it, inserted] = records.try_emplace(p.unsafeGetTensorImpl());
    detail::Record& r = it->second;
    if (inserted) {
      r.numel = p.numel();
      const auto budget =
          static_cast<int64_t>(static_cast<double>(total_numel) * fraction);
      if (fraction > 0 && p.is_cpu() && offloaded_numel + r.numel <= budget) {
        r.offload = true;
        offloaded_numel += r.numel;
        const auto stem =
            (std::filesystem::path(dir) / std::to_string(next_file++)).string();
        r.exp_avg_path = stem + ".exp_avg.bin";
        r.exp_avg_sq_path = stem + ".exp_avg_sq.bin";
      }
    }
    return r;
  }

  void run_offloaded(
      std::vector<detail::CpuItem>& items,
      std::vector<detail::CpuItem>& rest);
};

} // namespace optimizer
} // namespace nn
} // namespace colossalai
