#pragma once

// Internal state shared by FullyShardedModel and FullyShardedOptimizer; see
// NOTE [FSDP units] in include/colossalai/zero/fully_sharded.h.

#include <colossalai/zero/fully_sharded.h>

#include <torch/csrc/autograd/function.h>

#include <deque>
#include <memory>
#include <string>
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

struct Unit {
  std::string name; // "" for the root
  torch::nn::Module* module = nullptr;
  bool root = false;

  std::vector<at::Tensor> params; // the module's own tensors
  std::vector<std::string> param_names;
  std::vector<int64_t> offsets; // into the flat buffer
  int64_t numel = 0;            // unpadded
  int64_t shard = 0;            // s: elements per rank
  int64_t grads_expected = 0;   // parameters that require grad

  at::Tensor full;       // S*s in param dtype; its storage is freed at rest
  bool aliased = false;  // full is the shard itself (nothing to gather)
  at::Tensor shard_data; // fp32 s (master weights)
  at::Tensor shard_grad; // fp32 s
  std::vector<at::Tensor> pieces; // per param: its part of shard_data
  std::vector<PieceRange> ranges; // per param: where that part lies
  // Per param: its view of `full`, made while the storage was allocated
  // (views cannot be made of a freed storage).
  std::vector<at::Tensor> views;

  // Gather state.
  bool gathered = false;
  bool gathering = false;
  distributed::Work gather_work;
  at::Tensor gather_src;

  // Backward state.
  int64_t grads_ready = 0;
  bool grads_done = false;
  bool reducing = false;
  at::Tensor flat_grad;
  at::Tensor reduced; // this rank's reduced shard (reduce dtype)
  distributed::Work reduce_work;

  int64_t padded() const {
    return full.numel();
  }
};

struct FsdpState : std::enable_shared_from_this<FsdpState> {
  FullyShardedOptions o;
  distributed::ProcessGroupPtr shard_group;     // S ranks
  distributed::ProcessGroupPtr replicate_group; // R ranks, null when R == 1
  int S = 1;
  int R = 1;
  at::Device device = at::kCPU;
  at::Device shard_device = at::kCPU;
  at::ScalarType param_dtype = at::kFloat;
  at::ScalarType reduce_dtype = at::kFloat;

  std::vector<Unit> units; // units[0] is the root (possibly empty)
  std::vector<at::Tensor> ignored_params; // neither sharded nor reduced
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<size_t> order; // non-root units in first-forward order
  bool order_recorded = false;
  bool recording = false;

  bool in_forward = false;
  bool in_backward = false;
  bool require_sync = true;
  bool summoned = false;
  std::deque<size_t> reducing;
  int64_t prefetches = 0;

  int64_t optimizer_bytes = 0; // measured after each step
  FullyShardedMemoryStats peak;

  int shard_rank() const {
    return shard_group->rank();
  }
  bool reshard_after_forward(const Unit& u) const;
  bool reshard_at_rest() const {
    return o.sharding_strategy() != ShardingStrategy::kNoShard;
  }

  // (Re-)installs the gradient-accumulator hooks; needed again whenever a
  // parameter's dtype changed under set_data (autograd then drops its
  // accumulator).
  void install_grad_hooks();

  // Gathering.
  void launch_gather(size_t k);
  void wait_gather(size_t k);
  void ensure_gathered(size_t k) {
    launch_gather(k);
    wait_gather(k);
  }
  void reshard(size_t k);
  // Re-gathers a unit that is gathered, after its shard changed.
  void refresh_gathered();

  // Forward.
  void enter_unit(size_t k);
  at::Tensor exit_unit(size_t k, const at::Tensor& output);
  void root_pre_forward();
  void root_post_forward();

  // Backward.
  void begin_backward();
  void pre_backward(size_t k);
  void on_grad(size_t k, size_t i);
  void unit_grads_done(size_t k);
  void reduce(size_t k);
  void consume(size_t k);
  void finalize_backward();
  c10::optional<size_t> backward_next(size_t k) const;
  c10::optional<size_t> forward_next(size_t k) const;

  FullyShardedMemoryStats measure() const;
  void sample_peak();
};

} // namespace detail
} // namespace zero
} // namespace colossalai
