#pragma once

// The one flat shard layout of the sharded strategies (ZeRO-1/2 buckets,
// FSDP units; a Gemini chunk is this layout plus a placement).
//
// NOTE [Flat shard layout]
// A group of parameters is flattened, in order, into one buffer padded to
// P = N * s elements (N: ranks sharing the shards); rank r owns elements
// [r*s, (r+1)*s), its shard. A parameter may straddle shard boundaries;
// the part of it inside this rank's shard is its piece (possibly empty).
// The optimizer steps pieces, so parameter groups, per-group options and
// checkpoints keep the model's own parameter order, and one all-gather of
// the shards rebuilds the whole buffer (one collective per group, not per
// parameter). A reduce-scatter of a flat gradient buffer leaves each rank
// the gradient of exactly its shard.

#include <colossalai/distributed/collectives.h>

#include "../../utils/host_memory.h"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <vector>

namespace colossalai {
namespace zero {
namespace detail {

// Where a parameter meets this rank's shard: elements [in_param, in_param +
// len) of the flattened parameter are elements [in_shard, in_shard + len)
// of the shard (len may be 0).
struct PieceRange {
  int64_t in_shard = 0;
  int64_t in_param = 0;
  int64_t len = 0;
};

struct FlatShardLayout {
  std::vector<int64_t> offsets; // of each parameter in the flat buffer
  std::vector<int64_t> numels;
  std::vector<PieceRange> ranges; // of each parameter in this rank's shard
  int64_t numel = 0;              // unpadded
  int64_t shard = 0;              // s: elements per rank
  int world = 1;
  int rank = 0;

  /// Lays out `params` (only their sizes are read) over `world` ranks.
  static FlatShardLayout of(
      const std::vector<at::Tensor>& params,
      int world,
      int rank);

  int64_t padded() const {
    return shard * world;
  }
  /// An uninitialised flat buffer of padded() elements whose padding is
  /// zero (so a reduction over it adds nothing there).
  at::Tensor empty_flat(const at::TensorOptions& options) const;
  /// A zero-padded flat copy of `tensors` (one per parameter).
  at::Tensor flatten(
      const std::vector<at::Tensor>& tensors,
      const at::TensorOptions& options) const;
  /// Copies `tensor` (parameter i's shape) into its place in `flat`.
  void copy_into(at::Tensor& flat, size_t i, const at::Tensor& tensor) const;
  /// Parameter i's place in a flat buffer, shaped as `sizes`.
  at::Tensor view(const at::Tensor& flat, size_t i, at::IntArrayRef sizes)
      const;
  /// This rank's shard of a flat buffer.
  at::Tensor my_shard(const at::Tensor& flat) const {
    return flat.narrow(0, static_cast<int64_t>(rank) * shard, shard);
  }
  /// Parameter i's piece of a shard-sized tensor.
  at::Tensor piece(const at::Tensor& shard_tensor, size_t i) const {
    return shard_tensor.narrow(0, ranges[i].in_shard, ranges[i].len);
  }
  /// Parameter i's piece of a whole (flattened) parameter-sized tensor.
  at::Tensor piece_of_param(const at::Tensor& param_flat, size_t i) const {
    return param_flat.narrow(0, ranges[i].in_param, ranges[i].len);
  }
};

/// Bytes of `t`'s elements (0 for an undefined tensor), for memory stats.
inline int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

/// A group of parameters in the flat shard layout, as the sharded optimizer
/// sees it: fp32 master shard, gradient shard and one piece per parameter
/// (a view of the shard whose .grad is a view of the gradient shard).
struct FlatParams {
  FlatShardLayout layout;
  std::vector<at::Tensor> params; // the model's parameters
  at::Tensor shard_data;          // fp32 s: master weights
  /// s gradients: fp32, or bf16 where the strategy keeps them in the
  /// working dtype (NOTE [Gradient shards in bf16]).
  at::Tensor shard_grad;
  /// shard_grad holds zeros (after construction and every zeroing): the
  /// next reduced gradient may be copied in instead of added, and a
  /// zeroing may skip it. Whatever writes other values clears it.
  bool grad_is_zero = true;
  std::vector<at::Tensor> pieces; // the optimizer's tensors
  /// The ranks sharing this group's shards when they are not the
  /// optimizer's (ZeRO's experts, over the ranks holding them); null: the
  /// optimizer's group.
  distributed::ProcessGroupPtr group;

  /// Makes `pieces` from `shard_data` and `shard_grad`.
  void make_pieces();
};

/// Whether `optimizer` steps float32 masters from 16-bit gradients as from
/// their float32 values, so that a strategy may keep its gradient shards in
/// bf16 (NOTE [Gradient shards in bf16]): LibTorch's Adam and AdamW (their
/// ops promote to the state's float32), FusedAdam / FusedAdamW and
/// HybridAdam. Others (SGD makes its momentum buffer a copy of the first
/// gradient, in that gradient's dtype) get float32 shards.
bool steps_from_low_precision_grads(const torch::optim::Optimizer& optimizer);

/// g.shard_grad += reduced (in the shard's dtype). Into a zero shard the sum is
/// a copy, made through `copies` (NOTE [Offload copies overlap the
/// backward] when it crosses to the host): copies.wait() before shard_grad
/// is read.
void accumulate_grad(
    FlatParams& g,
    const at::Tensor& reduced,
    utils::HostCopies& copies);

/// Starts the all-gather of every rank's `shard` into the padded `full`
/// (no collective when the layout has one rank: a copy).
distributed::Work all_gather_flat(
    at::Tensor& full,
    const at::Tensor& shard,
    const FlatShardLayout& layout,
    const distributed::ProcessGroup* group);

} // namespace detail
} // namespace zero
} // namespace colossalai
