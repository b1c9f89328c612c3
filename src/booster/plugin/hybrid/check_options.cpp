#include "check_options.h"

#include <colossalai/initialize.h>
#include <colossalai/pipeline/schedule.h>

#include "../plugin_options.h"

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

namespace {

constexpr const char* kName = "HybridParallelPlugin";

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
    TORCH_CHECK(
        o.scheduler_nodes().empty(),
        kName,
        ": scheduler_nodes schedule a pipeline; they need pp_size > 1");
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
  if (!o.scheduler_nodes().empty()) {
    const int m = pipeline::check_schedule(
        o.scheduler_nodes(),
        pp,
        o.num_model_chunks(),
        style == "zbv",
        std::string(kName) + ": scheduler_nodes");
    TORCH_CHECK(
        o.num_microbatches() == 0 || o.num_microbatches() == m,
        kName,
        ": scheduler_nodes schedule ",
        m,
        " micro-batches, num_microbatches is ",
        o.num_microbatches());
    bool split = false;
    for (const auto& stage : o.scheduler_nodes()) {
      for (const auto& a : stage) {
        split = split || a.kind == pipeline::ActionKind::kBackwardInput ||
            a.kind == pipeline::ActionKind::kBackwardWeight;
      }
    }
    TORCH_CHECK(
        !split || o.gradient_checkpointing_ratio() == 0.0,
        kName,
        ": scheduler_nodes with split backward passes (BI, W) cannot "
        "recompute blocks (gradient_checkpointing_ratio must be 0): the "
        "input-gradient pass would accumulate weight gradients too");
  }
  TORCH_CHECK(
      o.zero_stage() < 2,
      kName,
      ": zero_stage 2 with pp_size > 1 is not supported (gradients are "
      "reduced once per step after every micro-batch; as in ColossalAI); "
      "use zero_stage(1) or 0");
}

} // namespace

HybridLayout check_hybrid_options(
    const HybridParallelPluginOptions& o,
    int world,
    bool experts) {
  HybridLayout out;
  const int tp = o.tp_size(), pp = o.pp_size();
  TORCH_CHECK(tp >= 1, kName, ": tp_size must be >= 1, got ", tp);
  TORCH_CHECK(pp >= 1, kName, ": pp_size must be >= 1, got ", pp);
  check_pipeline_options(o);
  TORCH_CHECK(
      o.zero_stage() >= 0 && o.zero_stage() <= 2,
      kName,
      ": zero_stage must be 0, 1 or 2, got ",
      o.zero_stage());
  out.dtype = parse_precision(o.precision(), kName, "precision");
  TORCH_CHECK(
      !o.enable_jit_fused(),
      kName,
      ": enable_jit_fused(true) is not supported: LibTorch has no TorchScript "
      "fusion of bias, dropout and residual add, so they run as separate ATen "
      "kernels (enable_all_optimization turns on the optimizations that "
      "exist: fused normalization and flash attention)");
  parse_precision(o.communication_dtype(), kName, "communication_dtype", true);
  TORCH_CHECK(
      !(out.dtype == at::kHalf && current_device().is_cpu()),
      kName,
      ": precision 'fp16' needs a CUDA device (CPU LibTorch cannot multiply "
      "fp16 matrices); use precision('bf16') or precision('fp32') on CPU");
  TORCH_CHECK(
      !(out.dtype == at::kHalf && o.zero_stage() == 0),
      kName,
      ": precision 'fp16' with zero_stage 0 is not supported (its loss "
      "scaler lives in the ZeRO optimizer); use zero_stage(1) or "
      "precision('bf16')");
  TORCH_CHECK(
      !(o.overlap_allgather() && o.zero_stage() == 0),
      kName,
      ": overlap_allgather needs zero_stage 1 or 2 (without ZeRO no "
      "parameter is all-gathered after the step); set zero_stage or "
      "overlap_allgather(false)");
  TORCH_CHECK(o.max_norm() >= 0, kName, ": max_norm must be >= 0");
  TORCH_CHECK(
      o.gradient_checkpointing_ratio() >= 0.0 &&
          o.gradient_checkpointing_ratio() <= 1.0,
      kName,
      ": gradient_checkpointing_ratio must be in [0, 1], got ",
      o.gradient_checkpointing_ratio());
  TORCH_CHECK(
      !(o.cpu_offload() && o.zero_stage() == 0),
      kName,
      ": cpu_offload needs zero_stage 1 or 2");
  TORCH_CHECK(
      o.make_vocab_size_divisible_by() > 0,
      kName,
      ": make_vocab_size_divisible_by must be positive");

  int sp = 1;
  if (o.enable_sequence_parallelism()) {
    out.sp_mode = o.sequence_parallelism_mode().empty()
        ? shardformer::SequenceParallelMode::kAllToAll
        : shardformer::parse_sequence_parallel_mode(
              o.sequence_parallelism_mode(), kName);
    const char* mode = shardformer::to_string(out.sp_mode);
    TORCH_CHECK(
        !o.enable_sequence_overlap() ||
            shardformer::on_tensor_group(out.sp_mode),
        kName,
        ": enable_sequence_overlap overlaps the column layers' collectives "
        "of sequence_parallelism_mode 'split_gather' (and 'ring', which "
        "overlaps already); '",
        mode,
        "' has none to overlap");
    if (shardformer::on_tensor_group(out.sp_mode)) {
      TORCH_CHECK(
          tp > 1,
          kName,
          ": sequence_parallelism_mode '",
          mode,
          "' runs on the tensor group and needs tp_size > 1");
      TORCH_CHECK(
          o.sp_size() <= 1,
          kName,
          ": sp_size is set by tp_size under '",
          mode,
          "'; leave sp_size unset (got ",
          o.sp_size(),
          ")");
    } else {
      sp = o.sp_size() == 0 ? 1 : o.sp_size();
      TORCH_CHECK(sp >= 1, kName, ": sp_size must be >= 1, got ", sp);
    }
  } else {
    TORCH_CHECK(
        o.sp_size() <= 1,
        kName,
        ": sp_size ",
        o.sp_size(),
        " needs enable_sequence_parallelism(true)");
    TORCH_CHECK(
        o.sequence_parallelism_mode().empty(),
        kName,
        ": sequence_parallelism_mode is set but "
        "enable_sequence_parallelism is false");
    TORCH_CHECK(
        !o.enable_sequence_overlap(),
        kName,
        ": enable_sequence_overlap needs enable_sequence_parallelism(true)");
  }
  out.sp_size = shardformer::on_tensor_group(out.sp_mode) ? tp : sp;
  TORCH_CHECK(
      o.inner_ring_size() == 0 ||
          out.sp_mode == shardformer::SequenceParallelMode::kRingAttn,
      kName,
      ": inner_ring_size sizes the inner rings of "
      "sequence_parallelism_mode 'ring_attn' (double ring attention); "
      "leave it 0 without ring_attn");
  TORCH_CHECK(
      o.inner_ring_size() >= 0 && o.inner_ring_size() <= sp &&
          (o.inner_ring_size() == 0 || sp % o.inner_ring_size() == 0),
      kName,
      ": inner_ring_size ",
      o.inner_ring_size(),
      " must divide sp_size ",
      sp,
      " (0: one ring)");
  TORCH_CHECK(
      world % (tp * pp * sp) == 0,
      kName,
      ": the world size ",
      world,
      " is not divisible by tp_size x pp_size x sp_size = ",
      tp * pp * sp);
  out.dp_size = world / (tp * pp * sp);
  out.sp_axis_size = sp;
  const int ep = o.ep_size();
  TORCH_CHECK(
      experts || ep == 1,
      kName,
      ": ep_size ",
      ep,
      " needs MoeHybridParallelPlugin (HybridParallelPlugin does not split "
      "experts)");
  TORCH_CHECK(
      ep >= 1, "MoeHybridParallelPlugin: ep_size must be >= 1, got ", ep);
  TORCH_CHECK(
      out.dp_size % ep == 0,
      "MoeHybridParallelPlugin: ep_size ",
      ep,
      " must divide the data-parallel size world / (tp_size x pp_size x "
      "sp_size) = ",
      out.dp_size,
      " (experts are split over data-parallel ranks)");
  TORCH_CHECK(
      !(experts && o.enable_sequence_parallelism()),
      "MoeHybridParallelPlugin: sequence parallelism is not supported with "
      "experts (each sparse layer routes the rows of whole sequences); set "
      "enable_sequence_parallelism(false)");
  out.ep_size = ep;
  out.moe_dp_size = out.dp_size / ep;
  return out;
}

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
