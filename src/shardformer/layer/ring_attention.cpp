#include <colossalai/distributed/collectives.h>
#include <colossalai/shardformer/layer/ring_attention.h>

#include "../../utils/host_memory.h"

#include <torch/autograd.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// NOTE [Ring attention]
// Rank r of n holds queries Q_r and, at step s, the key / value chunk of
// rank (r - s) mod n; the chunk for step s + 1 is already travelling (sent to
// r + 1, received from r - 1) while step s's block runs. Blocks merge with
// the online softmax: running row maximum m, sum l, unnormalised output acc;
// the result is acc / l and lse = m + log l is kept for backward. Backward
// sends the chunks round again with their gradient accumulators: the
// key / value chunk ahead (overlapped), the dK / dV accumulator after the
// block adds its share, so after n hops it is back at its owner. Masks come
// from global positions (key after query: masked), so a block can be empty,
// full or partial; which one is decided from the positions on the host
// (reading a device mask back would stall a GPU's queue at every block).
//
// The double ring is the same loop nested: sp rank R x I + p (inner ring
// R, place p of I) runs O = n / I rounds of I steps. At step i of round o
// it holds the chunk of sp rank ((R - o) mod O) x I + (p - i) mod I: the
// chunks go round the inner ring within a round, and the chunk a rank
// began round o with (sent on the inter ring while the round runs) begins
// round o + 1 at the same place of the next inner ring. One ring is O = 1
// with the inner ring sp. In backward each accumulator follows its chunk:
// I inner hops per round, which bring it back to the place its chunk began
// the round at, then one inter hop to where that chunk begins the next
// round; after O rounds it is home. Every hop of an accumulator travels
// while the next block computes.

namespace colossalai {
namespace shardformer {
namespace layer {

namespace {

namespace cd = distributed;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The inner ring's messages, the inter ring's (another group).
constexpr int kKvTag = 11, kGradTag = 12, kInterKvTag = 13, kInterGradTag = 14;

// How much of a key chunk the causal mask leaves a query chunk.
enum class Visible { kAll, kSome, kNone };

struct RingHolder : torch::CustomClassHolder {
  // One ring: inner = sp, no inter. Double: inner x inter = sp.
  distributed::ProcessGroupPtr inner, inter;
  at::Tensor positions; // [n, T_l] on the device
  std::vector<Visible> visible; // this rank's queries over rank j's keys
  int sp_rank = 0;

  int inner_size() const {
    return inner->size();
  }
  int rounds() const {
    return inter == nullptr ? 1 : inter->size();
  }
  // The sp rank whose chunk this rank holds at step i of round o.
  int source(int o, int i) const {
    const int n_in = inner_size(), n_out = rounds();
    const int ring = inter == nullptr ? 0 : inter->rank(), p = inner->rank();
    return ((ring - o + n_out) % n_out) * n_in + (p - i + n_in) % n_in;
  }
};

// An accumulator of key / value gradients following its chunk round the
// rings: `acc` once it is here, `moving` while it travels.
struct MovingGrad {
  at::Tensor acc;
  cd::RingHop moving;
  bool in_flight = false;

  void arrive() {
    if (in_flight) {
      moving.wait();
      acc = moving.received;
      in_flight = false;
    }
  }
  void send_on(const distributed::ProcessGroup& g, int tag) {
    moving = cd::ring_exchange(acc, g, tag);
    in_flight = true;
    acc = at::Tensor();
  }
};

// Keys after the query are masked: none when the latest key is no later
// than the earliest query, all when the earliest key is later than the
// latest query. `pos_q` and `pos_k` are contiguous int64 host rows.
Visible visibility(const at::Tensor& pos_q, const at::Tensor& pos_k) {
  if (pos_q.numel() == 0 || pos_k.numel() == 0) {
    return Visible::kNone;
  }
  const auto* q = pos_q.data_ptr<int64_t>();
  const auto* k = pos_k.data_ptr<int64_t>();
  const auto [q_min, q_max] = std::minmax_element(q, q + pos_q.numel());
  const auto [k_min, k_max] = std::minmax_element(k, k + pos_k.numel());
  if (*k_max <= *q_min) {
    return Visible::kAll;
  }
  return *k_min > *q_max ? Visible::kNone : Visible::kSome;
}

// The mask of a block that is partly visible (key after query: masked),
// formed on the device; undefined otherwise.
at::Tensor causal_mask(
    const at::Tensor& pos_q,
    const at::Tensor& pos_k,
    Visible visible) {
  return visible == Visible::kSome ? pos_k.unsqueeze(0) > pos_q.unsqueeze(1)
                                   : at::Tensor();
}

at::Tensor scores(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& mask,
    double scale) {
  auto s = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (mask.defined()) {
    s.masked_fill_(mask, -std::numeric_limits<double>::infinity());
  }
  return s;
}

class RingAttentionFn : public torch::autograd::Function<RingAttentionFn> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      const at::Tensor& q,
      const at::Tensor& k,
      const at::Tensor& v,
      c10::intrusive_ptr<RingHolder> holder) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const auto pos_q = holder->positions[holder->sp_rank];
    auto q32 = q.to(at::kFloat);
    auto kv = at::stack({k.to(at::kFloat), v.to(at::kFloat)}).contiguous();
    auto m = at::full(
        {q.size(0), q.size(1), q.size(2)},
        -std::numeric_limits<float>::infinity(),
        q32.options());
    auto l = at::zeros_like(m);
    auto acc = at::zeros_like(q32);
    const int n_in = holder->inner_size(), rounds = holder->rounds();
    auto kv_round = kv; // the chunk this rank begins the round with
    for (int o = 0; o < rounds; ++o) {
      cd::RingHop outer;
      if (o + 1 < rounds) {
        outer = cd::ring_exchange(kv_round, *holder->inter, kInterKvTag);
      }
      kv = kv_round;
      for (int i = 0; i < n_in; ++i) {
        cd::RingHop hop;
        if (i + 1 < n_in) {
          hop = cd::ring_exchange(kv, *holder->inner, kKvTag);
        }
        const int src = holder->source(o, i);
        if (holder->visible[src] != Visible::kNone) {
          auto mask =
              causal_mask(pos_q, holder->positions[src], holder->visible[src]);
          auto sc = scores(q32, kv[0], mask, scale);
          auto m_new = at::maximum(m, sc.amax(-1));
          // Rows with no visible key yet keep m = -inf: shift by 0 there.
          auto shift =
              at::where(at::isinf(m_new), at::zeros_like(m_new), m_new);
          auto alpha = at::exp(m - shift);
          auto p = at::exp(sc - shift.unsqueeze(-1));
          l = l * alpha + p.sum(-1);
          acc = acc * alpha.unsqueeze(-1) + at::matmul(p, kv[1]);
          m = m_new;
        }
        if (i + 1 < n_in) {
          hop.wait();
          kv = hop.received;
        }
      }
      if (o + 1 < rounds) {
        outer.wait();
        kv_round = outer.received;
      }
    }
    // Causal attention always sees the token itself: l > 0 on every row.
    auto out32 = acc / l.unsqueeze(-1);
    auto lse = m + at::log(l);
    ctx->save_for_backward({q, k, v, out32, lse});
    ctx->saved_data["ring"] = at::IValue::make_capsule(std::move(holder));
    return {out32.to(q.scalar_type())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto capsule = ctx->saved_data.at("ring").toCapsule();
    const auto& holder = *static_cast<RingHolder*>(capsule.get());
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    const auto &out32 = saved[3], &lse = saved[4];
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const auto pos_q = holder.positions[holder.sp_rank];
    auto q32 = q.to(at::kFloat);
    auto dout = grads[0].to(at::kFloat);
    auto delta = (dout * out32).sum(-1, /*keepdim=*/true); // [B, H, Tq, 1]
    auto dq = at::zeros_like(q32);
    auto kv_round =
        at::stack({k.to(at::kFloat), v.to(at::kFloat)}).contiguous();
    const int n_in = holder.inner_size(), rounds = holder.rounds();
    MovingGrad dkv;
    for (int o = 0; o < rounds; ++o) {
      cd::RingHop outer;
      if (o + 1 < rounds) {
        outer = cd::ring_exchange(kv_round, *holder.inter, kInterKvTag);
      }
      auto kv = kv_round;
      for (int i = 0; i < n_in; ++i) {
        cd::RingHop kv_hop;
        if (i + 1 < n_in) {
          kv_hop = cd::ring_exchange(kv, *holder.inner, kKvTag);
        }
        const int src = holder.source(o, i);
        at::Tensor dk, dv;
        if (holder.visible[src] != Visible::kNone) {
          auto mask =
              causal_mask(pos_q, holder.positions[src], holder.visible[src]);
          auto p = at::exp(scores(q32, kv[0], mask, scale) - lse.unsqueeze(-1));
          dv = at::matmul(p.transpose(-2, -1), dout);
          auto ds = p * (at::matmul(dout, kv[1].transpose(-2, -1)) - delta);
          dq.add_(at::matmul(ds, kv[0]), scale);
          dk = at::matmul(ds.transpose(-2, -1), q32).mul_(scale);
        }
        // The chunk's accumulator travelled while this block computed.
        dkv.arrive();
        if (!dkv.acc.defined()) {
          dkv.acc = dk.defined() ? at::stack({dk, dv}) : at::zeros_like(kv);
        } else if (dk.defined()) {
          dkv.acc[0].add_(dk);
          dkv.acc[1].add_(dv);
        }
        if (n_in > 1) {
          dkv.send_on(*holder.inner, kGradTag);
        }
        if (i + 1 < n_in) {
          kv_hop.wait();
          kv = kv_hop.received;
        }
      }
      if (rounds > 1) {
        // Back at the place its chunk began the round: on to the next ring.
        dkv.arrive();
        dkv.send_on(*holder.inter, kInterGradTag);
      }
      if (o + 1 < rounds) {
        outer.wait();
        kv_round = outer.received;
      }
    }
    dkv.arrive(); // this rank's own chunk's
    return {
        dq.to(q.scalar_type()),
        dkv.acc[0].to(k.scalar_type()),
        dkv.acc[1].to(v.scalar_type()),
        at::Tensor()};
  }
};

} // namespace

at::Tensor zigzag_positions(int64_t seq_len, int sp_size) {
  TORCH_CHECK(sp_size >= 1, "zigzag_positions: sp_size must be >= 1");
  if (sp_size == 1) {
    return at::arange(seq_len, at::kLong).unsqueeze(0);
  }
  TORCH_CHECK(
      seq_len % (2 * sp_size) == 0,
      "ring attention: the sequence length ",
      seq_len,
      " must be divisible by 2 x sp_size (",
      2 * sp_size,
      ") for the zigzag split");
  const int64_t c = seq_len / (2 * sp_size);
  std::vector<at::Tensor> rows;
  for (int r = 0; r < sp_size; ++r) {
    rows.push_back(at::cat(
        {at::arange(r * c, (r + 1) * c, at::kLong),
         at::arange(
             (2 * sp_size - 1 - r) * c, (2 * sp_size - r) * c, at::kLong)}));
  }
  return at::stack(rows);
}

DoubleRing get_double_ring_groups(
    const distributed::ProcessGroupPtr& sp,
    int inner_ring_size) {
  const int n = sp == nullptr ? 1 : sp->size();
  TORCH_CHECK(
      inner_ring_size >= 0 && inner_ring_size <= n &&
          (inner_ring_size == 0 || n % inner_ring_size == 0),
      "ring attention: inner_ring_size ",
      inner_ring_size,
      " must divide the sequence-parallel size ",
      n,
      " (0: one ring)");
  if (inner_ring_size == 0 || inner_ring_size == n) {
    return {};
  }
  const int ring = sp->rank() / inner_ring_size,
            place = sp->rank() % inner_ring_size;
  std::vector<int> inner, inter;
  for (int i = 0; i < inner_ring_size; ++i) {
    inner.push_back(sp->global_rank(ring * inner_ring_size + i));
  }
  for (int o = 0; o < n / inner_ring_size; ++o) {
    inter.push_back(sp->global_rank(o * inner_ring_size + place));
  }
  // Every member creates its inner ring, then its inter ring: each group's
  // members all reach it at the same point.
  DoubleRing rings;
  rings.inner = cd::new_group(inner, sp->name() + ".inner_ring");
  rings.inter = cd::new_group(inter, sp->name() + ".inter_ring");
  return rings;
}

at::Tensor ring_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& positions,
    const distributed::ProcessGroupPtr& sp,
    const DoubleRing& rings) {
  TORCH_CHECK(
      q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
      "ring_attention: q, k, v must be [B, H, T_local, D] of one shape, got ",
      q.sizes(),
      ", ",
      k.sizes(),
      ", ",
      v.sizes());
  const int n = sp == nullptr ? 1 : sp->size();
  TORCH_CHECK(
      positions.dim() == 2 && positions.size(0) == n &&
          positions.size(1) == q.size(2),
      "ring_attention: positions must be [sp_size, T_local] = [",
      n,
      ", ",
      q.size(2),
      "], got ",
      positions.sizes());
  const auto host_pos = positions.to(at::kCPU, at::kLong).contiguous();
  const auto pos = utils::upload_async(host_pos, q.device());
  const int r = sp == nullptr ? 0 : sp->rank();
  std::vector<Visible> visible;
  for (int j = 0; j < n; ++j) {
    visible.push_back(visibility(host_pos[r], host_pos[j]));
  }
  if (n == 1) {
    // One rank: the same arithmetic, no ring.
    auto mask = causal_mask(pos[0], pos[0], visible[0]);
    auto sc = scores(
        q.to(at::kFloat),
        k.to(at::kFloat),
        mask,
        1.0 / std::sqrt(static_cast<double>(q.size(-1))));
    return at::matmul(at::softmax(sc, -1), v.to(at::kFloat))
        .to(q.scalar_type());
  }
  auto holder = c10::make_intrusive<RingHolder>();
  if (rings.defined()) {
    TORCH_CHECK(
        rings.inter != nullptr &&
            rings.inner->size() * rings.inter->size() == n &&
            rings.inter->rank() * rings.inner->size() + rings.inner->rank() ==
                r,
        "ring_attention: `rings` are not a double ring of this sp group (",
        sp->describe(),
        "): make them with get_double_ring_groups(sp, inner_ring_size)");
    holder->inner = rings.inner;
    holder->inter = rings.inter;
  } else {
    holder->inner = sp;
  }
  holder->sp_rank = r;
  holder->positions = pos;
  holder->visible = std::move(visible);
  return RingAttentionFn::apply(q, k, v, std::move(holder))[0];
}

} // namespace layer
} // namespace shardformer
} // namespace colossalai
