#pragma once

#include <torch/data/samplers/base.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace colossalai {
namespace data {

/// Splits a dataset of `size` samples over `num_replicas` ranks, like
/// torch.utils.data.DistributedSampler: with shuffle, the permutation depends
/// only on seed + epoch, so every rank draws the same one and takes every
/// `num_replicas`-th index from `rank`. Without drop_last, indices repeat to
/// make every rank's share equal; with drop_last, the tail is dropped.
///
/// Copies share the epoch and the resume point, so `set_epoch` and
/// `set_samples_seen` on the copy a loader holds are seen by the loader.
///
/// Resuming mid-epoch, at any number of replicas: the epoch's order is one
/// permutation of the dataset, and after b batches of B samples on each of
/// R replicas exactly its first b·B·R entries were trained on (replica r
/// takes entries r, r + R, ...). `set_samples_seen(b·B·R)` makes the
/// replicas now present split what is left of that order the same way, so
/// no sample of the epoch is drawn twice or skipped, and at an unchanged
/// replica count every rank draws what it would have drawn without the stop.
///
/// Example:
/// \code
///   // state saved with samples_in_epoch = loader->samples_seen(batches)
///   loader->set_epoch(state.epoch());
///   loader->set_samples_seen(state.samples_in_epoch());
///   for (auto& batch : *loader) { ... } // the rest of that epoch
/// \endcode
class DistributedSampler
    : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  DistributedSampler(
      size_t size,
      int num_replicas,
      int rank,
      bool shuffle = true,
      uint64_t seed = 1024,
      bool drop_last = false);

  /// Starts epoch `epoch`'s order; a different epoch than the current one
  /// also starts it from its beginning (samples_seen 0).
  void set_epoch(int64_t epoch);
  int64_t epoch() const {
    return shared_->epoch;
  }
  /// The first `n` samples of the current epoch's order, counted over all
  /// replicas, were trained on already: this rank draws its share of the
  /// rest (ColossalAI's StatefulDistributedSampler.set_start_index counts
  /// per rank instead, which only holds at the same world size). Beyond the
  /// epoch's `total_size()`, nothing is left.
  void set_samples_seen(size_t n);
  size_t samples_seen() const {
    return shared_->samples_seen;
  }
  /// Samples all replicas draw per epoch: the dataset padded up to (or, with
  /// drop_last, cut down to) a multiple of the replicas.
  size_t total_size() const {
    return num_samples_ * static_cast<size_t>(num_replicas_);
  }
  int num_replicas() const {
    return num_replicas_;
  }
  /// Samples this rank draws in the current epoch (after `samples_seen`).
  size_t num_samples() const;
  /// This rank's indices for the current epoch.
  std::vector<size_t> indices() const;

  void reset(torch::optional<size_t> new_size = torch::nullopt) override;
  torch::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  void compute_sizes();

  size_t size_;
  int num_replicas_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  size_t num_samples_ = 0; // per rank, whole epoch
  struct Shared {
    int64_t epoch = 0;
    size_t samples_seen = 0;
  };
  std::shared_ptr<Shared> shared_;
  std::vector<size_t> order_;
  size_t cursor_ = 0;
};

} // namespace data
} // namespace colossalai
