#pragma once

// What the families' from_pretrained / save_pretrained share: reading a
// Hugging Face directory's weights into a module under renamed keys, and
// writing a module's tensors as one file or shards plus an index.

#include <colossalai/models/pretrained.h>

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <functional>
#include <string>

namespace colossalai {
namespace models {
namespace detail {

/// config.json's text (throws naming the directory when absent).
std::string read_config_json(const std::string& dir);

/// The dtype config.json names (`dtype`, or `torch_dtype`), float32 when it
/// names none or "auto".
at::ScalarType config_dtype(const std::string& json);

/// Maps a checkpoint key to the module's name; "" skips the tensor.
using KeyMap = std::function<std::string(const std::string&)>;

/// Copies every tensor of `dir`'s weights (model.safetensors, the sharded
/// safetensors index, pytorch_model.bin or its index) into `module` under
/// `map`'s names, converting dtypes. With `strict`: unknown keys and module
/// tensors left unread are errors naming them.
void load_pretrained_weights(
    torch::nn::Module& module,
    const std::string& dir,
    const KeyMap& map,
    bool strict);

/// Writes `module`'s parameters and buffers (Hugging Face names) into
/// `dir` as transformers does, and `config_json` as config.json.
void save_pretrained_module(
    torch::nn::Module& module,
    const std::string& config_json,
    const std::string& dir,
    const SavePretrainedOptions& options);

/// Writes `dir`/config.json (creating `dir`), through a temporary file.
void write_config_json(const std::string& dir, const std::string& json);

inline bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
      s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// config.json's text parsed (an error says it is not JSON).
nlohmann::json parse_json(const std::string& text);

/// `j[key]` as T; `fallback` when absent or null (a wrong type is an error
/// naming the key).
template <class T>
T get_or(const nlohmann::json& j, const char* key, T fallback) {
  if (!j.contains(key) || j[key].is_null()) {
    return fallback;
  }
  try {
    return j[key].get<T>();
  } catch (const nlohmann::json::exception&) {
    TORCH_CHECK(
        false, "config.json: '", key, "' has the wrong type: ", j[key].dump());
  }
}

/// A field that changes the computation in a way this library does not
/// implement: refused (naming `family` and the field) unless absent, null or
/// `expected`.
template <class T>
void require(
    const nlohmann::json& j,
    const char* key,
    T expected,
    const char* family) {
  if (!j.contains(key) || j[key].is_null()) {
    return;
  }
  TORCH_CHECK(
      j[key] == nlohmann::json(expected),
      family,
      " config.json: ",
      key,
      " = ",
      j[key].dump(),
      " is not supported (only ",
      nlohmann::json(expected).dump(),
      ")");
}

/// `config_json` with "dtype" set to the module's parameter dtype, as
/// transformers writes it.
std::string with_dtype(const std::string& config_json, torch::nn::Module& m);

/// from_pretrained's steps: a model of `config`, in the dtype `options` or
/// config.json (`config_text`) ask for, holding `dir`'s weights under
/// `map`'s names.
template <class M, class Config>
M load_pretrained_model(
    const std::string& dir,
    const std::string& config_text,
    const Config& config,
    const FromPretrainedOptions& options,
    const KeyMap& map) {
  M model(config);
  model->to(options.dtype().value_or(config_dtype(config_text)));
  load_pretrained_weights(*model, dir, map, options.strict());
  return model;
}

/// save_pretrained's steps: config.json (with the model's dtype) and the
/// weights. `config_to_json` of the model's config is found by its type.
template <class M>
void save_pretrained_model(
    M& model,
    const std::string& dir,
    const SavePretrainedOptions& options) {
  save_pretrained_module(
      *model,
      with_dtype(config_to_json(model->config()), *model),
      dir,
      options);
}

} // namespace detail
} // namespace models
} // namespace colossalai
