#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/functional.h>
#include <colossalai/quantization/fp8.h>

#include <torch/csrc/autograd/custom_function.h>

namespace colossalai {
namespace distributed {
namespace functional {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool trivial(const ProcessGroupPtr& g) {
  return g == nullptr || g->size() == 1;
}

// A group, and whether its traffic travels as FP8 (the caller asked and
// the group spans nodes): activations forward as e4m3, gradients backward
// as e5m2, as ColossalAI's layers send them.
struct Link {
  ProcessGroupPtr group;
  bool fp8 = false;

  const char* format(bool backward) const {
    return fp8 ? (backward ? "e5m2" : "e4m3") : nullptr;
  }
};

Link link_of(const ProcessGroupPtr& group, bool fp8, const char* op) {
  TORCH_CHECK(
      !fp8 || quantization::fp8_supported(),
      op,
      ": fp8 needs LibTorch 2.1 or later (its float8 dtypes)");
  return Link{group, fp8 && quantization::fp8_compresses(*group)};
}

// saved_data holds IValues: the link travels in a capsule.
struct LinkHolder : torch::CustomClassHolder {
  explicit LinkHolder(Link l) : link(std::move(l)) {}
  Link link;
};

void save_link(AutogradContext* ctx, const Link& l) {
  ctx->saved_data["link"] =
      c10::IValue::make_capsule(c10::make_intrusive<LinkHolder>(l));
}

const Link& link_of(AutogradContext* ctx) {
  auto holder = ctx->saved_data["link"].toCapsule();
  return static_cast<LinkHolder*>(holder.get())->link;
}

// Whether `x` goes through the FP8 collectives with `format` (null: no).
bool as_fp8(const at::Tensor& x, const char* format) {
  return format != nullptr && x.is_floating_point() && x.element_size() >= 2;
}

int64_t wrap(int64_t dim, const at::Tensor& x) {
  return c10::maybe_wrap_dim(dim, x.dim());
}

void check_divisible(
    const at::Tensor& x,
    int64_t dim,
    int world,
    const char* op) {
  TORCH_CHECK(
      x.size(dim) % world == 0,
      op,
      ": dimension ",
      dim,
      " of size ",
      x.size(dim),
      " does not split evenly over the group's ",
      world,
      " ranks");
}

at::Tensor all_reduce_sum(
    const at::Tensor& x,
    const ProcessGroup& g,
    const char* fp8) {
  auto out = x.contiguous().clone();
  (as_fp8(out, fp8) ? quantization::all_reduce_fp8(out, g, ReduceOp::kSum, fp8)
                    : all_reduce(out, g))
      .wait();
  return out;
}

at::Tensor my_chunk(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroup& g,
    const char* /*fp8*/) {
  return x.chunk(g.size(), dim)[g.rank()].contiguous();
}

at::Tensor gather_dim(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroup& g,
    const char* fp8) {
  std::vector<int64_t> shape{g.size()};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  auto stacked = at::empty(shape, x.options());
  auto flat = stacked.view({-1});
  auto mine = x.contiguous().view({-1});
  (as_fp8(x, fp8) ? quantization::all_gather_fp8(flat, mine, g, fp8)
                  : all_gather(flat, mine, g))
      .wait();
  return dim == 0 ? stacked.flatten(0, 1) : at::cat(stacked.unbind(0), dim);
}

at::Tensor reduce_scatter_dim(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroup& g,
    const char* fp8) {
  // Rank-major blocks, so that rank r's chunk is the r-th flat shard.
  auto blocks = at::stack(x.chunk(g.size(), dim), 0).contiguous();
  std::vector<int64_t> shape = blocks.sizes().vec();
  shape.erase(shape.begin());
  auto out = at::empty(shape, x.options());
  auto flat = out.view({-1});
  (as_fp8(x, fp8) ? quantization::reduce_scatter_fp8(
                        flat, blocks.view({-1}), g, ReduceOp::kSum, fp8)
                  : reduce_scatter(flat, blocks.view({-1}), g))
      .wait();
  return out;
}

at::Tensor all_to_all_dims(
    const at::Tensor& x,
    int64_t scatter_dim,
    int64_t gather_dim,
    const ProcessGroup& g,
    const char* fp8) {
  auto blocks = at::stack(x.chunk(g.size(), scatter_dim), 0).contiguous();
  auto received = at::empty_like(blocks);
  auto out = received.view({-1});
  (as_fp8(x, fp8) ? quantization::all_to_all_fp8(out, blocks.view({-1}), g, fp8)
                  : all_to_all(out, blocks.view({-1}), g))
      .wait();
  return at::cat(received.unbind(0), gather_dim);
}

// Autograd Functions take the Link as two arguments (group, fp8).
struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const ProcessGroupPtr& g,
      bool fp8) {
    save_link(ctx, Link{g, fp8});
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& l = link_of(ctx);
    return {
        all_reduce_sum(grads[0], *l.group, l.format(true)),
        at::Tensor(),
        at::Tensor()};
  }
};

struct ReduceFromGroup : torch::autograd::Function<ReduceFromGroup> {
  static at::Tensor forward(
      AutogradContext*,
      const at::Tensor& x,
      const ProcessGroupPtr& g,
      bool fp8) {
    return all_reduce_sum(x, *g, Link{g, fp8}.format(false));
  }

  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

using DimOp = at::Tensor (*)(
    const at::Tensor&,
    int64_t,
    const ProcessGroup&,
    const char*);

// A collective along one dimension whose adjoint is another one.
template <DimOp Forward, DimOp Backward>
struct AlongDim : torch::autograd::Function<AlongDim<Forward, Backward>> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      int64_t dim,
      const ProcessGroupPtr& g,
      bool fp8) {
    const Link l{g, fp8};
    save_link(ctx, l);
    ctx->saved_data["dim"] = dim;
    return Forward(x, dim, *g, l.format(false));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& l = link_of(ctx);
    return {
        Backward(
            grads[0], ctx->saved_data["dim"].toInt(), *l.group, l.format(true)),
        at::Tensor(),
        at::Tensor(),
        at::Tensor()};
  }
};

using SplitAlongDim = AlongDim<my_chunk, gather_dim>;
using GatherAlongDim = AlongDim<gather_dim, my_chunk>;
using ReduceScatterAlongDim = AlongDim<reduce_scatter_dim, gather_dim>;
using GatherReduceScatterBackward = AlongDim<gather_dim, reduce_scatter_dim>;

struct AllToAllAlongDims : torch::autograd::Function<AllToAllAlongDims> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      int64_t scatter_dim,
      int64_t gather_dim,
      const ProcessGroupPtr& g,
      bool fp8) {
    const Link l{g, fp8};
    save_link(ctx, l);
    ctx->saved_data["scatter"] = scatter_dim;
    ctx->saved_data["gather"] = gather_dim;
    return all_to_all_dims(x, scatter_dim, gather_dim, *g, l.format(false));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& l = link_of(ctx);
    return {
        all_to_all_dims(
            grads[0],
            ctx->saved_data["gather"].toInt(),
            ctx->saved_data["scatter"].toInt(),
            *l.group,
            l.format(true)),
        at::Tensor(),
        at::Tensor(),
        at::Tensor(),
        at::Tensor()};
  }
};

// Rows of dim 0 exchanged with uneven splits; the received rows' shape
// beyond dim 0 is the input's.
at::Tensor all_to_all_rows(
    const at::Tensor& x,
    const std::vector<int64_t>& output_splits,
    const std::vector<int64_t>& input_splits,
    const ProcessGroup& g,
    const char* fp8) {
  int64_t rows = 0;
  for (auto n : output_splits) {
    rows += n;
  }
  auto shape = x.sizes().vec();
  shape[0] = rows;
  auto out = at::empty(shape, x.options());
  (as_fp8(x, fp8)
       ? quantization::all_to_all_fp8(
             out, x.contiguous(), g, output_splits, input_splits, fp8)
       : all_to_all(out, x.contiguous(), g, output_splits, input_splits))
      .wait();
  return out;
}

struct AllToAllSingle : torch::autograd::Function<AllToAllSingle> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const std::vector<int64_t>& output_splits,
      const std::vector<int64_t>& input_splits,
      const ProcessGroupPtr& g,
      bool fp8) {
    const Link l{g, fp8};
    save_link(ctx, l);
    ctx->saved_data["out"] = output_splits;
    ctx->saved_data["in"] = input_splits;
    return all_to_all_rows(x, output_splits, input_splits, *g, l.format(false));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The reverse exchange: what arrived from rank r goes back to it.
    const auto& l = link_of(ctx);
    return {
        all_to_all_rows(
            grads[0],
            ctx->saved_data["in"].toIntVector(),
            ctx->saved_data["out"].toIntVector(),
            *l.group,
            l.format(true)),
        at::Tensor(),
        at::Tensor(),
        at::Tensor(),
        at::Tensor()};
  }
};

struct ScaleGrad : torch::autograd::Function<ScaleGrad> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      double factor) {
    ctx->saved_data["factor"] = factor;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0] * ctx->saved_data["factor"].toDouble(), at::Tensor()};
  }
};

} // namespace

at::Tensor scale_grad(const at::Tensor& x, double factor) {
  return factor == 1.0 ? x : ScaleGrad::apply(x, factor);
}

at::Tensor copy_to_group(
    const at::Tensor& x,
    const ProcessGroupPtr& group,
    bool fp8) {
  if (trivial(group)) {
    return x;
  }
  const auto l = link_of(group, fp8, "copy_to_group");
  return CopyToGroup::apply(x, l.group, l.fp8);
}

at::Tensor reduce_from_group(
    const at::Tensor& x,
    const ProcessGroupPtr& group,
    bool fp8) {
  if (trivial(group)) {
    return x;
  }
  const auto l = link_of(group, fp8, "reduce_from_group");
  return ReduceFromGroup::apply(x, l.group, l.fp8);
}

at::Tensor split_along_dim(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroupPtr& group,
    bool fp8) {
  if (trivial(group)) {
    return x;
  }
  dim = wrap(dim, x);
  check_divisible(x, dim, group->size(), "split_along_dim");
  const auto l = link_of(group, fp8, "split_along_dim");
  return SplitAlongDim::apply(x, dim, l.group, l.fp8);
}

at::Tensor gather_along_dim(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroupPtr& group,
    bool fp8) {
  if (trivial(group)) {
    return x;
  }
  const auto l = link_of(group, fp8, "gather_along_dim");
  return GatherAlongDim::apply(x, wrap(dim, x), l.group, l.fp8);
}

at::Tensor reduce_scatter_along_dim(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroupPtr& group,
    bool fp8) {
  if (trivial(group)) {
    return x;
  }
  dim = wrap(dim, x);
  check_divisible(x, dim, group->size(), "reduce_scatter_along_dim");
  const auto l = link_of(group, fp8, "reduce_scatter_along_dim");
  return ReduceScatterAlongDim::apply(x, dim, l.group, l.fp8);
}

at::Tensor gather_along_dim_reduce_scatter_backward(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroupPtr& group,
    bool fp8) {
  if (trivial(group)) {
    return x;
  }
  const auto l =
      link_of(group, fp8, "gather_along_dim_reduce_scatter_backward");
  return GatherReduceScatterBackward::apply(x, wrap(dim, x), l.group, l.fp8);
}

at::Tensor all_to_all_along_dims(
    const at::Tensor& x,
    int64_t scatter_dim,
    int64_t gather_dim,
    const ProcessGroupPtr& group,
    bool fp8) {
  if (trivial(group)) {
    return x;
  }
  scatter_dim = wrap(scatter_dim, x);
  gather_dim = wrap(gather_dim, x);
  check_divisible(x, scatter_dim, group->size(), "all_to_all_along_dims");
  const auto l = link_of(group, fp8, "all_to_all_along_dims");
  return AllToAllAlongDims::apply(x, scatter_dim, gather_dim, l.group, l.fp8);
}

at::Tensor all_to_all_single(
    const at::Tensor& x,
    const std::vector<int64_t>& output_splits,
    const std::vector<int64_t>& input_splits,
    const ProcessGroupPtr& group,
    bool fp8) {
  if (trivial(group)) {
    return x;
  }
  const auto n = static_cast<size_t>(group->size());
  TORCH_CHECK(
      x.dim() > 0 && output_splits.size() == n && input_splits.size() == n,
      "all_to_all_single: needs a tensor with rows and ",
      n,
      " output and input splits, got ",
      output_splits.size(),
      " and ",
      input_splits.size());
  int64_t rows = 0;
  for (auto r : input_splits) {
    TORCH_CHECK(r >= 0, "all_to_all_single: negative split ", r);
    rows += r;
  }
  TORCH_CHECK(
      rows == x.size(0),
      "all_to_all_single: input splits sum to ",
      rows,
      " rows, the tensor has ",
      x.size(0));
  const auto l = link_of(group, fp8, "all_to_all_single");
  return AllToAllSingle::apply(x, output_splits, input_splits, l.group, l.fp8);
}

} // namespace functional
} // namespace distributed
} // namespace colossalai
