// HybridParallelPlugin's pipeline: the stage split of a model, the
// micro-batches of a step and the schedule that runs them
// (NOTE [Hybrid pipeline]).

#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_model.h>
#include <colossalai/initialize.h>
#include <colossalai/lazy/lazy_init.h>
#include <colossalai/pipeline/schedule.h>
#include <colossalai/placement/gradients.h>
#include <colossalai/zero/low_level_optimizer.h>

#include <ATen/core/grad_mode.h>

#include "../../../utils/host_memory.h"
#include "../gather_wait_model.h"
#include "checkpoint_io.h"
#include "pipeline_guard.h"

#include <algorithm>
#include <set>
#include <unordered_set>

namespace colossalai {
namespace booster {
namespace plugin {

namespace {

constexpr const char* kPluginName = "HybridParallelPlugin";

} // namespace

std::set<std::string> HybridParallelPlugin::apply_pipeline(
    torch::nn::Module& module) {
  const int pp = options_.pp_size();
  const int64_t layers = policy_->num_pipeline_layers(module);
  TORCH_CHECK(
      layers > 0,
      kPluginName,
      ": pp_size ",
      pp,
      " needs a policy that splits the model into stages, and ",
      policy_->name(),
      " does not; pass a custom_policy that overrides num_pipeline_layers, "
      "held_layers and stage_forward");
  const bool zbv = options_.pp_style() == "zbv";
  stage_manager_ = std::make_shared<pipeline::PipelineStageManager>(
      pp_group_, options_.num_model_chunks(), zbv);
  const auto per_stage = stage_manager_->distribute_layers(
      layers, options_.num_layers_per_stage());
  auto modules = module.named_modules();
  std::set<std::string> held;
  chunk_layers_.clear();
  chunk_params_.assign(options_.num_model_chunks(), {});
  // The parameters (full name, tensor) of the layers a chunk holds.
  auto params_of = [&](const shardformer::StageLayers& layers) {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& name : policy_->held_layers(module, layers)) {
      auto* m = modules.find(name);
      TORCH_CHECK(
          m != nullptr,
          kPluginName,
          ": ",
          policy_->name(),
          ".held_layers names a module '",
          name,
          "' that the model does not have");
      for (const auto& p : (*m)->named_parameters(true)) {
        out.emplace_back(name + "." + p.key(), p.value());
      }
    }
    return out;
  };
  for (int c = 0; c < options_.num_model_chunks(); ++c) {
    chunk_layers_.push_back(stage_manager_->stage_layers(c, per_stage));
    std::set<std::string> mine;
    for (const auto& p : params_of(chunk_layers_[c])) {
      held.insert(p.first);
      if (mine.insert(p.first).second) {
        chunk_params_[c].push_back(p.second);
      }
    }
  }
  auto named = module.named_parameters(true);
  shared_params_.clear();
  for (const auto& name : policy_->shared_params(module)) {
    auto* p = named.find(name);
    TORCH_CHECK(
        p != nullptr,
        kPluginName,
        ": ",
        policy_->name(),
        ".shared_params names '",
        name,
        "' that the model does not have");
    if (held.count(name)) {
      shared_params_.push_back(*p);
    }
  }
  // Checkpoints: which stage writes each parameter and buffer
  // (release_other_parts makes these parts).
  const auto& st = state_;
  st->owner.clear();
  for (int s = pp - 1; s >= 0; --s) {
    for (int c = 0; c < options_.num_model_chunks(); ++c) {
      const auto layers = stage_manager_->stage_layers_of(s, c, per_stage);
      for (const auto& name : policy_->held_layers(module, layers)) {
        for (const auto& b : (*modules.find(name))->named_buffers(true)) {
          st->owner[name + "." + b.key()] = s; // the lowest stage wins
        }
      }
      for (const auto& p : params_of(layers)) {
        st->owner[p.first] = s;
      }
    }
  }
  for (const auto& item : named) {
    TORCH_CHECK(
        st->owner.count(item.key()),
        kPluginName,
        ": no pipeline stage holds parameter '",
        item.key(),
        "' (",
        policy_->name(),
        ".held_layers leaves it out)");
  }
  auto p2p = std::make_shared<pipeline::PipelineP2PCommunication>(
      pp_group_, options_.enable_metadata_cache());
  p2p->set_fp8_communication(options_.fp8_communication());
  schedule_ = std::make_shared<pipeline::PipelineSchedule>(
      stage_manager_,
      p2p,
      options_.pp_style(),
      options_.overlap_p2p(),
      options_.scheduler_nodes());
  return held;
}

void HybridParallelPlugin::sync_shared_grads() {
  if (shared_group_ == nullptr || shared_params_.empty()) {
    return;
  }
  std::vector<at::Tensor> grads;
  for (auto& p : shared_params_) {
    if (!p.grad().defined()) {
      p.mutable_grad() = at::zeros_like(p);
    }
    grads.push_back(p.mutable_grad());
  }
  // Gradients crossing between the first and last stages: FP8 with
  // fp8_communication.
  placement::sum_flat(grads, *shared_group_, options_.fp8_communication());
}

pipeline::PipelineOutput HybridParallelPlugin::execute_pipeline(
    const pipeline::DataIterator& data_iter,
    interface::ModelWrapper& model,
    const pipeline::PipelineCriterion& criterion,
    interface::OptimizerWrapper* optimizer,
    bool return_loss,
    bool return_outputs) {
  TORCH_CHECK(
      schedule_ != nullptr,
      kPluginName,
      ".execute_pipeline needs a model boosted with pp_size > 1");
  auto* guard = boosted_guard(model);
  TORCH_CHECK(
      guard != nullptr,
      kPluginName,
      ".execute_pipeline: pass the boosted model");
  auto* zero = boosted_zero(optimizer);
  // Under a NoGradGuard the schedule runs the forwards only (evaluation):
  // no optimizer is needed and no gradient is synchronised.
  const bool forward_only = !at::GradMode::is_enabled();
  TORCH_CHECK(
      forward_only || options_.zero_stage() == 0 || zero != nullptr,
      kPluginName,
      ".execute_pipeline: pass the boosted optimizer (ZeRO reduces the "
      "gradients into its buckets)");
  auto batch = data_iter();
  TORCH_CHECK(
      !batch.empty() && batch[0].defined() && batch[0].dim() >= 1,
      kPluginName,
      ".execute_pipeline: data_iter gave an empty batch");
  const int64_t n = batch[0].size(0);
  // An undefined tensor is an optional input left out (a packed batch's
  // attention_mask beside its position_ids): undefined in every micro-batch.
  for (const auto& t : batch) {
    TORCH_CHECK(
        !t.defined() || (t.dim() >= 1 && t.size(0) == n),
        kPluginName,
        ".execute_pipeline: every tensor of the batch must have ",
        n,
        " samples along dim 0");
  }
  int64_t m = options_.num_microbatches(), size = options_.microbatch_size();
  if (m > 0 && size > 0) {
    TORCH_CHECK(
        m * size == n,
        kPluginName,
        ": num_microbatches ",
        m,
        " x microbatch_size ",
        size,
        " != the batch's ",
        n,
        " samples");
  } else if (m > 0) {
    TORCH_CHECK(
        n % m == 0,
        kPluginName,
        ": a batch of ",
        n,
        " samples does not divide into num_microbatches ",
        m);
    size = n / m;
  } else {
    TORCH_CHECK(
        n % size == 0,
        kPluginName,
        ": a batch of ",
        n,
        " samples does not divide into micro-batches of microbatch_size ",
        size);
    m = n / size;
  }
  TORCH_CHECK(
      options_.pp_style() != "interleaved" || m % options_.pp_size() == 0,
      kPluginName,
      ": pp_style 'interleaved' needs num_microbatches (",
      m,
      ") to be a multiple of pp_size (",
      options_.pp_size(),
      ")");
  const auto device = current_device();
  std::vector<pipeline::Batch> micro(m);
  // Each micro-batch's share of the batch's loss items (tokens), counted
  // where the batch is, before it moves (NOTE [Token-mean losses]). None
  // when the policy cannot count one of them or nothing is counted: equal
  // weights.
  std::vector<double> weights;
  bool counted = true;
  double items = 0;
  for (int64_t i = 0; i < m; ++i) {
    pipeline::Batch slice;
    for (const auto& t : batch) {
      slice.push_back(t.defined() ? t.narrow(0, i * size, size) : t);
    }
    policy_->check_micro_batch(slice); // on every rank, before any transfer
    const int64_t n_i = policy_->loss_items(slice);
    counted = counted && n_i >= 0;
    weights.push_back(static_cast<double>(n_i));
    items += static_cast<double>(n_i);
    for (const auto& t : slice) {
      micro[i].push_back(
          t.defined() ? guard->prepare_input(utils::upload_async(t, device))
                      : at::Tensor());
    }
  }
  if (!counted || items <= 0) {
    weights.clear();
  }
  for (auto& w : weights) {
    w /= items;
  }

  // Data-parallel synchronisation once per step, after every micro-batch.
  auto* ddp = boosted_ddp(model);
  const bool sync = ddp != nullptr ? ddp->require_sync()
      : zero != nullptr            ? zero->require_sync()
                                   : true;
  auto set_sync = [&](bool on) {
    if (ddp != nullptr) {
      ddp->set_require_sync(on);
    }
    if (zero != nullptr) {
      zero->set_require_sync(on);
    }
  };
  set_sync(false);
  NoSyncGuard restore([&]() { set_sync(sync); });
  // The stages run past the wrappers: overlap_allgather's wait before the
  // forward (the blocks' own waits run in their forwards).
  if (auto* waits = interface::find_wrapper<detail::GatherWaitModel>(model)) {
    waits->before_forward();
  }
  auto module = model.unwrap();
  auto forward = [&](int chunk,
                     const pipeline::Batch& mb,
                     const at::Tensor& hidden) {
    detail::PipelineGuardModel::Scope scope(*guard);
    return policy_->stage_forward(*module, chunk_layers_[chunk], mb, hidden);
  };
  auto scale = [optimizer](const at::Tensor& loss) {
    return optimizer != nullptr ? optimizer->scale_loss(loss) : loss;
  };
  auto out = schedule_->forward_backward_step(
      micro,
      forward,
      chunk_params_,
      criterion,
      scale,
      return_loss,
      return_outputs,
      weights);
  if (!sync || forward_only) {
    // no_sync: gradients accumulate until a synchronised step; forward
    // only: there are none.
    return out;
  }
  set_sync(true);
  sync_shared_grads();
  if (ddp != nullptr) {
    ddp->sync_gradients();
  }
  if (zero != nullptr) {
    zero->sync_gradients();
  }
  return out;
}

} // namespace plugin
} // namespace booster
} // namespace colossalai
