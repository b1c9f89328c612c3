#include "overlap_linear.h"
#include "ring_linear.h"

#include "../../kernels/linear_dtype.h"

#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/functional.h>
#include <colossalai/utils/compat.h>

#include <torch/autograd.h>

// NOTE [Sequence overlap]
// split_gather all-gathers the sequence before the column layers of a block
// and, in backward, reduce-scatters the input gradient once every layer
// that read the gathered input has computed both its gradients (autograd
// computes a linear's input and weight gradients in one node). With
// enable_sequence_overlap the layers that read one input run as one
// Function: its backward forms the summed input gradient first, starts its
// reduce-scatter, computes the weight and bias gradients while it travels
// and only then waits (ColossalAI's async_grad_reduce_scatter). The bytes,
// the gathered input kept for backward and the sums are split_gather's:
// the gradients are the same up to the order of the layers' sums. Under
// autocast both collectives carry the 16-bit operands (split_gather's carry
// float32): half the bytes, and the reduce-scatter sums in 16 bits, as in a
// model cast to 16 bits.

namespace colossalai {
namespace shardformer {
namespace layer {
namespace detail {

namespace {

namespace cd = distributed;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class OverlapGatherLinears
    : public torch::autograd::Function<OverlapGatherLinears> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      at::TensorList ws,
      at::TensorList bs,
      c10::intrusive_ptr<SeqGroup> h) {
    // Grad mode is off inside forward: the collective alone, no node.
    const auto whole =
        distributed::functional::gather_along_dim(x, h->seq_dim, h->group);
    variable_list ys;
    for (size_t i = 0; i < ws.size(); ++i) {
      const auto b = kernels::detail::bias_of(bs[i]);
      ys.push_back(at::linear(
          whole,
          ws[i],
          b.defined() ? c10::optional<at::Tensor>(b) : c10::nullopt));
    }
    variable_list saved{whole};
    saved.insert(saved.end(), ws.begin(), ws.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["group"] = at::IValue::make_capsule(std::move(h));
    std::vector<int64_t> has_bias;
    for (const auto& b : bs) {
      has_bias.push_back(b.numel() > 0 ? 1 : 0);
    }
    ctx->saved_data["has_bias"] = has_bias;
    return ys;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto capsule = ctx->saved_data.at("group").toCapsule();
    const auto& h = *static_cast<const SeqGroup*>(capsule.get());
    const auto has_bias = ctx->saved_data.at("has_bias").toIntVector();
    const auto& g = *h.group;
    const auto& whole = saved[0];
    const size_t k = saved.size() - 1;
    // The input gradient first, summed over the layers.
    at::Tensor dx;
    for (size_t i = 0; i < k; ++i) {
      if (grads[i].defined()) {
        auto part = at::matmul(grads[i], saved[1 + i]);
        dx = dx.defined() ? dx.add_(part) : part;
      }
    }
    if (!dx.defined()) {
      dx = at::zeros_like(whole);
    }
    // Its reduce-scatter travels while the weight gradients are computed.
    auto flat = dx.movedim(h.seq_dim, 0).contiguous();
    auto sizes = flat.sizes().vec();
    sizes[0] /= g.size();
    auto mine = at::empty(sizes, flat.options());
    auto work = cd::reduce_scatter(mine, flat, g);
    variable_list out(1 + 2 * k + 1);
    const auto rows = whole.reshape({-1, whole.size(-1)});
    for (size_t i = 0; i < k; ++i) {
      if (!grads[i].defined()) {
        continue;
      }
      const auto dy = grads[i].reshape({-1, grads[i].size(-1)});
      out[1 + i] = at::matmul(dy.t(), rows);
      if (has_bias[i] != 0) {
        out[1 + k + i] = dy.sum(0);
      }
    }
    work.wait();
    out[0] = mine.movedim(0, h.seq_dim);
    return out;
  }
};

} // namespace

std::vector<at::Tensor> gather_linears_overlapped(
    const at::Tensor& x,
    const std::vector<at::Tensor>& w_out_in,
    const std::vector<at::Tensor>& biases,
    int64_t seq_dim,
    const distributed::ProcessGroupPtr& group) {
  TORCH_INTERNAL_ASSERT(w_out_in.size() == biases.size() && !w_out_in.empty());
  TORCH_INTERNAL_ASSERT(group != nullptr && group->size() > 1);
  auto h = seq_group(x, seq_dim, group, "sequence overlap");
  // Under autocast, the operands as autocast would hand them to the matmuls,
  // cast before the gather: backward's products (autocast is off there) run
  // in that dtype too.
  const auto cast = compat::autocast_dtype(x.device().type());
  const bool casts = cast && at::isFloatingType(x.scalar_type());
  auto input = casts ? x.to(*cast) : x;
  std::vector<at::Tensor> ws, bs;
  for (size_t i = 0; i < w_out_in.size(); ++i) {
    ws.push_back(casts ? w_out_in[i].to(*cast) : w_out_in[i]);
    const auto& b = biases[i];
    bs.push_back(kernels::detail::bias_slot(
        casts && b.defined() ? b.to(*cast) : b, ws.back()));
  }
  // As TensorLists: a std::vector argument would not count as inputs.
  return OverlapGatherLinears::apply(
      input, at::TensorList(ws), at::TensorList(bs), std::move(h));
}

} // namespace detail
} // namespace layer
} // namespace shardformer
} // namespace colossalai
