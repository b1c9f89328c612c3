#include "models/pretrained_internal.h"

#include "checkpoint_io/io_utils.h"

#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/quantization/quantize_model.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <sys/stat.h>

namespace colossalai {
namespace models {
namespace detail {

namespace cio = checkpoint_io;
namespace cd = checkpoint_io::detail;
using json = nlohmann::json;

std::string read_config_json(const std::string& dir) {
  const auto path = cd::join(dir, "config.json");
  std::ifstream in(path);
  TORCH_CHECK(
      in.good(),
      "from_pretrained: ",
      dir,
      " has no config.json (a directory written by transformers' "
      "save_pretrained is expected)");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

at::ScalarType config_dtype(const std::string& text) {
  const auto j = parse_json(text);
  std::string name;
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (j.contains(key) && j[key].is_string()) {
      name = j[key].get<std::string>();
      break;
    }
  }
  if (name.empty() || name == "auto" || name == "float32") {
    return at::kFloat;
  }
  if (name == "bfloat16") {
    return at::kBFloat16;
  }
  if (name == "float16") {
    return at::kHalf;
  }
  if (name == "float64") {
    return at::kDouble;
  }
  TORCH_CHECK(
      false,
      "from_pretrained: config.json's dtype '",
      name,
      "' is not a floating-point dtype this library loads (float32, "
      "bfloat16, float16, float64); pass FromPretrainedOptions().dtype(...)");
}

namespace {

// The weight files of `dir`, in transformers' order of preference.
std::vector<std::string> weight_files(const std::string& dir) {
  const std::vector<std::pair<std::string, bool>> candidates = {
      {"model.safetensors", false},
      {"model.safetensors.index.json", true},
      {"pytorch_model.bin", false},
      {"pytorch_model.bin.index.json", true}};
  for (const auto& c : candidates) {
    const auto path = cd::join(dir, c.first);
    if (!cd::exists(path)) {
      continue;
    }
    if (!c.second) {
      return {path};
    }
    std::vector<std::string> files;
    std::set<std::string> seen;
    for (const auto& kv : cd::read_index(path).weight_map) {
      if (seen.insert(kv.second).second) {
        files.push_back(cd::join(dir, kv.second));
      }
    }
    return files;
  }
  TORCH_CHECK(
      false,
      "from_pretrained: ",
      dir,
      " has no weights: expected model.safetensors, "
      "model.safetensors.index.json, pytorch_model.bin or "
      "pytorch_model.bin.index.json");
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

} // namespace

void load_pretrained_weights(
    torch::nn::Module& module,
    const std::string& dir,
    const KeyMap& map,
    bool strict) {
  std::map<std::string, at::Tensor> targets;
  for (const auto& kv : module.named_parameters(/*recurse=*/true)) {
    targets[kv.key()] = kv.value();
  }
  for (const auto& kv : module.named_buffers(/*recurse=*/true)) {
    targets[kv.key()] = kv.value();
  }
  std::set<std::string> loaded;
  std::vector<std::string> unexpected;
  torch::NoGradGuard no_grad;
  for (const auto& file : weight_files(dir)) {
    TORCH_CHECK(
        cd::exists(file),
        "from_pretrained: ",
        file,
        " is named by the index but missing");
    const auto state = ends_with(file, ".safetensors")
        ? cio::safetensors::load_file(file)
        : cio::load_bin(file);
    for (const auto& kv : state) {
      const auto name = map(kv.key());
      if (name.empty()) {
        continue;
      }
      auto it = targets.find(name);
      if (it == targets.end()) {
        unexpected.push_back(kv.key());
        continue;
      }
      auto& dst = it->second;
      const auto& src = kv.value();
      TORCH_CHECK(
          dst.sizes() == src.sizes(),
          "from_pretrained: ",
          file,
          ": '",
          kv.key(),
          "' has shape ",
          src.sizes(),
          " but the model built from config.json expects ",
          dst.sizes());
      TORCH_CHECK(
          at::isFloatingType(src.scalar_type()) ==
              at::isFloatingType(dst.scalar_type()),
          "from_pretrained: ",
          file,
          ": '",
          kv.key(),
          "' is ",
          src.scalar_type(),
          ", the model's tensor ",
          dst.scalar_type());
      dst.copy_(src);
      loaded.insert(name);
    }
  }
  if (!strict) {
    return;
  }
  TORCH_CHECK(
      unexpected.empty(),
      "from_pretrained: ",
      dir,
      " holds tensors the model does not have: ",
      list_some(unexpected),
      " (FromPretrainedOptions().strict(false) ignores them)");
  std::vector<std::string> missing;
  for (const auto& kv : targets) {
    if (!loaded.count(kv.first)) {
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
}

void write_config_json(const std::string& dir, const std::string& text) {
  ::mkdir(dir.c_str(), 0755);
  TORCH_CHECK(
      cd::is_dir(dir), "save_pretrained: cannot create the directory ", dir);
  std::vector<char> bytes(text.begin(), text.end());
  cd::atomic_write_file(
      cd::join(dir, "config.json"),
      [&](const std::string& tmp) { cd::write_bytes(tmp, bytes); });
}

namespace {

// Weights an earlier save_pretrained left in `dir` in another layout (one
// file, shards, the other format): transformers and from_pretrained would
// read a stale model.safetensors before new shards, so they go once the new
// files are in place.
void remove_stale_weights(
    const std::string& dir,
    const std::set<std::string>& written) {
  static const std::regex weights(
      "(model|pytorch_model)(-[0-9]{5}-of-[0-9]{5})?\\.(safetensors|bin)"
      "(\\.index\\.json)?");
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    if (e.is_regular_file() && std::regex_match(name, weights) &&
        !written.count(name)) {
      std::error_code ec;
      std::filesystem::remove(e.path(), ec);
    }
  }
}

} // namespace

void save_pretrained_module(
    torch::nn::Module& module,
    const std::string& config_json,
    const std::string& dir,
    const SavePretrainedOptions& options) {
  TORCH_CHECK(
      options.max_shard_size() > 0,
      "save_pretrained: max_shard_size must be positive, got ",
      options.max_shard_size());
  TORCH_CHECK(
      !colossalai::quantization::has_quantized_weights(module),
      "save_pretrained: the model's base weights are quantized (QLoRA); save "
      "the adapters (LoraModel::save_pretrained) and keep the full-precision "
      "directory the base was loaded from");
  write_config_json(dir, config_json);
  // Host copies, in the module's order; the weights are read once.
  cio::StateDict state;
  for (const auto& kv : cio::model_state_dict(module)) {
    state.insert(kv.key(), kv.value().detach().cpu().contiguous());
  }
  const bool safe = options.safe_serialization();
  const std::string base = safe ? "model.safetensors" : "pytorch_model.bin";
  // Greedy shards in order, as transformers cuts them.
  std::vector<cio::StateDict> shards(1);
  int64_t size = 0, total = 0;
  for (const auto& kv : state) {
    const int64_t n = cd::nbytes(kv.value());
    if (size > 0 && size + n > options.max_shard_size()) {
      shards.emplace_back();
      size = 0;
    }
    shards.back().insert(kv.key(), kv.value());
    size += n;
    total += n;
  }
  auto write = [&](const std::string& path, const cio::StateDict& part) {
    cd::atomic_write_file(path, [&](const std::string& tmp) {
      if (safe) {
        cio::safetensors::save_file(tmp, part, {{"format", "pt"}});
      } else {
        cio::save_bin(tmp, part);
      }
    });
  };
  std::set<std::string> written;
  if (shards.size() == 1) {
    write(cd::join(dir, base), shards[0]);
    written.insert(base);
  } else {
    cd::Index index;
    index.total_size = total;
    const int n = static_cast<int>(shards.size());
    for (int i = 0; i < n; ++i) {
      const auto name = cd::shard_name(base, i + 1, n);
      write(cd::join(dir, name), shards[i]);
      written.insert(name);
      for (const auto& kv : shards[i]) {
        index.weight_map.emplace_back(kv.key(), name);
      }
    }
    // Last: the index publishes the shards.
    cd::atomic_write_file(
        cd::join(dir, base + ".index.json"),
        [&](const std::string& tmp) { cd::write_index(tmp, index); });
    written.insert(base + ".index.json");
  }
  remove_stale_weights(dir, written);
}

nlohmann::json parse_json(const std::string& text) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "config.json is not valid JSON: ", e.what());
  }
}

std::string with_dtype(const std::string& config_json, torch::nn::Module& m) {
  auto j = parse_json(config_json);
  at::ScalarType t = at::kFloat;
  for (const auto& p : m.parameters()) {
    t = p.scalar_type();
    break;
  }
  j["dtype"] = t == at::kBFloat16 ? "bfloat16"
      : t == at::kHalf            ? "float16"
      : t == at::kDouble          ? "float64"
                                  : "float32";
  j.erase("torch_dtype");
  return j.dump(2) + "\n";
}

} // namespace detail

std::string pretrained_config_json(const std::string& dir) {
  return detail::read_config_json(dir);
}

std::string pretrained_model_type(const std::string& dir) {
  const auto j = nlohmann::json::parse(detail::read_config_json(dir));
  TORCH_CHECK(
      j.contains("model_type") && j["model_type"].is_string(),
      "from_pretrained: ",
      dir,
      "/config.json has no model_type");
  return j["model_type"].get<std::string>();
}

} // namespace models
} // namespace colossalai
