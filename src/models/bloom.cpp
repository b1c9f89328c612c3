#include <colossalai/models/bloom.h>

#include "model_init.h"

#include <colossalai/models/kv_cache.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace colossalai {
namespace models {

namespace sl = shardformer::layer;
using detail::col;
using detail::row;

BloomConfig BloomConfig::tiny_test() {
  return BloomConfig()
      .vocab_size(100)
      .hidden_size(32)
      .n_layer(2)
      .n_head(4)
      .hidden_dropout(0)
      .attention_dropout(0);
}

BloomConfig BloomConfig::small_cpu() {
  return BloomConfig()
      .vocab_size(4096)
      .hidden_size(256)
      .n_layer(4)
      .n_head(4)
      .hidden_dropout(0)
      .attention_dropout(0);
}

at::Tensor bloom_alibi_slopes(int64_t n_head) {
  TORCH_CHECK(n_head > 0, "bloom_alibi_slopes: n_head must be positive");
  // Hugging Face's _get_alibi_slopes, in float32 as it computes them.
  int64_t closest = 1;
  while (closest * 2 <= n_head) {
    closest *= 2;
  }
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const double base = std::pow(
      2.0, -std::pow(2.0, -(std::log2(static_cast<double>(closest)) - 3.0)));
  auto slopes = at::pow(
      at::full({}, base, opts),
      at::arange(1, 1 + closest, opts.dtype(at::kInt)));
  if (closest != n_head) {
    const double extra_base = std::pow(
        2.0,
        -std::pow(2.0, -(std::log2(static_cast<double>(2 * closest)) - 3.0)));
    const int64_t remaining = std::min(closest, n_head - closest);
    auto extra = at::pow(
        at::full({}, extra_base, opts),
        at::arange(1, 1 + 2 * remaining, 2, opts.dtype(at::kInt)));
    slopes = at::cat({slopes, extra}, 0);
  }
  return slopes;
}

namespace {

// Hugging Face's initialisation of BLOOM (PreTrainedModel's default):
// N(0, initializer_range) for linear weights and the embedding, zero
// biases, LayerNorms at one and zero.
torch::nn::LayerNorm layer_norm(const BloomConfig& c) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size()})
                                  .eps(c.layer_norm_epsilon()));
}

// The ALiBi bias of every key for this tensor rank's heads, float32
// [B or 1, H_local, 1, T]: slope x position, the positions counting only the
// real tokens of `attention_mask` (Hugging Face's build_alibi_tensor:
// (cumsum(mask) - 1) * mask), else 0 .. T - 1. The bias depends on the key
// only: softmax is invariant to a per-query shift, so it equals a bias of
// key - query distance.
// `slopes`: this rank's heads' slopes on `device`.
at::Tensor alibi_bias(
    const at::Tensor& attention_mask,
    int64_t t,
    const at::Tensor& slopes,
    const at::Device& device) {
  const int64_t heads = slopes.size(0);
  at::Tensor pos;
  if (attention_mask.defined()) {
    auto m = attention_mask.to(device).ne(0).to(at::kLong);
    pos = ((m.cumsum(-1) - 1) * m).to(at::kFloat); // [B, T]
  } else {
    pos = at::arange(t, at::TensorOptions().dtype(at::kFloat).device(device))
              .unsqueeze(0); // [1, T]
  }
  return slopes.view({1, heads, 1, 1}) * pos.view({pos.size(0), 1, 1, t});
}

} // namespace

BloomAttentionImpl::BloomAttentionImpl(
    const BloomConfig& c,
    const ParallelState* state,
    int64_t layer_idx)
    : n_head_(c.n_head()), head_dim_(0), state_(state), layer_idx_(layer_idx) {
  TORCH_CHECK(
      c.n_head() > 0 && c.hidden_size() % c.n_head() == 0,
      "BloomConfig: hidden_size (",
      c.hidden_size(),
      ") must be divisible by n_head (",
      c.n_head(),
      ")");
  head_dim_ = c.head_dim();
  const double std = c.initializer_range();
  // Hugging Face's output features are [n_head, 3, head_dim]: a plain column
  // split (one section) gives each rank whole heads with their q, k and v.
  query_key_value = register_module(
      "query_key_value", col(c.hidden_size(), 3 * c.hidden_size(), std));
  dense = register_module("dense", row(c.hidden_size(), c.hidden_size(), std));
  attention_dropout = register_module(
      "attention_dropout",
      sl::Dropout(sl::DropoutOptions(c.attention_dropout())));
  hidden_dropout = register_module(
      "hidden_dropout", sl::Dropout(sl::DropoutOptions(c.hidden_dropout())));
}

at::Tensor BloomAttentionImpl::forward(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& alibi,
    const at::Tensor& mask) {
  auto qkv = query_key_value(x); // [B, T, 3 C / tp]: the whole sequence
  const int64_t b = qkv.size(0), t = qkv.size(1), d = head_dim_;
  const int64_t heads = n_head_ / state_->tp_size();
  auto parts = qkv.view({b, t, heads, 3, d});
  auto q = parts.select(3, 0).transpose(1, 2); // [B, H, T, D]
  auto k = parts.select(3, 1).transpose(1, 2);
  auto v = parts.select(3, 2).transpose(1, 2);
  if (state_->kv_cache != nullptr) {
    std::tie(k, v) = state_->kv_cache->update(layer_idx_, k, v);
  }
  const int64_t tk = k.size(2); // keys: the cache's and these
  TORCH_CHECK(
      alibi.size(1) == heads && alibi.size(-1) == tk,
      "BloomAttention: the ALiBi bias ",
      alibi.sizes(),
      " does not match ",
      heads,
      " heads over ",
      tk,
      " keys");
  // [B * H, T, D] (keys [B * H, D, T]), as Hugging Face's baddbmm takes them.
  q = q.reshape({b * heads, t, d});
  k = k.reshape({b * heads, tk, d});
  v = v.reshape({b * heads, tk, d});
  auto bias = alibi.to(q.scalar_type())
                  .expand({b, heads, 1, tk})
                  .reshape({b * heads, 1, tk});
  // alibi + q k^T / sqrt(head_dim).
  auto scores = at::baddbmm(
                    bias,
                    q,
                    k.transpose(1, 2),
                    /*beta=*/1.0,
                    /*alpha=*/1.0 / std::sqrt(static_cast<double>(d)))
                    .view({b, heads, t, tk});
  auto hidden = mask.defined()
      ? mask.logical_not()
      : at::ones({t, t}, q.options().dtype(at::kBool)).triu(1);
  if (mask.defined()) {
    // A query with no key (left padding) attends to every key alike, as
    // transformers' eager Bloom computes it: its scores plus the mask's
    // float minimum are all that minimum, while autograd still passes the
    // scores their gradient through the sum.
    auto none = mask.any(-1, /*keepdim=*/true).logical_not();
    hidden = hidden.logical_and(none.logical_not());
    scores = at::where(none, scores - scores.detach(), scores);
  }
  // Softmax in float32, cast back to the activations' dtype.
  auto probs =
      at::softmax(
          scores.masked_fill(hidden, -std::numeric_limits<double>::infinity()),
          -1,
          at::kFloat)
          .to(q.scalar_type());
  probs = attention_dropout(probs);
  auto y = at::bmm(probs.view({b * heads, t, tk}), v)
               .view({b, heads, t, d})
               .permute({0, 2, 1, 3})
               .reshape({b, t, heads * d});
  return residual + hidden_dropout(dense(y));
}

BloomMLPImpl::BloomMLPImpl(const BloomConfig& c) {
  const double std = c.initializer_range();
  dense_h_to_4h = register_module(
      "dense_h_to_4h", col(c.hidden_size(), 4 * c.hidden_size(), std));
  dense_4h_to_h = register_module(
      "dense_4h_to_h", row(4 * c.hidden_size(), c.hidden_size(), std));
  hidden_dropout = register_module(
      "hidden_dropout", sl::Dropout(sl::DropoutOptions(c.hidden_dropout())));
}

at::Tensor BloomMLPImpl::forward(
    const at::Tensor& x,
    const at::Tensor& residual) {
  // Hugging Face's bloom_gelu_forward is the tanh approximation.
  return residual +
      hidden_dropout(detail::gelu_projected(
          *dense_4h_to_h, dense_h_to_4h(x), "tanh", recompute_activation));
}

BloomBlockImpl::BloomBlockImpl(
    const BloomConfig& c,
    const ParallelState* state,
    int64_t layer_idx)
    : post_layernorm_residual_(c.apply_residual_connection_post_layernorm()) {
  input_layernorm = register_module("input_layernorm", layer_norm(c));
  self_attention = register_module(
      "self_attention", BloomAttention(c, state, layer_idx));
  post_attention_layernorm =
      register_module("post_attention_layernorm", layer_norm(c));
  mlp = register_module("mlp", BloomMLP(c));
}

at::Tensor BloomBlockImpl::forward(
    const at::Tensor& x,
    const at::Tensor& alibi,
    const at::Tensor& mask) {
  auto scope = forward_scope();
  auto ln = input_layernorm(x);
  auto h = self_attention->forward(
      ln, post_layernorm_residual_ ? ln : x, alibi, mask);
  auto ln2 = post_attention_layernorm(h);
  return scope.exit(mlp->forward(ln2, post_layernorm_residual_ ? ln2 : h));
}

BloomModelImpl::BloomModelImpl(const BloomConfig& c, const ParallelState* state)
    : config_(c), state_(state) {
  word_embeddings = register_module(
      "word_embeddings",
      sl::VocabParallelEmbedding1D(
          sl::Embedding1DOptions(c.vocab_size(), c.hidden_size())));
  word_embeddings_layernorm =
      register_module("word_embeddings_layernorm", layer_norm(c));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer(); ++i) {
    h->push_back(BloomBlock(c, state, i));
  }
  ln_f = register_module("ln_f", layer_norm(c));
  torch::NoGradGuard no_grad;
  word_embeddings->weight.normal_(0.0, c.initializer_range());
}

at::Tensor BloomModelImpl::forward(
    const at::Tensor& ids,
    const at::Tensor& attention_mask) {
  return forward_stage(
      shardformer::StageLayers(), ids, at::Tensor(), attention_mask);
}

at::Tensor BloomModelImpl::forward_stage(
    const shardformer::StageLayers& layers,
    const at::Tensor& ids,
    const at::Tensor& hidden,
    const at::Tensor& attention_mask) {
  TORCH_CHECK(
      ids.dim() == 2, "BloomModel: ids must be [B, T], got ", ids.sizes());
  const auto& st = *state_;
  const int64_t t = ids.size(1);
  // Attention sees the whole sequence (split_gather gathers it in the
  // column layers): the whole sequence's mask and ALiBi positions.
  // A cached step's keys are all the cache's (no window) and these.
  const auto mask = st.kv_cache != nullptr
      ? st.kv_cache->begin_step(t, attention_mask, 0, ids.device())
      : attention_keep_mask(attention_mask, t, 0, ids.device());
  const int64_t keys =
      st.kv_cache != nullptr ? st.kv_cache->length() + t : t;
  // This rank's slopes, copied to the device once rather than every forward
  // (a copy from pageable host memory synchronises, and a CUDA graph cannot
  // capture it).
  const int64_t heads = config_.n_head() / st.tp_size();
  const int64_t rank = st.tp == nullptr ? 0 : st.tp->rank();
  if (!alibi_slopes_.defined() || alibi_slopes_.device() != ids.device() ||
      alibi_slopes_rank_ != rank || alibi_slopes_.size(0) != heads) {
    alibi_slopes_ = bloom_alibi_slopes(config_.n_head())
                        .narrow(0, rank * heads, heads)
                        .to(ids.device());
    alibi_slopes_rank_ = rank;
  }
  const auto alibi =
      alibi_bias(attention_mask, keys, alibi_slopes_, ids.device());
  at::Tensor x = hidden;
  if (layers.first) {
    x = split_sequence(word_embeddings_layernorm(word_embeddings(ids)), st);
  }
  TORCH_CHECK(x.defined(), "BloomModel: a later stage needs hidden states");
  x = run_stage_blocks<BloomBlockImpl>(
      st,
      layers,
      *h,
      x,
      [alibi, mask](BloomBlockImpl& block, const at::Tensor& y) {
        return block.forward(y, alibi, mask);
      });
  return layers.last ? gather_sequence(ln_f(x), st) : x;
}

BloomForCausalLMImpl::BloomForCausalLMImpl(const BloomConfig& config)
    : config_(config) {
  detail::register_checkpoint_hooks();
  transformer = register_module("transformer", BloomModel(config, &state_));
}

at::Tensor BloomForCausalLMImpl::forward(
    const at::Tensor& ids,
    const at::Tensor& attention_mask) {
  return forward_stage(
      shardformer::StageLayers(), ids, at::Tensor(), attention_mask);
}

at::Tensor BloomForCausalLMImpl::forward_stage(
    const shardformer::StageLayers& layers,
    const at::Tensor& ids,
    const at::Tensor& hidden,
    const at::Tensor& attention_mask) {
  auto x = transformer->forward_stage(layers, ids, hidden, attention_mask);
  if (!layers.last) {
    return x;
  }
  return tied_lm_head_logits(
      x, transformer->word_embeddings->weight, state_, config_.vocab_size());
}

at::Tensor BloomForCausalLMImpl::forward_cached(
    const at::Tensor& ids,
    KVCache& cache,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids,
    int64_t logits_to_keep) {
  (void)position_ids; // ALiBi: the mask gives the keys' positions
  CachedForward frame(state_, cache, "BloomForCausalLM");
  auto x = transformer->forward(ids, attention_mask);
  return frame.finish(
      x, logits_to_keep, config_.vocab_size(), [this](const at::Tensor& h) {
        return tied_lm_head_logits(
            h,
            transformer->word_embeddings->weight,
            state_,
            config_.vocab_size());
      });
}

at::Tensor BloomForCausalLMImpl::loss(
    const at::Tensor& logits,
    const at::Tensor& targets) const {
  return causal_lm_loss(logits, targets, state_, config_.vocab_size());
}

at::Tensor BloomForCausalLMImpl::forward_loss(
    const at::Tensor& ids,
    const at::Tensor& targets,
    const at::Tensor& attention_mask) {
  auto x = transformer->forward_stage(
      shardformer::StageLayers(), ids, at::Tensor(), attention_mask);
  const auto& w = transformer->word_embeddings->weight;
  return causal_lm_head_loss(
      x, w, targets, state_, config_.vocab_size(), [&](const at::Tensor& h) {
        return tied_lm_head_logits(h, w, state_, config_.vocab_size());
      });
}

std::shared_ptr<shardformer::Policy> BloomForCausalLMImpl::default_policy()
    const {
  return std::make_shared<BloomPolicy>();
}

shardformer::ShardInfo BloomPolicy::shard(
    torch::nn::Module& model,
    const shardformer::ShardConfig& cfg) {
  auto& m = policy_model<BloomForCausalLMImpl>(
      model, "BloomPolicy", "a BloomForCausalLM");
  const auto tp = cfg.tensor_parallel_process_group();
  const auto mode = cfg.sp_mode();
  // ALiBi positions and the mask are built for the whole sequence, which
  // attention sees under split_gather only.
  TORCH_CHECK(
      !shardformer::on_sp_group(mode),
      "BloomPolicy: sequence_parallelism_mode '",
      shardformer::to_string(mode),
      "' is not supported; BloomPolicy supports split_gather and ring");
  auto& st = m.parallel_state();
  configure_parallel_state(
      st, cfg, m.config().n_head(), "BloomPolicy", "n_head");

  auto& t = *m.transformer;
  shard_vocab_parallel(*t.word_embeddings, cfg);
  const bool split_gather = shardformer::on_tensor_group(mode);
  // Activations between blocks: sequence chunks under split_gather.
  const auto act_group = split_gather ? tp : st.sp;
  shardformer::ShardInfo info;
  for (size_t i = 0; i < t.h->size(); ++i) {
    auto* blk = t.h[i]->as<BloomBlockImpl>();
    auto& a = *blk->self_attention;
    auto& mlp = *blk->mlp;
    // One section: the fused q, k, v are interleaved per head.
    shard_linears(
        {a.query_key_value.get(), mlp.dense_h_to_4h.get()},
        {a.dense.get(), mlp.dense_4h_to_h.get()},
        tp,
        mode,
        cfg);
    set_dropout(a.attention_dropout, tp, true); // heads are split
    set_dropout(a.hidden_dropout, act_group, act_group != nullptr);
    set_dropout(mlp.hidden_dropout, act_group, act_group != nullptr);
    if (split_gather) {
      add_partial_grads(
          info,
          "transformer.h." + std::to_string(i) + ".",
          {"input_layernorm.weight",
           "input_layernorm.bias",
           "post_attention_layernorm.weight",
           "post_attention_layernorm.bias",
           "self_attention.dense.bias",
           "mlp.dense_4h_to_h.bias"});
    }
  }
  // word_embeddings_layernorm runs on the whole sequence, before the split:
  // its gradient is whole on every rank.
  if (split_gather) {
    add_partial_grads(info, "transformer.ln_f.", {"weight", "bias"});
  }
  return info;
}

int64_t BloomPolicy::num_pipeline_layers(const torch::nn::Module& model) const {
  return policy_model<BloomForCausalLMImpl>(
             model, "BloomPolicy", "a BloomForCausalLM")
      .config()
      .n_layer();
}

std::vector<std::string> BloomPolicy::held_layers(
    const torch::nn::Module& model,
    const shardformer::StageLayers& layers) const {
  const int64_t n = BloomPolicy::num_pipeline_layers(model);
  std::vector<std::string> names;
  if (layers.first) {
    names = {
        "transformer.word_embeddings", "transformer.word_embeddings_layernorm"};
  }
  append_stage_blocks(names, layers, n, "transformer.h.");
  if (layers.last) {
    names.push_back("transformer.ln_f");
    if (!layers.first) {
      names.push_back("transformer.word_embeddings"); // the tied head
    }
  }
  return names;
}

std::vector<std::string> BloomPolicy::shared_params(
    const torch::nn::Module&) const {
  return {"transformer.word_embeddings.weight"};
}

at::Tensor BloomPolicy::stage_forward(
    torch::nn::Module& model,
    const shardformer::StageLayers& layers,
    const std::vector<at::Tensor>& micro_batch,
    const at::Tensor& hidden) const {
  return causal_lm_stage_forward<BloomForCausalLMImpl, /*kPositions=*/false>(
      model, layers, micro_batch, hidden, "BloomPolicy", "a BloomForCausalLM");
}

} // namespace models
} // namespace colossalai
