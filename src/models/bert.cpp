#include <colossalai/models/bert.h>

#include "model_init.h"

#include <colossalai/distributed/functional.h>
#include <colossalai/quantization/fp8_linear.h>
#include <colossalai/utils/compat.h>

#include <torch/nn/init.h>

namespace colossalai {
namespace models {

namespace cdf = distributed::functional;
namespace sl = shardformer::layer;
using detail::col;
using detail::init_normal;
using detail::init_zero;
using detail::row;

BertConfig BertConfig::tiny_test() {
  return BertConfig()
      .vocab_size(100)
      .hidden_size(32)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .intermediate_size(64)
      .max_position_embeddings(32)
      .hidden_dropout_prob(0)
      .attention_probs_dropout_prob(0);
}

BertConfig BertConfig::small_cpu() {
  return BertConfig()
      .vocab_size(4096)
      .hidden_size(256)
      .num_hidden_layers(4)
      .num_attention_heads(4)
      .intermediate_size(1024)
      .max_position_embeddings(128)
      .hidden_dropout_prob(0)
      .attention_probs_dropout_prob(0);
}

namespace {

// Hugging Face's BERT initialisation (PreTrainedModel._init_weights):
// N(0, initializer_range) for linear weights and embeddings, zero biases
// (cls.predictions.bias too) and the padding token's embedding row,
// LayerNorm at ones and zeros (LibTorch's own).
// at::gelu's `approximate` for hidden_act (ACT2FN: "gelu" is the exact erf
// form, "gelu_new" and "gelu_pytorch_tanh" the tanh approximation).
std::string gelu_approximation(const BertConfig& c) {
  const auto& act = c.hidden_act();
  if (act == "gelu") {
    return "none";
  }
  TORCH_CHECK(
      act == "gelu_new" || act == "gelu_pytorch_tanh",
      "BertConfig: hidden_act '",
      act,
      "' is not supported (gelu, gelu_new, gelu_pytorch_tanh)");
  return "tanh";
}

// A 16-bit activation (autocast's) beside float32 weights included.
at::Tensor norm(const torch::nn::LayerNorm& ln, const at::Tensor& x) {
  const auto& o = ln->options;
  return compat::layer_norm(
      x, o.normalized_shape(), ln->weight, ln->bias, o.eps());
}

torch::nn::LayerNorm layer_norm(const BertConfig& c) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({c.hidden_size()}).eps(c.layer_norm_eps()));
}

sl::Dropout make_dropout(double p) {
  return sl::Dropout(sl::DropoutOptions(p));
}

// Bidirectional softmax attention of q, k, v [B, H, T, D]: `mask`
// (optional, [B, 1, 1, T], true: a key to attend) hides padding keys. The
// fused kernel without a mask or active dropout; else `attention` with a
// mask (non-causal), dropping probabilities through `dropout`.
at::Tensor bidirectional_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    sl::DropoutImpl* dropout,
    const at::Tensor& mask) {
  const bool drops = dropout != nullptr && dropout->is_training() &&
      dropout->options.p() > 0.0;
  if (!mask.defined() && !drops) {
    return compat::scaled_dot_product_attention(
        q, k, v, /*mask=*/c10::nullopt, /*is_causal=*/false);
  }
  // `attention` is causal without a mask: every key, explicitly.
  const at::Tensor keep = mask.defined()
      ? mask
      : at::ones({1, 1, 1, k.size(2)}, q.options().dtype(at::kBool));
  return attention(q, k, v, drops ? dropout : nullptr, keep);
}

// The keys each query may see: [B, 1, 1, T] from Hugging Face's
// attention_mask [B, T] (1: a real token); undefined without one. A
// sequence with no real token sees every key (as transformers' additive
// mask of the dtype's minimum does), so its outputs stay finite.
at::Tensor key_mask(
    const at::Tensor& attention_mask,
    int64_t b,
    int64_t t,
    const at::Device& device) {
  if (!attention_mask.defined()) {
    return at::Tensor();
  }
  TORCH_CHECK(
      attention_mask.dim() == 2 && attention_mask.size(1) == t &&
          (attention_mask.size(0) == b || attention_mask.size(0) == 1),
      "BertModel: attention_mask must be [B, T] like ids [",
      b,
      ", ",
      t,
      "], got ",
      attention_mask.sizes());
  auto keep =
      attention_mask.to(device).ne(0).view({attention_mask.size(0), 1, 1, t});
  return keep.logical_or(keep.any(-1, /*keepdim=*/true).logical_not());
}

// An optional [B, T] or [1, T] index input of BertEmbeddings.
void check_ids_like(
    const at::Tensor& x,
    const at::Tensor& ids,
    const char* what) {
  TORCH_CHECK(
      !x.defined() ||
          (x.dim() == 2 && x.size(1) == ids.size(1) &&
           (x.size(0) == ids.size(0) || x.size(0) == 1)),
      "BertModel: ",
      what,
      " must be [B, T] like ids ",
      ids.sizes(),
      ", got ",
      x.sizes());
}

} // namespace

BertEmbeddingsImpl::BertEmbeddingsImpl(const BertConfig& c) : config_(c) {
  TORCH_CHECK(
      c.type_vocab_size() >= 1,
      "BertConfig: type_vocab_size must be at least 1, got ",
      c.type_vocab_size());
  TORCH_CHECK(
      c.pad_token_id() < c.vocab_size(),
      "BertConfig: pad_token_id (",
      c.pad_token_id(),
      ") must be below vocab_size (",
      c.vocab_size(),
      ")");
  word_embeddings = register_module(
      "word_embeddings",
      sl::VocabParallelEmbedding1D(
          sl::Embedding1DOptions(c.vocab_size(), c.hidden_size())));
  position_embeddings = register_module(
      "position_embeddings",
      torch::nn::Embedding(c.max_position_embeddings(), c.hidden_size()));
  token_type_embeddings = register_module(
      "token_type_embeddings",
      torch::nn::Embedding(c.type_vocab_size(), c.hidden_size()));
  LayerNorm = register_module("LayerNorm", layer_norm(c));
  dropout = register_module("dropout", make_dropout(c.hidden_dropout_prob()));
  init_normal(word_embeddings->weight, c.initializer_range());
  init_normal(position_embeddings->weight, c.initializer_range());
  init_normal(token_type_embeddings->weight, c.initializer_range());
  if (c.pad_token_id() >= 0) {
    torch::NoGradGuard no_grad;
    word_embeddings->weight.narrow(0, c.pad_token_id(), 1).zero_();
  }
}

at::Tensor BertEmbeddingsImpl::forward(
    const at::Tensor& ids,
    const at::Tensor& token_type_ids,
    const at::Tensor& position_ids) {
  const int64_t t = ids.size(1);
  // The tied decoder still gives the padding row a gradient.
  auto words = without_padding_grad(
      word_embeddings(ids),
      ids,
      config_.pad_token_id(),
      word_embeddings->weight);
  // Hugging Face's order: (words + token types) + positions.
  auto x = token_type_ids.defined()
      ? words + token_type_embeddings(token_type_ids)
      : words + token_type_embeddings->weight.select(0, 0);
  x = x +
      position_embeddings(
          position_ids.defined()
              ? position_ids
              : at::arange(t, ids.options().dtype(at::kLong)));
  return dropout(norm(LayerNorm, x));
}

BertSelfAttentionImpl::BertSelfAttentionImpl(
    const BertConfig& c,
    const ParallelState* /*state*/) {
  const int64_t h = c.num_attention_heads();
  TORCH_CHECK(
      h > 0 && c.hidden_size() % h == 0,
      "BertConfig: hidden_size (",
      c.hidden_size(),
      ") must be divisible by num_attention_heads (",
      h,
      ")");
  head_dim_ = c.hidden_size() / h;
  const double std = c.initializer_range();
  query = register_module("query", col(c.hidden_size(), c.hidden_size(), std));
  key = register_module("key", col(c.hidden_size(), c.hidden_size(), std));
  value = register_module("value", col(c.hidden_size(), c.hidden_size(), std));
  dropout = register_module(
      "dropout", make_dropout(c.attention_probs_dropout_prob()));
}

at::Tensor BertSelfAttentionImpl::forward(
    const at::Tensor& x,
    const at::Tensor& mask) {
  const int64_t b = x.size(0);
  // One shared input for q, k and v: one gradient sum over tp, not three,
  // and under autocast one cast kept, not three.
  const auto qkv =
      sl::forward_shared_input({query.get(), key.get(), value.get()}, x);
  const int64_t t = qkv[0].size(1); // the whole sequence under split_gather
  auto q = qkv[0].view({b, t, -1, head_dim_}).transpose(1, 2);
  auto k = qkv[1].view({b, t, -1, head_dim_}).transpose(1, 2);
  auto v = qkv[2].view({b, t, -1, head_dim_}).transpose(1, 2);
  auto y = bidirectional_attention(q, k, v, dropout.get(), mask)
               .transpose(1, 2); // [B, T, H / tp, D]
  return y.reshape({b, t, -1});
}

BertSelfOutputImpl::BertSelfOutputImpl(const BertConfig& c) {
  dense = register_module(
      "dense", row(c.hidden_size(), c.hidden_size(), c.initializer_range()));
  LayerNorm = register_module("LayerNorm", layer_norm(c));
  dropout = register_module("dropout", make_dropout(c.hidden_dropout_prob()));
}

at::Tensor BertSelfOutputImpl::forward(
    const at::Tensor& hidden,
    const at::Tensor& input) {
  return norm(LayerNorm, dropout(dense(hidden)) + input);
}

BertAttentionImpl::BertAttentionImpl(
    const BertConfig& c,
    const ParallelState* state) {
  self = register_module("self", BertSelfAttention(c, state));
  output = register_module("output", BertSelfOutput(c));
}

at::Tensor BertAttentionImpl::forward(
    const at::Tensor& x,
    const at::Tensor& mask) {
  return output(self(x, mask), x);
}

BertIntermediateImpl::BertIntermediateImpl(const BertConfig& c)
    : approximate_(gelu_approximation(c)) {
  dense = register_module(
      "dense",
      col(c.hidden_size(), c.intermediate_size(), c.initializer_range()));
}

at::Tensor BertIntermediateImpl::forward(const at::Tensor& x) {
  return at::gelu(dense(x), approximate_);
}

BertOutputImpl::BertOutputImpl(const BertConfig& c) {
  dense = register_module(
      "dense",
      row(c.intermediate_size(), c.hidden_size(), c.initializer_range()));
  LayerNorm = register_module("LayerNorm", layer_norm(c));
  dropout = register_module("dropout", make_dropout(c.hidden_dropout_prob()));
}

at::Tensor BertOutputImpl::forward(
    const at::Tensor& hidden,
    const at::Tensor& input) {
  return norm(LayerNorm, dropout(dense(hidden)) + input);
}

BertLayerImpl::BertLayerImpl(const BertConfig& c, const ParallelState* state) {
  attention = register_module("attention", BertAttention(c, state));
  intermediate = register_module("intermediate", BertIntermediate(c));
  output = register_module("output", BertOutput(c));
}

at::Tensor BertLayerImpl::forward(const at::Tensor& x, const at::Tensor& mask) {
  auto scope = forward_scope();
  auto a = attention(x, mask);
  return scope.exit(output(intermediate(a), a));
}

BertEncoderImpl::BertEncoderImpl(
    const BertConfig& c,
    const ParallelState* state) {
  layer = register_module("layer", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers(); ++i) {
    layer->push_back(BertLayer(c, state));
  }
}

BertModelImpl::BertModelImpl(const BertConfig& c, const ParallelState* state)
    : config_(c), state_(state) {
  embeddings = register_module("embeddings", BertEmbeddings(c));
  encoder = register_module("encoder", BertEncoder(c, state));
}

at::Tensor BertModelImpl::forward(
    const at::Tensor& ids,
    const at::Tensor& attention_mask,
    const at::Tensor& token_type_ids,
    const at::Tensor& position_ids) {
  return forward_stage(
      shardformer::StageLayers(),
      ids,
      at::Tensor(),
      attention_mask,
      token_type_ids,
      position_ids);
}

at::Tensor BertModelImpl::forward_stage(
    const shardformer::StageLayers& layers,
    const at::Tensor& ids,
    const at::Tensor& hidden,
    const at::Tensor& attention_mask,
    const at::Tensor& token_type_ids,
    const at::Tensor& position_ids) {
  const auto& st = *state_;
  TORCH_CHECK(
      ids.dim() == 2, "BertModel: ids must be [B, T], got ", ids.sizes());
  TORCH_CHECK(
      position_ids.defined() ||
          ids.size(1) <= config_.max_position_embeddings(),
      "BertModel: the sequence length ",
      ids.size(1),
      " exceeds max_position_embeddings (",
      config_.max_position_embeddings(),
      ")");
  check_ids_like(token_type_ids, ids, "token_type_ids");
  check_ids_like(position_ids, ids, "position_ids");
  // Attention sees the whole sequence (split_gather's column layers gather
  // it): the mask is the whole sequence's.
  const auto mask =
      key_mask(attention_mask, ids.size(0), ids.size(1), ids.device());
  at::Tensor x = hidden;
  if (layers.first) {
    x = split_sequence(embeddings(ids, token_type_ids, position_ids), st);
  }
  TORCH_CHECK(x.defined(), "BertModel: a later stage needs hidden states");
  x = run_stage_blocks<BertLayerImpl>(
      st,
      layers,
      *encoder->layer,
      x,
      [mask](BertLayerImpl& block, const at::Tensor& y) {
        return block.forward(y, mask);
      });
  return layers.last ? gather_sequence(x, st) : x;
}

BertPredictionHeadTransformImpl::BertPredictionHeadTransformImpl(
    const BertConfig& c)
    : approximate_(gelu_approximation(c)) {
  dense = register_module(
      "dense", torch::nn::Linear(c.hidden_size(), c.hidden_size()));
  LayerNorm = register_module("LayerNorm", layer_norm(c));
  init_normal(dense->weight, c.initializer_range());
  init_zero(dense->bias);
}

at::Tensor BertPredictionHeadTransformImpl::forward(const at::Tensor& x) {
  return norm(
      LayerNorm,
      at::gelu(
          quantization::linear(x, dense->weight, dense->bias), approximate_));
}

BertLMPredictionHeadImpl::BertLMPredictionHeadImpl(const BertConfig& c) {
  transform = register_module("transform", BertPredictionHeadTransform(c));
  bias = register_parameter("bias", at::zeros({c.vocab_size()}));
}

BertOnlyMLMHeadImpl::BertOnlyMLMHeadImpl(const BertConfig& c) {
  predictions = register_module("predictions", BertLMPredictionHead(c));
}

BertForMaskedLMImpl::BertForMaskedLMImpl(const BertConfig& config)
    : config_(config) {
  detail::register_checkpoint_hooks();
  bert = register_module("bert", BertModel(config, &state_));
  cls = register_module("cls", BertOnlyMLMHead(config));
}

at::Tensor BertForMaskedLMImpl::forward(
    const at::Tensor& ids,
    const at::Tensor& attention_mask,
    const at::Tensor& token_type_ids,
    const at::Tensor& position_ids) {
  return forward_stage(
      shardformer::StageLayers(),
      ids,
      at::Tensor(),
      attention_mask,
      token_type_ids,
      position_ids);
}

at::Tensor BertForMaskedLMImpl::forward_stage(
    const shardformer::StageLayers& layers,
    const at::Tensor& ids,
    const at::Tensor& hidden,
    const at::Tensor& attention_mask,
    const at::Tensor& token_type_ids,
    const at::Tensor& position_ids) {
  auto x = bert->forward_stage(
      layers, ids, hidden, attention_mask, token_type_ids, position_ids);
  if (!layers.last) {
    return x;
  }
  auto& head = *cls->predictions;
  // The decoder: the tied word embedding (this rank's vocabulary rows under
  // tp) plus cls.predictions.bias, split as those rows.
  auto logits = sl::lm_head_logits(
      head.transform(x),
      bert->embeddings->word_embeddings->weight,
      state_.tp,
      /*gather_output=*/false,
      /*vocab_size=*/-1,
      state_.fp8);
  logits = logits + head.bias.to(logits.scalar_type());
  if (state_.parallel_output) {
    return logits;
  }
  // ColossalAI's parallel_output false: the whole vocabulary, padding cut.
  auto full = cdf::gather_along_dim(logits, -1, state_.tp, state_.fp8);
  return full.size(-1) > config_.vocab_size()
      ? full.narrow(-1, 0, config_.vocab_size())
      : full;
}

at::Tensor BertForMaskedLMImpl::loss(
    const at::Tensor& logits,
    const at::Tensor& labels) const {
  TORCH_CHECK(
      logits.dim() == 3 && labels.dim() == 2 &&
          logits.size(0) == labels.size(0) && logits.size(1) == labels.size(1),
      "BertForMaskedLM.loss: logits must be [B, T, V] and labels [B, T], "
      "got ",
      logits.sizes(),
      " and ",
      labels.sizes());
  const bool sharded = state_.tp_size() > 1 && state_.parallel_output;
  return sl::vocab_parallel_cross_entropy(
      logits.flatten(0, 1),
      labels.flatten(),
      sharded ? state_.tp : nullptr,
      config_.vocab_size(),
      /*ignore_index=*/-100);
}

std::shared_ptr<shardformer::Policy> BertForMaskedLMImpl::default_policy()
    const {
  return std::make_shared<BertPolicy>();
}

} // namespace models
} // namespace colossalai
