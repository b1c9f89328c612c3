#pragma once

/// Tensor-parallel embeddings and the vocabulary-parallel LM head and loss
/// (ColossalAI's `Embedding1D`, `VocabParallelEmbedding1D`,
/// `VocabParallelLMHead1D`, `dist_cross_entropy`).
///
/// Vocabularies are padded to a multiple of make_vocab_size_divisible_by x
/// tp (as ColossalAI's policies do), so every rank holds the same number of
/// rows; padded rows are zero and padded logits never win: the parallel
/// cross entropy masks them.
///
/// Example (a GPT's tied embedding and head, logits kept sharded):
/// \code
///   using namespace colossalai::shardformer::layer;
///   VocabParallelEmbedding1D wte(
///       VocabParallelEmbedding1DImpl::from_full(*full_wte, tp));
///   auto h = wte(tokens);                       // [B, T, E], replicated
///   auto logits = lm_head_logits(h, wte->weight, tp); // [B, T, V_pad / tp]
///   auto loss = vocab_parallel_cross_entropy(
///       logits.flatten(0, 1), targets.flatten(), tp,
///       full_wte->weight.size(0));
/// \endcode

#include <colossalai/distributed/process_group.h>
#include <colossalai/shardformer/layer/parallel_module.h>

#include <ATen/core/Reduction.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/pimpl.h>

namespace colossalai {
namespace shardformer {
namespace layer {

/// `vocab` rounded up to a multiple of `divisible_by` x `tp`.
int64_t padded_vocab_size(int64_t vocab, int64_t divisible_by, int tp);

struct Embedding1DOptions {
  Embedding1DOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, embedding_dim);
  /// VocabParallelEmbedding1D / LMHead1D: once sharded, the vocabulary is
  /// padded to a multiple of this times the tensor-parallel size (a layer
  /// with no group keeps exactly num_embeddings rows).
  TORCH_ARG(int64_t, make_vocab_size_divisible_by) = 64;
  /// Embedding1D: all-gather the embedding dimension (false: each rank keeps
  /// its embedding_dim / tp slice).
  TORCH_ARG(bool, gather_output) = true;
  /// The tensor-parallel group; null: not sharded (a plain Embedding).
  TORCH_ARG(distributed::ProcessGroupPtr, process_group) = nullptr;
};

/// The embedding dimension split over the group: rank r holds columns
/// [r * E / tp, (r + 1) * E / tp) of every row.
class Embedding1DImpl : public torch::nn::Cloneable<Embedding1DImpl>,
                        public ParallelModule {
 public:
  explicit Embedding1DImpl(Embedding1DOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);
  /// Shards this whole layer in place over `group`.
  void shard_(const distributed::ProcessGroupPtr& group) override;
  std::map<std::string, ShardSpec> shard_specs() const override;
  static std::shared_ptr<Embedding1DImpl> from_full(
      const torch::nn::EmbeddingImpl& full,
      const distributed::ProcessGroupPtr& group,
      bool gather_output = true);

  Embedding1DOptions options;
  at::Tensor weight; ///< [V, E / tp]
  distributed::ProcessGroupPtr group;
};
TORCH_MODULE(Embedding1D);

/// The (padded) vocabulary split over the group: rank r holds rows
/// [r * V_pad / tp, (r + 1) * V_pad / tp). Each rank looks up the tokens in
/// its range (zeros elsewhere) and the results are summed (all-reduce).
class VocabParallelEmbedding1DImpl
    : public torch::nn::Cloneable<VocabParallelEmbedding1DImpl>,
      public ParallelModule {
 public:
  explicit VocabParallelEmbedding1DImpl(Embedding1DOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);
  /// Pads and shards this whole layer in place over `group`.
  void shard_(const distributed::ProcessGroupPtr& group) override;
  std::map<std::string, ShardSpec> shard_specs() const override;
  static std::shared_ptr<VocabParallelEmbedding1DImpl> from_full(
      const torch::nn::EmbeddingImpl& full,
      const distributed::ProcessGroupPtr& group,
      int64_t make_vocab_size_divisible_by = 64);

  /// This rank's first vocabulary row and its row count.
  int64_t vocab_start() const {
    return vocab_start_;
  }
  int64_t padded_num_embeddings() const {
    return padded_;
  }
  /// This rank's rows that hold real (not padding) vocabulary entries.
  int64_t real_rows() const;

  Embedding1DOptions options;
  at::Tensor weight; ///< [V_pad / tp, E]
  distributed::ProcessGroupPtr group;

 private:
  int64_t padded_ = 0;
  int64_t vocab_start_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding1D);

/// An untied LM head over a vocabulary-parallel weight (ColossalAI's
/// VocabParallelLMHead1D): weight [V_pad / tp, E], no bias. `forward` gives
/// this rank's vocabulary columns of the logits, or with `gather_output` the
/// whole [.., vocab] logits (ColossalAI's parallel_output false).
class VocabParallelLMHead1DImpl
    : public torch::nn::Cloneable<VocabParallelLMHead1DImpl>,
      public ParallelModule {
 public:
  explicit VocabParallelLMHead1DImpl(Embedding1DOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& hidden);
  void shard_(const distributed::ProcessGroupPtr& group) override;
  std::map<std::string, ShardSpec> shard_specs() const override;

  Embedding1DOptions options;
  at::Tensor weight; ///< [V_pad / tp, E]
  distributed::ProcessGroupPtr group;
};
TORCH_MODULE(VocabParallelLMHead1D);

/// The LM head of a vocabulary-parallel model: logits of this rank's
/// vocabulary rows, x W_r^T, with the input's gradient summed over the group
/// (VocabParallelLMHead1D; `weight` is usually the tied embedding's shard).
/// With `gather_output` the logits are all-gathered and cut back to
/// `vocab_size` (ColossalAI's parallel_output false). `fp8`: the
/// collectives travel as FP8 across nodes (distributed/functional.h).
at::Tensor lm_head_logits(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const distributed::ProcessGroupPtr& group,
    bool gather_output = false,
    int64_t vocab_size = -1,
    bool fp8 = false);

/// Mean cross entropy of vocabulary-sharded logits ([N, V_pad / tp] on
/// each rank, rank-major) against `target` ([N], global ids) without
/// gathering the logits: the row maximum, the target logit and the sum of
/// exponentials are reduced over the group (Megatron's
/// vocab_parallel_cross_entropy). Columns at or beyond `vocab_size` (the
/// padding) are excluded; targets equal to `ignore_index` count for
/// nothing. Its gradient is softmax - one_hot on each rank's columns.
/// `reduction` Sum gives the sum over the counted targets instead of their
/// mean (0 when none counts).
at::Tensor vocab_parallel_cross_entropy(
    const at::Tensor& logits,
    const at::Tensor& target,
    const distributed::ProcessGroupPtr& group,
    int64_t vocab_size,
    int64_t ignore_index = -100,
    at::Reduction::Reduction reduction = at::Reduction::Mean);

/// The loss of a vocabulary-parallel head without its logits:
/// `vocab_parallel_cross_entropy(lm_head_logits(hidden, weight, group),
/// target, group, vocab_size, ignore_index)` through
/// kernels::fused_linear_cross_entropy with a VocabShard, chunks of tokens
/// whose statistics are reduced over `group` (NOTE [Fused causal-LM
/// loss]). `hidden` [N, C] is the same on every rank, `weight` this rank's
/// [V_pad / tp, C] rows (rank-major, equal shards), `target` [N] global
/// ids. A null or one-rank group takes the whole head (its first
/// `vocab_size` rows).
at::Tensor vocab_parallel_fused_linear_cross_entropy(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const at::Tensor& target,
    const distributed::ProcessGroupPtr& group,
    int64_t vocab_size,
    int64_t ignore_index = -100,
    int64_t chunk_size = 0);

} // namespace layer
} // namespace shardformer
} // namespace colossalai
