#include <colossalai/data/distributed_sampler.h>

#include <torch/serialize/archive.h>

#include <ATen/CPUGeneratorImpl.h>
#include <cstring>

#include <ATen/ATen.h>

namespace colossalai {
namespace data {

DistributedSampler::DistributedSampler(
    size_t size,
    int num_replicas,
    int rank,
    bool shuffle,
    uint64_t seed,
    bool drop_last)
    : size_(size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last),
      epoch_(std::make_shared<int64_t>(0)) {
  TORCH_CHECK(
      num_replicas >= 1, "DistributedSampler: num_replicas must be >= 1");
  TORCH_CHECK(
      rank >= 0 && rank < num_replicas,
      "DistributedSampler: rank ",
      rank,
      " outside [0, ",
      num_replicas,
      ")");
  compute_sizes();
  reset();
}

void DistributedSampler::compute_sizes() {
  const size_t n = static_cast<size_t>(num_replicas_);
  num_samples_ = drop_last_ ? size_ / n : (size_ + n - 1) / n;
}

std::vector<size_t> DistributedSampler::indices() const {
  std::vector<int64_t> perm(size_);
  if (shuffle_) {
    // A generator local to this call: deterministic for seed + epoch and
    // independent of the global RNG the user's training draws from.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(
        seed_ + static_cast<uint64_t>(*epoch_));
    auto p = at::randperm(static_cast<int64_t>(size_), gen, at::kLong);
    std::memcpy(perm.data(), p.data_ptr<int64_t>(), size_ * sizeof(int64_t));
  } else {
    for (size_t i = 0; i < size_; ++i) {
      perm[i] = static_cast<int64_t>(i);
    }
  }
  const size_t total = num_samples_ * num_replicas_;
  std::vector<size_t> out;
  out.reserve(num_samples_);
  for (size_t i = rank_; i < total; i += num_replicas_) {
    // Past the end: wrap around to pad (only without drop_last).
    out.push_back(static_cast<size_t>(perm[size_ ? i % size_ : 0]));
  }
  return out;
}

void DistributedSampler::reset(torch::optional<size_t> new_size) {
  if (new_size.has_value()) {
    size_ = *new_size;
    compute_sizes();
  }
  order_ = indices();
  cursor_ = 0;
}

torch::optional<std::vector<size_t>> DistributedSampler::next(
    size_t batch_size) {
  if (cursor_ >= order_.size()) {
    return torch::nullopt;
  }
  size_t end = std::min(order_.size(), cursor_ + batch_size);
  std::vector<size_t> batch(order_.begin() + cursor_, order_.begin() + end);
  cursor_ = end;
  return batch;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", at::tensor(*epoch_), /*is_buffer=*/true);
  archive.write("cursor", at::tensor(static_cast<int64_t>(cursor_)), true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch, cursor;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("cursor", cursor, true);
  *epoch_ = epoch.item<int64_t>();
  order_ = indices();
  cursor_ = static_cast<size_t>(cursor.item<int64_t>());
}

} // namespace data
} // namespace colossalai
