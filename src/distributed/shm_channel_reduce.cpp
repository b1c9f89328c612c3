// The shared-memory channel's reducing collectives: all-reduce and
// reduce-scatter (NOTE [Shared-memory collectives]).

#include "shm_channel.h"

#if defined(__linux__)

#include "local_reduce.h"
#include "shm_channel_internal.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace colossalai {
namespace distributed {
namespace detail {

namespace {

at::Tensor view(uint8_t* p, int64_t numel, at::ScalarType dtype) {
  return at::from_blob(p, {numel}, at::TensorOptions().dtype(dtype));
}

} // namespace

void ShmChannel::run_all_reduce(const at::Tensor& t, ReduceOp op) {
  const auto dtype = t.scalar_type();
  const int64_t es = t.element_size();
  const int64_t piece = slot_bytes_ / es;
  const int64_t numel = t.numel();
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  std::vector<at::Tensor> srcs(size_);
  for (int64_t at = 0; at < numel; at += piece) {
    const int64_t len = std::min(piece, numel - at);
    const int b = take_buffer();
    std::memcpy(slot(b, rank_), p + at * es, len * es);
    signal();
    wait_all(phase_);
    const auto part = shard_range(len, size_, rank_);
    if (part.second > part.first) {
      for (int q = 0; q < size_; ++q) {
        srcs[q] =
            view(slot(b, q) + part.first * es, part.second - part.first, dtype);
      }
      reduce_into(srcs[0], srcs, op, &scratch_);
    }
    signal();
    wait_all(phase_);
    std::memcpy(p + at * es, slot(b, 0), len * es);
    signal();
    read_done_[b] = phase_;
  }
}

void ShmChannel::run_reduce_scatter(
    const at::Tensor& out,
    const at::Tensor& in,
    const std::vector<int64_t>& sizes,
    ReduceOp op) {
  const auto dtype = in.scalar_type();
  const int64_t es = in.element_size();
  // Slot layout: one piece per destination rank.
  const int64_t piece = std::max<int64_t>(slot_bytes_ / es / size_, 1);
  const auto offset = offsets_of(sizes);
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  auto* src = static_cast<uint8_t*>(in.data_ptr());
  std::vector<at::Tensor> srcs(size_);
  for (int64_t at = 0; at < longest; at += piece) {
    const int b = take_buffer();
    uint8_t* mine = slot(b, rank_);
    for (int q = 0; q < size_; ++q) {
      const int64_t len = clamp_len(sizes[q], at, piece);
      // The own piece is read from the input: no peer reads it.
      if (q != rank_ && len > 0) {
        std::memcpy(
            mine + q * piece * es, src + (offset[q] + at) * es, len * es);
      }
    }
    signal();
    wait_all(phase_);
    const int64_t len = clamp_len(sizes[rank_], at, piece);
    if (len > 0) {
      for (int q = 0; q < size_; ++q) {
        srcs[q] = q == rank_
            ? view(src + (offset[rank_] + at) * es, len, dtype)
            : view(slot(b, q) + rank_ * piece * es, len, dtype);
      }
      reduce_into(out.narrow(0, at, len), srcs, op, &scratch_);
    }
    signal();
    read_done_[b] = phase_;
  }
}

std::shared_future<void> ShmChannel::all_reduce(at::Tensor t, ReduceOp op) {
  TORCH_CHECK(
      op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()),
      "all_reduce: ReduceOp::kAvg needs a floating tensor, got ",
      t.scalar_type());
  return enqueue([this, t = t.view({-1}), op] { run_all_reduce(t, op); });
}

std::shared_future<void> ShmChannel::reduce_scatter(
    at::Tensor out,
    at::Tensor in,
    std::vector<int64_t> sizes,
    ReduceOp op) {
  TORCH_CHECK(
      op != ReduceOp::kAvg || at::isFloatingType(in.scalar_type()),
      "reduce_scatter: ReduceOp::kAvg needs a floating tensor, got ",
      in.scalar_type());
  TORCH_INTERNAL_ASSERT(static_cast<int>(sizes.size()) == size_);
  return enqueue([this,
                  out = out.view({-1}),
                  in = in.view({-1}),
                  sizes = std::move(sizes),
                  op] { run_reduce_scatter(out, in, sizes, op); });
}

} // namespace detail
} // namespace distributed
} // namespace colossalai

#endif
