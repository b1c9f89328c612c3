#pragma once
// Helpers of the tests that train the zoo's transformers under the hybrid
// plugin against one process.

#include <colossalai/booster/booster.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/shardformer/policy.h>
#include <harness/test_util.h>

#include <torch/nn/module.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>

namespace colossalai {
namespace testing {

/// One execute_pipeline over the batch (x, y), with the model's own loss.
template <class Boosted, class Model>
pipeline::PipelineOutput pipeline_step(
    booster::Booster& booster,
    Boosted& boosted,
    Model& model,
    const at::Tensor& x,
    const at::Tensor& y) {
  return booster.execute_pipeline(
      [&] {
        return pipeline::Batch{x, y};
      },
      boosted.model,
      [&](const at::Tensor& logits, const pipeline::Batch& mb) {
        return model->loss(logits, mb[1]);
      },
      boosted.optimizer.get());
}

/// An optimizer whose step raises while `*raising`, before it updates
/// anything, as a failed allocation would (NOTE [A step that raised]).
template <class O>
struct RaisingStep : O {
  template <class... A>
  explicit RaisingStep(const bool* raising, A&&... a)
      : O(std::forward<A>(a)...), raising_(raising) {}
  at::Tensor step(
      torch::optim::Optimizer::LossClosure closure = nullptr) override {
    TORCH_CHECK(!*raising_, "a step raised");
    return O::step(std::move(closure));
  }
  const bool* raising_;
};

/// SGD with momentum or AdamW (the two optimizers every equality test runs);
/// with `raising_step`, one whose step raises while `*raising_step`.
inline std::shared_ptr<torch::optim::Optimizer> make_optimizer(
    const std::vector<at::Tensor>& params,
    bool sgd,
    const bool* raising_step = nullptr) {
  if (sgd) {
    const auto o = torch::optim::SGDOptions(0.1).momentum(0.9);
    if (raising_step != nullptr) {
      return std::make_shared<RaisingStep<torch::optim::SGD>>(
          raising_step, params, o);
    }
    return std::make_shared<torch::optim::SGD>(params, o);
  }
  const auto o = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  if (raising_step != nullptr) {
    return std::make_shared<RaisingStep<torch::optim::AdamW>>(
        raising_step, params, o);
  }
  return std::make_shared<torch::optim::AdamW>(params, o);
}

/// The largest elementwise difference between two lists of tensors.
inline double max_abs_diff(
    const std::vector<at::Tensor>& a,
    const std::vector<at::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, (host(a[i]) - host(b[i])).abs().max().item<double>());
  }
  return d;
}

/// Whole tensors of a (possibly tensor-split) model, by name; parameters
/// released by a pipeline split (no elements) are left out. Collective
/// over each split parameter's group.
inline std::map<std::string, at::Tensor> whole_weights(
    torch::nn::Module& model,
    const shardformer::ShardInfo& info) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model.named_parameters()) {
    auto t = item.value().detach().to(at::kFloat).contiguous();
    if (t.numel() == 0) {
      continue;
    }
    auto it = info.specs.find(item.key());
    if (it != info.specs.end() && it->second.size() > 1) {
      const auto& spec = it->second;
      auto flat = at::empty({spec.size() * t.numel()}, t.options());
      distributed::all_gather(flat, t.view({-1}), *spec.group).wait();
      std::vector<int64_t> shape{spec.size()};
      shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
      auto parts = flat.view(shape).unbind(0);
      t = shardformer::layer::unshard_tensor(
          std::vector<at::Tensor>(parts.begin(), parts.end()), spec);
    }
    out[item.key()] = host(t).clone(); // references live on the CPU
  }
  return out;
}

/// One process training a zoo causal LM on `steps` global batches
/// (`batch(step)` -> {ids, targets}); `max_norm` > 0 clips as
/// torch.nn.utils.clip_grad_norm_. The losses and the final weights.
template <class Model, class BatchFn>
std::pair<std::vector<double>, std::map<std::string, at::Tensor>>
train_one_process(
    Model model,
    int steps,
    bool sgd,
    double max_norm,
    const BatchFn& batch) {
  auto opt = make_optimizer(model->parameters(), sgd);
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    auto b = batch(step);
    opt->zero_grad();
    at::Tensor loss = model->loss(model->forward(b.first), b.second);
    loss.backward();
    if (max_norm > 0) {
      torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);
    }
    opt->step();
    losses.push_back(loss.item<double>());
  }
  return {losses, whole_weights(*model, shardformer::ShardInfo())};
}

} // namespace testing
} // namespace colossalai
