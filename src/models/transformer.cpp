#include <colossalai/models/transformer.h>

#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/functional.h>
#include <colossalai/models/kv_cache.h>
#include <colossalai/nn/checkpoint.h>
#include <colossalai/nn/loss.h>
#include <colossalai/shardformer/layer/embedding.h>
#include <colossalai/shardformer/layer/ring_attention.h>
#include <colossalai/utils/compat.h>

#include "../utils/host_memory.h"

#include <cmath>
#include <limits>

namespace colossalai {
namespace models {

namespace cdf = distributed::functional;
namespace sl = shardformer::layer;

void configure_parallel_state(
    ParallelState& st,
    const shardformer::ShardConfig& cfg,
    int64_t heads,
    const char* policy,
    const char* what) {
  const int tp_size = cfg.tp_size();
  TORCH_CHECK(
      heads % tp_size == 0,
      policy,
      ": ",
      what,
      " (",
      heads,
      ") must be divisible by tp_size (",
      tp_size,
      ")");
  st.tp = cfg.tensor_parallel_process_group();
  // The layers carry "ring"; the model's forward sees split_gather.
  st.sp_mode = cfg.sp_mode() == shardformer::SequenceParallelMode::kRing
      ? shardformer::SequenceParallelMode::kSplitGather
      : cfg.sp_mode();
  st.sp = st.sequence_on_sp() ? cfg.sequence_parallel_process_group() : nullptr;
  TORCH_CHECK(
      st.sp_mode != shardformer::SequenceParallelMode::kAllToAll ||
          (heads / tp_size) % st.sp_size() == 0,
      policy,
      ": all_to_all sequence parallelism needs the ",
      what,
      " per tensor rank (",
      heads / tp_size,
      ") divisible by sp_size (",
      st.sp_size(),
      ")");
  TORCH_CHECK(
      cfg.inner_ring_size() == 0 ||
          st.sp_mode == shardformer::SequenceParallelMode::kRingAttn,
      policy,
      ": inner_ring_size (double ring attention) needs "
      "sequence_parallelism_mode 'ring_attn'");
  st.rings = st.sp_mode == shardformer::SequenceParallelMode::kRingAttn
      ? sl::get_double_ring_groups(st.sp, cfg.inner_ring_size())
      : sl::DoubleRing();
  st.parallel_output = cfg.parallel_output();
  st.fp8 = cfg.fp8_communication();
  TORCH_CHECK(
      cfg.gradient_checkpointing_ratio() >= 0.0 &&
          cfg.gradient_checkpointing_ratio() <= 1.0,
      policy,
      ": gradient_checkpointing_ratio must be in [0, 1], got ",
      cfg.gradient_checkpointing_ratio());
  st.gradient_checkpointing_ratio = cfg.gradient_checkpointing_ratio();
}

at::Tensor run_block(
    const ParallelState& st,
    int64_t index,
    int64_t num_blocks,
    torch::nn::Module& block,
    const std::function<at::Tensor(const at::Tensor&)>& fn,
    const at::Tensor& x) {
  const auto checkpointed = static_cast<int64_t>(
      st.gradient_checkpointing_ratio * static_cast<double>(num_blocks));
  // A cached step appends to the cache once per layer: never recomputed.
  if (index < checkpointed && block.is_training() && st.kv_cache == nullptr) {
    return nn::checkpoint(fn, x, &block);
  }
  return fn(x);
}

CachedForward::CachedForward(
    ParallelState& state,
    KVCache& cache,
    const char* who)
    : state_(state), cache_(cache) {
  TORCH_CHECK(
      state.sp_mode == shardformer::SequenceParallelMode::kNone,
      who,
      "::forward_cached (generation) runs without sequence parallelism; "
      "this model is sharded with sequence_parallelism_mode ",
      shardformer::to_string(state.sp_mode),
      ": generate with a model sharded without it (tensor parallelism is "
      "supported)");
  TORCH_CHECK(
      state.kv_cache == nullptr,
      who,
      "::forward_cached: another cached forward of this model is in progress");
  state.kv_cache = &cache;
}

CachedForward::~CachedForward() {
  state_.kv_cache = nullptr;
}

at::Tensor CachedForward::finish(
    const at::Tensor& hidden,
    int64_t logits_to_keep,
    int64_t vocab_size,
    const std::function<at::Tensor(const at::Tensor&)>& hidden_to_logits) {
  cache_.end_step();
  TORCH_CHECK(
      logits_to_keep >= 0,
      "forward_cached: logits_to_keep must be >= 0, got ",
      logits_to_keep);
  const int64_t t = hidden.size(1);
  const auto x = logits_to_keep > 0 && logits_to_keep < t
      ? hidden.narrow(1, t - logits_to_keep, logits_to_keep)
      : hidden;
  auto logits = hidden_to_logits(x);
  if (state_.tp_size() > 1 && state_.parallel_output) {
    logits =
        cdf::gather_along_dim(logits, logits.dim() - 1, state_.tp, state_.fp8);
  }
  return logits.size(-1) > vocab_size ? logits.narrow(-1, 0, vocab_size)
                                      : logits;
}

at::Tensor step_positions(
    const ParallelState& state,
    int64_t t,
    const at::Device& device) {
  const int64_t past = state.kv_cache != nullptr ? state.kv_cache->length() : 0;
  return at::arange(past, past + t, at::TensorOptions(at::kLong).device(device));
}

void check_position_ids(
    const at::Tensor& ids,
    const at::Tensor& position_ids,
    const char* who) {
  TORCH_CHECK(
      !position_ids.defined() || position_ids.sizes() == ids.sizes(),
      who,
      ": position_ids must be [B, T] like ids ",
      ids.sizes(),
      ", got ",
      position_ids.sizes());
}

at::Tensor tied_lm_head_logits(
    const at::Tensor& x,
    const at::Tensor& weight,
    const ParallelState& state,
    int64_t vocab_size) {
  return shardformer::layer::lm_head_logits(
      x,
      weight,
      state.tp,
      /*gather_output=*/!state.parallel_output,
      vocab_size,
      state.fp8);
}

at::Tensor causal_lm_loss(
    const at::Tensor& logits,
    const at::Tensor& targets,
    const ParallelState& st,
    int64_t vocab_size) {
  const bool sharded = st.tp_size() > 1 && st.parallel_output;
  const bool seq_split = sequence_split_output(st);
  // Logits split along the sequence: this rank's targets, the same split as
  // the ids.
  const at::Tensor t = seq_split ? sequence_chunk(targets, st).first : targets;
  if (!seq_split) {
    return shardformer::layer::vocab_parallel_cross_entropy(
        logits.flatten(0, 1), t.flatten(), sharded ? st.tp : nullptr,
        vocab_size);
  }
  // The chunks hold different numbers of counted tokens (the shifted
  // labels' last position, padding): the sum and the count travel over sp
  // (NOTE [Token-mean losses]), so the value is the whole sequence's token
  // mean and the sp-averaged gradient is its gradient.
  auto sum = shardformer::layer::vocab_parallel_cross_entropy(
      logits.flatten(0, 1),
      t.flatten(),
      sharded ? st.tp : nullptr,
      vocab_size,
      /*ignore_index=*/-100,
      at::Reduction::Sum);
  return nn::token_mean(sum, t.ne(-100).sum(), st.sp);
}

at::Tensor without_padding_grad(
    const at::Tensor& rows,
    const at::Tensor& ids,
    int64_t pad,
    const at::Tensor& weight) {
  if (pad < 0 || !at::GradMode::is_enabled() || !weight.requires_grad()) {
    return rows;
  }
  return at::where(ids.eq(pad).unsqueeze(-1), rows.detach(), rows);
}

at::Tensor micro_batch_input(
    const std::vector<at::Tensor>& micro_batch,
    size_t i) {
  return micro_batch.size() > i ? micro_batch[i] : at::Tensor();
}

int64_t LMPolicy::loss_items(const std::vector<at::Tensor>& micro_batch) const {
  if (micro_batch.size() < 2 || !micro_batch[1].defined()) {
    return -1;
  }
  return micro_batch[1].ne(-100).sum().item<int64_t>();
}

void LMPolicy::check_micro_batch(
    const std::vector<at::Tensor>& micro_batch) const {
  const auto names = micro_batch_inputs();
  std::string takes;
  for (const auto& n : names) {
    takes += (takes.empty() ? "" : ", ") + n;
  }
  TORCH_CHECK(
      !micro_batch.empty() && micro_batch[0].defined(),
      name(),
      ": the micro-batch must start with the input ids");
  TORCH_CHECK(
      micro_batch.size() <= names.size(),
      name(),
      ": a pipeline micro-batch holds {",
      takes,
      "}, got ",
      micro_batch.size(),
      " tensors: tensor ",
      names.size(),
      " would not reach the model");
  for (size_t i = 2; i < micro_batch.size(); ++i) {
    const auto& x = micro_batch[i];
    TORCH_CHECK(
        !x.defined() || x.sizes() == micro_batch[0].sizes(),
        name(),
        ": micro-batch tensor ",
        i,
        " (",
        names[i],
        ") must be [B, T] like the ids ",
        micro_batch[0].sizes(),
        ", got ",
        x.sizes());
  }
}

namespace {

// `attention` for a mask in which every query sees at least one key.
at::Tensor attention_of_seen(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    shardformer::layer::DropoutImpl* dropout,
    const at::Tensor& mask) {
  const bool drops = dropout != nullptr && dropout->is_training() &&
      dropout->options.p() > 0.0;
  if (!drops) {
    // LibTorch's kernel on 2.x, the explicit path on 1.13.
    if (mask.defined()) {
      return compat::scaled_dot_product_attention(
          q, k, v, mask, /*is_causal=*/false);
    }
    return compat::scaled_dot_product_attention(
        q, k, v, /*mask=*/c10::nullopt, /*is_causal=*/true);
  }
  // Dropout on the probabilities needs them: the explicit path, with the
  // Dropout whose masks follow the tensor-parallel layout.
  const int64_t t = q.size(2);
  TORCH_INTERNAL_ASSERT(
      k.size(1) == q.size(1), "attention dropout takes equal k/v heads");
  auto att = at::matmul(q, k.transpose(-2, -1)) *
      (1.0 / std::sqrt(static_cast<double>(q.size(3))));
  auto hidden = mask.defined()
      ? mask.logical_not()
      : at::ones({t, t}, q.options().dtype(at::kBool)).triu(1);
  att = at::softmax(
      att.masked_fill(hidden, -std::numeric_limits<double>::infinity()), -1);
  return at::matmul(dropout->forward(att), v);
}

} // namespace

at::Tensor attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    shardformer::layer::DropoutImpl* dropout,
    const at::Tensor& mask) {
  if (!mask.defined()) {
    return attention_of_seen(q, k, v, dropout, mask);
  }
  // A query that may see no key (left padding) gets a zero output and no
  // gradient, as PyTorch's SDPA (>= 2.5) gives transformers. It attends to
  // every key here, so that softmax stays finite on every LibTorch, and is
  // zeroed after (no host sync to ask whether there is one).
  auto none = mask.any(-1, /*keepdim=*/true).logical_not();
  return attention_of_seen(q, k, v, dropout, mask.logical_or(none))
      .masked_fill(none, 0.0);
}

at::Tensor attention_keep_mask(
    const at::Tensor& attention_mask,
    int64_t t,
    int64_t window,
    const at::Device& device) {
  const bool windowed = window > 0 && window < t;
  if (!attention_mask.defined() && !windowed) {
    return at::Tensor();
  }
  auto opts = at::TensorOptions().device(device);
  auto i = at::arange(t, opts.dtype(at::kLong)).unsqueeze(1);
  auto j = at::arange(t, opts.dtype(at::kLong)).unsqueeze(0);
  auto keep = j.le(i); // [T, T]
  if (windowed) {
    keep = keep.logical_and((i - j).lt(window));
  }
  keep = keep.view({1, 1, t, t});
  if (attention_mask.defined()) {
    TORCH_CHECK(
        attention_mask.dim() == 2 && attention_mask.size(1) == t,
        "attention_mask must be [B, T] with T the sequence length (",
        t,
        "), got ",
        attention_mask.sizes());
    auto real =
        attention_mask.to(device).ne(0).view({attention_mask.size(0), 1, 1, t});
    keep = keep.logical_and(real); // left padding: rows with no key
  }
  return keep;
}

at::Tensor packed_documents_mask(
    const at::Tensor& keep,
    const at::Tensor& position_ids,
    int64_t t,
    const at::Device& device) {
  if (t < 2) {
    return keep;
  }
  const auto pos = position_ids.to(device);
  const auto starts =
      (pos.narrow(1, 1, t - 1) - pos.narrow(1, 0, t - 1)).ne(1); // [B, T - 1]
  if (!starts.any().item<bool>()) {
    return keep;
  }
  const auto doc = at::cat(
                       {at::zeros({pos.size(0), 1}, pos.options()),
                        starts.to(at::kLong).cumsum(1)},
                       1); // [B, T]
  const auto same =
      doc.unsqueeze(2).eq(doc.unsqueeze(1)).unsqueeze(1); // [B, 1, T, T]
  auto causal = keep;
  if (!causal.defined()) {
    auto i = at::arange(t, pos.options()).unsqueeze(1);
    causal = at::arange(t, pos.options()).unsqueeze(0).le(i).view({1, 1, t, t});
  }
  return causal.logical_and(same);
}

at::Tensor to_head_shards(
    const at::Tensor& x,
    const distributed::ProcessGroupPtr& sp,
    bool fp8) {
  return cdf::all_to_all_along_dims(
      x, /*scatter_dim=*/2, /*gather_dim=*/1, sp, fp8);
}

at::Tensor to_sequence_shards(
    const at::Tensor& x,
    const distributed::ProcessGroupPtr& sp,
    bool fp8) {
  return cdf::all_to_all_along_dims(
      x, /*scatter_dim=*/1, /*gather_dim=*/2, sp, fp8);
}

std::pair<at::Tensor, at::Tensor> sequence_chunk(
    const at::Tensor& ids,
    const ParallelState& st) {
  const int64_t t = ids.size(1);
  if (!st.sequence_on_sp()) {
    return {ids, at::arange(t, ids.options().dtype(at::kLong))};
  }
  const int n = st.sp_size(), r = st.sp == nullptr ? 0 : st.sp->rank();
  if (st.sp_mode == shardformer::SequenceParallelMode::kRingAttn) {
    auto pos = utils::upload_async(sl::zigzag_positions(t, n)[r], ids.device());
    return {ids.index_select(1, pos), pos};
  }
  TORCH_CHECK(
      t % n == 0,
      "sequence parallelism: the sequence length ",
      t,
      " must be divisible by the sequence-parallel size ",
      n);
  const int64_t len = t / n;
  return {
      ids.narrow(1, r * len, len),
      at::arange(r * len, (r + 1) * len, ids.options().dtype(at::kLong))};
}

bool sequence_split_output(const ParallelState& st) {
  return st.sequence_on_sp() && st.parallel_output && st.sp_size() > 1;
}

at::Tensor causal_lm_head_loss(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const at::Tensor& targets,
    const ParallelState& st,
    int64_t vocab_size,
    const std::function<at::Tensor(const at::Tensor&)>& logits_of) {
  // The head whole on this rank, or split by vocabulary over tp (a rank's
  // rows times the ranks cover the vocabulary).
  const bool fused = !sequence_split_output(st) &&
      at::isFloatingType(weight.scalar_type()) &&
      weight.size(0) * st.tp_size() >= vocab_size;
  if (!fused) {
    return causal_lm_loss(logits_of(hidden), targets, st, vocab_size);
  }
  TORCH_CHECK(
      targets.sizes() == hidden.sizes().slice(0, hidden.dim() - 1),
      "forward_loss: targets must be [B, T] as the ids, got ",
      targets.sizes(),
      " for hidden states ",
      hidden.sizes());
  return shardformer::layer::vocab_parallel_fused_linear_cross_entropy(
      hidden.flatten(0, -2),
      weight,
      targets.flatten().to(hidden.device()),
      st.tp_size() > 1 ? st.tp : nullptr,
      vocab_size);
}

at::Tensor split_sequence(const at::Tensor& x, const ParallelState& st) {
  return st.sp_mode == shardformer::SequenceParallelMode::kSplitGather
      ? cdf::split_along_dim(x, 1, st.tp, st.fp8)
      : x;
}

at::Tensor gather_sequence(const at::Tensor& x, const ParallelState& st) {
  if (st.sp_mode == shardformer::SequenceParallelMode::kSplitGather) {
    return cdf::gather_along_dim(x, 1, st.tp, st.fp8);
  }
  if (!st.sequence_on_sp() || sequence_split_output(st)) {
    return x;
  }
  auto whole =
      cdf::gather_along_dim(cdf::scale_grad(x, st.sp_size()), 1, st.sp, st.fp8);
  if (st.sp_mode == shardformer::SequenceParallelMode::kRingAttn &&
      st.sp_size() > 1) {
    // Gathered in rank order of the zigzag chunks: back to token order.
    auto order = sl::zigzag_positions(whole.size(1), st.sp_size()).flatten();
    whole = whole.index_select(
        1, utils::upload_async(at::argsort(order), x.device()));
  }
  return whole;
}

at::Tensor sequence_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const ParallelState& st,
    shardformer::layer::DropoutImpl* dropout,
    const at::Tensor& mask) {
  if (st.sp_mode != shardformer::SequenceParallelMode::kRingAttn) {
    return attention(q, k, v, dropout, mask);
  }
  TORCH_CHECK(
      !mask.defined(),
      "ring_attn sequence parallelism is causal only: an attention_mask "
      "(padding) or a sliding window needs another sequence_parallelism_mode "
      "(split_gather, all_to_all) or none");
  TORCH_CHECK(
      dropout == nullptr,
      "ring_attn sequence parallelism has no attention dropout: set the "
      "model's attention dropout to 0 (GPT-2: attn_pdrop) or train without "
      "it");
  return sl::ring_attention(
      q,
      k,
      v,
      sl::zigzag_positions(q.size(2) * st.sp_size(), st.sp_size()),
      st.sp,
      st.rings);
}

void shard_linears(
    std::initializer_list<sl::Linear1D_ColImpl*> cols,
    std::initializer_list<sl::Linear1D_RowImpl*> rows,
    const distributed::ProcessGroupPtr& tp,
    shardformer::SequenceParallelMode sp_mode,
    const shardformer::ShardConfig& cfg) {
  const bool seq_parallel = shardformer::on_tensor_group(sp_mode);
  const bool ring = sp_mode == shardformer::SequenceParallelMode::kRing;
  const bool fp8 = cfg.fp8_communication();
  for (auto* col : cols) {
    col->options.seq_parallel(seq_parallel)
        .ring(ring)
        .overlap(seq_parallel && cfg.enable_sequence_overlap());
    col->fp8_communication = fp8;
    col->shard_(tp);
  }
  for (auto* row : rows) {
    row->options.seq_parallel(seq_parallel).ring(ring);
    row->fp8_communication = fp8;
    row->shard_(tp);
  }
}

void set_dropout(
    sl::Dropout& d,
    const distributed::ProcessGroupPtr& group,
    bool sharded) {
  d->options.process_group(group).sharded_input(sharded);
  d->reset();
}

void add_partial_grads(
    shardformer::ShardInfo& info,
    const std::string& prefix,
    std::initializer_list<const char*> names) {
  for (const char* n : names) {
    info.partial_grad_params.insert(prefix + n);
  }
}

void append_stage_blocks(
    std::vector<std::string>& names,
    const shardformer::StageLayers& layers,
    int64_t num_blocks,
    const std::string& prefix) {
  const int64_t end = layers.end < 0 ? num_blocks : layers.end;
  for (int64_t i = layers.begin; i < end; ++i) {
    names.push_back(prefix + std::to_string(i));
  }
}

} // namespace models
} // namespace colossalai
