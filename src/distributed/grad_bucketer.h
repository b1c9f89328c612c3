#pragma once

// The one gradient bucketer every data-parallel strategy stands on (DDP
// all-reduce, ZeRO-1/2 reduce-scatter / all-reduce, FSDP per-unit
// reduce-scatter). See NOTE [Gradient bucketing].
//
// NOTE [Gradient bucketing]
// Parameters are registered in buckets. A gradient-accumulator hook reports
// each parameter's gradient once per backward; the first report of a
// backward queues `finalize` on the autograd engine, which runs once the
// whole backward is done. When every parameter of a bucket has reported,
// the strategy's `launch` starts the bucket's collective -- from the hook,
// so communication overlaps the rest of backward (`overlap`), or all at once
// in finalize. Buckets launch in index order (`ordered`: every rank issues
// the same sequence even if gradients arrive in another order), or in the
// order they complete (FSDP: units complete in reverse execution order,
// the same on every rank). With `max_in_flight` > 0, launching one more
// bucket first completes the oldest, bounding gradient memory. finalize
// reports the parameters that got no gradient (the strategy may refuse
// them), launches what is left, waits for every bucket in launch order
// calling `complete`, and resets; an error anywhere resets too, so the next
// backward starts clean. With sync off (no_sync), readiness is still
// tracked (FSDP reshards on it) but nothing is filled or launched.
//
// NOTE [A backward that raised]
// The autograd engine runs a backward's queued callbacks only when the
// backward ends; one that raised (a hook's check, the device out of memory)
// drops them unrun, so finalize never comes. The callback holds a token that
// notices it was dropped unrun (abandoned), and the next backward (or flush)
// first waits for the collectives the raised one launched (a rank that
// raised at the same point as the others launched the same ones), drops
// their results and resets, as torch's plain autograd leaves a raised
// backward: what it accumulated stays until zero_grad. Without this the next
// backward found half-full buckets. The token fires when the engine frees
// the raised backward's graph task, which the autograd thread that ran its
// last task may do a moment after the caller saw the error:
// Booster::backward waits for that before it rethrows
// (settle_raised_backward), so that a quick next backward is not taken for
// the raised one. The tasks it left queued keep the accumulators they name
// alive until the next backward on that thread, so hooks put back meanwhile
// (FSDP's summon_full_params) find them: a hook is installed once per
// accumulator (utils::on_grad_accumulated's owner). Before anything is
// dropped the ranks agree that theirs raised at the same point (NOTE [A
// backward that raised on some ranks] in raised_backward.h).

#include <colossalai/distributed/collectives.h>

#include "../utils/grad_ready_hook.h"

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace distributed {

/// How `plan_buckets` fills buckets.
struct BucketPlanOptions {
  /// A bucket closes when the next parameter would take it past `cap`
  /// (a parameter larger than `cap` gets a bucket of its own; 0: one
  /// parameter per bucket).
  int64_t cap = 25 << 20;
  /// The first bucket's cap, smaller so the first collective starts early
  /// (torch's DDP: 1 MiB); -1: `cap`.
  int64_t first_cap = -1;
  /// `cap` counts bytes (DDP), else elements (ZeRO).
  bool bytes = true;
  /// Buckets hold one dtype and device each (each kind has its own first
  /// bucket).
  bool by_dtype_and_device = true;
  /// Optional, one per parameter: parameters of different groups never
  /// share a bucket. FSDP and Gemini pass each parameter's unit (chunk)
  /// with an unbounded cap: a unit is reduce-scattered as one flat buffer,
  /// so it is one bucket.
  std::vector<int64_t> groups;
};

/// The one bucket planner of the data-parallel strategies (DDP, ZeRO, FSDP,
/// Gemini): parameter indices in reverse registration order, which
/// approximates the order backward produces their gradients, so the first
/// bucket fills first.
std::vector<std::vector<size_t>> plan_buckets(
    const std::vector<at::Tensor>& params,
    const BucketPlanOptions& options);

struct GradBucketerOptions {
  /// Launch a bucket's collective from the gradient hook that completed it.
  bool overlap = true;
  /// Launch in bucket-index order (else in completion order).
  bool ordered = true;
  /// Buckets launched but not yet completed; 0: no limit.
  size_t max_in_flight = 0;
  /// A bucket whose launch started no collective (one rank) completes at
  /// once when nothing launched before it is in flight, instead of waiting
  /// for later launches: its result (e.g. a gradient shard, and a host step
  /// taken ahead from it) is ready as soon as the hook that completed it.
  bool complete_local_at_once = false;
};

/// What a strategy does with its buckets. Called on the backward thread.
class BucketHandler {
 public:
  virtual ~BucketHandler() = default;
  /// Before a backward's first gradient changes any state: may throw to
  /// refuse the backward, leaving the bucketer as it was.
  virtual void before_backward() {}
  /// First gradient of a backward (before it is filled).
  virtual void on_backward_begin() {}
  /// Copies parameter `param`'s gradient into its bucket; `used` is false
  /// for a parameter that got no gradient in this backward (fill zeros).
  /// Not called with sync off.
  virtual void fill(size_t param, bool used) = 0;
  /// Every parameter of `bucket` has reported (sync on or off).
  virtual void on_bucket_ready(size_t bucket) {}
  /// Starts the bucket's collective.
  virtual Work launch(size_t bucket) = 0;
  /// Uses a bucket's result after its collective finished.
  virtual void complete(size_t bucket) = 0;
  /// In finalize, the parameters that got no gradient (may throw to refuse
  /// them; the bucketer resets first).
  virtual void on_missing(const std::vector<size_t>& params) {}
  /// In finalize, after every bucket launched and before waiting on them.
  virtual void before_wait() {}
  /// In finalize, after every bucket completed; `synced` is false when the
  /// backward ran with sync off.
  virtual void on_finalized(bool synced) {}
  /// The per-backward state is reset (after finalize, or after an error).
  virtual void on_reset() {}
};

class GradBucketer : public std::enable_shared_from_this<GradBucketer> {
 public:
  /// `buckets[b]` lists the parameter indices (in [0, num_params)) of bucket
  /// b; a parameter belongs to at most one bucket. `handler` must outlive
  /// the bucketer's hooks. Buckets must not be empty.
  GradBucketer(
      size_t num_params,
      std::vector<std::vector<size_t>> buckets,
      BucketHandler* handler,
      GradBucketerOptions options);

  /// Installs a gradient-accumulator hook on each parameter (index i ->
  /// params[i]); returns false for the first that is not a leaf requiring
  /// grad (its index in `bad`). Call again after a parameter changed dtype.
  bool attach_hooks(const std::vector<at::Tensor>& params, size_t* bad);
  /// Whether nothing but this bucketer holds the parameters' gradient
  /// accumulators (no live autograd graph does): then attach_hooks makes
  /// new ones, on the current stream.
  bool sole_owner_of_hooks() const;

  /// Parameter `param`'s gradient is accumulated (what the hooks call);
  /// `used` false reports a parameter known to get none (DDP static_graph).
  void ready(size_t param, bool used = true);
  /// Starts a backward without a gradient (FSDP's pre-backward hook).
  void begin_backward();
  /// After a backward raised, on the caller's thread: waits (at most half a
  /// second) until the engine freed every graph task holding a bucketer's
  /// finalize, so that the next backward is told apart from the raised one
  /// (NOTE [A backward that raised]). Booster::backward calls it.
  static void settle_raised_backward();
  /// After a backward raised: agrees with the other ranks that theirs
  /// raised after the same collectives, where it had issued any since it
  /// began (NOTE [A backward that raised on some ranks] in
  /// raised_backward.h), then drops what the raised backward left in every
  /// bucketer. Throws DistributedError, with `cause` in its message, where
  /// the ranks disagree: the run cannot go on. `agree` false skips the
  /// agreement (the caller made it, or the backward raised a
  /// DistributedError: the group is broken already). Booster::backward
  /// calls it; otherwise the next backward does, after whatever ran in
  /// between.
  static void recover_raised_backward(
      const std::string& cause,
      bool agree = true);

  void set_sync(bool sync) {
    sync_ = sync;
  }
  /// Synchronises every bucket now, outside a backward: what the backwards
  /// that ran with sync off accumulated (a pipeline's micro-batches, whose
  /// backwards each cover one model chunk, synchronised once per step).
  /// `used[i]`: parameter i has a gradient. Sync is left as it was.
  void flush(const std::vector<char>& used);
  bool sync() const {
    return sync_;
  }
  /// Inside a backward (not one that raised: NOTE [A backward that
  /// raised]).
  bool in_backward() const {
    return in_backward_ && !abandoned();
  }
  /// Inside finalize (buckets completing there were not overlapped).
  bool finalizing() const {
    return finalizing_;
  }
  size_t num_buckets() const {
    return buckets_.size();
  }
  const std::vector<size_t>& bucket_params(size_t b) const {
    return buckets_[b].params;
  }
  /// Buckets launched from a gradient hook (while backward still computed)
  /// in the last synchronised backward.
  size_t buckets_overlapped() const {
    return overlapped_last_;
  }
  /// Buckets launched and not completed (bounded by max_in_flight).
  size_t in_flight() const {
    return in_flight_.size();
  }

 private:
  struct Bucket {
    std::vector<size_t> params;
    size_t pending = 0;
    bool launched = false;
    Work work;
  };

  void mark(size_t param, bool used);
  void launch_ready(bool from_hook);
  void launch(size_t b, bool from_hook);
  void complete_oldest();
  void finalize();
  void reset();
  /// The backward under way raised: its finalize will never run.
  bool abandoned() const {
    return in_backward_ && abandoned_.load() == backwards_;
  }
  /// NOTE [A backward that raised]: waits for its collectives and resets.
  void recover_abandoned();

  const uint64_t id_; // tags its hooks (utils::on_grad_accumulated)
  BucketHandler* handler_;
  GradBucketerOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_; // -1: in no bucket
  std::vector<char> ready_;
  std::vector<utils::GradAccumulatorPtr> accumulators_;

  bool sync_ = true;
  bool in_backward_ = false;
  bool finalizing_ = false;
  size_t next_ = 0;                   // ordered: next bucket to launch
  std::deque<size_t> complete_order_; // unordered: ready, not launched
  std::deque<size_t> in_flight_;
  size_t overlapped_ = 0;
  size_t overlapped_last_ = 0;
  uint64_t backwards_ = 0; // backwards begun
  // detail::collectives_issued() when this backward began.
  uint64_t issued_at_begin_ = 0;
  // The number of the last backward whose finalize was dropped unrun (set
  // from whichever thread frees the engine's graph task); 0: none.
  std::atomic<uint64_t> abandoned_{0};
};

} // namespace distributed
} // namespace colossalai
