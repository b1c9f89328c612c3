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
/// Copies share the epoch, so `set_epoch` on the copy a loader holds is seen
/// by the loader.
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

  void set_epoch(int64_t epoch) {
    *epoch_ = epoch;
  }
  int64_t epoch() const {
    return *epoch_;
  }
  /// Samples this rank draws per epoch.
  size_t num_samples() const {
    return num_samples_;
  }
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
  size_t num_samples_ = 0;
  std::shared_ptr<int64_t> epoch_;
  std::vector<size_t> order_;
  size_t cursor_ = 0;
};

} // namespace data
} // namespace colossalai
