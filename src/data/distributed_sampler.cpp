#include <colossalai/data/distributed_sampler.h>

#include <torch/serialize/archive.h>

#include <ATen/CPUGeneratorImpl.h>
#include <algorithm>
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
      shared_(std::make_shared<Shared>()) {
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

void DistributedSampler::set_epoch(int64_t epoch) {
  if (epoch != shared_->epoch) {
    shared_->samples_seen = 0;
  }
  shared_->epoch = epoch;
}

void DistributedSampler::set_samples_seen(size_t n) {
  shared_->samples_seen = n;
}

size_t DistributedSampler::num_samples() const {
  const size_t seen = shared_->samples_seen;
  if (seen >= total_size()) {
    return 0;
  }
  // The samples left, padded up (or cut down) to the replicas as a whole
  // epoch is; past the dataset's size only padding was left.
  const size_t left = size_ - std::min(seen, size_);
  const size_t n = static_cast<size_t>(num_replicas_);
  return drop_last_ ? left / n : (left + n - 1) / n;
}

std::vector<size_t> DistributedSampler::indices() const {
  std::vector<int64_t> perm(size_);
  if (shuffle_) {
    // A generator local to this call: deterministic for seed + epoch and
    // independent of the global RNG the user's training draws from.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(
        seed_ + static_cast<uint64_t>(shared_->epoch));
    auto p = at::randperm(static_cast<int64_t>(size_), gen, at::kLong);
    std::memcpy(perm.data(), p.data_ptr<int64_t>(), size_ * sizeof(int64_t));
  } else {
    for (size_t i = 0; i < size_; ++i) {
      perm[i] = static_cast<int64_t>(i);
    }
  }
  // Entries [seen, seen + count * replicas) of the order, interleaved; at
  // seen = 0 that is the whole epoch.
  const size_t count = num_samples();
  const size_t first = std::min(shared_->samples_seen, total_size());
  const size_t end = first + count * static_cast<size_t>(num_replicas_);
  std::vector<size_t> out;
  out.reserve(count);
  for (size_t i = first + rank_; i < end; i += num_replicas_) {
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
  archive.write("epoch", at::tensor(shared_->epoch), /*is_buffer=*/true);
  archive.write("cursor", at::tensor(static_cast<int64_t>(cursor_)), true);
  archive.write(
      "samples_seen",
      at::tensor(static_cast<int64_t>(shared_->samples_seen)),
      true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch, cursor;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("cursor", cursor, true);
  at::Tensor seen;
  // Archives written before the resume point existed lack it: 0.
  shared_->samples_seen =
      archive.try_read("samples_seen", seen, true) ? seen.item<int64_t>() : 0;
  shared_->epoch = epoch.item<int64_t>();
  order_ = indices();
  cursor_ = static_cast<size_t>(cursor.item<int64_t>());
}

} // namespace data
} // namespace colossalai
