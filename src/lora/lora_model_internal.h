#pragma once

// What LoraModel's source files share (src/lora/lora_model*.cpp): one
// adapted layer, and PEFT's matching of module names (internal).

#include <colossalai/lora/lora_model.h>
#include <colossalai/shardformer/layer/parallel_module.h>

#include <string>
#include <unordered_set>
#include <vector>

namespace colossalai {
namespace lora {

namespace sl = shardformer::layer;

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

namespace detail {

/// The names PEFT's list form matches `name` by: the name itself and each
/// dotted suffix.
std::vector<std::string> suffixes(const std::string& name);

using NameSet = std::unordered_set<std::string>;

/// Whether PEFT's list form `names` selects the module `name`.
bool matches(const std::string& name, const NameSet& names);

NameSet name_set(const std::vector<std::string>& names);

/// What the config selects by (its regex, or its list), for errors.
std::string describe(const LoraConfig& c);

} // namespace detail

} // namespace lora
} // namespace colossalai
