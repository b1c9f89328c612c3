#pragma once

// Collectives through a shared-memory segment among the ranks of one group
// that run on one host (internal). See NOTE [Shared-memory collectives].

#include <colossalai/distributed/collectives.h>

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace c10d {
class Store;
} // namespace c10d

namespace colossalai {
namespace distributed {
namespace detail {

class ShmChannel {
 public:
  /// Collective over the members of a group (each calls it with its group
  /// rank): returns a channel when every member runs on this host and could
  /// map a segment within its budget (`budget_bytes` of segments per
  /// process), else nullptr on every member (they agree through `store`).
  /// `*why` says which, for the group's TransportInfo. Throws when a member
  /// does not arrive within `timeout`.
  static std::shared_ptr<ShmChannel> open(
      ::c10d::Store& store,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      int64_t budget_bytes,
      std::string* why);
  /// The default budget of segments per process (NOTE [Shared-memory
  /// budget]).
  static int64_t default_budget_bytes();
  /// The segment's size.
  int64_t bytes() const {
    return static_cast<int64_t>(bytes_);
  }
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  /// True when `t` can travel through the channel: a CPU tensor, and for
  /// reductions a dtype the local kernels sum (floating or integer).
  static bool carries(const at::Tensor& t, bool reduces);

  // Each starts the operation on the channel's thread, in call order; the
  // future is ready when this rank's part is done (or holds the error).
  // Tensors must stay untouched until then. `sizes`: each rank's shard.
  std::shared_future<void> all_reduce(at::Tensor t, ReduceOp op);
  std::shared_future<void> reduce_scatter(
      at::Tensor out,
      at::Tensor in,
      std::vector<int64_t> sizes,
      ReduceOp op);
  std::shared_future<void> all_gather(
      at::Tensor out,
      at::Tensor in,
      std::vector<int64_t> sizes);
  std::shared_future<void> broadcast(at::Tensor t, int src);
  /// Rank r's `send_bytes[q]` bytes (consecutive in `in`) go to rank q,
  /// landing at q's `recv_bytes[r]` bytes (consecutive in `out`, rank
  /// order).
  std::shared_future<void> all_to_all(
      at::Tensor out,
      at::Tensor in,
      std::vector<int64_t> send_bytes,
      std::vector<int64_t> recv_bytes);
  /// Ready when every member has reached it, after all earlier operations.
  std::shared_future<void> barrier();
  /// Runs `fn` on the channel's thread at its turn: an operation the segment
  /// does not carry, kept in the group's one order (NOTE [One order per
  /// group]). `fn` runs it on the backend and waits for it.
  std::shared_future<void> run_in_order(std::function<void()> fn);
  /// True on the channel's own thread (where run_in_order's functions run).
  bool on_channel_thread() const {
    return std::this_thread::get_id() == thread_.get_id();
  }

 private:
  struct Flag;
  ShmChannel(
      void* base,
      size_t bytes,
      int rank,
      int size,
      int64_t slot_bytes,
      std::chrono::milliseconds timeout);

  std::shared_future<void> enqueue(std::function<void()> fn);
  void worker();

  // Phases: every rank bumps its own counter when it finishes a phase;
  // all ranks run the same phases in the same order.
  void signal();
  void wait_all(uint32_t phase);
  void wait_one(int peer, uint32_t phase);
  bool alive(int peer) const;
  uint8_t* slot(int buffer, int rank) const;
  // The next of the two buffers, once every rank has finished reading it.
  int take_buffer();

  void run_all_reduce(const at::Tensor& t, ReduceOp op);
  void run_reduce_scatter(
      const at::Tensor& out,
      const at::Tensor& in,
      const std::vector<int64_t>& sizes,
      ReduceOp op);
  void run_all_gather(
      const at::Tensor& out,
      const at::Tensor& in,
      const std::vector<int64_t>& sizes);
  void run_broadcast(const at::Tensor& t, int src);
  void run_all_to_all(
      const at::Tensor& out,
      const at::Tensor& in,
      const std::vector<int64_t>& send_bytes,
      const std::vector<int64_t>& recv_bytes);

  void* base_;
  size_t bytes_;
  int rank_, size_;
  int64_t slot_bytes_;
  std::chrono::milliseconds timeout_;
  Flag* flags_;
  uint8_t* data_;
  uint32_t phase_ = 0;
  uint32_t read_done_[2] = {0, 0};
  int next_buffer_ = 0;
  at::Tensor scratch_; // fp32 accumulator of 16-bit sums

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> queue_;
  std::atomic<bool> stopping_{false};
  std::string broken_; // first error; later operations fail with it
  std::thread thread_;
};

} // namespace detail
} // namespace distributed
} // namespace colossalai
