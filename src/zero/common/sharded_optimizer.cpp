#include <colossalai/checkpoint_io/optimizer_state.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/nn/optimizer/skips_step_on_device.h>
#include <colossalai/utils/compat.h>
#include <colossalai/zero/sharded_optimizer.h>

#include "../../distributed/raised_backward.h"
#include "flat_params.h"

#include <colossalai/placement/gradients.h>

#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <exception>
#include <unordered_map>
#include <unordered_set>

namespace colossalai {
namespace zero {

using detail::FlatParams;

ShardedOptimizer::ShardedOptimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer,
    ShardedOptimizerOptions options)
    : interface::OptimizerWrapper(std::move(optimizer)), options_(options) {
  TORCH_CHECK(
      options_.max_norm() >= 0,
      "max_norm must be >= 0 (0 disables clipping), got ",
      options_.max_norm());
  TORCH_CHECK(
      options_.norm_type() > 0,
      "norm_type must be positive, got ",
      options_.norm_type());
  if (options_.loss_scaler()) {
    scaler_ = std::make_unique<amp::DynamicLossScaler>(*options_.loss_scaler());
  }
}

ShardedOptimizer::~ShardedOptimizer() = default;

void ShardedOptimizer::shard_param_groups(
    const std::string& plugin,
    std::vector<FlatParams*> groups,
    distributed::ProcessGroupPtr group,
    const std::vector<at::Tensor>& unsharded) {
  TORCH_CHECK(
      optim_->state().empty(),
      plugin,
      ": boost the optimizer before its first step");
  groups_ = std::move(groups);
  group_ = std::move(group);
  std::unordered_map<const void*, at::Tensor> piece_of;
  for (auto* g : groups_) {
    for (size_t i = 0; i < g->params.size(); ++i) {
      piece_of.emplace(g->params[i].unsafeGetTensorImpl(), g->pieces[i]);
    }
  }
  std::unordered_set<const void*> whole;
  for (const auto& p : unsharded) {
    whole.insert(p.unsafeGetTensorImpl());
  }
  for (auto& g : optim_->param_groups()) {
    for (auto& p : g.params()) {
      auto it = piece_of.find(p.unsafeGetTensorImpl());
      if (it != piece_of.end()) {
        p = it->second;
        continue;
      }
      TORCH_CHECK(
          whole.count(p.unsafeGetTensorImpl()),
          plugin,
          ": the optimizer holds a parameter (shape ",
          p.sizes(),
          ") that is not in the boosted model");
    }
  }
}

double ShardedOptimizer::loss_scale() const {
  return scaler_ ? scaler_->scale() : 1.0;
}

void ShardedOptimizer::backward(const at::Tensor& loss, bool retain) {
  TORCH_CHECK(
      loss.numel() == 1,
      "backward: the loss must be a scalar, got shape ",
      loss.sizes());
  try {
    scale_loss(loss).backward({}, retain);
  } catch (...) {
    // NOTE [Host steps overlap the backward]: nothing may go on updating
    // or uploading in the background behind the caller's back.
    settle_raised_steps_ahead();
    throw;
  }
}

at::Tensor ShardedOptimizer::scale_loss(const at::Tensor& loss) {
  return scaler_ ? scaler_->scale_loss(loss) : loss;
}

namespace {

// The device every one of `tensors` lies on, if they share one.
c10::optional<at::Device> one_device(const std::vector<at::Tensor>& tensors) {
  c10::optional<at::Device> device;
  for (const auto& t : tensors) {
    if (!t.defined() || (device.has_value() && t.device() != *device)) {
      return c10::nullopt;
    }
    device = t.device();
  }
  return device;
}

} // namespace

void ShardedOptimizer::unscale() {
  if (!scaler_ || unscaled_) {
    return;
  }
  unscaled_ = true;
  const auto grads = shard_grads();
  const auto device = one_device(grads);
  if (scaler_->on_device() && device.has_value()) {
    local_found_inf_ =
        amp::unscale_and_check_(grads, scaler_->inv_scale_tensor(*device));
    return;
  }
  // The verdict is taken before a clip changes the gradients (a clip by
  // value would make an inf finite), as PyTorch's GradScaler.unscale_
  // takes it. Gradients on several devices (host shards) with the scale
  // on a device read it back: their step reads the verdict anyway.
  local_found_inf_ = amp::any_non_finite(grads);
  scale_grads(1.0 / scaler_->scale());
}

void ShardedOptimizer::scale_grads(double factor) {
  for (auto* g : groups_) {
    g->shard_grad.mul_(factor);
  }
}

std::vector<at::Tensor> ShardedOptimizer::shard_grads() const {
  std::vector<at::Tensor> grads;
  for (auto* g : groups_) {
    grads.push_back(g->shard_grad);
  }
  return grads;
}

bool ShardedOptimizer::overflow() {
  TORCH_INTERNAL_ASSERT(local_found_inf_.defined(), "overflow before unscale");
  return agreed_overflow(local_found_inf_).item<float>() > 0;
}

at::Tensor ShardedOptimizer::agreed_overflow(at::Tensor flag) {
  // Shards differ per rank: every rank skips if any saw inf/nan. The flag
  // moves to the group's device (NCCL takes no host tensors; offloaded
  // shards live on the host).
  flag = flag.reshape({1});
  if (group_ != nullptr && group_->size() > 1) {
    flag = flag.to(group_->device());
    distributed::all_reduce(flag, *group_, distributed::ReduceOp::kMax).wait();
  }
  // Tensor ranks and stages hold other parameters: all of them skip
  // together.
  if (placement_ != nullptr) {
    for (const auto* g : placement_->reduction_groups()) {
      flag = flag.to(g->device());
      distributed::all_reduce(flag, *g, distributed::ReduceOp::kMax).wait();
    }
  }
  return flag;
}

nn::optimizer::SkipsStepOnDevice* ShardedOptimizer::skipping_on_device() {
  auto* skipping =
      dynamic_cast<nn::optimizer::SkipsStepOnDevice*>(optim_.get());
  if (skipping == nullptr || !skipping->skips_step_on_device()) {
    return nullptr;
  }
  // Every gradient the optimizer steps (pieces and whole parameters) and
  // every group the verdict is agreed over on one device: the flag never
  // moves between host and device. The verdict is the shards'.
  std::vector<at::Tensor> grads = shard_grads();
  if (grads.empty()) {
    return nullptr;
  }
  for (const auto& group : optim_->param_groups()) {
    for (const auto& p : group.params()) {
      if (p.grad().defined()) {
        grads.push_back(p.grad());
      }
    }
  }
  const auto device = one_device(grads);
  if (!device.has_value() ||
      (group_ != nullptr && group_->size() > 1 &&
       group_->device() != *device)) {
    return nullptr;
  }
  if (placement_ != nullptr) {
    for (const auto* g : placement_->reduction_groups()) {
      if (g->device() != *device) {
        return nullptr;
      }
    }
  }
  return skipping;
}

void ShardedOptimizer::set_graph_mode(bool on) {
  synchronize_step();
  verdict_.reset_capture();
  interface::OptimizerWrapper::set_graph_mode(on);
}

void ShardedOptimizer::prepare_graph_step() {
  synchronize_step(); // the previous replay's verdict: waits for it
  interface::OptimizerWrapper::prepare_graph_step();
}

void ShardedOptimizer::after_graph_replay() {
  verdict_.after_replay();
}

void ShardedOptimizer::synchronize_step() {
  if (const auto skipped = verdict_.settle(*optim_)) {
    skipped_ = *skipped;
  }
}

void ShardedOptimizer::set_placement(
    std::shared_ptr<const placement::PlacementTable> table) {
  placement_ = std::move(table);
}

namespace {

// The parameters and the gradients of this rank's pieces of them, in flat
// order (pieces of no elements left out).
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> pieces_of(
    const std::vector<detail::FlatParams*>& groups) {
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> out;
  for (auto* g : groups) {
    for (size_t i = 0; i < g->params.size(); ++i) {
      if (g->pieces[i].numel() > 0) {
        out.first.push_back(g->params[i]);
        out.second.push_back(g->pieces[i].mutable_grad());
      }
    }
  }
  return out;
}

} // namespace

void ShardedOptimizer::sum_partial_grads() {
  if (placement_ == nullptr || !placement_->has_partial() || partials_summed_) {
    return;
  }
  partials_summed_ = true; // once per step, whoever asks first
  // Every tensor rank has the same flat layout, so the pieces line up.
  auto pieces = pieces_of(groups_);
  placement::sum_partial_grads(*placement_, pieces.first, pieces.second);
  for (auto* g : groups_) {
    g->grad_is_zero = false; // other ranks' partials may have landed
  }
}

double ShardedOptimizer::global_norm(double norm_type) {
  // Shards are disjoint: the global norm combines every rank's partials.
  if (placement_ == nullptr || placement_->reduction_groups().empty()) {
    return interface::total_norm(shard_grads(), norm_type, group_.get());
  }
  auto pieces = pieces_of(groups_);
  return placement::global_grad_norm(
      *placement_, pieces.first, pieces.second, norm_type, group_.get());
}

at::Tensor ShardedOptimizer::global_norm_on_device(double norm_type) {
  if (one_rank()) {
    return interface::total_norm_tensor(shard_grads(), norm_type);
  }
  if (placement_ == nullptr || placement_->reduction_groups().empty()) {
    std::vector<const distributed::ProcessGroup*> groups;
    if (group_ != nullptr) {
      groups.push_back(group_.get());
    }
    return interface::total_norm_on_device(shard_grads(), norm_type, groups);
  }
  auto pieces = pieces_of(groups_);
  return placement::global_grad_norm_on_device(
      *placement_, pieces.first, pieces.second, norm_type, group_.get());
}

void ShardedOptimizer::step() {
  distributed::detail::guard_step([this] {
    synchronize_step();
    published_during_step_ = 0;
    sum_partial_grads();
    if (scaler_ != nullptr) {
      if (auto* skipping = skipping_on_device()) {
        step_skipping_on_device(*skipping);
        return;
      }
    }
    unscale();
    skipped_ = scaler_ != nullptr && overflow();
    if (!skipped_) {
      if (options_.max_norm() > 0) {
        // Clipped by a coefficient that stays on the device: a step with
        // max_norm reads nothing back (and a CUDA graph may capture it).
        interface::scale_by_clip_coef(
            shard_grads(),
            global_norm_on_device(options_.norm_type()),
            options_.max_norm());
      }
      step_optimizer();
      after_step();
    }
    if (scaler_) {
      scaler_->update(skipped_);
    }
    unscaled_ = false;
    partials_summed_ = false;
    local_found_inf_ = at::Tensor();
  });
}

void ShardedOptimizer::step_skipping_on_device(
    nn::optimizer::SkipsStepOnDevice& skipping) {
  // The scale moves to the gradients' device on the first such step;
  // from then on the verdict, the clip and the scale's update stay there.
  const auto device = shard_grads().front().device();
  const bool capturing = compat::stream_capturing(device);
  TORCH_CHECK(
      !capturing || scaler_->lives_on(device),
      "a captured fp16 step needs an eager step first (the loss scale "
      "moves to the device there)");
  if (!scaler_->on_device()) {
    scaler_->scale_tensor(device);
  }
  unscale();
  const auto found_inf = agreed_overflow(local_found_inf_).reshape({});
  if (options_.max_norm() > 0) {
    // An overflowing step's norm is inf or nan, and so its gradients
    // become; the kernel skips them with the same verdict.
    interface::scale_by_clip_coef(
        shard_grads(),
        global_norm_on_device(options_.norm_type()),
        options_.max_norm());
  }
  skipping.skip_step_if(found_inf);
  step_optimizer();
  after_step(); // a skipped step publishes the weights it left as they were
  scaler_->update(found_inf);
  verdict_.record(found_inf);
  unscaled_ = false;
  partials_summed_ = false;
  local_found_inf_ = at::Tensor();
}

void ShardedOptimizer::step_optimizer() {
  auto* hybrid = dynamic_cast<nn::optimizer::HybridAdam*>(optim_.get());
  if (hybrid == nullptr || !publishes_during_step()) {
    optim_->step();
    return;
  }
  // Host pieces HybridAdam will step (those with a gradient), per group.
  std::unordered_map<const c10::TensorImpl*, size_t> group_of;
  std::vector<size_t> left(groups_.size(), 0);
  for (size_t k = 0; k < groups_.size(); ++k) {
    for (const auto& piece : groups_[k]->pieces) {
      if (piece.is_cpu() && piece.grad().defined()) {
        group_of.emplace(piece.unsafeGetTensorImpl(), k);
        ++left[k];
      }
    }
  }
  if (group_of.empty()) {
    optim_->step();
    return;
  }
  // A failed upload must not leave the optimizer's step half done: it is
  // kept, the step goes on (after_step publishes that group), and it is
  // raised once the step is complete.
  std::exception_ptr failed;
  hybrid->set_host_step_hook([&](const at::Tensor& param) {
    const auto it = group_of.find(param.unsafeGetTensorImpl());
    if (failed || it == group_of.end() || --left[it->second] != 0) {
      return;
    }
    try {
      if (group_stepped_on_host(it->second)) {
        ++published_during_step_;
      }
    } catch (...) {
      failed = std::current_exception();
    }
  });
  {
    const auto unhook =
        c10::make_scope_exit([hybrid] { hybrid->set_host_step_hook(nullptr); });
    optim_->step();
  }
  if (failed) {
    std::rethrow_exception(failed);
  }
}

std::string ShardedOptimizer::sharded_graph_blocker(
    const std::string& plugin) const {
  if (scaler_ &&
      dynamic_cast<const nn::optimizer::SkipsStepOnDevice*>(optim_.get()) ==
          nullptr) {
    return plugin +
        " with fp16 reads the loss scaler's overflow verdict on the host "
        "before the step, unless the optimizer skips an overflowing step "
        "on the device (nn::optimizer::FusedAdamW, FusedAdam); or take "
        "precision bf16 or fp32";
  }
  if (group_ != nullptr && group_->size() > 1) {
    return plugin + " over " + std::to_string(group_->size()) +
        " ranks: a captured step runs at one rank (the collectives are not "
        "captured)";
  }
  if (placement_ != nullptr) {
    return plugin +
        " with tensor or pipeline parallelism: a captured step runs at one "
        "rank";
  }
  return std::string();
}

std::shared_ptr<nn::optimizer::HybridAdam> ShardedOptimizer::
    host_step_ahead_optimizer(
        const std::string& plugin,
        std::shared_ptr<detail::StepsAhead> ahead) {
  auto hybrid = std::dynamic_pointer_cast<nn::optimizer::HybridAdam>(optim_);
  TORCH_CHECK(
      hybrid != nullptr,
      plugin,
      ": overlap_host_step updates the host shards during the backward with "
      "HybridAdam (colossalai::nn::optimizer::HybridAdam); got another "
      "optimizer. Use HybridAdam or turn overlap_host_step off");
  TORCH_CHECK(
      options_.max_norm() == 0,
      plugin,
      ": overlap_host_step updates each host shard before the backward "
      "ends, and max_norm ",
      options_.max_norm(),
      " clips by the global gradient norm, known only then. Set max_norm 0 "
      "or turn overlap_host_step off");
  TORCH_CHECK(
      scaler_ == nullptr,
      plugin,
      ": overlap_host_step updates each host shard before the backward "
      "ends, and fp16 loss scaling skips a step whose gradients overflowed, "
      "known only then. Use precision bf16 or fp32, or turn "
      "overlap_host_step off");
  TORCH_INTERNAL_ASSERT(ahead != nullptr);
  steps_ahead_ = std::move(ahead);
  return hybrid;
}

std::vector<size_t> ShardedOptimizer::finish_steps_ahead(
    const at::Device& device) {
  groups_stepped_ahead_ = 0;
  auto* hybrid = dynamic_cast<nn::optimizer::HybridAdam*>(optim_.get());
  if (hybrid == nullptr || steps_ahead_ == nullptr ||
      !steps_ahead_->pending()) {
    return {};
  }
  auto& ahead = *steps_ahead_;
  TORCH_CHECK(!ahead.raised(), "step(): ", detail::kRaisedBackwardAhead);
  const auto clear = c10::make_scope_exit([&ahead] { ahead.clear(); });
  hybrid->wait_ahead();
  groups_stepped_ahead_ = static_cast<int64_t>(ahead.count());
  return ahead.finish(device);
}

void ShardedOptimizer::check_none_stepped_ahead(const char* what) const {
  TORCH_CHECK(
      steps_ahead_ == nullptr || !steps_ahead_->raised(),
      what,
      ": ",
      detail::kRaisedBackwardAhead);
  const auto* hybrid =
      dynamic_cast<const nn::optimizer::HybridAdam*>(optim_.get());
  TORCH_CHECK(
      hybrid == nullptr || !hybrid->stepped_ahead(),
      what,
      ": between the backward and step() with overlap_host_step, whose "
      "host shards were already updated with the gradients as they were; "
      "call it before the backward's end (e.g. zero_grad before the "
      "forward), or turn overlap_host_step off");
}

void ShardedOptimizer::settle_raised_steps_ahead() {
  if (steps_ahead_ == nullptr || !steps_ahead_->raised()) {
    return;
  }
  auto* hybrid = dynamic_cast<nn::optimizer::HybridAdam*>(optim_.get());
  try {
    hybrid->wait_ahead();
  } catch (const std::exception&) {
    // The backward's own error is the one to report; the step that would
    // have shown this one is refused anyway.
  }
  steps_ahead_->settle();
}

void ShardedOptimizer::drop_raised_steps_ahead() {
  if (steps_ahead_ == nullptr || !steps_ahead_->raised()) {
    return;
  }
  settle_raised_steps_ahead();
  dynamic_cast<nn::optimizer::HybridAdam&>(*optim_).drop_ahead();
  steps_ahead_->clear();
}

bool ShardedOptimizer::one_rank() const {
  return (group_ == nullptr || group_->size() == 1) && placement_ == nullptr;
}

void ShardedOptimizer::zero_grad(bool set_to_none) {
  check_none_stepped_ahead("zero_grad");
  partials_summed_ = false;
  for (auto* g : groups_) {
    // A shard known to hold zeros (e.g. LowLevelZero's step cleared it)
    // is not written again: a pass over every gradient per step.
    if (!g->grad_is_zero) {
      g->shard_grad.zero_(); // the pieces' gradients are views of it
      g->grad_is_zero = true;
    }
  }
  zero_extra_grads(set_to_none);
}

double ShardedOptimizer::clip_grad_by_norm(double max_norm, double norm_type) {
  TORCH_CHECK(max_norm > 0, "clip_grad_by_norm: max_norm must be positive");
  TORCH_CHECK(norm_type > 0, "clip_grad_by_norm: norm_type must be positive");
  check_none_stepped_ahead("clip_grad_by_norm");
  sum_partial_grads();
  unscale();
  const double norm = global_norm(norm_type);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    scale_grads(coef);
  }
  return norm;
}

at::Tensor ShardedOptimizer::clip_grad_by_norm_tensor(
    double max_norm,
    double norm_type) {
  check_none_stepped_ahead("clip_grad_by_norm_tensor");
  TORCH_CHECK(
      scaler_ == nullptr,
      "clip_grad_by_norm_tensor: with fp16 the gradients are unscaled after "
      "an overflow check read on the host; use clip_grad_by_norm");
  TORCH_CHECK(
      one_rank(),
      "clip_grad_by_norm_tensor: the global norm of several ranks' shards "
      "(or a parallel layout's) is reduced on the host; use "
      "clip_grad_by_norm, or the plugin's max_norm");
  return interface::clip_grads_on_device(shard_grads(), max_norm, norm_type);
}

void ShardedOptimizer::clip_grad_by_value(double clip_value) {
  TORCH_CHECK(clip_value >= 0, "clip_grad_by_value: clip_value must be >= 0");
  check_none_stepped_ahead("clip_grad_by_value");
  unscale();
  for (auto* g : groups_) {
    g->shard_grad.clamp_(-clip_value, clip_value);
  }
}

std::map<int64_t, checkpoint_io::StateDict> ShardedOptimizer::full_states() {
  std::map<int64_t, checkpoint_io::StateDict> out;
  stream_full_states([&](int64_t id, const checkpoint_io::StateDict& state) {
    out.emplace(id, state);
  });
  return out;
}

void ShardedOptimizer::stream_full_states(const StateSink& sink) {
  check_none_stepped_ahead("saving the optimizer's states"); // half a step
  constexpr int kRoot = 0;
  // Unsharded states are handed over by the optimizer group's root; each
  // flat group's by the root of the ranks sharing it.
  const bool root = group_ == nullptr || group_->rank() == kRoot;
  auto states = checkpoint_io::detail::optimizer_param_states(*optim_);
  // Parameter id -> (group, index) by the pieces' identity.
  std::unordered_map<const void*, std::pair<size_t, size_t>> where;
  for (size_t k = 0; k < groups_.size(); ++k) {
    for (size_t i = 0; i < groups_[k]->pieces.size(); ++i) {
      where.emplace(
          groups_[k]->pieces[i].unsafeGetTensorImpl(), std::make_pair(k, i));
    }
  }
  int64_t id = 0;
  std::vector<std::vector<std::pair<size_t, int64_t>>> by_group(groups_.size());
  for (auto& g : optim_->param_groups()) {
    for (auto& p : g.params()) {
      auto it = where.find(p.unsafeGetTensorImpl());
      if (it == where.end()) {
        if (root && states.count(id)) {
          sink(id, states.at(id)); // unsharded: held whole
        }
      } else {
        by_group[it->second.first].emplace_back(it->second.second, id);
      }
      ++id;
    }
  }
  for (size_t k = 0; k < groups_.size(); ++k) {
    const auto& fp = *groups_[k];
    const auto& layout = fp.layout;
    const auto& shards = fp.group != nullptr ? fp.group : group_;
    const bool root = shards == nullptr || shards->rank() == kRoot;
    // Keys come from the first parameter with state; every rank has state
    // for the same parameters (all pieces get gradients).
    const checkpoint_io::StateDict* first = nullptr;
    for (const auto& e : by_group[k]) {
      if (states.count(e.second)) {
        first = &states.at(e.second);
        break;
      }
    }
    if (first == nullptr) {
      continue;
    }
    std::map<int64_t, checkpoint_io::StateDict> group_out;
    for (const auto& item : *first) {
      const auto& key = item.key();
      if (item.value().dim() == 0) { // step counters: equal on every rank
        for (const auto& e : by_group[k]) {
          if (root && states.count(e.second)) {
            group_out[e.second].insert(key, states.at(e.second)[key]);
          }
        }
        continue;
      }
      auto local = at::zeros({layout.shard}, item.value().options());
      for (const auto& e : by_group[k]) {
        if (states.count(e.second) && layout.ranges[e.first].len > 0) {
          layout.piece(local, e.first)
              .copy_(states.at(e.second)[key].reshape({-1}));
        }
      }
      at::Tensor full;
      if (root) {
        full = at::empty({layout.padded()}, local.options());
      }
      if (shards != nullptr && shards->size() > 1) {
        distributed::gather(full, local, kRoot, *shards).wait();
      } else {
        full.copy_(local);
      }
      if (!root) {
        continue;
      }
      // Compact copies, so the gathered buffer is released now and a
      // pickled state holds its own bytes, not the whole group's.
      for (const auto& e : by_group[k]) {
        if (states.count(e.second)) {
          group_out[e.second].insert(
              key,
              layout.view(full, e.first, fp.params[e.first].sizes()).clone());
        }
      }
    }
    for (const auto& kv : group_out) {
      sink(kv.first, kv.second);
    }
  }
}

void ShardedOptimizer::load_full_state(
    int64_t id,
    const checkpoint_io::StateDict& state,
    const std::string& file) {
  drop_raised_steps_ahead(); // the states loaded replace that step's
  check_none_stepped_ahead("loading the optimizer's states");
  int64_t n = 0;
  at::Tensor param;
  for (auto& g : optim_->param_groups()) {
    for (auto& p : g.params()) {
      if (n++ == id) {
        param = p;
      }
    }
  }
  TORCH_CHECK(
      param.defined(),
      "optimizer checkpoint '",
      file,
      "' has state for parameter ",
      id,
      " but the optimizer has ",
      n);
  for (auto* g : groups_) {
    for (size_t i = 0; i < g->pieces.size(); ++i) {
      if (!g->pieces[i].is_same(param)) {
        continue;
      }
      checkpoint_io::StateDict piece;
      for (const auto& item : state) {
        if (item.value().dim() == 0) {
          piece.insert(item.key(), item.value());
          continue;
        }
        checkpoint_io::detail::check_state_numel(
            file, item.key(), id, item.value().numel(), g->layout.numels[i]);
        piece.insert(
            item.key(),
            g->layout.piece_of_param(item.value().reshape({-1}), i)
                .to(g->shard_data.device())
                .clone());
      }
      checkpoint_io::detail::load_param_state(*optim_, id, piece, file);
      return;
    }
  }
  checkpoint_io::detail::load_param_state(*optim_, id, state, file);
}

} // namespace zero
} // namespace colossalai
