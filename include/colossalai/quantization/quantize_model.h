#pragma once

/// Quantizing a model's frozen base for QLoRA (ColossalAI's
/// `quantize_model`, which `booster.enable_lora(..., quantize=true)` runs
/// after injecting the adapters). See NOTE [QLoRA in C++].
///
/// Example:
/// \code
///   namespace q = colossalai::quantization;
///   auto names = q::quantize_model(*model, q::BnbQuantizationConfig()
///       .load_in_4bit(true).bnb_4bit_quant_type("nf4"));
///   auto f = q::quantized_footprint(*model); // f.bytes_per_param() ~ 0.53
/// \endcode

#include <colossalai/quantization/bnb.h>

#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace colossalai {
namespace quantization {

/// Quantizes, in place, every linear layer of `model` built from
/// shardformer::layer::Linear1D_Col / Linear1D_Row, except those that
/// `config.skip_modules()` or `keep_in_fp32_modules()` name (a module's
/// dotted name, its last components, or a module containing it). Empty
/// skip_modules: the output layer "lm_head" stays in full precision, as
/// transformers keeps it. Returns the quantized layers' names in model
/// order; an error if the config is invalid, nothing is left to quantize or
/// a layer cannot be (tensor-parallel), with every layer checked before the
/// first changes.
std::vector<std::string> quantize_model(
    torch::nn::Module& model,
    const BnbQuantizationConfig& config);

/// The layers quantize_model would quantize, with its errors (an invalid
/// config, nothing to quantize, a tensor-parallel layer) and nothing
/// changed: enable_lora checks this before it injects the adapters.
std::vector<std::string> quantizable_modules(
    torch::nn::Module& model,
    const BnbQuantizationConfig& config);

class QuantizedWeight;

/// The quantized weight of a Linear1D_Col / Linear1D_Row module (QLoRA),
/// or null (another module, or a full-precision one).
const QuantizedWeight* quantized_weight_of(const torch::nn::Module& module);

/// Whether `model` has quantized layers.
bool has_quantized_weights(torch::nn::Module& model);

/// The memory of a model's quantized weights.
struct QuantizedFootprint {
  int64_t params = 0;      ///< full-precision parameters they replace
  int64_t data_bytes = 0;  ///< packed codes / int8 rows
  int64_t state_bytes = 0; ///< absmax, nested state, row scales
  double bytes_per_param() const {
    return params == 0 ? 0.0
                       : static_cast<double>(data_bytes + state_bytes) /
            static_cast<double>(params);
  }
};
QuantizedFootprint quantized_footprint(torch::nn::Module& model);

} // namespace quantization
} // namespace colossalai
