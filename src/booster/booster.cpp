#include <colossalai/booster/booster.h>
#include <colossalai/initialize.h>

#include <algorithm>

namespace colossalai {
namespace booster {

namespace {

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    out += (out.empty() ? "" : ", ") + s;
  }
  return out;
}

} // namespace

Booster::Booster(BoosterOptions options)
    : options_(std::move(options)), plugin_(options_.plugin()) {
  device_ = options_.device().empty() ? current_device()
                                      : at::Device(options_.device());
  const std::string device_type = device_.is_cuda() ? "cuda" : "cpu";
  std::string precision = options_.mixed_precision();
  if (precision == "no") {
    precision = "";
  }
  if (plugin_) {
    TORCH_CHECK(
        contains(plugin_->supported_devices(), device_type),
        plugin_->name(),
        " does not support device '",
        device_type,
        "' (supported: ",
        join(plugin_->supported_devices()),
        ")");
    if (!precision.empty()) {
      TORCH_CHECK(
          contains(plugin_->supported_precisions(), precision),
          plugin_->name(),
          " does not support mixed_precision '",
          precision,
          "' (supported: ",
          join(plugin_->supported_precisions()),
          ")");
    }
  }
  if (!plugin_ || !plugin_->control_precision()) {
    mixed_precision_ =
        mixed_precision::make_mixed_precision(precision, device_.type());
  }
}

std::pair<
    std::shared_ptr<interface::ModelWrapper>,
    std::shared_ptr<interface::OptimizerWrapper>>
Booster::boost_parts(
    std::shared_ptr<torch::nn::Module> model,
    std::shared_ptr<torch::optim::Optimizer> optimizer) {
  TORCH_CHECK(model != nullptr, "Booster.boost: the model is null");
  if (!plugin_ || !plugin_->control_device()) {
    model->to(device_);
  }
  auto model_w = std::make_shared<interface::ModelWrapper>(model);
  std::shared_ptr<interface::OptimizerWrapper> optim_w;
  if (optimizer) {
    optim_w = std::make_shared<interface::OptimizerWrapper>(optimizer);
  }
  std::shared_ptr<interface::ModelWrapper> mw = model_w;
  if (plugin_) {
    plugin_->configure(mw, optim_w);
  }
  if (mixed_precision_) {
    mixed_precision_->configure(mw, optim_w);
  }
  return {mw, optim_w};
}

void Booster::backward(
    const at::Tensor& loss,
    interface::OptimizerWrapper& optimizer) {
  optimizer.backward(loss);
}

plugin::NoSyncGuard Booster::no_sync(
    interface::ModelWrapper& model,
    interface::OptimizerWrapper* optimizer) {
  TORCH_CHECK(
      plugin_ != nullptr,
      "Booster.no_sync: there is no plugin, so nothing to sync");
  TORCH_CHECK(
      plugin_->support_no_sync(), plugin_->name(), " does not support no_sync");
  return plugin_->no_sync(model, optimizer);
}

} // namespace booster
} // namespace colossalai
