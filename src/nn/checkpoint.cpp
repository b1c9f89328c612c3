#include <colossalai/nn/checkpoint.h>
#include <colossalai/quantization/fp8_linear.h>
#include <colossalai/utils/compat.h>

#include <ATen/Context.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>
#include <torch/nn/module.h>

#include <algorithm>

namespace colossalai {
namespace nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Everything the recomputation needs, carried through the autograd context.
struct Replay : torch::CustomClassHolder {
  CheckpointFunction fn;
  torch::nn::Module* owner = nullptr;
  // Device default generators' states at the first run.
  std::vector<std::pair<at::Device, at::Tensor>> generators;
  // Restorers of the owner's own streams at the first run.
  std::vector<std::function<void()>> streams;
  c10::optional<at::ScalarType> autocast_cpu, autocast_cuda;
  bool fp8_linear = false; // inside a use_fp8 forward
};

std::vector<at::Device> devices_of(const std::vector<at::Tensor>& inputs) {
  std::vector<at::Device> out{at::Device(at::kCPU)};
  for (const auto& t : inputs) {
    if (t.defined() && t.is_cuda() &&
        std::find(out.begin(), out.end(), t.device()) == out.end()) {
      out.push_back(t.device());
    }
  }
  return out;
}

std::vector<std::pair<at::Device, at::Tensor>> generator_states(
    const std::vector<at::Device>& devices) {
  std::vector<std::pair<at::Device, at::Tensor>> out;
  for (const auto& d : devices) {
    TORCH_CHECK(
        !compat::stream_capturing(d),
        "checkpoint: activation checkpointing keeps the random generators' "
        "states for its recomputation, and a CUDA graph's capture cannot "
        "read them; capture a step without checkpointed blocks "
        "(gradient_checkpointing_ratio 0)");
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.emplace_back(d, gen.get_state());
  }
  return out;
}

void set_generator_states(
    const std::vector<std::pair<at::Device, at::Tensor>>& states) {
  for (const auto& s : states) {
    auto gen = at::globalContext().defaultGenerator(s.first);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(s.second);
  }
}

std::vector<std::function<void()>> stream_snapshots(torch::nn::Module* owner) {
  std::vector<std::function<void()>> out;
  if (owner == nullptr) {
    return out;
  }
  for (const auto& m : owner->modules(/*include_self=*/true)) {
    if (auto* r = dynamic_cast<RandomStateOwner*>(m.get())) {
      out.push_back(r->snapshot_random_state());
    }
  }
  return out;
}

// Depth of recomputations on this thread (the autograd engine runs a
// device's backward on a thread of its own; the flag lives there).
thread_local int recompute_depth = 0;

struct RecomputeScope {
  RecomputeScope() {
    ++recompute_depth;
  }
  ~RecomputeScope() {
    --recompute_depth;
  }
};

class CheckpointNode : public torch::autograd::Function<CheckpointNode> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      at::TensorList input_list,
      c10::intrusive_ptr<Replay> replay) {
    variable_list inputs = input_list.vec();
    ctx->save_for_backward(inputs);
    // Function::forward runs with grad mode off: nothing is saved.
    auto outputs = replay->fn(inputs);
    ctx->saved_data["replay"] = at::IValue::make_capsule(std::move(replay));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto inputs = ctx->get_saved_variables();
    auto holder = ctx->saved_data.at("replay").toCapsule();
    auto& replay = *static_cast<Replay*>(holder.get());
    std::vector<at::Tensor> detached;
    detached.reserve(inputs.size());
    for (const auto& t : inputs) {
      auto d = t.detach();
      d.requires_grad_(t.requires_grad());
      detached.push_back(std::move(d));
    }
    // Replay the first run's random streams, then put today's back.
    std::vector<at::Device> devices;
    for (const auto& g : replay.generators) {
      devices.push_back(g.first);
    }
    const auto now = generator_states(devices);
    const auto streams_now = stream_snapshots(replay.owner);
    set_generator_states(replay.generators);
    for (const auto& restore : replay.streams) {
      restore();
    }
    std::vector<at::Tensor> outputs;
    try {
      at::AutoGradMode grad(true);
      c10::optional<compat::AutocastGuard> cpu_cast, cuda_cast;
      if (replay.autocast_cpu) {
        cpu_cast.emplace(at::kCPU, *replay.autocast_cpu);
      }
      if (replay.autocast_cuda) {
        cuda_cast.emplace(at::kCUDA, *replay.autocast_cuda);
      }
      quantization::Fp8LinearScope fp8(replay.fp8_linear);
      RecomputeScope recomputing;
      outputs = replay.fn(detached);
    } catch (...) {
      set_generator_states(now);
      for (const auto& restore : streams_now) {
        restore();
      }
      throw;
    }
    set_generator_states(now);
    for (const auto& restore : streams_now) {
      restore();
    }
    TORCH_CHECK(
        outputs.size() == grads.size(),
        "checkpoint: the recomputation returned ",
        outputs.size(),
        " tensors, the first run ",
        grads.size());
    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() &&
          grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) {
      torch::autograd::backward(roots, root_grads);
    }
    variable_list result;
    result.reserve(detached.size() + 1);
    for (const auto& d : detached) {
      result.push_back(d.requires_grad() ? d.grad() : at::Tensor());
    }
    result.emplace_back(); // the Replay argument
    return result;
  }
};

} // namespace

bool in_checkpoint_recompute() {
  return recompute_depth > 0;
}

std::vector<at::Tensor> checkpoint(
    const CheckpointFunction& fn,
    const std::vector<at::Tensor>& inputs,
    torch::nn::Module* owner) {
  TORCH_CHECK(fn, "checkpoint: the function is empty");
  if (!at::GradMode::is_enabled()) {
    return fn(inputs); // nothing to recompute for
  }
  auto replay = c10::make_intrusive<Replay>();
  replay->fn = fn;
  replay->owner = owner;
  replay->generators = generator_states(devices_of(inputs));
  replay->streams = stream_snapshots(owner);
  replay->autocast_cpu = compat::autocast_dtype(at::kCPU);
  replay->autocast_cuda = compat::autocast_dtype(at::kCUDA);
  replay->fp8_linear = quantization::fp8_linear_enabled();
  // The recomputation reaches the parameters inside `fn` only through an
  // input that requires grad. Where none does (a frozen embedding's output
  // under LoRA), the first floating input is marked, as transformers'
  // enable_input_require_grads does; its gradient goes nowhere.
  auto args = inputs;
  const bool any = std::any_of(args.begin(), args.end(), [](const auto& t) {
    return t.defined() && t.requires_grad();
  });
  for (size_t i = 0; !any && i < args.size(); ++i) {
    if (args[i].defined() && at::isFloatingType(args[i].scalar_type())) {
      args[i] = args[i].detach().requires_grad_(true);
      break;
    }
  }
  // A TensorList, not a vector: only that is taken as autograd inputs.
  return CheckpointNode::apply(at::TensorList(args), std::move(replay));
}

at::Tensor checkpoint(
    const std::function<at::Tensor(const at::Tensor&)>& fn,
    const at::Tensor& input,
    torch::nn::Module* owner) {
  TORCH_CHECK(fn, "checkpoint: the function is empty");
  return checkpoint(
      // By value: backward calls it after this frame is gone.
      [fn](const std::vector<at::Tensor>& xs) {
        return std::vector<at::Tensor>{fn(xs[0])};
      },
      {input},
      owner)[0];
}

} // namespace nn
} // namespace colossalai
