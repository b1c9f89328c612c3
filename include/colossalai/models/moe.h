#pragma once

/// Mixture-of-experts feed-forward blocks as transformers writes them for
/// Mixtral (`block_sparse_moe`: `gate`, `experts.{e}.w1/w3/w2`) and
/// Qwen2-MoE / Qwen3-MoE (`mlp`: `gate`, `experts.{e}.gate_proj/up_proj/
/// down_proj`, Qwen2-MoE's `shared_expert` and `shared_expert_gate`), with
/// the Switch Transformer load-balancing loss transformers adds to the
/// language-model loss. Routing is dropless: every token reaches its top-k
/// experts (no capacity factor), so a sharded run computes what one process
/// does. `LlamaForCausalLM` builds these blocks when its config's
/// `MoeConfig::num_experts` is positive (model types "mixtral",
/// "qwen2_moe", "qwen3_moe").
///
/// Example:
/// \code
///   auto config = colossalai::models::LlamaConfig::tiny_test()
///                     .model_type("mixtral")
///                     .moe(colossalai::models::MoeConfig()
///                              .num_experts(4)
///                              .num_experts_per_tok(2)
///                              .output_router_logits(true));
///   colossalai::models::LlamaForCausalLM model(config);
///   // Cross entropy plus router_aux_loss_coef x the balancing loss:
///   auto loss = model->loss(model->forward(ids), targets);
/// \endcode

#include <colossalai/shardformer/layer/linear.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

namespace colossalai {
namespace models {

/// transformers' mixture-of-experts fields (MixtralConfig, Qwen2MoeConfig,
/// Qwen3MoeConfig). num_experts 0: a dense model.
struct MoeConfig {
  /// Routed experts per sparse layer (`num_local_experts` in Mixtral's
  /// config, `num_experts` in Qwen's).
  TORCH_ARG(int64_t, num_experts) = 0;
  /// Experts each token is sent to (top-k).
  TORCH_ARG(int64_t, num_experts_per_tok) = 2;
  /// Width of a routed expert; 0: the config's intermediate_size
  /// (Mixtral's).
  TORCH_ARG(int64_t, moe_intermediate_size) = 0;
  /// Qwen2-MoE's always-on expert beside the routed ones, gated by a
  /// sigmoid; 0: none.
  TORCH_ARG(int64_t, shared_expert_intermediate_size) = 0;
  /// Renormalise the top-k probabilities to sum to one (always, in
  /// Mixtral).
  TORCH_ARG(bool, norm_topk_prob) = true;
  /// Layer i is sparse when (i + 1) is a multiple of this (Qwen), and i is
  /// not in mlp_only_layers; the others have a dense MLP of
  /// intermediate_size.
  TORCH_ARG(int64_t, decoder_sparse_step) = 1;
  TORCH_ARG(std::vector<int64_t>, mlp_only_layers) = {};
  /// Weight of the load-balancing loss in `loss`.
  TORCH_ARG(double, router_aux_loss_coef) = 0.001;
  /// As transformers: the balancing loss joins `loss` only when true
  /// (transformers' default is false; training an MoE usually wants it).
  TORCH_ARG(bool, output_router_logits) = false;

 public:
  bool enabled() const {
    return num_experts_ > 0;
  }
  /// Whether decoder layer `i` has a sparse block.
  bool sparse_layer(int64_t i) const;
  /// moe_intermediate_size, or `intermediate_size` when it is 0.
  int64_t expert_width(int64_t intermediate_size) const {
    return moe_intermediate_size_ > 0 ? moe_intermediate_size_
                                      : intermediate_size;
  }
};

/// One SwiGLU expert: down(silu(gate(x)) * up(x)), tensor-parallel like
/// LlamaMLP. Parameter names: gate_proj / up_proj / down_proj, or Mixtral's
/// w1 / w3 / w2.
class MoeExpertImpl : public torch::nn::Module {
 public:
  MoeExpertImpl(
      int64_t hidden_size,
      int64_t intermediate_size,
      double init_std,
      bool mixtral_names);
  /// x [N, C] -> [N, C].
  at::Tensor forward(const at::Tensor& x);

  shardformer::layer::Linear1D_Col gate_proj{nullptr}, up_proj{nullptr};
  shardformer::layer::Linear1D_Row down_proj{nullptr};
};
TORCH_MODULE(MoeExpert);

/// The sparse block: a linear router (`gate`, no bias) picks each token's
/// top-k experts from the softmax of its logits; their outputs are summed
/// weighted by those probabilities (renormalised with norm_topk_prob), plus
/// the shared expert's output times sigmoid(shared_expert_gate(x)) where
/// there is one. Tokens are sorted by expert and each expert runs once on
/// its rows, even on none (so every expert's gradient exists, zero when no
/// token chose it), or, with set_grouped_gemm, every expert in one grouped
/// GEMM per projection.
class SparseMoeBlockImpl : public torch::nn::Module {
 public:
  SparseMoeBlockImpl(
      int64_t hidden_size,
      int64_t intermediate_size,
      const MoeConfig& config,
      double init_std,
      bool mixtral_names);
  /// x [B, T, C] -> [B, T, C]; keeps the router's logits [B * T, E].
  at::Tensor forward(const at::Tensor& x);
  /// The router's logits of the last forward (undefined before one).
  const at::Tensor& router_logits() const {
    return router_logits_;
  }
  /// Splits the experts over `group` (expert parallelism): rank r computes
  /// experts [r * E / n, (r + 1) * E / n) for the tokens every rank routes
  /// to them, which travel there and back by all-to-all. The block keeps
  /// every expert module; the plugin releases the others' parameters. E
  /// must divide by the group's size. `fp8`: the token exchange travels as
  /// FP8 where the group spans nodes (distributed/functional.h).
  void set_expert_parallel(
      distributed::ProcessGroupPtr group,
      bool fp8 = false);
  /// The experts this rank computes: [first, first + count).
  int64_t first_local_expert() const {
    return first_local_;
  }
  int64_t num_local_experts() const {
    return num_local_;
  }
  /// Runs this rank's experts as one grouped GEMM per projection
  /// (kernels::grouped_swiglu: no count read back to the host, no GEMM per
  /// expert) where it applies: experts without tensor parallelism, adapter
  /// or quantization, and at::_grouped_mm for the compute dtype on the
  /// rows' device (LibTorch 2.10+: bf16 on Hopper / Blackwell GPUs, the
  /// CPU). Elsewhere, and by default, expert by expert.
  void set_grouped_gemm(bool on) {
    grouped_gemm_ = on;
  }
  bool grouped_gemm() const {
    return grouped_gemm_;
  }

  torch::nn::Linear gate{nullptr};
  torch::nn::ModuleList experts{nullptr};
  /// Qwen2-MoE's shared expert and its gate (null otherwise).
  MoeExpert shared_expert{nullptr};
  torch::nn::Linear shared_expert_gate{nullptr};

 private:
  // The routed rows (sorted by expert, `count` per expert) through this
  // rank's experts: here, or dispatched over the expert-parallel group and
  // combined back in the same order.
  at::Tensor run_experts(const at::Tensor& rows, const at::Tensor& counts);
  // This rank's experts on their rows (`counts` [local], int64 on any
  // device): grouped where set and it applies, else one expert at a time.
  at::Tensor run_local(const at::Tensor& rows, const at::Tensor& counts);

  MoeConfig config_;
  bool mixtral_;
  at::Tensor router_logits_;
  distributed::ProcessGroupPtr ep_group_;
  bool ep_fp8_ = false;
  int64_t first_local_ = 0;
  int64_t num_local_ = 0;
  bool grouped_gemm_ = false;
};
TORCH_MODULE(SparseMoeBlock);

/// SparseMoeBlockImpl::set_grouped_gemm on every sparse block under
/// `model`; returns how many it set. Off by default.
///
/// Example:
/// \code
///   colossalai::models::set_grouped_expert_gemm(*model, true);
/// \endcode
int64_t set_grouped_expert_gemm(torch::nn::Module& model, bool on);

/// transformers' load_balancing_loss_func: with f_e the fraction of top-k
/// assignments that went to expert e and P_e its mean router probability,
/// both over every row of every layer's logits ([N, E] each; rows whose
/// `attention_mask` [B, T] entry is 0 left out), num_experts * sum_e f_e P_e.
/// A scalar fp32 tensor; differentiable through the probabilities.
at::Tensor load_balancing_loss(
    const std::vector<at::Tensor>& router_logits,
    int64_t num_experts,
    int64_t top_k,
    const at::Tensor& attention_mask = at::Tensor());

} // namespace models
} // namespace colossalai
