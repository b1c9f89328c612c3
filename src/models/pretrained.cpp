#include "models/pretrained_internal.h"

#include "utils/bounded_json.h"

#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/model_state_hooks.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/models/bert.h>
#include <colossalai/models/bloom.h>
#include <colossalai/models/opt.h>
#include <colossalai/quantization/quantize_model.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <regex>
#include <set>
#include <sys/stat.h>

namespace colossalai {
namespace models {
namespace detail {

namespace cio = checkpoint_io;
namespace cd = checkpoint_io::detail;
using json = nlohmann::json;

namespace {

// transformers' GenerationConfig.from_model_config: the config's special
// token ids that are set; empty when none is (nothing known to generate
// with).
std::string generation_config_json(const std::string& config_json) {
  const auto config = json::parse(config_json);
  json out = {{"_from_model_config", true}};
  bool any = false;
  for (const char* key :
       {"bos_token_id", "eos_token_id", "pad_token_id",
        "decoder_start_token_id"}) {
    auto it = config.find(key);
    if (it != config.end() && !it->is_null()) {
      out[key] = *it;
      any = true;
    }
  }
  if (!any) {
    return "";
  }
  auto version = config.find("transformers_version");
  if (version != config.end()) {
    out["transformers_version"] = *version;
  }
  return out.dump(2) + "\n";
}

} // namespace

void register_checkpoint_hooks() {
  static const bool registered = [] {
    cio::ModelStateHooks hooks;
    // transformers' tie_weights(): the head's weight is the input
    // embedding's (BERT's decoder bias is cls.predictions.bias too).
    hooks.tied_keys =
        [](torch::nn::Module& m) -> std::map<std::string, std::string> {
      if (dynamic_cast<GPT2LMHeadModelImpl*>(&m) != nullptr) {
        return {{"lm_head.weight", "transformer.wte.weight"}};
      }
      if (auto* l = dynamic_cast<LlamaForCausalLMImpl*>(&m)) {
        if (l->config().tie_word_embeddings()) {
          return {{"lm_head.weight", "model.embed_tokens.weight"}};
        }
        return {};
      }
      if (dynamic_cast<OPTForCausalLMImpl*>(&m) != nullptr) {
        return {{"lm_head.weight", "model.decoder.embed_tokens.weight"}};
      }
      if (dynamic_cast<BloomForCausalLMImpl*>(&m) != nullptr) {
        return {{"lm_head.weight", "transformer.word_embeddings.weight"}};
      }
      if (dynamic_cast<BertForMaskedLMImpl*>(&m) != nullptr) {
        return {
            {"cls.predictions.decoder.weight",
             "bert.embeddings.word_embeddings.weight"},
            {"cls.predictions.decoder.bias", "cls.predictions.bias"}};
      }
      return {};
    };
    // config.json as save_pretrained writes it, and generation_config.json
    // for the causal families, as ColossalAI's sharded save writes them.
    hooks.config_files =
        [](torch::nn::Module& m) -> std::map<std::string, std::string> {
      std::string config;
      bool generates = true;
      if (auto* g = dynamic_cast<GPT2LMHeadModelImpl*>(&m)) {
        config = config_to_json(g->config());
      } else if (auto* l = dynamic_cast<LlamaForCausalLMImpl*>(&m)) {
        config = config_to_json(l->config());
      } else if (auto* o = dynamic_cast<OPTForCausalLMImpl*>(&m)) {
        config = config_to_json(o->config());
      } else if (auto* b = dynamic_cast<BloomForCausalLMImpl*>(&m)) {
        config = config_to_json(b->config());
      } else if (auto* b = dynamic_cast<BertForMaskedLMImpl*>(&m)) {
        config = config_to_json(b->config());
        generates = false;
      } else {
        return {};
      }
      config = with_dtype(config, m);
      std::map<std::string, std::string> out{{"config.json", config}};
      const auto generation = generation_config_json(config);
      if (generates && !generation.empty()) {
        out.emplace("generation_config.json", generation);
      }
      return out;
    };
    cio::register_model_state_hooks("model families", std::move(hooks));
    return true;
  }();
  (void)registered;
}

std::string read_config_json(const std::string& dir) {
  const auto path = cd::join(dir, "config.json");
  TORCH_CHECK(
      cd::exists(path),
      "from_pretrained: ",
      dir,
      " has no config.json (a directory written by transformers' "
      "save_pretrained is expected)");
  const auto bytes = cd::read_bytes(path, cd::kMaxJsonFileBytes, "config.json");
  return std::string(bytes.begin(), bytes.end());
}

void rethrow_naming_config(const std::string& dir, const c10::Error& e) {
  static const std::string kFile = "config.json";
  const auto& msg = e.msg();
  const auto path = cd::join(dir, kFile);
  if (starts_with(msg, kFile)) {
    TORCH_CHECK(false, "from_pretrained: ", path, msg.substr(kFile.size()));
  }
  TORCH_CHECK(false, "from_pretrained: ", path, ": ", msg);
}

at::ScalarType config_dtype(const std::string& text) {
  const ConfigFields f(text);
  // transformers 5 writes dtype, earlier versions torch_dtype.
  const char* key = f.has("dtype") ? "dtype" : "torch_dtype";
  const auto name = f.string(key, "float32");
  if (name != "auto" && name != "float32" && name != "bfloat16" &&
      name != "float16" && name != "float64") {
    f.fail(
        key,
        "is " + utils::json_excerpt(json(name)) +
            ", not a floating-point dtype this library loads (float32, "
            "bfloat16, float16, float64); pass "
            "FromPretrainedOptions().dtype(...)");
  }
  return name == "bfloat16" ? at::kBFloat16
      : name == "float16"   ? at::kHalf
      : name == "float64"   ? at::kDouble
                            : at::kFloat;
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

nlohmann::json source_fields(const std::string& source_json) {
  return source_json.empty()
      ? json::object()
      : utils::parse_bounded_json<json>(source_json, "config.json");
}

std::string with_dtype(const std::string& config_json, torch::nn::Module& m) {
  auto j = source_fields(config_json);
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
  const auto text = detail::read_config_json(dir);
  try {
    const detail::ConfigFields f(text);
    if (!f.has("model_type")) {
      f.fail("model_type", "is missing");
    }
    return f.string("model_type", "");
  } catch (const c10::Error& e) {
    detail::rethrow_naming_config(dir, e);
  }
}

} // namespace models
} // namespace colossalai
