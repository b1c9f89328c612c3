#pragma once

// NOTE [Gemini placement]
// Every unit (a Gemini chunk) has state in two tiers, the device (where it
// computes) and the host:
//  - its fp32 shard, gradient shard and optimizer states: the device, or the
//    host when the unit is offloaded (static: offload_optim_fraction; auto:
//    every unit, as ColossalAI's auto policy does, less those moved into
//    the device margin, below);
//  - for an offloaded unit, a device copy of its shard in param_dtype (the
//    parameter shard), which the all-gather reads. Static placement keeps it
//    unless the unit is among the first offload_param_fraction units, which
//    read the host shard at every gather; auto placement caches it while the
//    budget allows. The fp32 host shard is the master copy, so evicting the
//    device copy moves nothing back: it is dropped, and fetched again (host
//    to device) by the next gather that needs it;
//  - while it computes: its gathered parameters and full gradients.
//
// With gpu_margin_mem_ratio > 0 (auto), the first optimizer step first
// measures the device margin (the steady budget below, less the model
// data that cannot be evicted) and moves units, in order, whose four fp32
// copies (shard, gradient shard, two Adam moments) fit in that share of
// it to the device tier: their shards and gradients move, the optimizer
// creates their states there, their steps run on the device and their
// gathers read the device shard. States that exist already (loaded before
// the first step) move with their unit; a unit whose states the optimizer
// keeps in files stays.
//
// Auto placement keeps the device tier's model data within a budget:
//   warm-up (the first step): capacity * (1 - warmup_non_model_data_ratio);
//   later: capacity * steady_cuda_cap_ratio - the non-model memory recorded
//   at this moment and the next one of the warm-up step.
// Non-model memory at a moment is the device's allocated bytes minus the
// model data (both tiers on a CPU-only build, where the device tier is host
// memory) minus what was allocated before the model was sharded. Moments are
// the engine's decision points: the root's forward, each module's forward
// and backward, each unit's gradients completing. A gather for backward
// also reserves the unit's gradient buffers (the flat gradient, the reduced
// shard and, on Gloo, which has no reduce-scatter, the exchange buffer),
// which appear after the decision. When a gather needs room,
// parameter shards of units not being gathered are evicted, the one whose
// next use (from the gather order recorded in the warm-up step) is furthest
// first, or the least recently used in the warm-up step. A prefetch that
// does not fit is skipped; a gather that does not fit is an error naming
// the budget.
//
// On CUDA the tiers are real devices and the moves are copies; on a CPU-only
// build both tiers are host memory, the moves are counted but cost nothing,
// and the budget is enforced on the accounting (which is how the policy is
// tested without a GPU). Only sampled moments are checked: memory a module
// allocates and frees inside its own forward is not seen.

#include <colossalai/zero/fully_sharded.h>

#include <functional>
#include <vector>

namespace colossalai {
namespace zero {
namespace detail {
struct FsdpState;
struct Unit;
} // namespace detail
namespace gemini {

// Non-model memory per moment of a pass (ColossalAI's memory stats
// collector): recorded in the warm-up step, read back in later ones.
class MemoryTracer {
 public:
  void begin_pass() {
    index_ = 0;
  }
  // Records one moment (warm-up) or steps over it.
  void record(int64_t non_model, bool warmup);
  // The most non-model memory of the current moment and the next; the most
  // of the whole warm-up step beyond the recorded moments.
  int64_t next_period() const;
  size_t moments() const {
    return recorded_.size();
  }

 private:
  std::vector<int64_t> recorded_;
  size_t index_ = 0;
  int64_t max_ = 0;
};

class Placement {
 public:
  Placement(detail::FsdpState& state, PlacementOptions options);

  // Chooses each unit's tiers (before the units are built).
  void assign_tiers();
  // Creates the static parameter shards and measures the baseline (after).
  void setup();

  // The tensor unit `k`'s all-gather reads (param_dtype, on the device; at
  // one rank a device-tier unit's float32 shard itself, which the caller's
  // copy converts), after making room for it and its gathered buffer;
  // undefined when a prefetch does not fit.
  at::Tensor gather_source(size_t k, bool prefetch);
  // A decision point (NOTE [Gemini placement]).
  void moment();
  // Samples device use between moments (with the last non-model figure).
  void sample();
  void begin_forward();
  void moved_to_host(int64_t bytes) {
    stats_.device_to_host += bytes;
  }
  // The fp32 shards changed: refresh the device parameter shards (but
  // those refresh_param_shard already refreshed during this step).
  void refresh_param_shards();
  // Unit k's device parameter shard from its updated fp32 shard now, while
  // the host steps other units (NOTE [Publishing during the host step]);
  // whether it has one.
  bool refresh_param_shard(size_t k);
  // Forgets refreshes of an earlier step that did not complete.
  void begin_step();
  // In the step, after begin_step: unit k's device parameter shard holds
  // its updated weights already, uploaded during the backward (NOTE [Host
  // steps overlap the backward]); accounts the upload.
  void refreshed_ahead(size_t k);
  // How the optimizer's states of a unit move with it: whether they can
  // (none is kept in files), and the move itself.
  struct StateMover {
    std::function<bool(const detail::Unit&)> movable;
    std::function<void(const detail::Unit&, at::Device)> move;
  };
  // Whether the next optimizer step moves units into the device margin:
  // kAuto with gpu_margin_mem_ratio, before its first step.
  bool margin_pending() const {
    return !margin_used_ && o_.policy() == PlacementPolicy::kAuto &&
        o_.gpu_margin_mem_ratio() > 0.0;
  }
  // At that step, before it: moves units (and their optimizer states) into
  // the device margin (NOTE [Gemini placement]).
  void before_step(const StateMover& states);
  // After an optimizer step: refreshes, and ends the warm-up.
  void after_step();

  PlacementStats stats() const;
  void reset_peak();

 private:
  int64_t device_model() const;
  int64_t host_model() const;
  int64_t model_budget() const;
  // Evicts parameter shards (never unit `k`'s, nor those being gathered)
  // until `need` bytes fit; whether they do.
  bool make_room(int64_t need, size_t k);
  int64_t next_use(size_t k) const;
  // The device margin: what the steady budget leaves beside the model data
  // that cannot be evicted (everything but cached parameter shards).
  int64_t device_margin() const;
  // Copies unit k's fp32 shard into its device parameter shard, if any.
  bool copy_param_shard(size_t k);
  // Moves unit k's fp32 shard and gradient shard to the device tier.
  void move_to_device(size_t k);

  detail::FsdpState& st_;
  PlacementOptions o_;
  int64_t capacity_ = 0;
  int64_t baseline_ = 0;
  int64_t fixed_device_ = 0; // buffers and ignored parameters
  MemoryTracer tracer_;
  bool warmup_ = true;
  bool margin_used_ = false;
  std::vector<size_t> uses_; // gathers of the warm-up step, in order
  std::vector<std::vector<size_t>> use_positions_; // per unit
  size_t position_ = 0;
  std::vector<int64_t> last_use_;
  int64_t clock_ = 0;
  PlacementStats stats_;
  std::vector<bool> refreshed_; // by refresh_param_shard, this step
};

} // namespace gemini
} // namespace zero
} // namespace colossalai
