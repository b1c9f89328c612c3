#pragma once

/// GPT-2 with Hugging Face's layout (`GPT2LMHeadModel`), written with the
/// tensor-parallel layers: built whole it is a plain model whose parameter
/// names and shapes are Hugging Face's (`transformer.h.{i}.attn.c_attn.weight`
/// [C, 3C] in Conv1D layout, ...), so its safetensors load and save
/// directly; `GPT2Policy` (or HybridParallelPlugin, which uses it) shards it
/// in place for tensor and sequence parallelism. Learned positions, GELU
/// (tanh), pre-LayerNorm blocks, LM head tied to `wte`.
///
/// Example:
/// \code
///   torch::manual_seed(0);
///   colossalai::models::GPT2LMHeadModel model(
///       colossalai::models::GPT2Config::tiny_test());
///   auto logits = model->forward(ids);               // [B, T, vocab]
///   auto loss = model->loss(logits, targets);        // next-token targets
/// \endcode

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
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace colossalai {
namespace models {

/// Hugging Face's GPT2Config fields (defaults: gpt2 small).
struct GPT2Config {
  /// vocab 100 (not a multiple of 64: exercises the padding), 32 positions,
  /// width 32, 4 heads, 2 blocks, no dropout.
  static GPT2Config tiny_test();
  /// gpt-small-cpu's shape (vocab 4096, 128 positions, width 256, 4 heads,
  /// 4 blocks), no dropout.
  static GPT2Config small_cpu();

  TORCH_ARG(int64_t, vocab_size) = 50257;
  TORCH_ARG(int64_t, n_positions) = 1024;
  TORCH_ARG(int64_t, n_embd) = 768;
  TORCH_ARG(int64_t, n_layer) = 12;
  TORCH_ARG(int64_t, n_head) = 12;
  TORCH_ARG(double, layer_norm_epsilon) = 1e-5;
  TORCH_ARG(double, embd_pdrop) = 0.1;
  TORCH_ARG(double, attn_pdrop) = 0.1;
  TORCH_ARG(double, resid_pdrop) = 0.1;
  TORCH_ARG(double, initializer_range) = 0.02;
  /// Width of the MLP; 0: 4 x n_embd.
  TORCH_ARG(int64_t, n_inner) = 0;
  /// The padding token as config.json names it (-1: null, transformers'
  /// default). GPT-2's token embedding has no padding_idx, so it changes
  /// nothing in the computation; it is read and written for the tools that
  /// use it.
  TORCH_ARG(int64_t, pad_token_id) = -1;
  /// The config.json this config was read from (from_pretrained), so
  /// save_pretrained keeps the fields not modelled here; empty: none.
  TORCH_ARG(std::string, source_json) = "";

 public:
  int64_t resolved_n_inner() const {
    return n_inner_ > 0 ? n_inner_ : 4 * n_embd_;
  }
};

class GPT2AttentionImpl : public torch::nn::Module {
 public:
  /// `layer_idx`: its block's entry in a KVCache.
  GPT2AttentionImpl(
      const GPT2Config& config,
      const ParallelState* state,
      int64_t layer_idx = 0);
  /// x: [B, T_local, C] -> [B, T_local, C]; `mask` from
  /// attention_keep_mask (undefined: causal).
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& mask = at::Tensor());

  shardformer::layer::Linear1D_Col c_attn{nullptr}; ///< fused q, k, v
  shardformer::layer::Linear1D_Row c_proj{nullptr};
  shardformer::layer::Dropout attn_dropout{nullptr};
  shardformer::layer::Dropout resid_dropout{nullptr};

 private:
  int64_t n_head_, head_dim_;
  const ParallelState* state_;
  int64_t layer_idx_;
};
TORCH_MODULE(GPT2Attention);

class GPT2MLPImpl : public torch::nn::Module {
 public:
  explicit GPT2MLPImpl(const GPT2Config& config);
  /// dropout(c_proj(gelu_tanh(c_fc(x)))).
  at::Tensor forward(const at::Tensor& x);

  shardformer::layer::Linear1D_Col c_fc{nullptr};
  shardformer::layer::Linear1D_Row c_proj{nullptr};
  shardformer::layer::Dropout dropout{nullptr};
  /// gelu(c_fc(x)) formed again in backward instead of kept, where c_proj
  /// is plain (set_mlp_activation_recompute).
  bool recompute_activation = false;
};
TORCH_MODULE(GPT2MLP);

/// x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)). Opens a ForwardScope, so
/// FSDP and Gemini can make each block a unit.
class GPT2BlockImpl : public torch::nn::Module,
                      public colossalai::nn::HookableModule {
 public:
  GPT2BlockImpl(
      const GPT2Config& config,
      const ParallelState* state,
      int64_t layer_idx = 0);
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& mask = at::Tensor());

  torch::nn::LayerNorm ln_1{nullptr};
  GPT2Attention attn{nullptr};
  torch::nn::LayerNorm ln_2{nullptr};
  GPT2MLP mlp{nullptr};
};
TORCH_MODULE(GPT2Block);

class GPT2ModelImpl : public torch::nn::Module {
 public:
  GPT2ModelImpl(const GPT2Config& config, const ParallelState* state);
  /// ids [B, T] -> final hidden states [B, T, C] (after ln_f), whole
  /// sequence on every rank; `attention_mask` [B, T] (1: a real token) and
  /// `position_ids` [B, T] (default 0 .. T - 1) as transformers takes them.
  /// `position_ids` without `attention_mask` may pack several documents in
  /// a row (packed_documents_mask).
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// A pipeline stage's part: embeddings of `ids` (first) or `hidden`,
  /// blocks [layers.begin, layers.end), then ln_f (last).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());

  shardformer::layer::VocabParallelEmbedding1D wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  shardformer::layer::Dropout drop{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  GPT2Config config_;
  const ParallelState* state_;
};
TORCH_MODULE(GPT2Model);

class GPT2LMHeadModelImpl : public torch::nn::Module,
                            public shardformer::ShardableModel {
 public:
  explicit GPT2LMHeadModelImpl(const GPT2Config& config = GPT2Config());
  /// ids [B, T] int64 -> logits [B, T, vocab] (with tensor parallelism and
  /// parallel_output: this rank's [B, T, V_pad / tp] vocabulary columns);
  /// `attention_mask` and `position_ids` as GPT2Model::forward.
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// A pipeline stage's part of `forward` (the last stage adds the head).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// A step of generation after what `cache` holds, as
  /// LlamaForCausalLM::forward_cached (NOTE [Generation]); positions past
  /// n_positions are refused.
  at::Tensor forward_cached(
      const at::Tensor& ids,
      KVCache& cache,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor(),
      int64_t logits_to_keep = 0);
  /// Mean cross entropy of `forward`'s logits against next-token targets
  /// [B, T] (aligned with the logits), sharded logits included.
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

  const GPT2Config& config() const {
    return config_;
  }
  ParallelState& parallel_state() {
    return state_;
  }
  std::shared_ptr<shardformer::Policy> default_policy() const override;

  GPT2Model transformer{nullptr};

 private:
  GPT2Config config_;
  ParallelState state_;
};
TORCH_MODULE(GPT2LMHeadModel);

/// Shards a GPT2LMHeadModel: wte vocabulary-parallel (and the tied head),
/// c_attn / c_fc column-parallel (c_attn as three fused sections), c_proj
/// row-parallel, heads split over the tensor group; split_gather sequence
/// parallelism splits the sequence between blocks over the tensor group,
/// all_to_all splits it over the sp group and exchanges heads around
/// attention. Blocks split evenly over pipeline stages.
class GPT2Policy : public LMPolicy {
 public:
  std::string name() const override {
    return "GPT2Policy";
  }
  shardformer::ShardInfo shard(
      torch::nn::Module& model,
      const shardformer::ShardConfig& config) override;
  int64_t num_pipeline_layers(const torch::nn::Module& model) const override;
  /// Embeddings on the first stage, ln_f and the tied head (wte) on the
  /// last.
  std::vector<std::string> held_layers(
      const torch::nn::Module& model,
      const shardformer::StageLayers& layers) const override;
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
