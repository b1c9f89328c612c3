#pragma once

/// The frozen weight of a quantized linear layer, kept as bitsandbytes'
/// Linear4bit / Linear8bitLt keep it (QLoRA's base). The layer's `weight`
/// parameter holds the stored data, frozen: 4-bit, the packed codes (uint8
/// [ceil(out * in / 2), 1]); 8-bit, the int8 rows [out, in]. This object
/// holds the rest (absmax per block, or per row) and multiplies.
///
/// NOTE [QLoRA in C++]
/// Weights are quantized in place, in the layers the models are built of
/// (shardformer::layer::Linear1D_Col / Row), after LoRA put its adapters
/// beside them: the full-precision weight's memory is released, the forward
/// dequantizes it into a temporary (4-bit, in bnb_4bit_compute_dtype) or
/// runs LLM.int8 (8-bit), and the backward dequantizes again to give the
/// input's gradient, so no full-precision weight outlives a forward. Only
/// the adapters train. The layer's `to(dtype)` leaves the stored data
/// alone (a plugin casting the model to bf16 casts the adapters and biases).
/// Plugins broadcast parameters, not this state: every rank quantizes the
/// same full-precision weights (one checkpoint) and so holds the same bits.
/// On the CPU the 4-bit weight is dequantized in one parallel pass over
/// the packed bytes, on a GPU by one kernel; a forward of a few tokens
/// (a generation step) reads the packed bytes directly instead (NOTE
/// [Few-row products on quantized weights]).
///
/// Example:
/// \code
///   namespace q = colossalai::quantization;
///   auto cfg = q::BnbQuantizationConfig().load_in_4bit(true)
///                  .bnb_4bit_quant_type("nf4").bnb_4bit_use_double_quant(true);
///   auto [data, w] = q::QuantizedWeight::quantize(full_weight, cfg);
///   at::Tensor y = w->linear(x, data); // x full_weight^T, within 4 bits
/// \endcode

#include <colossalai/quantization/bnb.h>

#include <ATen/core/Tensor.h>

#include <memory>
#include <utility>
#include <vector>

namespace colossalai {
namespace quantization {

class QuantizedWeight : public std::enable_shared_from_this<QuantizedWeight> {
 public:
  /// Quantizes `weight` ([out, in], any floating dtype) as `config` says
  /// (validated): the data for the layer's parameter, and the state.
  static std::pair<at::Tensor, std::shared_ptr<QuantizedWeight>> quantize(
      const at::Tensor& weight,
      const BnbQuantizationConfig& config);

  /// The weight [out, in] in `dtype` (undefined: its dtype before
  /// quantization), from the stored `data`.
  at::Tensor dequantize(
      const at::Tensor& data,
      c10::optional<at::ScalarType> dtype = c10::nullopt) const;

  /// x W^T in x's dtype, x [..., in]: 4-bit, x cast to the compute dtype
  /// times the dequantized weight; 8-bit, LLM.int8 with the outlier
  /// threshold (bitsandbytes' MatMul8bitLt). Differentiable in x only.
  at::Tensor linear(const at::Tensor& x, const at::Tensor& data) const;

  /// Moves the state to `device` (the layer's `to` calls it).
  void to(const at::Device& device);

  bool is_4bit() const {
    return config_.load_in_4bit();
  }
  /// [out, in].
  const std::vector<int64_t>& shape() const {
    return shape_;
  }
  /// The weight's dtype before quantization.
  at::ScalarType dtype() const {
    return dtype_;
  }
  const BnbQuantizationConfig& config() const {
    return config_;
  }
  /// 4-bit: the blockwise state.
  const QuantState4bit& state_4bit() const {
    return state4_;
  }
  /// 8-bit: each row's absmax (fp32 [out]).
  const at::Tensor& scb() const {
    return scb_;
  }
  /// Bytes of the state beside the stored data.
  int64_t state_nbytes() const;

 private:
  BnbQuantizationConfig config_;
  std::vector<int64_t> shape_;
  at::ScalarType dtype_ = at::kFloat;
  QuantState4bit state4_;
  at::Tensor scb_;
};

} // namespace quantization
} // namespace colossalai
