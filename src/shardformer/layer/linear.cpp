#include <colossalai/distributed/functional.h>
#include <colossalai/initialize.h>
#include <colossalai/shardformer/layer/linear.h>

#include <torch/nn/init.h>

#include <cmath>

namespace colossalai {
namespace shardformer {
namespace layer {

namespace cdf = distributed::functional;

namespace detail {

distributed::ProcessGroupPtr tp_group(
    const distributed::ProcessGroupPtr& g,
    int64_t n,
    const char* layer,
    const char* what) {
  auto group = g != nullptr ? g : distributed::world_group();
  TORCH_CHECK(
      n % group->size() == 0,
      layer,
      ": ",
      what,
      " (",
      n,
      ") must be divisible by the tensor-parallel size ",
      group->size());
  return group;
}

} // namespace detail

namespace {

// nn.Linear's initialisation, U(-1/sqrt(in), 1/sqrt(in)) for the weight
// and the bias, with the full layer's fan-in whatever the shard's shape.
void init_like_linear(at::Tensor& w, at::Tensor& b, int64_t in_features) {
  torch::NoGradGuard no_grad;
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  w.uniform_(-bound, bound);
  if (b.defined()) {
    b.uniform_(-bound, bound);
  }
}

void check_full(
    const at::Tensor& weight,
    const at::Tensor& bias,
    const char* layer) {
  TORCH_CHECK(
      weight.defined() && weight.dim() == 2,
      layer,
      ": from_full needs a 2-d weight [out_features, in_features]");
  TORCH_CHECK(
      !bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)),
      layer,
      ": the bias has shape ",
      bias.sizes(),
      ", expected [",
      weight.size(0),
      "]");
}

at::Tensor bias_of(const torch::nn::LinearImpl& full) {
  return full.options.bias() ? full.bias : at::Tensor();
}

} // namespace

Linear1D_ColImpl::Linear1D_ColImpl(Linear1DOptions options_)
    : options(std::move(options_)) {
  reset();
}

void Linear1D_ColImpl::reset() {
  group = detail::tp_group(
      options.process_group(),
      options.out_features(),
      "Linear1D_Col",
      "out_features");
  const int64_t out = options.out_features() / group->size();
  weight =
      register_parameter("weight", at::empty({out, options.in_features()}));
  if (options.bias()) {
    bias = register_parameter("bias", at::empty({out}));
  }
  init_like_linear(weight, bias, options.in_features());
}

at::Tensor Linear1D_ColImpl::forward(const at::Tensor& input) {
  // Every rank's shard reads the whole input: its gradient sums over them.
  auto x = options.seq_parallel()
      ? cdf::gather_along_dim_reduce_scatter_backward(
            input, options.seq_dim(), group)
      : cdf::copy_to_group(input, group);
  auto y = at::linear(x, weight, bias);
  return options.gather_output() ? cdf::gather_along_dim(y, -1, group) : y;
}

std::shared_ptr<Linear1D_ColImpl> Linear1D_ColImpl::from_full(
    const torch::nn::LinearImpl& full,
    const distributed::ProcessGroupPtr& group,
    bool gather_output,
    int64_t fused) {
  return from_full(full.weight, bias_of(full), group, gather_output, fused);
}

std::shared_ptr<Linear1D_ColImpl> Linear1D_ColImpl::from_full(
    const at::Tensor& weight,
    const at::Tensor& b,
    const distributed::ProcessGroupPtr& group,
    bool gather_output,
    int64_t fused) {
  check_full(weight, b, "Linear1D_Col");
  const int64_t out = weight.size(0);
  TORCH_CHECK(
      fused >= 1 && out % fused == 0,
      "Linear1D_Col: ",
      out,
      " output features do not form ",
      fused,
      " equal fused sections");
  TORCH_CHECK(
      fused == 1 || !gather_output,
      "Linear1D_Col: gather_output with fused sections would interleave the "
      "sections by rank; gather each section instead");
  auto o = Linear1DOptions(weight.size(1), out)
               .bias(b.defined())
               .gather_output(gather_output)
               .process_group(group);
  auto g =
      detail::tp_group(group, out / fused, "Linear1D_Col", "a fused section");
  auto m = std::make_shared<Linear1D_ColImpl>(o);
  torch::NoGradGuard no_grad;
  const int tp = g->size(), r = g->rank();
  // Rank r: its chunk of each section, sections in order.
  auto mine = [&](const at::Tensor& t) {
    std::vector<at::Tensor> parts;
    for (const auto& section : t.chunk(fused, 0)) {
      parts.push_back(section.chunk(tp, 0)[r]);
    }
    return at::cat(parts, 0);
  };
  m->weight.copy_(mine(weight));
  if (b.defined()) {
    m->bias.copy_(mine(b));
  }
  return m;
}

Linear1D_RowImpl::Linear1D_RowImpl(Linear1DOptions options_)
    : options(std::move(options_)) {
  reset();
}

void Linear1D_RowImpl::reset() {
  group = detail::tp_group(
      options.process_group(),
      options.in_features(),
      "Linear1D_Row",
      "in_features");
  const int64_t in = options.in_features() / group->size();
  weight =
      register_parameter("weight", at::empty({options.out_features(), in}));
  if (options.bias()) {
    bias = register_parameter("bias", at::empty({options.out_features()}));
  }
  init_like_linear(weight, bias, options.in_features());
}

at::Tensor Linear1D_RowImpl::forward(const at::Tensor& input) {
  auto x =
      options.parallel_input() ? input : cdf::split_along_dim(input, -1, group);
  TORCH_CHECK(
      x.size(-1) == weight.size(1),
      "Linear1D_Row: the input's last dimension is ",
      x.size(-1),
      ", expected this rank's ",
      weight.size(1),
      " of ",
      options.in_features(),
      " input features",
      options.parallel_input() ? " (parallel_input is set)" : "");
  auto partial = at::linear(x, weight);
  auto y = options.seq_parallel()
      ? cdf::reduce_scatter_along_dim(partial, options.seq_dim(), group)
      : cdf::reduce_from_group(partial, group);
  // The bias is replicated: added once, after the sum.
  return bias.defined() ? y + bias : y;
}

std::shared_ptr<Linear1D_RowImpl> Linear1D_RowImpl::from_full(
    const torch::nn::LinearImpl& full,
    const distributed::ProcessGroupPtr& group,
    bool parallel_input) {
  return from_full(full.weight, bias_of(full), group, parallel_input);
}

std::shared_ptr<Linear1D_RowImpl> Linear1D_RowImpl::from_full(
    const at::Tensor& weight,
    const at::Tensor& b,
    const distributed::ProcessGroupPtr& group,
    bool parallel_input) {
  check_full(weight, b, "Linear1D_Row");
  auto o = Linear1DOptions(weight.size(1), weight.size(0))
               .bias(b.defined())
               .parallel_input(parallel_input)
               .process_group(group);
  auto m = std::make_shared<Linear1D_RowImpl>(o);
  torch::NoGradGuard no_grad;
  const int tp = m->group->size(), r = m->group->rank();
  m->weight.copy_(weight.chunk(tp, 1)[r]);
  if (b.defined()) {
    m->bias.copy_(b);
  }
  return m;
}

} // namespace layer
} // namespace shardformer
} // namespace colossalai
