#include "ddp_reducer.h"

#include "../../utils/grad_ready_hook.h"

#include <torch/csrc/autograd/engine.h>

#include <map>
#include <sstream>
#include <tuple>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

Reducer::Reducer(
    std::vector<std::string> names,
    std::vector<at::Tensor> params,
    distributed::ProcessGroupPtr group,
    ReducerOptions options)
    : names_(std::move(names)),
      params_(std::move(params)),
      group_(std::move(group)),
      options_(options) {
  TORCH_INTERNAL_ASSERT(names_.size() == params_.size());
  build_buckets();
  ready_.assign(params_.size(), 0);
  used_.assign(params_.size(), 0);
  globally_unused_.assign(params_.size(), 0);
}

void Reducer::build_buckets() {
  // Reverse registration order approximates the order in which backward
  // produces gradients, so the first bucket fills first.
  struct Open {
    size_t bucket;
    int64_t bytes = 0;
  };
  using Key = std::tuple<int, int, int>; // dtype, device type, index
  std::map<Key, Open> open;
  std::map<Key, int> closed;
  slots_.resize(params_.size());
  std::vector<int64_t> numels;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    Key key{
        static_cast<int>(p.scalar_type()),
        static_cast<int>(p.device().type()),
        p.device().index()};
    const int64_t bytes = p.numel() * p.element_size();
    auto it = open.find(key);
    const int64_t cap =
        closed[key] == 0 ? options_.first_bucket_bytes : options_.bucket_bytes;
    if (it != open.end() && it->second.bytes > 0 &&
        it->second.bytes + bytes > cap) {
      closed[key]++;
      open.erase(it);
      it = open.end();
    }
    if (it == open.end()) {
      it = open.emplace(key, Open{buckets_.size()}).first;
      buckets_.emplace_back();
      numels.push_back(0);
    }
    auto& b = buckets_[it->second.bucket];
    slots_[k] = Slot{it->second.bucket, numels[it->second.bucket], p.numel()};
    numels[it->second.bucket] += p.numel();
    b.params.push_back(k);
    it->second.bytes += bytes;
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const auto& first = params_[buckets_[i].params.front()];
    buckets_[i].buffer = at::zeros({numels[i]}, first.options());
    buckets_[i].pending = buckets_[i].params.size();
  }
}

void Reducer::register_hooks() {
  std::weak_ptr<Reducer> weak = shared_from_this();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = utils::on_grad_accumulated(params_[i], [weak, i]() {
      if (auto self = weak.lock()) {
        self->on_grad_ready(i);
      }
    });
    TORCH_CHECK(
        acc != nullptr,
        "TorchDDPPlugin: parameter '",
        names_[i],
        "' is not a leaf that requires grad");
    // The parameter holds its accumulator weakly; keep it (and the hook).
    accumulators_.push_back(std::move(acc));
  }
}

void Reducer::on_grad_ready(size_t index) {
  if (!require_sync) {
    return;
  }
  if (!in_backward_) {
    in_backward_ = true;
    std::weak_ptr<Reducer> weak = shared_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak]() {
      if (auto self = weak.lock()) {
        self->finalize();
      }
    });
    if (unused_known_) {
      // static_graph: parameters unused everywhere never get a hook call; mark
      // them now so their buckets are not held back until the end.
      for (size_t k = 0; k < params_.size(); ++k) {
        if (globally_unused_[k]) {
          mark_ready(k, false);
        }
      }
    }
  }
  TORCH_INTERNAL_ASSERT(
      !ready_[index],
      "gradient of '",
      names_[index],
      "' reported twice in one backward");
  mark_ready(index, true);
}

void Reducer::mark_ready(size_t index, bool used) {
  const auto& slot = slots_[index];
  auto& bucket = buckets_[slot.bucket];
  auto& param = params_[index];
  auto view = bucket.buffer.narrow(0, slot.offset, slot.numel);
  auto& grad = param.mutable_grad();
  if (grad.defined()) {
    if (grad.data_ptr() != view.data_ptr()) {
      view.copy_(grad.reshape({-1}));
      if (options_.gradient_as_bucket_view) {
        grad = view.view(param.sizes());
      }
    }
  } else {
    view.zero_();
  }
  ready_[index] = 1;
  used_[index] = used ? 1 : 0;
  TORCH_INTERNAL_ASSERT(bucket.pending > 0);
  if (--bucket.pending == 0) {
    launch_ready_buckets();
  }
}

void Reducer::launch_ready_buckets() {
  // Strictly in bucket order: every rank must issue the same sequence.
  while (next_bucket_ < buckets_.size() &&
         buckets_[next_bucket_].pending == 0) {
    auto& b = buckets_[next_bucket_++];
    // Divide first, as PyTorch does: keeps fp16 sums in range.
    b.buffer.div_(group_->size());
    b.work = distributed::all_reduce(b.buffer, *group_);
    overlapped_ += finalizing_ ? 0 : 1;
  }
}

void Reducer::reset() {
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(used_.begin(), used_.end(), 0);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work = distributed::Work();
  }
  next_bucket_ = 0;
  in_backward_ = false;
  finalizing_ = false;
  overlapped_ = 0;
}

void Reducer::finalize() {
  finalizing_ = true;
  overlapped_last_ = overlapped_;
  std::vector<size_t> missing;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) {
      missing.push_back(i);
    }
  }
  if (!missing.empty() && !options_.find_unused_parameters) {
    std::ostringstream names;
    for (size_t k = 0; k < missing.size() && k < 10; ++k) {
      names << (k ? ", " : "") << names_[missing[k]];
    }
    if (missing.size() > 10) {
      names << ", ... (" << missing.size() << " in all)";
    }
    reset();
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
  for (size_t i : missing) {
    mark_ready(i, false);
  }
  TORCH_INTERNAL_ASSERT(next_bucket_ == buckets_.size());

  std::vector<char> unused(params_.size(), 0);
  if (options_.find_unused_parameters) {
    if (unused_known_) {
      unused = globally_unused_;
    } else {
      // Which parameters no rank used: their gradients stay as they were.
      auto flags = at::tensor(used_, at::kInt);
      distributed::all_reduce(flags, *group_, distributed::ReduceOp::kMax)
          .wait();
      auto acc = flags.accessor<int32_t, 1>();
      for (size_t i = 0; i < params_.size(); ++i) {
        unused[i] = acc[i] == 0;
      }
      if (options_.static_graph) {
        globally_unused_ = unused;
        unused_known_ = true;
      }
    }
  }
  try {
    for (auto& b : buckets_) {
      b.work.wait();
    }
  } catch (...) {
    reset();
    throw;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (unused[i]) {
      continue;
    }
    auto& param = params_[i];
    const auto& slot = slots_[i];
    auto view = buckets_[slot.bucket]
                    .buffer.narrow(0, slot.offset, slot.numel)
                    .view(param.sizes());
    auto& grad = param.mutable_grad();
    if (options_.gradient_as_bucket_view) {
      grad = view;
    } else if (grad.defined()) {
      grad.copy_(view);
    } else {
      grad = view.clone();
    }
  }
  reset();
}

std::vector<int64_t> Reducer::bucket_numels() const {
  std::vector<int64_t> out;
  for (const auto& b : buckets_) {
    out.push_back(b.buffer.numel());
  }
  return out;
}

int64_t Reducer::bytes_per_sync() const {
  int64_t total = 0;
  for (const auto& b : buckets_) {
    total += b.buffer.numel() * b.buffer.element_size();
  }
  return total;
}

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
