#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/functional.h>
#include <colossalai/kernels/fused_linear_cross_entropy.h>
#include <colossalai/shardformer/layer/embedding.h>
#include <colossalai/shardformer/layer/linear.h>

#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>

namespace colossalai {
namespace shardformer {
namespace layer {

namespace cdf = distributed::functional;

int64_t padded_vocab_size(int64_t vocab, int64_t divisible_by, int tp) {
  TORCH_CHECK(
      divisible_by > 0,
      "make_vocab_size_divisible_by must be positive, got ",
      divisible_by);
  const int64_t multiple = divisible_by * tp;
  return (vocab + multiple - 1) / multiple * multiple;
}

Embedding1DImpl::Embedding1DImpl(Embedding1DOptions options_)
    : options(std::move(options_)) {
  reset();
}

void Embedding1DImpl::reset() {
  group = options.process_group();
  detail::check_divisible(
      group, options.embedding_dim(), "Embedding1D", "embedding_dim");
  weight = register_parameter(
      "weight",
      at::empty(
          {options.num_embeddings(),
           options.embedding_dim() / detail::group_size(group)}));
  torch::NoGradGuard no_grad;
  weight.normal_(); // nn.Embedding's N(0, 1)
}

std::map<std::string, ShardSpec> Embedding1DImpl::shard_specs() const {
  return {{"weight", ShardSpec::split(1, options.embedding_dim(), group)}};
}

void Embedding1DImpl::shard_(const distributed::ProcessGroupPtr& g) {
  TORCH_CHECK(group == nullptr, "Embedding1D.shard_: already sharded");
  detail::check_divisible(
      g, options.embedding_dim(), "Embedding1D", "embedding_dim");
  group = g;
  options.process_group(g);
  detail::shard_param_(weight, shard_specs().at("weight"));
}

at::Tensor Embedding1DImpl::forward(const at::Tensor& input) {
  auto y = at::embedding(weight, input);
  return options.gather_output()
      ? cdf::gather_along_dim(y, -1, group, fp8_communication)
      : y;
}

std::shared_ptr<Embedding1DImpl> Embedding1DImpl::from_full(
    const torch::nn::EmbeddingImpl& full,
    const distributed::ProcessGroupPtr& group,
    bool gather_output) {
  auto m = std::make_shared<Embedding1DImpl>(
      Embedding1DOptions(full.weight.size(0), full.weight.size(1))
          .gather_output(gather_output));
  {
    torch::NoGradGuard no_grad;
    m->weight.copy_(full.weight);
  }
  m->shard_(group);
  return m;
}

namespace {

// The padded row count of a vocabulary layer over `g` (none without a
// group: a plain layer keeps the Hugging Face shape).
int64_t vocab_rows(
    const Embedding1DOptions& o,
    const distributed::ProcessGroupPtr& g) {
  return g == nullptr
      ? o.num_embeddings()
      : padded_vocab_size(
            o.num_embeddings(), o.make_vocab_size_divisible_by(), g->size());
}

ShardSpec vocab_spec(
    const Embedding1DOptions& o,
    const distributed::ProcessGroupPtr& g) {
  return ShardSpec::split(0, o.num_embeddings(), g)
      .with_padding(vocab_rows(o, g));
}

} // namespace

VocabParallelEmbedding1DImpl::VocabParallelEmbedding1DImpl(
    Embedding1DOptions options_)
    : options(std::move(options_)) {
  reset();
}

void VocabParallelEmbedding1DImpl::reset() {
  group = options.process_group();
  padded_ = vocab_rows(options, group);
  const int64_t rows = padded_ / detail::group_size(group);
  vocab_start_ = rows * detail::group_rank(group);
  weight =
      register_parameter("weight", at::empty({rows, options.embedding_dim()}));
  torch::NoGradGuard no_grad;
  weight.normal_();
  // Padded rows are never looked up; keep them zero.
  const int64_t real = real_rows();
  weight.narrow(0, real, rows - real).zero_();
}

std::map<std::string, ShardSpec> VocabParallelEmbedding1DImpl::shard_specs()
    const {
  return {{"weight", vocab_spec(options, group)}};
}

void VocabParallelEmbedding1DImpl::shard_(
    const distributed::ProcessGroupPtr& g) {
  TORCH_CHECK(
      group == nullptr, "VocabParallelEmbedding1D.shard_: already sharded");
  TORCH_CHECK(
      weight.size(0) == options.num_embeddings(),
      "VocabParallelEmbedding1D.shard_: the layer has ",
      weight.size(0),
      " rows, expected num_embeddings ",
      options.num_embeddings());
  group = g;
  options.process_group(g);
  padded_ = vocab_rows(options, g);
  vocab_start_ = padded_ / detail::group_size(g) * detail::group_rank(g);
  detail::shard_param_(weight, vocab_spec(options, g));
}

int64_t VocabParallelEmbedding1DImpl::real_rows() const {
  return std::max<int64_t>(
      0, std::min(weight.size(0), options.num_embeddings() - vocab_start_));
}

at::Tensor VocabParallelEmbedding1DImpl::forward(const at::Tensor& input) {
  if (group == nullptr) {
    return at::embedding(weight, input);
  }
  const int64_t rows = weight.size(0);
  auto outside = (input < vocab_start_) | (input >= vocab_start_ + rows);
  auto local = (input - vocab_start_).masked_fill(outside, 0);
  auto y = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0);
  return cdf::reduce_from_group(y, group, fp8_communication);
}

std::shared_ptr<VocabParallelEmbedding1DImpl> VocabParallelEmbedding1DImpl::
    from_full(
        const torch::nn::EmbeddingImpl& full,
        const distributed::ProcessGroupPtr& group,
        int64_t make_vocab_size_divisible_by) {
  auto m = std::make_shared<VocabParallelEmbedding1DImpl>(
      Embedding1DOptions(full.weight.size(0), full.weight.size(1))
          .make_vocab_size_divisible_by(make_vocab_size_divisible_by));
  {
    torch::NoGradGuard no_grad;
    m->weight.copy_(full.weight);
  }
  m->shard_(group);
  return m;
}

VocabParallelLMHead1DImpl::VocabParallelLMHead1DImpl(
    Embedding1DOptions options_)
    : options(std::move(options_)) {
  reset();
}

void VocabParallelLMHead1DImpl::reset() {
  group = options.process_group();
  const int64_t padded = vocab_rows(options, group);
  const int64_t rows = padded / detail::group_size(group);
  weight =
      register_parameter("weight", at::empty({rows, options.embedding_dim()}));
  torch::NoGradGuard no_grad;
  const double bound =
      1.0 / std::sqrt(static_cast<double>(options.embedding_dim()));
  weight.uniform_(-bound, bound); // nn.Linear's
  const int64_t start = rows * detail::group_rank(group);
  const int64_t real =
      std::max<int64_t>(0, std::min(rows, options.num_embeddings() - start));
  weight.narrow(0, real, rows - real).zero_();
}

std::map<std::string, ShardSpec> VocabParallelLMHead1DImpl::shard_specs()
    const {
  return {{"weight", vocab_spec(options, group)}};
}

void VocabParallelLMHead1DImpl::shard_(const distributed::ProcessGroupPtr& g) {
  TORCH_CHECK(
      group == nullptr, "VocabParallelLMHead1D.shard_: already sharded");
  group = g;
  options.process_group(g);
  detail::shard_param_(weight, vocab_spec(options, g));
}

at::Tensor VocabParallelLMHead1DImpl::forward(const at::Tensor& hidden) {
  return lm_head_logits(
      hidden,
      weight,
      group,
      options.gather_output(),
      options.num_embeddings(),
      fp8_communication);
}

at::Tensor lm_head_logits(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const distributed::ProcessGroupPtr& group,
    bool gather_output,
    int64_t vocab_size,
    bool fp8) {
  auto logits = at::linear(cdf::copy_to_group(hidden, group, fp8), weight);
  if (!gather_output) {
    return logits;
  }
  auto full = cdf::gather_along_dim(logits, -1, group, fp8);
  return vocab_size >= 0 && vocab_size < full.size(-1)
      ? full.narrow(-1, 0, vocab_size)
      : full;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCrossEntropy
    : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& logits,
      const at::Tensor& target,
      const distributed::ProcessGroupPtr& g,
      int64_t vocab_size,
      int64_t ignore_index,
      int64_t reduction) {
    const int64_t cols = logits.size(1);
    const int64_t start = cols * g->rank();
    auto x = logits.to(at::kFloat).clone();
    // Padding columns take no probability.
    const int64_t real =
        std::max<int64_t>(0, std::min(cols, vocab_size - start));
    if (real < cols) {
      x.narrow(1, real, cols - real)
          .fill_(-std::numeric_limits<float>::infinity());
    }
    auto row_max = std::get<0>(x.max(1));
    distributed::all_reduce(row_max, *g, distributed::ReduceOp::kMax).wait();
    x.sub_(row_max.unsqueeze(1));
    auto valid = target != ignore_index;
    auto mine = (target >= start) & (target < start + cols) & valid;
    auto local = (target - start).masked_fill(~mine, 0);
    auto picked =
        x.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0);
    distributed::all_reduce(picked, *g).wait();
    auto e = x.exp_();
    auto sum = e.sum(1);
    distributed::all_reduce(sum, *g).wait();
    auto per_row = (sum.log() - picked).masked_fill(~valid, 0);
    const double n = reduction == at::Reduction::Sum
        ? 1.0
        : std::max<int64_t>(1, valid.sum().item<int64_t>());
    e.div_(sum.unsqueeze(1)); // softmax over this rank's columns
    ctx->save_for_backward({e, local, mine, valid});
    ctx->saved_data["n"] = n;
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return per_row.sum() / n;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();
    auto rows = at::arange(grad.size(0), saved[1].options());
    grad.index_put_(
        {rows, saved[1]},
        grad.index({rows, saved[1]}) - saved[2].to(grad.scalar_type()));
    grad.mul_(saved[3].unsqueeze(1).to(grad.scalar_type()));
    grad.mul_(grads[0] / ctx->saved_data["n"].toDouble());
    const auto dtype =
        static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {
        grad.to(dtype),
        at::Tensor(),
        at::Tensor(),
        at::Tensor(),
        at::Tensor(),
        at::Tensor()};
  }
};

} // namespace

at::Tensor vocab_parallel_cross_entropy(
    const at::Tensor& logits,
    const at::Tensor& target,
    const distributed::ProcessGroupPtr& group,
    int64_t vocab_size,
    int64_t ignore_index,
    at::Reduction::Reduction reduction) {
  TORCH_CHECK(
      reduction == at::Reduction::Mean || reduction == at::Reduction::Sum,
      "vocab_parallel_cross_entropy: reduction must be Mean or Sum");
  TORCH_CHECK(
      logits.dim() == 2 && target.dim() == 1 &&
          logits.size(0) == target.size(0),
      "vocab_parallel_cross_entropy: logits must be [N, V / tp] and target "
      "[N], got ",
      logits.sizes(),
      " and ",
      target.sizes());
  // The target follows the logits to their device, as the boosted
  // criterion's does (a CPU data loader feeding a GPU model).
  const at::Tensor target_here =
      target.device() == logits.device() ? target : target.to(logits.device());
  if (group == nullptr) {
    TORCH_CHECK(
        vocab_size > 0 && vocab_size <= logits.size(1),
        "vocab_parallel_cross_entropy: vocab_size ",
        vocab_size,
        " exceeds the logits' ",
        logits.size(1),
        " columns");
    return at::cross_entropy_loss(
        logits.narrow(1, 0, vocab_size).to(at::kFloat),
        target_here,
        {},
        reduction,
        ignore_index);
  }
  const auto& g = group;
  TORCH_CHECK(
      vocab_size > 0 && vocab_size <= logits.size(1) * g->size(),
      "vocab_parallel_cross_entropy: vocab_size ",
      vocab_size,
      " does not fit the ",
      logits.size(1) * g->size(),
      " columns of the sharded logits");
  return VocabParallelCrossEntropy::apply(
      logits, target_here, g, vocab_size, ignore_index, reduction);
}

at::Tensor vocab_parallel_fused_linear_cross_entropy(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const at::Tensor& target,
    const distributed::ProcessGroupPtr& group,
    int64_t vocab_size,
    int64_t ignore_index,
    int64_t chunk_size) {
  TORCH_CHECK(
      weight.dim() == 2 && vocab_size > 0,
      "vocab_parallel_fused_linear_cross_entropy: weight must be [V_pad / tp, C] "
      "and vocab_size positive, got ",
      weight.sizes(),
      " and ",
      vocab_size);
  auto options = kernels::FusedLinearCrossEntropyOptions()
                     .ignore_index(ignore_index)
                     .chunk_size(chunk_size);
  if (group == nullptr || group->size() == 1) {
    TORCH_CHECK(
        weight.size(0) >= vocab_size,
        "vocab_parallel_fused_linear_cross_entropy: one rank's head has ",
        weight.size(0),
        " rows for a vocabulary of ",
        vocab_size);
    return kernels::fused_linear_cross_entropy(
        hidden, weight.narrow(0, 0, vocab_size), c10::nullopt, target, options);
  }
  kernels::VocabShard shard;
  shard.start = weight.size(0) * group->rank();
  shard.vocab_size = vocab_size;
  shard.all_reduce_max = [group](at::Tensor& t) {
    distributed::all_reduce(t, *group, distributed::ReduceOp::kMax).wait();
  };
  shard.all_reduce_sum = [group](at::Tensor& t) {
    distributed::all_reduce(t, *group).wait();
  };
  return kernels::fused_linear_cross_entropy(
      cdf::copy_to_group(hidden, group),
      weight,
      c10::nullopt,
      target,
      options.vocab_shard(shard));
}

} // namespace layer
} // namespace shardformer
} // namespace colossalai
