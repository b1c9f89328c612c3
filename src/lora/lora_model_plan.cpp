// Which modules a LoraConfig adapts: PEFT's target_modules (a list of name
// suffixes, or a regex) and LoraModel::plan, each layer's kind and shapes.

#include "lora_model_internal.h"

#include <colossalai/shardformer/layer/linear.h>

#include "../utils/bounded_read.h"
#include "module_regex.h"

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <optional>

namespace colossalai {
namespace lora {
namespace detail {

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

} // namespace detail

using detail::describe;
using detail::matches;
using detail::name_set;

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

} // namespace lora
} // namespace colossalai
