// Token means over ranks (NOTE [Token-mean losses]).

#include <colossalai/distributed/collectives.h>
#include <colossalai/nn/loss.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace colossalai {
namespace nn {

at::Tensor token_mean(
    const at::Tensor& sum,
    const at::Tensor& count,
    const distributed::ProcessGroupPtr& group) {
  TORCH_CHECK(
      sum.defined() && sum.numel() == 1 && count.defined() &&
          count.numel() == 1,
      "token_mean: sum and count must be scalars, got ",
      sum.defined() ? sum.sizes() : at::IntArrayRef{},
      " and ",
      count.defined() ? count.sizes() : at::IntArrayRef{});
  const int size = group == nullptr ? 1 : group->size();
  // Both numbers in one message, in double: a count is exact there up to
  // 2^53 tokens, and a float sum of millions of tokens keeps its digits.
  auto both = at::stack(
      {sum.detach().reshape({}).to(at::kDouble),
       count.detach().reshape({}).to(sum.device(), at::kDouble)});
  if (size > 1) {
    distributed::all_reduce(both, *group).wait();
  }
  const double total = both[1].item<double>();
  if (total <= 0) {
    // No token anywhere: zero, with a zero gradient that still reaches every
    // parameter the sum depends on (hooks fire as for any other step).
    return sum.reshape({}) * 0.0;
  }
  const auto local = sum.reshape({}) * (static_cast<double>(size) / total);
  const auto value = (both[0] / total).to(sum.scalar_type());
  return local + (value - local.detach());
}

} // namespace nn
} // namespace colossalai
