#include <colossalai/booster/mixed_precision/mixed_precision_base.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_model.h>
#include <colossalai/checkpoint_io/distributed_checkpoint_io.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/initialize.h>
#include <colossalai/lazy/lazy_init.h>
#include <colossalai/pipeline/schedule.h>
#include <colossalai/placement/gradients.h>
#include <colossalai/quantization/fp8.h>
#include <colossalai/zero/low_level_optimizer.h>

#include "fp8_linear_model.h"
#include "gather_wait_model.h"
#include "hybrid/check_options.h"
#include "hybrid/checkpoint_io.h"
#include "hybrid/naive_optimizer.h"
#include "hybrid/pipeline_guard.h"
#include "plugin_options.h"
#include "zero_options.h"

#include <torch/version.h>

#include <algorithm>
#include <set>
#include <unordered_map>
#include <unordered_set>

namespace colossalai {
namespace booster {
namespace plugin {

namespace sl = shardformer::layer;

namespace {

constexpr const char* kName = "HybridParallelPlugin";

std::vector<int64_t> full_shape(
    const at::Tensor& local,
    const sl::ShardSpec& s) {
  auto shape = local.sizes().vec();
  if (s.is_split()) {
    shape[s.dim] = s.full_size;
  }
  return shape;
}

} // namespace

HybridParallelPlugin::HybridParallelPlugin(
    HybridParallelPluginOptions options,
    bool experts)
    : options_(std::move(options)) {
  TORCH_CHECK(
      !options_.fp8_communication() || quantization::fp8_supported(),
      kName,
      ": fp8_communication needs LibTorch 2.1 or later (its float8 dtypes); "
      "this is ",
      TORCH_VERSION);
  const int world = distributed::get_world_size();
  const auto layout = detail::check_hybrid_options(options_, world, experts);
  const int tp = options_.tp_size(), pp = options_.pp_size();
  const int sp = layout.sp_axis_size, dp = layout.dp_size;
  const int ep = layout.ep_size;
  dtype_ = layout.dtype;
  if (options_.use_fp8()) {
    detail::check_use_fp8(kName, dtype_);
  }
  sp_mode_ = layout.sp_mode;
  sp_size_ = layout.sp_size;

  // (dp, pp, sp, tp) or (pp, dp, sp, tp): tp varies fastest. Under expert
  // parallelism dp splits into (moe_dp, ep), ep inside: the ranks of an
  // expert-parallel group are data-parallel neighbours.
  const int dp_axis = options_.dp_outside() ? 0 : 1;
  pp_axis_ = options_.dp_outside() ? 1 : 0;
  const int split = ep > 1 ? 1 : 0; // the ep axis shifts those after dp
  if (ep > 1) {
    ep_axis_ = dp_axis + 1;
    if (pp_axis_ > dp_axis) {
      ++pp_axis_;
    }
  }
  const int sp_axis = 2 + split, tp_axis = 3 + split;
  std::vector<int> shape(4 + split);
  shape[dp_axis] = ep > 1 ? layout.moe_dp_size : dp;
  if (ep > 1) {
    shape[ep_axis_] = ep;
  }
  shape[pp_axis_] = pp;
  shape[sp_axis] = sp;
  shape[tp_axis] = tp;
  mesh_ = std::make_unique<cluster::ProcessGroupMesh>(shape);
  // Every rank asks for its groups in this order.
  tp_group_ = mesh_->get_group_along_axis(tp_axis);
  auto sp_axis_group = mesh_->get_group_along_axis(sp_axis);
  if (ep > 1) {
    dp_group_ = mesh_->get_group_along_axis({dp_axis, ep_axis_});
    mixed_dp_group_ = mesh_->get_group_along_axis({dp_axis, ep_axis_, sp_axis});
    ep_group_ = mesh_->get_group_along_axis(ep_axis_);
    moe_dp_group_ = mesh_->get_group_along_axis(dp_axis);
  } else {
    dp_group_ = mesh_->get_group_along_axis(dp_axis);
    mixed_dp_group_ = mesh_->get_group_along_axis({dp_axis, sp_axis});
    moe_dp_group_ = dp_group_;
  }
  pp_group_ = mesh_->get_group_along_axis(pp_axis_);
  sp_group_ =
      shardformer::on_tensor_group(sp_mode_) ? tp_group_ : sp_axis_group;
  // Tied parameters of the first and last stage (two ranks unless the V
  // puts both on the first): their gradients are summed between the two.
  if (pp > 1 && options_.pp_style() != "zbv") {
    const auto& ranks = pp_group_->ranks();
    const int first = ranks.front(), last = ranks.back();
    const int me = distributed::get_rank();
    if (me == first || me == last) {
      shared_group_ = distributed::new_group(
          {first, last},
          "pp_shared_" + std::to_string(first) + "_" + std::to_string(last));
    }
  }
}

std::shared_ptr<checkpoint_io::CheckpointIO> HybridParallelPlugin::
    get_checkpoint_io() {
  if (!state_) {
    state_ = std::make_shared<HybridState>();
  }
  return std::make_shared<checkpoint_io::DistributedCheckpointIO>(
      distributed::world_group(), hybrid_state_access(state_));
}

std::string HybridParallelPlugin::lora_refusal() const {
  if (options_.tp_size() > 1) {
    return "tp_size " + std::to_string(options_.tp_size()) +
        " > 1 (LoRA adapters are not tensor-parallel; tp_size 1 trains them)";
  }
  if (options_.ep_size() > 1) {
    return "ep_size " + std::to_string(options_.ep_size()) +
        " > 1 (LoRA adapters on split experts are not supported; ep_size 1 "
        "trains them)";
  }
  if (options_.pp_size() > 1) {
    return "pp_size " + std::to_string(options_.pp_size()) +
        " > 1 (a pipeline stage's forward bypasses the refresh of "
        "reparametrised layers; pp_size 1 trains them)";
  }
  return "";
}

void HybridParallelPlugin::configure(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer) {
  TORCH_CHECK(
      model != nullptr && optimizer != nullptr,
      kName,
      ": boost needs both a model and an optimizer");
  TORCH_CHECK(
      !configured_,
      kName,
      ": one plugin boosts one model (make another plugin for another)");
  configured_ = true;
  if (!state_) {
    state_ = std::make_shared<HybridState>();
  }
  auto module = model->unwrap();
  // Rank 0's whole model everywhere, so every tensor rank cuts its shard
  // from the same weights. A lazy model (NOTE [Lazy initialization]) is
  // materialised after sharding instead, each tensor rank cutting its shard
  // as it goes (and, under pp, each stage keeping its layers only); every
  // rank replays the same construction (the same seed, as ColossalAI
  // requires).
  const bool lazy_model = lazy::is_lazy(*module);
  if (!lazy_model) {
    module->to(current_device());
    std::vector<at::Tensor> state = module->parameters();
    for (const auto& b : module->buffers()) {
      state.push_back(b);
    }
    broadcast_coalesced(state, 0, *distributed::world_group());
  }
  apply_tensor_parallel(*module);
  // Under pipelines and expert parallelism a rank holds part of the model:
  // its stage's layers and, of their experts, its own.
  const bool partitioned = options_.pp_size() > 1 || options_.ep_size() > 1;
  std::set<std::string> held;
  if (options_.pp_size() > 1) {
    held = apply_pipeline(*module);
  }
  if (options_.ep_size() > 1) {
    apply_expert_parallel(*module, held);
  }
  if (lazy_model) {
    // Each rank materialises its tensor-parallel slices of the parameters
    // it holds only: the others are computed one at a time (the random
    // stream must advance as in eager construction) and dropped at once.
    auto named = module->named_parameters(true);
    lazy::materialize(
        *module, [&](const std::string& name, const at::Tensor& full) {
          return !partitioned || held.count(name) || !named.contains(name)
              ? full
              : at::empty({0}, full.options());
        });
    module->to(current_device());
  }
  if (partitioned) {
    release_other_parts(*module, *optimizer, held);
  }
  if (dtype_ != at::kFloat && options_.zero_stage() > 0) {
    module->to(dtype_);
  }
  build_placement(*module, held, *optimizer);
  apply_data_parallel(model, optimizer);
}

void HybridParallelPlugin::apply_tensor_parallel(torch::nn::Module& module) {
  shardformer::ShardConfig cfg;
  // enable_all_optimization: every optimization that exists here (the JIT
  // fusion does not).
  const bool all = options_.enable_all_optimization();
  cfg.tensor_parallel_process_group(
         options_.tp_size() > 1 ? tp_group_ : nullptr)
      .sequence_parallel_process_group(
          shardformer::on_sp_group(sp_mode_) ? sp_group_ : nullptr)
      .enable_sequence_parallelism(
          sp_mode_ != shardformer::SequenceParallelMode::kNone)
      .sequence_parallelism_mode(
          sp_mode_ == shardformer::SequenceParallelMode::kNone
              ? "split_gather"
              : shardformer::to_string(sp_mode_))
      .enable_sequence_overlap(options_.enable_sequence_overlap())
      .inner_ring_size(options_.inner_ring_size())
      .enable_flash_attention(all || options_.enable_flash_attention())
      .enable_fused_normalization(all || options_.enable_fused_normalization())
      .enable_jit_fused(false)
      .parallel_output(options_.parallel_output())
      .make_vocab_size_divisible_by(options_.make_vocab_size_divisible_by())
      .gradient_checkpointing_ratio(options_.gradient_checkpointing_ratio())
      .ep_group(options_.ep_size() > 1 ? ep_group_ : nullptr)
      .fp8_communication(options_.fp8_communication());
  policy_ = shardformer::resolve_policy(module, options_.custom_policy());
  info_ = shardformer::shard_model(module, cfg, policy_);
  state_->tp = options_.tp_size() > 1 ? tp_group_ : nullptr;
}

void HybridParallelPlugin::build_placement(
    torch::nn::Module& module,
    const std::set<std::string>& held,
    interface::OptimizerWrapper& optimizer) {
  auto table = std::make_shared<placement::PlacementTable>();
  if (options_.tp_size() > 1) {
    table->add_axis("tp", tp_group_);
  }
  if (stage_manager_ != nullptr) {
    table->set_pipeline(pp_group_, stage_manager_->stage());
  }
  std::unordered_set<const void*> tied;
  for (const auto& p : shared_params_) {
    tied.insert(p.unsafeGetTensorImpl());
  }
  std::unordered_map<const void*, std::string> name_of;
  for (const auto& item : module.named_parameters(true)) {
    if ((options_.pp_size() > 1 || options_.ep_size() > 1) &&
        !held.count(item.key())) {
      continue;
    }
    name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
    placement::ParamPlacement where;
    where.name = item.key();
    if (options_.tp_size() > 1) {
      auto spec = info_.specs.find(item.key());
      if (spec != info_.specs.end() && spec->second.is_split()) {
        const auto& s = spec->second;
        where.axes["tp"] =
            placement::Placement::shard(s.dim)
                .with_sections(s.sections)
                .with_padding(s.padded_size != s.full_size ? s.padded_size : 0);
        where.global_shape = full_shape(item.value(), s);
      } else if (info_.partial_grad_params.count(item.key())) {
        where.axes["tp"] = placement::Placement::partial();
      }
    }
    if (tied.count(item.value().unsafeGetTensorImpl())) {
      // Counted once, on the stage holding the embeddings.
      where.tie_owner_stage = stage_manager_->locate(0).first;
    }
    table->add(item.value(), std::move(where));
  }
  placement_ = table;
  for (const auto& n : info_.partial_grad_params) {
    TORCH_CHECK(
        module.named_parameters(true).contains(n),
        kName,
        ": the policy names a partial-gradient parameter '",
        n,
        "' that the model does not have");
  }
  state_->table = table;
  const auto names = optimizer_param_names(optimizer, name_of);
  for (size_t k = 0; k < names.size(); ++k) {
    const auto& params = optimizer.param_groups()[k].params();
    for (size_t i = 0; i < params.size(); ++i) {
      state_->name_by_id.push_back(names[k][i]);
      state_->local_shape_by_id.push_back(params[i].sizes().vec());
    }
  }
}

void HybridParallelPlugin::apply_data_parallel(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer) {
  // use_fp8's scope, then (a pipeline's model is called through
  // execute_pipeline only) the guard, whose scope opens the ones inside it.
  auto guard_pipeline = [&] {
    if (options_.use_fp8()) {
      model = std::make_shared<detail::Fp8LinearModel>(model, kName);
    }
    if (options_.pp_size() > 1) {
      auto guard = std::make_shared<detail::PipelineGuardModel>(model);
      guard_ = guard;
      model = guard;
    }
  };
  model = std::make_shared<detail::CastInputModel>(
      model, options_.zero_stage() > 0 ? dtype_ : at::kFloat);
  // Experts (NOTE [Expert parallelism]) are averaged over the ranks
  // holding the same ones, the rest over dp x sp.
  expert_params_.clear();
  std::set<std::string> expert_names;
  if (options_.ep_size() > 1) {
    auto named = model->unwrap()->named_parameters(true);
    for (const auto& kv : info_.expert_owner) {
      expert_names.insert(kv.first);
      if (state_->held.count(kv.first)) {
        expert_params_.push_back(named[kv.first]);
      }
    }
  }
  if (options_.zero_stage() == 0) {
    if (mixed_dp_group_->size() > 1) {
      auto ddp = std::make_shared<TorchDDPModel>(
          model,
          mixed_dp_group_,
          TorchDDPPluginOptions()
              .broadcast_buffers(options_.broadcast_buffers())
              .bucket_cap_mb(options_.ddp_bucket_cap_mb())
              .find_unused_parameters(options_.find_unused_parameters())
              .gradient_as_bucket_view(options_.gradient_as_bucket_view())
              .static_graph(options_.static_graph())
              .fp8_communication(options_.fp8_communication()),
          expert_names);
      ddp_ = ddp;
      model = ddp;
    }
    if (dtype_ == at::kBFloat16) {
      // Parameters and gradients stay fp32; matmuls run in bf16.
      model = std::make_shared<mixed_precision::AutocastModel>(
          model, current_device().type(), at::kBFloat16);
    }
    auto naive = std::make_shared<detail::HybridParallelNaiveOptimizer>(
        optimizer->optimizer_ptr(), placement_, options_.max_norm());
    if (options_.ep_size() > 1) {
      naive->set_experts(expert_params_, moe_dp_group_, ep_group_);
    }
    optimizer = naive;
    guard_pipeline();
    return;
  }
  auto zo = detail::zero_optimizer_options(
      options_,
      options_.zero_stage(),
      dtype_,
      options_.zero_bucket_size_in_m(),
      kName);
  std::vector<std::pair<distributed::ProcessGroupPtr, std::vector<at::Tensor>>>
      own_groups;
  if (options_.ep_size() > 1) {
    own_groups.emplace_back(moe_dp_group_, expert_params_);
  }
  zo.overlap_allgather(options_.overlap_allgather())
      .fp8_communication(options_.fp8_communication());
  auto zero_opt = std::make_shared<zero::LowLevelZeroOptimizer>(
      optimizer->optimizer_ptr(), mixed_dp_group_, zo, std::move(own_groups));
  zero_opt->set_placement(placement_);
  if (options_.overlap_allgather()) {
    model = std::make_shared<detail::GatherWaitModel>(model, zero_opt, kName);
  }
  guard_pipeline();
  state_->zero = zero_opt;
  optimizer = zero_opt;
}

namespace {

// `handle` when it is `model` or one of the wrappers `model` wraps.
template <class W>
W* in_chain(interface::ModelWrapper& model, const std::weak_ptr<W>& handle) {
  auto w = handle.lock();
  for (interface::ModelWrapper* m = &model; w && m != nullptr;
       m = m->inner().get()) {
    if (m == w.get()) {
      return w.get(); // alive while the caller's model holds it
    }
  }
  return nullptr;
}

} // namespace

detail::PipelineGuardModel* HybridParallelPlugin::boosted_guard(
    interface::ModelWrapper& model) const {
  return in_chain(model, guard_);
}

TorchDDPModel* HybridParallelPlugin::boosted_ddp(
    interface::ModelWrapper& model) const {
  return in_chain(model, ddp_);
}

zero::LowLevelZeroOptimizer* HybridParallelPlugin::boosted_zero(
    interface::OptimizerWrapper* optimizer) const {
  auto z = state_ != nullptr ? state_->zero.lock() : nullptr;
  return z != nullptr &&
          static_cast<interface::OptimizerWrapper*>(z.get()) == optimizer
      ? z.get()
      : nullptr;
}

NoSyncGuard HybridParallelPlugin::no_sync(
    interface::ModelWrapper& model,
    interface::OptimizerWrapper* optimizer) {
  TORCH_CHECK(
      options_.zero_stage() < 2,
      kName,
      ": no_sync needs zero_stage 0 or 1 (stage 2 keeps only gradient "
      "slices, so gradients cannot accumulate locally)");
  if (options_.zero_stage() == 1) {
    auto* z = boosted_zero(optimizer);
    TORCH_CHECK(z != nullptr, kName, ".no_sync: pass the boosted optimizer");
    z->set_require_sync(false);
    return NoSyncGuard([z]() { z->set_require_sync(true); });
  }
  auto* ddp = boosted_ddp(model);
  if (ddp == nullptr) {
    return NoSyncGuard(); // one data-parallel rank: nothing to defer
  }
  ddp->set_require_sync(false);
  return NoSyncGuard([ddp]() { ddp->set_require_sync(true); });
}

} // namespace plugin
} // namespace booster
} // namespace colossalai
