#include <colossalai/models/gpt2.h>

#include "model_init.h"

#include <colossalai/kernels/layer_norm.h>
#include <colossalai/models/kv_cache.h>

#include <colossalai/distributed/functional.h>

#include <torch/nn/init.h>

#include <cmath>

namespace colossalai {
namespace models {

namespace cdf = distributed::functional;
namespace sl = shardformer::layer;
using detail::init_normal;
using detail::init_zero;

GPT2Config GPT2Config::tiny_test() {
  return GPT2Config()
      .vocab_size(100)
      .n_positions(32)
      .n_embd(32)
      .n_layer(2)
      .n_head(4)
      .embd_pdrop(0)
      .attn_pdrop(0)
      .resid_pdrop(0);
}

GPT2Config GPT2Config::small_cpu() {
  return GPT2Config()
      .vocab_size(4096)
      .n_positions(128)
      .n_embd(256)
      .n_layer(4)
      .n_head(4)
      .embd_pdrop(0)
      .attn_pdrop(0)
      .resid_pdrop(0);
}

namespace {

// Hugging Face's GPT-2 initialisation: N(0, initializer_range) for weights
// and embeddings, zero biases, and the residual projections (c_proj) scaled
// by 1 / sqrt(2 n_layer).
torch::nn::LayerNorm layer_norm(const GPT2Config& c) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({c.n_embd()}).eps(c.layer_norm_epsilon()));
}

sl::Linear1D_Col conv1d_col(int64_t in, int64_t out, int64_t sections) {
  return sl::Linear1D_Col(
      sl::Linear1DOptions(in, out).conv1d_layout(true).fused_sections(
          sections));
}

sl::Linear1D_Row conv1d_row(int64_t in, int64_t out) {
  return sl::Linear1D_Row(sl::Linear1DOptions(in, out).conv1d_layout(true));
}

} // namespace

GPT2AttentionImpl::GPT2AttentionImpl(
    const GPT2Config& c,
    const ParallelState* state,
    int64_t layer_idx)
    : n_head_(c.n_head()), head_dim_(0), state_(state), layer_idx_(layer_idx) {
  TORCH_CHECK(
      c.n_head() > 0 && c.n_embd() % c.n_head() == 0,
      "GPT2Config: n_embd (",
      c.n_embd(),
      ") must be divisible by n_head (",
      c.n_head(),
      ")");
  head_dim_ = c.n_embd() / c.n_head();
  c_attn = register_module("c_attn", conv1d_col(c.n_embd(), 3 * c.n_embd(), 3));
  c_proj = register_module("c_proj", conv1d_row(c.n_embd(), c.n_embd()));
  attn_dropout = register_module(
      "attn_dropout", sl::Dropout(sl::DropoutOptions(c.attn_pdrop())));
  resid_dropout = register_module(
      "resid_dropout", sl::Dropout(sl::DropoutOptions(c.resid_pdrop())));
  init_normal(c_attn->weight, c.initializer_range());
  init_zero(c_attn->bias);
  init_normal(
      c_proj->weight, c.initializer_range() / std::sqrt(2.0 * c.n_layer()));
  init_zero(c_proj->bias);
}

at::Tensor GPT2AttentionImpl::forward(
    const at::Tensor& x,
    const at::Tensor& mask) {
  auto qkv = c_attn(x); // [B, T, 3 C / tp]: the whole sequence
  const int64_t b = qkv.size(0);
  int64_t t = qkv.size(1);
  int64_t heads = n_head_ / state_->tp_size();
  const bool ulysses =
      state_->sp_mode == shardformer::SequenceParallelMode::kAllToAll;
  auto parts = qkv.view({b, t, 3, heads, head_dim_});
  if (ulysses) {
    // Sequence chunks with every head -> the whole sequence, sp-th of heads.
    parts = cdf::all_to_all_along_dims(parts, 3, 1, state_->sp, state_->fp8);
    t = parts.size(1);
    heads = parts.size(3);
  }
  auto q = parts.select(2, 0).transpose(1, 2);
  auto k = parts.select(2, 1).transpose(1, 2);
  auto v = parts.select(2, 2).transpose(1, 2);
  if (state_->kv_cache != nullptr) {
    std::tie(k, v) = state_->kv_cache->update(layer_idx_, k, v);
  }
  const bool drop = attn_dropout->options.p() > 0 && is_training();
  auto y = sequence_attention(
               q, k, v, *state_, drop ? attn_dropout.get() : nullptr, mask)
               .transpose(1, 2); // [B, T, H, D]
  if (ulysses) {
    y = to_sequence_shards(y, state_->sp, state_->fp8);
  }
  y = y.reshape({b, y.size(1), -1});
  return resid_dropout(c_proj(y));
}

GPT2MLPImpl::GPT2MLPImpl(const GPT2Config& c) {
  c_fc =
      register_module("c_fc", conv1d_col(c.n_embd(), c.resolved_n_inner(), 1));
  c_proj =
      register_module("c_proj", conv1d_row(c.resolved_n_inner(), c.n_embd()));
  dropout = register_module(
      "dropout", sl::Dropout(sl::DropoutOptions(c.resid_pdrop())));
  init_normal(c_fc->weight, c.initializer_range());
  init_zero(c_fc->bias);
  init_normal(
      c_proj->weight, c.initializer_range() / std::sqrt(2.0 * c.n_layer()));
  init_zero(c_proj->bias);
}

at::Tensor GPT2MLPImpl::forward(const at::Tensor& x) {
  // HF's gelu_new: the tanh approximation.
  return dropout(detail::gelu_projected(
      *c_proj, c_fc(x), "tanh", recompute_activation));
}

GPT2BlockImpl::GPT2BlockImpl(
    const GPT2Config& c,
    const ParallelState* state,
    int64_t layer_idx) {
  ln_1 = register_module("ln_1", layer_norm(c));
  attn = register_module("attn", GPT2Attention(c, state, layer_idx));
  ln_2 = register_module("ln_2", layer_norm(c));
  mlp = register_module("mlp", GPT2MLP(c));
}

at::Tensor GPT2BlockImpl::forward(const at::Tensor& x, const at::Tensor& mask) {
  auto scope = forward_scope();
  // The residual add and the norm after it in one pass (on a GPU).
  auto [normed, h] = kernels::add_layer_norm(
      x, attn(ln_1(x), mask), ln_2->weight, ln_2->bias, ln_2->options.eps());
  return scope.exit(h + mlp(normed));
}

GPT2ModelImpl::GPT2ModelImpl(const GPT2Config& c, const ParallelState* state)
    : config_(c), state_(state) {
  wte = register_module(
      "wte",
      sl::VocabParallelEmbedding1D(
          sl::Embedding1DOptions(c.vocab_size(), c.n_embd())));
  wpe =
      register_module("wpe", torch::nn::Embedding(c.n_positions(), c.n_embd()));
  drop =
      register_module("drop", sl::Dropout(sl::DropoutOptions(c.embd_pdrop())));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer(); ++i) {
    h->push_back(GPT2Block(c, state, i));
  }
  ln_f = register_module("ln_f", layer_norm(c));
  init_normal(wte->weight, c.initializer_range());
  init_normal(wpe->weight, c.initializer_range());
}

at::Tensor GPT2ModelImpl::forward(
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

at::Tensor GPT2ModelImpl::forward_stage(
    const shardformer::StageLayers& layers,
    const at::Tensor& ids,
    const at::Tensor& hidden,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  const auto& st = *state_;
  TORCH_CHECK(
      ids.dim() == 2 && ids.size(1) <= config_.n_positions(),
      "GPT2Model: ids must be [B, T] with T <= n_positions (",
      config_.n_positions(),
      "), got ",
      ids.sizes());
  check_position_ids(ids, position_ids, "GPT2Model");
  const int64_t t = ids.size(1);
  auto mask = st.kv_cache != nullptr
      ? st.kv_cache->begin_step(t, attention_mask, 0, ids.device())
      : attention_keep_mask(attention_mask, t, 0, ids.device());
  if (st.kv_cache == nullptr && position_ids.defined() &&
      !attention_mask.defined()) {
    mask = packed_documents_mask(mask, position_ids, t, ids.device());
  }
  at::Tensor x = hidden;
  if (layers.first) {
    at::Tensor tokens = ids, pos;
    std::tie(tokens, pos) = sequence_chunk(ids, st);
    if (position_ids.defined()) {
      pos = sequence_chunk(position_ids, st).first;
    } else if (st.kv_cache != nullptr) {
      pos = step_positions(st, t, ids.device());
    }
    if (st.kv_cache != nullptr) {
      const int64_t last = pos.max().item<int64_t>();
      TORCH_CHECK(
          last < config_.n_positions(),
          "GPT2Model: generation reached position ",
          last,
          ", beyond the learned positions (n_positions ",
          config_.n_positions(),
          ")");
    }
    x = split_sequence(drop(wte(tokens) + wpe(pos)), st);
  }
  TORCH_CHECK(x.defined(), "GPT2Model: a later stage needs hidden states");
  x = run_stage_blocks<GPT2BlockImpl>(
      st, layers, *h, x, [mask](GPT2BlockImpl& block, const at::Tensor& y) {
        return block.forward(y, mask);
      });
  return layers.last ? gather_sequence(ln_f(x), st) : x;
}

GPT2LMHeadModelImpl::GPT2LMHeadModelImpl(const GPT2Config& config)
    : config_(config) {
  detail::register_checkpoint_hooks();
  transformer = register_module("transformer", GPT2Model(config, &state_));
}

at::Tensor GPT2LMHeadModelImpl::forward(
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

at::Tensor GPT2LMHeadModelImpl::forward_stage(
    const shardformer::StageLayers& layers,
    const at::Tensor& ids,
    const at::Tensor& hidden,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  auto x = transformer->forward_stage(
      layers, ids, hidden, attention_mask, position_ids);
  if (!layers.last) {
    return x;
  }
  return tied_lm_head_logits(
      x, transformer->wte->weight, state_, config_.vocab_size());
}

at::Tensor GPT2LMHeadModelImpl::forward_cached(
    const at::Tensor& ids,
    KVCache& cache,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids,
    int64_t logits_to_keep) {
  CachedForward frame(state_, cache, "GPT2LMHeadModel");
  auto x = transformer->forward(ids, attention_mask, position_ids);
  return frame.finish(
      x, logits_to_keep, config_.vocab_size(), [this](const at::Tensor& h) {
        return tied_lm_head_logits(
            h, transformer->wte->weight, state_, config_.vocab_size());
      });
}

at::Tensor GPT2LMHeadModelImpl::loss(
    const at::Tensor& logits,
    const at::Tensor& targets) const {
  return causal_lm_loss(logits, targets, state_, config_.vocab_size());
}

at::Tensor GPT2LMHeadModelImpl::forward_loss(
    const at::Tensor& ids,
    const at::Tensor& targets,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  auto x = transformer->forward_stage(
      shardformer::StageLayers(), ids, at::Tensor(), attention_mask, position_ids);
  const auto& w = transformer->wte->weight;
  return causal_lm_head_loss(
      x, w, targets, state_, config_.vocab_size(), [&](const at::Tensor& h) {
        return tied_lm_head_logits(h, w, state_, config_.vocab_size());
      });
}

std::shared_ptr<shardformer::Policy> GPT2LMHeadModelImpl::default_policy()
    const {
  return std::make_shared<GPT2Policy>();
}

shardformer::ShardInfo GPT2Policy::shard(
    torch::nn::Module& model,
    const shardformer::ShardConfig& cfg) {
  auto& m = policy_model<GPT2LMHeadModelImpl>(
      model, "GPT2Policy", "a GPT2LMHeadModel");
  const auto tp = cfg.tensor_parallel_process_group();
  const auto mode = cfg.sp_mode();
  auto& st = m.parallel_state();
  configure_parallel_state(
      st, cfg, m.config().n_head(), "GPT2Policy", "n_head");

  auto& t = *m.transformer;
  shard_vocab_parallel(*t.wte, cfg);
  const bool split_gather = shardformer::on_tensor_group(mode);
  // Activations between blocks: sequence chunks under either sp mode.
  const auto act_group = split_gather ? tp : st.sp;
  set_dropout(t.drop, nullptr, false);
  shardformer::ShardInfo info;
  for (size_t i = 0; i < t.h->size(); ++i) {
    auto* blk = t.h[i]->as<GPT2BlockImpl>();
    auto& a = *blk->attn;
    auto& mlp = *blk->mlp;
    shard_linears(
        {a.c_attn.get(), mlp.c_fc.get()},
        {a.c_proj.get(), mlp.c_proj.get()},
        tp,
        mode,
        cfg);
    set_dropout(a.attn_dropout, tp, true); // heads are split
    set_dropout(a.resid_dropout, act_group, act_group != nullptr);
    set_dropout(mlp.dropout, act_group, act_group != nullptr);
    if (split_gather) {
      add_partial_grads(
          info,
          "transformer.h." + std::to_string(i) + ".",
          {"ln_1.weight",
           "ln_1.bias",
           "ln_2.weight",
           "ln_2.bias",
           "attn.c_proj.bias",
           "mlp.c_proj.bias"});
    }
  }
  if (split_gather) {
    add_partial_grads(info, "transformer.ln_f.", {"weight", "bias"});
  }
  return info;
}

int64_t GPT2Policy::num_pipeline_layers(const torch::nn::Module& model) const {
  return policy_model<GPT2LMHeadModelImpl>(
             model, "GPT2Policy", "a GPT2LMHeadModel")
      .config()
      .n_layer();
}

std::vector<std::string> GPT2Policy::held_layers(
    const torch::nn::Module& model,
    const shardformer::StageLayers& layers) const {
  const int64_t n = GPT2Policy::num_pipeline_layers(model);
  std::vector<std::string> names;
  if (layers.first) {
    names = {"transformer.wte", "transformer.wpe", "transformer.drop"};
  }
  append_stage_blocks(names, layers, n, "transformer.h.");
  if (layers.last) {
    names.push_back("transformer.ln_f");
    if (!layers.first) {
      names.push_back("transformer.wte"); // the tied head
    }
  }
  return names;
}

std::vector<std::string> GPT2Policy::shared_params(
    const torch::nn::Module&) const {
  return {"transformer.wte.weight"};
}

at::Tensor GPT2Policy::stage_forward(
    torch::nn::Module& model,
    const shardformer::StageLayers& layers,
    const std::vector<at::Tensor>& micro_batch,
    const at::Tensor& hidden) const {
  return causal_lm_stage_forward<GPT2LMHeadModelImpl>(
      model, layers, micro_batch, hidden, "GPT2Policy", "a GPT2LMHeadModel");
}

} // namespace models
} // namespace colossalai
