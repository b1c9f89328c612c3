#pragma once

#include <colossalai/data/distributed_sampler.h>

#include <torch/data/dataloader.h>

#include <algorithm>
#include <memory>

namespace colossalai {
namespace data {

/// A LibTorch data loader over one rank's share of a dataset, with
/// `set_epoch` to reshuffle (call it at the start of each epoch, as with
/// PyTorch's DistributedSampler) and `set_samples_seen` to resume mid-epoch
/// at any number of ranks (DistributedSampler).
///
/// Example:
/// \code
///   auto loader = plugin->prepare_dataloader(
///       dataset.map(torch::data::transforms::Stack<>()), 64, true);
///   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
///     loader->set_epoch(epoch);
///     for (auto& batch : *loader) { ... }
///   }
/// \endcode
template <class Dataset>
class DistributedDataLoader {
 public:
  using Loader = torch::data::StatelessDataLoader<Dataset, DistributedSampler>;

  DistributedDataLoader(
      Dataset dataset,
      DistributedSampler sampler,
      torch::data::DataLoaderOptions options)
      : sampler_(sampler),
        batch_size_(options.batch_size()),
        drop_last_(options.drop_last()),
        loader_(std::make_unique<Loader>(
            std::move(dataset),
            std::move(sampler),
            options)) {}

  auto begin() {
    return loader_->begin();
  }
  auto end() {
    return loader_->end();
  }
  void set_epoch(int64_t epoch) {
    sampler_.set_epoch(epoch);
  }
  /// The next pass draws this rank's share of what is left of the epoch
  /// after its first `n` samples (over all ranks).
  void set_samples_seen(size_t n) {
    sampler_.set_samples_seen(n);
  }
  /// The epoch's samples trained on, over all ranks, once every rank has
  /// taken `batches` batches of this pass: what a checkpoint saves as
  /// TrainingState::samples_in_epoch.
  size_t samples_seen(size_t batches) const {
    const size_t per_batch = batch_size_ * sampler_.num_replicas();
    const size_t drawn = std::min(batches, num_batches()) * per_batch;
    return std::min(
        sampler_.samples_seen() + drawn, sampler_.total_size());
  }
  const DistributedSampler& sampler() const {
    return sampler_;
  }
  /// Batches of this rank in a pass (what is left of the epoch).
  size_t num_batches() const {
    size_t n = sampler_.num_samples();
    return drop_last_ ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
  }

 private:
  DistributedSampler sampler_; // shares the epoch with the loader's copy
  size_t batch_size_;
  bool drop_last_;
  std::unique_ptr<Loader> loader_;
};

} // namespace data
} // namespace colossalai
