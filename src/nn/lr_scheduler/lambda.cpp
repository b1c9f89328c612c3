#include <colossalai/nn/lr_scheduler/lambda.h>

#include <c10/util/Exception.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

namespace {
// One function per group, or one shared by all.
LambdaLROptions per_group(
    LambdaLROptions options,
    size_t num_groups,
    const char* who) {
  auto& fns = options.lr_lambdas();
  TORCH_CHECK(
      fns.size() == 1 || fns.size() == num_groups,
      who,
      ": expected 1 or ",
      num_groups,
      " lr_lambdas (one per parameter group), got ",
      fns.size());
  for (const auto& fn : fns) {
    TORCH_CHECK(fn, who, ": lr_lambdas must not hold an empty function");
  }
  if (fns.size() == 1 && num_groups > 1) {
    options.lr_lambdas(std::vector<LrLambda>(num_groups, fns.front()));
  }
  return options;
}
} // namespace

LambdaLR::LambdaLR(
    torch::optim::Optimizer& optimizer,
    const LambdaLROptions& options)
    : LRScheduler(optimizer),
      options_(per_group(options, num_groups(), "LambdaLR")) {
  initial_step();
}

std::vector<double> LambdaLR::get_lr() {
  std::vector<double> lrs;
  for (size_t i = 0; i < base_lrs_.size(); ++i) {
    lrs.push_back(base_lrs_[i] * options_.lr_lambdas()[i](last_epoch_));
  }
  return lrs;
}

MultiplicativeLR::MultiplicativeLR(
    torch::optim::Optimizer& optimizer,
    const MultiplicativeLROptions& options)
    : LRScheduler(optimizer),
      options_(per_group(options, num_groups(), "MultiplicativeLR")) {
  initial_step();
}

std::vector<double> MultiplicativeLR::get_lr() {
  auto lrs = group_lrs();
  if (last_epoch_ > 0) {
    for (size_t i = 0; i < lrs.size(); ++i) {
      lrs[i] *= options_.lr_lambdas()[i](last_epoch_);
    }
  }
  return lrs;
}

namespace {
// Python saves None for a plain function (only callable objects' attributes
// are saved); LambdaLR.load_state_dict needs the entry.
c10::IValue no_lambdas(size_t num_groups) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (size_t i = 0; i < num_groups; ++i) {
    list.push_back(c10::IValue());
  }
  return list;
}
} // namespace

void LambdaLR::state_dict_extra(c10::impl::GenericDict& state) const {
  state.insert_or_assign("lr_lambdas", no_lambdas(num_groups()));
}

void MultiplicativeLR::state_dict_extra(c10::impl::GenericDict& state) const {
  state.insert_or_assign("lr_lambdas", no_lambdas(num_groups()));
}

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
