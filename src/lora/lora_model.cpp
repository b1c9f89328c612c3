// LoraModel: PEFT's adapters on a model's modules, their initialisation and
// training flags, and merging them into the base weights.

#include "lora_model_internal.h"

#include <colossalai/checkpoint_io/model_state_hooks.h>
#include <colossalai/quantization/fp8_linear.h>
#include <colossalai/quantization/quantize_model.h>
#include <colossalai/quantization/quantized_weight.h>

#include "../utils/bounded_read.h"

#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/init.h>

#include <cmath>
#include <set>

namespace colossalai {
namespace lora {

namespace cio = checkpoint_io;

namespace {

// PEFT's initialisation (LoraLayer.reset_lora_parameters).
void init_adapter(
    at::Tensor& A,
    at::Tensor& B,
    bool embedding,
    const std::string& how,
    int64_t r) {
  at::NoGradGuard no_grad;
  if (how == "none") { // nn.Linear's / nn.Embedding's own init for both
    if (embedding) {
      A.normal_();
      B.normal_();
    } else {
      torch::nn::init::kaiming_uniform_(A, std::sqrt(5.0));
      torch::nn::init::kaiming_uniform_(B, std::sqrt(5.0));
    }
    return;
  }
  if (embedding) {
    A.zero_();
    B.normal_();
    return;
  }
  if (how == "gaussian") {
    A.normal_(0.0, 1.0 / static_cast<double>(r));
  } else {
    torch::nn::init::kaiming_uniform_(A, std::sqrt(5.0));
  }
  B.zero_();
}

// A child module holding one parameter "weight" (PEFT's lora_A / lora_B
// are nn.Linear layers without bias).
std::shared_ptr<torch::nn::Module> weight_holder(const at::Tensor& w) {
  auto m = std::make_shared<torch::nn::Module>("LoraWeight");
  m->register_parameter("weight", w);
  return m;
}

// LoRA's part in checkpoints (NOTE [Model state hooks]): a base model's
// checkpoint has no adapters (PEFT's names) and still loads strictly into
// the model with adapters enabled, which keep their values.
void register_checkpoint_hooks() {
  static const bool registered = [] {
    cio::ModelStateHooks hooks;
    hooks.optional_key = [](const std::string& key) {
      for (const char* part : {".lora_A.",
                               ".lora_B.",
                               ".lora_embedding_A",
                               ".lora_embedding_B"}) {
        if (key.find(part) != std::string::npos) {
          return true;
        }
      }
      return false;
    };
    cio::register_model_state_hooks("lora", std::move(hooks));
    return true;
  }();
  (void)registered;
}

} // namespace

using detail::matches;
using detail::name_set;
using detail::suffixes;

LoraModel::LoraModel(
    std::shared_ptr<torch::nn::Module> model,
    LoraConfig config)
    : model_(std::move(model)), config_(std::move(config)) {
  TORCH_CHECK(model_ != nullptr, "LoraModel: the model is null");
  layers_ = plan(*model_, config_);
  register_checkpoint_hooks();
  for (const auto& layer : layers_) {
    auto* m = layer->module;
    // A copy: named_parameters() returns a temporary dict.
    const at::Tensor weight = m->named_parameters(false)["weight"];
    layer->base = weight;
    // A quantized base (QLoRA): the adapters in its full-precision dtype.
    const auto* quantized = quantization::quantized_weight_of(*m);
    const auto opts = weight.options().requires_grad(false).dtype(
        quantized ? quantized->dtype() : weight.scalar_type());
    layer->A = at::empty({config_.r(), layer->in}, opts);
    layer->B = at::empty({layer->out, config_.r()}, opts);
    init_adapter(
        layer->A,
        layer->B,
        layer->is_embedding(),
        config_.init_lora_weights(),
        config_.r());
    layer->A.requires_grad_(true);
    layer->B.requires_grad_(true);
    if (layer->is_embedding()) {
      m->register_parameter("lora_embedding_A", layer->A);
      m->register_parameter("lora_embedding_B", layer->B);
    } else {
      m->register_module("lora_A", weight_holder(layer->A));
      m->register_module("lora_B", weight_holder(layer->B));
    }
  }
  // Everything else is frozen, except the biases `bias` names and the
  // modules_to_save.
  std::set<const void*> trainable;
  for (const auto& l : layers_) {
    trainable.insert(l->A.unsafeGetTensorImpl());
    trainable.insert(l->B.unsafeGetTensorImpl());
    if (config_.bias() == "lora_only") {
      // find() points into the dict: keep it alive.
      const auto params = l->module->named_parameters(false);
      const auto* b = params.find("bias");
      if (b != nullptr && b->defined()) {
        trainable.insert(b->unsafeGetTensorImpl());
      }
    }
  }
  const auto to_save = name_set(config_.modules_to_save());
  auto unmatched = to_save;
  for (const auto& item : model_->named_modules("", /*include_self=*/false)) {
    if (matches(item.key(), to_save)) {
      for (const auto& p : item.value()->parameters()) {
        trainable.insert(p.unsafeGetTensorImpl());
      }
      for (const auto& s : suffixes(item.key())) {
        unmatched.erase(s);
      }
    }
  }
  for (const auto& t : config_.modules_to_save()) {
    TORCH_CHECK(
        !unmatched.count(t),
        "LoRA: modules_to_save entry '",
        utils::excerpt(t),
        "' matches no module of the model");
  }
  for (auto& item : model_->named_parameters()) {
    const bool bias_all =
        config_.bias() == "all" && item.key().find("bias") != std::string::npos;
    item.value().requires_grad_(
        trainable.count(item.value().unsafeGetTensorImpl()) > 0 || bias_all);
  }
  attach();
}

LoraModel::~LoraModel() = default;

void LoraModel::attach() {
  for (const auto& l : layers_) {
    if (l->kind == Layer::Kind::kAdapter) {
      // The module owns this function (and through it the Layer; the
      // Layer does not own the module).
      l->parallel->output_adapter = [l](const at::Tensor& x) {
        auto h = l->dropout > 0
            ? at::dropout(x, l->dropout, l->module->is_training())
            : x;
        // Inside a use_fp8 forward, through FP8 where the rank allows
        // (a multiple of 16).
        return quantization::linear(
                   quantization::linear(h, l->A, {}), l->B, {}) *
            l->scaling;
      };
      l->parallel->output_adapter_takes_cast = l->dropout == 0;
    }
  }
  refresh();
}

std::vector<std::string> LoraModel::adapted_modules() const {
  std::vector<std::string> out;
  for (const auto& l : layers_) {
    out.push_back(l->path);
  }
  return out;
}

std::vector<at::Tensor> LoraModel::trainable_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& p : model_->parameters()) {
    if (p.requires_grad()) {
      out.push_back(p);
    }
  }
  return out;
}

void LoraModel::refresh() {
  for (const auto& l : layers_) {
    if (l->member != nullptr) {
      *l->member = merged_ ? l->base : l->base + l->delta();
    }
  }
}

void LoraModel::merge() {
  TORCH_CHECK(!merged_, "LoRA: the adapters are merged already");
  for (const auto& l : layers_) {
    TORCH_CHECK(
        quantization::quantized_weight_of(*l->module) == nullptr,
        "LoRA: cannot merge into '",
        l->path,
        "', whose base weight is quantized (QLoRA); merge into the "
        "full-precision model loaded with the saved adapter instead");
  }
  {
    at::NoGradGuard no_grad;
    for (const auto& l : layers_) {
      l->base.add_(l->delta());
      if (l->parallel != nullptr) {
        l->parallel->output_adapter = nullptr;
        l->parallel->output_adapter_takes_cast = false;
      }
    }
  }
  merged_ = true;
  refresh();
}

void LoraModel::unmerge() {
  TORCH_CHECK(merged_, "LoRA: the adapters are not merged");
  {
    at::NoGradGuard no_grad;
    for (const auto& l : layers_) {
      l->base.sub_(l->delta());
    }
  }
  merged_ = false;
  attach();
}

} // namespace lora
} // namespace colossalai
