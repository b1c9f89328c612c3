#pragma once

#include <colossalai/booster/plugin/plugin_base.h>
#include <colossalai/cluster/process_group_mesh.h>
#include <colossalai/data/dataloader.h>
#include <colossalai/distributed/process_group.h>

#include <torch/data/dataloader_options.h>

namespace colossalai {
namespace booster {
namespace plugin {

/// Base of the data-parallel plugins: owns a one-axis mesh of all ranks (the
/// data-parallel group) and prepares data loaders that shard a dataset over
/// it. Requires `colossalai::launch`.
class DPPluginBase : public Plugin {
 public:
  DPPluginBase();

  cluster::ProcessGroupMesh& pg_mesh() {
    return *mesh_;
  }
  int dp_rank() const override {
    return dp_group_->rank();
  }
  int dp_size() const override {
    return dp_group_->size();
  }
  const distributed::ProcessGroupPtr& dp_group() const {
    return dp_group_;
  }

  /// A loader over this rank's share of `dataset` (a torch::data dataset,
  /// usually `.map(Stack<>())`). Deterministic for `seed` and the epoch set
  /// with `set_epoch`; `num_workers` background threads load batches.
  template <class Dataset>
  std::unique_ptr<data::DistributedDataLoader<Dataset>> prepare_dataloader(
      Dataset dataset,
      size_t batch_size,
      bool shuffle = false,
      uint64_t seed = 1024,
      bool drop_last = false,
      size_t num_workers = 0) const {
    TORCH_CHECK(
        batch_size > 0,
        name(),
        ".prepare_dataloader: batch_size ",
        "must be > 0");
    auto size = dataset.size();
    TORCH_CHECK(
        size.has_value(),
        name(),
        ".prepare_dataloader: the dataset ",
        "must have a size");
    data::DistributedSampler sampler(
        *size, dp_size(), dp_rank(), shuffle, seed, drop_last);
    return std::make_unique<data::DistributedDataLoader<Dataset>>(
        std::move(dataset),
        std::move(sampler),
        torch::data::DataLoaderOptions(batch_size)
            .drop_last(drop_last)
            .workers(num_workers));
  }

 protected:
  std::unique_ptr<cluster::ProcessGroupMesh> mesh_;
  distributed::ProcessGroupPtr dp_group_;
};

} // namespace plugin
} // namespace booster
} // namespace colossalai
