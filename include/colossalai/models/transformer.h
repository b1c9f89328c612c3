#pragma once

/// Pieces the Hugging Face-layout transformers (GPT-2, LLaMA, OPT, BLOOM,
/// BERT) share: causal attention with or without the fused kernel, the
/// Ulysses head exchange, the runtime parallel state a policy leaves in a
/// model, and the steps every family's policy takes to shard it.

#include <colossalai/distributed/process_group.h>
#include <colossalai/shardformer/layer/linear.h>
#include <colossalai/shardformer/layer/normalization.h>
#include <colossalai/shardformer/layer/ring_attention.h>
#include <colossalai/shardformer/policy.h>
#include <colossalai/shardformer/shard_config.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

namespace colossalai {
namespace models {

class KVCache;

/// What a model's forward needs to know after sharding (set by its policy;
/// the defaults are a whole model on one process).
struct ParallelState {
  distributed::ProcessGroupPtr tp;
  /// kNone, kSplitGather (over `tp`; ring's layers overlap their matmuls,
  /// the model's forward sees split_gather), or kAllToAll / kRingAttn (over
  /// `sp`).
  shardformer::SequenceParallelMode sp_mode =
      shardformer::SequenceParallelMode::kNone;
  distributed::ProcessGroupPtr sp;
  /// ring_attn's double ring over `sp` (ShardConfig::inner_ring_size);
  /// empty: one ring.
  shardformer::layer::DoubleRing rings;
  bool parallel_output = true;
  /// Share of the blocks (the first ones) that recompute their activations
  /// in backward (ColossalAI: int(ratio x num_layers) blocks).
  double gradient_checkpointing_ratio = 0.0;
  /// ShardConfig::fp8_communication: the model's own tensor- and
  /// sequence-parallel collectives travel as FP8 across nodes.
  bool fp8 = false;
  /// The cache of the forward_cached in progress (null otherwise): the
  /// model's forward begins a step of it, each attention layer appends its
  /// keys and values and attends to all it holds (NOTE [Generation]).
  KVCache* kv_cache = nullptr;

  int tp_size() const {
    return tp == nullptr ? 1 : tp->size();
  }
  int sp_size() const {
    return sp == nullptr ? 1 : sp->size();
  }
  /// Whether the tokens are split over `sp` from the embeddings to the final
  /// norm (all_to_all, ring_attn).
  bool sequence_on_sp() const {
    return shardformer::on_sp_group(sp_mode);
  }
};

/// Fills `state` from `config` for a policy, after checking that `heads`
/// (the heads that split: GPT-2's, LLaMA's key/value heads; `what` names
/// them) divide over the tensor group and, per tensor rank, over the
/// all_to_all group.
void configure_parallel_state(
    ParallelState& state,
    const shardformer::ShardConfig& config,
    int64_t heads,
    const char* policy,
    const char* what);

/// Block `index` of `num_blocks`: `fn(x)`, checkpointed (nn::checkpoint,
/// the block's random streams replayed) when it is among the first
/// int(gradient_checkpointing_ratio x num_blocks) blocks and `block` trains.
at::Tensor run_block(
    const ParallelState& state,
    int64_t index,
    int64_t num_blocks,
    torch::nn::Module& block,
    const std::function<at::Tensor(const at::Tensor&)>& fn,
    const at::Tensor& x);

/// Runs a pipeline stage's blocks of `blocks` (each a `Block`): [begin,
/// end) of `layers`, end -1 meaning all, each through `run_block` (block i
/// of all of them) as `fn(block, x)`. Every family's forward_stage loops
/// over its blocks this way.
template <class Block, class Fn>
at::Tensor run_stage_blocks(
    const ParallelState& state,
    const shardformer::StageLayers& layers,
    torch::nn::ModuleListImpl& blocks,
    at::Tensor x,
    const Fn& fn) {
  const auto n = static_cast<int64_t>(blocks.size());
  const int64_t end = layers.end < 0 ? n : layers.end;
  for (int64_t i = layers.begin; i < end; ++i) {
    auto* block = blocks[i]->as<Block>();
    x = run_block(
        state,
        i,
        n,
        *block,
        [block, fn](const at::Tensor& y) { return fn(*block, y); },
        x);
  }
  return x;
}

/// A family's forward_cached for its duration: refuses what generation
/// does not run under (sequence parallelism: `who` names the model), points
/// `state.kv_cache` at `cache` and clears it again however the forward
/// ends. The forward itself begins the cache's step; `finish` ends it.
class CachedForward {
 public:
  CachedForward(ParallelState& state, KVCache& cache, const char* who);
  ~CachedForward();
  CachedForward(const CachedForward&) = delete;
  CachedForward& operator=(const CachedForward&) = delete;
  /// Ends the cache's step and returns the logits as forward_cached gives
  /// them: the last `logits_to_keep` positions (0: all) of `hidden_to_logits`
  /// applied to `hidden`, over the whole vocabulary (gathered over tp when
  /// the head leaves it split, padded columns cut) on every rank.
  at::Tensor finish(
      const at::Tensor& hidden,
      int64_t logits_to_keep,
      int64_t vocab_size,
      const std::function<at::Tensor(const at::Tensor&)>& hidden_to_logits);

 private:
  ParallelState& state_;
  KVCache& cache_;
};

/// Default positions of a step of `t` tokens: 0 .. t - 1 after what
/// `state.kv_cache` holds (none: from 0), int64 [t] on `device`.
at::Tensor step_positions(
    const ParallelState& state,
    int64_t t,
    const at::Device& device);

/// Checks `position_ids`: undefined, or [B, T] like `ids`; `who` names
/// the model in the error.
void check_position_ids(
    const at::Tensor& ids,
    const at::Tensor& position_ids,
    const char* who);

/// nn.Embedding's padding_idx on a lookup `rows` = embedding(`ids`) of
/// `weight`: the lookups of token `pad` give its row no gradient (none when
/// `pad` < 0, or when no gradient is being recorded for `weight`). The row
/// still gets one elsewhere (a tied LM head), as in transformers.
at::Tensor without_padding_grad(
    const at::Tensor& rows,
    const at::Tensor& ids,
    int64_t pad,
    const at::Tensor& weight);

/// Logits of an LM head tied to the token embedding `weight`: [B, T, V],
/// or this rank's vocabulary shard when `state` keeps the output parallel.
at::Tensor tied_lm_head_logits(
    const at::Tensor& x,
    const at::Tensor& weight,
    const ParallelState& state,
    int64_t vocab_size);

/// Mean next-token cross entropy of a causal LM's logits [B, T, V or
/// V_pad / tp] against targets [B, T] over the targets other than -100:
/// vocabulary-parallel where `state` leaves the logits split over tp; over
/// this rank's tokens where it leaves them split over sp, the sum and the
/// count reduced over sp (`nn::token_mean`), so that the value is the whole
/// sequence's token mean and the sp-averaged gradient its gradient, however
/// the counted tokens fall on the ranks.
at::Tensor causal_lm_loss(
    const at::Tensor& logits,
    const at::Tensor& targets,
    const ParallelState& state,
    int64_t vocab_size);

/// NOTE [Fused causal-LM loss]
/// Every causal family's `forward_loss(ids, targets, ...)` is
/// `loss(forward(ids, ...), targets)` without the logits: the final hidden
/// states and the head's weight go to kernels::fused_linear_cross_entropy,
/// chunks of tokens whose loss and logits gradient a CUDA kernel takes in
/// place on a GPU, so the [tokens x vocab] logits and their float32 copy
/// are never whole. Under tensor parallelism each rank takes its
/// vocabulary shard's part of every chunk and the softmax statistics are
/// reduced over tp (shardformer::layer::vocab_parallel_fused_linear_
/// cross_entropy; ATen, no kernel yet). Under a sequence split over sp, or
/// with a head whose weight is not floating (quantized) or that carries
/// adapters, it is `loss(logits)` itself. Both take the softmax and the
/// loss in float32; they agree within the compute dtype's rounding.
/// On one H200 (bench/results/2026-11-28-gpu): GPT-2 medium's bf16 step
/// 58.9 -> 55.9 ms and its peak 16.7 -> 12.6 GiB; a Llama 3.2 1B shape
/// 189.0 -> 184.5 ms and 43.9 -> 33.9 GiB.
///
/// causal_lm_head_loss is that choice for final hidden states `hidden`
/// [B, T, C] (after the last norm) and the head's `weight`; `logits_of`
/// gives the family's logits of `hidden` where the fused loss does not
/// apply.
at::Tensor causal_lm_head_loss(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const at::Tensor& targets,
    const ParallelState& state,
    int64_t vocab_size,
    const std::function<at::Tensor(const at::Tensor&)>& logits_of);

/// Causal softmax attention of q [B, H, T, D] and k, v [B, H_kv, T_k, D]
/// -> [B, H, T, D], through compat::scaled_dot_product_attention
/// (LibTorch's kernel on 2.x; fewer key/value heads than query heads:
/// grouped-query attention) unless `dropout` (may be null) is active: then
/// matmul, mask, softmax and `dropout` on the probabilities (equal heads). `mask` (optional, from
/// `attention_keep_mask`) replaces the causal mask: true where a query may
/// see a key. A query that may see no key (left padding) gets a zero
/// output, as transformers' SDPA attention on PyTorch >= 2.5.
at::Tensor attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    shardformer::layer::DropoutImpl* dropout,
    const at::Tensor& mask = at::Tensor());

/// The boolean [B, 1, T, T] mask of which keys each query of a whole
/// sequence of length `t` sees: causal, within `sliding_window` positions
/// (query i sees key j when i - j < window; <= 0: no window, Mistral's
/// convention) and not padding (`attention_mask` [B, T], Hugging Face's:
/// 1 for a real token, 0 for padding). A query left with no key (left
/// padding) keeps none (see `attention`). Undefined when nothing beyond
/// causality is masked (the fused causal kernel then runs).
at::Tensor attention_keep_mask(
    const at::Tensor& attention_mask,
    int64_t t,
    int64_t sliding_window,
    const at::Device& device);

/// Packed sequences, as transformers 5's masks read `position_ids` given
/// without an attention_mask and without a cache (GPT-2 and the LLaMA
/// family; training runs so): wherever a row's
/// position does not follow the one before by 1 (typically a restart at
/// 0), a new document starts, and attention stays inside each document.
/// `keep` (undefined: causal) gains that block diagonal; returned unchanged
/// when no row holds more than one document.
at::Tensor packed_documents_mask(
    const at::Tensor& keep,
    const at::Tensor& position_ids,
    int64_t t,
    const at::Device& device);

/// Ulysses: [B, T / sp, H, D] sequence-sharded -> [B, T, H / sp, D]
/// head-sharded over `sp` (and `to_sequence_shards` back); `fp8`:
/// ParallelState::fp8.
at::Tensor to_head_shards(
    const at::Tensor& x,
    const distributed::ProcessGroupPtr& sp,
    bool fp8 = false);
at::Tensor to_sequence_shards(
    const at::Tensor& x,
    const distributed::ProcessGroupPtr& sp,
    bool fp8 = false);

/// This rank's tokens of a [B, T] int64 batch and their positions when
/// `state` splits the sequence over sp (contiguous chunks for all_to_all,
/// the zigzag split for ring_attn); the whole batch and 0 .. T - 1 else.
std::pair<at::Tensor, at::Tensor> sequence_chunk(
    const at::Tensor& ids,
    const ParallelState& state);

/// Whether the model's output stays split along the sequence over sp
/// (all_to_all, ring_attn with parallel_output): the LM head and the loss
/// then run on this rank's tokens only (`causal_lm_loss` takes the matching
/// targets and reports the whole sequence's token mean).
bool sequence_split_output(const ParallelState& state);

/// The embeddings' output [B, T, C] as the blocks take it: this rank's
/// sequence chunk over tp under split_gather (`gather_sequence` undoes
/// it), `x` itself otherwise.
at::Tensor split_sequence(const at::Tensor& x, const ParallelState& state);

/// The final hidden states [B, T, C] from this rank's share: gathered over
/// tp (split_gather); left split over sp when `sequence_split_output`, else
/// gathered over sp (back in token order, the gradient scaled by sp since
/// every sp rank computes the whole loss but keeps only its tokens'
/// gradient); `x` itself otherwise.
at::Tensor gather_sequence(const at::Tensor& x, const ParallelState& state);

/// Causal attention of this rank's q, k, v [B, H, T_local, D] under
/// `state`: ring attention over sp for ring_attn (attention dropout must be
/// off there, and no `mask`: the ring is causal only), else `attention`
/// over the local sequence.
at::Tensor sequence_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const ParallelState& state,
    shardformer::layer::DropoutImpl* dropout,
    const at::Tensor& mask = at::Tensor());

// What every family's policy does the same way. Kept here, once, so that
// the families differ only where their models do.

/// The model a policy was given, as the class it shards: a policy handed
/// another model fails with "<policy>: the model is not <expected>"
/// (`expected` with its article: "a GPT2LMHeadModel", "an OPTForCausalLM").
template <class T>
T& policy_model(
    torch::nn::Module& model,
    const char* policy,
    const char* expected) {
  auto* m = dynamic_cast<T*>(&model);
  TORCH_CHECK(m != nullptr, policy, ": the model is not ", expected);
  return *m;
}

/// `policy_model` for the const queries (num_pipeline_layers, held_layers,
/// shared_params).
template <class T>
const T& policy_model(
    const torch::nn::Module& model,
    const char* policy,
    const char* expected) {
  const auto* m = dynamic_cast<const T*>(&model);
  TORCH_CHECK(m != nullptr, policy, ": the model is not ", expected);
  return *m;
}

/// Shards a vocabulary-parallel embedding or LM head (anything with
/// Embedding1DOptions and shard_) over the config's tensor group, its
/// vocabulary padded to make_vocab_size_divisible_by, as every family's
/// embedding is.
template <class Layer>
void shard_vocab_parallel(Layer& layer, const shardformer::ShardConfig& cfg) {
  layer.options.make_vocab_size_divisible_by(
      cfg.make_vocab_size_divisible_by());
  layer.fp8_communication = cfg.fp8_communication();
  layer.shard_(cfg.tensor_parallel_process_group());
}

/// Shards a block's column-parallel layers, then its row-parallel ones, in
/// the order given, over `tp`, with sequence parallelism in the layers when
/// `sp_mode` is split_gather or ring (ring also overlaps their matmuls):
/// every family's blocks shard their linears this way. `cfg` gives
/// fp8_communication and enable_sequence_overlap.
void shard_linears(
    std::initializer_list<shardformer::layer::Linear1D_ColImpl*> cols,
    std::initializer_list<shardformer::layer::Linear1D_RowImpl*> rows,
    const distributed::ProcessGroupPtr& tp,
    shardformer::SequenceParallelMode sp_mode,
    const shardformer::ShardConfig& cfg);

/// Points `d` at `group` (null: none), its input `sharded` over it (each
/// rank its own mask) or replicated (the same mask), and resets it so its
/// random stream follows that layout.
void set_dropout(
    shardformer::layer::Dropout& d,
    const distributed::ProcessGroupPtr& group,
    bool sharded);

/// Marks `prefix` + each of `names` as a partial-gradient parameter (used on
/// this rank's sequence chunk only, its gradient summed over tp).
void add_partial_grads(
    shardformer::ShardInfo& info,
    const std::string& prefix,
    std::initializer_list<const char*> names);

/// Appends `prefix` + i for the blocks i a pipeline stage holds: [begin,
/// end) of `layers`, end -1 meaning all `num_blocks` (held_layers' middle
/// part in every family).
void append_stage_blocks(
    std::vector<std::string>& names,
    const shardformer::StageLayers& layers,
    int64_t num_blocks,
    const std::string& prefix);

/// micro_batch[i] when present and defined, undefined when absent (its
/// shape is LMPolicy::check_micro_batch's).
at::Tensor micro_batch_input(
    const std::vector<at::Tensor>& micro_batch,
    size_t i);

/// The policy of colossalai::models' language models, whose pipeline
/// micro-batch is {ids, labels, ...} and whose `loss` is the mean over the
/// labels other than -100: a pipeline step weighs each micro-batch's loss
/// by that count (NOTE [Token-mean losses]).
class LMPolicy : public shardformer::Policy {
 public:
  int64_t loss_items(
      const std::vector<at::Tensor>& micro_batch) const override;
  /// Refuses more tensors than `micro_batch_inputs` names, each by name,
  /// and inputs after the labels that are not [B, T] like the ids.
  void check_micro_batch(
      const std::vector<at::Tensor>& micro_batch) const override;
  /// What the micro-batch holds, in order: {input_ids, labels,
  /// attention_mask, position_ids} (a causal LM's; the last two optional).
  virtual std::vector<std::string> micro_batch_inputs() const {
    return {"input_ids", "labels", "attention_mask", "position_ids"};
  }
};

/// Policy::stage_forward of a causal LM `T` whose micro-batch is {ids,
/// labels, attention_mask, position_ids} (the last two optional; a family
/// without position ids, `kPositions` false, takes three; the plugin has
/// checked it with LMPolicy::check_micro_batch):
/// `T::forward_stage(layers, ids, hidden, attention_mask[, position_ids])`
/// on every stage, after the checks that `model` is a `T` (see
/// `policy_model`) and that the micro-batch starts with the ids ("<policy>:
/// the micro-batch must start with the input ids").
template <class T, bool kPositions = true>
at::Tensor causal_lm_stage_forward(
    torch::nn::Module& model,
    const shardformer::StageLayers& layers,
    const std::vector<at::Tensor>& micro_batch,
    const at::Tensor& hidden,
    const char* policy,
    const char* expected) {
  auto& m = policy_model<T>(model, policy, expected);
  TORCH_CHECK(
      !micro_batch.empty() && micro_batch[0].defined(),
      policy,
      ": the micro-batch must start with the input ids");
  // [1] is the criterion's labels: not an input of the forward.
  const auto mask = micro_batch_input(micro_batch, 2);
  if constexpr (kPositions) {
    return m.forward_stage(
        layers, micro_batch[0], hidden, mask, micro_batch_input(micro_batch, 3));
  } else {
    return m.forward_stage(layers, micro_batch[0], hidden, mask);
  }
}

namespace detail {
/// Registers, once, the families' hooks with checkpoint IO (NOTE [Model
/// state hooks]): tied weights' second names, as Python's state_dict()
/// holds them, and the config files a sharded save writes beside its
/// shards; each family's constructor calls it.
void register_checkpoint_hooks();
} // namespace detail

/// Every MLP under `model` that can forms its activation again in backward
/// instead of keeping it, where its output projection is plain (no tensor
/// parallelism, adapter or quantization): LLaMA's silu(gate) * up
/// (kernels::silu_mul_linear, LlamaMLP), GPT-2's and BLOOM's gelu of the
/// first projection (kernels::gelu_linear, GPT2MLP, BloomMLP). A [tokens x
/// intermediate] tensor less per layer, one elementwise pass more. Off by
/// default. Returns how many MLPs it set.
///
/// Example:
/// \code
///   colossalai::models::set_mlp_activation_recompute(*model, true);
/// \endcode
int64_t set_mlp_activation_recompute(torch::nn::Module& model, bool on);

} // namespace models
} // namespace colossalai
