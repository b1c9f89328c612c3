#include "reducer.h"

#include <colossalai/quantization/fp8.h>

#include <map>
#include <sstream>
#include <tuple>

namespace colossalai {
namespace zero {
namespace detail {

Reducer::Reducer(
    std::vector<std::string> names,
    std::vector<at::Tensor> params,
    distributed::ProcessGroupPtr group,
    ReducerOptions options)
    : names_(std::move(names)),
      params_(std::move(params)),
      group_(std::move(group)),
      options_(options),
      world_(
          at::scalar_tensor(static_cast<double>(group_->size()), at::kDouble)) {
  TORCH_INTERNAL_ASSERT(names_.size() == params_.size());
  used_.assign(params_.size(), 0);
  unused_.assign(params_.size(), 0);
  globally_unused_.assign(params_.size(), 0);
  distributed::GradBucketerOptions bo;
  bo.ordered = true;
  bo.overlap = true;
  bucketer_ = std::make_shared<distributed::GradBucketer>(
      params_.size(), plan_buckets(), this, bo);
}

std::vector<std::vector<size_t>> Reducer::plan_buckets() {
  // Buckets hold one dtype and device each; the first of each kind is
  // smaller, so its all-reduce starts early.
  distributed::BucketPlanOptions po;
  po.cap = options_.bucket_bytes;
  po.first_cap = options_.first_bucket_bytes;
  auto buckets = distributed::plan_buckets(params_, po);
  std::vector<int64_t> numels(buckets.size(), 0);
  slots_.resize(params_.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    for (size_t k : buckets[b]) {
      slots_[k] = Slot{b, numels[b], params_[k].numel()};
      numels[b] += params_[k].numel();
    }
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    buffers_.push_back(
        at::zeros({numels[b]}, params_[buckets[b].front()].options()));
  }
  return buckets;
}

void Reducer::register_hooks() {
  if (group_->size() == 1) {
    // Alone, the gradients already are the average: no hooks, no buckets,
    // no copies, so DDP at world size 1 costs what the plain step does.
    // (The check that every parameter got a gradient runs from 2 ranks on.)
    return;
  }
  size_t bad = 0;
  TORCH_CHECK(
      bucketer_->attach_hooks(params_, &bad),
      "TorchDDPPlugin: parameter '",
      names_[bad],
      "' is not a leaf that requires grad");
}

at::Tensor Reducer::view_of(size_t param) const {
  const auto& slot = slots_[param];
  return buffers_[slot.bucket].narrow(0, slot.offset, slot.numel);
}

void Reducer::on_backward_begin() {
  if (unused_known_) {
    // static_graph: parameters unused everywhere never get a hook call;
    // report them now so their buckets are not held back until the end.
    for (size_t k = 0; k < params_.size(); ++k) {
      if (globally_unused_[k]) {
        bucketer_->ready(k, false);
      }
    }
  }
}

void Reducer::sync_gradients() {
  if (group_->size() == 1) {
    return;
  }
  std::vector<char> used;
  for (const auto& p : params_) {
    used.push_back(p.grad().defined() ? 1 : 0);
  }
  bucketer_->flush(used);
}

void Reducer::fill(size_t param, bool used) {
  auto& p = params_[param];
  auto view = view_of(param);
  auto& grad = p.mutable_grad();
  if (grad.defined()) {
    // (An unused parameter may still hold what no_sync accumulated.)
    // Divided on the way in, as PyTorch divides before the sum (keeps fp16
    // sums in range); one pass instead of a copy and a division.
    if (grad.data_ptr() != view.data_ptr()) {
      at::div_out(view, grad.reshape({-1}), world_);
      if (options_.gradient_as_bucket_view) {
        grad = view.view(p.sizes());
      }
    } else {
      view.div_(world_);
    }
  } else {
    view.zero_();
  }
  used_[param] = used ? 1 : 0;
}

distributed::Work Reducer::launch(size_t bucket) {
  // (fill divided every gradient by the world size already.)
  if (options_.fp8) {
    return quantization::all_reduce_fp8(
        buffers_[bucket], *group_, distributed::ReduceOp::kSum, "e5m2");
  }
  return distributed::all_reduce(buffers_[bucket], *group_);
}

void Reducer::on_missing(const std::vector<size_t>& missing) {
  if (missing.empty() || options_.find_unused_parameters) {
    return;
  }
  std::ostringstream names;
  for (size_t k = 0; k < missing.size() && k < 10; ++k) {
    names << (k ? ", " : "") << names_[missing[k]];
  }
  if (missing.size() > 10) {
    names << ", ... (" << missing.size() << " in all)";
  }
  TORCH_CHECK(
      false,
      "TorchDDPPlugin: parameters received no gradient in "
      "this backward: ",
      names.str(),
      ". If the model has "
      "parameters that do not take part in every forward, use "
      "TorchDDPPluginOptions().find_unused_parameters(true); "
      "otherwise make every output take part in the loss.");
}

void Reducer::before_wait() {
  std::fill(unused_.begin(), unused_.end(), 0);
  if (!options_.find_unused_parameters) {
    return;
  }
  if (unused_known_) {
    unused_ = globally_unused_;
    return;
  }
  // Which parameters no rank used (overlapping the buckets still in
  // flight): their gradients stay as they were.
  auto flags = at::tensor(used_, at::TensorOptions().dtype(at::kInt))
                   .to(group_->device());
  distributed::all_reduce(flags, *group_, distributed::ReduceOp::kMax).wait();
  auto host = flags.cpu();
  auto acc = host.accessor<int32_t, 1>();
  for (size_t i = 0; i < params_.size(); ++i) {
    unused_[i] = acc[i] == 0;
  }
  if (options_.static_graph) {
    globally_unused_ = unused_;
    unused_known_ = true;
  }
}

void Reducer::on_finalized(bool synced) {
  if (!synced) {
    return; // no_sync: gradients accumulate in .grad
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (unused_[i]) {
      continue;
    }
    auto& param = params_[i];
    auto view = view_of(i).view(param.sizes());
    auto& grad = param.mutable_grad();
    if (options_.gradient_as_bucket_view) {
      grad = view;
    } else if (grad.defined()) {
      grad.copy_(view);
    } else {
      grad = view.clone();
    }
  }
}

std::vector<int64_t> Reducer::bucket_numels() const {
  std::vector<int64_t> out;
  for (const auto& b : buffers_) {
    out.push_back(b.numel());
  }
  return out;
}

int64_t Reducer::bytes_per_sync() const {
  int64_t total = 0;
  for (const auto& b : buffers_) {
    total += b.numel() * b.element_size();
  }
  return total;
}

} // namespace detail
} // namespace zero
} // namespace colossalai
