// adamw_step_ (NOTE [Kernels]): the reference path in ATen ops, and the
// multi-tensor kernel's launch on a GPU (adamw.cu).

#include <colossalai/kernels/adamw.h>

#include <colossalai/utils/compat.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <vector>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "adamw_cuda.h"
#include "cuda_launch.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace colossalai {
namespace kernels {

namespace {

// torch.optim.AdamW's bias-corrected scalars at `step`, in double.
struct Corrections {
  double step_size;             // lr / (1 - beta1^step)
  double bias_correction2_sqrt; // sqrt(1 - beta2^step)
};

Corrections corrections(const AdamWStepOptions& o, int64_t step) {
  const double s = static_cast<double>(step);
  return {
      o.lr() / (1.0 - std::pow(o.beta1(), s)),
      std::sqrt(1.0 - std::pow(o.beta2(), s))};
}

// found_inf, where given: one float32 element on the parameters' device.
void check_found_inf(const at::Tensor& found_inf, at::TensorList params) {
  if (!found_inf.defined()) {
    return;
  }
  TORCH_CHECK(
      found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat &&
          (params.empty() || found_inf.device() == params[0].device()),
      "adamw_step_: found_inf must be one float32 element on the "
      "parameters' device, got shape ",
      found_inf.sizes(),
      " ",
      found_inf.scalar_type(),
      " on ",
      found_inf.device());
}

bool kernel_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// The same checks on both paths: a call the kernel would refuse fails on
// the CPU too.
void check(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList working,
    at::ArrayRef<int64_t> steps) {
  const size_t n = params.size();
  TORCH_CHECK(
      grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
          steps.size() == n && (working.empty() || working.size() == n),
      "adamw_step_: one gradient, exp_avg, exp_avg_sq and step per parameter "
      "(and no working copies or one per parameter), got ",
      n,
      " parameters, ",
      grads.size(),
      " gradients, ",
      exp_avgs.size(),
      " exp_avgs, ",
      exp_avg_sqs.size(),
      " exp_avg_sqs, ",
      steps.size(),
      " steps, ",
      working.size(),
      " working copies");
  if (n == 0) {
    return;
  }
  const auto device = params[0].device();
  const auto grad_dtype = grads[0].scalar_type();
  c10::optional<at::ScalarType> working_dtype;
  for (size_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    auto same = [&](const at::Tensor& t, const char* what) {
      TORCH_CHECK(
          t.defined() && t.numel() == p.numel() && t.device() == device &&
              t.is_contiguous(),
          "adamw_step_: ",
          what,
          " ",
          i,
          " must be a contiguous tensor of ",
          p.numel(),
          " elements on ",
          device);
    };
    TORCH_CHECK(
        p.defined() && p.scalar_type() == at::kFloat && p.device() == device &&
            p.is_contiguous(),
        "adamw_step_: parameter ",
        i,
        " must be a contiguous float32 tensor (the master) on ",
        device);
    same(grads[i], "gradient");
    same(exp_avgs[i], "exp_avg");
    same(exp_avg_sqs[i], "exp_avg_sq");
    TORCH_CHECK(
        grads[i].scalar_type() == grad_dtype && kernel_dtype(grad_dtype),
        "adamw_step_: the gradients must share one dtype of float32, float16 "
        "or bfloat16; gradient ",
        i,
        " is ",
        grads[i].scalar_type(),
        ", gradient 0 ",
        grad_dtype);
    TORCH_CHECK(
        exp_avgs[i].scalar_type() == at::kFloat &&
            exp_avg_sqs[i].scalar_type() == at::kFloat,
        "adamw_step_: the moments must be float32 (parameter ",
        i,
        ")");
    TORCH_CHECK(
        steps[i] >= 1,
        "adamw_step_: step ",
        i,
        " must be >= 1, got ",
        steps[i]);
    if (!working.empty() && working[i].defined()) {
      same(working[i], "working copy");
      const auto t = working[i].scalar_type();
      TORCH_CHECK(
          kernel_dtype(t) && t == working_dtype.value_or(t),
          "adamw_step_: the working copies must share one dtype of float32, "
          "float16 or bfloat16; copy ",
          i,
          " is ",
          t);
      working_dtype = t;
    }
  }
}

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
// The kernel's two tables for one step, built on the host.
struct Tables {
  std::vector<cuda::AdamWTensor> tensors;
  std::vector<cuda::AdamWBlock> blocks;
  at::ScalarType working_dtype = at::kFloat;

  size_t tensor_bytes() const {
    return tensors.size() * sizeof(cuda::AdamWTensor);
  }
  size_t bytes() const {
    return tensor_bytes() + blocks.size() * sizeof(cuda::AdamWBlock);
  }
};

Tables tables(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList working,
    at::ArrayRef<int64_t> steps,
    const AdamWStepOptions& o) {
  Tables out;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t numel = params[i].numel();
    if (numel == 0) {
      continue;
    }
    const bool copy = !working.empty() && working[i].defined();
    if (copy) {
      out.working_dtype = working[i].scalar_type();
    }
    const auto c = corrections(o, steps[i]); // rounded once, to float
    cuda::AdamWTensor t{};
    t.param = params[i].data_ptr<float>();
    t.grad = grads[i].data_ptr();
    t.exp_avg = exp_avgs[i].data_ptr<float>();
    t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    t.working = copy ? working[i].data_ptr() : nullptr;
    t.numel = numel;
    t.decay = static_cast<float>(1.0 - o.lr() * o.weight_decay());
    t.step_size = static_cast<float>(c.step_size);
    t.bias_correction2_sqrt = static_cast<float>(c.bias_correction2_sqrt);
    const int64_t chunks = (numel + cuda::kAdamWChunk - 1) / cuda::kAdamWChunk;
    TORCH_CHECK(
        chunks <= INT32_MAX && out.tensors.size() < INT32_MAX,
        "adamw_step_: tensor ",
        i,
        " has too many elements for one launch");
    for (int64_t c = 0; c < chunks; ++c) {
      out.blocks.push_back(
          {static_cast<int32_t>(out.tensors.size()), static_cast<int32_t>(c)});
    }
    out.tensors.push_back(t);
  }
  return out;
}

// Both tables in one pinned buffer and one asynchronous copy, into `into`
// where given (of t.bytes() bytes), else into a new device tensor. ATen's
// pinned allocator keeps the buffer until the copy has run.
at::Tensor upload_tables(const Tables& t, at::Device device, at::Tensor into) {
  auto host = at::empty(
      {static_cast<int64_t>(t.bytes())},
      at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* bytes = host.data_ptr<uint8_t>();
  std::memcpy(bytes, t.tensors.data(), t.tensor_bytes());
  std::memcpy(
      bytes + t.tensor_bytes(),
      t.blocks.data(),
      t.bytes() - t.tensor_bytes());
  if (!into.defined()) {
    return host.to(device, /*non_blocking=*/true);
  }
  TORCH_INTERNAL_ASSERT(into.numel() == static_cast<int64_t>(t.bytes()));
  into.copy_(host, /*non_blocking=*/true);
  return into;
}

// The kernel over the tables in `table` (device memory, as upload_tables
// wrote them) on the current stream.
void launch_tables(
    const at::Tensor& table,
    size_t num_tensors,
    size_t num_blocks,
    at::ScalarType grad_dtype,
    at::ScalarType working_dtype,
    const AdamWStepOptions& o,
    const at::Tensor& found_inf) {
  const auto* base = table.data_ptr<uint8_t>();
  cuda::check_launch(
      cuda::adamw_step(
          cuda::dtype_of(grad_dtype, "adamw_step_"),
          cuda::dtype_of(working_dtype, "adamw_step_"),
          reinterpret_cast<const cuda::AdamWTensor*>(base),
          reinterpret_cast<const cuda::AdamWBlock*>(
              base + num_tensors * sizeof(cuda::AdamWTensor)),
          static_cast<int64_t>(num_blocks),
          static_cast<float>(1.0 - o.beta1()),
          static_cast<float>(o.beta2()),
          static_cast<float>(1.0 - o.beta2()),
          static_cast<float>(o.eps()),
          found_inf.defined() ? found_inf.data_ptr<float>() : nullptr,
          c10::cuda::getCurrentCUDAStream().stream()),
      "adamw_step_",
      "the AdamW kernel's launch");
}

void fused(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList working,
    at::ArrayRef<int64_t> steps,
    const AdamWStepOptions& o,
    const at::Tensor& found_inf) {
  const auto device = params[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const auto t =
      tables(params, grads, exp_avgs, exp_avg_sqs, working, steps, o);
  if (t.blocks.empty()) {
    return;
  }
  const auto table = upload_tables(t, device, at::Tensor());
  launch_tables(
      table,
      t.tensors.size(),
      t.blocks.size(),
      grads[0].scalar_type(),
      t.working_dtype,
      o,
      found_inf);
}
#endif

} // namespace

void adamw_step_reference_(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList working,
    at::ArrayRef<int64_t> steps,
    const AdamWStepOptions& o,
    const at::Tensor& found_inf) {
  check(params, grads, exp_avgs, exp_avg_sqs, working, steps);
  check_found_inf(found_inf, params);
  // Read on the host: on the CPU a plain load, on a GPU (where the kernel
  // is not built) a wait.
  if (found_inf.defined() &&
      (found_inf.is_cpu() ? *found_inf.data_ptr<float>()
                          : found_inf.item<float>()) != 0.0f) {
    return;
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    auto p = params[i].view({-1});
    auto m = exp_avgs[i].view({-1});
    auto v = exp_avg_sqs[i].view({-1});
    const auto g = grads[i].reshape({-1}).to(at::kFloat);
    const auto c = corrections(o, steps[i]);
    p.mul_(1.0 - o.lr() * o.weight_decay());
    m.lerp_(g, 1.0 - o.beta1());
    v.mul_(o.beta2()).addcmul_(g, g, 1.0 - o.beta2());
    const auto denom = (v.sqrt() / c.bias_correction2_sqrt).add_(o.eps());
    p.addcdiv_(m, denom, -c.step_size);
    if (!working.empty() && working[i].defined()) {
      working[i].view({-1}).copy_(p);
    }
  }
}

void adamw_step_(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList working,
    at::ArrayRef<int64_t> steps,
    const AdamWStepOptions& options,
    const at::Tensor& found_inf) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (adamw_step_fused_applies(params, grads, working)) {
    check(params, grads, exp_avgs, exp_avg_sqs, working, steps);
    check_found_inf(found_inf, params);
    at::NoGradGuard no_grad;
    fused(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        working,
        steps,
        options,
        found_inf.defined() ? found_inf.contiguous() : found_inf);
    return;
  }
#endif
  adamw_step_reference_(
      params, grads, exp_avgs, exp_avg_sqs, working, steps, options, found_inf);
}

bool adamw_step_fused_applies(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList working) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (params.empty() || !params[0].defined() || !params[0].is_cuda()) {
    return false;
  }
  const auto device = params[0].device();
  auto on = [&](at::TensorList ts) {
    for (const auto& t : ts) {
      if (t.defined() && t.device() != device) {
        return false;
      }
    }
    return true;
  };
  return on(params) && on(grads) && on(working);
#else
  (void)params;
  (void)grads;
  (void)working;
  return false;
#endif
}

struct AdamWStepGraph::Impl {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, working;
  AdamWStepOptions fixed; // beta1, beta2, eps: the launch's arguments
  bool fused = false;
  // The reference path's last upload.
  std::vector<int64_t> steps;
  AdamWStepOptions options;
  bool uploaded = false;
  // The fused path: the device tables every replay reads.
  at::Tensor table;
  size_t num_tensors = 0, num_blocks = 0;
  at::ScalarType working_dtype = at::kFloat;
};

AdamWStepGraph::AdamWStepGraph(
    std::vector<at::Tensor> params,
    std::vector<at::Tensor> grads,
    std::vector<at::Tensor> exp_avgs,
    std::vector<at::Tensor> exp_avg_sqs,
    std::vector<at::Tensor> working,
    const AdamWStepOptions& options,
    at::Tensor table)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  check(
      params,
      grads,
      exp_avgs,
      exp_avg_sqs,
      working,
      std::vector<int64_t>(params.size(), 1));
  m.params = std::move(params);
  m.grads = std::move(grads);
  m.exp_avgs = std::move(exp_avgs);
  m.exp_avg_sqs = std::move(exp_avg_sqs);
  m.working = std::move(working);
  m.fixed = options;
  m.options = options;
  m.fused = adamw_step_fused_applies(m.params, m.grads, m.working);
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (m.fused) {
    // Sizes only (as tables() lays them out): the contents come with each
    // upload.
    for (size_t i = 0; i < m.params.size(); ++i) {
      const int64_t numel = m.params[i].numel();
      if (numel > 0) {
        ++m.num_tensors;
        m.num_blocks += static_cast<size_t>(
            (numel + cuda::kAdamWChunk - 1) / cuda::kAdamWChunk);
      }
      if (!m.working.empty() && m.working[i].defined()) {
        m.working_dtype = m.working[i].scalar_type(); // one dtype: check()
      }
    }
    const auto bytes = table_bytes(m.params);
    if (table.defined()) {
      TORCH_CHECK(
          table.scalar_type() == at::kByte && table.is_contiguous() &&
              table.device() == m.params[0].device() && table.numel() >= bytes,
          "AdamWStepGraph: the table must be a contiguous uint8 tensor of at "
          "least ",
          bytes,
          " bytes on ",
          m.params[0].device());
      m.table = table.narrow(0, 0, bytes);
    } else {
      m.table = at::empty({bytes}, m.params[0].options().dtype(at::kByte));
    }
  }
#endif
  (void)table;
}

int64_t AdamWStepGraph::table_bytes(at::TensorList params) {
  int64_t bytes = 0;
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  for (const auto& p : params) {
    const int64_t numel = p.numel();
    if (numel > 0) {
      const int64_t chunks = (numel + cuda::kAdamWChunk - 1) / cuda::kAdamWChunk;
      bytes += static_cast<int64_t>(sizeof(cuda::AdamWTensor)) +
          chunks * static_cast<int64_t>(sizeof(cuda::AdamWBlock));
    }
  }
#else
  (void)params;
#endif
  return bytes;
}

AdamWStepGraph::~AdamWStepGraph() = default;

void AdamWStepGraph::upload(
    at::ArrayRef<int64_t> steps,
    const AdamWStepOptions& options) {
  auto& m = *impl_;
  TORCH_CHECK(
      options.beta1() == m.fixed.beta1() && options.beta2() == m.fixed.beta2() &&
          options.eps() == m.fixed.eps(),
      "AdamWStepGraph: beta1, beta2 and eps are the captured launch's "
      "arguments (",
      m.fixed.beta1(),
      ", ",
      m.fixed.beta2(),
      ", ",
      m.fixed.eps(),
      "); a step with ",
      options.beta1(),
      ", ",
      options.beta2(),
      ", ",
      options.eps(),
      " needs a new capture");
  check(m.params, m.grads, m.exp_avgs, m.exp_avg_sqs, m.working, steps);
  if (!m.fused) {
    m.steps.assign(steps.begin(), steps.end());
    m.options = options;
    m.uploaded = true;
    return;
  }
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  const auto device = m.params[0].device();
  TORCH_CHECK(
      !compat::stream_capturing(device),
      "AdamWStepGraph::upload: the step's scalars are written between "
      "replays, not inside a capture");
  const c10::cuda::CUDAGuard guard(device);
  upload_tables(
      tables(
          m.params,
          m.grads,
          m.exp_avgs,
          m.exp_avg_sqs,
          m.working,
          steps,
          options),
      device,
      m.table);
  m.uploaded = true;
#endif
}

void AdamWStepGraph::launch(const at::Tensor& found_inf) {
  auto& m = *impl_;
  if (!m.fused) {
    TORCH_CHECK(m.uploaded, "AdamWStepGraph::launch: no step uploaded yet");
    adamw_step_reference_(
        m.params,
        m.grads,
        m.exp_avgs,
        m.exp_avg_sqs,
        m.working,
        m.steps,
        m.options,
        found_inf);
    return;
  }
  check_found_inf(found_inf, m.params);
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  // Inside a capture the table is written before the first replay.
  if (m.num_blocks == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(m.params[0].device());
  launch_tables(
      m.table,
      m.num_tensors,
      m.num_blocks,
      m.grads[0].scalar_type(),
      m.working_dtype,
      m.fixed,
      found_inf);
#endif
}

} // namespace kernels
} // namespace colossalai
