#pragma once

/// What every tensor-parallel layer shares (ColossalAI's `ParallelModule`):
/// it is built whole (no group: a plain layer, tensor-parallel size 1) and
/// sharded in place over a group by `shard_`, and it says how each of its
/// parameters splits, so that full (Hugging Face-layout) weights can be cut
/// into shards on load and gathered back on save at any tensor-parallel size.
///
/// Sharding in place keeps every parameter's identity (`set_data`), so an
/// optimizer built from the whole model before `boost` stays valid.
///
/// Example (a custom layer's spec, and cutting / gathering by it):
/// \code
///   using namespace colossalai::shardformer::layer;
///   ShardSpec spec = ShardSpec::split(0, /*full_size=*/1000, tp)
///                        .with_padding(1024);     // vocabulary rows
///   auto mine = shard_tensor(full, spec);         // [1024 / tp, E]
///   auto back = unshard_tensor(all_ranks_chunks, spec); // [1000, E]
/// \endcode

#include <colossalai/distributed/process_group.h>

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace colossalai {
namespace shardformer {
namespace layer {

/// How one parameter splits over its tensor-parallel group.
struct ShardSpec {
  /// Replicated on every rank of the group.
  static ShardSpec replicated() {
    return ShardSpec();
  }
  /// Split along `dim` into `group`'s size chunks, rank r holding chunk r;
  /// `full_size` is the whole size along `dim`.
  static ShardSpec split(
      int64_t dim,
      int64_t full_size,
      distributed::ProcessGroupPtr group);
  /// The `sections` equal sections along `dim` (a fused q, k, v projection:
  /// 3) are split separately: rank r holds its chunk of each, in order.
  ShardSpec with_sections(int64_t sections) const;
  /// Zero rows are appended along `dim` up to `padded` before splitting
  /// (vocabulary padding); gathering cuts them off again.
  ShardSpec with_padding(int64_t padded) const;

  bool is_split() const {
    return dim >= 0;
  }
  int size() const {
    return group == nullptr ? 1 : group->size();
  }
  int rank() const {
    return group == nullptr ? 0 : group->rank();
  }

  int64_t dim = -1;
  int64_t sections = 1;
  int64_t full_size = 0;
  int64_t padded_size = 0;
  distributed::ProcessGroupPtr group;
};

/// This rank's shard of the whole tensor `full` (a new tensor).
at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec);
/// This rank's shard of `full` for group rank `rank` of `world`.
at::Tensor shard_tensor(
    const at::Tensor& full,
    const ShardSpec& spec,
    int world,
    int rank);
/// This rank's shard of `full` as a view (no copy) where it is one plain
/// slice of it (one section, no padding, an even split); `full` itself
/// where the spec does not split; else an undefined tensor (use
/// `shard_tensor`). Loaders read into such a view without a copy.
at::Tensor shard_view(const at::Tensor& full, const ShardSpec& spec);
/// The whole tensor from every rank's shard, in group-rank order.
at::Tensor unshard_tensor(
    const std::vector<at::Tensor>& shards,
    const ShardSpec& spec);

/// Interface of the tensor-parallel layers.
class ParallelModule {
 public:
  virtual ~ParallelModule() = default;
  /// Shards the whole layer in place over `group` (a layer that needs more,
  /// e.g. sequence parallelism, reads its options, set before).
  virtual void shard_(const distributed::ProcessGroupPtr& group) = 0;
  /// How this module's own parameters (not its children's) split, by their
  /// local names; parameters not listed are replicated.
  virtual std::map<std::string, ShardSpec> shard_specs() const = 0;

  /// An additive adapter beside the layer (LoRA, NOTE [LoRA in C++]):
  /// given the layer's input, its result is added to the output. Empty:
  /// none.
  std::function<at::Tensor(const at::Tensor& input)> output_adapter;
  /// Whether output_adapter's first use of its input is a matmul (LoRA
  /// without dropout), so that under autocast it may read the input's
  /// shared cast (amp::SharedCast) in place of the input.
  bool output_adapter_takes_cast = false;
  /// ShardConfig::fp8_communication: the layer's tensor-parallel
  /// collectives travel as FP8 where its group spans more than one node
  /// (distributed/functional.h's `fp8`). Ring layers' overlapped transfers
  /// stay in the working dtype.
  bool fp8_communication = false;
};

namespace detail {
/// Replaces `param`'s data by its shard under `spec`, keeping the tensor's
/// identity (and requires_grad).
void shard_param_(at::Tensor& param, const ShardSpec& spec);
} // namespace detail

} // namespace layer
} // namespace shardformer
} // namespace colossalai
