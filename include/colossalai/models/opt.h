#pragma once

/// OPT with Hugging Face's layout (`OPTForCausalLM`), written with the
/// tensor-parallel layers: learned positions (with OPT's offset of 2),
/// LayerNorm before (opt-125m, 1.3b, ...) or after (opt-350m) each
/// sub-block, ReLU (or GELU) MLP, biases on every projection, optional
/// `project_in` / `project_out` when the word embeddings are narrower than
/// the model (opt-350m), and the LM head tied to `embed_tokens`. Built whole
/// it is a plain model with Hugging Face's parameter names
/// (`model.decoder.layers.{i}.self_attn.q_proj.weight`, ...), so its
/// checkpoints load and save directly; `OPTPolicy` shards it in place.
///
/// Example:
/// \code
///   namespace models = colossalai::models;
///   models::OPTForCausalLM model(models::OPTConfig::tiny_test());
///   auto loss = model->loss(model->forward(ids), targets);
///   // Padding (1: a real token): positions skip the padding, as
///   // transformers computes them (cumsum(mask) * mask - 1).
///   auto logits = model->forward(ids, attention_mask);
///   auto opt = models::from_pretrained<models::OPTForCausalLM>("opt-125m");
///   models::save_pretrained(opt, "opt-125m-tuned");
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
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace colossalai {
namespace models {

/// Hugging Face's OPTConfig fields (defaults: opt-125m's shape, as
/// transformers' OPTConfig()).
struct OPTConfig {
  /// vocab 100, width 32, MLP 64, 2 layers, 4 heads, 32 positions, no
  /// dropout.
  static OPTConfig tiny_test();
  /// About gpt-small-cpu's size: vocab 4096, width 256, MLP 1024, 4 layers,
  /// 4 heads, 128 positions, no dropout.
  static OPTConfig small_cpu();

  TORCH_ARG(int64_t, vocab_size) = 50272;
  TORCH_ARG(int64_t, hidden_size) = 768;
  TORCH_ARG(int64_t, ffn_dim) = 3072;
  TORCH_ARG(int64_t, num_hidden_layers) = 12;
  TORCH_ARG(int64_t, num_attention_heads) = 12;
  /// Positions a sequence may have; the table has 2 rows more (OPT's
  /// offset: position p reads row p + 2).
  TORCH_ARG(int64_t, max_position_embeddings) = 2048;
  /// Width of the word embeddings (and of the tied head); 0: hidden_size.
  /// Otherwise `project_in` / `project_out` map between the two (opt-350m).
  TORCH_ARG(int64_t, word_embed_proj_dim) = 0;
  /// LayerNorm before each sub-block and a final LayerNorm (true), or after
  /// each sub-block and no final one (opt-350m).
  TORCH_ARG(bool, do_layer_norm_before) = true;
  /// Biases on q, k, v, out_proj, fc1 and fc2.
  TORCH_ARG(bool, enable_bias) = true;
  /// The LayerNorms have a weight and a bias.
  TORCH_ARG(bool, layer_norm_elementwise_affine) = true;
  /// On the attention output and the MLP output (the residual branches).
  TORCH_ARG(double, dropout) = 0.1;
  /// On the attention probabilities.
  TORCH_ARG(double, attention_dropout) = 0.0;
  /// "relu" or "gelu" (exact, erf).
  TORCH_ARG(std::string, activation_function) = "relu";
  TORCH_ARG(double, init_std) = 0.02;
  /// The padding token (Hugging Face's `padding_idx` of embed_tokens): its
  /// row starts at zero and its lookups give embed_tokens no gradient; < 0:
  /// none.
  TORCH_ARG(int64_t, pad_token_id) = 1;
  /// The config.json this config was read from (from_pretrained), so
  /// save_pretrained keeps the fields not modelled here; empty: none.
  TORCH_ARG(std::string, source_json) = "";

 public:
  /// word_embed_proj_dim, or hidden_size when it is 0.
  int64_t resolved_word_embed_proj_dim() const {
    return word_embed_proj_dim_ > 0 ? word_embed_proj_dim_ : hidden_size_;
  }
  /// Whether project_in / project_out exist.
  bool has_projections() const {
    return resolved_word_embed_proj_dim() != hidden_size_;
  }
};

class OPTAttentionImpl : public torch::nn::Module {
 public:
  /// `layer_idx`: its layer's entry in a KVCache.
  OPTAttentionImpl(
      const OPTConfig& config,
      const ParallelState* state,
      int64_t layer_idx = 0);
  /// x [B, T_local, C], `mask` from attention_keep_mask (undefined: causal)
  /// -> [B, T_local, C] (before the residual dropout).
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& mask = at::Tensor());

  shardformer::layer::Linear1D_Col k_proj{nullptr}, v_proj{nullptr},
      q_proj{nullptr};
  shardformer::layer::Linear1D_Row out_proj{nullptr};
  /// On the attention probabilities (attention_dropout).
  shardformer::layer::Dropout dropout{nullptr};

 private:
  int64_t head_dim_;
  const ParallelState* state_;
  int64_t layer_idx_;
};
TORCH_MODULE(OPTAttention);

/// Pre-LN: x = x + drop(attn(ln1(x))); x = x + drop(fc2(act(fc1(ln2(x))))).
/// Post-LN: x = ln1(x + drop(attn(x))); x = ln2(x + drop(fc2(act(fc1(x))))).
/// Opens a ForwardScope, so FSDP and Gemini can make each layer a unit.
class OPTDecoderLayerImpl : public torch::nn::Module,
                            public colossalai::nn::HookableModule {
 public:
  OPTDecoderLayerImpl(
      const OPTConfig& config,
      const ParallelState* state,
      int64_t layer_idx = 0);
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& mask = at::Tensor());

  OPTAttention self_attn{nullptr};
  torch::nn::LayerNorm self_attn_layer_norm{nullptr};
  shardformer::layer::Linear1D_Col fc1{nullptr};
  shardformer::layer::Linear1D_Row fc2{nullptr};
  torch::nn::LayerNorm final_layer_norm{nullptr};
  /// On both residual branches (dropout).
  shardformer::layer::Dropout dropout{nullptr};

 private:
  bool pre_ln_;
  bool gelu_;
};
TORCH_MODULE(OPTDecoderLayer);

class OPTDecoderImpl : public torch::nn::Module {
 public:
  OPTDecoderImpl(const OPTConfig& config, const ParallelState* state);
  /// ids [B, T] -> hidden states [B, T, word_embed_proj_dim] (after
  /// final_layer_norm and project_out), whole sequence; `attention_mask`
  /// [B, T] (1: a real token) and `position_ids` [B, T] as transformers
  /// takes them (default: cumsum(mask) * mask - 1 with a mask, 0 .. T - 1
  /// without).
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// A pipeline stage's part: embeddings (first) or `hidden`, layers
  /// [layers.begin, layers.end), then final_layer_norm and project_out
  /// (last).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());

  /// [vocab, word_embed_proj_dim], also the LM head.
  shardformer::layer::VocabParallelEmbedding1D embed_tokens{nullptr};
  /// [max_position_embeddings + 2, hidden_size], replicated.
  torch::nn::Embedding embed_positions{nullptr};
  /// Null unless word_embed_proj_dim != hidden_size; no bias, replicated.
  torch::nn::Linear project_out{nullptr}, project_in{nullptr};
  /// Null unless do_layer_norm_before.
  torch::nn::LayerNorm final_layer_norm{nullptr};
  torch::nn::ModuleList layers{nullptr};

 private:
  OPTConfig config_;
  const ParallelState* state_;
};
TORCH_MODULE(OPTDecoder);

class OPTModelImpl : public torch::nn::Module {
 public:
  OPTModelImpl(const OPTConfig& config, const ParallelState* state);
  /// As OPTDecoder::forward.
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());

  OPTDecoder decoder{nullptr};
};
TORCH_MODULE(OPTModel);

class OPTForCausalLMImpl : public torch::nn::Module,
                           public shardformer::ShardableModel {
 public:
  explicit OPTForCausalLMImpl(const OPTConfig& config = OPTConfig());
  /// ids [B, T] int64 -> logits [B, T, vocab] (this rank's vocabulary
  /// columns under tensor parallelism with parallel_output);
  /// `attention_mask` and `position_ids` as OPTDecoder::forward.
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// A pipeline stage's part of `forward` (the last stage adds the tied
  /// head).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// A step of generation after what `cache` holds, as
  /// LlamaForCausalLM::forward_cached (NOTE [Generation]); default
  /// positions count the real tokens of `attention_mask`, as forward's.
  at::Tensor forward_cached(
      const at::Tensor& ids,
      KVCache& cache,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor(),
      int64_t logits_to_keep = 0);
  /// Mean cross entropy against next-token targets [B, T] (-100: ignored,
  /// as transformers' labels).
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

  const OPTConfig& config() const {
    return config_;
  }
  ParallelState& parallel_state() {
    return state_;
  }
  std::shared_ptr<shardformer::Policy> default_policy() const override;

  /// The head is model.decoder.embed_tokens (no lm_head parameter).
  OPTModel model{nullptr};

 private:
  OPTConfig config_;
  ParallelState state_;
};
TORCH_MODULE(OPTForCausalLM);

/// Shards an OPTForCausalLM: embed_tokens vocabulary-parallel (and the tied
/// head), q/k/v/fc1 column-parallel, out_proj/fc2 row-parallel, heads split
/// over the tensor group (tp must divide num_attention_heads); positions,
/// project_in / project_out and the LayerNorms replicated. Sequence
/// parallelism: split_gather and ring (over the tensor group), as
/// GPT2Policy; all_to_all and ring_attn are refused. Layers split evenly
/// over pipeline stages.
class OPTPolicy : public LMPolicy {
 public:
  std::string name() const override {
    return "OPTPolicy";
  }
  shardformer::ShardInfo shard(
      torch::nn::Module& model,
      const shardformer::ShardConfig& config) override;
  int64_t num_pipeline_layers(const torch::nn::Module& model) const override;
  /// embed_tokens, embed_positions and project_in on the first stage;
  /// final_layer_norm, project_out and the tied head (embed_tokens) on the
  /// last.
  std::vector<std::string> held_layers(
      const torch::nn::Module& model,
      const shardformer::StageLayers& layers) const override;
  /// model.decoder.embed_tokens.weight (the tied head).
  std::vector<std::string> shared_params(
      const torch::nn::Module& model) const override;
  at::Tensor stage_forward(
      torch::nn::Module& model,
      const shardformer::StageLayers& layers,
      const std::vector<at::Tensor>& micro_batch,
      const at::Tensor& hidden) const override;
};

/// OPTConfig from the text of a config.json (model_type "opt"; Hugging
/// Face's field names), kept in `source_json`. Refuses what this library
/// does not compute: activation_function other than relu / gelu,
/// `_remove_final_layer_norm`, layerdrop, an untied head.
OPTConfig opt_config_from_json(const std::string& json);
/// config.json's text for a config: `source_json` with the modelled fields
/// written over it.
std::string config_to_json(const OPTConfig& config);

/// Builds the model `dir`'s config.json describes and loads its weights
/// (an OPTForCausalLM's or a bare OPTModel's; `lm_head.weight`, the tied
/// head, is skipped).
template <>
OPTForCausalLM from_pretrained<OPTForCausalLM>(
    const std::string& dir,
    const FromPretrainedOptions& options);

/// Writes config.json and the weights of a model held whole by this
/// process (as transformers saves it: no lm_head.weight).
void save_pretrained(
    OPTForCausalLM& model,
    const std::string& dir,
    const SavePretrainedOptions& options = SavePretrainedOptions());

/// Writes only `dir`/config.json (beside weights a booster saved).
void save_pretrained_config(const OPTConfig& config, const std::string& dir);

} // namespace models
} // namespace colossalai
