#pragma once

// What the collectives share (internal): the byte counter, the group's
// order on its shared-memory channel, copies for tensors the backend does
// not carry, Gloo's native-or-replacement choice, the receive-buffer pool.
// One header so that each collective's file is its own.

#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>

#include "backend.h"
#include "local_reduce.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace colossalai {
namespace distributed {
namespace detail {

inline std::atomic<int64_t> g_bytes{0};

inline void count(const at::Tensor& t, const ProcessGroup& g) {
  const int64_t n = t.numel() * t.element_size();
  g_bytes.fetch_add(n, std::memory_order_relaxed);
  g.add_bytes_communicated(n);
}

// NOTE [A backward that raised on some ranks] (raised_backward.h) compares
// how many collectives each rank issued on a group. Each call of the public
// API counts once, on the caller's thread; the operations it is made of (a
// replacement's phases, a carried copy's, one replayed on the channel's
// thread, one a Work's wait starts) do not, so ranks that made the same
// calls count alike whatever their paths and timing.
inline thread_local int g_issue_depth = 0;
inline std::atomic<uint64_t> g_issued{0}; // on every group
// Sends and receives, which pair by peer and tag, not by count.
inline std::atomic<uint64_t> g_exchanged{0};

/// Throws the reason a group may not go on, once it has one.
void check_usable(const ProcessGroup& g, const char* op);

class Issue {
 public:
  Issue(const ProcessGroup& g, const char* op) {
    if (g_issue_depth == 0) {
      const auto& t = g.transport_handle();
      if (t.broken.load(std::memory_order_acquire)) {
        check_usable(g, op); // throws the reason
      }
      if (t.shm == nullptr || !t.shm->on_channel_thread()) {
        t.issued.fetch_add(1, std::memory_order_relaxed);
        g_issued.fetch_add(1, std::memory_order_relaxed);
      }
    }
    ++g_issue_depth;
  }
  ~Issue() {
    --g_issue_depth;
  }
  Issue(const Issue&) = delete;
  Issue& operator=(const Issue&) = delete;
};

// Inside a Work's wait: what it starts is part of the operation it ends.
class Nested {
 public:
  Nested() {
    ++g_issue_depth;
  }
  ~Nested() {
    --g_issue_depth;
  }
  Nested(const Nested&) = delete;
  Nested& operator=(const Nested&) = delete;
};

inline bool gloo(const ProcessGroup& g) {
  return g.backend_type() == BackendType::kGloo;
}

// NOTE [One order per group]
// A group's transport is chosen once, when it is created. On a
// shared-memory group every collective runs on the channel's thread in call
// order: the segment's own operations, a barrier (one phase of the
// segment), and the ones the segment does not carry (gather, a reduction
// of a dtype it cannot sum), which that thread runs on Gloo and
// waits for before it takes the next. So a barrier orders all earlier
// collectives of the group, as c10d's do, and a failure breaks the group
// for every later one. Sends and receives go straight to Gloo, unordered
// with collectives, as in c10d (Gloo starts them at once): a pipeline's
// receive posted early must not wait behind a collective.

// The group's channel when its collectives must queue on it; null without
// one, and on the channel's own thread (where a queued operation runs on
// the backend).
inline ShmChannel* channel_of(const ProcessGroup& g) {
  auto* c = g.transport_handle().shm.get();
  return c != nullptr && !c->on_channel_thread() ? c : nullptr;
}

// The group's channel when it carries `t` itself (NOTE [Shared-memory
// collectives]), else null.
inline ShmChannel* shm(
    const ProcessGroup& g,
    const at::Tensor& t,
    bool reduces) {
  auto* channel = channel_of(g);
  return channel && ShmChannel::carries(t, reduces) ? channel : nullptr;
}

inline bool ready(const std::shared_future<void>& f) {
  return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

inline Work shm_work(
    std::shared_future<void> done,
    const char* op,
    const ProcessGroup& g) {
  return make_work(
      compat::WorkPtr(),
      [done]() { done.get(); },
      op,
      g,
      [done]() { return ready(done); });
}

// Runs `run` (which starts the operation on the backend) at its turn in
// the group's order, and waits for it there (NOTE [One order per group]).
inline Work in_order(
    ShmChannel* channel,
    const char* op,
    const ProcessGroup& g,
    std::function<Work()> run) {
  return shm_work(
      channel->run_in_order([run = std::move(run)] { run().wait(); }), op, g);
}

// The channel an operation the segment does not carry queues on.
inline ShmChannel* queue_for(
    const ProcessGroup& g,
    const at::Tensor& t,
    bool reduces) {
  auto* channel = channel_of(g);
  return channel && !ShmChannel::carries(t, reduces) ? channel : nullptr;
}

// A bf16 tensor on a Gloo group travels as opaque 16-bit words where only
// bytes move (Gloo in 1.13 has no bf16 type at all).
inline at::Tensor raw(const at::Tensor& t, const ProcessGroup& g) {
  return gloo(g) && t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t;
}

// How the last call of each reducing / gathering collective ran
// (collective_path()).
enum Op { kAllReduce, kAllGather, kReduceScatter, kNumOps };
inline std::atomic<int> g_path[kNumOps] = {};

inline void record(Op op, CollectivePath path) {
  g_path[op].store(static_cast<int>(path), std::memory_order_relaxed);
}

// NOTE [Tensors the backend does not carry]
// Gloo moves host memory, NCCL device memory. A tensor on the other side -
// a CUDA tensor on a Gloo group (several ranks sharing one GPU), a host
// tensor on an NCCL group (offloaded optimizer states, gathered for a
// checkpoint) - travels through a copy on the backend's side: taken when
// the call starts, written back in wait(). Host copies are pinned. Every
// path below (shared memory, the replacements) then serves both.
inline bool foreign(const ProcessGroup& g, const at::Tensor& t) {
  return t.defined() && (gloo(g) ? t.is_cuda() : !t.is_cuda());
}

// `t` itself when the backend carries it, else a copy it carries (holding
// `t`'s values when `copy`).
inline at::Tensor carried(
    const ProcessGroup& g,
    const at::Tensor& t,
    bool copy) {
  if (!foreign(g, t)) {
    return t;
  }
  auto c = at::empty(
      t.sizes(),
      gloo(g) ? t.options().device(at::kCPU).pinned_memory(true)
              : t.options().device(g.device()));
  if (copy) {
    c.copy_(t);
  }
  return c;
}

// Waits for `inner`, then writes each copy back to its original (an
// undefined original: a copy only kept alive until then).
inline Work staged_work(
    Work inner,
    std::vector<std::pair<at::Tensor, at::Tensor>> back,
    const char* op,
    const ProcessGroup& g) {
  auto w = std::make_shared<Work>(std::move(inner));
  return make_work(
      compat::WorkPtr(),
      [w, back]() mutable {
        w->wait();
        for (auto& [original, copy] : back) {
          if (original.defined() && !original.is_same(copy)) {
            original.copy_(copy);
          }
        }
      },
      op,
      g,
      [w]() { return w->is_completed(); });
}

// An out-of-place collective `call(output, input)` on carried copies, when
// either tensor needs one; nullopt when neither does.
template <class F>
std::optional<Work> via_carried(
    at::Tensor& output,
    const at::Tensor& input,
    const ProcessGroup& g,
    const char* op,
    F&& call) {
  if (!foreign(g, output) && !foreign(g, input)) {
    return std::nullopt;
  }
  auto o = carried(g, output, false);
  auto i = carried(g, input, true);
  return staged_work(call(o, i), {{output, o}, {at::Tensor(), i}}, op, g);
}

// Whether Gloo's own flat all-gather / reduce-scatter may be tried: unknown
// until the first call, then what that call found (NOTE [c10d backends
// across versions]). Every rank links the same LibTorch, so every rank
// finds the same.
enum class Native { kUnknown, kYes, kNo };
inline std::atomic<Native> g_gloo_native[kNumOps] = {};

// Starts `call` (Gloo's native flat collective) unless Gloo is known to
// refuse it; null when it refuses, and the caller takes its replacement.
template <class F>
compat::WorkPtr try_gloo_native(Op op, F&& call) {
  if (g_gloo_native[op].load() == Native::kNo) {
    return compat::WorkPtr();
  }
  try {
    auto w = call();
    g_gloo_native[op].store(Native::kYes);
    return w;
  } catch (const std::exception& e) {
    if (!compat::is_unsupported(e)) {
      throw;
    }
    g_gloo_native[op].store(Native::kNo);
    return compat::WorkPtr();
  }
}

// Gloo sums bf16 itself where compat says so; 1.13's cannot.
inline bool gloo_reduces(at::ScalarType dtype) {
  return dtype != at::kBFloat16 || compat::gloo_reduces_bf16();
}

inline void check_dense(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.defined(), op, ": ", what, " tensor is undefined");
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, " tensor must be contiguous");
}

inline ::c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax:
      return ::c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return ::c10d::ReduceOp::MIN;
    default:
      return ::c10d::ReduceOp::SUM;
  }
}

// Reduces `n` equal blocks of `blocks` into `out`.
inline void local_reduce(
    at::Tensor& out,
    const at::Tensor& blocks,
    int n,
    ReduceOp op) {
  auto view = blocks.view({n, -1});
  std::vector<at::Tensor> parts;
  for (int r = 0; r < n; ++r) {
    parts.push_back(view[r]);
  }
  reduce_into(out, parts, op);
}

// NOTE [Receive buffers]
// A collective that receives into freshly allocated memory is slow here out
// of proportion: every page faults in while Gloo's thread copies from the
// socket, the receiver falls behind, and TCP stalls the sender for tens of
// milliseconds (a 16 MB reduce-scatter on 2 ranks: 85 ms median with a
// fresh buffer per call, 6.6 ms reusing one; the all-to-all alone, 5.3 ms).
// So receive buffers come from a small pool: a buffer goes back when its
// collective has finished (never while Gloo may still write it), and the
// pool keeps the few largest for the next call.
class BufferPool {
 public:
  at::Tensor take(int64_t bytes, at::Device device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i) {
        const auto& t = free_[i];
        if (t.device() == device && t.numel() >= bytes &&
            (best == free_.size() || t.numel() < free_[best].numel())) {
          best = i;
        }
      }
      if (best < free_.size()) {
        at::Tensor t = std::move(free_[best]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        return t;
      }
    }
    return at::empty({bytes}, at::TensorOptions(device).dtype(at::kByte));
  }

  void give_back(at::Tensor t) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(t));
    if (free_.size() > kKeep) {
      auto smallest = std::min_element(
          free_.begin(), free_.end(), [](const auto& a, const auto& b) {
            return a.numel() < b.numel();
          });
      free_.erase(smallest);
    }
  }

 private:
  static constexpr size_t kKeep = 4; // two buckets in flight, two groups
  std::mutex mu_;
  std::vector<at::Tensor> free_;
};

inline BufferPool& buffer_pool() {
  static BufferPool pool;
  return pool;
}

// A pooled buffer viewed as `numel` elements of `options`' dtype; `done`
// hands it back.
struct PooledBuffer {
  at::Tensor bytes;
  at::Tensor tensor;
  void done() {
    if (bytes.defined()) {
      buffer_pool().give_back(std::move(bytes));
      tensor.reset();
    }
  }
};

inline PooledBuffer pooled(int64_t numel, const at::TensorOptions& options) {
  PooledBuffer b;
  const int64_t elt = static_cast<int64_t>(options.dtype().itemsize());
  b.bytes = buffer_pool().take(numel * elt, options.device());
  b.tensor =
      b.bytes.narrow(0, 0, numel * elt).view(options.dtype().toScalarType());
  return b;
}

// Every rank's shard size when `numel` elements split over `world` ranks
// as shard_range splits them.
inline std::vector<int64_t> shard_sizes(int64_t numel, int world) {
  std::vector<int64_t> s(world);
  for (int r = 0; r < world; ++r) {
    auto range = shard_range(numel, world, r);
    s[r] = range.second - range.first;
  }
  return s;
}

} // namespace detail
} // namespace distributed
} // namespace colossalai
