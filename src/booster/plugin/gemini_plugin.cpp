#include <colossalai/booster/plugin/gemini_plugin.h>

#include "../../zero/common/flat_params.h"
#include "../../zero/gemini/chunk_plan.h"
#include "fp8_linear_model.h"
#include "fully_sharded_parts.h"
#include "plugin_options.h"

#include <colossalai/initialize.h>
#include <colossalai/quantization/fp8.h>

#include <torch/version.h>

#include <set>

namespace colossalai {
namespace booster {
namespace plugin {

namespace {

zero::FullyShardedOptions engine_options(const GeminiPluginOptions& o) {
  const auto dtype =
      detail::parse_precision(o.precision(), "GeminiPlugin", "precision");
  TORCH_CHECK(
      dtype != at::kHalf || current_device().is_cuda(),
      "GeminiPlugin: precision 'fp16' needs a CUDA device (CPU LibTorch "
      "cannot multiply fp16 matrices); use precision 'bf16' or 'fp32'");
  TORCH_CHECK(
      o.placement_policy() == "static" || o.placement_policy() == "auto",
      "GeminiPlugin: placement_policy must be 'static' or 'auto', got '",
      o.placement_policy(),
      "'");
  const bool autop = o.placement_policy() == "auto";
  auto fraction = [](double f, const char* option) {
    TORCH_CHECK(
        f >= 0.0 && f <= 1.0,
        "GeminiPlugin: ",
        option,
        " must be in [0, 1], got ",
        f);
  };
  fraction(o.shard_param_frac(), "shard_param_frac");
  fraction(o.offload_optim_frac(), "offload_optim_frac");
  fraction(o.offload_param_frac(), "offload_param_frac");
  fraction(o.warmup_non_model_data_ratio(), "warmup_non_model_data_ratio");
  fraction(o.steady_cuda_cap_ratio(), "steady_cuda_cap_ratio");
  TORCH_CHECK(
      !autop ||
          (o.offload_optim_frac() == 0.0 && o.offload_param_frac() == 0.0),
      "GeminiPlugin: offload_optim_frac and offload_param_frac are for "
      "placement_policy 'static'; 'auto' places every chunk itself");
  TORCH_CHECK(
      o.offload_param_frac() == 0.0 ||
          (o.shard_param_frac() == 1.0 && o.offload_optim_frac() == 1.0),
      "GeminiPlugin: offload_param_frac needs shard_param_frac 1.0 and "
      "offload_optim_frac 1.0 (a chunk whose fp32 shard is on the device "
      "gathers from it); got shard_param_frac ",
      o.shard_param_frac(),
      ", offload_optim_frac ",
      o.offload_optim_frac());
  fraction(o.gpu_margin_mem_ratio(), "gpu_margin_mem_ratio");
  TORCH_CHECK(
      autop || o.gpu_margin_mem_ratio() == 0.0,
      "GeminiPlugin: gpu_margin_mem_ratio is for placement_policy 'auto' "
      "(static placement puts optimizer states by offload_optim_frac); got ",
      o.gpu_margin_mem_ratio());
  TORCH_CHECK(
      o.device_memory_capacity() >= 0,
      "GeminiPlugin: device_memory_capacity must be >= 0 (0: the device's), "
      "got ",
      o.device_memory_capacity());
  TORCH_CHECK(
      o.master_weights(),
      "GeminiPlugin: master_weights(false) is not supported (the fp32 shards "
      "are the master weights)");
  TORCH_CHECK(
      o.tp_size() == 1,
      "GeminiPlugin: tp_size must be 1 (use HybridParallelPlugin for tensor "
      "parallelism)");
  TORCH_CHECK(
      o.extra_dp_size() >= 1,
      "GeminiPlugin: extra_dp_size must be >= 1, got ",
      o.extra_dp_size());
  TORCH_CHECK(
      o.max_prefetch() >= 0,
      "GeminiPlugin: max_prefetch must be >= 0, got ",
      o.max_prefetch());
  TORCH_CHECK(
      o.chunk_size() >= 0,
      "GeminiPlugin: chunk_size must be >= 0 (0: searched), got ",
      o.chunk_size());
  TORCH_CHECK(
      o.norm_type() == 2.0,
      "GeminiPlugin: only norm_type 2.0 is supported, got ",
      o.norm_type());
  if (o.overlap_host_step()) {
    const char* why = o.enable_gradient_accumulation()
        ? "enable_gradient_accumulation: several backwards add to gradients "
          "the first one's overlapped step already consumed"
        : o.max_norm() > 0
        ? "max_norm: clipping needs the global norm of every gradient "
          "before any chunk is updated"
        : dtype == at::kHalf
        ? "precision fp16: the loss scaler may skip the step, known only "
          "after the whole backward"
        : nullptr;
    TORCH_CHECK(
        why == nullptr,
        "GeminiPlugin: overlap_host_step updates host chunks during the "
        "backward, which cannot serve ",
        why ? why : "",
        "; turn one of them off");
  }
  TORCH_CHECK(
      !o.fp8_communication() || quantization::fp8_supported(),
      "GeminiPlugin: fp8_communication needs LibTorch 2.1 or later (its "
      "float8 dtypes); this is ",
      TORCH_VERSION);
  if (o.use_fp8()) {
    detail::check_use_fp8("GeminiPlugin", dtype);
  }
  TORCH_CHECK(
      o.pin_memory() || !current_device().is_cuda(),
      "GeminiPlugin: pin_memory(false) is not supported on a CUDA device: "
      "host chunks are page-locked, so their transfers run asynchronously "
      "(the default, pin_memory(true))");
  zero::FullyShardedOptions e;
  e.param_dtype(dtype)
      .reduce_dtype(dtype)
      .overlap_host_step(o.overlap_host_step())
      .fp8_communication(o.fp8_communication());
  zero::PlacementOptions po;
  po.policy(
        autop ? zero::PlacementPolicy::kAuto : zero::PlacementPolicy::kStatic)
      .offload_optim_fraction(o.offload_optim_frac())
      .keep_gathered_fraction(1.0 - o.shard_param_frac())
      .offload_param_fraction(o.offload_param_frac())
      .device_capacity(o.device_memory_capacity())
      .warmup_non_model_data_ratio(o.warmup_non_model_data_ratio())
      .steady_cuda_cap_ratio(o.steady_cuda_cap_ratio())
      .gpu_margin_mem_ratio(o.gpu_margin_mem_ratio());
  e.placement(po);
  // Every module that opens a ForwardScope gathers the chunks it needs.
  e.auto_wrap_policy(zero::size_based_wrap_policy(0));
  e.forward_prefetch(o.max_prefetch() > 0);
  e.backward_prefetch(
      o.max_prefetch() > 0 ? zero::BackwardPrefetch::kBackwardPre
                           : zero::BackwardPrefetch::kNone);
  return e;
}

// force_outputs_fp32: floating outputs cast to float32 (a differentiable
// cast: the gradient reaches the 16-bit graph in its own dtype).
class OutputsFp32Model : public interface::ModelWrapper {
 public:
  using interface::ModelWrapper::ModelWrapper;

 protected:
  at::Tensor transform_output(const at::Tensor& output) override {
    // As ColossalAI's _cast_float: every floating dtype, float64 included.
    return output.defined() && output.is_floating_point() &&
            output.scalar_type() != at::kFloat
        ? output.to(at::kFloat)
        : output;
  }
};

} // namespace

GeminiPlugin::GeminiPlugin(GeminiPluginOptions options)
    : gemini_(std::move(options)), engine_(engine_options(gemini_)) {
  engine_.process_group(dp_group_);
  TORCH_CHECK(
      dp_group_->size() % gemini_.extra_dp_size() == 0,
      "GeminiPlugin: extra_dp_size (",
      gemini_.extra_dp_size(),
      ") must divide the data-parallel size ",
      dp_group_->size());
}

std::shared_ptr<checkpoint_io::CheckpointIO> GeminiPlugin::get_checkpoint_io() {
  return detail::fully_sharded_checkpoint_io(dp_group_, name());
}

void GeminiPlugin::configure(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer) {
  TORCH_CHECK(model != nullptr, "GeminiPlugin: boost needs a model");
  // The ranks that share one copy of the chunks (ColossalAI's zero group).
  const int dp = dp_group_->size() / gemini_.extra_dp_size();
  int64_t chunk_size = gemini_.chunk_size();
  bool keep_gathered = false;
  if (chunk_size == 0) {
    std::vector<int64_t> numels;
    std::set<const void*> seen;
    for (const auto& p : model->unwrap()->parameters()) {
      if (seen.insert(p.unsafeGetTensorImpl()).second) {
        numels.push_back(p.numel());
      }
    }
    zero::gemini::ChunkSearchOptions so;
    so.search_range_m = gemini_.search_range_m();
    so.search_interval = gemini_.hidden_dim() > 0 ? gemini_.hidden_dim() : 1024;
    so.min_chunk_size_m = gemini_.min_chunk_size_m();
    const auto found = zero::gemini::search_chunk_size(numels, dp, so);
    chunk_size = std::max<int64_t>(found.chunk_size, 1);
    keep_gathered = found.keep_gathered;
  }
  auto engine = engine_; // this model's chunks
  engine.chunk_size(chunk_size);
  // bf16 gradient shards as ColossalAI's chunks hold them, for an optimizer
  // that steps from them (NOTE [Gradient shards in bf16]); fp16's stay
  // float32, where the loss scale is undone.
  engine.keep_low_precision_grads(
      gemini_.precision() == "bf16" && optimizer != nullptr &&
      zero::detail::steps_from_low_precision_grads(optimizer->unwrap()));
  // A model below min_chunk_size is one chunk kept gathered on every rank,
  // its gradients all-reduced (ColossalAI's keep_gathered).
  // With extra_dp_size, each group of dp consecutive ranks shards one copy
  // and the copies all-reduce their gradient shards.
  engine.sharding_strategy(
      keep_gathered                     ? zero::ShardingStrategy::kNoShard
          : gemini_.extra_dp_size() > 1 ? zero::ShardingStrategy::kHybridShard
                                        : zero::ShardingStrategy::kFullShard);
  engine.hybrid_shard_size(dp);
  zero::ShardedOptimizerOptions oo;
  oo.max_norm(gemini_.max_norm()).norm_type(gemini_.norm_type());
  if (gemini_.precision() == "fp16") {
    oo.loss_scaler(detail::loss_scaler_options(gemini_));
  }
  detail::shard_fully(model, optimizer, engine, oo);
  if (gemini_.use_fp8()) {
    model = std::make_shared<detail::Fp8LinearModel>(model, "GeminiPlugin");
  }
  if (gemini_.force_outputs_fp32()) {
    model = std::make_shared<OutputsFp32Model>(model);
  }
}

} // namespace plugin
} // namespace booster
} // namespace colossalai
