#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/model_state_hooks.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/lora/lora_model.h>
#include <colossalai/quantization/quantize_model.h>
#include <colossalai/quantization/quantized_weight.h>
#include <colossalai/shardformer/layer/linear.h>

#include "../utils/bounded_read.h"
#include "module_regex.h"

#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <unordered_set>

namespace colossalai {
namespace lora {

namespace sl = shardformer::layer;
namespace cio = checkpoint_io;

struct LoraModel::Layer {
  enum class Kind { kAdapter, kLinear, kEmbedding };
  std::string path;
  torch::nn::Module* module = nullptr; // owned by the model
  Kind kind = Kind::kLinear;
  sl::ParallelModule* parallel = nullptr; // kAdapter
  at::Tensor* member = nullptr; // kLinear / kEmbedding: the forward's weight
  at::Tensor base;              // the frozen weight (the registered parameter)
  // PEFT's shapes: A [r, in], B [out, r]; an embedding's A [r, num], B
  // [dim, r].
  at::Tensor A, B;
  bool conv1d = false; // the weight is stored [in, out]
  int64_t in = 0, out = 0; // A [r, in], B [out, r]
  double scaling = 1.0;
  double dropout = 0.0;

  // s * B A in the weight's own layout.
  at::Tensor delta() const {
    auto d = at::matmul(B, A) * scaling;
    return kind == Kind::kEmbedding || conv1d ? d.t() : d;
  }
  bool is_embedding() const {
    return kind == Kind::kEmbedding;
  }
};

namespace {

constexpr const char* kPrefix = "base_model.model.";
constexpr const char* kConfigName = "adapter_config.json";
constexpr const char* kSafetensorsName = "adapter_model.safetensors";
constexpr const char* kBinName = "adapter_model.bin";
// PEFT writes a few hundred bytes; a config listing every module of a large
// model stays far below this.
constexpr uint64_t kMaxConfigBytes = uint64_t(16) << 20;

// The names PEFT's list form matches `name` by: the name itself and each
// dotted suffix ("h.0.attn.c_attn": "0.attn.c_attn", "attn.c_attn",
// "c_attn"). Looked up in a set, a list costs a lookup per suffix, not per
// entry. (A string is a regular expression for the whole name:
// detail::ModuleRegex.)
std::vector<std::string> suffixes(const std::string& name) {
  std::vector<std::string> out{name};
  for (size_t dot = name.find('.'); dot != std::string::npos;
       dot = name.find('.', dot + 1)) {
    out.push_back(name.substr(dot + 1));
  }
  return out;
}

using NameSet = std::unordered_set<std::string>;

bool matches(const std::string& name, const NameSet& names) {
  for (const auto& s : suffixes(name)) {
    if (names.count(s)) {
      return true;
    }
  }
  return false;
}

NameSet name_set(const std::vector<std::string>& names) {
  return NameSet(names.begin(), names.end());
}

std::string describe(const LoraConfig& c) {
  if (!c.target_modules_regex().empty()) {
    return "target_modules_regex '" + utils::excerpt(c.target_modules_regex()) +
        "'";
  }
  std::string out;
  for (size_t i = 0; i < c.target_modules().size() && out.size() < 200; ++i) {
    out += (i ? ", " : "") + c.target_modules()[i];
  }
  return "target_modules [" + utils::excerpt(out, 200) + "]";
}

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

std::vector<std::shared_ptr<LoraModel::Layer>> LoraModel::plan(
    torch::nn::Module& model,
    const LoraConfig& config) {
  config.validate();
  const double scaling = config.use_rslora()
      ? config.lora_alpha() / std::sqrt(static_cast<double>(config.r()))
      : config.lora_alpha() / static_cast<double>(config.r());
  std::optional<detail::ModuleRegex> regex;
  if (!config.target_modules_regex().empty()) {
    regex.emplace(config.target_modules_regex()); // validate() compiled it
  }
  const auto targets = name_set(config.target_modules());
  std::vector<std::shared_ptr<Layer>> layers;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto& name = item.key();
    if (regex ? !regex->fullmatch(name) : !matches(name, targets)) {
      continue;
    }
    auto* m = item.value().get();
    TORCH_CHECK(
        !m->named_children().contains("lora_A") &&
            !m->named_parameters(false).contains("lora_embedding_A"),
        "LoRA: module '",
        name,
        "' already has adapters (enable_lora once per model)");
    auto layer = std::make_shared<Layer>();
    layer->path = name;
    layer->module = m;
    layer->scaling = scaling;
    layer->dropout = config.lora_dropout();
    int64_t in = 0, out = 0;
    if (auto* lin = dynamic_cast<torch::nn::LinearImpl*>(m)) {
      layer->kind = Layer::Kind::kLinear;
      layer->member = &lin->weight;
      out = lin->weight.size(0);
      in = lin->weight.size(1);
    } else if (auto* emb = dynamic_cast<torch::nn::EmbeddingImpl*>(m)) {
      layer->kind = Layer::Kind::kEmbedding;
      layer->member = &emb->weight;
      in = emb->weight.size(0);  // A: [r, num_embeddings]
      out = emb->weight.size(1); // B: [embedding_dim, r]
    } else if (auto* col = dynamic_cast<sl::Linear1D_ColImpl*>(m)) {
      layer->kind = Layer::Kind::kAdapter;
      layer->parallel = col;
      layer->conv1d = col->options.conv1d_layout();
      in = col->options.in_features();
      out = col->options.out_features();
      TORCH_CHECK(
          col->group == nullptr || col->group->size() == 1,
          "LoRA: '",
          name,
          "' is split over a tensor-parallel group; LoRA adapters are not "
          "tensor-parallel (use tp_size 1)");
    } else if (auto* row = dynamic_cast<sl::Linear1D_RowImpl*>(m)) {
      layer->kind = Layer::Kind::kAdapter;
      layer->parallel = row;
      layer->conv1d = row->options.conv1d_layout();
      in = row->options.in_features();
      out = row->options.out_features();
      TORCH_CHECK(
          row->group == nullptr || row->group->size() == 1,
          "LoRA: '",
          name,
          "' is split over a tensor-parallel group; LoRA adapters are not "
          "tensor-parallel (use tp_size 1)");
    } else {
      TORCH_CHECK(
          false,
          "LoRA cannot adapt '",
          name,
          "' (",
          m->name(),
          "), which ",
          describe(config),
          " selects: supported are torch::nn::Linear, torch::nn::Embedding "
          "and colossalai's Linear1D_Col / Linear1D_Row");
    }
    TORCH_CHECK(
        layer->kind == Layer::Kind::kAdapter || config.lora_dropout() == 0.0,
        "LoRA: lora_dropout ",
        config.lora_dropout(),
        " needs a layer that runs the adapter path itself, but '",
        name,
        "' is a ",
        m->name(),
        ", adapted by reparametrising its weight (NOTE [LoRA in C++]); use "
        "lora_dropout(0), or build the model from colossalai's Linear1D "
        "layers");
    // Checked before anything is allocated: A is [r, in], B [out, r].
    TORCH_CHECK(
        config.r() <= std::min(in, out),
        "LoRA: r ",
        config.r(),
        " is above the rank of '",
        name,
        "' (",
        in,
        " -> ",
        out,
        "): B A has rank at most min(in, out) = ",
        std::min(in, out),
        ", so a larger r adds nothing but memory");
    layer->in = in;
    layer->out = out;
    layers.push_back(layer);
  }
  TORCH_CHECK(
      !layers.empty(),
      "LoRA: ",
      describe(config),
      " matches no module of the model");
  return layers;
}

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
        return at::linear(at::linear(h, l->A), l->B) * l->scaling;
      };
    }
  }
  refresh();
}

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
