#pragma once

/// bitsandbytes' quantization for QLoRA, on LibTorch tensors:
/// `BnbQuantizationConfig` (ColossalAI's, the fields of transformers'
/// BitsAndBytesConfig that QLoRA uses) and the blockwise 4-bit (NF4, FP4)
/// and 8-bit (dynamic map) quantizers the frozen base weights are stored
/// with: each block of `blocksize` values is scaled by its absolute maximum
/// and each scaled value stored as the index of a code value; 4-bit codes
/// are packed two per byte (first value in the high nibble), and double
/// quantization stores the absmax values themselves in 8 bits (blocks of
/// 256, less their mean).
///
/// The 4-bit quantizer picks what bitsandbytes' CPU path picks (the code
/// whose midpoints bracket the value, ties to the lower code), so packed
/// weights and absmax are bit-identical to `bitsandbytes.functional.
/// quantize_4bit`, and dequantized values to its reference kernel
/// (test_qlora; bitsandbytes 0.50.2's native CPU dequantizer returns wrong
/// values for some layouts and is not the reference). The 8-bit one picks
/// the nearest code;
/// bitsandbytes' native CPU kernel differs from nearest in about 0.1% of
/// near-ties, so double-quantized absmax values can differ from its by one
/// code step there.
///
/// Example:
/// \code
///   namespace q = colossalai::quantization;
///   auto [packed, state] = q::quantize_4bit(w, 64, "nf4",
///                                           /*compress_statistics=*/true);
///   at::Tensor w_hat = q::dequantize_4bit(packed, state); // w's shape, dtype
/// \endcode

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace colossalai {
namespace quantization {

/// ColossalAI's BnbQuantizationConfig: what `enable_lora(...,
/// bnb_quantization_config, quantize=true)` quantizes the frozen base with.
struct BnbQuantizationConfig {
  /// LLM.int8: 8-bit weights, activations above `llm_int8_threshold` kept
  /// in 16 bits.
  TORCH_ARG(bool, load_in_8bit) = false;
  TORCH_ARG(double, llm_int8_threshold) = 6.0;
  /// 4-bit blockwise weights (QLoRA).
  TORCH_ARG(bool, load_in_4bit) = false;
  /// "fp4" or "nf4" (NormalFloat, QLoRA's choice).
  TORCH_ARG(std::string, bnb_4bit_quant_type) = "fp4";
  /// Quantize the absmax values too (about 0.37 bits per parameter less).
  TORCH_ARG(bool, bnb_4bit_use_double_quant) = false;
  /// The dtype the dequantized weight is multiplied in.
  TORCH_ARG(at::ScalarType, bnb_4bit_compute_dtype) = at::kFloat;
  /// Modules (dotted-name suffixes) kept unquantized, e.g. the LM head.
  TORCH_ARG(std::vector<std::string>, skip_modules);
  /// Modules kept in fp32.
  TORCH_ARG(std::vector<std::string>, keep_in_fp32_modules);

 public:
  /// Errors name the field: exactly one of load_in_4bit / load_in_8bit, a
  /// known quant type, a floating compute dtype, a positive threshold.
  void validate() const;
};

/// How a 4-bit tensor was quantized: what dequantize_4bit needs.
struct QuantState4bit {
  /// Per block: the absmax (fp32), or with `nested` its 8-bit code (uint8)
  /// to be dequantized with `state2_*` and shifted by `offset`.
  at::Tensor absmax;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  int64_t blocksize = 64;
  std::string quant_type = "fp4";
  /// The 16 code values (nf4 or fp4 table).
  at::Tensor code;
  bool nested = false;
  at::Tensor offset;        ///< scalar fp32 (nested)
  at::Tensor state2_absmax; ///< per block of 256 absmax values (nested)
  at::Tensor state2_code;   ///< the 8-bit dynamic map (nested)
  int64_t state2_blocksize = 256;
};

/// bitsandbytes' 4-bit code tables ("nf4": NormalFloat quantiles; "fp4":
/// its 1-2-1 float format normalised to [-1, 1]), fp32 [16], in
/// bitsandbytes' index order.
at::Tensor code_4bit(const std::string& quant_type);

/// bitsandbytes' dynamic 8-bit map (create_dynamic_map), fp32 [256], sorted.
at::Tensor create_dynamic_map(
    bool is_signed = true,
    int64_t max_exponent_bits = 7,
    int64_t total_bits = 8);

/// Blockwise 4-bit quantization of `a` (any floating dtype): packed uint8
/// [ceil(numel / 2), 1] and its state. `blocksize` in {64, 128, ...} as
/// bitsandbytes takes it (positive here); `compress_statistics`: double
/// quantization of the absmax values.
std::pair<at::Tensor, QuantState4bit> quantize_4bit(
    const at::Tensor& a,
    int64_t blocksize = 64,
    const std::string& quant_type = "fp4",
    bool compress_statistics = false);

/// The dequantized tensor (state.shape, state.dtype). On the CPU one
/// parallel pass over the packed bytes; on a GPU one kernel
/// (src/kernels/dequantize_4bit.cu) where the build has CUDA kernels and
/// the dtype is float32, float16 or bfloat16; elsewhere ATen kernels. All
/// three give the same values (each formed in fp32, rounded once).
at::Tensor dequantize_4bit(
    const at::Tensor& packed,
    const QuantState4bit& state);
/// The same in `dtype` (each value formed in fp32 and rounded once, as
/// bitsandbytes dequantizes into the compute dtype).
at::Tensor dequantize_4bit(
    const at::Tensor& packed,
    const QuantState4bit& state,
    at::ScalarType dtype);

/// Blockwise 8-bit quantization with `code` (sorted, 256 values): uint8 of
/// `a`'s shape and fp32 absmax per block (nearest code; see above).
std::pair<at::Tensor, at::Tensor> quantize_blockwise(
    const at::Tensor& a,
    const at::Tensor& code,
    int64_t blocksize);
/// fp32 values of a quantize_blockwise result.
at::Tensor dequantize_blockwise(
    const at::Tensor& q,
    const at::Tensor& absmax,
    const at::Tensor& code,
    int64_t blocksize);

/// LLM.int8's row-wise quantization (bitsandbytes' int8_vectorwise_quant)
/// of a 2-d tensor, read in fp16 as bitsandbytes casts it.
struct Int8Rows {
  at::Tensor data;         ///< int8, a's shape: round(a * 127 / stats)
  at::Tensor stats;        ///< fp32 [rows]: each row's absmax
  at::Tensor outlier_cols; ///< int64: columns holding an outlier
};
/// With `threshold` > 0, elements with |a| >= threshold are outliers: left
/// out of the row absmax, and their whole columns are zero in `data`.
Int8Rows int8_vectorwise_quant(const at::Tensor& a, double threshold = 0.0);
/// fp32 values of int8 rows: q * stats / 127.
at::Tensor int8_vectorwise_dequant(
    const at::Tensor& q,
    const at::Tensor& stats);
/// LLM.int8 (bitsandbytes' MatMul8bitLt forward): x [..., in] times the
/// int8 weight (`cb` [out, in], row absmax `scb` [out]) transposed, plus
/// `bias` (may be undefined), in x's dtype. x's rows are quantized to int8
/// except the columns holding a value of magnitude >= `threshold` (0: none),
/// which multiply the dequantized weight columns in x's precision.
at::Tensor int8_linear(
    const at::Tensor& x,
    const at::Tensor& cb,
    const at::Tensor& scb,
    const at::Tensor& bias,
    double threshold);

/// NOTE [Few-row products on quantized weights]
/// A layer run on a few tokens (a generation step's one token per sequence)
/// is bound by reading its weight. Dequantizing first reads the packed
/// bytes, writes the whole weight in the compute dtype and reads it again:
/// 4.5 bytes per 4-bit parameter in bf16, 8.5 in fp32, against the 0.5 a
/// product reading the packed bytes moves. These two read them directly, a
/// few rows of x at a time; what they compute is the composition's result
/// up to the order of the sums (each weight value rounded exactly as the
/// dequantizer rounds it, fp32 sums). Training's token counts keep the
/// composition (dequantize, then one cuBLAS / BLAS matmul), as bitsandbytes
/// does: there the matmul's arithmetic outweighs the weight's bytes.

/// x W^T, x [..., in] floating, W the 4-bit weight [out, in] in `packed` /
/// `state`: [..., out] in x's dtype. Each weight value is what
/// dequantize_4bit(packed, state, x.scalar_type()) gives (the nested absmax
/// decoded on the way), each product summed in fp32 and each result
/// rounded once. On the CPU and on a GPU (built with CUDA kernels; fp32,
/// fp16, bf16) it reads the packed bytes directly, up to 8 rows of x per
/// pass over them; elsewhere it is at::linear of the dequantized weight.
/// Not differentiable: QuantizedWeight::linear's autograd Function is.
at::Tensor gemv_4bit(
    const at::Tensor& x,
    const at::Tensor& packed,
    const QuantState4bit& state);

/// a [m, k] int8 times b [n, k] int8 transposed in int32: [m, n]
/// (bitsandbytes' int8_linear_matmul). For up to 8 rows and k < 2^17 a pass
/// over b's bytes (CPU, or a GPU built with CUDA kernels), exact; else
/// through cuBLASLt where it takes the shapes (a GPU, m > 16), exact, or in
/// fp32, exact while k * 127^2 < 2^24.
at::Tensor int8_linear_matmul(const at::Tensor& a, const at::Tensor& b);

/// The rows of x at or below which the quantized layers (QuantizedWeight::
/// linear's forward, int8_linear) take the products above instead of
/// dequantizing; at most 8, 0 turns them off. Default 4: on one x86-64
/// core, at 1-4 rows of a 4096 x 4096 or 11008 x 4096 weight, they are
/// 1.01-4.9x (4-bit, fp32 compute) and 1.5-10.6x (int8) faster than
/// dequantize + matmul, at 8 rows 0.76-3.3x (bench_qlora's "few rows",
/// bench/results/2026-11-28-qlora-few-rows). On the CPU a 4-bit layer with
/// a 16-bit compute dtype keeps dequantize + matmul (0.71-0.97x there).
int64_t gemv_max_rows();
void set_gemv_max_rows(int64_t rows);

} // namespace quantization
} // namespace colossalai
