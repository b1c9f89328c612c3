#pragma once

/// LLaMA with Hugging Face's layout (`LlamaForCausalLM`), written with the
/// tensor-parallel layers: RMSNorm, rotary position embeddings (with
/// Llama 3's and linear `rope_scaling`), SwiGLU MLP, grouped-query attention,
/// an untied or tied LM head. The same class is Mistral (a sliding attention
/// window), Qwen2 (q, k, v biases) and Qwen3 (RMSNorm of each head's q and
/// k), whose Hugging Face layouts differ from LLaMA's only there
/// (`LlamaConfig::model_type`), and Mixtral, Qwen2-MoE and Qwen3-MoE
/// (moe.h: a sparse mixture-of-experts block where the others have their
/// MLP). Built whole it is a plain model with Hugging
/// Face's parameter names (`model.layers.{i}.self_attn.q_proj.weight`, ...);
/// `LlamaPolicy` shards it in place.
///
/// Example:
/// \code
///   colossalai::models::LlamaForCausalLM model(
///       colossalai::models::LlamaConfig::tiny_test());
///   auto loss = model->loss(model->forward(ids), targets);
///   // Padding (1: a real token) and explicit positions, as transformers:
///   auto logits = model->forward(ids, attention_mask, position_ids);
/// \endcode

#include <colossalai/models/moe.h>
#include <colossalai/models/transformer.h>
#include <colossalai/nn/hookable_module.h>
#include <colossalai/shardformer/layer/embedding.h>
#include <colossalai/shardformer/layer/linear.h>
#include <colossalai/shardformer/layer/normalization.h>
#include <colossalai/shardformer/policy.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace colossalai {
namespace models {

/// How the rotary frequencies are scaled (Hugging Face's `rope_scaling`, or
/// `rope_parameters` in transformers 5): "default" (none), "linear"
/// (positions divided by `factor`) or "llama3" (Llama 3.1's smooth
/// per-frequency scaling). Other types are refused when a config is read.
struct RopeScaling {
  TORCH_ARG(std::string, rope_type) = "default";
  TORCH_ARG(double, factor) = 1.0;
  TORCH_ARG(double, low_freq_factor) = 1.0;
  TORCH_ARG(double, high_freq_factor) = 4.0;
  TORCH_ARG(int64_t, original_max_position_embeddings) = 8192;
};

/// Hugging Face's LlamaConfig fields (defaults: LLaMA-7B), with those of
/// Mistral, Qwen2 and Qwen3 that change the computation.
struct LlamaConfig {
  /// vocab 100, width 32, MLP 64, 2 layers, 8 heads over 4 key/value heads,
  /// 32 positions.
  static LlamaConfig tiny_test();
  /// About gpt-small-cpu's size: vocab 4096, width 256, MLP 688, 4 layers,
  /// 4 heads over 2 key/value heads, 128 positions.
  static LlamaConfig small_cpu();

  /// "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe" or
  /// "qwen3_moe": what save_pretrained writes as `model_type` and
  /// `architectures`; the last three need `moe`'s num_experts.
  TORCH_ARG(std::string, model_type) = "llama";
  TORCH_ARG(int64_t, vocab_size) = 32000;
  TORCH_ARG(int64_t, hidden_size) = 4096;
  TORCH_ARG(int64_t, intermediate_size) = 11008;
  TORCH_ARG(int64_t, num_hidden_layers) = 32;
  TORCH_ARG(int64_t, num_attention_heads) = 32;
  TORCH_ARG(int64_t, num_key_value_heads) = 32;
  /// Width of one head; 0: hidden_size / num_attention_heads.
  TORCH_ARG(int64_t, head_dim) = 0;
  TORCH_ARG(int64_t, max_position_embeddings) = 2048;
  TORCH_ARG(double, rms_norm_eps) = 1e-6;
  TORCH_ARG(double, rope_theta) = 10000.0;
  TORCH_ARG(RopeScaling, rope_scaling) = RopeScaling();
  TORCH_ARG(double, initializer_range) = 0.02;
  /// The LM head is the token embedding (Llama 3.2 1B / 3B, small Qwens).
  TORCH_ARG(bool, tie_word_embeddings) = false;
  /// Biases on q, k, v and o (LLaMA's `attention_bias`).
  TORCH_ARG(bool, attention_bias) = false;
  /// Biases on q, k and v only (Qwen2).
  TORCH_ARG(bool, qkv_bias) = false;
  /// Biases on gate, up and down (LLaMA's `mlp_bias`).
  TORCH_ARG(bool, mlp_bias) = false;
  /// RMSNorm over each head's q and k before the rotation (Qwen3).
  TORCH_ARG(bool, qk_norm) = false;
  /// Each query sees the last `sliding_window` keys (Mistral); 0: all.
  TORCH_ARG(int64_t, sliding_window) = 0;
  /// The padding token (transformers' `padding_idx` of embed_tokens): its
  /// row starts at zero and its lookups give the row no gradient; -1 (a
  /// null `pad_token_id`, LlamaConfig's default): none.
  TORCH_ARG(int64_t, pad_token_id) = -1;
  /// The mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE); num_experts 0:
  /// dense.
  TORCH_ARG(MoeConfig, moe) = MoeConfig();
  /// The config.json this config was read from (from_pretrained), so
  /// save_pretrained keeps the fields not modelled here; empty: none.
  TORCH_ARG(std::string, source_json) = "";

 public:
  /// head_dim, or hidden_size / num_attention_heads when it is 0.
  int64_t resolved_head_dim() const {
    return head_dim_ > 0 ? head_dim_ : hidden_size_ / num_attention_heads_;
  }
};

/// The rotary cosines and sines of one forward's positions, formed once per
/// dtype and shared by all its layers (transformers' LlamaRotaryEmbedding
/// also runs once per forward): every layer's frequencies come from the
/// same config. Formed on first use, so one object serves an autocast
/// forward (bf16 queries) and a plain one; not for concurrent use.
class RotaryTables {
 public:
  /// `positions` [T] or [B, T]; `inv_freq` [head_dim / 2] float32 on the
  /// positions' device.
  RotaryTables(at::Tensor positions, at::Tensor inv_freq);
  /// cos and sin, [T, head_dim] or [B, T, head_dim] in `dtype`; the
  /// reference holds until get() forms another dtype's.
  const std::pair<at::Tensor, at::Tensor>& get(at::ScalarType dtype) const;

 private:
  at::Tensor positions_, inv_freq_;
  using Formed = std::pair<at::ScalarType, std::pair<at::Tensor, at::Tensor>>;
  mutable std::vector<Formed> formed_;
};

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  /// `layer_idx`: its layer's entry in a KVCache.
  LlamaAttentionImpl(
      const LlamaConfig& config,
      const ParallelState* state,
      int64_t layer_idx = 0);
  /// x [B, T_local, C], positions [T_local] or [B, T_local], `mask` from
  /// attention_keep_mask (undefined: causal) -> [B, T_local, C].
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& positions,
      const at::Tensor& mask = at::Tensor());
  /// The same with the rotary tables of a whole forward (rotary_tables).
  at::Tensor forward(
      const at::Tensor& x,
      const RotaryTables& rope,
      const at::Tensor& mask = at::Tensor());
  /// The tables of `positions` with this layer's frequencies (copied to
  /// the positions' device once, not every forward).
  RotaryTables rotary_tables(const at::Tensor& positions);

  shardformer::layer::Linear1D_Col q_proj{nullptr}, k_proj{nullptr},
      v_proj{nullptr};
  shardformer::layer::Linear1D_Row o_proj{nullptr};
  /// Qwen3's per-head norms (null otherwise).
  shardformer::layer::RMSNorm q_norm{nullptr}, k_norm{nullptr};

 private:
  LlamaConfig config_;
  const ParallelState* state_;
  int64_t layer_idx_;
  at::Tensor inv_freq_; ///< [head_dim / 2] fp32, scaled
  at::Tensor inv_freq_device_; ///< its copy on the last device used
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  explicit LlamaMLPImpl(const LlamaConfig& config);
  /// down(silu(gate(x)) * up(x)).
  at::Tensor forward(const at::Tensor& x);

  shardformer::layer::Linear1D_Col gate_proj{nullptr}, up_proj{nullptr};
  shardformer::layer::Linear1D_Row down_proj{nullptr};
  /// silu(gate) * up formed again in backward instead of kept, where the
  /// down projection is plain (set_mlp_activation_recompute).
  bool recompute_activation = false;
};
TORCH_MODULE(LlamaMLP);

class LlamaDecoderLayerImpl : public torch::nn::Module,
                              public colossalai::nn::HookableModule {
 public:
  /// Layer `layer_idx`: its feed-forward part is a SparseMoeBlock where
  /// `config.moe().sparse_layer(layer_idx)`, else a LlamaMLP.
  LlamaDecoderLayerImpl(
      const LlamaConfig& config,
      const ParallelState* state,
      int64_t layer_idx = 0);
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& positions,
      const at::Tensor& mask = at::Tensor());
  /// The same with the rotary tables the model forms once per forward.
  at::Tensor forward(
      const at::Tensor& x,
      const RotaryTables& rope,
      const at::Tensor& mask = at::Tensor());

  LlamaAttention self_attn{nullptr};
  /// One of the two is set: the dense MLP, or the sparse block (registered
  /// as Mixtral's `block_sparse_moe` or Qwen's `mlp`).
  LlamaMLP mlp{nullptr};
  SparseMoeBlock moe{nullptr};
  shardformer::layer::RMSNorm input_layernorm{nullptr};
  shardformer::layer::RMSNorm post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

class LlamaModelImpl : public torch::nn::Module {
 public:
  LlamaModelImpl(const LlamaConfig& config, const ParallelState* state);
  /// ids [B, T] -> normalised hidden states [B, T, C], whole sequence;
  /// `attention_mask` [B, T] (1: a real token) and `position_ids` [B, T]
  /// (default 0 .. T - 1) as transformers takes them.
  /// `position_ids` without `attention_mask` may pack several documents in
  /// a row (packed_documents_mask).
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// A pipeline stage's part: embeddings (first) or `hidden`, layers
  /// [layers.begin, layers.end) (positions from `ids`), then norm (last).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());

  shardformer::layer::VocabParallelEmbedding1D embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  shardformer::layer::RMSNorm norm{nullptr};

 private:
  LlamaConfig config_;
  const ParallelState* state_;
};
TORCH_MODULE(LlamaModel);

class LlamaForCausalLMImpl : public torch::nn::Module,
                             public shardformer::ShardableModel {
 public:
  explicit LlamaForCausalLMImpl(const LlamaConfig& config = LlamaConfig());
  /// ids [B, T] int64 -> logits [B, T, vocab] (this rank's vocabulary
  /// columns under tensor parallelism with parallel_output);
  /// `attention_mask` and `position_ids` as LlamaModel::forward.
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// A pipeline stage's part of `forward` (the last stage adds lm_head).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// `ids` [B, T_new], the tokens after the `cache.length()` positions
  /// `cache` holds (NOTE [Generation]), which it appends to: logits [B,
  /// T_new or logits_to_keep, vocab] of the last `logits_to_keep` positions
  /// (0: all), over the whole vocabulary on every tensor rank.
  /// `attention_mask` covers the past and the new tokens, [B, cache.length()
  /// + T_new] (undefined: all real); `position_ids` [B, T_new] (default:
  /// cache.length() onwards). A model sharded with sequence parallelism or
  /// pipelined is not supported.
  at::Tensor forward_cached(
      const at::Tensor& ids,
      KVCache& cache,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor(),
      int64_t logits_to_keep = 0);
  /// Mean cross entropy against next-token targets [B, T] (-100: ignored,
  /// as transformers' labels); for a mixture of experts with
  /// `moe().output_router_logits()`, plus router_aux_loss_coef x aux_loss().
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const;
  /// `loss(forward(ids, attention_mask, position_ids), targets)` without
  /// the [B, T, vocab] logits (NOTE [Fused causal-LM loss]): less memory and
  /// time in training. Through a booster:
  /// `boosted.model.forward_loss(ids, targets, mask, positions)`.
  at::Tensor forward_loss(
      const at::Tensor& ids,
      const at::Tensor& targets,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// The load-balancing loss of the last forward over every sparse layer
  /// (load_balancing_loss, padding left out as that forward's
  /// attention_mask says); undefined for a dense model.
  at::Tensor aux_loss() const;

  const LlamaConfig& config() const {
    return config_;
  }
  ParallelState& parallel_state() {
    return state_;
  }
  std::shared_ptr<shardformer::Policy> default_policy() const override;

  LlamaModel model{nullptr};
  /// Null with tie_word_embeddings: the head is model.embed_tokens.
  shardformer::layer::VocabParallelLMHead1D lm_head{nullptr};

 private:
  // ce, plus router_aux_loss_coef x aux_loss() where loss() adds it.
  at::Tensor with_aux_loss(const at::Tensor& ce) const;
  // The head's logits of final hidden states: lm_head, or the tied
  // embedding's.
  at::Tensor head_logits(const at::Tensor& x);

  LlamaConfig config_;
  ParallelState state_;
  at::Tensor last_attention_mask_; ///< for aux_loss
};
TORCH_MODULE(LlamaForCausalLM);
/// Mistral, Qwen2, Qwen3 and the mixtures of experts are LlamaForCausalLM
/// with their config (`LlamaConfig::model_type` and the fields it sets).
using MistralForCausalLM = LlamaForCausalLM;
using Qwen2ForCausalLM = LlamaForCausalLM;
using Qwen3ForCausalLM = LlamaForCausalLM;
using MixtralForCausalLM = LlamaForCausalLM;
using Qwen2MoeForCausalLM = LlamaForCausalLM;
using Qwen3MoeForCausalLM = LlamaForCausalLM;

/// Shards a LlamaForCausalLM: embed_tokens and lm_head vocabulary-parallel,
/// q/k/v/gate/up column-parallel, o/down row-parallel, query and key/value
/// heads split over the tensor group (tp must divide num_key_value_heads);
/// sequence parallelism as GPT2Policy. In a sparse block each expert is
/// split like the MLP and the router is replicated; sparse blocks refuse
/// sequence parallelism, and pipeline stages the balancing loss.
class LlamaPolicy : public LMPolicy {
 public:
  std::string name() const override {
    return "LlamaPolicy";
  }
  shardformer::ShardInfo shard(
      torch::nn::Module& model,
      const shardformer::ShardConfig& config) override;
  int64_t num_pipeline_layers(const torch::nn::Module& model) const override;
  /// embed_tokens on the first stage, norm and lm_head on the last (tied:
  /// embed_tokens there too).
  std::vector<std::string> held_layers(
      const torch::nn::Module& model,
      const shardformer::StageLayers& layers) const override;
  /// model.embed_tokens.weight when the head is tied to it.
  std::vector<std::string> shared_params(
      const torch::nn::Module& model) const override;
  at::Tensor stage_forward(
      torch::nn::Module& model,
      const shardformer::StageLayers& layers,
      const std::vector<at::Tensor>& micro_batch,
      const at::Tensor& hidden) const override;
};

} // namespace models
} // namespace colossalai
