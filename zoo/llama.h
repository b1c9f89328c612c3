#pragma once

/// LLaMA with Hugging Face's layout (`LlamaForCausalLM`), written with the
/// tensor-parallel layers: RMSNorm, rotary position embeddings, SwiGLU MLP,
/// grouped-query attention, an untied LM head. Built whole it is a plain
/// model with Hugging Face's parameter names
/// (`model.layers.{i}.self_attn.q_proj.weight`, ...); `LlamaPolicy` shards
/// it in place.
///
/// Example:
/// \code
///   colossalai::zoo::LlamaForCausalLM model(
///       colossalai::zoo::LlamaConfig::tiny_test());
///   auto loss = model->loss(model->forward(ids), targets);
/// \endcode

#include <colossalai/nn/hookable_module.h>
#include <colossalai/shardformer/layer/embedding.h>
#include <colossalai/shardformer/layer/linear.h>
#include <colossalai/shardformer/layer/normalization.h>
#include <colossalai/shardformer/policy.h>
#include <zoo/transformer.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

namespace colossalai {
namespace zoo {

/// Hugging Face's LlamaConfig fields (defaults: LLaMA-7B).
struct LlamaConfig {
  /// vocab 100, width 32, MLP 64, 2 layers, 8 heads over 4 key/value heads,
  /// 32 positions.
  static LlamaConfig tiny_test();
  /// About gpt-small-cpu's size: vocab 4096, width 256, MLP 688, 4 layers,
  /// 4 heads over 2 key/value heads, 128 positions.
  static LlamaConfig small_cpu();

  TORCH_ARG(int64_t, vocab_size) = 32000;
  TORCH_ARG(int64_t, hidden_size) = 4096;
  TORCH_ARG(int64_t, intermediate_size) = 11008;
  TORCH_ARG(int64_t, num_hidden_layers) = 32;
  TORCH_ARG(int64_t, num_attention_heads) = 32;
  TORCH_ARG(int64_t, num_key_value_heads) = 32;
  TORCH_ARG(int64_t, max_position_embeddings) = 2048;
  TORCH_ARG(double, rms_norm_eps) = 1e-6;
  TORCH_ARG(double, rope_theta) = 10000.0;
  TORCH_ARG(double, initializer_range) = 0.02;
};

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& config, const ParallelState* state);
  /// x [B, T_local, C], positions [T_local] -> [B, T_local, C].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions);

  shardformer::layer::Linear1D_Col q_proj{nullptr}, k_proj{nullptr},
      v_proj{nullptr};
  shardformer::layer::Linear1D_Row o_proj{nullptr};

 private:
  LlamaConfig config_;
  const ParallelState* state_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  explicit LlamaMLPImpl(const LlamaConfig& config);
  /// down(silu(gate(x)) * up(x)).
  at::Tensor forward(const at::Tensor& x);

  shardformer::layer::Linear1D_Col gate_proj{nullptr}, up_proj{nullptr};
  shardformer::layer::Linear1D_Row down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

class LlamaDecoderLayerImpl : public torch::nn::Module,
                              public colossalai::nn::HookableModule {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& config, const ParallelState* state);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions);

  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  shardformer::layer::RMSNorm input_layernorm{nullptr};
  shardformer::layer::RMSNorm post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

class LlamaModelImpl : public torch::nn::Module {
 public:
  LlamaModelImpl(const LlamaConfig& config, const ParallelState* state);
  /// ids [B, T] -> normalised hidden states [B, T, C], whole sequence.
  at::Tensor forward(const at::Tensor& ids);
  /// A pipeline stage's part: embeddings (first) or `hidden`, layers
  /// [layers.begin, layers.end) (positions from `ids`), then norm (last).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden);

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
  /// columns under tensor parallelism with parallel_output).
  at::Tensor forward(const at::Tensor& ids);
  /// A pipeline stage's part of `forward` (the last stage adds lm_head).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden);
  /// Mean cross entropy against next-token targets [B, T].
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const;

  const LlamaConfig& config() const {
    return config_;
  }
  ParallelState& parallel_state() {
    return state_;
  }
  std::shared_ptr<shardformer::Policy> default_policy() const override;

  LlamaModel model{nullptr};
  shardformer::layer::VocabParallelLMHead1D lm_head{nullptr};

 private:
  LlamaConfig config_;
  ParallelState state_;
};
TORCH_MODULE(LlamaForCausalLM);

/// Shards a LlamaForCausalLM: embed_tokens and lm_head vocabulary-parallel,
/// q/k/v/gate/up column-parallel, o/down row-parallel, query and key/value
/// heads split over the tensor group (tp must divide num_key_value_heads);
/// sequence parallelism as GPT2Policy.
class LlamaPolicy : public shardformer::Policy {
 public:
  std::string name() const override {
    return "LlamaPolicy";
  }
  shardformer::ShardInfo shard(
      torch::nn::Module& model,
      const shardformer::ShardConfig& config) override;
  int64_t num_pipeline_layers(const torch::nn::Module& model) const override;
  /// embed_tokens on the first stage, norm and lm_head on the last.
  std::vector<std::string> held_layers(
      const torch::nn::Module& model,
      const shardformer::StageLayers& layers) const override;
  at::Tensor stage_forward(
      torch::nn::Module& model,
      const shardformer::StageLayers& layers,
      const std::vector<at::Tensor>& micro_batch,
      const at::Tensor& hidden) const override;
};

} // namespace zoo
} // namespace colossalai
