// LoraModel's files, PEFT's adapter directory: from_pretrained,
// adapter_config.json and adapter_model.safetensors / .bin, the adapter
// state dict.

#include "lora_model_internal.h"

#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>

#include "../utils/bounded_read.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <filesystem>
#include <map>
#include <set>

namespace colossalai {
namespace lora {

namespace cio = checkpoint_io;

namespace {

constexpr const char* kPrefix = "base_model.model.";
constexpr const char* kConfigName = "adapter_config.json";
constexpr const char* kSafetensorsName = "adapter_model.safetensors";
constexpr const char* kBinName = "adapter_model.bin";
// PEFT writes a few hundred bytes; a config listing every module of a large
// model stays far below this.
constexpr uint64_t kMaxConfigBytes = uint64_t(16) << 20;

} // namespace

using detail::describe;
using detail::matches;
using detail::name_set;

std::shared_ptr<LoraModel> LoraModel::from_pretrained(
    std::shared_ptr<torch::nn::Module> model,
    const std::string& dir) {
  TORCH_CHECK(model != nullptr, "LoraModel: the model is null");
  const auto config_path = cio::detail::join(dir, kConfigName);
  TORCH_CHECK(
      cio::detail::exists(config_path),
      "LoRA: '",
      dir,
      "' has no ",
      kConfigName,
      " (not a PEFT adapter directory)");
  std::string text;
  const auto why =
      utils::read_regular_file(config_path, kMaxConfigBytes, text);
  TORCH_CHECK(why.empty(), "LoRA: '", config_path, "' ", why);
  auto config = LoraConfig::from_json(text, config_path);
  const auto st = cio::detail::join(dir, kSafetensorsName);
  const auto bin = cio::detail::join(dir, kBinName);
  TORCH_CHECK(
      cio::detail::exists(st) || cio::detail::exists(bin),
      "LoRA: '",
      dir,
      "' has neither ",
      kSafetensorsName,
      " nor ",
      kBinName);
  const bool use_st = cio::detail::exists(st);
  const auto& weights = use_st ? st : bin;
  const auto not_regular = utils::regular_file_error(weights);
  TORCH_CHECK(not_regular.empty(), "LoRA: '", weights, "' ", not_regular);
  // The file's shapes against the config's before the adapters are
  // allocated: a config's r does not allocate what its file does not hold.
  cio::StateDict state;
  std::shared_ptr<cio::safetensors::MappedFile> mapped;
  std::map<std::string, std::vector<int64_t>> shapes;
  if (use_st) {
    mapped = cio::safetensors::MappedFile::open(st);
    for (const auto& t : mapped->header().tensors) {
      shapes[t.name] = t.shape;
    }
  } else {
    state = cio::load_bin(bin);
    for (const auto& item : state) {
      shapes[item.key()] = item.value().sizes().vec();
    }
  }
  for (const auto& l : plan(*model, config)) {
    const std::string p = kPrefix + l->path;
    const auto names = l->is_embedding()
        ? std::make_pair(p + ".lora_embedding_A", p + ".lora_embedding_B")
        : std::make_pair(p + ".lora_A.weight", p + ".lora_B.weight");
    const std::vector<int64_t> want_a{config.r(), l->in},
        want_b{l->out, config.r()};
    for (const auto& [name, want] :
         {std::make_pair(names.first, want_a),
          std::make_pair(names.second, want_b)}) {
      const auto it = shapes.find(name);
      TORCH_CHECK(
          it != shapes.end(),
          "LoRA: '",
          weights,
          "' lacks the adapter tensor '",
          name,
          "'");
      TORCH_CHECK(
          it->second == want,
          "LoRA: '",
          weights,
          "': '",
          name,
          "' has shape ",
          c10::IntArrayRef(it->second),
          ", but ",
          kConfigName,
          " (r ",
          config.r(),
          ") and the model's layer make ",
          c10::IntArrayRef(want),
          " (another r or another base model?)");
    }
  }
  auto lora = std::make_shared<LoraModel>(std::move(model), std::move(config));
  lora->load_adapter_state_dict(use_st ? mapped->tensors() : state, weights);
  return lora;
}

cio::StateDict LoraModel::adapter_state_dict() const {
  cio::StateDict out;
  const std::string prefix = kPrefix;
  for (const auto& l : layers_) {
    const auto p = prefix + l->path;
    if (l->is_embedding()) {
      out.insert(p + ".lora_embedding_A", l->A);
      out.insert(p + ".lora_embedding_B", l->B);
    } else {
      out.insert(p + ".lora_A.weight", l->A);
      out.insert(p + ".lora_B.weight", l->B);
    }
  }
  std::set<std::string> seen;
  for (const auto& item : out) {
    seen.insert(item.key());
  }
  auto add = [&](const std::string& name, const at::Tensor& t) {
    if (seen.insert(prefix + name).second) {
      out.insert(prefix + name, t);
    }
  };
  if (config_.bias() == "all") {
    for (const auto& item : model_->named_parameters()) {
      if (item.key().find("bias") != std::string::npos) {
        add(item.key(), item.value());
      }
    }
  } else if (config_.bias() == "lora_only") {
    for (const auto& l : layers_) {
      const auto params = l->module->named_parameters(false);
      const auto* b = params.find("bias");
      if (b != nullptr && b->defined()) {
        add(l->path + ".bias", *b);
      }
    }
  }
  if (!config_.modules_to_save().empty()) {
    const auto to_save = name_set(config_.modules_to_save());
    for (const auto& item : model_->named_modules("", false)) {
      if (matches(item.key(), to_save)) {
        for (const auto& p : item.value()->named_parameters()) {
          add(item.key() + "." + p.key(), p.value());
        }
      }
    }
  }
  return out;
}

void LoraModel::load_adapter_state_dict(
    const cio::StateDict& state,
    const std::string& file) {
  auto targets = adapter_state_dict();
  for (const auto& item : state) {
    TORCH_CHECK(
        targets.contains(item.key()),
        "LoRA: '",
        file,
        "' holds '",
        item.key(),
        "', which this model's adapter (",
        describe(config_),
        ") does not have");
  }
  at::NoGradGuard no_grad;
  for (auto& item : targets) {
    const auto* src = state.find(item.key());
    TORCH_CHECK(
        src != nullptr,
        "LoRA: '",
        file,
        "' lacks the adapter tensor '",
        item.key(),
        "'");
    TORCH_CHECK(
        src->sizes() == item.value().sizes(),
        "LoRA: '",
        file,
        "': '",
        item.key(),
        "' has shape ",
        src->sizes(),
        ", the model's adapter has ",
        item.value().sizes(),
        " (another r or another base model?)");
    item.value().copy_(*src);
  }
  refresh();
}

void LoraModel::save_pretrained(const std::string& dir, bool use_safetensors)
    const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(
      cio::detail::is_dir(dir),
      "save_lora_as_pretrained: cannot create directory '",
      dir,
      "': ",
      ec.message());
  cio::StateDict state;
  for (const auto& item : adapter_state_dict()) {
    state.insert(item.key(), item.value().detach().cpu().contiguous().clone());
  }
  auto config = config_;
  for (const auto& l : layers_) {
    config.fan_in_fan_out(config.fan_in_fan_out() || l->conv1d);
  }
  const auto text = config.to_json();
  cio::detail::atomic_write_file(
      cio::detail::join(dir, kConfigName), [&](const std::string& tmp) {
        cio::detail::write_bytes(
            tmp, std::vector<char>(text.begin(), text.end()));
      });
  cio::detail::atomic_write_file(
      cio::detail::join(dir, use_safetensors ? kSafetensorsName : kBinName),
      [&](const std::string& tmp) {
        if (use_safetensors) {
          cio::safetensors::save_file(tmp, state, {{"format", "pt"}});
        } else {
          cio::save_bin(tmp, state);
        }
      });
}

} // namespace lora
} // namespace colossalai
