#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_model.h>
#include <colossalai/checkpoint_io/distributed_checkpoint_io.h>
#include <colossalai/initialize.h>
#include <colossalai/quantization/fp8.h>

#include <torch/version.h>

#include "../../zero/common/hybrid_groups.h"
#include "fp8_linear_model.h"
#include "gather_wait_model.h"
#include "plugin_options.h"
#include "zero_options.h"

namespace colossalai {
namespace booster {
namespace plugin {

namespace {

// The working-dtype model, and the optimizer whose master slices mirror
// its weights.
class LowLevelZeroModel : public detail::CastInputModel {
 public:
  using detail::CastInputModel::CastInputModel;
  std::weak_ptr<zero::LowLevelZeroOptimizer> optimizer;
};

// How ZeRO's state reaches a checkpoint: full weights (every rank holds
// them) and full optimizer states gathered bucket by bucket to rank 0, in the
// GeneralCheckpointIO layout, so checkpoints load at any world size and
// under any plugin; loading keeps this rank's slices.
class ZeroStateAccess : public checkpoint_io::StateAccess {
 public:
  void stream_model(
      interface::ModelWrapper& model,
      const checkpoint_io::TensorSink& sink) override {
    // fp8_communication leaves the weights rounded to 8 bits; a checkpoint
    // holds the masters' values.
    auto* m = interface::find_wrapper<LowLevelZeroModel>(model);
    if (m != nullptr) {
      if (auto opt = m->optimizer.lock()) {
        opt->gather_exact_weights();
      }
    }
    checkpoint_io::StateAccess::stream_model(model, sink);
  }
  void stream_optimizer(
      interface::OptimizerWrapper& optimizer,
      const checkpoint_io::StateSink& sink) override {
    zero_of(optimizer).stream_full_states(sink);
  }
  void load_optimizer_param(
      interface::OptimizerWrapper& optimizer,
      int64_t id,
      const checkpoint_io::StateDict& state,
      const std::string& file) override {
    auto& zero = zero_of(optimizer);
    zero.wait_all_gathers(); // they would write the master slices back
    zero.load_full_state(id, state, file);
  }
  void load_model(
      interface::ModelWrapper& model,
      const std::function<void()>& load) override {
    load();
    // The master slices follow the loaded weights.
    auto* m = interface::find_wrapper<LowLevelZeroModel>(model);
    if (m != nullptr) {
      if (auto opt = m->optimizer.lock()) {
        opt->sync_master_from_working();
      }
    }
  }

 private:
  static zero::LowLevelZeroOptimizer& zero_of(interface::OptimizerWrapper& o) {
    auto* z = dynamic_cast<zero::LowLevelZeroOptimizer*>(&o);
    TORCH_CHECK(
        z != nullptr,
        "LowLevelZeroPlugin checkpoints need the "
        "optimizer the plugin boosted");
    return *z;
  }
};

} // namespace

std::shared_ptr<checkpoint_io::CheckpointIO> LowLevelZeroPlugin::
    get_checkpoint_io() {
  return std::make_shared<checkpoint_io::DistributedCheckpointIO>(
      dp_group_, std::make_shared<ZeroStateAccess>());
}

LowLevelZeroPlugin::LowLevelZeroPlugin(LowLevelZeroPluginOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(
      options_.stage() == 1 || options_.stage() == 2,
      "LowLevelZeroPlugin: stage must be 1 or 2, got ",
      options_.stage());
  dtype_ = detail::parse_precision(
      options_.precision(), "LowLevelZeroPlugin", "precision");
  detail::parse_precision(
      options_.communication_dtype(),
      "LowLevelZeroPlugin",
      "communication_dtype",
      true);
  TORCH_CHECK(
      options_.norm_type() == 2.0,
      "LowLevelZeroPlugin: norm_type must be 2.0, got ",
      options_.norm_type());
  TORCH_CHECK(
      options_.max_norm() >= 0, "LowLevelZeroPlugin: max_norm must be >= 0");
  TORCH_CHECK(
      options_.reduce_bucket_size_in_m() > 0,
      "LowLevelZeroPlugin: reduce_bucket_size_in_m must be > 0");
  TORCH_CHECK(
      options_.extra_dp_size() >= 1 &&
          dp_group_->size() % options_.extra_dp_size() == 0,
      "LowLevelZeroPlugin: extra_dp_size (",
      options_.extra_dp_size(),
      ") must be >= 1 and divide the data-parallel size ",
      dp_group_->size());
  TORCH_CHECK(
      !options_.fp8_communication() || quantization::fp8_supported(),
      "LowLevelZeroPlugin: fp8_communication needs LibTorch 2.1 or later "
      "(its float8 dtypes); this is ",
      TORCH_VERSION);
  if (options_.overlap_host_step()) {
    const char* why = !options_.cpu_offload()
        ? "cpu_offload(false): without it no master slice lives on the host"
        : options_.max_norm() > 0
        ? "max_norm: clipping needs the global norm of every gradient "
          "before any slice is updated"
        : dtype_ == at::kHalf
        ? "precision fp16: the loss scaler may skip the step, known only "
          "after the whole backward"
        : nullptr;
    TORCH_CHECK(
        why == nullptr,
        "LowLevelZeroPlugin: overlap_host_step updates host master slices "
        "during the backward, which does not go with ",
        why ? why : "",
        "; change one of them");
  }
  TORCH_CHECK(
      options_.master_weights() || dtype_ == at::kFloat,
      "LowLevelZeroPlugin: master_weights(false) is not supported; "
      "the optimizer updates fp32 slices");
  TORCH_CHECK(
      !(dtype_ == at::kHalf && current_device().is_cpu()),
      "LowLevelZeroPlugin: precision 'fp16' needs a CUDA device "
      "(CPU LibTorch cannot multiply fp16 matrices); use "
      "precision('bf16') or precision('fp32') on CPU");
  if (options_.use_fp8()) {
    detail::check_use_fp8("LowLevelZeroPlugin", dtype_);
  }
}

void LowLevelZeroPlugin::configure(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer) {
  TORCH_CHECK(
      model != nullptr && optimizer != nullptr,
      "LowLevelZeroPlugin: boost needs both a model and an optimizer");
  auto module = model->unwrap();
  module->to(current_device(), dtype_);
  std::vector<at::Tensor> state = module->parameters();
  for (const auto& b : module->buffers()) {
    state.push_back(b);
  }
  broadcast_coalesced(state, 0, *dp_group_); // every rank starts equal
  auto zero_model = std::make_shared<LowLevelZeroModel>(
      model, dtype_, options_.cast_inputs());
  model = zero_model;

  auto zo = detail::zero_optimizer_options(
      options_,
      options_.stage(),
      dtype_,
      options_.reduce_bucket_size_in_m(),
      "LowLevelZeroPlugin");
  zo.overlap_host_step(options_.overlap_host_step());
  zo.overlap_allgather(options_.overlap_allgather());
  zo.fp8_communication(options_.fp8_communication());
  auto shards = dp_group_;
  if (options_.extra_dp_size() > 1) {
    auto groups = zero::detail::hybrid_groups(
        dp_group_, dp_group_->size() / options_.extra_dp_size(), "zero");
    shards = groups.shards != nullptr
        ? groups.shards
        : distributed::new_group(
              {distributed::get_rank()},
              "zero_alone_" + std::to_string(distributed::get_rank()));
    zo.replica_group(groups.replicas);
  }
  auto zero_opt = std::make_shared<zero::LowLevelZeroOptimizer>(
      optimizer->optimizer_ptr(), shards, zo);
  zero_model->optimizer = zero_opt;
  if (options_.overlap_allgather()) {
    model = std::make_shared<detail::GatherWaitModel>(
        model, zero_opt, "LowLevelZeroPlugin");
  }
  if (options_.use_fp8()) {
    model =
        std::make_shared<detail::Fp8LinearModel>(model, "LowLevelZeroPlugin");
  }
  optimizer = zero_opt;
}

NoSyncGuard LowLevelZeroPlugin::no_sync(
    interface::ModelWrapper&,
    interface::OptimizerWrapper* optimizer) {
  TORCH_CHECK(
      options_.stage() == 1,
      "LowLevelZeroPlugin: no_sync needs stage 1 (stage 2 keeps only "
      "gradient slices, so gradients cannot accumulate locally)");
  auto* zero_opt = dynamic_cast<zero::LowLevelZeroOptimizer*>(optimizer);
  TORCH_CHECK(
      zero_opt != nullptr,
      "LowLevelZeroPlugin.no_sync: pass the boosted optimizer");
  zero_opt->set_require_sync(false);
  return NoSyncGuard([zero_opt]() { zero_opt->set_require_sync(true); });
}

} // namespace plugin
} // namespace booster
} // namespace colossalai
