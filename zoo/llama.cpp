#include <zoo/llama.h>

#include <colossalai/distributed/functional.h>

namespace colossalai {
namespace zoo {

namespace cdf = distributed::functional;
namespace sl = shardformer::layer;

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

sl::Linear1D_Col col(int64_t in, int64_t out, double std) {
  sl::Linear1D_Col m(sl::Linear1DOptions(in, out).bias(false));
  torch::NoGradGuard no_grad;
  m->weight.normal_(0.0, std);
  return m;
}

sl::Linear1D_Row row(int64_t in, int64_t out, double std) {
  sl::Linear1D_Row m(sl::Linear1DOptions(in, out).bias(false));
  torch::NoGradGuard no_grad;
  m->weight.normal_(0.0, std);
  return m;
}

sl::RMSNorm rms_norm(const LlamaConfig& c) {
  return sl::RMSNorm(sl::RMSNormOptions(c.hidden_size()).eps(c.rms_norm_eps()));
}

// Hugging Face's rotate_half: (x1, x2) -> (-x2, x1) over the last dim.
at::Tensor rotate_half(const at::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return at::cat({-halves[1], halves[0]}, -1);
}

// x [B, H, T, D] rotated by the angles of `positions` [T].
at::Tensor apply_rope(
    const at::Tensor& x,
    const at::Tensor& positions,
    double theta) {
  const int64_t d = x.size(-1);
  auto inv_freq = at::pow(
                      theta,
                      at::arange(0, d, 2, x.options().dtype(at::kFloat)) /
                          static_cast<double>(d))
                      .reciprocal();
  auto freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  auto emb = at::cat({freqs, freqs}, -1); // [T, D]
  auto cos = emb.cos().to(x.scalar_type());
  auto sin = emb.sin().to(x.scalar_type());
  return x * cos + rotate_half(x) * sin;
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
    const ParallelState* state)
    : config_(c), state_(state) {
  const int64_t h = c.num_attention_heads(), kv = c.num_key_value_heads();
  TORCH_CHECK(
      c.hidden_size() % h == 0 && h % kv == 0,
      "LlamaConfig: hidden_size (",
      c.hidden_size(),
      ") must be divisible by num_attention_heads (",
      h,
      "), which must be divisible by num_key_value_heads (",
      kv,
      ")");
  const int64_t d = c.hidden_size() / h;
  const double std = c.initializer_range();
  q_proj = register_module("q_proj", col(c.hidden_size(), h * d, std));
  k_proj = register_module("k_proj", col(c.hidden_size(), kv * d, std));
  v_proj = register_module("v_proj", col(c.hidden_size(), kv * d, std));
  o_proj = register_module("o_proj", row(h * d, c.hidden_size(), std));
}

at::Tensor LlamaAttentionImpl::forward(
    const at::Tensor& x,
    const at::Tensor& positions) {
  const auto& st = *state_;
  const int64_t d = config_.hidden_size() / config_.num_attention_heads();
  const int64_t b = x.size(0);
  // One shared input for q, k and v: one gradient sum over tp, not three.
  auto xin = q_proj->prepare_input(x);
  auto q = q_proj->forward_prepared(xin);
  const int64_t t = q.size(1); // whole sequence under split_gather
  q = q.view({b, t, -1, d});
  auto k = k_proj->forward_prepared(xin).view({b, t, -1, d});
  auto v = v_proj->forward_prepared(xin).view({b, t, -1, d});
  // Rotary angles: the sequence here is `positions` unless split_gather
  // gathered it whole.
  auto pos = st.sp_mode == "split_gather" ? at::arange(t, positions.options())
                                          : positions;
  q = apply_rope(q.transpose(1, 2), pos, config_.rope_theta()).transpose(1, 2);
  k = apply_rope(k.transpose(1, 2), pos, config_.rope_theta()).transpose(1, 2);
  if (st.sp_mode == "all_to_all") {
    q = to_head_shards(q, st.sp);
    k = to_head_shards(k, st.sp);
    v = to_head_shards(v, st.sp);
  }
  const int64_t n_rep = q.size(2) / k.size(2);
  auto y = sequence_attention(
               q.transpose(1, 2),
               repeat_kv(k.transpose(1, 2), n_rep),
               repeat_kv(v.transpose(1, 2), n_rep),
               st,
               nullptr)
               .transpose(1, 2); // [B, T, H, D]
  if (st.sp_mode == "all_to_all") {
    y = to_sequence_shards(y, st.sp);
  }
  return o_proj(y.reshape({b, y.size(1), -1}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c) {
  const double std = c.initializer_range();
  gate_proj = register_module(
      "gate_proj", col(c.hidden_size(), c.intermediate_size(), std));
  up_proj = register_module(
      "up_proj", col(c.hidden_size(), c.intermediate_size(), std));
  down_proj = register_module(
      "down_proj", row(c.intermediate_size(), c.hidden_size(), std));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  auto xin = gate_proj->prepare_input(x); // shared, as q, k and v
  return down_proj(
      at::silu(gate_proj->forward_prepared(xin)) *
      up_proj->forward_prepared(xin));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(
    const LlamaConfig& c,
    const ParallelState* state) {
  self_attn = register_module("self_attn", LlamaAttention(c, state));
  mlp = register_module("mlp", LlamaMLP(c));
  input_layernorm = register_module("input_layernorm", rms_norm(c));
  post_attention_layernorm =
      register_module("post_attention_layernorm", rms_norm(c));
}

at::Tensor LlamaDecoderLayerImpl::forward(
    const at::Tensor& x,
    const at::Tensor& positions) {
  auto scope = forward_scope();
  auto h = x + self_attn->forward(input_layernorm(x), positions);
  return scope.exit(h + mlp(post_attention_layernorm(h)));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c, const ParallelState* state)
    : config_(c), state_(state) {
  embed_tokens = register_module(
      "embed_tokens",
      sl::VocabParallelEmbedding1D(
          sl::Embedding1DOptions(c.vocab_size(), c.hidden_size())));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers(); ++i) {
    layers->push_back(LlamaDecoderLayer(c, state));
  }
  norm = register_module("norm", rms_norm(c));
  torch::NoGradGuard no_grad;
  embed_tokens->weight.normal_(0.0, c.initializer_range());
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& ids) {
  return forward_stage(shardformer::StageLayers(), ids, at::Tensor());
}

at::Tensor LlamaModelImpl::forward_stage(
    const shardformer::StageLayers& stage,
    const at::Tensor& ids,
    const at::Tensor& hidden) {
  TORCH_CHECK(
      ids.dim() == 2 && ids.size(1) <= config_.max_position_embeddings(),
      "LlamaModel: ids must be [B, T] with T <= max_position_embeddings (",
      config_.max_position_embeddings(),
      "), got ",
      ids.sizes());
  const auto& st = *state_;
  at::Tensor tokens = ids, pos;
  std::tie(tokens, pos) = sequence_chunk(ids, st);
  at::Tensor x = hidden;
  if (stage.first) {
    x = embed_tokens(tokens);
    if (st.sp_mode == "split_gather") {
      x = cdf::split_along_dim(x, 1, st.tp);
    }
  }
  TORCH_CHECK(x.defined(), "LlamaModel: a later stage needs hidden states");
  const int64_t n = static_cast<int64_t>(layers->size());
  const int64_t end = stage.end < 0 ? n : stage.end;
  for (int64_t i = stage.begin; i < end; ++i) {
    auto* layer = (*layers)[i]->as<LlamaDecoderLayerImpl>();
    x = run_block(
        st,
        i,
        n,
        *layer,
        [layer, pos](const at::Tensor& y) { return layer->forward(y, pos); },
        x);
  }
  return stage.last ? gather_sequence(norm(x), st) : x;
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c) : config_(c) {
  model = register_module("model", LlamaModel(c, &state_));
  lm_head = register_module(
      "lm_head",
      sl::VocabParallelLMHead1D(
          sl::Embedding1DOptions(c.vocab_size(), c.hidden_size())));
  torch::NoGradGuard no_grad;
  lm_head->weight.normal_(0.0, c.initializer_range());
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& ids) {
  return lm_head(model(ids));
}

at::Tensor LlamaForCausalLMImpl::forward_stage(
    const shardformer::StageLayers& layers,
    const at::Tensor& ids,
    const at::Tensor& hidden) {
  auto x = model->forward_stage(layers, ids, hidden);
  return layers.last ? lm_head(x) : x;
}

at::Tensor LlamaForCausalLMImpl::loss(
    const at::Tensor& logits,
    const at::Tensor& targets) const {
  return causal_lm_loss(logits, targets, state_, config_.vocab_size());
}

std::shared_ptr<shardformer::Policy> LlamaForCausalLMImpl::default_policy()
    const {
  return std::make_shared<LlamaPolicy>();
}

shardformer::ShardInfo LlamaPolicy::shard(
    torch::nn::Module& module,
    const shardformer::ShardConfig& cfg) {
  auto* m = dynamic_cast<LlamaForCausalLMImpl*>(&module);
  TORCH_CHECK(m != nullptr, "LlamaPolicy: the model is not a LlamaForCausalLM");
  const auto tp = cfg.tensor_parallel_process_group();
  const auto mode = cfg.sp_mode();
  configure_parallel_state(
      m->parallel_state(),
      cfg,
      m->config().num_key_value_heads(),
      "LlamaPolicy",
      "num_key_value_heads");

  // "ring" is split_gather with ring-overlapped matmuls in the layers.
  const bool split_gather = mode == "split_gather" || mode == "ring";
  auto& lm = *m->model;
  lm.embed_tokens->options.make_vocab_size_divisible_by(
      cfg.make_vocab_size_divisible_by());
  lm.embed_tokens->shard_(tp);
  m->lm_head->options.make_vocab_size_divisible_by(
      cfg.make_vocab_size_divisible_by());
  m->lm_head->options.gather_output(!cfg.parallel_output());
  m->lm_head->shard_(tp);
  shardformer::ShardInfo info;
  for (size_t i = 0; i < lm.layers->size(); ++i) {
    auto* layer = lm.layers[i]->as<LlamaDecoderLayerImpl>();
    auto& a = *layer->self_attn;
    auto& mlp = *layer->mlp;
    for (auto* col :
         {a.q_proj.get(),
          a.k_proj.get(),
          a.v_proj.get(),
          mlp.gate_proj.get(),
          mlp.up_proj.get()}) {
      col->options.seq_parallel(split_gather).ring(mode == "ring");
      col->shard_(tp);
    }
    for (auto* row : {a.o_proj.get(), mlp.down_proj.get()}) {
      row->options.seq_parallel(split_gather).ring(mode == "ring");
      row->shard_(tp);
    }
    if (split_gather) {
      const auto p = "model.layers." + std::to_string(i) + ".";
      info.partial_grad_params.insert(p + "input_layernorm.weight");
      info.partial_grad_params.insert(p + "post_attention_layernorm.weight");
    }
  }
  if (split_gather) {
    info.partial_grad_params.insert("model.norm.weight");
  }
  return info;
}

namespace {

const LlamaForCausalLMImpl& as_llama(const torch::nn::Module& model) {
  const auto* m = dynamic_cast<const LlamaForCausalLMImpl*>(&model);
  TORCH_CHECK(m != nullptr, "LlamaPolicy: the model is not a LlamaForCausalLM");
  return *m;
}

} // namespace

int64_t LlamaPolicy::num_pipeline_layers(const torch::nn::Module& model) const {
  return as_llama(model).config().num_hidden_layers();
}

std::vector<std::string> LlamaPolicy::held_layers(
    const torch::nn::Module& model,
    const shardformer::StageLayers& layers) const {
  const int64_t n = as_llama(model).config().num_hidden_layers();
  std::vector<std::string> names;
  if (layers.first) {
    names.push_back("model.embed_tokens");
  }
  const int64_t end = layers.end < 0 ? n : layers.end;
  for (int64_t i = layers.begin; i < end; ++i) {
    names.push_back("model.layers." + std::to_string(i));
  }
  if (layers.last) {
    names.push_back("model.norm");
    names.push_back("lm_head");
  }
  return names;
}

at::Tensor LlamaPolicy::stage_forward(
    torch::nn::Module& model,
    const shardformer::StageLayers& layers,
    const std::vector<at::Tensor>& micro_batch,
    const at::Tensor& hidden) const {
  auto& m = const_cast<LlamaForCausalLMImpl&>(as_llama(model));
  TORCH_CHECK(
      !micro_batch.empty(),
      "LlamaPolicy: the micro-batch must start with the input ids");
  return m.forward_stage(layers, micro_batch[0], hidden);
}

} // namespace zoo
} // namespace colossalai
