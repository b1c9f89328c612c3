#include <colossalai/models/opt.h>

#include "model_init.h"

#include <colossalai/models/kv_cache.h>
#include <colossalai/quantization/fp8_linear.h>

#include <torch/nn/init.h>

namespace colossalai {
namespace models {

namespace sl = shardformer::layer;
using detail::init_normal;
using detail::init_zero;

OPTConfig OPTConfig::tiny_test() {
  return OPTConfig()
      .vocab_size(100)
      .hidden_size(32)
      .ffn_dim(64)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .max_position_embeddings(32)
      .dropout(0)
      .attention_dropout(0);
}

OPTConfig OPTConfig::small_cpu() {
  return OPTConfig()
      .vocab_size(4096)
      .hidden_size(256)
      .ffn_dim(1024)
      .num_hidden_layers(4)
      .num_attention_heads(4)
      .max_position_embeddings(128)
      .dropout(0)
      .attention_dropout(0);
}

namespace {

// OPT's learned positions: position p reads row p + 2 of embed_positions
// (fairseq kept rows 0 and 1 for its padding index).
constexpr int64_t kPositionOffset = 2;

// Hugging Face's initialisation (OPTPreTrainedModel with init_std):
// N(0, init_std) for linear weights and embeddings, zero biases, LayerNorm
// weights one and biases zero (LibTorch's default).
sl::Linear1D_Col col(int64_t in, int64_t out, const OPTConfig& c) {
  sl::Linear1D_Col m(sl::Linear1DOptions(in, out).bias(c.enable_bias()));
  init_normal(m->weight, c.init_std());
  init_zero(m->bias);
  return m;
}

sl::Linear1D_Row row(int64_t in, int64_t out, const OPTConfig& c) {
  sl::Linear1D_Row m(sl::Linear1DOptions(in, out).bias(c.enable_bias()));
  init_normal(m->weight, c.init_std());
  init_zero(m->bias);
  return m;
}

torch::nn::Linear projection(int64_t in, int64_t out, const OPTConfig& c) {
  torch::nn::Linear m(torch::nn::LinearOptions(in, out).bias(false));
  init_normal(m->weight, c.init_std());
  return m;
}

// nn.LayerNorm(hidden_size, elementwise_affine=...) with its default eps.
torch::nn::LayerNorm layer_norm(const OPTConfig& c) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({c.hidden_size()})
          .eps(1e-5)
          .elementwise_affine(c.layer_norm_elementwise_affine()));
}

} // namespace

OPTAttentionImpl::OPTAttentionImpl(
    const OPTConfig& c,
    const ParallelState* state,
    int64_t layer_idx)
    : head_dim_(
          c.num_attention_heads() > 0
              ? c.hidden_size() / c.num_attention_heads()
              : 0),
      state_(state),
      layer_idx_(layer_idx) {
  TORCH_CHECK(
      c.num_attention_heads() > 0 &&
          c.hidden_size() % c.num_attention_heads() == 0,
      "OPTConfig: hidden_size (",
      c.hidden_size(),
      ") must be divisible by num_attention_heads (",
      c.num_attention_heads(),
      ")");
  const int64_t e = c.hidden_size();
  // Hugging Face's registration order (k, v, q, out).
  k_proj = register_module("k_proj", col(e, e, c));
  v_proj = register_module("v_proj", col(e, e, c));
  q_proj = register_module("q_proj", col(e, e, c));
  out_proj = register_module("out_proj", row(e, e, c));
  dropout = register_module(
      "dropout", sl::Dropout(sl::DropoutOptions(c.attention_dropout())));
}

at::Tensor OPTAttentionImpl::forward(
    const at::Tensor& x,
    const at::Tensor& mask) {
  // One shared input for q, k and v: one gradient sum over tp, not three,
  // and under autocast one cast kept, not three.
  const auto qkv =
      sl::forward_shared_input({q_proj.get(), k_proj.get(), v_proj.get()}, x);
  const int64_t b = qkv[0].size(0);
  const int64_t t = qkv[0].size(1); // whole sequence under split_gather
  // Heads per rank: num_heads / tp (the column layers' output features).
  auto q = qkv[0].view({b, t, -1, head_dim_}).transpose(1, 2);
  auto k = qkv[1].view({b, t, -1, head_dim_}).transpose(1, 2);
  auto v = qkv[2].view({b, t, -1, head_dim_}).transpose(1, 2);
  if (state_->kv_cache != nullptr) {
    std::tie(k, v) = state_->kv_cache->update(layer_idx_, k, v);
  }
  // Hugging Face scales q by head_dim^-0.5 before q k^T; attention() scales
  // the product: the same softmax.
  const bool drop = dropout->options.p() > 0 && is_training();
  auto y =
      sequence_attention(q, k, v, *state_, drop ? dropout.get() : nullptr, mask)
          .transpose(1, 2); // [B, T, H, D]
  return out_proj(y.reshape({b, y.size(1), -1}));
}

OPTDecoderLayerImpl::OPTDecoderLayerImpl(
    const OPTConfig& c,
    const ParallelState* state,
    int64_t layer_idx)
    : pre_ln_(c.do_layer_norm_before()),
      gelu_(c.activation_function() == "gelu") {
  TORCH_CHECK(
      c.activation_function() == "relu" || c.activation_function() == "gelu",
      "OPTConfig: activation_function '",
      c.activation_function(),
      "' is not supported (relu, gelu)");
  self_attn = register_module("self_attn", OPTAttention(c, state, layer_idx));
  self_attn_layer_norm = register_module("self_attn_layer_norm", layer_norm(c));
  fc1 = register_module("fc1", col(c.hidden_size(), c.ffn_dim(), c));
  fc2 = register_module("fc2", row(c.ffn_dim(), c.hidden_size(), c));
  final_layer_norm = register_module("final_layer_norm", layer_norm(c));
  dropout =
      register_module("dropout", sl::Dropout(sl::DropoutOptions(c.dropout())));
}

at::Tensor OPTDecoderLayerImpl::forward(
    const at::Tensor& x,
    const at::Tensor& mask) {
  auto scope = forward_scope();
  // Attention: LayerNorm before (125m, 1.3b, ...) or after (350m).
  auto h = x +
      dropout(self_attn->forward(pre_ln_ ? self_attn_layer_norm(x) : x, mask));
  if (!pre_ln_) {
    h = self_attn_layer_norm(h);
  }
  // MLP.
  auto m = fc1(pre_ln_ ? final_layer_norm(h) : h);
  m = gelu_ ? at::gelu(m) : at::relu(m);
  h = h + dropout(fc2(m));
  if (!pre_ln_) {
    h = final_layer_norm(h);
  }
  return scope.exit(h);
}

OPTDecoderImpl::OPTDecoderImpl(const OPTConfig& c, const ParallelState* state)
    : config_(c), state_(state) {
  TORCH_CHECK(
      c.max_position_embeddings() > 0,
      "OPTConfig: max_position_embeddings must be positive, got ",
      c.max_position_embeddings());
  const int64_t word_dim = c.resolved_word_embed_proj_dim();
  embed_tokens = register_module(
      "embed_tokens",
      sl::VocabParallelEmbedding1D(
          sl::Embedding1DOptions(c.vocab_size(), word_dim)));
  embed_positions = register_module(
      "embed_positions",
      torch::nn::Embedding(
          c.max_position_embeddings() + kPositionOffset, c.hidden_size()));
  if (c.has_projections()) {
    project_out = register_module(
        "project_out", projection(c.hidden_size(), word_dim, c));
    project_in =
        register_module("project_in", projection(word_dim, c.hidden_size(), c));
  }
  if (c.do_layer_norm_before()) {
    final_layer_norm = register_module("final_layer_norm", layer_norm(c));
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers(); ++i) {
    layers->push_back(OPTDecoderLayer(c, state, i));
  }
  init_normal(embed_tokens->weight, c.init_std());
  init_normal(embed_positions->weight, c.init_std());
  if (c.pad_token_id() >= 0 && c.pad_token_id() < c.vocab_size()) {
    torch::NoGradGuard no_grad;
    embed_tokens->weight[c.pad_token_id()].zero_(); // padding_idx's row
  }
}

at::Tensor OPTDecoderImpl::forward(
    const at::Tensor& ids,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  return forward_stage(
      shardformer::StageLayers(),
      ids,
      at::Tensor(),
      attention_mask,
      position_ids);
}

at::Tensor OPTDecoderImpl::forward_stage(
    const shardformer::StageLayers& stage,
    const at::Tensor& ids,
    const at::Tensor& hidden,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  TORCH_CHECK(
      ids.dim() == 2, "OPTDecoder: ids must be [B, T], got ", ids.sizes());
  check_position_ids(ids, position_ids, "OPTDecoder");
  const auto& st = *state_;
  const bool cached = st.kv_cache != nullptr;
  TORCH_CHECK(
      cached || !attention_mask.defined() ||
          attention_mask.sizes() == ids.sizes(),
      "OPTDecoder: attention_mask must be [B, T] like ids ",
      ids.sizes(),
      ", got ",
      attention_mask.sizes());
  const int64_t t = ids.size(1);
  const int64_t past = cached ? st.kv_cache->length() : 0;
  const auto mask = cached
      ? st.kv_cache->begin_step(t, attention_mask, 0, ids.device())
      : attention_keep_mask(attention_mask, t, 0, ids.device());
  at::Tensor x = hidden;
  if (stage.first) {
    // Positions as transformers: given, else from the padding mask (padding
    // does not advance them; a padding token's is -1), else 0 .. T - 1
    // (after the cache's).
    TORCH_CHECK(
        position_ids.defined() || past + t <= config_.max_position_embeddings(),
        "OPTDecoder: the sequence (",
        past + t,
        " tokens) is longer than max_position_embeddings (",
        config_.max_position_embeddings(),
        ")");
    at::Tensor pos;
    if (position_ids.defined()) {
      pos = position_ids.to(ids.device(), at::kLong);
    } else if (attention_mask.defined()) {
      auto real = attention_mask.to(ids.device()).ne(0).to(at::kLong);
      pos = (at::cumsum(real, 1) * real - 1).narrow(1, past, t);
    } else {
      pos = step_positions(st, t, ids.device());
    }
    if (cached) {
      const int64_t last = pos.max().item<int64_t>();
      TORCH_CHECK(
          last < config_.max_position_embeddings(),
          "OPTDecoder: generation reached position ",
          last,
          ", beyond the learned positions (max_position_embeddings ",
          config_.max_position_embeddings(),
          ")");
    }
    auto tokens = without_padding_grad(
        embed_tokens(ids),
        ids,
        config_.pad_token_id(),
        embed_tokens->weight);
    if (project_in) {
      tokens = quantization::linear(tokens, project_in->weight, {});
    }
    x = split_sequence(tokens + embed_positions(pos + kPositionOffset), st);
  }
  TORCH_CHECK(x.defined(), "OPTDecoder: a later stage needs hidden states");
  x = run_stage_blocks<OPTDecoderLayerImpl>(
      st,
      stage,
      *layers,
      x,
      [mask](OPTDecoderLayerImpl& layer, const at::Tensor& y) {
        return layer.forward(y, mask);
      });
  if (!stage.last) {
    return x;
  }
  if (final_layer_norm) {
    x = final_layer_norm(x);
  }
  x = gather_sequence(x, st);
  return project_out ? quantization::linear(x, project_out->weight, {}) : x;
}

OPTModelImpl::OPTModelImpl(const OPTConfig& c, const ParallelState* state) {
  decoder = register_module("decoder", OPTDecoder(c, state));
}

at::Tensor OPTModelImpl::forward(
    const at::Tensor& ids,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  return decoder->forward(ids, attention_mask, position_ids);
}

OPTForCausalLMImpl::OPTForCausalLMImpl(const OPTConfig& c) : config_(c) {
  detail::register_checkpoint_hooks();
  model = register_module("model", OPTModel(c, &state_));
}

at::Tensor OPTForCausalLMImpl::forward(
    const at::Tensor& ids,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  return forward_stage(
      shardformer::StageLayers(),
      ids,
      at::Tensor(),
      attention_mask,
      position_ids);
}

at::Tensor OPTForCausalLMImpl::forward_stage(
    const shardformer::StageLayers& layers,
    const at::Tensor& ids,
    const at::Tensor& hidden,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  auto& decoder = *model->decoder;
  auto x =
      decoder.forward_stage(layers, ids, hidden, attention_mask, position_ids);
  if (!layers.last) {
    return x;
  }
  return tied_lm_head_logits(
      x, decoder.embed_tokens->weight, state_, config_.vocab_size());
}

at::Tensor OPTForCausalLMImpl::forward_cached(
    const at::Tensor& ids,
    KVCache& cache,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids,
    int64_t logits_to_keep) {
  CachedForward frame(state_, cache, "OPTForCausalLM");
  auto& decoder = *model->decoder;
  auto x = decoder.forward(ids, attention_mask, position_ids);
  return frame.finish(
      x,
      logits_to_keep,
      config_.vocab_size(),
      [this, &decoder](const at::Tensor& h) {
        return tied_lm_head_logits(
            h, decoder.embed_tokens->weight, state_, config_.vocab_size());
      });
}

at::Tensor OPTForCausalLMImpl::loss(
    const at::Tensor& logits,
    const at::Tensor& targets) const {
  return causal_lm_loss(logits, targets, state_, config_.vocab_size());
}

at::Tensor OPTForCausalLMImpl::forward_loss(
    const at::Tensor& ids,
    const at::Tensor& targets,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  auto& decoder = *model->decoder;
  auto x = decoder.forward_stage(
      shardformer::StageLayers(), ids, at::Tensor(), attention_mask, position_ids);
  const auto& w = decoder.embed_tokens->weight;
  return causal_lm_head_loss(
      x, w, targets, state_, config_.vocab_size(), [&](const at::Tensor& h) {
        return tied_lm_head_logits(h, w, state_, config_.vocab_size());
      });
}

std::shared_ptr<shardformer::Policy> OPTForCausalLMImpl::default_policy()
    const {
  return std::make_shared<OPTPolicy>();
}

namespace {

// A LayerNorm's weight and bias (when it has them) under `name`.
void insert_layer_norm(
    std::set<std::string>& out,
    const torch::nn::LayerNorm& ln,
    const std::string& name) {
  if (ln->weight.defined()) {
    out.insert(name + ".weight");
  }
  if (ln->bias.defined()) {
    out.insert(name + ".bias");
  }
}

} // namespace

shardformer::ShardInfo OPTPolicy::shard(
    torch::nn::Module& model,
    const shardformer::ShardConfig& cfg) {
  auto& m =
      policy_model<OPTForCausalLMImpl>(model, "OPTPolicy", "an OPTForCausalLM");
  const auto tp = cfg.tensor_parallel_process_group();
  const auto mode = cfg.sp_mode();
  TORCH_CHECK(
      !shardformer::on_sp_group(mode),
      "OPTPolicy: sequence_parallelism_mode '",
      shardformer::to_string(mode),
      "' is not supported; OPTPolicy supports split_gather and ring");
  auto& st = m.parallel_state();
  configure_parallel_state(
      st,
      cfg,
      m.config().num_attention_heads(),
      "OPTPolicy",
      "num_attention_heads");

  auto& d = *m.model->decoder;
  shard_vocab_parallel(*d.embed_tokens, cfg);
  const bool split_gather = shardformer::on_tensor_group(mode);
  // Activations between layers: sequence chunks over tp under split_gather.
  const auto act_group = split_gather ? tp : st.sp;
  shardformer::ShardInfo info;
  for (size_t i = 0; i < d.layers->size(); ++i) {
    auto* layer = d.layers[i]->as<OPTDecoderLayerImpl>();
    auto& a = *layer->self_attn;
    shard_linears(
        {a.q_proj.get(), a.k_proj.get(), a.v_proj.get(), layer->fc1.get()},
        {a.out_proj.get(), layer->fc2.get()},
        tp,
        mode,
        cfg);
    set_dropout(a.dropout, tp, true); // heads are split
    set_dropout(layer->dropout, act_group, act_group != nullptr);
    if (split_gather) {
      const auto p = "model.decoder.layers." + std::to_string(i) + ".";
      insert_layer_norm(
          info.partial_grad_params,
          layer->self_attn_layer_norm,
          p + "self_attn_layer_norm");
      insert_layer_norm(
          info.partial_grad_params,
          layer->final_layer_norm,
          p + "final_layer_norm");
      // Row layers add their bias after the sum: its gradient is partial
      // where each rank holds part of the sequence.
      if (a.out_proj->bias.defined()) {
        add_partial_grads(info, p, {"self_attn.out_proj.bias"});
      }
      if (layer->fc2->bias.defined()) {
        add_partial_grads(info, p, {"fc2.bias"});
      }
    }
  }
  if (split_gather && d.final_layer_norm) {
    insert_layer_norm(
        info.partial_grad_params,
        d.final_layer_norm,
        "model.decoder.final_layer_norm");
  }
  return info;
}

int64_t OPTPolicy::num_pipeline_layers(const torch::nn::Module& model) const {
  return policy_model<OPTForCausalLMImpl>(
             model, "OPTPolicy", "an OPTForCausalLM")
      .config()
      .num_hidden_layers();
}

std::vector<std::string> OPTPolicy::held_layers(
    const torch::nn::Module& model,
    const shardformer::StageLayers& layers) const {
  const auto& c =
      policy_model<OPTForCausalLMImpl>(model, "OPTPolicy", "an OPTForCausalLM")
          .config();
  std::vector<std::string> names;
  if (layers.first) {
    names = {"model.decoder.embed_tokens", "model.decoder.embed_positions"};
    if (c.has_projections()) {
      names.push_back("model.decoder.project_in");
    }
  }
  append_stage_blocks(
      names, layers, c.num_hidden_layers(), "model.decoder.layers.");
  if (layers.last) {
    if (c.do_layer_norm_before()) {
      names.push_back("model.decoder.final_layer_norm");
    }
    if (c.has_projections()) {
      names.push_back("model.decoder.project_out");
    }
    if (!layers.first) {
      names.push_back("model.decoder.embed_tokens"); // the tied head
    }
  }
  return names;
}

std::vector<std::string> OPTPolicy::shared_params(
    const torch::nn::Module&) const {
  return {"model.decoder.embed_tokens.weight"};
}

at::Tensor OPTPolicy::stage_forward(
    torch::nn::Module& model,
    const shardformer::StageLayers& layers,
    const std::vector<at::Tensor>& micro_batch,
    const at::Tensor& hidden) const {
  return causal_lm_stage_forward<OPTForCausalLMImpl>(
      model, layers, micro_batch, hidden, "OPTPolicy", "an OPTForCausalLM");
}

} // namespace models
} // namespace colossalai
