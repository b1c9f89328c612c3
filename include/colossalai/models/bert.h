#pragma once

/// BERT with Hugging Face's layout (`BertForMaskedLM`), written with the
/// tensor-parallel layers: learned absolute positions and token types,
/// post-LayerNorm encoder blocks with bidirectional attention (padding keys
/// hidden by `attention_mask`), GELU, and the masked-LM head whose decoder
/// is tied to `bert.embeddings.word_embeddings` plus a bias of its own
/// (`cls.predictions.bias`). Built whole it is a plain model whose
/// parameter names are Hugging Face's (`bert.encoder.layer.{i}.attention.
/// self.query.weight`, ...), so its checkpoints load and save directly;
/// `BertPolicy` (or HybridParallelPlugin, which uses it) shards it in place.
///
/// Example:
/// \code
///   namespace models = colossalai::models;
///   models::BertForMaskedLM model(models::BertConfig::tiny_test());
///   // ids [B, T]; 1 for a real token, 0 for padding:
///   auto logits = model->forward(ids, attention_mask); // [B, T, vocab]
///   auto loss = model->loss(logits, labels); // -100: not a masked token
///   // Hugging Face directories:
///   auto bert = models::from_pretrained<models::BertForMaskedLM>("bert");
///   models::save_pretrained(bert, "bert-tuned");
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

/// Hugging Face's BertConfig fields (defaults: bert-base-uncased).
struct BertConfig {
  /// vocab 100 (not a multiple of 64: exercises the padding), width 32,
  /// 4 heads, 2 layers, intermediate 64, 32 positions, no dropout.
  static BertConfig tiny_test();
  /// About gpt-small-cpu's size: vocab 4096, width 256, 4 heads, 4 layers,
  /// intermediate 1024, 128 positions, no dropout.
  static BertConfig small_cpu();

  TORCH_ARG(int64_t, vocab_size) = 30522;
  TORCH_ARG(int64_t, hidden_size) = 768;
  TORCH_ARG(int64_t, num_hidden_layers) = 12;
  TORCH_ARG(int64_t, num_attention_heads) = 12;
  TORCH_ARG(int64_t, intermediate_size) = 3072;
  /// "gelu" (exact, erf) or "gelu_new" / "gelu_pytorch_tanh" (the tanh
  /// approximation); others are refused.
  TORCH_ARG(std::string, hidden_act) = "gelu";
  TORCH_ARG(double, hidden_dropout_prob) = 0.1;
  TORCH_ARG(double, attention_probs_dropout_prob) = 0.1;
  TORCH_ARG(int64_t, max_position_embeddings) = 512;
  TORCH_ARG(int64_t, type_vocab_size) = 2;
  TORCH_ARG(double, initializer_range) = 0.02;
  TORCH_ARG(double, layer_norm_eps) = 1e-12;
  /// word_embeddings' padding_idx: its row starts at zero and the lookups
  /// of this token give it no gradient (nn.Embedding's padding_idx); -1:
  /// none (config.json's null).
  TORCH_ARG(int64_t, pad_token_id) = 0;
  /// The config.json this config was read from (from_pretrained), so
  /// save_pretrained keeps the fields not modelled here; empty: none.
  TORCH_ARG(std::string, source_json) = "";
};

/// word + token type + position embeddings, LayerNorm, dropout.
class BertEmbeddingsImpl : public torch::nn::Module {
 public:
  explicit BertEmbeddingsImpl(const BertConfig& config);
  /// ids, token_type_ids, position_ids [B, T] (the last two may be [1, T];
  /// undefined: zeros and 0 .. T - 1) -> [B, T, C].
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& token_type_ids = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());

  shardformer::layer::VocabParallelEmbedding1D word_embeddings{nullptr};
  torch::nn::Embedding position_embeddings{nullptr};
  torch::nn::Embedding token_type_embeddings{nullptr};
  torch::nn::LayerNorm LayerNorm{nullptr};
  shardformer::layer::Dropout dropout{nullptr};

 private:
  BertConfig config_;
};
TORCH_MODULE(BertEmbeddings);

/// q, k, v projections and bidirectional softmax attention (no output
/// projection: that is BertSelfOutput's).
class BertSelfAttentionImpl : public torch::nn::Module {
 public:
  /// `state` is unused (BERT's attention has no sequence-parallel
  /// variant); taken as the other blocks take it.
  BertSelfAttentionImpl(const BertConfig& config, const ParallelState* state);
  /// x [B, T_local, C], `mask` [B, 1, 1, T] (true: a key to attend;
  /// undefined: every key) -> [B, T, C / tp] (the whole sequence under
  /// split_gather: the column layers gather it).
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& mask = at::Tensor());

  shardformer::layer::Linear1D_Col query{nullptr}, key{nullptr}, value{nullptr};
  shardformer::layer::Dropout dropout{nullptr}; ///< on the probabilities

 private:
  int64_t head_dim_;
};
TORCH_MODULE(BertSelfAttention);

/// LayerNorm(dropout(dense(h)) + input).
class BertSelfOutputImpl : public torch::nn::Module {
 public:
  explicit BertSelfOutputImpl(const BertConfig& config);
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& input);

  shardformer::layer::Linear1D_Row dense{nullptr};
  torch::nn::LayerNorm LayerNorm{nullptr};
  shardformer::layer::Dropout dropout{nullptr};
};
TORCH_MODULE(BertSelfOutput);

class BertAttentionImpl : public torch::nn::Module {
 public:
  BertAttentionImpl(const BertConfig& config, const ParallelState* state);
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& mask = at::Tensor());

  BertSelfAttention self{nullptr};
  BertSelfOutput output{nullptr};
};
TORCH_MODULE(BertAttention);

/// act(dense(x)), the MLP's first half.
class BertIntermediateImpl : public torch::nn::Module {
 public:
  explicit BertIntermediateImpl(const BertConfig& config);
  at::Tensor forward(const at::Tensor& x);

  shardformer::layer::Linear1D_Col dense{nullptr};

 private:
  std::string approximate_; ///< at::gelu's: "none" or "tanh"
};
TORCH_MODULE(BertIntermediate);

/// LayerNorm(dropout(dense(h)) + input), the MLP's second half.
class BertOutputImpl : public torch::nn::Module {
 public:
  explicit BertOutputImpl(const BertConfig& config);
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& input);

  shardformer::layer::Linear1D_Row dense{nullptr};
  torch::nn::LayerNorm LayerNorm{nullptr};
  shardformer::layer::Dropout dropout{nullptr};
};
TORCH_MODULE(BertOutput);

/// One post-LayerNorm encoder block: a = attention(x); output(
/// intermediate(a), a). Opens a ForwardScope, so FSDP and Gemini can make
/// each block a unit.
class BertLayerImpl : public torch::nn::Module,
                      public colossalai::nn::HookableModule {
 public:
  BertLayerImpl(const BertConfig& config, const ParallelState* state);
  at::Tensor forward(
      const at::Tensor& x,
      const at::Tensor& mask = at::Tensor());

  BertAttention attention{nullptr};
  BertIntermediate intermediate{nullptr};
  BertOutput output{nullptr};
};
TORCH_MODULE(BertLayer);

class BertEncoderImpl : public torch::nn::Module {
 public:
  BertEncoderImpl(const BertConfig& config, const ParallelState* state);

  torch::nn::ModuleList layer{nullptr}; ///< BertLayer
};
TORCH_MODULE(BertEncoder);

/// BertModel without the pooler (as BertForMaskedLM builds it).
class BertModelImpl : public torch::nn::Module {
 public:
  BertModelImpl(const BertConfig& config, const ParallelState* state);
  /// ids [B, T] -> the last hidden states [B, T, C], whole sequence on
  /// every rank; `attention_mask` [B, T] (1: a real token, 0: padding,
  /// hidden as a key), `token_type_ids` and `position_ids` as
  /// BertEmbeddings::forward.
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& token_type_ids = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// A pipeline stage's part: embeddings of `ids` (first) or `hidden`,
  /// layers [layers.begin, layers.end), then the whole sequence gathered
  /// (last).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& token_type_ids = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());

  BertEmbeddings embeddings{nullptr};
  BertEncoder encoder{nullptr};

 private:
  BertConfig config_;
  const ParallelState* state_;
};
TORCH_MODULE(BertModel);

/// LayerNorm(act(dense(x))).
class BertPredictionHeadTransformImpl : public torch::nn::Module {
 public:
  explicit BertPredictionHeadTransformImpl(const BertConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear dense{nullptr};
  torch::nn::LayerNorm LayerNorm{nullptr};

 private:
  std::string approximate_;
};
TORCH_MODULE(BertPredictionHeadTransform);

/// The transform and the decoder's bias; the decoder weight is the word
/// embedding (BertForMaskedLMImpl applies it).
class BertLMPredictionHeadImpl : public torch::nn::Module {
 public:
  explicit BertLMPredictionHeadImpl(const BertConfig& config);

  BertPredictionHeadTransform transform{nullptr};
  /// [vocab] (zeros at construction); under BertPolicy's tensor
  /// parallelism this rank's [V_pad / tp] slice, split as word_embeddings'
  /// rows (padding entries zero).
  at::Tensor bias;
};
TORCH_MODULE(BertLMPredictionHead);

class BertOnlyMLMHeadImpl : public torch::nn::Module {
 public:
  explicit BertOnlyMLMHeadImpl(const BertConfig& config);

  BertLMPredictionHead predictions{nullptr};
};
TORCH_MODULE(BertOnlyMLMHead);

class BertForMaskedLMImpl : public torch::nn::Module,
                            public shardformer::ShardableModel {
 public:
  explicit BertForMaskedLMImpl(const BertConfig& config = BertConfig());
  /// ids [B, T] int64 -> masked-LM logits [B, T, vocab] (with tensor
  /// parallelism and parallel_output: this rank's [B, T, V_pad / tp]
  /// vocabulary columns); the other inputs as BertModel::forward.
  at::Tensor forward(
      const at::Tensor& ids,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& token_type_ids = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// A pipeline stage's part of `forward` (the last stage adds the head).
  at::Tensor forward_stage(
      const shardformer::StageLayers& layers,
      const at::Tensor& ids,
      const at::Tensor& hidden,
      const at::Tensor& attention_mask = at::Tensor(),
      const at::Tensor& token_type_ids = at::Tensor(),
      const at::Tensor& position_ids = at::Tensor());
  /// Hugging Face's masked-LM loss: mean cross entropy of `forward`'s
  /// logits against `labels` [B, T] at the same positions (no shift) over
  /// the labels that are not -100; vocabulary-sharded logits included.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& labels) const;

  const BertConfig& config() const {
    return config_;
  }
  ParallelState& parallel_state() {
    return state_;
  }
  std::shared_ptr<shardformer::Policy> default_policy() const override;

  BertModel bert{nullptr};
  BertOnlyMLMHead cls{nullptr};

 private:
  BertConfig config_;
  ParallelState state_;
};
TORCH_MODULE(BertForMaskedLM);

/// Shards a BertForMaskedLM: word_embeddings vocabulary-parallel with the
/// tied decoder and cls.predictions.bias split as its rows, query / key /
/// value / intermediate.dense column-parallel, attention.output.dense and
/// output.dense row-parallel, heads split over the tensor group (tp must
/// divide num_attention_heads). Sequence parallelism: split_gather (and
/// ring) split the sequence between the column and row layers over the
/// tensor group; all_to_all and ring_attn are refused. Pipelines split the
/// encoder layers evenly; every stage's micro-batch is
/// {ids, labels, attention_mask, token_type_ids} (the last two optional;
/// the second, the criterion's labels, is not read by the forward).
class BertPolicy : public LMPolicy {
 public:
  std::string name() const override {
    return "BertPolicy";
  }
  shardformer::ShardInfo shard(
      torch::nn::Module& model,
      const shardformer::ShardConfig& config) override;
  int64_t num_pipeline_layers(const torch::nn::Module& model) const override;
  /// bert.embeddings on the first stage, cls and the tied decoder
  /// (word_embeddings) on the last.
  std::vector<std::string> held_layers(
      const torch::nn::Module& model,
      const shardformer::StageLayers& layers) const override;
  /// bert.embeddings.word_embeddings.weight (the tied decoder).
  std::vector<std::string> shared_params(
      const torch::nn::Module& model) const override;
  /// micro_batch[0]: ids [B, T]; [1]: labels (unused here); [2], optional:
  /// attention_mask [B, T]; [3], optional: token_type_ids [B, T].
  at::Tensor stage_forward(
      torch::nn::Module& model,
      const shardformer::StageLayers& layers,
      const std::vector<at::Tensor>& micro_batch,
      const at::Tensor& hidden) const override;
  std::vector<std::string> micro_batch_inputs() const override {
    return {"input_ids", "labels", "attention_mask", "token_type_ids"};
  }
};

/// A BertConfig from the text of a config.json (model_type bert); the text
/// is kept in `source_json`. Refused: hidden_act other than gelu, gelu_new
/// or gelu_pytorch_tanh, position_embedding_type other than absolute,
/// is_decoder or add_cross_attention true, an untied decoder.
BertConfig bert_config_from_json(const std::string& json);
/// config.json's text: `source_json` with the modelled fields written over
/// it, architectures ["BertForMaskedLM"].
std::string config_to_json(const BertConfig& config);

/// Reads a Hugging Face BertForMaskedLM directory (a BertForPreTraining or
/// bare BertModel checkpoint too: the pooler, the next-sentence head and
/// the tied decoder's tensors are skipped, a missing `bert.` prefix added,
/// old LayerNorm names gamma / beta read as weight / bias).
template <>
BertForMaskedLM from_pretrained<BertForMaskedLM>(
    const std::string& dir,
    const FromPretrainedOptions& options);

/// Writes config.json and the weights of a model held whole by this process
/// (the tied decoder is not written, as transformers does).
void save_pretrained(
    BertForMaskedLM& model,
    const std::string& dir,
    const SavePretrainedOptions& options = SavePretrainedOptions());

/// Writes only `dir`/config.json (beside weights a booster saved).
void save_pretrained_config(const BertConfig& config, const std::string& dir);

} // namespace models
} // namespace colossalai
