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

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace colossalai {
namespace nn {
namespace optimizer {
class HybridAdam;
} // namespace optimizer
} // namespace nn
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

// NOTE [Host steps overlap the backward]
// With master shards on the host (ZeRO's cpu_offload, Gemini's host tier)
// a step is the device's backward, then HybridAdam's CPU update of every
// host shard, then their upload: the host idles while the device computes,
// and the device while the host steps. At 7B scale the host step is of the
// order of the whole backward. But a group's (chunk's, bucket's) gradient
// is final as soon as its reduced shard has reached the host, long before
// the backward ends (the backward runs from the last group to the first).
// With overlap_host_step the strategy hands each host group to
// HybridAdam::step_ahead there (step_group_ahead): a background thread
// waits for the gradient's copy to land (HostCopies::landed), updates the
// master shard and its states with the CPU kernel, and uploads the new
// weights (Gemini's device parameter shard; ZeRO's weights at one rank) on
// a side stream that first waits for the device's work queued before the
// hand-over, the backward's last reads of those weights among it
// (utils::upload_after). step() waits for the thread, makes the device's
// stream wait for the uploads, and updates the rest (the device's groups;
// across ZeRO ranks the all-gathers, which must keep one order on every
// rank). The arithmetic is step()'s on the same values, so the weights are
// the same bit for bit where the same groups live on the host (Gemini's
// static placement puts the last ones there with the option: the first
// the backward completes); only the host's time moves into the backward. The
// first step is not overlapped: it creates the optimizer's states (on the
// stepping thread: zeroing them on the backward's would hold up the
// device's queue, and on a CPU-only machine it would count them as
// activations in Gemini's placement).
// What it cannot serve is refused by name: clipping by the global norm and
// fp16's overflow check need every gradient before any update; a second
// synchronising backward before step() would add to gradients already
// consumed (refused before it changes anything, BucketHandler::
// before_backward); options changed after the backward would not reach
// the groups already updated (HybridAdam::step refuses them); zero_grad
// and clipping between the backward and step() come too late for those
// groups (ShardedOptimizer refuses them). A backward that raised after some
// groups were taken (NOTE [A backward that raised]) leaves a step that can
// be neither finished (the other gradients are incomplete) nor taken back:
// ShardedOptimizer::backward waits for the updates and uploads taken before
// it rethrows, so nothing runs in the background any more, and everything
// but loading the optimizer's states (a checkpoint) is refused by name. On
// a CPU-only machine the "device" and the host are the same cores, and
// nothing is gained.

/// NOTE [Host steps overlap the backward]: a strategy's groups updated
/// ahead of the coming step, and where their uploads to the device land.
/// The backward's thread marks and queues; the optimizer's background
/// thread adds uploads; step() finishes.
class StepsAhead {
 public:
  /// On the backward's thread: group k was handed to the optimizer.
  void note_taken(size_t k) {
    taken_.push_back(k);
    ended_ = false;
  }
  /// In the strategy's finalize: the backward that took them ended.
  void note_backward_end() {
    ended_ = true;
  }
  /// Groups were taken by a backward that raised before its end.
  bool raised() const {
    return pending() && !ended_;
  }
  /// On the optimizer's thread: group k's device copy lands at `landed`.
  void add_upload(size_t k, utils::StreamPoint landed) {
    const std::lock_guard<std::mutex> lock(mu_);
    uploads_.emplace_back(k, std::move(landed));
  }
  bool pending() const {
    return !taken_.empty();
  }
  size_t count() const {
    return taken_.size();
  }
  /// After the optimizer's wait_ahead: makes `device`'s current stream
  /// wait for every upload, returns the groups uploaded, and forgets all.
  std::vector<size_t> finish(const at::Device& device) {
    std::vector<size_t> uploaded;
    {
      const std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [k, landed] : uploads_) {
        landed.block_current(device); // the next forward reads them
        uploaded.push_back(k);
      }
      uploads_.clear();
    }
    taken_.clear();
    return uploaded;
  }
  /// After the optimizer's wait_ahead: blocks the host until every upload
  /// landed (no copy left in flight), keeping all.
  void settle() {
    const std::lock_guard<std::mutex> lock(mu_);
    for (const auto& upload : uploads_) {
      upload.second.synchronize();
    }
  }
  /// Settles, then forgets all (a step that failed, or was dropped).
  void clear() {
    settle();
    const std::lock_guard<std::mutex> lock(mu_);
    uploads_.clear();
    taken_.clear();
  }

 private:
  std::vector<size_t> taken_; // backward's thread, then step()
  bool ended_ = false;
  std::mutex mu_;
  std::vector<std::pair<size_t, utils::StreamPoint>> uploads_;
};

/// NOTE [Host steps overlap the backward]: hands group `g` (index k) to
/// `optimizer`'s step_ahead on the backward's thread, once its gradient
/// shard was handed to `copies`. After the update, on the optimizer's
/// thread, `dst` (a device copy of the weights; undefined: none to
/// refresh) gets the updated master shard on a side stream, after the
/// device's work queued now (the backward's last reads of `dst` among it).
/// The job holds its own references: a strategy may drop `dst` meanwhile.
/// Returns whether the optimizer took the group (then noted in `ahead`).
bool step_group_ahead(
    nn::optimizer::HybridAdam& optimizer,
    const FlatParams& g,
    size_t k,
    const utils::HostCopies& copies,
    at::Tensor dst,
    const at::Device& device,
    const std::shared_ptr<StepsAhead>& ahead);

/// NOTE [Host steps overlap the backward]: why a second backward before
/// step() is refused where host shards were updated ahead.
inline constexpr const char* kSecondBackwardAhead =
    "overlap_host_step: a second backward before optimizer.step(); the "
    "first one's host shards were already updated for the coming step. "
    "Call step() after every backward, or turn overlap_host_step off to "
    "accumulate gradients over several backwards";

/// NOTE [Host steps overlap the backward]: why everything but loading the
/// optimizer's states is refused after a backward that raised once host
/// shards were updated ahead.
inline constexpr const char* kRaisedBackwardAhead =
    "overlap_host_step: the last backward raised after some host shards had "
    "been updated for the coming step, and the other gradients are "
    "incomplete: that step can be neither finished nor taken back. Load the "
    "model and the optimizer from a checkpoint to go on (booster.load_model, "
    "booster.load_optimizer), or turn overlap_host_step off where a loop "
    "skips the batches whose backward raised";

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
