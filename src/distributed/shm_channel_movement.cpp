// The shared-memory channel's data-movement collectives: all-gather,
// broadcast and all-to-all (NOTE [Shared-memory collectives]).

#include "shm_channel.h"

#if defined(__linux__)

#include "shm_channel_internal.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace colossalai {
namespace distributed {
namespace detail {

namespace {

// NOTE [Streaming copies out of the segment]
// All-gather and broadcast copy pieces out of the (cache-resident) segment
// into the output. Ordinary stores first read every destination line from
// memory (read for ownership); non-temporal stores write around the cache.
// Measured on 2 ranks in alternation: a 64 MB broadcast took 6.8-7.6
// against 14.0-14.7 ms, a 256 MB all-gather 45-46 against 65-73 ms. They
// also leave the result out of the cache, which a reader of a small result
// would miss, so only operations of at least kStreamBytes stream. At that
// size the miss did not show: 2 ranks, an all-gather followed at once by a
// sum over the whole result, 3 alternated runs, streamed vs ordinary
// stores: 16 MB 3.1-4.3 vs 4.1-4.8 ms, 32 MB 8.1-8.9 vs 8.4-9.2 ms (the sum
// alone 1.0-1.3 vs 1.1-1.4 ms at 16 MB). The all-reduce's copy-out gained
// nothing measurable (64 MB: 16.0-18.8 against 14.5-17.0 ms) and a
// reduce-scatter summed in a cached piece and streamed out lost (11.0-12.6
// against 9.2-10.8 ms): both keep ordinary stores. The fence makes the stores
// visible before the operation reports completion or signals a peer.
constexpr int64_t kStreamBytes = 16 << 20;

void copy_out(uint8_t* dst, const uint8_t* src, size_t n, bool stream) {
#if defined(__SSE2__)
  if (stream) {
    const size_t head =
        std::min(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
    std::memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
      const auto* s = reinterpret_cast<const __m128i*>(src + i);
      auto* d = reinterpret_cast<__m128i*>(dst + i);
      const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1),
                    c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
      _mm_stream_si128(d, a);
      _mm_stream_si128(d + 1, b);
      _mm_stream_si128(d + 2, c);
      _mm_stream_si128(d + 3, e);
    }
    std::memcpy(dst + i, src + i, n - i);
    _mm_sfence();
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, n);
}

} // namespace

void ShmChannel::run_all_gather(
    const at::Tensor& out,
    const at::Tensor& in,
    const std::vector<int64_t>& sizes) {
  const int64_t es = out.element_size();
  const int64_t piece = slot_bytes_ / es;
  const auto offset = offsets_of(sizes);
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  auto* src = static_cast<uint8_t*>(in.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const bool stream = out.numel() * es >= kStreamBytes;
  for (int64_t at = 0; at < longest; at += piece) {
    const int b = take_buffer();
    const int64_t mine = clamp_len(sizes[rank_], at, piece);
    if (mine > 0) {
      std::memcpy(slot(b, rank_), src + at * es, mine * es);
    }
    signal();
    wait_all(phase_);
    for (int q = 0; q < size_; ++q) {
      const int64_t len = clamp_len(sizes[q], at, piece);
      uint8_t* to = dst + (offset[q] + at) * es;
      if (len <= 0) {
        continue;
      }
      if (q != rank_) {
        copy_out(to, slot(b, q), len * es, stream);
      } else if (to != src + at * es) {
        std::memmove(to, src + at * es, len * es); // may overlap the input
      }
    }
    signal();
    read_done_[b] = phase_;
  }
}

void ShmChannel::run_broadcast(const at::Tensor& t, int src) {
  const int64_t bytes = t.numel() * t.element_size();
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  const bool stream = bytes >= kStreamBytes;
  for (int64_t at = 0; at < bytes; at += slot_bytes_) {
    const int64_t len = std::min(slot_bytes_, bytes - at);
    const int b = take_buffer();
    if (rank_ == src) {
      std::memcpy(slot(b, src), p + at, len);
    }
    signal();
    wait_one(src, phase_);
    if (rank_ != src) {
      copy_out(p + at, slot(b, src), len, stream);
    }
    signal();
    read_done_[b] = phase_;
  }
}

// All-to-all in rounds: each slot holds one piece per destination rank;
// round k moves bytes [k * piece, (k + 1) * piece) of every block. Ranks
// know only their own blocks' lengths, so a first phase shares them: the
// longest block sets the number of rounds.
void ShmChannel::run_all_to_all(
    const at::Tensor& out,
    const at::Tensor& in,
    const std::vector<int64_t>& send_bytes,
    const std::vector<int64_t>& recv_bytes) {
  const int64_t piece = slot_bytes_ / size_ / 64 * 64;
  TORCH_INTERNAL_ASSERT(piece > 0);
  const auto send_at = offsets_of(send_bytes);
  const auto recv_at = offsets_of(recv_bytes);
  auto* src = static_cast<uint8_t*>(in.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  // Every rank's lengths: the longest block sets the number of rounds, and
  // every rank checks every pair, so all fail alike when a sender and its
  // receiver disagree (none is left waiting for the others).
  int64_t longest = 0;
  {
    const int b = take_buffer();
    const size_t row = size_ * sizeof(int64_t);
    std::memcpy(slot(b, rank_), send_bytes.data(), row);
    std::memcpy(slot(b, rank_) + row, recv_bytes.data(), row);
    signal();
    wait_all(phase_);
    std::vector<int64_t> sends(size_ * size_), recvs(size_ * size_);
    for (int q = 0; q < size_; ++q) {
      std::memcpy(&sends[q * size_], slot(b, q), row);
      std::memcpy(&recvs[q * size_], slot(b, q) + row, row);
    }
    signal();
    read_done_[b] = phase_;
    for (int from = 0; from < size_; ++from) {
      for (int to = 0; to < size_; ++to) {
        const int64_t sent = sends[from * size_ + to];
        const int64_t expected = recvs[to * size_ + from];
        TORCH_CHECK(
            sent == expected,
            "all_to_all: group rank ",
            from,
            " sends ",
            sent,
            " bytes to group rank ",
            to,
            ", which expects ",
            expected,
            " (input_splits and output_splits disagree)");
        longest = from != to ? std::max(longest, sent) : longest;
      }
    }
  }
  if (recv_bytes[rank_] > 0) {
    std::memmove(dst + recv_at[rank_], src + send_at[rank_], recv_bytes[rank_]);
  }
  for (int64_t at = 0; at < longest; at += piece) {
    const int b = take_buffer();
    uint8_t* mine = slot(b, rank_);
    for (int q = 0; q < size_; ++q) {
      const int64_t len = clamp_len(send_bytes[q], at, piece);
      if (q != rank_ && len > 0) {
        std::memcpy(mine + q * piece, src + send_at[q] + at, len);
      }
    }
    signal();
    wait_all(phase_);
    for (int q = 0; q < size_; ++q) {
      const int64_t len = clamp_len(recv_bytes[q], at, piece);
      if (q != rank_ && len > 0) {
        std::memcpy(dst + recv_at[q] + at, slot(b, q) + rank_ * piece, len);
      }
    }
    signal();
    read_done_[b] = phase_;
  }
}

std::shared_future<void> ShmChannel::all_to_all(
    at::Tensor out,
    at::Tensor in,
    std::vector<int64_t> send_bytes,
    std::vector<int64_t> recv_bytes) {
  TORCH_INTERNAL_ASSERT(
      static_cast<int>(send_bytes.size()) == size_ &&
      static_cast<int>(recv_bytes.size()) == size_ &&
      send_bytes[rank_] == recv_bytes[rank_]);
  return enqueue([this,
                  out = std::move(out),
                  in = std::move(in),
                  send_bytes = std::move(send_bytes),
                  recv_bytes = std::move(recv_bytes)] {
    run_all_to_all(out, in, send_bytes, recv_bytes);
  });
}

std::shared_future<void> ShmChannel::broadcast(at::Tensor t, int src) {
  TORCH_INTERNAL_ASSERT(src >= 0 && src < size_);
  return enqueue([this, t = t.view({-1}), src] { run_broadcast(t, src); });
}

std::shared_future<void> ShmChannel::all_gather(
    at::Tensor out,
    at::Tensor in,
    std::vector<int64_t> sizes) {
  TORCH_INTERNAL_ASSERT(static_cast<int>(sizes.size()) == size_);
  return enqueue(
      [this,
       out = out.view({-1}),
       in = in.view({-1}),
       sizes = std::move(sizes)] { run_all_gather(out, in, sizes); });
}

} // namespace detail
} // namespace distributed
} // namespace colossalai

#endif
