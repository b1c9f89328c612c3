#include <colossalai/booster/mixed_precision/mixed_precision_base.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_model.h>
#include <colossalai/checkpoint_io/distributed_checkpoint_io.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/initialize.h>
#include <colossalai/lazy/lazy_init.h>
#include <colossalai/pipeline/schedule.h>
#include <colossalai/zero/low_level_optimizer.h>

#include "hybrid_checkpoint_io.h"
#include "plugin_options.h"
#include "zero_options.h"

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

// split_gather and ring split the sequence over the tensor group.
bool on_tensor_group(const std::string& sp_mode) {
  return sp_mode == "split_gather" || sp_mode == "ring";
}

// The outermost wrapper under pp_size > 1: the model runs stage by stage
// inside execute_pipeline; a direct call is a user error.
class PipelineGuardModel : public interface::ModelWrapper {
 public:
  explicit PipelineGuardModel(std::shared_ptr<interface::ModelWrapper> inner)
      : interface::ModelWrapper(std::move(inner)) {}
  // Stage forwards run inside this scope.
  struct Scope {
    explicit Scope(PipelineGuardModel& m) : m_(m) {
      m_.in_schedule_ = true;
      try {
        m_.enter_forward();
      } catch (...) {
        m_.in_schedule_ = false;
        throw;
      }
    }
    ~Scope() {
      m_.exit_forward();
      m_.in_schedule_ = false;
    }
    PipelineGuardModel& m_;
  };

 protected:
  void pre_forward() override {
    TORCH_CHECK(
        in_schedule_,
        kName,
        ": with pp_size > 1 the model runs through "
        "booster.execute_pipeline(data_iter, model, criterion, optimizer), "
        "not by calling it");
  }

 private:
  bool in_schedule_ = false;
};

std::vector<int64_t> full_shape(
    const at::Tensor& local,
    const sl::ShardSpec& s) {
  auto shape = local.sizes().vec();
  if (s.is_split()) {
    shape[s.dim] = s.full_size;
  }
  return shape;
}

// Sums `tensors` over `group` in place, in one all-reduce of their
// concatenation.
void all_reduce_flat(
    std::vector<at::Tensor>& tensors,
    const distributed::ProcessGroup& group) {
  std::vector<at::Tensor> parts;
  for (const auto& t : tensors) {
    parts.push_back(t.reshape({-1}));
  }
  auto flat = at::cat(parts).to(group.device());
  distributed::all_reduce(flat, group).wait();
  int64_t offset = 0;
  for (auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view_as(t));
    offset += t.numel();
  }
}

// zero_stage 0 (ColossalAI's HybridParallel(Naive|AMP)Optimizer): DDP has
// averaged the gradients over dp x sp; this adds the tensor-parallel part
// (partial gradients summed over the tensor group, the norm over it) and
// clipping inside step.
class HybridParallelNaiveOptimizer : public interface::OptimizerWrapper {
 public:
  HybridParallelNaiveOptimizer(
      std::shared_ptr<torch::optim::Optimizer> optim,
      distributed::ProcessGroupPtr tp,
      std::vector<at::Tensor> replicated,
      std::vector<at::Tensor> partial,
      double max_norm,
      distributed::ProcessGroupPtr pp,
      const std::vector<at::Tensor>& not_counted)
      : interface::OptimizerWrapper(std::move(optim)),
        tp_(std::move(tp)),
        pp_(std::move(pp)),
        partial_(std::move(partial)),
        max_norm_(max_norm) {
    for (const auto& p : replicated) {
      replicated_.insert(p.unsafeGetTensorImpl());
    }
    for (const auto& p : not_counted) {
      not_counted_.insert(p.unsafeGetTensorImpl());
    }
  }

  void step() override {
    sum_partial_grads();
    if (max_norm_ > 0) {
      clip_grad_by_norm(max_norm_, 2.0);
    }
    optim_->step();
    summed_ = false;
  }

  void zero_grad(bool set_to_none) override {
    summed_ = false;
    interface::OptimizerWrapper::zero_grad(set_to_none);
  }

  double clip_grad_by_norm(double max_norm, double norm_type) override {
    TORCH_CHECK(max_norm > 0, "clip_grad_by_norm: max_norm must be positive");
    TORCH_CHECK(norm_type > 0, "clip_grad_by_norm: norm_type must be positive");
    sum_partial_grads();
    const bool first = tp_ == nullptr || tp_->rank() == 0;
    std::vector<at::Tensor> grads;
    for (const auto& p : parameters()) {
      if ((first || !replicated_.count(p.unsafeGetTensorImpl())) &&
          !not_counted_.count(p.unsafeGetTensorImpl())) {
        grads.push_back(p.grad());
      }
    }
    // Every stage holds other parameters: the norm combines them.
    const double norm = interface::total_norm(
        grads,
        norm_type,
        std::vector<const distributed::ProcessGroup*>{tp_.get(), pp_.get()});
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) {
      interface::scale_grads(parameters(), coef);
    }
    return norm;
  }

 private:
  void sum_partial_grads() {
    if (tp_ == nullptr || tp_->size() == 1 || partial_.empty() || summed_) {
      return;
    }
    summed_ = true;
    std::vector<at::Tensor> grads;
    for (auto& p : partial_) {
      TORCH_INTERNAL_ASSERT(p.grad().defined(), "partial gradient missing");
      grads.push_back(p.mutable_grad());
    }
    all_reduce_flat(grads, *tp_);
  }

  distributed::ProcessGroupPtr tp_, pp_;
  std::unordered_set<const void*> replicated_, not_counted_;
  std::vector<at::Tensor> partial_;
  double max_norm_;
  bool summed_ = false;
};

// The optimizer's parameters' names (`name_of`: by tensor identity), by
// group.
std::vector<std::vector<std::string>> param_names(
    interface::OptimizerWrapper& optimizer,
    const std::unordered_map<const void*, std::string>& name_of) {
  std::vector<std::vector<std::string>> out;
  for (auto& g : optimizer.param_groups()) {
    out.emplace_back();
    for (auto& p : g.params()) {
      auto it = name_of.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(
          it != name_of.end(),
          kName,
          ": the optimizer holds a parameter (shape ",
          p.sizes(),
          ") that is not in the boosted model");
      out.back().push_back(it->second);
    }
  }
  return out;
}

void check_pipeline_options(const HybridParallelPluginOptions& o) {
  const int pp = o.pp_size();
  const auto& style = o.pp_style();
  TORCH_CHECK(
      style == "1f1b" || style == "interleaved" || style == "zbv",
      kName,
      ": pp_style must be '1f1b', 'interleaved' or 'zbv', got '",
      style,
      "'");
  TORCH_CHECK(
      o.num_microbatches() >= 0 && o.microbatch_size() >= 0,
      kName,
      ": num_microbatches and microbatch_size must be >= 0");
  if (pp == 1) {
    return;
  }
  TORCH_CHECK(
      o.num_microbatches() > 0 || o.microbatch_size() > 0,
      kName,
      ": pp_size ",
      pp,
      " needs num_microbatches or microbatch_size");
  if (style == "1f1b") {
    TORCH_CHECK(
        o.num_model_chunks() == 1,
        kName,
        ": pp_style '1f1b' needs num_model_chunks 1 (got ",
        o.num_model_chunks(),
        "); use pp_style('interleaved')");
  } else if (style == "interleaved") {
    TORCH_CHECK(
        o.num_model_chunks() > 1,
        kName,
        ": pp_style 'interleaved' needs num_model_chunks > 1");
  } else {
    TORCH_CHECK(
        o.num_model_chunks() == 2,
        kName,
        ": pp_style 'zbv' needs num_model_chunks 2 (the V), got ",
        o.num_model_chunks());
    TORCH_CHECK(
        o.gradient_checkpointing_ratio() == 0.0,
        kName,
        ": pp_style 'zbv' cannot recompute blocks "
        "(gradient_checkpointing_ratio must be 0): its input-gradient pass "
        "would accumulate weight gradients too");
  }
  TORCH_CHECK(
      o.zero_stage() < 2,
      kName,
      ": zero_stage 2 with pp_size > 1 is not supported (gradients are "
      "reduced once per step after every micro-batch; as in ColossalAI); "
      "use zero_stage(1) or 0");
}

} // namespace

HybridParallelPlugin::HybridParallelPlugin(HybridParallelPluginOptions options)
    : options_(std::move(options)) {
  const int world = distributed::get_world_size();
  const int tp = options_.tp_size(), pp = options_.pp_size();
  TORCH_CHECK(tp >= 1, kName, ": tp_size must be >= 1, got ", tp);
  TORCH_CHECK(pp >= 1, kName, ": pp_size must be >= 1, got ", pp);
  check_pipeline_options(options_);
  TORCH_CHECK(
      options_.zero_stage() >= 0 && options_.zero_stage() <= 2,
      kName,
      ": zero_stage must be 0, 1 or 2, got ",
      options_.zero_stage());
  dtype_ = detail::parse_precision(options_.precision(), kName, "precision");
  TORCH_CHECK(
      !options_.enable_jit_fused(),
      kName,
      ": enable_jit_fused(true) is not supported: LibTorch has no TorchScript "
      "fusion of bias, dropout and residual add, so they run as separate ATen "
      "kernels (enable_all_optimization turns on the optimizations that "
      "exist: fused normalization and flash attention)");
  detail::parse_precision(
      options_.communication_dtype(), kName, "communication_dtype", true);
  TORCH_CHECK(
      !(dtype_ == at::kHalf && current_device().is_cpu()),
      kName,
      ": precision 'fp16' needs a CUDA device (CPU LibTorch cannot multiply "
      "fp16 matrices); use precision('bf16') or precision('fp32') on CPU");
  TORCH_CHECK(
      !(dtype_ == at::kHalf && options_.zero_stage() == 0),
      kName,
      ": precision 'fp16' with zero_stage 0 is not supported (its loss "
      "scaler lives in the ZeRO optimizer); use zero_stage(1) or "
      "precision('bf16')");
  TORCH_CHECK(options_.max_norm() >= 0, kName, ": max_norm must be >= 0");
  TORCH_CHECK(
      options_.gradient_checkpointing_ratio() >= 0.0 &&
          options_.gradient_checkpointing_ratio() <= 1.0,
      kName,
      ": gradient_checkpointing_ratio must be in [0, 1], got ",
      options_.gradient_checkpointing_ratio());
  TORCH_CHECK(
      !(options_.cpu_offload() && options_.zero_stage() == 0),
      kName,
      ": cpu_offload needs zero_stage 1 or 2");
  TORCH_CHECK(
      options_.make_vocab_size_divisible_by() > 0,
      kName,
      ": make_vocab_size_divisible_by must be positive");

  int sp = 1;
  if (options_.enable_sequence_parallelism()) {
    sp_mode_ = options_.sequence_parallelism_mode().empty()
        ? "all_to_all"
        : options_.sequence_parallelism_mode();
    TORCH_CHECK(
        sp_mode_ == "split_gather" || sp_mode_ == "all_to_all" ||
            sp_mode_ == "ring" || sp_mode_ == "ring_attn",
        kName,
        ": sequence_parallelism_mode must be 'split_gather', 'ring', "
        "'all_to_all' or 'ring_attn', got '",
        sp_mode_,
        "'");
    if (on_tensor_group(sp_mode_)) {
      TORCH_CHECK(
          tp > 1,
          kName,
          ": sequence_parallelism_mode '",
          sp_mode_,
          "' runs on the tensor group and needs tp_size > 1");
      TORCH_CHECK(
          options_.sp_size() <= 1,
          kName,
          ": sp_size is set by tp_size under '",
          sp_mode_,
          "'; leave sp_size unset (got ",
          options_.sp_size(),
          ")");
    } else {
      sp = options_.sp_size() == 0 ? 1 : options_.sp_size();
      TORCH_CHECK(sp >= 1, kName, ": sp_size must be >= 1, got ", sp);
    }
  } else {
    TORCH_CHECK(
        options_.sp_size() <= 1,
        kName,
        ": sp_size ",
        options_.sp_size(),
        " needs enable_sequence_parallelism(true)");
    TORCH_CHECK(
        options_.sequence_parallelism_mode().empty(),
        kName,
        ": sequence_parallelism_mode is set but "
        "enable_sequence_parallelism is false");
  }
  sp_size_ = on_tensor_group(sp_mode_) ? tp : sp;
  TORCH_CHECK(
      world % (tp * pp * sp) == 0,
      kName,
      ": the world size ",
      world,
      " is not divisible by tp_size x pp_size x sp_size = ",
      tp * pp * sp);
  const int dp = world / (tp * pp * sp);

  // (dp, pp, sp, tp) or (pp, dp, sp, tp): tp varies fastest.
  const int dp_axis = options_.dp_outside() ? 0 : 1;
  const int pp_axis = options_.dp_outside() ? 1 : 0;
  constexpr int sp_axis = 2, tp_axis = 3;
  std::vector<int> shape(4);
  shape[dp_axis] = dp;
  shape[pp_axis] = pp;
  shape[sp_axis] = sp;
  shape[tp_axis] = tp;
  mesh_ = std::make_unique<cluster::ProcessGroupMesh>(shape);
  // Every rank asks for its groups in this order.
  tp_group_ = mesh_->get_group_along_axis(tp_axis);
  auto sp_axis_group = mesh_->get_group_along_axis(sp_axis);
  dp_group_ = mesh_->get_group_along_axis(dp_axis);
  mixed_dp_group_ = mesh_->get_group_along_axis({dp_axis, sp_axis});
  pp_group_ = mesh_->get_group_along_axis(pp_axis);
  sp_group_ = on_tensor_group(sp_mode_) ? tp_group_ : sp_axis_group;
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
      distributed::world_group(),
      hybrid_state_access(std::static_pointer_cast<HybridState>(state_)));
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
  auto module = model->unwrap();
  const auto device = current_device();
  // Rank 0's whole model everywhere, so every tensor rank cuts its shard
  // from the same weights. A lazy model (NOTE [Lazy initialization]) is
  // materialised after sharding instead, each tensor rank cutting its shard
  // as it goes (and, under pp, each stage keeping its layers only); every
  // rank replays the same construction (the same seed, as ColossalAI
  // requires).
  const bool lazy_model = lazy::is_lazy(*module);
  if (!lazy_model) {
    module->to(device);
    std::vector<at::Tensor> state = module->parameters();
    for (const auto& b : module->buffers()) {
      state.push_back(b);
    }
    broadcast_coalesced(state, 0, *distributed::world_group());
  }

  shardformer::ShardConfig cfg;
  // enable_all_optimization: every optimization that exists here (the JIT
  // fusion does not).
  const bool all = options_.enable_all_optimization();
  cfg.tensor_parallel_process_group(
         options_.tp_size() > 1 ? tp_group_ : nullptr)
      .sequence_parallel_process_group(
          sp_mode_ == "all_to_all" || sp_mode_ == "ring_attn" ? sp_group_
                                                              : nullptr)
      .enable_sequence_parallelism(!sp_mode_.empty())
      .sequence_parallelism_mode(sp_mode_.empty() ? "split_gather" : sp_mode_)
      .enable_flash_attention(all || options_.enable_flash_attention())
      .enable_fused_normalization(all || options_.enable_fused_normalization())
      .enable_jit_fused(false)
      .parallel_output(options_.parallel_output())
      .make_vocab_size_divisible_by(options_.make_vocab_size_divisible_by())
      .gradient_checkpointing_ratio(options_.gradient_checkpointing_ratio());
  if (!state_) {
    state_ = std::make_shared<HybridState>();
  }
  auto st = std::static_pointer_cast<HybridState>(state_);
  policy_ = shardformer::resolve_policy(*module, options_.custom_policy());
  st->info = shardformer::shard_model(*module, cfg, policy_);
  if (lazy_model && options_.pp_size() == 1) {
    lazy::materialize(*module);
    module->to(device);
  }
  info_ = st->info;
  st->tp = options_.tp_size() > 1 ? tp_group_ : nullptr;
  // Pipelines: keep this stage's layers, release the rest.
  std::set<std::string> held;
  if (options_.pp_size() > 1) {
    held = setup_pipeline(*module, *optimizer);
    st->pipelined = true;
  }
  if (dtype_ != at::kFloat && options_.zero_stage() > 0) {
    module->to(dtype_);
  }

  // Parameter roles by identity.
  std::unordered_map<const void*, std::string> name_of;
  std::vector<at::Tensor> replicated, partial, not_counted;
  for (const auto& item : module->named_parameters(true)) {
    if (options_.pp_size() > 1 && !held.count(item.key())) {
      continue;
    }
    name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
    if (!info_.specs.count(item.key())) {
      replicated.push_back(item.value());
    }
    if (info_.partial_grad_params.count(item.key())) {
      partial.push_back(item.value());
    }
  }
  for (const auto& n : info_.partial_grad_params) {
    TORCH_CHECK(
        module->named_parameters(true).contains(n),
        kName,
        ": the policy names a partial-gradient parameter '",
        n,
        "' that the model does not have");
  }
  const auto names = param_names(*optimizer, name_of);
  for (size_t k = 0; k < names.size(); ++k) {
    const auto& params = optimizer->param_groups()[k].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      auto spec_it = info_.specs.find(names[k][i]);
      auto spec =
          spec_it == info_.specs.end() ? sl::ShardSpec() : spec_it->second;
      st->spec_by_id.push_back(spec);
      st->local_shape_by_id.push_back(p.sizes().vec());
      st->full_shape_by_id.push_back(full_shape(p, spec));
    }
  }

  // A tied parameter is counted in the norm on the stage holding the
  // embeddings only.
  if (stage_manager_ != nullptr && !stage_manager_->holds_first_stage()) {
    not_counted = shared_params_;
  }
  auto hybrid = std::make_shared<detail::CastInputModel>(
      model, options_.zero_stage() > 0 ? dtype_ : at::kFloat);
  model = hybrid;
  const auto tp = options_.tp_size() > 1 ? tp_group_ : nullptr;
  if (options_.zero_stage() == 0) {
    if (mixed_dp_group_->size() > 1) {
      model = std::make_shared<TorchDDPModel>(
          model,
          mixed_dp_group_,
          TorchDDPPluginOptions()
              .broadcast_buffers(options_.broadcast_buffers())
              .bucket_cap_mb(options_.ddp_bucket_cap_mb())
              .find_unused_parameters(options_.find_unused_parameters())
              .gradient_as_bucket_view(options_.gradient_as_bucket_view())
              .static_graph(options_.static_graph()));
    }
    if (dtype_ == at::kBFloat16) {
      // Parameters and gradients stay fp32; matmuls run in bf16.
      model = std::make_shared<mixed_precision::AutocastModel>(
          model, device.type(), at::kBFloat16);
    }
    optimizer = std::make_shared<HybridParallelNaiveOptimizer>(
        optimizer->optimizer_ptr(),
        tp,
        replicated,
        partial,
        options_.max_norm(),
        options_.pp_size() > 1 ? pp_group_ : nullptr,
        not_counted);
    if (options_.pp_size() > 1) {
      model = std::make_shared<PipelineGuardModel>(model);
    }
    return;
  }
  auto zo = detail::zero_optimizer_options(
      options_,
      options_.zero_stage(),
      dtype_,
      options_.zero_bucket_size_in_m(),
      kName);
  auto zero_opt = std::make_shared<zero::LowLevelZeroOptimizer>(
      optimizer->optimizer_ptr(), mixed_dp_group_, zo);
  zero_opt->set_model_parallel(tp, replicated, partial);
  if (options_.pp_size() > 1) {
    zero_opt->set_pipeline_parallel(pp_group_, not_counted);
    model = std::make_shared<PipelineGuardModel>(model);
  }
  st->zero = zero_opt;
  optimizer = zero_opt;
}

std::set<std::string> HybridParallelPlugin::setup_pipeline(
    torch::nn::Module& module,
    interface::OptimizerWrapper& optimizer) {
  const int pp = options_.pp_size();
  const int64_t layers = policy_->num_pipeline_layers(module);
  TORCH_CHECK(
      layers > 0,
      kName,
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
          kName,
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
        kName,
        ": ",
        policy_->name(),
        ".shared_params names '",
        name,
        "' that the model does not have");
    if (held.count(name)) {
      shared_params_.push_back(*p);
    }
  }
  // A lazy model materialises here, keeping this stage's parameters only:
  // the others are computed one at a time (the random stream must advance
  // as in eager construction) and dropped at once, so a stage never holds
  // another stage's layers.
  if (lazy::is_lazy(module)) {
    lazy::materialize(
        module, [&](const std::string& name, const at::Tensor& full) {
          return held.count(name) || !named.contains(name)
              ? full
              : at::empty({0}, full.options());
        });
    module.to(current_device());
  }
  // Checkpoints number the optimizer's parameters as it holds them now,
  // before the release.
  auto st = std::static_pointer_cast<HybridState>(state_);
  {
    std::unordered_map<const void*, std::string> name_of;
    for (const auto& item : named) {
      name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
    }
    st->global_id.clear();
    st->global_groups.clear();
    st->global_name.clear();
    int64_t id = 0;
    for (const auto& group : param_names(optimizer, name_of)) {
      st->global_groups.emplace_back();
      for (const auto& name : group) {
        if (held.count(name)) {
          st->global_id.push_back(id);
        }
        st->global_name.push_back(name);
        st->global_groups.back().push_back(id++);
      }
    }
  }
  // Release what other stages hold (ColossalAI's shardformer does the
  // same): storage freed, no gradient, out of the optimizer.
  std::unordered_set<const void*> released;
  {
    at::NoGradGuard no_grad;
    for (auto& item : named) {
      if (!held.count(item.key())) {
        auto& p = item.value();
        released.insert(p.unsafeGetTensorImpl());
        p.set_data(at::empty({0}, p.options()));
        p.requires_grad_(false);
      }
    }
  }
  for (auto& g : optimizer.param_groups()) {
    auto& ps = g.params();
    ps.erase(
        std::remove_if(
            ps.begin(),
            ps.end(),
            [&](const at::Tensor& p) {
              return released.count(p.unsafeGetTensorImpl()) > 0;
            }),
        ps.end());
  }
  // Checkpoints: which stage writes each parameter and buffer, and who
  // sends it.
  st->stage = stage_manager_->stage();
  st->held = held;
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
        kName,
        ": no pipeline stage holds parameter '",
        item.key(),
        "' (",
        policy_->name(),
        ".held_layers leaves it out)");
  }
  std::vector<int> coord(mesh_->shape().size(), 0);
  const int pp_axis = options_.dp_outside() ? 1 : 0;
  st->stage_source.clear();
  for (int s = 0; s < pp; ++s) {
    coord[pp_axis] = s;
    st->stage_source.push_back(mesh_->ravel(coord));
  }
  st->to_writer = std::make_shared<pipeline::PipelineP2PCommunication>(
      distributed::world_group(),
      /*enable_metadata_cache=*/false,
      /*one_way=*/true);
  auto p2p = std::make_shared<pipeline::PipelineP2PCommunication>(
      pp_group_, options_.enable_metadata_cache());
  schedule_ = std::make_shared<pipeline::PipelineSchedule>(
      stage_manager_, p2p, options_.pp_style(), options_.overlap_p2p());
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
  all_reduce_flat(grads, *shared_group_);
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
      kName,
      ".execute_pipeline needs a model boosted with pp_size > 1");
  auto* guard = interface::find_wrapper<PipelineGuardModel>(model);
  TORCH_CHECK(
      guard != nullptr, kName, ".execute_pipeline: pass the boosted model");
  auto* zero = dynamic_cast<zero::LowLevelZeroOptimizer*>(optimizer);
  TORCH_CHECK(
      options_.zero_stage() == 0 || zero != nullptr,
      kName,
      ".execute_pipeline: pass the boosted optimizer (ZeRO reduces the "
      "gradients into its buckets)");
  auto batch = data_iter();
  TORCH_CHECK(
      !batch.empty() && batch[0].defined() && batch[0].dim() >= 1,
      kName,
      ".execute_pipeline: data_iter gave an empty batch");
  const int64_t n = batch[0].size(0);
  for (const auto& t : batch) {
    TORCH_CHECK(
        t.defined() && t.dim() >= 1 && t.size(0) == n,
        kName,
        ".execute_pipeline: every tensor of the batch must have ",
        n,
        " samples along dim 0");
  }
  int64_t m = options_.num_microbatches(), size = options_.microbatch_size();
  if (m > 0 && size > 0) {
    TORCH_CHECK(
        m * size == n,
        kName,
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
        kName,
        ": a batch of ",
        n,
        " samples does not divide into num_microbatches ",
        m);
    size = n / m;
  } else {
    TORCH_CHECK(
        n % size == 0,
        kName,
        ": a batch of ",
        n,
        " samples does not divide into micro-batches of microbatch_size ",
        size);
    m = n / size;
  }
  TORCH_CHECK(
      options_.pp_style() != "interleaved" || m % options_.pp_size() == 0,
      kName,
      ": pp_style 'interleaved' needs num_microbatches (",
      m,
      ") to be a multiple of pp_size (",
      options_.pp_size(),
      ")");
  const auto device = current_device();
  std::vector<pipeline::Batch> micro(m);
  for (int64_t i = 0; i < m; ++i) {
    for (const auto& t : batch) {
      micro[i].push_back(
          guard->prepare_input(t.narrow(0, i * size, size).to(device)));
    }
  }

  // Data-parallel synchronisation once per step, after every micro-batch.
  auto* ddp = interface::find_wrapper<TorchDDPModel>(model);
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
  auto module = model.unwrap();
  auto forward = [&](int chunk,
                     const pipeline::Batch& mb,
                     const at::Tensor& hidden) {
    PipelineGuardModel::Scope scope(*guard);
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
      return_outputs);
  if (!sync) {
    return out; // no_sync: gradients accumulate until a synchronised step
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

NoSyncGuard HybridParallelPlugin::no_sync(
    interface::ModelWrapper& model,
    interface::OptimizerWrapper* optimizer) {
  TORCH_CHECK(
      options_.zero_stage() < 2,
      kName,
      ": no_sync needs zero_stage 0 or 1 (stage 2 keeps only gradient "
      "slices, so gradients cannot accumulate locally)");
  if (options_.zero_stage() == 1) {
    auto* z = dynamic_cast<zero::LowLevelZeroOptimizer*>(optimizer);
    TORCH_CHECK(z != nullptr, kName, ".no_sync: pass the boosted optimizer");
    z->set_require_sync(false);
    return NoSyncGuard([z]() { z->set_require_sync(true); });
  }
  auto* ddp = interface::find_wrapper<TorchDDPModel>(model);
  if (ddp == nullptr) {
    return NoSyncGuard(); // one data-parallel rank: nothing to defer
  }
  ddp->set_require_sync(false);
  return NoSyncGuard([ddp]() { ddp->set_require_sync(true); });
}

} // namespace plugin
} // namespace booster
} // namespace colossalai
