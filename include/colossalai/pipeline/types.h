#pragma once

/// What `Booster::execute_pipeline` takes and returns (kept light: the
/// plugin interface includes it).

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace colossalai {
namespace pipeline {

/// One batch: tensors cut along dim 0 into micro-batches (e.g. {ids,
/// targets}).
using Batch = std::vector<at::Tensor>;
/// Gives the next batch (ColossalAI's data_iter: `next(data_iter)` once per
/// step, on every rank).
using DataIterator = std::function<Batch()>;
/// `criterion(outputs, micro_batch)` -> the scalar loss of one micro-batch.
using PipelineCriterion =
    std::function<at::Tensor(const at::Tensor& outputs, const Batch& batch)>;

/// What a step returns (ColossalAI's {'loss', 'outputs'}): the loss
/// averaged over the micro-batches (weighted by their counted tokens when
/// the policy counts them: Policy::loss_items), on the rank that holds the
/// last virtual stage (undefined elsewhere), and with `return_outputs` that
/// stage's outputs concatenated along dim 0.
struct PipelineOutput {
  at::Tensor loss;
  at::Tensor outputs;
};

/// One step of a pipeline schedule (NOTE [Pipeline schedules] in
/// pipeline/schedule.h): a pass of model chunk `chunk` on micro-batch
/// `micro_batch`.
enum class ActionKind {
  kForward,
  kBackward,      ///< input and weight gradients at once
  kBackwardInput, ///< the input's gradient (zero-bubble)
  kBackwardWeight ///< the weights' gradients (zero-bubble)
};

struct Action {
  ActionKind kind;
  int chunk;
  int micro_batch;
  bool operator==(const Action& o) const {
    return kind == o.kind && chunk == o.chunk && micro_batch == o.micro_batch;
  }
};

} // namespace pipeline
} // namespace colossalai
