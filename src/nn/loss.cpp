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
  // No host sync: a count of zero anywhere means every sum is zero too, so
  // dividing by max(count, 1) gives 0 with a zero gradient.
  // At least float: a bf16 scale of size / total would keep 3 digits.
  const auto dtype = at::promote_types(sum.scalar_type(), at::kFloat);
  const auto total = both[1].clamp_min(1.0);
  const auto local =
      sum.reshape({}).to(dtype) * (static_cast<double>(size) / total).to(dtype);
  const auto value = (both[0] / total).to(dtype);
  return local + (value - local.detach());
}

} // namespace nn
} // namespace colossalai
