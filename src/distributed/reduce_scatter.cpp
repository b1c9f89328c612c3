// reduce_scatter: the backend's where it has one, the shared-memory
// channel on one host, else the point-to-point replacement (NOTE [Gloo
// reduce-scatter]).

#include "collective_ops.h"

#include <cstring>

namespace colossalai {
namespace distributed {

using namespace detail; // the shared helpers (collective_ops.h)

namespace {

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

// Reduce-scatter through the backend's own flat collective (NCCL), an
// uneven input padded to equal shards.
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
  auto w = launch();
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

Work reduce_scatter(
    at::Tensor& output,
    const at::Tensor& input,
    const ProcessGroup& group,
    ReduceOp op) {
  Issue issue(group, "reduce_scatter");
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
  // Gloo's own reduce-scatter is not used even where LibTorch has it: it
  // sends what an all-reduce sends, twice the replacement's bytes (10 MiB
  // per 10 MiB tensor at 2 ranks across a link, against 5 MiB), and 2.6's
  // ignores MAX / MIN (NOTE [Gloo replacements]).
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
  if (gloo(group)) {
    return m * n * elt; // the all-to-all's receive buffer (see above)
  }
  return m * n == numel ? 0 : (m * n + m) * elt; // padded input and output
}

} // namespace distributed
} // namespace colossalai
