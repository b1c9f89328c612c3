#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>

#include "backend.h"
#include "local_reduce.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>

// NOTE [Gloo replacements]
// Gloo in LibTorch 1.13 has no reduce-scatter, no flat all-gather and no bf16
// arithmetic. Replacements that move the same number of bytes as the optimal
// algorithms:
//  * reduce_scatter = each rank sends N-1 shards and receives N-1 (the ring
//    optimum): point to point in chunks, summed as they land, for fp32 /
//    fp64 CPU tensors (NOTE [Gloo reduce-scatter]); otherwise one all-to-all
//    + a local sum in fp32;
//  * flat all_gather = Gloo's allgather into views of the output (uneven
//    shards are padded to the largest, at most one element each);
//  * bf16 all_reduce = the reduce_scatter above + all_gather, both moving the
//    raw 16-bit payload (a bf16 tensor travels viewed as fp16: only bytes
//    move). The all_gather phase starts in wait(); collectives are matched by
//    call order, so this stays consistent as long as every rank waits in the
//    same order relative to its other calls on the group, as SPMD code does.
// Where the backend has the operation itself it is used: NCCL always, Gloo
// from the LibTorch 2.x releases that implement flat all-gather,
// reduce-scatter and bf16 sums (found at the first call; NOTE [c10d backends
// across versions]); `collective_path` says which path the last call took.
// These replacements serve groups that span hosts (or run with
// shm_collectives off): on one host the shared-memory channel carries all
// four operations (NOTE [Shared-memory collectives]).

namespace colossalai {
namespace distributed {

namespace {

std::atomic<int64_t> g_bytes{0};

void count(const at::Tensor& t, const ProcessGroup& g) {
  const int64_t n = t.numel() * t.element_size();
  g_bytes.fetch_add(n, std::memory_order_relaxed);
  g.add_bytes_communicated(n);
}

bool gloo(const ProcessGroup& g) {
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
detail::ShmChannel* channel_of(const ProcessGroup& g) {
  auto* c = g.transport_handle().shm.get();
  return c != nullptr && !c->on_channel_thread() ? c : nullptr;
}

// The group's channel when it carries `t` itself (NOTE [Shared-memory
// collectives]), else null.
detail::ShmChannel* shm(
    const ProcessGroup& g,
    const at::Tensor& t,
    bool reduces) {
  auto* channel = channel_of(g);
  return channel && detail::ShmChannel::carries(t, reduces) ? channel : nullptr;
}

bool ready(const std::shared_future<void>& f) {
  return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

Work shm_work(
    std::shared_future<void> done,
    const char* op,
    const ProcessGroup& g) {
  return detail::make_work(
      compat::WorkPtr(),
      [done]() { done.get(); },
      op,
      g,
      [done]() { return ready(done); });
}

// Runs `run` (which starts the operation on the backend) at its turn in
// the group's order, and waits for it there (NOTE [One order per group]).
Work in_order(
    detail::ShmChannel* channel,
    const char* op,
    const ProcessGroup& g,
    std::function<Work()> run) {
  return shm_work(
      channel->run_in_order([run = std::move(run)] { run().wait(); }), op, g);
}

// The channel an operation the segment does not carry queues on.
detail::ShmChannel* queue_for(
    const ProcessGroup& g,
    const at::Tensor& t,
    bool reduces) {
  auto* channel = channel_of(g);
  return channel && !detail::ShmChannel::carries(t, reduces) ? channel
                                                             : nullptr;
}

// A bf16 tensor on a Gloo group travels as opaque 16-bit words where only
// bytes move (Gloo in 1.13 has no bf16 type at all).
at::Tensor raw(const at::Tensor& t, const ProcessGroup& g) {
  return gloo(g) && t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t;
}

// How the last call of each reducing / gathering collective ran
// (collective_path()).
enum Op { kAllReduce, kAllGather, kReduceScatter, kNumOps };
std::atomic<int> g_path[kNumOps] = {};

void record(Op op, CollectivePath path) {
  g_path[op].store(static_cast<int>(path), std::memory_order_relaxed);
}

// NOTE [Tensors the backend does not carry]
// Gloo moves host memory, NCCL device memory. A tensor on the other side -
// a CUDA tensor on a Gloo group (several ranks sharing one GPU), a host
// tensor on an NCCL group (offloaded optimizer states, gathered for a
// checkpoint) - travels through a copy on the backend's side: taken when
// the call starts, written back in wait(). Host copies are pinned. Every
// path below (shared memory, the replacements) then serves both.
bool foreign(const ProcessGroup& g, const at::Tensor& t) {
  return t.defined() && (gloo(g) ? t.is_cuda() : !t.is_cuda());
}

// `t` itself when the backend carries it, else a copy it carries (holding
// `t`'s values when `copy`).
at::Tensor carried(const ProcessGroup& g, const at::Tensor& t, bool copy) {
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
Work staged_work(
    Work inner,
    std::vector<std::pair<at::Tensor, at::Tensor>> back,
    const char* op,
    const ProcessGroup& g) {
  auto w = std::make_shared<Work>(std::move(inner));
  return detail::make_work(
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
std::atomic<Native> g_gloo_native[kNumOps] = {};

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
bool gloo_reduces(at::ScalarType dtype) {
  return dtype != at::kBFloat16 || compat::gloo_reduces_bf16();
}

void check_dense(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.defined(), op, ": ", what, " tensor is undefined");
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, " tensor must be contiguous");
}

::c10d::ReduceOp to_c10d(ReduceOp op) {
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
void local_reduce(
    at::Tensor& out,
    const at::Tensor& blocks,
    int n,
    ReduceOp op) {
  auto view = blocks.view({n, -1});
  std::vector<at::Tensor> parts;
  for (int r = 0; r < n; ++r) {
    parts.push_back(view[r]);
  }
  detail::reduce_into(out, parts, op);
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

BufferPool& buffer_pool() {
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

PooledBuffer pooled(int64_t numel, const at::TensorOptions& options) {
  PooledBuffer b;
  const int64_t elt = static_cast<int64_t>(options.dtype().itemsize());
  b.bytes = buffer_pool().take(numel * elt, options.device());
  b.tensor =
      b.bytes.narrow(0, 0, numel * elt).view(options.dtype().toScalarType());
  return b;
}

// Tags of reduce_scatter's point-to-point chunks: above any a caller uses
// (the pipeline's are below 2^20).
constexpr int kReduceScatterTag = 1 << 28;

// NOTE [Gloo reduce-scatter]
// Each rank sends every peer that peer's block and receives the peers'
// blocks of its own shard, in chunks, point to point, all posted at once;
// chunk c is summed into the output (in rank order, so every call rounds
// the same way) as soon as every peer's chunk c has landed, while later
// chunks are still on the wire. The same bytes as an all-to-all, without
// its local copy of the own block, and the sum overlaps the transfer.
Work reduce_scatter_p2p(
    at::Tensor out,
    at::Tensor in,
    const std::vector<int64_t>& sizes,
    const ProcessGroup& group,
    ReduceOp op) {
  const int n = group.size(), me = group.rank();
  const int64_t mine = sizes[me];
  std::vector<int64_t> offset(n + 1, 0);
  for (int r = 0; r < n; ++r) {
    offset[r + 1] = offset[r] + sizes[r];
  }
  // A block of `len` elements (the receiver's shard) goes in chunks of at
  // least 1 MiB, at most 4 (each message costs a fixed overhead); sender
  // and receiver cut it alike.
  const int64_t min_chunk = std::max<int64_t>((1 << 20) / in.element_size(), 1);
  auto cut = [min_chunk](int64_t len) {
    const int64_t k = std::clamp<int64_t>(len / min_chunk, 1, 4);
    const int64_t per = (len + k - 1) / k;
    std::vector<std::pair<int64_t, int64_t>> pieces; // (begin, length)
    for (int64_t b = 0; b < len; b += per) {
      pieces.emplace_back(b, std::min(per, len - b));
    }
    return pieces;
  };
  auto& backend = detail::backend(group);
  auto post = [&](bool is_send, at::Tensor t, int peer, size_t c) {
    std::vector<at::Tensor> ts{t};
    const int tag = kReduceScatterTag + static_cast<int>(c);
    return detail::make_work(
        detail::post(
            group,
            "reduce_scatter",
            [&] {
              return is_send ? backend.send(ts, peer, tag)
                             : backend.recv(ts, peer, tag);
            }),
        nullptr,
        "reduce_scatter",
        group);
  };
  const auto my_pieces = cut(mine);
  // Peer p's pieces land in slot p, or p - 1 past this rank (no slot for
  // the own block, which is read from the input).
  auto slot = [me](int p) { return p < me ? p : p - 1; };
  auto blocks = pooled(mine * (n - 1), in.options());
  auto sent = std::make_shared<std::vector<Work>>();
  auto arrived = std::make_shared<std::vector<Work>>();
  size_t rounds = my_pieces.size();
  std::vector<std::vector<std::pair<int64_t, int64_t>>> their(n);
  for (int p = 0; p < n; ++p) {
    their[p] = cut(sizes[p]);
    rounds = std::max(rounds, their[p].size());
  }
  // Chunk by chunk, so the first chunks of every peer land first.
  for (size_t c = 0; c < rounds; ++c) {
    for (int p = 0; p < n; ++p) {
      if (p == me) {
        continue;
      }
      if (c < their[p].size()) {
        const auto& piece = their[p][c];
        sent->push_back(post(
            true, in.narrow(0, offset[p] + piece.first, piece.second), p, c));
      }
      if (c < my_pieces.size()) {
        const auto& piece = my_pieces[c];
        arrived->push_back(post(
            false,
            blocks.tensor.narrow(0, slot(p) * mine + piece.first, piece.second),
            p,
            c));
      }
    }
  }
  return detail::make_work(
      compat::WorkPtr(),
      [out,
       in,
       blocks,
       sent,
       arrived,
       my_pieces,
       mine,
       me,
       n,
       off = offset[me],
       slot,
       op]() mutable {
        size_t k = 0;
        for (const auto& piece : my_pieces) {
          auto part = [&](int p) {
            return p == me ? in.narrow(0, off + piece.first, piece.second)
                           : blocks.tensor.narrow(
                                 0, slot(p) * mine + piece.first, piece.second);
          };
          for (int p = 0; p < n - 1; ++p) {
            (*arrived)[k++].wait();
          }
          std::vector<at::Tensor> parts;
          for (int p = 0; p < n; ++p) {
            parts.push_back(part(p));
          }
          detail::reduce_into(
              out.narrow(0, piece.first, piece.second), parts, op);
        }
        for (auto& w : *sent) {
          w.wait();
        }
        blocks.done();
      },
      "reduce_scatter",
      group,
      [sent, arrived]() {
        for (const auto* works : {sent.get(), arrived.get()}) {
          for (const auto& w : *works) {
            if (!w.is_completed()) {
              return false;
            }
          }
        }
        return true;
      });
}

std::vector<int64_t> shard_sizes(int64_t numel, int world) {
  std::vector<int64_t> s(world);
  for (int r = 0; r < world; ++r) {
    auto range = shard_range(numel, world, r);
    s[r] = range.second - range.first;
  }
  return s;
}

// Reduce-scatter through the backend's own flat collective, an uneven input
// padded to equal shards; nullopt where Gloo refuses it (NOTE [c10d
// backends across versions]).
c10::optional<Work> reduce_scatter_native(
    at::Tensor out,
    at::Tensor in,
    const std::vector<int64_t>& sizes,
    const ProcessGroup& group,
    ReduceOp op) {
  const int n = group.size();
  const int64_t m = sizes[0], mine = sizes[group.rank()];
  const bool even = m * n == in.numel();
  at::Tensor src = in, dst = out;
  if (!even) {
    src = at::zeros({m * n}, in.options());
    int64_t at = 0;
    for (int r = 0; r < n; ++r) {
      src.slice(0, r * m, r * m + sizes[r])
          .copy_(in.slice(0, at, at + sizes[r]));
      at += sizes[r];
    }
    dst = at::empty({m}, in.options());
  }
  ::c10d::ReduceScatterOptions opts;
  opts.reduceOp = to_c10d(op);
  auto launch = [&] {
    return detail::post(group, "reduce_scatter", [&] {
      return compat::reduce_scatter_single(
          detail::backend(group), dst, src, opts);
    });
  };
  auto w = gloo(group) ? try_gloo_native(kReduceScatter, launch) : launch();
  if (!w) {
    return c10::nullopt;
  }
  record(kReduceScatter, CollectivePath::kBackend);
  std::function<void()> finish;
  if (!even || op == ReduceOp::kAvg) {
    finish = [out, dst, mine, n, op, even]() mutable {
      if (!even) {
        out.copy_(dst.slice(0, 0, mine));
      }
      if (op == ReduceOp::kAvg) {
        out.div_(n);
      }
    };
  }
  return detail::make_work(w, std::move(finish), "reduce_scatter", group);
}

} // namespace

CollectivePath collective_path(const std::string& op) {
  static const char* const kNames[kNumOps] = {
      "all_reduce", "all_gather", "reduce_scatter"};
  for (int i = 0; i < kNumOps; ++i) {
    if (op == kNames[i]) {
      return static_cast<CollectivePath>(g_path[i].load());
    }
  }
  TORCH_CHECK(
      false,
      "collective_path: unknown operation '",
      op,
      "' (all_reduce, all_gather or reduce_scatter)");
}

const char* to_string(CollectivePath path) {
  switch (path) {
    case CollectivePath::kLocal:
      return "local";
    case CollectivePath::kSharedMemory:
      return "shared memory";
    case CollectivePath::kBackend:
      return "backend";
    case CollectivePath::kReplacement:
      return "replacement";
    default:
      return "none";
  }
}

Work::Work() = default;
Work::Work(std::unique_ptr<State> state) : state_(std::move(state)) {}
Work::Work(Work&& other) noexcept = default;
Work& Work::operator=(Work&& other) noexcept = default;
Work::~Work() = default;

Work detail::make_work(
    compat::WorkPtr work,
    std::function<void()> finish,
    std::string op,
    const ProcessGroup& group,
    std::function<bool()> ready) {
  auto st = std::make_unique<Work::State>();
  st->work = std::move(work);
  st->finish = std::move(finish);
  st->ready = std::move(ready);
  st->op = std::move(op);
  st->group = &group;
  st->keep = group.weak_from_this().lock();
  return Work(std::move(st));
}

void Work::wait() {
  if (!state_) {
    return;
  }
  // Finished exactly once: the state leaves the handle before anything runs.
  auto st = std::move(state_);
  try {
    if (st->work) {
      st->work->wait();
    }
    if (st->finish) {
      st->finish();
    }
  } catch (const DistributedError&) {
    throw;
  } catch (const std::exception& e) {
    throw detail::failure(*st->group, st->op, e);
  }
}

DistributedError detail::failure(
    const ProcessGroup& group,
    const std::string& op,
    const std::exception& cause) {
  return DistributedError(
      group.describe() + ": " + op + " failed (timeout " +
      std::to_string(group.timeout().count()) +
      " ms; did a peer exit?): " + error_text(cause));
}

bool Work::is_completed() const {
  if (!state_) {
    return true;
  }
  if (state_->ready) {
    return state_->ready();
  }
  // A finish after a backend work is local: the network part is that work.
  return state_->work ? state_->work->isCompleted() : !state_->finish;
}

std::pair<int64_t, int64_t> shard_range(int64_t numel, int world, int rank) {
  TORCH_CHECK(world > 0 && rank >= 0 && rank < world, "shard_range: bad rank");
  int64_t base = numel / world, extra = numel % world;
  int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

Work all_reduce(at::Tensor& tensor, const ProcessGroup& group, ReduceOp op) {
  check_dense(tensor, "all_reduce", "input");
  if (foreign(group, tensor)) {
    auto c = carried(group, tensor, true);
    return staged_work(
        all_reduce(c, group, op), {{tensor, c}}, "all_reduce", group);
  }
  if (auto* channel = queue_for(group, tensor, /*reduces=*/true)) {
    auto t = tensor;
    return in_order(
        channel, "all_reduce", group, [t, g = &group, op]() mutable {
          return all_reduce(t, *g, op);
        });
  }
  count(tensor, group);
  if (group.size() == 1) {
    record(kAllReduce, CollectivePath::kLocal);
    return Work();
  }
  if (auto* channel = shm(group, tensor, /*reduces=*/true)) {
    record(kAllReduce, CollectivePath::kSharedMemory);
    return shm_work(channel->all_reduce(tensor, op), "all_reduce", group);
  }
  if (gloo(group) && !gloo_reduces(tensor.scalar_type())) {
    // Two phases, see NOTE [Gloo replacements].
    record(kAllReduce, CollectivePath::kReplacement);
    auto range = shard_range(tensor.numel(), group.size(), group.rank());
    auto flat = tensor.view({-1});
    auto shard = pooled(range.second - range.first, tensor.options());
    auto rs =
        std::make_shared<Work>(reduce_scatter(shard.tensor, flat, group, op));
    const ProcessGroup* g = &group;
    return detail::make_work(
        compat::WorkPtr(),
        [rs, shard, flat, g]() mutable {
          rs->wait();
          all_gather(flat, shard.tensor, *g).wait();
          shard.done();
        },
        "all_reduce(bf16)",
        group);
  }
  record(kAllReduce, CollectivePath::kBackend);
  std::vector<at::Tensor> ts{tensor};
  ::c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  auto w = detail::post(group, "all_reduce", [&] {
    return detail::backend(group).allreduce(ts, opts);
  });
  std::function<void()> finish;
  if (op == ReduceOp::kAvg) {
    int n = group.size();
    finish = [tensor, n]() mutable { tensor.div_(n); };
  }
  return detail::make_work(w, std::move(finish), "all_reduce", group);
}

Work broadcast(at::Tensor& tensor, int src, const ProcessGroup& group) {
  check_dense(tensor, "broadcast", "input");
  if (foreign(group, tensor)) {
    auto c = carried(group, tensor, group.rank() == src);
    return staged_work(
        broadcast(c, src, group), {{tensor, c}}, "broadcast", group);
  }
  TORCH_CHECK(
      src >= 0 && src < group.size(),
      "broadcast: src ",
      src,
      " outside group of ",
      group.size());
  if (auto* channel = queue_for(group, tensor, /*reduces=*/false)) {
    auto t = tensor;
    return in_order(
        channel, "broadcast", group, [t, src, g = &group]() mutable {
          return broadcast(t, src, *g);
        });
  }
  count(tensor, group);
  if (group.size() == 1) {
    return Work();
  }
  if (auto* channel = shm(group, tensor, /*reduces=*/false)) {
    return shm_work(channel->broadcast(tensor, src), "broadcast", group);
  }
  std::vector<at::Tensor> ts{raw(tensor, group)};
  ::c10d::BroadcastOptions opts;
  opts.rootRank = src;
  return detail::make_work(
      detail::post(
          group,
          "broadcast",
          [&] { return detail::backend(group).broadcast(ts, opts); }),
      nullptr,
      "broadcast",
      group);
}

Work all_gather(
    at::Tensor& output,
    const at::Tensor& input,
    const ProcessGroup& group) {
  check_dense(output, "all_gather", "output");
  check_dense(input, "all_gather", "input");
  if (auto w = via_carried(
          output,
          input,
          group,
          "all_gather",
          [&](at::Tensor& o, const at::Tensor& i) {
            return all_gather(o, i, group);
          })) {
    return std::move(*w);
  }
  TORCH_CHECK(
      output.scalar_type() == input.scalar_type(),
      "all_gather: output dtype ",
      output.scalar_type(),
      " differs from input dtype ",
      input.scalar_type());
  const int n = group.size();
  auto sizes = shard_sizes(output.numel(), n);
  TORCH_CHECK(
      input.numel() == sizes[group.rank()],
      "all_gather: rank ",
      group.rank(),
      " must give ",
      sizes[group.rank()],
      " elements for an output of ",
      output.numel(),
      ", got ",
      input.numel());
  if (auto* channel = queue_for(group, input, /*reduces=*/false)) {
    auto o = output;
    return in_order(
        channel, "all_gather", group, [o, input, g = &group]() mutable {
          return all_gather(o, input, *g);
        });
  }
  count(input, group);
  auto out = output.view({-1});
  if (n == 1) {
    record(kAllGather, CollectivePath::kLocal);
    out.copy_(input.view({-1}));
    return Work();
  }
  if (auto* channel = shm(group, input, /*reduces=*/false)) {
    record(kAllGather, CollectivePath::kSharedMemory);
    return shm_work(
        channel->all_gather(out, input, std::move(sizes)), "all_gather", group);
  }
  const int64_t m = sizes[0]; // largest shard
  const bool even = m * n == output.numel();
  if (even) {
    auto o = raw(out, group);
    auto i = raw(input.view({-1}), group);
    auto launch = [&] {
      return detail::post(group, "all_gather", [&] {
        return compat::all_gather_single(detail::backend(group), o, i);
      });
    };
    auto w = gloo(group) ? try_gloo_native(kAllGather, launch) : launch();
    if (w) {
      record(kAllGather, CollectivePath::kBackend);
      return detail::make_work(std::move(w), nullptr, "all_gather", group);
    }
  }
  record(kAllGather, CollectivePath::kReplacement);
  at::Tensor buffer = even ? out : at::empty({m * n}, output.options());
  at::Tensor in = input.view({-1});
  if (in.numel() != m) {
    auto padded = at::zeros({m}, input.options());
    padded.slice(0, 0, in.numel()).copy_(in);
    in = padded;
  }
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int r = 0; r < n; ++r) {
    outs[0].push_back(raw(buffer.slice(0, r * m, (r + 1) * m), group));
  }
  std::vector<at::Tensor> ins{raw(in, group)};
  auto w = detail::post(group, "all_gather", [&] {
    return detail::backend(group).allgather(outs, ins);
  });
  std::function<void()> finish;
  if (!even) {
    finish = [out, buffer, sizes, m, n]() mutable {
      int64_t at = 0;
      for (int r = 0; r < n; ++r) {
        out.slice(0, at, at + sizes[r])
            .copy_(buffer.slice(0, r * m, r * m + sizes[r]));
        at += sizes[r];
      }
    };
  }
  return detail::make_work(w, std::move(finish), "all_gather", group);
}

Work gather(
    at::Tensor& output,
    const at::Tensor& input,
    int root,
    const ProcessGroup& group) {
  check_dense(input, "gather", "input");
  if (auto w = via_carried(
          output,
          input,
          group,
          "gather",
          [&](at::Tensor& o, const at::Tensor& i) {
            return gather(o, i, root, group);
          })) {
    return std::move(*w);
  }
  TORCH_CHECK(
      root >= 0 && root < group.size(),
      "gather: root ",
      root,
      " outside group of ",
      group.size());
  const int n = group.size();
  const bool me = group.rank() == root;
  if (me) {
    check_dense(output, "gather", "output");
    TORCH_CHECK(
        output.numel() == input.numel() * n &&
            output.scalar_type() == input.scalar_type(),
        "gather: output must hold ",
        n,
        " x ",
        input.numel(),
        " elements of ",
        input.scalar_type());
  }
  if (auto* channel = channel_of(group)) {
    auto o = output;
    return in_order(
        channel, "gather", group, [o, input, root, g = &group]() mutable {
          return gather(o, input, root, *g);
        });
  }
  count(input, group);
  if (n == 1) {
    output.view({-1}).copy_(input.view({-1}));
    return Work();
  }
  std::vector<std::vector<at::Tensor>> outs;
  if (me) {
    outs.emplace_back();
    auto flat = output.view({-1});
    const int64_t m = input.numel();
    for (int r = 0; r < n; ++r) {
      outs[0].push_back(raw(flat.slice(0, r * m, (r + 1) * m), group));
    }
  }
  std::vector<at::Tensor> ins{raw(input.view({-1}), group)};
  ::c10d::GatherOptions opts;
  opts.rootRank = root;
  return detail::make_work(
      detail::post(
          group,
          "gather",
          [&] { return detail::backend(group).gather(outs, ins, opts); }),
      nullptr,
      "gather",
      group);
}

Work reduce_scatter(
    at::Tensor& output,
    const at::Tensor& input,
    const ProcessGroup& group,
    ReduceOp op) {
  check_dense(output, "reduce_scatter", "output");
  check_dense(input, "reduce_scatter", "input");
  if (auto w = via_carried(
          output,
          input,
          group,
          "reduce_scatter",
          [&](at::Tensor& o, const at::Tensor& i) {
            return reduce_scatter(o, i, group, op);
          })) {
    return std::move(*w);
  }
  TORCH_CHECK(
      output.scalar_type() == input.scalar_type(),
      "reduce_scatter: output dtype ",
      output.scalar_type(),
      " differs from input dtype ",
      input.scalar_type());
  const int n = group.size();
  auto sizes = shard_sizes(input.numel(), n);
  const int64_t mine = sizes[group.rank()];
  TORCH_CHECK(
      output.numel() == mine,
      "reduce_scatter: rank ",
      group.rank(),
      " must receive ",
      mine,
      " elements of an input of ",
      input.numel(),
      ", got an output of ",
      output.numel());
  if (auto* channel = queue_for(group, input, /*reduces=*/true)) {
    auto o = output;
    return in_order(
        channel, "reduce_scatter", group, [o, input, op, g = &group]() mutable {
          return reduce_scatter(o, input, *g, op);
        });
  }
  count(input, group);
  auto in = input.view({-1});
  auto out = output.view({-1});
  if (n == 1) {
    record(kReduceScatter, CollectivePath::kLocal);
    out.copy_(in);
    return Work();
  }
  if (!gloo(group)) {
    auto w = reduce_scatter_native(out, in, sizes, group, op);
    TORCH_INTERNAL_ASSERT(w.has_value());
    return std::move(*w);
  }
  if (auto* channel = shm(group, input, /*reduces=*/true)) {
    record(kReduceScatter, CollectivePath::kSharedMemory);
    return shm_work(
        channel->reduce_scatter(out, in, sizes, op), "reduce_scatter", group);
  }
  // Gloo's own reduce-scatter only sums: LibTorch 2.6's ignores MAX / MIN
  // and returns sums (test_collectives' ChunkedReduceScatterInFlight).
  const bool sums = op == ReduceOp::kSum || op == ReduceOp::kAvg;
  if (sums && gloo_reduces(input.scalar_type()) &&
      g_gloo_native[kReduceScatter].load() != Native::kNo) {
    if (auto w = reduce_scatter_native(out, in, sizes, group, op)) {
      return std::move(*w);
    }
  }
  record(kReduceScatter, CollectivePath::kReplacement);
  const bool low =
      input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kHalf;
  if (input.device().is_cpu() && !low) {
    return reduce_scatter_p2p(out, in, sizes, group, op);
  }
  // Gloo: all-to-all of the shards, then a local reduction.
  // The receive buffer is pooled (NOTE [Receive buffers]).
  auto blocks = pooled(mine * n, input.options());
  std::vector<int64_t> out_splits(n, mine), in_splits = sizes;
  auto o = raw(blocks.tensor, group);
  auto i = raw(in, group);
  auto w = detail::post(group, "reduce_scatter", [&] {
    return compat::all_to_all_single(
        detail::backend(group), o, i, out_splits, in_splits);
  });
  return detail::make_work(
      w,
      [out, blocks, n, op]() mutable {
        local_reduce(out, blocks.tensor, n, op);
        blocks.done();
      },
      "reduce_scatter",
      group);
}

int64_t reduce_scatter_workspace_bytes(
    int64_t numel,
    at::ScalarType dtype,
    const ProcessGroup& group) {
  const int n = group.size();
  if (n == 1) {
    return 0;
  }
  if (group.transport_handle().shm) {
    return 0; // reduced straight from the shared segment into the output
  }
  const int64_t m = shard_sizes(numel, n)[0];
  const int64_t elt = static_cast<int64_t>(c10::elementSize(dtype));
  if (gloo(group) &&
      (g_gloo_native[kReduceScatter].load() != Native::kYes ||
       !gloo_reduces(dtype))) {
    return m * n * elt; // the all-to-all's receive buffer (see above)
  }
  return m * n == numel ? 0 : (m * n + m) * elt; // padded input and output
}

Work all_to_all(
    at::Tensor& output,
    const at::Tensor& input,
    const ProcessGroup& group,
    std::vector<int64_t> output_splits,
    std::vector<int64_t> input_splits) {
  check_dense(output, "all_to_all", "output");
  check_dense(input, "all_to_all", "input");
  if (auto w = via_carried(
          output,
          input,
          group,
          "all_to_all",
          [&](at::Tensor& o, const at::Tensor& i) {
            return all_to_all(o, i, group, output_splits, input_splits);
          })) {
    return std::move(*w);
  }
  TORCH_CHECK(
      output.scalar_type() == input.scalar_type(),
      "all_to_all: output and input dtypes differ");
  const int n = group.size();
  TORCH_CHECK(
      output_splits.empty() || (int)output_splits.size() == n,
      "all_to_all: output_splits needs ",
      n,
      " entries");
  TORCH_CHECK(
      input_splits.empty() || (int)input_splits.size() == n,
      "all_to_all: input_splits needs ",
      n,
      " entries");
  if (input_splits.empty()) {
    TORCH_CHECK(
        input.size(0) % n == 0,
        "all_to_all: input dim 0 (",
        input.size(0),
        ") must divide by the group size ",
        n,
        " when no splits are given");
  }
  if (auto* channel = shm(group, input, /*reduces=*/false)) {
    // Splits count rows of dim 0; the segment moves bytes.
    auto bytes = [n](const at::Tensor& t, const std::vector<int64_t>& splits) {
      const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
      const int64_t row = rows > 0 ? t.numel() / rows * t.element_size() : 0;
      std::vector<int64_t> b(n, rows / n * row);
      if (!splits.empty()) {
        int64_t total = 0;
        for (int q = 0; q < n; ++q) {
          b[q] = splits[q] * row;
          total += splits[q];
        }
        TORCH_CHECK(
            total == rows,
            "all_to_all: splits sum to ",
            total,
            " rows, the tensor has ",
            rows);
      }
      return b;
    };
    if (output_splits.empty()) {
      TORCH_CHECK(
          output.dim() > 0 && output.size(0) % n == 0,
          "all_to_all: output dim 0 must divide by the group size ",
          n,
          " when no splits are given");
    }
    auto send_bytes = bytes(input, input_splits);
    auto recv_bytes = bytes(output, output_splits);
    TORCH_CHECK(
        send_bytes[group.rank()] == recv_bytes[group.rank()],
        "all_to_all: this rank sends itself ",
        send_bytes[group.rank()],
        " bytes but expects ",
        recv_bytes[group.rank()]);
    count(input, group);
    return shm_work(
        channel->all_to_all(
            output, input, std::move(send_bytes), std::move(recv_bytes)),
        "all_to_all",
        group);
  }
  if (auto* channel = channel_of(group)) {
    auto o = output;
    return in_order(
        channel,
        "all_to_all",
        group,
        [o, input, output_splits, input_splits, g = &group]() mutable {
          return all_to_all(o, input, *g, output_splits, input_splits);
        });
  }
  count(input, group);
  if (n == 1) {
    output.copy_(input);
    return Work();
  }
  auto o = raw(output, group);
  auto i = raw(input, group);
  return detail::make_work(
      detail::post(
          group,
          "all_to_all",
          [&] {
            return compat::all_to_all_single(
                detail::backend(group), o, i, output_splits, input_splits);
          }),
      nullptr,
      "all_to_all",
      group);
}

Work send(
    const at::Tensor& tensor,
    int dst,
    const ProcessGroup& group,
    int tag) {
  check_dense(tensor, "send", "input");
  if (foreign(group, tensor)) {
    auto c = carried(group, tensor, true);
    return staged_work(
        send(c, dst, group, tag), {{at::Tensor(), c}}, "send", group);
  }
  TORCH_CHECK(
      dst >= 0 && dst < group.size() && dst != group.rank(),
      "send: bad destination rank ",
      dst);
  count(tensor, group);
  std::vector<at::Tensor> ts{raw(tensor, group)};
  const std::string op = "send to " + std::to_string(dst);
  return detail::make_work(
      detail::post(
          group, op, [&] { return detail::backend(group).send(ts, dst, tag); }),
      nullptr,
      op,
      group);
}

Work recv(at::Tensor& tensor, int src, const ProcessGroup& group, int tag) {
  check_dense(tensor, "recv", "output");
  if (foreign(group, tensor)) {
    auto c = carried(group, tensor, false);
    return staged_work(recv(c, src, group, tag), {{tensor, c}}, "recv", group);
  }
  TORCH_CHECK(
      src >= 0 && src < group.size() && src != group.rank(),
      "recv: bad source rank ",
      src);
  std::vector<at::Tensor> ts{raw(tensor, group)};
  const std::string op = "recv from " + std::to_string(src);
  return detail::make_work(
      detail::post(
          group, op, [&] { return detail::backend(group).recv(ts, src, tag); }),
      nullptr,
      op,
      group);
}

Work barrier(const ProcessGroup& group) {
  if (group.size() == 1) {
    return Work();
  }
  if (auto* channel = channel_of(group)) {
    return shm_work(channel->barrier(), "barrier", group);
  }
  ::c10d::BarrierOptions opts;
  if (!gloo(group) && group.device().is_cuda()) {
    // NCCL's barrier reduces a tensor on a device it would otherwise guess.
    opts.device_ids = {group.device().index()};
  }
  return detail::make_work(
      detail::post(
          group,
          "barrier",
          [&] { return detail::backend(group).barrier(opts); }),
      nullptr,
      "barrier",
      group);
}

std::vector<std::string> all_gather_bytes(
    const std::string& bytes,
    const ProcessGroup& group) {
  const int n = group.size();
  const auto dev = group.device();
  auto len =
      at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong).to(dev);
  auto lens = at::empty({n}, len.options());
  all_gather(lens, len, group).wait();
  auto lens_cpu = lens.cpu();
  const auto* l = lens_cpu.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(l, l + n);
  // Padded to the longest, so every rank gives an equal shard.
  auto mine = at::zeros({std::max<int64_t>(longest, 1)}, at::kByte);
  std::memcpy(mine.data_ptr(), bytes.data(), bytes.size());
  mine = mine.to(dev);
  auto all = at::empty({n * mine.numel()}, mine.options());
  all_gather(all, mine, group).wait();
  auto all_cpu = all.cpu();
  const auto* p = static_cast<const char*>(all_cpu.data_ptr());
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) {
    out.emplace_back(p + r * mine.numel(), l[r]);
  }
  return out;
}

RingHop ring_exchange(
    const at::Tensor& send_tensor,
    const ProcessGroup& group,
    int tag) {
  const int n = group.size(), r = group.rank();
  TORCH_CHECK(n > 1, "ring_exchange: the group has one rank");
  RingHop hop;
  hop.received = at::empty_like(send_tensor, at::MemoryFormat::Contiguous);
  // NCCL queues a pair's sends and receives on one stream in posting
  // order: with two ranks both neighbours are the same peer, and two ranks
  // that both receive first would wait forever. Even ranks send first.
  if (r % 2 == 0) {
    hop.sent = send(send_tensor, (r + 1) % n, group, tag);
    hop.arrived = recv(hop.received, (r - 1 + n) % n, group, tag);
  } else {
    hop.arrived = recv(hop.received, (r - 1 + n) % n, group, tag);
    hop.sent = send(send_tensor, (r + 1) % n, group, tag);
  }
  return hop;
}

int64_t bytes_communicated() {
  return g_bytes.load(std::memory_order_relaxed);
}

} // namespace distributed
} // namespace colossalai
