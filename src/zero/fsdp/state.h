#pragma once

// Internal state shared by FullyShardedModel and FullyShardedOptimizer; see
// NOTE [FSDP units] in include/colossalai/zero/fully_sharded.h.

#include <colossalai/zero/fully_sharded.h>

#include "../../distributed/grad_bucketer.h"
#include "../common/flat_params.h"
#include "../gemini/placement.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace zero {
namespace detail {

// A unit: its parameters in the flat shard layout (NOTE [Flat shard
// layout]) plus the gathered full buffer and per-backward state.
struct Unit : FlatParams {
  std::string name; // "" for the root
  bool root = false;
  // Tiers (NOTE [Gemini placement]).
  bool offloaded = false; // fp32 shard, its gradient and states on the host
  bool param_offloaded = false; // no device copy of the parameter shard
  bool keep_gathered = false;   // parameters stay gathered between uses
  at::Tensor param_shard;       // the device copy, in param_dtype
  int64_t optim_bytes = 0;      // its optimizer states, after each step

  std::vector<std::string> param_names;

  at::Tensor full;      // S*s in param dtype; its storage is freed at rest
  bool aliased = false; // full is the shard itself (nothing to gather)
  // Per param: its view of `full`, made while the storage was allocated
  // (views cannot be made of a freed storage).
  std::vector<at::Tensor> views;

  // Gather state.
  bool gathered = false;
  bool gathering = false;
  distributed::Work gather_work;
  at::Tensor gather_src;

  // Backward state.
  at::Tensor flat_grad; // this backward's full gradients, flat
  at::Tensor reduced;   // this rank's reduced shard (reduce dtype)
  int64_t staging = 0;  // the reduce-scatter's workspace while it runs

  int64_t numel() const {
    return layout.numel;
  }
  int64_t padded() const {
    return layout.padded();
  }
};

// A forward scope: the root, or a module that opens a ForwardScope. The
// units holding its parameters are gathered while it runs and again for
// its backward. FSDP has one unit per scope; with chunks (Gemini, NOTE
// [Gemini chunks]) they are the chunks its parameters fall in, and a chunk
// may serve several scopes.
struct Scope {
  std::string name; // "" for the root
  torch::nn::Module* module = nullptr;
  std::vector<size_t> units;
};

struct FsdpState : std::enable_shared_from_this<FsdpState>,
                   distributed::BucketHandler {
  FullyShardedOptions o;
  distributed::ProcessGroupPtr shard_group;     // S ranks
  distributed::ProcessGroupPtr replicate_group; // R ranks, null when R == 1
  int S = 1;
  int R = 1;
  at::Device device = at::kCPU;
  at::ScalarType param_dtype = at::kFloat;
  at::ScalarType reduce_dtype = at::kFloat;
  // fp8_communication, where the group spans nodes: the shard group's
  // gathers and reduce-scatters, the replicas' all-reduce.
  bool fp8_shard = false;
  bool fp8_replicate = false;

  std::vector<Unit> units;   // units[0] is the root's (possibly empty)
  std::vector<Scope> scopes; // scopes[0] is the root
  // Per unit: the scopes using it in the running forward, and the scope
  // whose backward completes it (for kBackwardPost prefetch).
  std::vector<int> open_scopes;
  std::vector<size_t> unit_scope;
  std::vector<at::Tensor> ignored_params; // neither sharded nor reduced
  // Gradient reduction: one bucket per unit with trainable parameters.
  std::shared_ptr<distributed::GradBucketer> bucketer;
  // Device-to-host gradient copies of the host tier (NOTE [Offload copies
  // overlap the backward]).
  utils::HostCopies host_copies;
  // NOTE [Host steps overlap the backward]: set by the optimizer with
  // overlap_host_step; hands unit k's host update to it.
  std::function<void(size_t)> step_ahead;
  std::shared_ptr<StepsAhead> ahead = std::make_shared<StepsAhead>();
  std::vector<std::pair<size_t, size_t>> grad_params; // (unit, index)
  std::vector<size_t> bucket_unit;
  std::vector<std::vector<size_t>> buckets; // until the bucketer exists
  std::vector<size_t> order; // non-root scopes in first-forward order
  bool order_recorded = false;
  bool recording = false;
  // std::uncaught_exceptions() when the forward began: a forward that
  // raised partway records no order (the next one does).
  int exceptions_at_forward = 0;

  bool in_forward = false;
  bool summoned = false;
  int64_t prefetches = 0;

  int64_t optimizer_bytes = 0; // measured after each step
  FullyShardedMemoryStats peak;
  std::unique_ptr<gemini::Placement> placement;

  int shard_rank() const {
    return shard_group->rank();
  }
  bool reshard_after_forward(const Unit& u) const;
  bool reshard_at_rest() const {
    return o.sharding_strategy() != ShardingStrategy::kNoShard;
  }

  bool in_backward() const {
    return bucketer != nullptr && bucketer->in_backward();
  }
  void set_require_sync(bool require) {
    bucketer->set_sync(require);
  }

  // (Re-)installs the gradient-accumulator hooks; needed again whenever a
  // parameter's dtype changed under set_data (autograd then drops its
  // accumulator).
  void install_grad_hooks();

  // Gathering.
  // A prefetch is skipped when the placement has no room for it.
  void launch_gather(size_t k, bool prefetch = false);
  void wait_gather(size_t k);
  void ensure_gathered(size_t k) {
    launch_gather(k);
    wait_gather(k);
  }
  void reshard(size_t k);
  // Re-gathers a unit that is gathered, after its shard changed.
  void refresh_gathered();

  // Gathers all units of scope `s` (launched together, then waited).
  void gather_scope(size_t s);
  void prefetch_scope(size_t s);

  // Forward.
  void enter_scope(size_t s);
  at::Tensor exit_scope(size_t s, const at::Tensor& output);
  void root_pre_forward();
  void root_post_forward();

  // Backward (BucketHandler: see NOTE [Gradient bucketing]).
  void pre_backward(size_t s);
  void before_backward() override;
  void fill(size_t param, bool used) override;
  void on_bucket_ready(size_t bucket) override;
  distributed::Work launch(size_t bucket) override;
  // Sums `grad` over the replicas (R > 1), through FP8 with fp8_replicate.
  distributed::Work all_reduce_replicas(at::Tensor& grad);
  void complete(size_t bucket) override;
  void on_finalized(bool synced) override;
  void on_reset() override;
  c10::optional<size_t> backward_next(size_t s) const;
  c10::optional<size_t> forward_next(size_t s) const;

  FullyShardedMemoryStats measure() const;
  void sample_peak();
};

} // namespace detail
} // namespace zero
} // namespace colossalai
