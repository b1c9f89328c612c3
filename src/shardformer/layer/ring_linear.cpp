#include "ring_linear.h"

#include <colossalai/distributed/collectives.h>

#include <torch/autograd.h>
#include <torch/custom_class.h>

#include <functional>

// NOTE [Ring linear]
// split_gather all-gathers the sequence before a column layer and
// reduce-scatters after a row layer, and each matmul waits for its whole
// collective. "ring" cuts both into n hops around the tensor group and
// multiplies the chunk in hand while the next one travels:
//  * gather-matmul: at hop s rank r holds chunk (r - s) mod n, multiplies it
//    and passes it on;
//  * matmul-reduce-scatter: the running sum for chunk (r - s - 1) mod n
//    arrives from r - 1 while rank r computes its own partial product for
//    that chunk, adds it and passes it on; after n - 1 hops it holds the
//    whole sum of chunk r.
// Each is the other's backward. The bytes are those of split_gather; sums
// run in the tensors' dtype, in ring order.

namespace colossalai {
namespace shardformer {
namespace layer {
namespace detail {

namespace {

namespace cd = distributed;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kRingTag = 21;

// All-gathers `local` along `dim` around the ring, calling `each(chunk, c)`
// on chunk c as it is in hand (the next hop already posted); returns the
// whole tensor.
at::Tensor ring_gather(
    const at::Tensor& local,
    int64_t dim,
    const cd::ProcessGroup& g,
    const std::function<void(const at::Tensor&, int)>& each) {
  const int n = g.size(), r = g.rank();
  std::vector<at::Tensor> chunks(n);
  at::Tensor cur = local.contiguous();
  for (int s = 0; s < n; ++s) {
    cd::RingHop hop;
    if (s + 1 < n) {
      hop = cd::ring_exchange(cur, g, kRingTag);
    }
    const int c = (r - s + n) % n;
    chunks[c] = cur;
    each(cur, c);
    if (s + 1 < n) {
      hop.wait();
      cur = hop.received;
    }
  }
  return at::cat(chunks, dim);
}

// Sums `partial(c)` over the group for every chunk c and returns chunk r's
// sum, each partial product computed while the previous running sum travels.
at::Tensor ring_reduce_scatter(
    const cd::ProcessGroup& g,
    const std::function<at::Tensor(int)>& partial) {
  const int n = g.size(), r = g.rank();
  at::Tensor acc = partial((r - 1 + n) % n).contiguous();
  for (int s = 1; s < n; ++s) {
    auto hop = cd::ring_exchange(acc, g, kRingTag);
    auto mine = partial((r - s - 1 + 2 * n) % n);
    hop.wait();
    acc = hop.received + mine;
  }
  return acc;
}

at::Tensor chunk_of(const at::Tensor& x, int64_t dim, int c, int n) {
  const int64_t len = x.size(dim) / n;
  return x.narrow(dim, c * len, len);
}

// grad_w [in, out] = x^T grad_y over every leading dimension.
at::Tensor weight_grad(const at::Tensor& x, const at::Tensor& grad_y) {
  return at::matmul(
      x.reshape({-1, x.size(-1)}).t(), grad_y.reshape({-1, grad_y.size(-1)}));
}

// What both functions keep for backward: the input their weight gradient
// needs, the weight, and the group.
void save(
    AutogradContext* ctx,
    const at::Tensor& input,
    const at::Tensor& w_io,
    c10::intrusive_ptr<SeqGroup> h) {
  ctx->save_for_backward({input, w_io});
  ctx->saved_data["group"] = at::IValue::make_capsule(std::move(h));
}

struct Saved {
  at::Tensor input, w_t; // w_t: w_io transposed, [out, in]
  c10::intrusive_ptr<torch::CustomClassHolder> capsule;
  const SeqGroup& holder() const {
    return *static_cast<const SeqGroup*>(capsule.get());
  }
};

Saved load(AutogradContext* ctx) {
  auto saved = ctx->get_saved_variables();
  return {saved[0], saved[1].t(), ctx->saved_data.at("group").toCapsule()};
}

class GatherMatmul : public torch::autograd::Function<GatherMatmul> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& w_io,
      c10::intrusive_ptr<SeqGroup> h) {
    const auto& g = *h->group;
    std::vector<at::Tensor> ys(g.size());
    auto whole = ring_gather(x, h->seq_dim, g, [&](const at::Tensor& c, int i) {
      ys[i] = at::matmul(c, w_io);
    });
    const int64_t dim = h->seq_dim;
    save(ctx, whole, w_io, std::move(h));
    return {at::cat(ys, dim)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = load(ctx);
    const auto& h = s.holder();
    const auto& g = *h.group;
    const auto dy = grads[0].contiguous();
    auto dx = ring_reduce_scatter(g, [&](int c) {
      return at::matmul(chunk_of(dy, h.seq_dim, c, g.size()), s.w_t);
    });
    return {dx, weight_grad(s.input, dy), at::Tensor()};
  }
};

class MatmulReduceScatter
    : public torch::autograd::Function<MatmulReduceScatter> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& w_io,
      c10::intrusive_ptr<SeqGroup> h) {
    const auto& g = *h->group;
    auto y = ring_reduce_scatter(g, [&](int c) {
      return at::matmul(chunk_of(x, h->seq_dim, c, g.size()), w_io);
    });
    save(ctx, x, w_io, std::move(h));
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = load(ctx);
    const auto& h = s.holder();
    const auto& g = *h.group;
    std::vector<at::Tensor> dxs(g.size());
    auto dy =
        ring_gather(grads[0], h.seq_dim, g, [&](const at::Tensor& c, int i) {
          dxs[i] = at::matmul(c, s.w_t);
        });
    return {at::cat(dxs, h.seq_dim), weight_grad(s.input, dy), at::Tensor()};
  }
};

} // namespace

c10::intrusive_ptr<SeqGroup> seq_group(
    const at::Tensor& x,
    int64_t seq_dim,
    const distributed::ProcessGroupPtr& group,
    const char* who) {
  auto h = c10::make_intrusive<SeqGroup>();
  h->group = group;
  h->seq_dim = seq_dim < 0 ? seq_dim + x.dim() : seq_dim;
  TORCH_CHECK(
      h->seq_dim >= 0 && h->seq_dim < x.dim() - 1,
      who,
      ": seq_dim ",
      seq_dim,
      " must name a dimension before the features of a ",
      x.dim(),
      "-d input");
  return h;
}

at::Tensor ring_gather_matmul(
    const at::Tensor& x,
    const at::Tensor& w_io,
    int64_t seq_dim,
    const distributed::ProcessGroupPtr& group) {
  if (group == nullptr || group->size() == 1) {
    return at::matmul(x, w_io);
  }
  return GatherMatmul::apply(
      x, w_io, seq_group(x, seq_dim, group, "ring sequence parallelism"))[0];
}

at::Tensor ring_matmul_reduce_scatter(
    const at::Tensor& x,
    const at::Tensor& w_io,
    int64_t seq_dim,
    const distributed::ProcessGroupPtr& group) {
  if (group == nullptr || group->size() == 1) {
    return at::matmul(x, w_io);
  }
  auto h = seq_group(x, seq_dim, group, "ring sequence parallelism");
  TORCH_CHECK(
      x.size(h->seq_dim) % group->size() == 0,
      "ring sequence parallelism: the sequence length ",
      x.size(h->seq_dim),
      " must be divisible by the tensor-parallel size ",
      group->size());
  return MatmulReduceScatter::apply(x, w_io, std::move(h))[0];
}

} // namespace detail
} // namespace layer
} // namespace shardformer
} // namespace colossalai
