#pragma once

/// The collective layer every plugin uses. Each call starts the operation and
/// returns a `Work` handle; `wait()` completes it (and any local
/// post-processing such as the sum of a reduce-scatter), throwing
/// `DistributedError` that names the rank, operation and group when a peer died
/// or the group timeout expired.
///
/// All tensors must be contiguous. Supported dtypes: float32, bfloat16, float16
/// (and integer types for data movement). Where the backend lacks an operation
/// (Gloo in LibTorch 1.13: reduce-scatter, flat all-gather, bf16 all-reduce),
/// a bandwidth-optimal replacement is used; see NOTE [Gloo replacements] and
/// `collective_path`.
/// When every member of a Gloo group runs on one host, its all-reduce,
/// reduce-scatter, all-gather, broadcast, all-to-all and barrier of CPU
/// tensors go through shared memory instead of sockets
/// (`LaunchOptions::shm_collectives`; NOTE [Shared-memory collectives]);
/// `ProcessGroup::transport()` says which transport a group took. A group's
/// collectives complete in call order, and a barrier completes after all of
/// them, as in c10d; sends and receives are not ordered with collectives.
/// A failure found while an operation is being started (a peer already
/// gone) is the same `DistributedError` that `wait()` would throw.
///
/// Example:
/// \code
///   auto group = colossalai::distributed::world_group();
///   auto work = colossalai::distributed::all_reduce(grad, *group);
///   // ... overlap compute ...
///   work.wait();
/// \endcode

#include <colossalai/distributed/process_group.h>

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace distributed {

enum class ReduceOp { kSum, kAvg, kMax, kMin };

/// Handle to an operation in flight: move-only, holds a reference to its
/// group, finishes (waits and runs local post-processing) exactly once.
class Work {
 public:
  struct State; // internal
  Work();       // an already-completed operation
  explicit Work(std::unique_ptr<State> state);
  Work(Work&& other) noexcept;
  Work& operator=(Work&& other) noexcept;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  ~Work();

  /// Blocks until done, runs local post-processing once. Idempotent.
  void wait();
  /// True when the network part is done (wait() then returns at once, save for
  /// local post-processing).
  bool is_completed() const;
  /// True for a Work that stands for no operation at all (default
  /// constructed, or moved from): nothing ran, nothing will.
  bool is_noop() const {
    return state_ == nullptr;
  }

 private:
  std::unique_ptr<State> state_;
};

/// In-place reduction of `tensor` over the group.
Work all_reduce(
    at::Tensor& tensor,
    const ProcessGroup& group,
    ReduceOp op = ReduceOp::kSum);

/// Copies `tensor` of group rank `src` into `tensor` of every other rank.
Work broadcast(at::Tensor& tensor, int src, const ProcessGroup& group);

/// Element range [begin, end) of rank `rank`'s shard when `numel` elements are
/// split over `world` ranks: balanced, the first `numel % world` shards get one
/// more element (the `tensor_split` convention).
std::pair<int64_t, int64_t> shard_range(int64_t numel, int world, int rank);

/// Gathers every rank's shard into one flat `output`. `input` is this rank's
/// shard, with `input.numel()` equal to the length `shard_range` gives for
/// `output.numel()`; lengths need not divide evenly.
Work all_gather(
    at::Tensor& output,
    const at::Tensor& input,
    const ProcessGroup& group);

/// Gathers every rank's equal-sized `input` into the flat `output` of group
/// rank `root` only (rank order); `output` is ignored on other ranks. Moves
/// a sharded tensor to one writer without every rank holding it whole.
Work gather(
    at::Tensor& output,
    const at::Tensor& input,
    int root,
    const ProcessGroup& group);

/// Reduces the flat `input` over the group and leaves this rank's shard (as
/// `shard_range` defines it) in `output`.
Work reduce_scatter(
    at::Tensor& output,
    const at::Tensor& input,
    const ProcessGroup& group,
    ReduceOp op = ReduceOp::kSum);

/// Bytes of working memory reduce_scatter() allocates beside its output
/// while it runs, for an input of `numel` elements of `dtype`: Gloo's
/// replacement receives every rank's shard into a buffer of the input's
/// size; a backend's own reduce-scatter (NCCL, Gloo on 2.x once it has run)
/// needs one only to pad an uneven input. For memory accounting.
int64_t reduce_scatter_workspace_bytes(
    int64_t numel,
    at::ScalarType dtype,
    const ProcessGroup& group);

/// How a collective was carried out.
enum class CollectivePath {
  kNone,         ///< not called yet in this process
  kLocal,        ///< a group of one: a local copy
  kSharedMemory, ///< the group's shared-memory segment (one host, CPU)
  kBackend,      ///< the backend's own operation (NCCL; Gloo where it has it)
  kReplacement,  ///< NOTE [Gloo replacements], where Gloo lacks the operation
};

/// The path the last `op` ("all_reduce", "all_gather" or "reduce_scatter")
/// of this process took. For tests and benchmarks that must say what ran.
///
/// Example:
/// \code
///   reduce_scatter(out, in, *group).wait();
///   std::cout << to_string(collective_path("reduce_scatter"));
/// \endcode
CollectivePath collective_path(const std::string& op);
const char* to_string(CollectivePath path);

/// Rank r sends the r-th block of `input` to every rank and receives
/// everyone's blocks into `output`, in rank order. Empty split vectors mean
/// equal blocks.
Work all_to_all(
    at::Tensor& output,
    const at::Tensor& input,
    const ProcessGroup& group,
    std::vector<int64_t> output_splits = {},
    std::vector<int64_t> input_splits = {});

/// Point-to-point; `dst` / `src` are group ranks.
Work send(
    const at::Tensor& tensor,
    int dst,
    const ProcessGroup& group,
    int tag = 0);
Work recv(at::Tensor& tensor, int src, const ProcessGroup& group, int tag = 0);

/// Point-to-point of a tensor whose dtype and shape the receiver does not
/// know (at most 16 dimensions): a header, then the data, on `tag`.
/// Blocking; for transfers outside a training step (checkpoint tensors
/// going to their writer), not for activations (the pipeline's p2p caches
/// the header).
void send_tensor(
    const at::Tensor& tensor,
    int dst,
    const ProcessGroup& group,
    int tag = 0);
/// What send_tensor sent, on the group's device.
at::Tensor recv_tensor(int src, const ProcessGroup& group, int tag = 0);

Work barrier(const ProcessGroup& group);

/// Every rank's `bytes`, in group rank order (any lengths; blocking). For
/// small metadata such as which files a rank wrote, not for tensors.
std::vector<std::string> all_gather_bytes(
    const std::string& bytes,
    const ProcessGroup& group);

/// One hop of a ring: `send` goes to the next group rank (rank + 1) while
/// the previous rank's tensor (same shape and dtype) arrives in `received`.
/// Both are posted at once; `wait()` before reading `received` or reusing
/// `send`. Concurrent hops between the same ranks need distinct tags.
struct RingHop {
  at::Tensor received;
  Work sent, arrived;
  void wait() {
    sent.wait();
    arrived.wait();
  }
};
RingHop ring_exchange(
    const at::Tensor& send,
    const ProcessGroup& group,
    int tag);

/// Bytes this process handed to collectives since start (payload, per
/// operation counted once); used by benchmarks.
int64_t bytes_communicated();

} // namespace distributed
} // namespace colossalai
