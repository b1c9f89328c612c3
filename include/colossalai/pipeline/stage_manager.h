#pragma once

/// Which layers each pipeline stage runs (ColossalAI's
/// `pipeline.stage_manager.PipelineStageManager`).
///
/// The stages are the ranks of the pipeline group (a `ProcessGroupMesh`
/// axis). With `num_model_chunks` > 1 each rank holds several model chunks:
/// the model is cut into stages x chunks virtual stages. Interleaved
/// schedules place virtual stage v on rank v % stages (chunk v / stages);
/// the zero-bubble V shape places chunk 0 of rank s at virtual stage s and
/// chunk 1 at 2 stages - 1 - s, so the first rank holds both the embeddings
/// and the head.
///
/// Example:
/// \code
///   PipelineStageManager sm(pp_group, /*num_model_chunks=*/2);
///   auto per_stage = sm.distribute_layers(12);   // 3 layers x 4 virtual
///   auto mine = sm.stage_layers(0, per_stage);   // chunk 0's layers
/// \endcode

#include <colossalai/distributed/process_group.h>
#include <colossalai/shardformer/policy.h>

#include <utility>
#include <vector>

namespace colossalai {
namespace pipeline {

/// The virtual stage of `chunk` on `stage`: chunk x stages + stage
/// (interleaved), or the V shape's s / 2 stages - 1 - s (`zbv`, two chunks).
int virtual_stage_index(int stage, int chunk, int num_stages, bool zbv);

class PipelineStageManager {
 public:
  /// `group`: the pipeline group; this rank's stage is its rank there.
  PipelineStageManager(
      distributed::ProcessGroupPtr group,
      int num_model_chunks = 1,
      bool use_zbv = false);

  int stage() const {
    return stage_;
  }
  int num_stages() const {
    return num_stages_;
  }
  int num_model_chunks() const {
    return num_model_chunks_;
  }
  int num_virtual_stages() const {
    return num_stages_ * num_model_chunks_;
  }
  bool use_zbv() const {
    return use_zbv_;
  }
  const distributed::ProcessGroupPtr& group() const {
    return group_;
  }

  /// The virtual stage of `chunk` on `stage` (this rank's by default).
  int virtual_stage(int chunk) const {
    return virtual_stage_of(stage_, chunk);
  }
  int virtual_stage_of(int stage, int chunk) const;
  /// {stage, chunk} that runs virtual stage `v`.
  std::pair<int, int> locate(int v) const;
  /// Whether this rank's `chunk` is the first / last virtual stage.
  bool is_first_stage(int chunk = 0) const {
    return virtual_stage(chunk) == 0;
  }
  bool is_last_stage(int chunk) const {
    return virtual_stage(chunk) == num_virtual_stages() - 1;
  }
  /// Whether any chunk of this rank is the first / last virtual stage.
  bool holds_first_stage() const;
  bool holds_last_stage() const;

  /// Layers per virtual stage: `num_layers_per_stage` checked (one entry
  /// per virtual stage, summing to `num_layers`), or an even split with
  /// the remainder on the middle stages (ColossalAI's distribute_layers).
  std::vector<int64_t> distribute_layers(
      int64_t num_layers,
      const std::vector<int>& num_layers_per_stage = {}) const;
  /// This rank's `chunk`: its layer range and whether it is first / last.
  shardformer::StageLayers stage_layers(
      int chunk,
      const std::vector<int64_t>& layers_per_virtual_stage) const {
    return stage_layers_of(stage_, chunk, layers_per_virtual_stage);
  }
  /// The same for `chunk` of any `stage`.
  shardformer::StageLayers stage_layers_of(
      int stage,
      int chunk,
      const std::vector<int64_t>& layers_per_virtual_stage) const;

 private:
  distributed::ProcessGroupPtr group_;
  int stage_;
  int num_stages_;
  int num_model_chunks_;
  bool use_zbv_;
};

} // namespace pipeline
} // namespace colossalai
