#include "collective_ops.h"
#include "raised_backward.h"

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
// from the LibTorch 2.x releases that implement flat all-gather and bf16
// sums (found at the first call; NOTE [c10d backends across versions]);
// `collective_path` says which path the last call took. Not Gloo's
// reduce-scatter: it moves an all-reduce's bytes (2 (N-1) / N of the
// input per rank, measured across a link), twice the replacement's.
// These replacements serve groups that span hosts (or run with
// shm_collectives off): on one host the shared-memory channel carries all
// four operations (NOTE [Shared-memory collectives]).

namespace colossalai {
namespace distributed {

using namespace detail; // the shared helpers (collective_ops.h)

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
  detail::Nested nested;
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
  // NOTE [A backward that raised on some ranks]: it waited for a rank whose
  // pass raised.
  const std::string raised = raised_elsewhere(group);
  if (!raised.empty()) {
    return DistributedError(
        group.describe() + ": " + op + " failed: " + raised +
        ", and this rank waited for that rank's part (" + error_text(cause) +
        "); restart every rank and load the last checkpoint");
  }
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
  Issue issue(group, "all_reduce");
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
  Issue issue(group, "broadcast");
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
  Issue issue(group, "all_gather");
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
  Issue issue(group, "gather");
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

Work send(
    const at::Tensor& tensor,
    int dst,
    const ProcessGroup& group,
    int tag) {
  check_usable(group, "send");
  g_exchanged.fetch_add(1, std::memory_order_relaxed);
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
  check_usable(group, "recv");
  g_exchanged.fetch_add(1, std::memory_order_relaxed);
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

namespace {
constexpr int64_t kMaxSentDims = 16;
} // namespace

void send_tensor(
    const at::Tensor& tensor,
    int dst,
    const ProcessGroup& group,
    int tag) {
  const auto t = tensor.detach().contiguous();
  TORCH_CHECK(
      t.dim() <= kMaxSentDims,
      "send_tensor: at most ",
      kMaxSentDims,
      " dimensions, got ",
      t.dim());
  auto head = at::zeros({kMaxSentDims + 2}, at::kLong);
  auto* p = head.data_ptr<int64_t>();
  p[0] = static_cast<int64_t>(t.scalar_type());
  p[1] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) {
    p[2 + d] = t.size(d);
  }
  head = head.to(group.device());
  send(head, dst, group, tag).wait();
  send(t, dst, group, tag).wait();
}

at::Tensor recv_tensor(int src, const ProcessGroup& group, int tag) {
  auto head = at::empty(
      {kMaxSentDims + 2}, at::TensorOptions(at::kLong).device(group.device()));
  recv(head, src, group, tag).wait();
  head = head.cpu();
  const auto* p = head.data_ptr<int64_t>();
  TORCH_CHECK(
      p[1] >= 0 && p[1] <= kMaxSentDims && p[0] >= 0 &&
          p[0] < static_cast<int64_t>(at::ScalarType::NumOptions),
      "recv_tensor: a corrupt header from rank ",
      src);
  auto t = at::empty(
      std::vector<int64_t>(p + 2, p + 2 + p[1]),
      at::TensorOptions(static_cast<at::ScalarType>(p[0]))
          .device(group.device()));
  recv(t, src, group, tag).wait();
  return t;
}

Work barrier(const ProcessGroup& group) {
  Issue issue(group, "barrier");
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
