#include <colossalai/checkpoint_io/distributed_checkpoint_io.h>
#include <colossalai/distributed/collectives.h>

#include <algorithm>

namespace colossalai {
namespace checkpoint_io {

DistributedCheckpointIO::DistributedCheckpointIO(
    distributed::ProcessGroupPtr group,
    std::shared_ptr<StateAccess> access)
    : group_(std::move(group)), access_(std::move(access)) {
  TORCH_CHECK(group_ != nullptr, "DistributedCheckpointIO: the group is null");
  TORCH_CHECK(
      access_ != nullptr, "DistributedCheckpointIO: the state access is null");
}

bool DistributedCheckpointIO::is_writer() const {
  return group_->rank() == 0;
}

void DistributedCheckpointIO::sync_point() {
  distributed::barrier(*group_).wait();
}

void DistributedCheckpointIO::load_in_model_scope(
    interface::ModelWrapper& model,
    const std::function<void()>& load) {
  access_->load_model(model, load);
}

void DistributedCheckpointIO::stream_model_state(
    interface::ModelWrapper& model,
    const TensorSink& sink) {
  access_->stream_model(model, sink);
}

void DistributedCheckpointIO::stream_optimizer_states(
    interface::OptimizerWrapper& optimizer,
    const StateSink& sink) {
  access_->stream_optimizer(optimizer, sink);
}

namespace {

// Installs the access's tensor loader for one load, also on error.
struct LoaderScope {
  LoaderScope(TensorLoader& slot, TensorLoader loader) : slot_(slot) {
    slot_ = std::move(loader);
  }
  ~LoaderScope() {
    slot_ = nullptr;
  }
  TensorLoader& slot_;
};

} // namespace

void DistributedCheckpointIO::load_unsharded_model(
    interface::ModelWrapper& model,
    const std::string& checkpoint,
    bool strict) {
  LoaderScope scope(tensor_loader_, access_->model_tensor_loader(model));
  access_->load_model(model, [&] {
    GeneralCheckpointIO::load_unsharded_model(model, checkpoint, strict);
  });
}

void DistributedCheckpointIO::load_sharded_model(
    interface::ModelWrapper& model,
    const std::string& index_file,
    bool strict) {
  LoaderScope scope(tensor_loader_, access_->model_tensor_loader(model));
  access_->load_model(model, [&] {
    GeneralCheckpointIO::load_sharded_model(model, index_file, strict);
  });
}

void DistributedCheckpointIO::load_optimizer_state(
    interface::OptimizerWrapper& optimizer,
    int64_t id,
    const StateDict& state,
    const std::string& file) {
  access_->load_optimizer_param(optimizer, id, state, file);
}

c10::impl::GenericList DistributedCheckpointIO::optimizer_param_groups(
    interface::OptimizerWrapper& optimizer) {
  return access_->optimizer_param_groups(optimizer);
}

void DistributedCheckpointIO::load_optimizer_groups(
    interface::OptimizerWrapper& optimizer,
    const c10::IValue& groups,
    const std::string& file) {
  access_->load_optimizer_groups(optimizer, groups, file);
}

int DistributedCheckpointIO::num_parts() {
  return std::max<int>(1, access_->part_writers().size());
}

int DistributedCheckpointIO::my_part() {
  const auto writers = access_->part_writers();
  if (writers.empty()) {
    return is_writer() ? 0 : -1;
  }
  auto it = std::find(writers.begin(), writers.end(), group_->rank());
  return it == writers.end() ? -1 : static_cast<int>(it - writers.begin());
}

void DistributedCheckpointIO::stream_model_part(
    interface::ModelWrapper& model,
    const TensorSink& sink) {
  access_->stream_model_part(model, sink);
}

void DistributedCheckpointIO::stream_optimizer_part(
    interface::OptimizerWrapper& optimizer,
    const StateSink& sink) {
  access_->stream_optimizer_part(optimizer, sink);
}

std::vector<std::string> DistributedCheckpointIO::exchange(
    const std::string& bytes) {
  return distributed::all_gather_bytes(bytes, *group_);
}

} // namespace checkpoint_io
} // namespace colossalai
