#include <colossalai/pipeline/stage_manager.h>

#include <c10/util/Exception.h>

#include <numeric>

namespace colossalai {
namespace pipeline {

PipelineStageManager::PipelineStageManager(
    distributed::ProcessGroupPtr group,
    int num_model_chunks,
    bool use_zbv)
    : group_(std::move(group)),
      num_model_chunks_(num_model_chunks),
      use_zbv_(use_zbv) {
  TORCH_CHECK(group_ != nullptr, "PipelineStageManager: no pipeline group");
  stage_ = group_->rank();
  num_stages_ = group_->size();
  TORCH_CHECK(
      num_model_chunks_ >= 1,
      "PipelineStageManager: num_model_chunks must be >= 1, got ",
      num_model_chunks_);
  TORCH_CHECK(
      !use_zbv_ || num_model_chunks_ == 2,
      "PipelineStageManager: the V shape needs num_model_chunks 2, got ",
      num_model_chunks_);
}

int virtual_stage_index(int stage, int chunk, int num_stages, bool zbv) {
  if (zbv) {
    return chunk == 0 ? stage : 2 * num_stages - 1 - stage;
  }
  return chunk * num_stages + stage;
}

int PipelineStageManager::virtual_stage_of(int stage, int chunk) const {
  TORCH_INTERNAL_ASSERT(
      stage >= 0 && stage < num_stages_ && chunk >= 0 &&
      chunk < num_model_chunks_);
  return virtual_stage_index(stage, chunk, num_stages_, use_zbv_);
}

std::pair<int, int> PipelineStageManager::locate(int v) const {
  TORCH_INTERNAL_ASSERT(v >= 0 && v < num_virtual_stages());
  if (use_zbv_) {
    return v < num_stages_ ? std::make_pair(v, 0)
                           : std::make_pair(2 * num_stages_ - 1 - v, 1);
  }
  return {v % num_stages_, v / num_stages_};
}

bool PipelineStageManager::holds_first_stage() const {
  for (int c = 0; c < num_model_chunks_; ++c) {
    if (is_first_stage(c)) {
      return true;
    }
  }
  return false;
}

bool PipelineStageManager::holds_last_stage() const {
  for (int c = 0; c < num_model_chunks_; ++c) {
    if (is_last_stage(c)) {
      return true;
    }
  }
  return false;
}

std::vector<int64_t> PipelineStageManager::distribute_layers(
    int64_t num_layers,
    const std::vector<int>& per_stage) const {
  const int v = num_virtual_stages();
  if (!per_stage.empty()) {
    TORCH_CHECK(
        static_cast<int>(per_stage.size()) == v,
        "num_layers_per_stage must have pp_size x num_model_chunks = ",
        v,
        " entries, got ",
        per_stage.size());
    int64_t sum = 0;
    for (int n : per_stage) {
      TORCH_CHECK(n >= 1, "num_layers_per_stage: every stage needs a layer");
      sum += n;
    }
    TORCH_CHECK(
        sum == num_layers,
        "num_layers_per_stage sums to ",
        sum,
        " but the model has ",
        num_layers,
        " layers");
    return std::vector<int64_t>(per_stage.begin(), per_stage.end());
  }
  TORCH_CHECK(
      num_layers >= v,
      "the model's ",
      num_layers,
      " layers cannot be split over ",
      v,
      " pipeline stages (pp_size x num_model_chunks)");
  std::vector<int64_t> out;
  for (int s = 0; s < v; ++s) {
    auto r = shardformer::stage_block_range(num_layers, s, v);
    out.push_back(r.second - r.first);
  }
  return out;
}

shardformer::StageLayers PipelineStageManager::stage_layers_of(
    int stage,
    int chunk,
    const std::vector<int64_t>& per_stage) const {
  TORCH_INTERNAL_ASSERT(
      static_cast<int>(per_stage.size()) == num_virtual_stages());
  const int v = virtual_stage_of(stage, chunk);
  shardformer::StageLayers out;
  out.begin = std::accumulate(per_stage.begin(), per_stage.begin() + v, 0L);
  out.end = out.begin + per_stage[v];
  out.first = v == 0;
  out.last = v == num_virtual_stages() - 1;
  return out;
}

} // namespace pipeline
} // namespace colossalai
