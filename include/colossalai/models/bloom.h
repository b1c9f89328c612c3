#pragma once

/// BLOOM with Hugging Face's layout (`BloomForCausalLM`), written with the
/// tensor-parallel layers: ALiBi attention (no position embeddings: each
/// head adds a linear bias of the key position to its scores), a LayerNorm
/// on the embeddings, pre-LayerNorm blocks with biases, a fused
/// query_key_value projection, GELU (tanh) MLP of width 4 x hidden_size,
/// and the LM head tied to `word_embeddings`. Built whole it is a plain
/// model whose parameter names and shapes are Hugging Face's
/// (`transformer.h.{i}.self_attention.query_key_value.weight`
/// [3 hidden, hidden], ...), so its safetensors load and save directly;
/// `BloomPolicy` (or HybridParallelPlugin, which uses it) shards it in place
/// for tensor and sequence parallelism.
///
/// Example:
/// \code
///   torch::manual_seed(0);
///   colossalai::models::BloomForCausalLM model(
///       colossalai::models::BloomConfig::tiny_test());
///   auto logits = model->forward(ids);        // [B, T, vocab]
///   auto loss = model->loss(logits, targets); // next-token targets
///   // Padding (1: a real token), as transformers takes it; the ALiBi
///   // positions count the real tokens only:
///   logits = model->forward(ids, attention_mask);
/// \endcode

#include <colossalai/models/pretrained_io.h>
#include <colossalai/models/transformer.h>
#include <colossalai/nn/hookable_module.h>
#include <colossalai/shardformer/layer/embedding.h>
#include <colossalai/shardformer/layer/linear.h>
#include <colossalai/shardformer/layer/normalization.h>
#include <colossalai/shardformer/policy.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace colossalai {
namespace models {

/// Hugging Face's BloomConfig fields (defaults: transformers' BloomConfig,
/// a small model with BLOOM's vocabulary).
struct BloomConfig {
  /// vocab 100 (not a multiple of 64: exercises the padding), width 32,
  /// 4 heads, 2 blocks, no dropout.
  static BloomConfig tiny_test();
  /// About gpt-small-cpu's size: vocab 4096, width 256, 4 heads, 4 blocks,
  /// no dropout.
  static BloomConfig small_cpu();

  TORCH_ARG(int64_t, vocab_size) = 250880;
  /// config.json may name it `n_embed`.
  TORCH_ARG(int64_t, hidden_size) = 64;
  /// config.json may name it `num_hidden_layers`.
  TORCH_ARG(int64_t, n_layer) = 2;
  /// config.json may name it `num_attention_heads`.
  TORCH_ARG(int64_t, n_head) = 8;
  TORCH_ARG(double, layer_norm_epsilon) = 1e-5;
  /// Dropout on the attention and MLP outputs before the residual add.
  TORCH_ARG(double, hidden_dropout) = 0.0;
  /// Dropout on the attention probabilities.
  TORCH_ARG(double, attention_dropout) = 0.0;
  TORCH_ARG(double, initializer_range) = 0.02;
  /// The residuals are the layer norms' outputs, not their inputs.
  TORCH_ARG(bool, apply_residual_connection_post_layernorm) = false;
  /// The padding token as config.json names it (-1: null, transformers'
  /// default). BLOOM's token embedding has no padding_idx, so it changes
  /// nothing in the computation; it is read and written for the tools that
  /// use it.
  TORCH_ARG(int64_t, pad_token_id) = -1;
  /// The config.json this config was read from (from_pretrained), so
  /// save_pretrained keeps the fields not modelled here; empty: none.
  TORCH_ARG(std::string, source_json) = "";

 public:
  int64_t head_dim() const {
    return hidden_size_ / n_head_;
  }
};

/// Hugging Face's ALiBi slopes of `n_head` heads ([n_head] float32): the
/// geometric series 2^(-8 i / n) of the closest power of two n <= n_head,
/// then, for the remaining heads, every other term of the series of 2n.
at::Tensor bloom_alibi_slopes(int64_t n_head);

class BloomAttentionImpl : public torch::nn::Module {
 public:
  /// `layer_idx`: its block's entry in a KVCache.
  BloomAttentionImpl(
      const BloomConfig& config,
      const ParallelState* state,
      int64_t layer_idx = 0);
  /// residual + dropout(dense(attention(x))): x and `residual`
  /// [B, T_local, C]; `alibi` [B or 1, H_local, 1, T_keys] (this rank's
  /// heads' bias of each key, from BloomModel; T_keys counts a KVCache's
  /// keys too); `mask` from attention_keep_mask (undefined: causal).
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& residual,
      const at::Tensor& alibi,
      const at::Tensor& mask = at::Tensor());

  /// Fused q, k, v; output features per head: [n_head, 3, head_dim].
  shardformer::layer::Linear1D_Col query_key_value{nullptr};
  shardformer::layer::Linear1D_Row dense{nullptr};
  shardformer::layer::Dropout attention_dropout{nullptr};
  shardformer::layer::Dropout hidden_dropout{nullptr};

 private:
  int64_t n_head_, head_dim_;
  const ParallelState* state_;
  int64_t layer_idx_;
};
TORCH_MODULE(BloomAttention);

class BloomMLPImpl : public torch::nn::Module {
 public:
  explicit BloomMLPImpl(const BloomConfig& config);
  /// residual + dropout(dense_4h_to_h(gelu(dense_h_to_4h(x)))).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& residual);

  shardformer::layer::Linear1D_Col dense_h_to_4h{nullptr};
  shardformer::layer::Linear1D_Row dense_4h_to_h{nullptr};
  shardformer::layer::Dropout hidden_dropout{nullptr};
  /// gelu(dense_h_to_4h(x)) formed again in backward instead of kept,
  /// where dense_4h_to_h is plain (set_mlp_activation_recompute).
  bool recompute_activation = false;
};
TORCH_MODULE(BloomMLP);

/// h = x + attn(ln(x)); h + mlp(ln(h)) (the residuals are the norms'
/// outputs with apply_residual_connection_post_layernorm). Opens a
/// ForwardScope, so FSDP and Gemini can make each block a unit.
class BloomBlockImpl : public torch::nn::Module,
                       public colossalai::nn::HookableModule {
 public:
  BloomBlockImpl(
      const BloomConfig& config,
      const ParallelState* state,
      int64_t layer_idx = 0);
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& alibi,
      const at::Tensor& mask = at::Tensor());

  torch::nn::LayerNorm input_layernorm{nullptr};
  BloomAttention self_attention{nullptr};
  torch::nn::LayerNorm post_attention_layernorm{nullptr};
  BloomMLP mlp{nullptr};

 private:
  bool post_layernorm_residual_;
};
TORCH_MODULE(BloomBlock);

class BloomModelImpl : public torch::nn::Module {
 public:
  BloomModelImpl(const BloomConfig& config, const ParallelState* state);
  /// ids [B, T] -> final hidden states [B, T, C] (after ln_f), whole
  /// sequence on every rank; `attention_mask` [B, T] (1: a real token) as
  /// transformers takes it: padding is masked and the ALiBi positions
  /// count only the real tokens.
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor());
  /// A pipeline stage's part: embeddings and their layer norm of `ids`
  /// (first) or `hidden`, blocks [layers.begin, layers.end), then ln_f
  /// (last).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden,
      const at::Tensor& attention_mask = at::Tensor());

  shardformer::layer::VocabParallelEmbedding1D word_embeddings{nullptr};
  torch::nn::LayerNorm word_embeddings_layernorm{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  BloomConfig config_;
  const ParallelState* state_;
  at::Tensor alibi_slopes_; ///< this tp rank's, on the last device used
  int64_t alibi_slopes_rank_ = -1;
};
TORCH_MODULE(BloomModel);

class BloomForCausalLMImpl : public torch::nn::Module,
                             public shardformer::ShardableModel {
 public:
  explicit BloomForCausalLMImpl(const BloomConfig& config = BloomConfig());
  /// ids [B, T] int64 -> logits [B, T, vocab] (with tensor parallelism and
  /// parallel_output: this rank's [B, T, V_pad / tp] vocabulary columns);
  /// `attention_mask` as BloomModel::forward.
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor());
  /// A pipeline stage's part of `forward` (the last stage adds the tied
  /// head).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden,
      const at::Tensor& attention_mask = at::Tensor());
  /// A step of generation after what `cache` holds, as
  /// LlamaForCausalLM::forward_cached (NOTE [Generation]); ALiBi has no
  /// positions: the keys' biases count the real tokens of
  /// `attention_mask`.
  at::Tensor forward_cached(
      const at::Tensor& ids,
      KVCache& cache,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor(),
      int64_t logits_to_keep = 0);
  /// Mean cross entropy of `forward`'s logits against next-token targets
  /// [B, T] (aligned with the logits; -100: ignored, as transformers'
  /// labels), sharded logits included.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const;
  /// `loss(forward(ids, attention_mask), targets)` without the
  /// [B, T, vocab] logits (NOTE [Fused causal-LM loss]): less memory and
  /// time in training. Through a booster:
  /// `boosted.model.forward_loss(ids, targets, mask)`.
  at::Tensor forward_loss(
      const at::Tensor& ids,
      const at::Tensor& targets,
      const at::Tensor& attention_mask = at::Tensor());

  const BloomConfig& config() const {
    return config_;
  }
  ParallelState& parallel_state() {
    return state_;
  }
  std::shared_ptr<shardformer::Policy> default_policy() const override;

  /// The head is transformer.word_embeddings (Hugging Face's lm_head.weight
  /// is tied to it).
  BloomModel transformer{nullptr};

 private:
  BloomConfig config_;
  ParallelState state_;
};
TORCH_MODULE(BloomForCausalLM);

/// Shards a BloomForCausalLM: word_embeddings vocabulary-parallel (and the
/// tied head), query_key_value and dense_h_to_4h column-parallel (each rank
/// whole heads with their q, k and v, and the ALiBi slopes of those heads),
/// dense and dense_4h_to_h row-parallel; tp must divide n_head.
/// split_gather (and ring) sequence parallelism splits the sequence between
/// blocks over the tensor group, after word_embeddings_layernorm; all_to_all
/// and ring_attn are refused. Blocks split evenly over pipeline stages.
class BloomPolicy : public LMPolicy {
 public:
  std::string name() const override {
    return "BloomPolicy";
  }
  shardformer::ShardInfo shard(
      torch::nn::Module& model,
      const shardformer::ShardConfig& config) override;
  int64_t num_pipeline_layers(const torch::nn::Module& model) const override;
  /// word_embeddings and word_embeddings_layernorm on the first stage, ln_f
  /// and the tied head (word_embeddings) on the last.
  std::vector<std::string> held_layers(
      const torch::nn::Module& model,
      const shardformer::StageLayers& layers) const override;
  /// transformer.word_embeddings.weight (the tied head).
  std::vector<std::string> shared_params(
      const torch::nn::Module& model) const override;
  at::Tensor stage_forward(
      torch::nn::Module& model,
      const shardformer::StageLayers& layers,
      const std::vector<at::Tensor>& micro_batch,
      const at::Tensor& hidden) const override;
  /// ALiBi: no position ids.
  std::vector<std::string> micro_batch_inputs() const override {
    return {"input_ids", "labels", "attention_mask"};
  }
};

/// BloomConfig from the text of a config.json (model_type "bloom"; Hugging
/// Face's aliases n_embed, num_attention_heads and num_hidden_layers
/// accepted); the text is kept in `source_json`. A config this library
/// cannot compute exactly (pretraining_tp > 1 with slow_but_exact, an
/// untied head) is refused naming the field.
BloomConfig bloom_config_from_json(const std::string& json);
/// config.json's text for a config: `source_json` with the modelled fields
/// written over it (and its aliases of them removed).
std::string config_to_json(const BloomConfig& config);

/// Builds the BloomForCausalLM `dir`'s config.json describes and loads its
/// weights (a tied `lm_head.weight` is skipped; a bare BloomModel's
/// checkpoint, without the `transformer.` prefix, loads as well).
template <>
BloomForCausalLM from_pretrained<BloomForCausalLM>(
    const std::string& dir,
    const FromPretrainedOptions& options);

/// Writes config.json and the weights of a model held whole by this process
/// (unboosted, or under a plugin that keeps it whole such as TorchDDP).
void save_pretrained(
    BloomForCausalLM& model,
    const std::string& dir,
    const SavePretrainedOptions& options = SavePretrainedOptions());

/// Writes only `dir`/config.json (beside weights a booster saved).
void save_pretrained_config(const BloomConfig& config, const std::string& dir);

} // namespace models
} // namespace colossalai
