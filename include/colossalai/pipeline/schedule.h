#pragma once

/// Pipeline schedules (ColossalAI's `pipeline.schedule`): the order in which
/// each stage runs the forward and backward passes of the micro-batches,
/// and the one engine that runs any such order.
///
/// NOTE [Pipeline schedules]
/// A schedule is, per stage, a list of actions on (model chunk,
/// micro-batch): F (forward), B (backward) and, for zero-bubble schedules,
/// B split into BI (the input's gradient only, which the previous stage
/// waits for) and W (the weights' gradients, which nobody waits for, so
/// they fill the bubbles). The generators:
///  - `one_f_one_b`: p - s - 1 warm-up forwards on stage s, then one
///    forward / one backward, then the remaining backwards. Bubble
///    (p - 1) / (m + p - 1).
///  - `interleaved` (Megatron): each rank holds `chunks` model chunks; the
///    warm-up runs ahead through the chunks, so the bubble shrinks by the
///    number of chunks. m must be a multiple of p.
///  - `zero_bubble_v` (ZB-V): two chunks in a V (the first rank holds the
///    embeddings and the head). Generated greedily by simulating every
///    stage with unit costs: a ready BI first, then a ready F (chunk 1, on
///    the way to the loss, before chunk 0) while at most p micro-batches per
///    chunk hold activations, else a pending W.
///    `ScheduleCosts` (ColossalAI's PipelineGraph costs) weighs the
///    passes and the hops between stages, and caps the micro-batches
///    holding activations.
/// `simulate` runs a schedule's per-stage lists with unit costs (or
/// `ScheduleCosts`) and blocking receives, as the engine does; a schedule
/// it finishes cannot deadlock in the engine (every action's inputs are
/// produced by actions that started earlier in the simulation), and its
/// idle share is the schedule's bubble. A schedule of one's own
/// (HybridParallelPluginOptions::scheduler_nodes) is checked with
/// `check_schedule`.
///
/// The engine (`PipelineSchedule`) runs one stage's list: a forward reads
/// the micro-batch (first virtual stage) or the previous stage's output, and
/// sends its own output on (the last virtual stage applies the criterion
/// and divides the loss by the number of micro-batches, as ColossalAI
/// does, or weighs it by its share of the batch's tokens: NOTE [Token-mean
/// losses]); a backward receives the output's gradient and sends the input's
/// back. Transfers are asynchronous (NOTE [Pipeline p2p]); with
/// `overlap_p2p` the receive of the next action is posted before the
/// current action computes.
///
/// Example:
/// \code
///   auto actions = one_f_one_b(/*stage=*/1, /*stages=*/4, /*m=*/8);
///   auto sim = simulate(generate("1f1b", 4, 1, 8), 1, false); // sim.bubble
///   // ZB-V for weight passes twice as long as the others, hops of 1:
///   auto costs = ScheduleCosts().backward_weight(2).comm(1);
///   auto v = zero_bubble_v(4, 8, costs);
///   auto bubble = simulate(v, 2, true, costs).bubble;
/// \endcode

#include <colossalai/pipeline/p2p.h>
#include <colossalai/pipeline/stage_manager.h>
#include <colossalai/pipeline/types.h>

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace pipeline {

/// "F0.3" (forward, chunk 0, micro-batch 3), "B", "BI", "W".
std::string to_string(const Action& a);

std::vector<Action> one_f_one_b(
    int stage,
    int num_stages,
    int num_microbatches);
std::vector<Action> interleaved(
    int stage,
    int num_stages,
    int num_chunks,
    int num_microbatches);
/// What each pass costs, in any time unit (ColossalAI's PipelineGraph
/// f_cost, b_cost, w_cost, c_cost): a forward, a whole backward (B, of
/// 1F1B and interleaved), an input gradient (BI), a weight gradient (W),
/// and a hop between two stages (a hand-off inside a stage is free). The
/// defaults are one unit per action. `max_in_flight`: how many
/// micro-batches per chunk a stage may hold activations for in
/// zero_bubble_v (ColossalAI's memory limit, counted in micro-batches;
/// 0: num_stages).
struct ScheduleCosts {
  TORCH_ARG(int64_t, forward) = 1;
  TORCH_ARG(int64_t, backward) = 1;
  TORCH_ARG(int64_t, backward_input) = 1;
  TORCH_ARG(int64_t, backward_weight) = 1;
  TORCH_ARG(int64_t, comm) = 0;
  TORCH_ARG(int, max_in_flight) = 0;
};

/// Every stage's list (the V shape is generated for all stages at once),
/// for passes that cost `costs`.
std::vector<std::vector<Action>> zero_bubble_v(
    int num_stages,
    int num_microbatches,
    const ScheduleCosts& costs = {});
/// Every stage's list for `style` ("1f1b", "interleaved", "zbv").
std::vector<std::vector<Action>> generate(
    const std::string& style,
    int num_stages,
    int num_chunks,
    int num_microbatches);

struct Simulation {
  /// Time until the last stage finishes (in the costs' unit).
  int64_t makespan = 0;
  /// Idle share of stages x makespan.
  double bubble = 0;
};
/// Runs `schedule` with `costs` (unit costs by default) and blocking
/// receives; throws naming the stuck stages if it deadlocks or an action is
/// missing or repeated.
Simulation simulate(
    const std::vector<std::vector<Action>>& schedule,
    int num_chunks,
    bool zbv,
    const ScheduleCosts& costs = {});

/// Where the schedule's messages between two stages arrive in another
/// order than they are sent ("" when they never do): the first pair and
/// message that differ. The engine posts receives in its actions' order, and
/// NCCL matches a pair's messages by order, not by tag (NOTE [Pipeline
/// p2p]); every generated schedule passes (test_pipeline).
std::string p2p_order_mismatch(
    const std::vector<std::vector<Action>>& schedule,
    int num_chunks,
    bool zbv);

/// Checks a schedule of one's own for `num_stages` stages of `num_chunks`
/// chunks (the V's layout when `zbv`): one list per stage, chunks and
/// micro-batches in range, micro-batches 0 .. m - 1 all used, every pass
/// run once and nothing deadlocking (`simulate`), each pair of stages
/// receiving in send order (`p2p_order_mismatch`). Throws naming the first
/// problem, prefixed by `who`; returns m.
int check_schedule(
    const std::vector<std::vector<Action>>& schedule,
    int num_stages,
    int num_chunks,
    bool zbv,
    const std::string& who);

/// One action's span in the last step (milliseconds from its start).
struct TimelineEvent {
  Action action;
  double start_ms;
  double end_ms;
};

/// The model's part of a step: runs model chunk `chunk` on one micro-batch
/// (`hidden` is undefined on the first virtual stage).
using StageForward = std::function<at::Tensor(
    int chunk,
    const std::vector<at::Tensor>& micro_batch,
    const at::Tensor& hidden)>;

class PipelineSchedule {
 public:
  /// `custom`: every stage's list to run instead of `style`'s generated
  /// one (checked with check_schedule); it fixes the micro-batch count.
  PipelineSchedule(
      std::shared_ptr<PipelineStageManager> stage_manager,
      std::shared_ptr<PipelineP2PCommunication> p2p,
      std::string style,
      bool overlap_p2p,
      std::vector<std::vector<Action>> custom = {});

  /// Runs forward and backward of every micro-batch in this stage's order;
  /// with gradients disabled (a NoGradGuard, as ColossalAI reads
  /// torch.is_grad_enabled()), forward only: the schedule's forwards in
  /// the same order, for evaluation.
  /// `chunk_params[c]`: chunk c's trainable parameters (weight passes);
  /// `scale_loss`: the loss the backward starts from (loss scaling);
  /// `loss_weights[i]`: micro-batch i's loss is multiplied by it (empty:
  /// 1 / num_microbatches each), so the step's loss is their weighted sum.
  PipelineOutput forward_backward_step(
      const std::vector<std::vector<at::Tensor>>& micro_batches,
      const StageForward& forward,
      const std::vector<std::vector<at::Tensor>>& chunk_params,
      const PipelineCriterion& criterion,
      const std::function<at::Tensor(const at::Tensor&)>& scale_loss,
      bool return_loss,
      bool return_outputs,
      const std::vector<double>& loss_weights = {});

  /// This stage's actions in the last step, with their times.
  const std::vector<TimelineEvent>& timeline() const {
    return timeline_;
  }
  const std::string& style() const {
    return style_;
  }
  const PipelineStageManager& stage_manager() const {
    return *sm_;
  }

 private:
  std::shared_ptr<PipelineStageManager> sm_;
  std::shared_ptr<PipelineP2PCommunication> p2p_;
  std::string style_;
  bool overlap_;
  std::vector<std::vector<Action>> custom_;
  int custom_m_ = 0;
  std::vector<TimelineEvent> timeline_;
  // Generated per micro-batch count (ZB-V generates all stages at once).
  int cached_m_ = -1;
  std::vector<Action> actions_;
};

} // namespace pipeline
} // namespace colossalai
