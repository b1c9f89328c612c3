#include "shm_channel.h"

#if defined(__linux__)

#include "shm_segment.h"

#include <colossalai/distributed/error.h>

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>

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
