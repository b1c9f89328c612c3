// from_pretrained's weights: the files' headers read and matched with the
// model's tensors before the model is allocated, then the copies.

#include "models/pretrained_internal.h"

#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/mapped_reads.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/lazy/lazy_init.h>

#include <algorithm>
#include <map>
#include <set>

namespace colossalai {
namespace models {
namespace detail {

namespace cio = checkpoint_io;
namespace cd = checkpoint_io::detail;

namespace {

// Every tensor of one weight file, as views of its mapping.
cio::StateDict open_file(const std::string& path) {
  return ends_with(path, ".safetensors") ? cio::safetensors::load_file(path)
                                         : cio::load_bin(path);
}

std::string list_some(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 5; ++i) {
    out += (i ? ", " : "") + names[i];
  }
  if (names.size() > 5) {
    out += ", ... (" + std::to_string(names.size()) + " in all)";
  }
  return out;
}

std::string shape_string(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return out + "]";
}

// A sharded checkpoint's tensors: each key the index names, from the shard
// it names.
CheckpointTensors open_sharded(
    const std::string& dir,
    const std::string& index) {
  std::map<std::string, std::vector<std::string>> keys_of; // shard -> keys
  for (const auto& kv : cd::read_index(index).weight_map) {
    keys_of[kv.second].push_back(kv.first);
  }
  CheckpointTensors out;
  for (const auto& shard : keys_of) {
    const auto file = cd::join(dir, shard.first);
    TORCH_CHECK(
        cd::exists(file),
        "from_pretrained: ",
        file,
        " is named by the index but missing");
    const auto state = open_file(file);
    for (const auto& key : shard.second) {
      if (const at::Tensor* t = state.find(key)) {
        out.tensors.push_back({key, file, *t});
      } else {
        out.unheld.push_back(key + " (" + shard.first + ")");
      }
    }
  }
  return out;
}

} // namespace

CheckpointTensors open_pretrained_weights(const std::string& dir) {
  for (const char* name : {"model.safetensors", "pytorch_model.bin"}) {
    const auto path = cd::join(dir, name);
    const auto index = path + ".index.json";
    if (cd::exists(path)) {
      CheckpointTensors out;
      for (const auto& kv : open_file(path)) {
        out.tensors.push_back({kv.key(), path, kv.value()});
      }
      return out;
    }
    if (cd::exists(index)) {
      return open_sharded(dir, index);
    }
  }
  TORCH_CHECK(
      false,
      "from_pretrained: ",
      dir,
      " has no weights: expected model.safetensors, "
      "model.safetensors.index.json, pytorch_model.bin or "
      "pytorch_model.bin.index.json");
}

TensorSpecs lazy_tensor_specs(
    const std::function<std::shared_ptr<torch::nn::Module>()>& build) {
  lazy::LazyInitContext context;
  // The probe's recording is dropped, whatever happens: nothing of it is
  // ever materialised.
  struct Discard {
    lazy::LazyInitContext& context;
    ~Discard() {
      context.discard();
    }
  } discard{context};
  const auto module = build();
  TensorSpecs specs;
  for (const auto& kv : module->named_parameters(/*recurse=*/true)) {
    specs[kv.key()] = {kv.value().sizes().vec(), kv.value().scalar_type()};
  }
  for (const auto& kv : module->named_buffers(/*recurse=*/true)) {
    specs[kv.key()] = {kv.value().sizes().vec(), kv.value().scalar_type()};
  }
  return specs;
}

void check_layer_count(
    const std::string& dir,
    const CheckpointTensors& weights,
    const LayerCount& layers) {
  // Up to this many, the lazy build is quick and the comparison of shapes
  // that follows it names a tensor, which says more.
  constexpr int64_t kQuickLayers = 256;
  const auto held = static_cast<int64_t>(weights.tensors.size());
  TORCH_CHECK(
      layers.value <= std::max(held, kQuickLayers),
      "from_pretrained: ",
      cd::join(dir, "config.json"),
      ": field '",
      layers.field,
      "' (",
      layers.value,
      ") asks for more layers than the weights hold tensors (",
      held,
      ")");
}

LoadPlan plan_pretrained_load(
    const std::string& dir,
    const CheckpointTensors& weights,
    const TensorSpecs& specs,
    const KeyMap& map,
    bool strict) {
  LoadPlan plan;
  std::map<std::string, std::string> source; // module name -> key
  std::vector<std::string> unexpected;
  for (const auto& t : weights.tensors) {
    const auto name = map(t.key);
    if (name.empty()) {
      continue;
    }
    const auto it = specs.find(name);
    if (it == specs.end()) {
      unexpected.push_back(t.key);
      continue;
    }
    const auto& shape = it->second.first;
    const auto dtype = it->second.second;
    TORCH_CHECK(
        t.value.sizes().vec() == shape,
        "from_pretrained: ",
        t.file,
        ": '",
        t.key,
        "' has shape ",
        shape_string(t.value.sizes()),
        " but the model built from config.json expects ",
        shape_string(shape));
    TORCH_CHECK(
        at::isFloatingType(t.value.scalar_type()) == at::isFloatingType(dtype),
        "from_pretrained: ",
        t.file,
        ": '",
        t.key,
        "' is ",
        t.value.scalar_type(),
        ", the model's tensor ",
        dtype);
    const auto seen = source.emplace(name, t.key);
    TORCH_CHECK(
        seen.second,
        "from_pretrained: ",
        dir,
        " holds '",
        name,
        "' twice (as '",
        seen.first->second,
        "' and '",
        t.key,
        "')");
    plan.emplace_back(name, t.value);
  }
  if (!strict) {
    return plan;
  }
  TORCH_CHECK(
      weights.unheld.empty(),
      "from_pretrained: ",
      dir,
      ": the index names tensors its shards do not hold: ",
      list_some(weights.unheld));
  TORCH_CHECK(
      unexpected.empty(),
      "from_pretrained: ",
      dir,
      " holds tensors the model does not have: ",
      list_some(unexpected),
      " (FromPretrainedOptions().strict(false) ignores them)");
  std::vector<std::string> missing;
  for (const auto& kv : specs) {
    if (!source.count(kv.first)) {
      missing.push_back(kv.first);
    }
  }
  TORCH_CHECK(
      missing.empty(),
      "from_pretrained: ",
      dir,
      " lacks tensors the model needs: ",
      list_some(missing),
      " (FromPretrainedOptions().strict(false) keeps their initial values)");
  return plan;
}

void load_planned_weights(
    torch::nn::Module& module,
    LoadPlan&& plan,
    at::ScalarType dtype) {
  std::map<std::string, at::Tensor> targets;
  for (const auto& kv : module.named_parameters(/*recurse=*/true)) {
    targets[kv.key()] = kv.value();
  }
  for (const auto& kv : module.named_buffers(/*recurse=*/true)) {
    targets[kv.key()] = kv.value();
  }
  torch::NoGradGuard no_grad;
  for (auto& kv : plan) {
    auto it = targets.find(kv.first);
    TORCH_INTERNAL_ASSERT(
        it != targets.end() && it->second.sizes() == kv.second.sizes(),
        "from_pretrained: the model differs from its lazy build at ",
        kv.first);
    auto& target = it->second;
    if (lazy::is_lazy(target)) {
      auto value = at::empty(kv.second.sizes(), at::dtype(dtype));
      cd::read_into(value, kv.second);
      lazy::install_lazy(target, value);
    } else {
      // Made eagerly by the constructor, or the other name of a tied
      // tensor already filled: cast below with the rest.
      cd::read_into(target, kv.second);
    }
    kv.second = at::Tensor();
  }
  // What the files did not fill (buffers, or tensors strict(false) let
  // lack): initialised as eager construction would, then cast. to() then
  // casts what the constructor made eagerly and leaves the rest.
  lazy::materialize(module, [dtype](const std::string&, const at::Tensor& t) {
    return t.to(dtype);
  });
  module.to(dtype);
}

} // namespace detail
} // namespace models
} // namespace colossalai
