#include <colossalai/booster/plugin/torch_ddp_checkpoint_io.h>
#include <colossalai/booster/plugin/torch_ddp_model.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/initialize.h>
#include <colossalai/quantization/fp8.h>

#include "../../zero/ddp/reducer.h"

#include <torch/csrc/autograd/grad_mode.h>
#include <torch/version.h>

#include <map>
#include <unordered_set>

namespace colossalai {
namespace booster {
namespace plugin {

void broadcast_coalesced(
    const std::vector<at::Tensor>& tensors,
    int src,
    const distributed::ProcessGroup& group) {
  if (group.size() == 1) {
    return;
  }
  // One flat message per dtype, in first-appearance order on every rank.
  std::vector<std::pair<at::ScalarType, std::vector<at::Tensor>>> by_dtype;
  for (const auto& t : tensors) {
    auto it = std::find_if(by_dtype.begin(), by_dtype.end(), [&](auto& e) {
      return e.first == t.scalar_type();
    });
    if (it == by_dtype.end()) {
      by_dtype.push_back({t.scalar_type(), {}});
      it = by_dtype.end() - 1;
    }
    it->second.push_back(t);
  }
  at::NoGradGuard no_grad;
  for (auto& entry : by_dtype) {
    std::vector<at::Tensor> flat_parts;
    for (auto& t : entry.second) {
      flat_parts.push_back(t.reshape({-1}));
    }
    auto flat = at::cat(flat_parts);
    distributed::broadcast(flat, src, group).wait();
    int64_t offset = 0;
    for (auto& t : entry.second) {
      auto part = flat.narrow(0, offset, t.numel()).view(t.sizes());
      const_cast<at::Tensor&>(t).copy_(part);
      offset += t.numel();
    }
  }
}

TorchDDPModel::TorchDDPModel(
    std::shared_ptr<interface::ModelWrapper> inner,
    distributed::ProcessGroupPtr group,
    const TorchDDPPluginOptions& options,
    const std::set<std::string>& params_to_ignore)
    : interface::ModelWrapper(std::move(inner)),
      group_(std::move(group)),
      options_(options) {
  TORCH_CHECK(
      options.bucket_cap_mb() > 0,
      "TorchDDPPlugin: bucket_cap_mb must be > 0, got ",
      options.bucket_cap_mb());
  // Deduplicate shared parameters (tied weights): one gradient, one slot.
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> state;
  std::unordered_set<const void*> seen;
  for (const auto& item : unwrap()->named_parameters(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second ||
        params_to_ignore.count(item.key())) {
      continue;
    }
    state.push_back(item.value());
    if (item.value().requires_grad()) {
      names.push_back(item.key());
      params.push_back(item.value());
    }
  }
  for (const auto& item : unwrap()->named_buffers(true)) {
    if (item.value().defined()) {
      state.push_back(item.value());
    }
  }
  // Every rank starts from rank 0's weights.
  broadcast_coalesced(state, 0, *group_);

  zero::detail::ReducerOptions ro;
  ro.bucket_bytes = static_cast<int64_t>(options.bucket_cap_mb() * (1 << 20));
  ro.first_bucket_bytes = std::min<int64_t>(1 << 20, ro.bucket_bytes);
  ro.find_unused_parameters = options.find_unused_parameters();
  ro.gradient_as_bucket_view = options.gradient_as_bucket_view();
  ro.static_graph = options.static_graph();
  ro.fp8 = options.fp8_communication() && quantization::fp8_compresses(*group_);
  fp8_ = ro.fp8;
  reducer_ = std::make_shared<zero::detail::Reducer>(
      std::move(names), std::move(params), group_, ro);
  reducer_->register_hooks();
}

TorchDDPModel::~TorchDDPModel() = default;

void TorchDDPModel::pre_forward() {
  if (options_.broadcast_buffers() && group_->size() > 1) {
    broadcast_buffers();
  }
}

void TorchDDPModel::broadcast_buffers() {
  std::vector<at::Tensor> buffers;
  for (const auto& b : unwrap()->buffers(true)) {
    if (b.defined()) {
      buffers.push_back(b);
    }
  }
  if (!buffers.empty()) {
    broadcast_coalesced(buffers, 0, *group_);
  }
}

void TorchDDPModel::sync_gradients() {
  reducer_->sync_gradients();
}

void TorchDDPModel::set_require_sync(bool require) {
  reducer_->set_require_sync(require);
}

bool TorchDDPModel::require_sync() const {
  return reducer_->require_sync();
}

std::vector<int64_t> TorchDDPModel::bucket_numels() const {
  return reducer_->bucket_numels();
}

int64_t TorchDDPModel::bytes_per_sync() const {
  return reducer_->bytes_per_sync();
}

size_t TorchDDPModel::buckets_overlapped() const {
  return reducer_->buckets_overlapped();
}

bool TorchDDPModel::fp8_communication() const {
  return fp8_;
}

TorchDDPPlugin::TorchDDPPlugin(TorchDDPPluginOptions options)
    : options_(options) {
  TORCH_CHECK(
      options.bucket_cap_mb() > 0,
      "TorchDDPPlugin: bucket_cap_mb must be > 0, got ",
      options.bucket_cap_mb());
  TORCH_CHECK(
      !options.fp8_communication() || quantization::fp8_supported(),
      "TorchDDPPlugin: fp8_communication needs LibTorch 2.1 or later (its "
      "float8 dtypes); this is ",
      TORCH_VERSION);
}

void TorchDDPPlugin::configure(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer) {
  if (optimizer) {
    optimizer->refuse_graph_capture(
        "TorchDDPPlugin all-reduces gradients in the model's backward, "
        "which a captured step does not capture; a captured step takes the "
        "booster without a plugin or LowLevelZeroPlugin at one rank");
  }
  if (!model) {
    return;
  }
  TORCH_CHECK(
      interface::find_wrapper<TorchDDPModel>(*model) == nullptr,
      "TorchDDPPlugin: the model is already boosted");
  model->unwrap()->to(current_device());
  model = std::make_shared<TorchDDPModel>(model, dp_group_, options_);
}

std::shared_ptr<checkpoint_io::CheckpointIO> TorchDDPPlugin::
    get_checkpoint_io() {
  return std::make_shared<TorchDDPCheckpointIO>(dp_group_);
}

NoSyncGuard TorchDDPPlugin::no_sync(
    interface::ModelWrapper& model,
    interface::OptimizerWrapper*) {
  auto* ddp = interface::find_wrapper<TorchDDPModel>(model);
  TORCH_CHECK(
      ddp != nullptr,
      "TorchDDPPlugin.no_sync: the model was not boosted by this "
      "plugin");
  bool previous = ddp->require_sync();
  ddp->set_require_sync(false);
  return NoSyncGuard([ddp, previous]() { ddp->set_require_sync(previous); });
}

} // namespace plugin
} // namespace booster
} // namespace colossalai
