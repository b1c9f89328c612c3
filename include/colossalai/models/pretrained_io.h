#pragma once

/// What from_pretrained / save_pretrained of every family share: their
/// options and the primary template (each family header declares its
/// specialization). See colossalai/models/pretrained.h.

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <cstdint>
#include <string>

namespace colossalai {
namespace models {

struct FromPretrainedOptions {
  /// The parameters' dtype; nullopt: config.json's `dtype` (`torch_dtype`
  /// before transformers 5), float32 where it names none.
  TORCH_ARG(c10::optional<at::ScalarType>, dtype) = c10::nullopt;
  /// Every parameter must be in the checkpoint and every checkpoint tensor
  /// must be a parameter (skipped buffers aside); false: missing ones keep
  /// their initial values and unknown ones are ignored.
  TORCH_ARG(bool, strict) = true;
};

struct SavePretrainedOptions {
  /// safetensors files; false: `pytorch_model.bin` (torch.save's format).
  TORCH_ARG(bool, safe_serialization) = true;
  /// Largest file in bytes: a larger model is written as numbered shards
  /// plus an index (transformers' default is 5 GB).
  TORCH_ARG(int64_t, max_shard_size) = int64_t(5) << 30;
};

/// The `model_type` of `dir`'s config.json ("gpt2", "llama", ...).
std::string pretrained_model_type(const std::string& dir);
/// The text of `dir`'s config.json, for a family's `*_config_from_json`
/// (to build a model to boost before loading `dir` with the booster).
std::string pretrained_config_json(const std::string& dir);

/// Builds the model `dir`'s config.json describes and loads its weights.
template <class M>
M from_pretrained(
    const std::string& dir,
    const FromPretrainedOptions& options = FromPretrainedOptions());

} // namespace models
} // namespace colossalai
