#pragma once

/// Tensor-parallel linear layers (ColossalAI's `shardformer.layer`, after
/// Megatron-LM): `Linear1D_Col` splits the output features over the group,
/// `Linear1D_Row` the input features. A column layer followed by a row layer
/// needs one all-reduce in forward (after the row layer) and one in backward
/// (before the column layer), through the autograd collectives of
/// colossalai/distributed/functional.h.
///
/// Example (an MLP sharded from a full one):
/// \code
///   using namespace colossalai::shardformer::layer;
///   Linear1D_Col fc(Linear1D_ColImpl::from_full(*full_fc, tp)); // out / tp
///   Linear1D_Row proj(Linear1D_RowImpl::from_full(*full_proj, tp)); // in / tp
///   auto y = proj(at::gelu(fc(x))); // equals full_proj(gelu(full_fc(x)))
///   // A Hugging Face GPT-2 Conv1D stores [in, out]: pass its transpose.
///   auto c_fc = Linear1D_ColImpl::from_full(conv_weight.t(), conv_bias, tp);
/// \endcode

#include <colossalai/amp/shared_cast.h>
#include <colossalai/distributed/process_group.h>
#include <colossalai/shardformer/layer/parallel_module.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace quantization {
struct BnbQuantizationConfig;
class QuantizedWeight;
} // namespace quantization
namespace shardformer {
namespace layer {

struct Linear1DOptions {
  Linear1DOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// The full (unsharded) sizes.
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// Column layer: all-gather the output features (false: each rank keeps
  /// its out_features / tp slice, for a row layer or a parallel loss next).
  TORCH_ARG(bool, gather_output) = false;
  /// Row layer: the input already holds this rank's in_features / tp slice
  /// (the output of a column layer); false: the full input is split here.
  TORCH_ARG(bool, parallel_input) = true;
  /// Sequence parallelism (split_gather): the column layer's input and the
  /// row layer's output are split along `seq_dim` over the group, so
  /// activations between blocks are not replicated; the all-reduces become
  /// an all-gather (column) and a reduce-scatter (row).
  TORCH_ARG(bool, seq_parallel) = false;
  TORCH_ARG(int64_t, seq_dim) = 1;
  /// With seq_parallel: the all-gather (column) and reduce-scatter (row)
  /// run chunk by chunk around a ring, each chunk's matmul overlapping the
  /// next hop (sequence_parallelism_mode "ring"). The same bytes and
  /// results as split_gather up to summation order. A column layer then
  /// gathers inside its matmul: prepare_input is the identity and layers
  /// sharing an input each gather it.
  TORCH_ARG(bool, ring) = false;
  /// With seq_parallel (not ring): a column layer's backward starts the
  /// input gradient's reduce-scatter before it computes its weight
  /// gradient, which then runs while the sum travels (ColossalAI's
  /// enable_sequence_overlap; NOTE [Sequence overlap]). Layers that read
  /// one input overlap together through forward_shared_input, with one
  /// gather and one reduce-scatter. A layer with an adapter, a quantized
  /// weight, gather_output, fp8_communication or inside a use_fp8 forward
  /// gathers as split_gather does.
  TORCH_ARG(bool, overlap) = false;
  /// Column layer: the output features are this many equal sections (a
  /// fused q, k, v projection: 3), each split over the group separately
  /// (ColossalAI's FusedLinear1D_Col).
  TORCH_ARG(int64_t, fused_sections) = 1;
  /// The weight is stored [in_features, out_features], as Hugging Face
  /// GPT-2's Conv1D stores it, so its checkpoints load unchanged.
  TORCH_ARG(bool, conv1d_layout) = false;
  /// The tensor-parallel group; null: not sharded (a plain Linear).
  TORCH_ARG(distributed::ProcessGroupPtr, process_group) = nullptr;
};

/// y = x A^T + b with A's rows (output features) split over the group:
/// rank r holds rows [r * out / tp, (r + 1) * out / tp) and the same slice
/// of b. The input is replicated; its gradient is summed over the group.
class Linear1D_ColImpl : public torch::nn::Cloneable<Linear1D_ColImpl>,
                         public ParallelModule {
 public:
  explicit Linear1D_ColImpl(Linear1DOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);

  /// The input as every rank's shard reads it: copied to the group (its
  /// gradient summed over the group in backward) or, with seq_parallel,
  /// gathered along the sequence. Layers that read one input (q, k and v;
  /// gate and up) share it: `prepare_input` once, then `forward_prepared`
  /// on each, so backward sums (or reduce-scatters) once, not once per
  /// layer. `forward(x)` is `forward_prepared(prepare_input(x))`.
  /// \code
  ///   auto xin = q_proj->prepare_input(x);
  ///   auto q = q_proj->forward_prepared(xin), k =
  ///   k_proj->forward_prepared(xin);
  /// \endcode
  at::Tensor prepare_input(const at::Tensor& input) const;
  at::Tensor forward_prepared(const at::Tensor& prepared);
  /// prepare_input for the layers that share it, cast once under autocast
  /// (amp::SharedCast: one 16-bit copy kept for all of them, not one each).
  /// \code
  ///   const auto xin = q_proj->prepare_shared_input(x);
  ///   auto q = q_proj->forward_prepared(xin);
  ///   auto k = k_proj->forward_prepared(xin);
  /// \endcode
  amp::SharedCast prepare_shared_input(const at::Tensor& input) const;
  /// forward_prepared of a shared input: the matmul reads the shared cast,
  /// except where it reads the input its own way (a quantized weight's
  /// compute dtype; a ring layer's gather); an adapter reads it where
  /// output_adapter_takes_cast (LoRA without dropout; a dropout draws from
  /// the input as it is).
  at::Tensor forward_prepared(const amp::SharedCast& prepared);

  /// Shards this whole layer in place over `group` (see ParallelModule).
  void shard_(const distributed::ProcessGroupPtr& group) override;
  std::map<std::string, ShardSpec> shard_specs() const override;

  /// QLoRA: quantizes the frozen weight in place as bitsandbytes does
  /// (NOTE [QLoRA in C++]); `weight` then holds the stored data, without
  /// gradient. Not on a tensor-parallel layer.
  void quantize_(const quantization::BnbQuantizationConfig& config);
  /// Throws what quantize_ would (quantized already, tensor-parallel),
  /// changing nothing.
  void check_quantizable() const;
  /// A quantized weight keeps its stored dtype; the rest converts.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false)
      override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  /// Whether forward(x) is at::linear(x, weight_out_in(), bias) alone:
  /// full precision, no adapter, one rank (no gather, no split), so an op
  /// may compute it from the weight directly.
  bool plain() const;
  /// The weight as [out, in] (a transposed view of a Conv1D-layout
  /// weight).
  at::Tensor weight_out_in() const;

  /// This rank's shard of `full` (weights copied). With `fused` > 1 the
  /// output features are that many equal sections (a fused q, k, v
  /// projection: `fused` 3) and each section is split over the group, so
  /// rank r holds its chunk of every section, in section order
  /// (ColossalAI's FusedLinear1D_Col).
  static std::shared_ptr<Linear1D_ColImpl> from_full(
      const torch::nn::LinearImpl& full,
      const distributed::ProcessGroupPtr& group,
      bool gather_output = false,
      int64_t fused = 1);
  /// The same from full tensors: `weight` [out, in] (nn.Linear's layout; a
  /// GPT-2 Conv1D weight, stored [in, out], is passed transposed) and
  /// `bias` [out] or undefined.
  static std::shared_ptr<Linear1D_ColImpl> from_full(
      const at::Tensor& weight,
      const at::Tensor& bias,
      const distributed::ProcessGroupPtr& group,
      bool gather_output = false,
      int64_t fused = 1);

  /// Whether forward_prepared gathers the sequence itself, overlapping its
  /// backward's reduce-scatter (Linear1DOptions::overlap); prepare_input is
  /// then the identity.
  bool overlaps() const;

  Linear1DOptions options;
  at::Tensor weight; ///< [out / tp, in] ([in, out / tp] in conv1d_layout)
  at::Tensor bias;   ///< [out / tp], undefined without bias
  distributed::ProcessGroupPtr group;
  /// The quantized weight's state (null: full precision).
  std::shared_ptr<quantization::QuantizedWeight> quantized;

 private:
  // `shared`: prepared's shared cast (or null), read by the matmul and the
  // adapter where they can, each where its own cast would have been made.
  at::Tensor forward_prepared(
      const at::Tensor& prepared,
      const amp::SharedCast* shared);
};
TORCH_MODULE(Linear1D_Col);

/// Column layers that read one input (q, k and v; gate and up), their
/// outputs in order: prepare_shared_input once and forward_prepared on
/// each, or, where all of them overlap (Linear1D_ColImpl::overlaps), one
/// all-gather for all, whose backward reduce-scatters the summed input
/// gradient while the weight gradients are computed.
/// \code
///   auto qkv = forward_shared_input({q.get(), k.get(), v.get()}, x);
/// \endcode
std::vector<at::Tensor> forward_shared_input(
    const std::vector<Linear1D_ColImpl*>& layers,
    const at::Tensor& input);

/// y = x A^T + b with A's columns (input features) split over the group:
/// each rank multiplies its slice of the input by its columns and the
/// partial results are summed (all-reduce); b is replicated and added once
/// after the sum.
class Linear1D_RowImpl : public torch::nn::Cloneable<Linear1D_RowImpl>,
                         public ParallelModule {
 public:
  explicit Linear1D_RowImpl(Linear1DOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);

  /// Shards this whole layer in place over `group` (see ParallelModule).
  void shard_(const distributed::ProcessGroupPtr& group) override;
  std::map<std::string, ShardSpec> shard_specs() const override;

  /// QLoRA: quantizes the frozen weight in place as bitsandbytes does
  /// (NOTE [QLoRA in C++]); `weight` then holds the stored data, without
  /// gradient. Not on a tensor-parallel layer.
  void quantize_(const quantization::BnbQuantizationConfig& config);
  /// Throws what quantize_ would (quantized already, tensor-parallel),
  /// changing nothing.
  void check_quantizable() const;
  /// A quantized weight keeps its stored dtype; the rest converts.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false)
      override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  /// Whether forward(x) is at::linear(x, weight_out_in(), bias) alone:
  /// full precision, no adapter, one rank (no reduction, no split), so an
  /// op may compute it from the weight directly.
  bool plain() const;
  /// The weight as [out, in] (nn.Linear's layout; a transposed view of a
  /// Conv1D-layout weight).
  at::Tensor weight_out_in() const;

  static std::shared_ptr<Linear1D_RowImpl> from_full(
      const torch::nn::LinearImpl& full,
      const distributed::ProcessGroupPtr& group,
      bool parallel_input = true);
  /// From full tensors, as Linear1D_ColImpl::from_full.
  static std::shared_ptr<Linear1D_RowImpl> from_full(
      const at::Tensor& weight,
      const at::Tensor& bias,
      const distributed::ProcessGroupPtr& group,
      bool parallel_input = true);

  Linear1DOptions options;
  at::Tensor weight; ///< [out, in / tp] ([in / tp, out] in conv1d_layout)
  at::Tensor bias;   ///< [out], replicated
  distributed::ProcessGroupPtr group;
  /// The quantized weight's state (null: full precision).
  std::shared_ptr<quantization::QuantizedWeight> quantized;
};
TORCH_MODULE(Linear1D_Row);

/// QLoRA: the quantized linear layers under `root` by their weights'
/// dotted names ("layers.0.q_proj.weight"), each with a function that
/// quantizes a full-precision weight (in the layer's layout) into the layer,
/// as a checkpoint's full weights load into a quantized base.
std::map<std::string, std::function<void(const at::Tensor&)>>
quantized_weight_loaders(torch::nn::Module& root);

namespace detail {
/// Checks that `n` splits over `g` (null: one rank); `what` names the size
/// for the error.
void check_divisible(
    const distributed::ProcessGroupPtr& g,
    int64_t n,
    const char* layer,
    const char* what);
inline int group_size(const distributed::ProcessGroupPtr& g) {
  return g == nullptr ? 1 : g->size();
}
inline int group_rank(const distributed::ProcessGroupPtr& g) {
  return g == nullptr ? 0 : g->rank();
}
} // namespace detail

} // namespace layer
} // namespace shardformer
} // namespace colossalai
