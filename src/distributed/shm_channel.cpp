#include "shm_channel.h"

#if defined(__linux__)

#include "local_reduce.h"
#include "shm_segment.h"

#include <colossalai/distributed/error.h>

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <climits>
#include <cstring>

// NOTE [Shared-memory collectives]
// Gloo moves every byte through a TCP socket, also between two processes
// on one host: the kernel copies it into the socket and out again, and its
// threads take CPU from the ranks' compute (a 16 MB all-reduce on two
// ranks takes about 18 ms on an idle 2-core machine). When every member of
// a Gloo group runs on one host, the group maps one shared segment and its
// collectives (all-reduce, reduce-scatter, all-gather, broadcast,
// all-to-all, barrier) run through it instead, as MPI and oneCCL do on a
// node:
//  * each rank owns one slot in each of two buffers; an operation goes in
//    slot-sized pieces, alternating buffers, so a rank can fill the next
//    piece while slower ranks still read the previous one;
//  * all-reduce of a piece: every rank copies its piece into its slot;
//    rank r sums part r of the piece over all slots (in rank order, so
//    every rank's result has the same bits) into slot 0; every rank copies
//    slot 0 out. Reduce-scatter stops after the sum, written straight into
//    the output; all-gather copies slots out;
//  * ranks advance through numbered phases: each rank publishes the last
//    phase it finished in its own counter and waits on the others' with a
//    futex (a short spin first), so a waiting rank burns no CPU that a
//    rank still computing needs;
//  * a wait checks the peer's process every 100 ms and gives up at the
//    group timeout, naming the peer; after an error every later operation
//    on the channel fails with it;
//  * operations run on the channel's own thread in call order, like Gloo's
//    work queue, so they overlap the caller's compute.
// The segment has no name, so nothing is left behind whatever way the
// processes end (NOTE [Segments that cannot outlive their job]). Barriers
// are one phase of the segment. Sends and receives stay on Gloo, unordered
// with collectives as in c10d; gathers run on Gloo in the group's one
// order (NOTE [One order per group]).

namespace colossalai {
namespace distributed {
namespace detail {

namespace {

static_assert(
    sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
    "futex words are 32-bit");

constexpr auto kPoll = std::chrono::milliseconds(100);

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, timespec* t) {
  return ::syscall(
      SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, t, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

at::Tensor view(uint8_t* p, int64_t numel, at::ScalarType dtype) {
  return at::from_blob(p, {numel}, at::TensorOptions().dtype(dtype));
}

// Where each rank's shard starts in the whole tensor (prefix sums).
std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offset(sizes.size() + 1, 0);
  for (size_t q = 0; q < sizes.size(); ++q) {
    offset[q + 1] = offset[q] + sizes[q];
  }
  return offset;
}

int64_t clamp_len(int64_t size, int64_t at, int64_t piece) {
  return std::clamp<int64_t>(size - at, 0, piece);
}

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

ShmChannel::ShmChannel(
    void* base,
    size_t bytes,
    int rank,
    int size,
    int64_t slot_bytes,
    std::chrono::milliseconds timeout)
    : base_(base),
      bytes_(bytes),
      rank_(rank),
      size_(size),
      slot_bytes_(slot_bytes),
      timeout_(timeout) {
  static_assert(sizeof(Flag) == 64, "one flag per cache line");
  auto* b = static_cast<uint8_t*>(base);
  flags_ = reinterpret_cast<Flag*>(b + 64);
  data_ = b + data_offset(size);
  mapped_segment_bytes() += static_cast<int64_t>(bytes);
  thread_ = std::thread([this] { worker(); });
}

ShmChannel::~ShmChannel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
  ::munmap(base_, bytes_);
  mapped_segment_bytes() -= static_cast<int64_t>(bytes_);
}

bool ShmChannel::carries(const at::Tensor& t, bool reduces) {
  if (!t.device().is_cpu() || t.is_sparse()) {
    return false;
  }
  return !reduces || at::isFloatingType(t.scalar_type()) ||
      at::isIntegralType(t.scalar_type(), /*includeBool=*/false);
}

std::shared_future<void> ShmChannel::enqueue(std::function<void()> fn) {
  std::packaged_task<void()> task([this, fn = std::move(fn)] {
    if (!broken_.empty()) {
      throw std::runtime_error(broken_);
    }
    try {
      fn();
    } catch (const std::exception& e) {
      broken_ = error_text(e);
      throw;
    }
  });
  auto future = task.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return future;
}

void ShmChannel::worker() {
  // The local sums write into callers' tensors, never into autograd graphs.
  at::NoGradGuard no_grad;
  for (;;) {
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {
        return;
      }
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task(); // errors land in the task's future
  }
}

uint8_t* ShmChannel::slot(int buffer, int rank) const {
  return data_ + (static_cast<int64_t>(buffer) * size_ + rank) * slot_bytes_;
}

void ShmChannel::signal() {
  Flag& f = flags_[rank_];
  f.phase.store(++phase_, std::memory_order_seq_cst);
  if (f.waiters.load(std::memory_order_seq_cst) > 0) {
    futex(&f.phase, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

bool ShmChannel::alive(int peer) const {
  const Flag& f = flags_[peer];
  char state = 0;
  uint64_t start = 0;
  if (!process_state(f.pid, &state, &start)) {
    return false;
  }
  return state != 'Z' && state != 'X' && start == f.start_time;
}

void ShmChannel::wait_one(int peer, uint32_t phase) {
  Flag& f = flags_[peer];
  auto reached = [&] {
    return static_cast<int32_t>(
               f.phase.load(std::memory_order_acquire) - phase) >= 0;
  };
  for (int i = 0; i < 256; ++i) {
    if (reached()) {
      return;
    }
    cpu_relax();
  }
  const auto start = std::chrono::steady_clock::now();
  auto checked = start;
  for (;;) {
    // Counted as a waiter before the last look, so a signal after it wakes us.
    f.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = f.phase.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - phase) < 0) {
      timespec t{0, 20 * 1000 * 1000};
      futex(&f.phase, FUTEX_WAIT, seen, &t);
    }
    f.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached()) {
      return;
    }
    TORCH_CHECK(!stopping_, "the group is being destroyed");
    const auto now = std::chrono::steady_clock::now();
    if (now - checked >= kPoll) {
      checked = now;
      TORCH_CHECK(
          alive(peer),
          "group rank ",
          peer,
          " (pid ",
          f.pid,
          ") exited during a shared-memory collective");
    }
    TORCH_CHECK(
        now - start < timeout_,
        "waited ",
        timeout_.count(),
        " ms for group rank ",
        peer,
        " (pid ",
        f.pid,
        ") in a shared-memory collective");
  }
}

void ShmChannel::wait_all(uint32_t phase) {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) {
      wait_one(q, phase);
    }
  }
}

int ShmChannel::take_buffer() {
  const int b = next_buffer_;
  next_buffer_ ^= 1;
  wait_all(read_done_[b]);
  return b;
}

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

std::shared_future<void> ShmChannel::barrier() {
  return enqueue([this] {
    signal();
    wait_all(phase_);
  });
}

std::shared_future<void> ShmChannel::run_in_order(std::function<void()> fn) {
  return enqueue(std::move(fn));
}

} // namespace detail
} // namespace distributed
} // namespace colossalai

#else // !__linux__: no futex, and open() makes no channel.

namespace colossalai {
namespace distributed {
namespace detail {

// open() never makes a channel here, so nothing below is ever reached.
ShmChannel::~ShmChannel() = default;

bool ShmChannel::carries(const at::Tensor&, bool) {
  return false;
}

namespace {
std::shared_future<void> unreachable() {
  TORCH_INTERNAL_ASSERT(false, "no shared-memory channel exists here");
}
} // namespace

std::shared_future<void> ShmChannel::all_reduce(at::Tensor, ReduceOp) {
  return unreachable();
}
std::shared_future<void> ShmChannel::reduce_scatter(
    at::Tensor,
    at::Tensor,
    std::vector<int64_t>,
    ReduceOp) {
  return unreachable();
}
std::shared_future<void> ShmChannel::all_gather(
    at::Tensor,
    at::Tensor,
    std::vector<int64_t>) {
  return unreachable();
}
std::shared_future<void> ShmChannel::broadcast(at::Tensor, int) {
  return unreachable();
}
std::shared_future<void> ShmChannel::all_to_all(
    at::Tensor,
    at::Tensor,
    std::vector<int64_t>,
    std::vector<int64_t>) {
  return unreachable();
}
std::shared_future<void> ShmChannel::barrier() {
  return unreachable();
}
std::shared_future<void> ShmChannel::run_in_order(std::function<void()>) {
  return unreachable();
}

} // namespace detail
} // namespace distributed
} // namespace colossalai

#endif
