#include <colossalai/models/llama.h>

#include "model_init.h"

#include <colossalai/kernels/rope.h>
#include <colossalai/models/kv_cache.h>

#include <colossalai/lazy/lazy_init.h>

#include <cmath>

namespace colossalai {
namespace models {

namespace sl = shardformer::layer;
using detail::col;
using detail::row;

LlamaConfig LlamaConfig::tiny_test() {
  return LlamaConfig()
      .vocab_size(100)
      .hidden_size(32)
      .intermediate_size(64)
      .num_hidden_layers(2)
      .num_attention_heads(8)
      .num_key_value_heads(4)
      .max_position_embeddings(32);
}

LlamaConfig LlamaConfig::small_cpu() {
  return LlamaConfig()
      .vocab_size(4096)
      .hidden_size(256)
      .intermediate_size(688)
      .num_hidden_layers(4)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .max_position_embeddings(128);
}

namespace {

sl::RMSNorm rms_norm(int64_t width, const LlamaConfig& c) {
  return sl::RMSNorm(sl::RMSNormOptions(width).eps(c.rms_norm_eps()));
}

// Hugging Face's rotate_half: (x1, x2) -> (-x2, x1) over the last dim.
at::Tensor rotate_half(const at::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return at::cat({-halves[1], halves[0]}, -1);
}

// The rotary inverse frequencies [d / 2], fp32 as transformers computes
// them, with the config's scaling applied.
at::Tensor rope_inv_freq(const LlamaConfig& c, int64_t d) {
  auto inv_freq = at::pow(
                      c.rope_theta(),
                      at::arange(0, d, 2, at::kLong).to(at::kFloat) /
                          static_cast<double>(d))
                      .reciprocal();
  const auto& rs = c.rope_scaling();
  if (rs.rope_type() == "linear") {
    return inv_freq / rs.factor();
  }
  if (rs.rope_type() != "llama3") {
    return inv_freq;
  }
  // Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the
  // band between interpolated.
  const double old_len =
      static_cast<double>(rs.original_max_position_embeddings());
  const double low_wavelen = old_len / rs.low_freq_factor();
  const double high_wavelen = old_len / rs.high_freq_factor();
  auto wavelen = 2.0 * M_PI / inv_freq;
  auto scaled =
      at::where(wavelen > low_wavelen, inv_freq / rs.factor(), inv_freq);
  auto smooth = (old_len / wavelen - rs.low_freq_factor()) /
      (rs.high_freq_factor() - rs.low_freq_factor());
  auto smoothed = (1 - smooth) * scaled / rs.factor() + smooth * scaled;
  auto medium = (wavelen < high_wavelen)
                    .logical_not()
                    .logical_and((wavelen > low_wavelen).logical_not());
  return at::where(medium, smoothed, scaled);
}

} // namespace

RotaryTables::RotaryTables(at::Tensor positions, at::Tensor inv_freq)
    : positions_(std::move(positions)), inv_freq_(std::move(inv_freq)) {
  TORCH_INTERNAL_ASSERT(inv_freq_.device() == positions_.device());
}

// The cosines and sines of the rotary angles, as transformers rounds them:
// angles in float32, then each table cast to `dtype`.
const std::pair<at::Tensor, at::Tensor>& RotaryTables::get(
    at::ScalarType dtype) const {
  for (const auto& f : formed_) {
    if (f.first == dtype) {
      return f.second;
    }
  }
  auto freqs = positions_.to(at::kFloat).unsqueeze(-1) * inv_freq_;
  auto emb = at::cat({freqs, freqs}, -1); // [.., T, D]
  formed_.emplace_back(
      dtype, std::make_pair(emb.cos().to(dtype), emb.sin().to(dtype)));
  return formed_.back().second;
}

namespace {

// x [B, T, H, D] rotated: the fused kernels on a GPU, elsewhere
// x * cos + rotate_half(x) * sin over [B, H, T, D] (bit for bit what it
// always computed).
at::Tensor apply_rope(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin) {
  if (kernels::rope_fused_applies(x, cos, sin)) {
    return kernels::rope(x, cos, sin);
  }
  const auto xt = x.transpose(1, 2);
  const auto c = cos.dim() == 3 ? cos.unsqueeze(1) : cos; // [B, 1, T, D]
  const auto s = sin.dim() == 3 ? sin.unsqueeze(1) : sin;
  return (xt * c + rotate_half(xt) * s).transpose(1, 2);
}

// [B, KV, T, D] -> [B, KV * n_rep, T, D], each key/value head serving
// n_rep consecutive query heads (Hugging Face's repeat_kv).
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) {
    return x;
  }
  const auto s = x.sizes();
  return x.unsqueeze(2)
      .expand({s[0], s[1], n_rep, s[2], s[3]})
      .reshape({s[0], s[1] * n_rep, s[2], s[3]});
}

} // namespace

LlamaAttentionImpl::LlamaAttentionImpl(
    const LlamaConfig& c,
    const ParallelState* state,
    int64_t layer_idx)
    : config_(c), state_(state), layer_idx_(layer_idx) {
  const int64_t h = c.num_attention_heads(), kv = c.num_key_value_heads();
  TORCH_CHECK(
      h > 0 && kv > 0 && h % kv == 0,
      "LlamaConfig: num_attention_heads (",
      h,
      ") must be divisible by num_key_value_heads (",
      kv,
      ")");
  TORCH_CHECK(
      c.head_dim() > 0 || c.hidden_size() % h == 0,
      "LlamaConfig: hidden_size (",
      c.hidden_size(),
      ") must be divisible by num_attention_heads (",
      h,
      ") unless head_dim is given");
  const int64_t d = c.resolved_head_dim();
  TORCH_CHECK(d % 2 == 0, "LlamaConfig: head_dim must be even, got ", d);
  const double std = c.initializer_range();
  const bool qkv_bias = c.attention_bias() || c.qkv_bias();
  q_proj =
      register_module("q_proj", col(c.hidden_size(), h * d, std, qkv_bias));
  k_proj =
      register_module("k_proj", col(c.hidden_size(), kv * d, std, qkv_bias));
  v_proj =
      register_module("v_proj", col(c.hidden_size(), kv * d, std, qkv_bias));
  o_proj = register_module(
      "o_proj", row(h * d, c.hidden_size(), std, c.attention_bias()));
  if (c.qk_norm()) {
    q_norm = register_module("q_norm", rms_norm(d, c));
    k_norm = register_module("k_norm", rms_norm(d, c));
  }
  // Real even in a LazyInitContext: materialize fills only parameters and
  // buffers (and LibTorch 1.13 has no meta kernel for at::where).
  lazy::EagerGuard eager;
  inv_freq_ = rope_inv_freq(c, d);
}

RotaryTables LlamaAttentionImpl::rotary_tables(const at::Tensor& positions) {
  const auto device = positions.device();
  if (device == inv_freq_.device()) {
    return RotaryTables(positions, inv_freq_);
  }
  // A copy from pageable host memory synchronises with the device (and a
  // CUDA graph cannot capture it): once per device, not every forward.
  if (!inv_freq_device_.defined() || inv_freq_device_.device() != device) {
    inv_freq_device_ = inv_freq_.to(device);
  }
  return RotaryTables(positions, inv_freq_device_);
}

at::Tensor LlamaAttentionImpl::forward(
    const at::Tensor& x,
    const at::Tensor& positions,
    const at::Tensor& mask) {
  return forward(x, rotary_tables(positions), mask);
}

at::Tensor LlamaAttentionImpl::forward(
    const at::Tensor& x,
    const RotaryTables& rope,
    const at::Tensor& mask) {
  const auto& st = *state_;
  const int64_t d = config_.resolved_head_dim();
  const int64_t b = x.size(0);
  // One shared input for q, k and v: one gradient sum over tp, not three,
  // and under autocast one cast kept, not three.
  const auto qkv =
      sl::forward_shared_input({q_proj.get(), k_proj.get(), v_proj.get()}, x);
  const int64_t t = qkv[0].size(1); // whole sequence under split_gather
  auto q = qkv[0].view({b, t, -1, d});
  auto k = qkv[1].view({b, t, -1, d});
  auto v = qkv[2].view({b, t, -1, d});
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  // Rotary angles: the sequence here is the tables' positions unless
  // split_gather gathered it whole (the model then passes the whole
  // sequence's).
  const auto& tables = rope.get(q.scalar_type());
  q = apply_rope(q, tables.first, tables.second);
  k = apply_rope(k, tables.first, tables.second);
  if (st.sp_mode == shardformer::SequenceParallelMode::kAllToAll) {
    q = to_head_shards(q, st.sp, st.fp8);
    k = to_head_shards(k, st.sp, st.fp8);
    v = to_head_shards(v, st.sp, st.fp8);
  }
  auto keys = k.transpose(1, 2), values = v.transpose(1, 2); // [B, KV, T, D]
  if (st.kv_cache != nullptr) {
    std::tie(keys, values) = st.kv_cache->update(layer_idx_, keys, values);
  }
  // Grouped-query attention reads the fewer key/value heads in place;
  // ring attention takes them repeated.
  if (st.sp_mode == shardformer::SequenceParallelMode::kRingAttn) {
    const int64_t n_rep = q.size(2) / k.size(2);
    keys = repeat_kv(keys, n_rep);
    values = repeat_kv(values, n_rep);
  }
  auto y = sequence_attention(
               q.transpose(1, 2), keys, values, st, nullptr, mask)
               .transpose(1, 2); // [B, T, H, D]
  if (st.sp_mode == shardformer::SequenceParallelMode::kAllToAll) {
    y = to_sequence_shards(y, st.sp, st.fp8);
  }
  return o_proj(y.reshape({b, y.size(1), -1}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c) {
  const double std = c.initializer_range();
  const bool bias = c.mlp_bias();
  gate_proj = register_module(
      "gate_proj", col(c.hidden_size(), c.intermediate_size(), std, bias));
  up_proj = register_module(
      "up_proj", col(c.hidden_size(), c.intermediate_size(), std, bias));
  down_proj = register_module(
      "down_proj", row(c.intermediate_size(), c.hidden_size(), std, bias));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  return detail::swiglu(
      *gate_proj, *up_proj, *down_proj, x, recompute_activation);
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(
    const LlamaConfig& c,
    const ParallelState* state,
    int64_t layer_idx) {
  self_attn =
      register_module("self_attn", LlamaAttention(c, state, layer_idx));
  if (c.moe().sparse_layer(layer_idx)) {
    const bool mixtral = c.model_type() == "mixtral";
    moe = register_module(
        mixtral ? "block_sparse_moe" : "mlp",
        SparseMoeBlock(
            c.hidden_size(),
            c.intermediate_size(),
            c.moe(),
            c.initializer_range(),
            mixtral));
  } else {
    mlp = register_module("mlp", LlamaMLP(c));
  }
  input_layernorm =
      register_module("input_layernorm", rms_norm(c.hidden_size(), c));
  post_attention_layernorm =
      register_module("post_attention_layernorm", rms_norm(c.hidden_size(), c));
}

at::Tensor LlamaDecoderLayerImpl::forward(
    const at::Tensor& x,
    const at::Tensor& positions,
    const at::Tensor& mask) {
  return forward(x, self_attn->rotary_tables(positions), mask);
}

at::Tensor LlamaDecoderLayerImpl::forward(
    const at::Tensor& x,
    const RotaryTables& rope,
    const at::Tensor& mask) {
  auto scope = forward_scope();
  // The residual add and the norm after it in one pass (on a GPU).
  auto [normed, h] = post_attention_layernorm->forward_add(
      x, self_attn->forward(input_layernorm(x), rope, mask));
  return scope.exit(h + (moe ? moe(normed) : mlp(normed)));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c, const ParallelState* state)
    : config_(c), state_(state) {
  const auto& type = c.model_type();
  const bool moe_type =
      type == "mixtral" || type == "qwen2_moe" || type == "qwen3_moe";
  TORCH_CHECK(
      moe_type == c.moe().enabled(),
      "LlamaConfig: model_type '",
      type,
      "' ",
      moe_type ? "needs moe().num_experts above 0"
               : "is dense: mixtures of experts are mixtral, qwen2_moe or "
                 "qwen3_moe",
      ", got moe().num_experts ",
      c.moe().num_experts());
  TORCH_CHECK(
      c.moe().shared_expert_intermediate_size() == 0 || type == "qwen2_moe",
      "LlamaConfig: a shared expert (moe().shared_expert_intermediate_size) "
      "is Qwen2-MoE's; model_type is '",
      type,
      "'");
  TORCH_CHECK(
      c.pad_token_id() < c.vocab_size(),
      "LlamaConfig: pad_token_id (",
      c.pad_token_id(),
      ") must be below vocab_size (",
      c.vocab_size(),
      ")");
  embed_tokens = register_module(
      "embed_tokens",
      sl::VocabParallelEmbedding1D(
          sl::Embedding1DOptions(c.vocab_size(), c.hidden_size())));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers(); ++i) {
    layers->push_back(LlamaDecoderLayer(c, state, i));
  }
  norm = register_module("norm", rms_norm(c.hidden_size(), c));
  torch::NoGradGuard no_grad;
  embed_tokens->weight.normal_(0.0, c.initializer_range());
  if (c.pad_token_id() >= 0) {
    embed_tokens->weight[c.pad_token_id()].zero_(); // padding_idx's row
  }
}

at::Tensor LlamaModelImpl::forward(
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

at::Tensor LlamaModelImpl::forward_stage(
    const shardformer::StageLayers& stage,
    const at::Tensor& ids,
    const at::Tensor& hidden,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  TORCH_CHECK(
      ids.dim() == 2, "LlamaModel: ids must be [B, T], got ", ids.sizes());
  check_position_ids(ids, position_ids, "LlamaModel");
  const auto& st = *state_;
  const int64_t t = ids.size(1);
  at::Tensor tokens = ids, pos;
  std::tie(tokens, pos) = sequence_chunk(ids, st);
  if (position_ids.defined()) {
    pos = st.sequence_on_sp() ? sequence_chunk(position_ids, st).first
                              : position_ids;
  }
  // Under split_gather attention sees the whole sequence: its positions.
  at::Tensor rope_pos =
      st.sp_mode == shardformer::SequenceParallelMode::kSplitGather
      ? (position_ids.defined() ? position_ids
                                : at::arange(t, ids.options().dtype(at::kLong)))
      : pos;
  at::Tensor mask;
  if (st.kv_cache != nullptr) {
    // A cached step: its queries see the cache's keys and their own.
    mask = st.kv_cache->begin_step(
        t, attention_mask, config_.sliding_window(), ids.device());
    if (!position_ids.defined()) {
      pos = rope_pos = step_positions(st, t, ids.device());
    }
  } else {
    // Attention always sees the whole sequence except under ring_attn
    // (which refuses a mask).
    mask = attention_keep_mask(
        attention_mask, t, config_.sliding_window(), ids.device());
    if (position_ids.defined() && !attention_mask.defined()) {
      mask = packed_documents_mask(mask, position_ids, t, ids.device());
    }
  }
  at::Tensor x = hidden;
  if (stage.first) {
    x = split_sequence(
        without_padding_grad(
            embed_tokens(tokens),
            tokens,
            config_.pad_token_id(),
            embed_tokens->weight),
        st);
  }
  TORCH_CHECK(x.defined(), "LlamaModel: a later stage needs hidden states");
  // One set of rotary tables for every layer of the stage, kept alive for
  // the layers that run again in backward (activation checkpointing).
  const auto n = static_cast<int64_t>(layers->size());
  std::shared_ptr<const RotaryTables> rope;
  if (stage.begin < (stage.end < 0 ? n : stage.end)) {
    auto* first = layers[stage.begin]->as<LlamaDecoderLayerImpl>();
    rope = std::make_shared<const RotaryTables>(
        first->self_attn->rotary_tables(rope_pos));
  }
  x = run_stage_blocks<LlamaDecoderLayerImpl>(
      st,
      stage,
      *layers,
      x,
      [rope, mask](LlamaDecoderLayerImpl& layer, const at::Tensor& y) {
        return layer.forward(y, *rope, mask);
      });
  return stage.last ? gather_sequence(norm(x), st) : x;
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c) : config_(c) {
  detail::register_checkpoint_hooks();
  model = register_module("model", LlamaModel(c, &state_));
  if (!c.tie_word_embeddings()) {
    lm_head = register_module(
        "lm_head",
        sl::VocabParallelLMHead1D(
            sl::Embedding1DOptions(c.vocab_size(), c.hidden_size())));
    torch::NoGradGuard no_grad;
    lm_head->weight.normal_(0.0, c.initializer_range());
  }
}

at::Tensor LlamaForCausalLMImpl::forward(
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

at::Tensor LlamaForCausalLMImpl::forward_stage(
    const shardformer::StageLayers& layers,
    const at::Tensor& ids,
    const at::Tensor& hidden,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  last_attention_mask_ = attention_mask;
  auto x =
      model->forward_stage(layers, ids, hidden, attention_mask, position_ids);
  return layers.last ? head_logits(x) : x;
}

at::Tensor LlamaForCausalLMImpl::head_logits(const at::Tensor& x) {
  return lm_head ? lm_head(x)
                 : tied_lm_head_logits(
                       x, model->embed_tokens->weight, state_, config_.vocab_size());
}

at::Tensor LlamaForCausalLMImpl::forward_cached(
    const at::Tensor& ids,
    KVCache& cache,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids,
    int64_t logits_to_keep) {
  CachedForward frame(state_, cache, "LlamaForCausalLM");
  last_attention_mask_ = at::Tensor();
  auto x = model->forward(ids, attention_mask, position_ids);
  return frame.finish(
      x, logits_to_keep, config_.vocab_size(), [this](const at::Tensor& h) {
        return head_logits(h);
      });
}

at::Tensor LlamaForCausalLMImpl::loss(
    const at::Tensor& logits,
    const at::Tensor& targets) const {
  return with_aux_loss(
      causal_lm_loss(logits, targets, state_, config_.vocab_size()));
}

at::Tensor LlamaForCausalLMImpl::forward_loss(
    const at::Tensor& ids,
    const at::Tensor& targets,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids) {
  last_attention_mask_ = attention_mask;
  auto x = model->forward_stage(
      shardformer::StageLayers(), ids, at::Tensor(), attention_mask, position_ids);
  // A head with its own parameters beside the weight (adapters) runs as
  // itself.
  const bool plain_head = !lm_head || lm_head->parameters().size() == 1;
  const auto& w = lm_head ? lm_head->weight : model->embed_tokens->weight;
  auto logits_of = [this](const at::Tensor& h) { return head_logits(h); };
  return with_aux_loss(
      plain_head
          ? causal_lm_head_loss(x, w, targets, state_, config_.vocab_size(), logits_of)
          : causal_lm_loss(head_logits(x), targets, state_, config_.vocab_size()));
}

at::Tensor LlamaForCausalLMImpl::with_aux_loss(const at::Tensor& ce) const {
  if (!config_.moe().enabled() || !config_.moe().output_router_logits()) {
    return ce;
  }
  return ce + config_.moe().router_aux_loss_coef() * aux_loss().to(ce.device());
}

at::Tensor LlamaForCausalLMImpl::aux_loss() const {
  const auto& moe = config_.moe();
  if (!moe.enabled()) {
    return at::Tensor();
  }
  std::vector<at::Tensor> logits;
  for (const auto& layer : *model->layers) {
    const auto* l = layer->as<LlamaDecoderLayerImpl>();
    if (l->moe) {
      // A pipeline stage runs some layers only: the balancing loss needs
      // every layer's router.
      TORCH_CHECK(
          l->moe->router_logits().defined(),
          "LlamaForCausalLM::aux_loss: no router logits for a sparse layer: "
          "run a forward first (under pipeline parallelism the balancing "
          "loss is not supported; set output_router_logits to false)");
      logits.push_back(l->moe->router_logits());
    }
  }
  return load_balancing_loss(
      logits,
      moe.num_experts(),
      moe.num_experts_per_tok(),
      last_attention_mask_);
}

std::shared_ptr<shardformer::Policy> LlamaForCausalLMImpl::default_policy()
    const {
  return std::make_shared<LlamaPolicy>();
}

shardformer::ShardInfo LlamaPolicy::shard(
    torch::nn::Module& module,
    const shardformer::ShardConfig& cfg) {
  auto& m = policy_model<LlamaForCausalLMImpl>(
      module, "LlamaPolicy", "a LlamaForCausalLM");
  const auto tp = cfg.tensor_parallel_process_group();
  const auto mode = cfg.sp_mode();
  configure_parallel_state(
      m.parallel_state(),
      cfg,
      m.config().num_key_value_heads(),
      "LlamaPolicy",
      "num_key_value_heads");

  const bool split_gather = shardformer::on_tensor_group(mode);
  auto& lm = *m.model;
  shard_vocab_parallel(*lm.embed_tokens, cfg);
  if (m.lm_head) {
    m.lm_head->options.gather_output(!cfg.parallel_output());
    shard_vocab_parallel(*m.lm_head, cfg);
  }
  shardformer::ShardInfo info;
  for (size_t i = 0; i < lm.layers->size(); ++i) {
    auto* layer = lm.layers[i]->as<LlamaDecoderLayerImpl>();
    auto& a = *layer->self_attn;
    shard_linears(
        {a.q_proj.get(), a.k_proj.get(), a.v_proj.get()},
        {a.o_proj.get()},
        tp,
        mode,
        cfg);
    const auto p = "model.layers." + std::to_string(i) + ".";
    if (layer->moe) {
      // Tokens are routed per row of the whole sequence; the router is
      // replicated (its gradient is whole on every tensor rank).
      TORCH_CHECK(
          mode == shardformer::SequenceParallelMode::kNone,
          "LlamaPolicy: the mixture-of-experts layers of ",
          m.config().model_type(),
          " do not support sequence parallelism; set sequence_parallelism_mode "
          "to none");
      std::vector<MoeExpertImpl*> experts;
      for (const auto& e : *layer->moe->experts) {
        experts.push_back(e->as<MoeExpertImpl>());
      }
      if (layer->moe->shared_expert) {
        experts.push_back(layer->moe->shared_expert.get());
      }
      for (auto* e : experts) {
        shard_linears(
            {e->gate_proj.get(), e->up_proj.get()},
            {e->down_proj.get()},
            tp,
            mode,
            cfg);
      }
      const auto& ep = cfg.ep_group();
      if (ep != nullptr && ep->size() > 1) {
        auto& block = *layer->moe;
        block.set_expert_parallel(ep, cfg.fp8_communication());
        const auto prefix = p +
            (m.config().model_type() == "mixtral" ? "block_sparse_moe"
                                                  : "mlp") +
            ".experts.";
        for (size_t e = 0; e < block.experts->size(); ++e) {
          const int owner = static_cast<int>(
              static_cast<int64_t>(e) / block.num_local_experts());
          for (const auto& w : block.experts[e]->named_parameters(true)) {
            info.expert_owner[prefix + std::to_string(e) + "." + w.key()] =
                owner;
          }
        }
      }
    } else {
      auto& mlp = *layer->mlp;
      shard_linears(
          {mlp.gate_proj.get(), mlp.up_proj.get()},
          {mlp.down_proj.get()},
          tp,
          mode,
          cfg);
      // Row layers add their bias after the sum: its gradient is partial
      // only where each rank holds part of the sequence.
      if (split_gather && mlp.down_proj->bias.defined()) {
        add_partial_grads(info, p, {"mlp.down_proj.bias"});
      }
    }
    if (split_gather) {
      add_partial_grads(
          info,
          p,
          {"input_layernorm.weight", "post_attention_layernorm.weight"});
    }
    if (split_gather && a.o_proj->bias.defined()) {
      add_partial_grads(info, p, {"self_attn.o_proj.bias"});
    }
    // Qwen3's per-head norms see this rank's heads only.
    if (a.q_norm && (tp != nullptr && tp->size() > 1)) {
      add_partial_grads(
          info, p, {"self_attn.q_norm.weight", "self_attn.k_norm.weight"});
    }
  }
  if (split_gather) {
    info.partial_grad_params.insert("model.norm.weight");
  }
  return info;
}

int64_t LlamaPolicy::num_pipeline_layers(const torch::nn::Module& model) const {
  return policy_model<LlamaForCausalLMImpl>(
             model, "LlamaPolicy", "a LlamaForCausalLM")
      .config()
      .num_hidden_layers();
}

std::vector<std::string> LlamaPolicy::held_layers(
    const torch::nn::Module& model,
    const shardformer::StageLayers& layers) const {
  const auto& c = policy_model<LlamaForCausalLMImpl>(
                      model, "LlamaPolicy", "a LlamaForCausalLM")
                      .config();
  std::vector<std::string> names;
  if (layers.first) {
    names.push_back("model.embed_tokens");
  }
  append_stage_blocks(names, layers, c.num_hidden_layers(), "model.layers.");
  if (layers.last) {
    names.push_back("model.norm");
    if (c.tie_word_embeddings()) {
      if (!layers.first) {
        names.push_back("model.embed_tokens"); // the tied head
      }
    } else {
      names.push_back("lm_head");
    }
  }
  return names;
}

std::vector<std::string> LlamaPolicy::shared_params(
    const torch::nn::Module& model) const {
  if (policy_model<LlamaForCausalLMImpl>(
          model, "LlamaPolicy", "a LlamaForCausalLM")
          .config()
          .tie_word_embeddings()) {
    return {"model.embed_tokens.weight"};
  }
  return {};
}

at::Tensor LlamaPolicy::stage_forward(
    torch::nn::Module& model,
    const shardformer::StageLayers& layers,
    const std::vector<at::Tensor>& micro_batch,
    const at::Tensor& hidden) const {
  return causal_lm_stage_forward<LlamaForCausalLMImpl>(
      model, layers, micro_batch, hidden, "LlamaPolicy", "a LlamaForCausalLM");
}

} // namespace models
} // namespace colossalai
