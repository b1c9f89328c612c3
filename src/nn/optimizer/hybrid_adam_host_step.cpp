// HybridAdam's host (CPU) step path: runs the CPU kernel on each
// parameter, streaming offloaded states through files.

#include "hybrid_adam_internal.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <cstring>
#include <future>

namespace colossalai {
namespace nn {
namespace optimizer {

namespace detail {

// A state tensor as the kernel needs it: contiguous fp32 on the CPU.
torch::Tensor as_kernel_state(const torch::Tensor& t, int64_t numel) {
  TORCH_CHECK(
      t.numel() == numel,
      "HybridAdam: a state has ",
      t.numel(),
      " elements, its parameter ",
      numel);
  if (t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous()) {
    return t;
  }
  return t.to(at::kCPU, at::kFloat).contiguous();
}

void run_cpu_item(
    const detail::CpuItem& it,
    float* exp_avg,
    float* exp_avg_sq,
    const std::function<void(const torch::Tensor&)>& hook) {
  detail::AdamBuffers b;
  b.param = it.param.data_ptr<float>();
  b.grad = it.grad.data_ptr();
  b.grad_dtype = it.grad.scalar_type();
  b.exp_avg = exp_avg;
  b.exp_avg_sq = exp_avg_sq;
  if (it.working.defined()) {
    b.copy = it.working.data_ptr();
    b.copy_dtype = it.working.scalar_type();
  }
  b.numel = it.param.numel();
  detail::adam_update(b, it.scalars);
  if (it.target.defined()) {
    it.target.copy_(it.param.view(it.target.sizes()));
  }
  if (hook) {
    hook(it.target.defined() ? it.target : it.param);
  }
}

} // namespace detail

// Streams the offloaded parameters' states through the three slots while
// `rest` (the in-memory parameters) is updated during the first reads.
void HybridAdam::Impl::run_offloaded(
    std::vector<detail::CpuItem>& items,
    std::vector<detail::CpuItem>& rest) {
  const size_t n = items.size();
  if (n == 0) {
    for (auto& it : rest) {
      detail::run_cpu_item(
          it,
          it.state->exp_avg().data_ptr<float>(),
          it.state->exp_avg_sq().data_ptr<float>(),
          host_step_hook);
    }
    return;
  }
  if (!worker) {
    worker = std::make_unique<detail::SerialWorker>();
  }
  int64_t max_numel = 0;
  for (auto& it : items) {
    max_numel = std::max(max_numel, it.record->numel);
  }
  for (size_t k = 0; k < 3; ++k) {
    if (!slot_exp_avg[k].defined() || slot_exp_avg[k].numel() < max_numel) {
      // Jobs still queued hold their own reference to an old buffer.
      slot_exp_avg[k] = at::empty({max_numel}, at::kFloat);
      slot_exp_avg_sq[k] = at::empty({max_numel}, at::kFloat);
    }
  }

  struct Buffers {
    torch::Tensor exp_avg;
    torch::Tensor exp_avg_sq;
    bool from_state = false; // the state's own in-memory tensors
  };
  std::vector<Buffers> bufs(n);
  std::vector<std::future<void>> loads(n);
  std::vector<std::future<void>> writes;
  writes.reserve(n);
  // Jobs only hold copies, but a step must not return (or unwind) while
  // its jobs still run: the next one would race with them.
  auto drain = c10::make_scope_exit([&] {
    for (auto& f : loads) {
      if (f.valid()) {
        f.wait();
      }
    }
    for (auto& f : writes) {
      if (f.valid()) {
        f.wait();
      }
    }
  });

  auto submit_load = [&](size_t j) {
    const detail::CpuItem& it = items[j];
    const detail::Record& r = *it.record;
    if (it.state->exp_avg().defined() && it.state->exp_avg_sq().defined()) {
      // Loaded or fetched into memory since the last step: use as is, then
      // write out and release.
      bufs[j] = {
          detail::as_kernel_state(it.state->exp_avg(), r.numel),
          detail::as_kernel_state(it.state->exp_avg_sq(), r.numel),
          true};
      return;
    }
    const size_t k = j % 3;
    auto m = slot_exp_avg[k].narrow(0, 0, r.numel);
    auto v = slot_exp_avg_sq[k].narrow(0, 0, r.numel);
    bufs[j] = {m, v, false};
    const size_t bytes = static_cast<size_t>(r.numel) * sizeof(float);
    if (r.on_disk) {
      loads[j] = worker->submit(
          [m, v, bytes, pm = r.exp_avg_path, pv = r.exp_avg_sq_path] {
            detail::read_state_file(pm, m.data_ptr(), bytes);
            detail::read_state_file(pv, v.data_ptr(), bytes);
          });
    } else {
      loads[j] = worker->submit([m, v, bytes] {
        std::memset(m.data_ptr(), 0, bytes);
        std::memset(v.data_ptr(), 0, bytes);
      });
    }
  };

  submit_load(0);
  if (n > 1) {
    submit_load(1);
  }
  for (auto& it : rest) {
    detail::run_cpu_item(
        it,
        it.state->exp_avg().data_ptr<float>(),
        it.state->exp_avg_sq().data_ptr<float>(),
        host_step_hook);
  }
  for (size_t j = 0; j < n; ++j) {
    if (loads[j].valid()) {
      loads[j].get();
    }
    detail::run_cpu_item(
        items[j],
        bufs[j].exp_avg.data_ptr<float>(),
        bufs[j].exp_avg_sq.data_ptr<float>(),
        host_step_hook);
    const detail::Record& r = *items[j].record;
    const size_t bytes = static_cast<size_t>(r.numel) * sizeof(float);
    // Submitted before the read that reuses this slot (j + 3), so the
    // worker's order keeps the two apart.
    writes.push_back(worker->submit([m = bufs[j].exp_avg,
                                     v = bufs[j].exp_avg_sq,
                                     bytes,
                                     pm = r.exp_avg_path,
                                     pv = r.exp_avg_sq_path] {
      detail::write_state_file(pm, m.data_ptr(), bytes);
      detail::write_state_file(pv, v.data_ptr(), bytes);
    }));
    if (j + 2 < n) {
      submit_load(j + 2);
    }
  }
  for (auto& f : writes) {
    f.get();
  }
  for (size_t j = 0; j < n; ++j) {
    items[j].record->on_disk = true;
    if (bufs[j].from_state) {
      items[j].state->exp_avg(torch::Tensor());
      items[j].state->exp_avg_sq(torch::Tensor());
    }
  }
}

} // namespace optimizer
} // namespace nn
} // namespace colossalai
