#include <colossalai/booster/booster.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/initialize.h>
#include <colossalai/lazy/lazy_init.h>
#include <colossalai/lora/lora_model.h>
#include <colossalai/quantization/quantize_model.h>

#include "../distributed/grad_bucketer.h"
#include "../distributed/raised_backward.h"
#include "../utils/host_memory.h"

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

// Moves tensor arguments to the model's device, as torch's DDP does with
// its device_ids: a training loop written for the CPU runs unchanged when
// the ranks are launched on GPUs. A host batch goes through page-locked
// memory, asynchronously (as a DataLoader with pin_memory and a
// non_blocking copy): the host does not wait for the last step to finish.
class ToDeviceModel : public interface::ModelWrapper {
 public:
  ToDeviceModel(std::shared_ptr<interface::ModelWrapper> inner, at::Device d)
      : interface::ModelWrapper(std::move(inner)), device_(d) {}

 protected:
  at::Tensor transform_input(const at::Tensor& x) override {
    return x.defined() ? utils::upload_async(x, device_) : x;
  }

 private:
  at::Device device_;
};

// Recomputes the LoRA weights of reparametrised layers before every
// forward (NOTE [LoRA in C++]).
class LoraRefreshModel : public interface::ModelWrapper {
 public:
  LoraRefreshModel(
      std::shared_ptr<interface::ModelWrapper> inner,
      std::shared_ptr<lora::LoraModel> lora)
      : interface::ModelWrapper(std::move(inner)), lora_(std::move(lora)) {}

 protected:
  void pre_forward() override {
    lora_->refresh();
  }

 private:
  std::shared_ptr<lora::LoraModel> lora_;
};

} // namespace

Booster::Booster(BoosterOptions options)
    : options_(std::move(options)), plugin_(options_.plugin()) {
  device_ = options_.device().empty() ? current_device()
                                      : at::Device(options_.device());
  if (plugin_ && plugin_->control_device()) {
    // The plugin places the model on the launched device: another one here
    // would only mislead autocast.
    const c10::Device launched = current_device();
    TORCH_CHECK(
        device_.type() == launched.type() &&
            (!device_.has_index() || device_ == launched),
        "BoosterOptions device '",
        device_.str(),
        "' differs from this rank's launched device '",
        launched.str(),
        "', where ",
        plugin_->name(),
        " places the model; choose the device at launch (LaunchOptions::"
        "device or COLOSSALAI_DEVICE) and leave the Booster's unset");
    device_ = launched;
  }
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
  // One rule for every plugin that applies its own precision: a Booster
  // mixed_precision may repeat it, never contradict it.
  TORCH_CHECK(
      !(plugin_ && plugin_->control_precision() && !precision.empty() &&
        precision != plugin_->precision()),
      "Booster mixed_precision '",
      precision,
      "' contradicts ",
      plugin_ ? plugin_->name() : "",
      "'s precision '",
      plugin_ ? plugin_->precision() : "",
      "': the plugin applies its own precision; set it in the plugin's "
      "options and leave mixed_precision unset (or equal)");
  auto policy = options_.mixed_precision_policy();
  TORCH_CHECK(
      !(policy && plugin_ && plugin_->control_precision()),
      "Booster mixed_precision: ",
      plugin_ ? plugin_->name() : "",
      " applies its own precision, so a MixedPrecision object's settings "
      "would go unused; set precision (and initial_scale, growth_interval, "
      "...) in the plugin's options instead");
  if (policy) {
    policy->bind_device(device_.type());
    mixed_precision_ = policy;
  } else if (!plugin_ || !plugin_->control_precision()) {
    mixed_precision_ =
        mixed_precision::make_mixed_precision(precision, device_.type());
  }
  if (plugin_ && plugin_->control_checkpoint_io()) {
    checkpoint_io_ = plugin_->get_checkpoint_io();
  } else {
    checkpoint_io_ = std::make_shared<checkpoint_io::GeneralCheckpointIO>();
  }
}

void Booster::save_optimizer(
    interface::OptimizerWrapper& optimizer,
    const std::string& checkpoint,
    const checkpoint_io::SaveOptimizerOptions& o) {
  checkpoint_io_->save_optimizer(optimizer, checkpoint, o);
}

void Booster::load_optimizer(
    interface::OptimizerWrapper& optimizer,
    const std::string& checkpoint) {
  checkpoint_io_->load_optimizer(optimizer, checkpoint);
}

void Booster::save_lr_scheduler(
    const nn::lr_scheduler::LRScheduler& s,
    const std::string& checkpoint) {
  checkpoint_io_->save_lr_scheduler(s, checkpoint);
}

void Booster::load_lr_scheduler(
    nn::lr_scheduler::LRScheduler& s,
    const std::string& checkpoint) {
  checkpoint_io_->load_lr_scheduler(s, checkpoint);
}

std::pair<
    std::shared_ptr<interface::ModelWrapper>,
    std::shared_ptr<interface::OptimizerWrapper>>
Booster::boost_parts(
    std::shared_ptr<torch::nn::Module> model,
    std::shared_ptr<torch::optim::Optimizer> optimizer) {
  TORCH_CHECK(model != nullptr, "Booster.boost: the model is null");
  // A model built in a LazyInitContext gets its values now (NOTE [Lazy
  // initialization]), or, under a sharding plugin, each rank its shard.
  if (lazy::is_lazy(*model) && !(plugin_ && plugin_->shards_lazy_models())) {
    lazy::materialize(*model);
  }
  if (!plugin_ || !plugin_->control_device()) {
    model->to(device_);
  }
  boosted_.insert(model.get());
  std::shared_ptr<interface::ModelWrapper> mw =
      std::make_shared<interface::ModelWrapper>(model);
  if (!device_.is_cpu()) {
    mw = std::make_shared<ToDeviceModel>(mw, device_);
  }
  auto lora = lora_.find(model.get());
  if (lora != lora_.end()) {
    mw = std::make_shared<LoraRefreshModel>(mw, lora->second);
    if (optimizer) {
      // Frozen base weights get no gradient and hold no optimizer state.
      for (auto& g : optimizer->param_groups()) {
        auto& ps = g.params();
        ps.erase(
            std::remove_if(
                ps.begin(),
                ps.end(),
                [](const at::Tensor& p) { return !p.requires_grad(); }),
            ps.end());
      }
    }
  }
  std::shared_ptr<interface::OptimizerWrapper> optim_w;
  if (optimizer) {
    optim_w = std::make_shared<interface::OptimizerWrapper>(optimizer);
  }
  if (plugin_) {
    plugin_->configure(mw, optim_w);
  }
  if (mixed_precision_) {
    mixed_precision_->configure(mw, optim_w);
  }
  if (options_.retain_freed_memory()) {
    utils::retain_freed_host_memory();
  }
  return {mw, optim_w};
}

std::shared_ptr<lora::LoraModel> Booster::enable_lora_module(
    std::shared_ptr<torch::nn::Module> model,
    const std::string& pretrained_dir,
    const std::optional<lora::LoraConfig>& lora_config,
    const std::optional<quantization::BnbQuantizationConfig>& bnb_config,
    bool quantize) {
  TORCH_CHECK(model != nullptr, "Booster.enable_lora: the model is null");
  if (plugin_ != nullptr && !plugin_->support_lora()) {
    const std::string setting = plugin_->lora_refusal();
    TORCH_CHECK(
        false,
        "Booster.enable_lora: ",
        plugin_->name(),
        " does not support LoRA",
        quantize ? " or QLoRA" : "",
        setting.empty() ? std::string(
                              " (no plugin, TorchDDPPlugin, "
                              "LowLevelZeroPlugin and HybridParallelPlugin "
                              "at tp_size 1 and pp_size 1 do)")
                        : " with " + setting);
  }
  TORCH_CHECK(
      quantize || !bnb_config.has_value(),
      "Booster.enable_lora: a bnb_quantization_config is given but quantize "
      "is false; pass quantize=true to quantize the base (QLoRA)");
  // ColossalAI's default for quantize without a config.
  const auto qconfig =
      bnb_config.value_or(quantization::BnbQuantizationConfig()
                              .load_in_4bit(true)
                              .bnb_4bit_quant_type("nf4")
                              .bnb_4bit_use_double_quant(true)
                              .bnb_4bit_compute_dtype(at::kBFloat16));
  if (quantize) {
    // Before anything changes: a failed call leaves the model as it was.
    quantization::quantizable_modules(*model, qconfig);
  }
  TORCH_CHECK(
      !boosted_.count(model.get()),
      "Booster.enable_lora: the model is boosted already; enable LoRA "
      "before boost");
  TORCH_CHECK(
      !lora_.count(model.get()),
      "Booster.enable_lora: the model has LoRA adapters already");
  std::shared_ptr<lora::LoraModel> lora;
  if (pretrained_dir.empty()) {
    TORCH_CHECK(
        lora_config.has_value(),
        "Booster.enable_lora: pass a lora_config, or the pretrained_dir of a "
        "saved adapter");
    lora = std::make_shared<lora::LoraModel>(model, *lora_config);
  } else {
    TORCH_CHECK(
        !lora_config.has_value(),
        "Booster.enable_lora: with pretrained_dir the adapter's own "
        "adapter_config.json applies; pass no lora_config");
    lora = lora::LoraModel::from_pretrained(model, pretrained_dir);
  }
  if (quantize) {
    // After the adapters: they take the base's full-precision dtype.
    quantization::quantize_model(*model, qconfig);
  }
  lora_[model.get()] = lora;
  return lora;
}

void Booster::save_lora_as_pretrained(
    interface::ModelWrapper& model,
    const std::string& checkpoint,
    bool use_safetensors) {
  auto it = lora_.find(model.unwrap().get());
  TORCH_CHECK(
      it != lora_.end(),
      "Booster.save_lora_as_pretrained: the model has no LoRA adapters "
      "(call enable_lora before boost)");
  model.synchronize_weights(); // the adapters as the last step left them
  const bool distributed = distributed::is_initialized();
  std::string error;
  if (!distributed || distributed::get_rank() == 0) {
    try {
      it->second->save_pretrained(checkpoint, use_safetensors);
    } catch (const std::exception& e) {
      error = distributed::error_text(e);
    }
  }
  if (distributed) {
    // Every rank returns after the files exist, or fails with the writer.
    auto all =
        distributed::all_gather_bytes(error, *distributed::world_group());
    error = all.front();
  }
  TORCH_CHECK(error.empty(), error);
}

namespace detail {

uint64_t collectives_issued() {
  return distributed::detail::collectives_issued();
}

void after_raised_pass(const char* pass, uint64_t issued) {
  std::string cause;
  bool broken = false; // a DistributedError: nothing left to agree on
  try {
    throw;
  } catch (const distributed::DistributedError& e) {
    cause = distributed::error_text(e);
    broken = true;
  } catch (const std::exception& e) {
    cause = distributed::error_text(e);
  } catch (...) {
    cause = "an exception of unknown type";
  }
  const bool backward = std::string(pass) == "backward";
  if (backward) {
    distributed::GradBucketer::settle_raised_backward();
  }
  if (!broken && distributed::detail::collectives_issued() != issued) {
    distributed::detail::agree_after_raise(pass, cause);
  }
  if (backward) {
    distributed::GradBucketer::recover_raised_backward(cause, false);
  }
}

} // namespace detail

void Booster::backward(
    const at::Tensor& loss,
    interface::OptimizerWrapper& optimizer) {
  const uint64_t issued = detail::collectives_issued();
  try {
    optimizer.backward(loss);
  } catch (...) {
    detail::after_raised_pass("backward", issued);
    throw;
  }
}

pipeline::PipelineOutput Booster::execute_pipeline(
    const pipeline::DataIterator& data_iter,
    interface::ModelWrapper& model,
    const pipeline::PipelineCriterion& criterion,
    interface::OptimizerWrapper* optimizer,
    bool return_loss,
    bool return_outputs) {
  TORCH_CHECK(
      plugin_ != nullptr && plugin_->support_pipeline(),
      "Booster.execute_pipeline needs a plugin that runs pipelines "
      "(HybridParallelPlugin with pp_size > 1), got ",
      plugin_ ? plugin_->name() : std::string("no plugin"));
  TORCH_CHECK(data_iter != nullptr, "execute_pipeline: data_iter is empty");
  TORCH_CHECK(criterion != nullptr, "execute_pipeline: criterion is empty");
  const uint64_t issued = distributed::detail::operations_issued();
  try {
    return plugin_->execute_pipeline(
        data_iter, model, criterion, optimizer, return_loss, return_outputs);
  } catch (const distributed::DistributedError&) {
    throw;
  } catch (const std::exception& e) {
    // NOTE [A backward that raised on some ranks]: a raise before this step
    // sent or received anything (a bad batch, a misuse) leaves no peer
    // waiting; after, the stages cannot pair up again.
    if (distributed::detail::operations_issued() == issued) {
      throw;
    }
    distributed::detail::fail_after_raised_pipeline(distributed::error_text(e));
  }
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
