#pragma once

// The DDP engine (ZeRO stage 0): TorchDDPModel's gradient all-reduce on
// the shared GradBucketer, beside the ZeRO-1/2 and FSDP engines.

#include "../../distributed/grad_bucketer.h"

#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace zero {
namespace detail {

struct ReducerOptions {
  int64_t first_bucket_bytes = 1 << 20;
  int64_t bucket_bytes = 25 << 20;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  /// Buckets all-reduce through FP8 (e5m2, NOTE [FP8 messages]).
  bool fp8 = false;
};

/// DDP's strategy on the shared bucketer: buckets of whole gradients,
/// averaged by an all-reduce, copied back into `.grad` (or left as views).
class Reducer : public distributed::BucketHandler {
 public:
  Reducer(
      std::vector<std::string> names,
      std::vector<at::Tensor> params,
      distributed::ProcessGroupPtr group,
      ReducerOptions options);

  /// Installs the gradient-accumulator hooks.
  void register_hooks();

  void set_require_sync(bool require) {
    bucketer_->set_sync(require);
  }
  bool require_sync() const {
    return bucketer_->sync();
  }
  /// Averages now what backwards with sync off accumulated in `.grad`.
  void sync_gradients();

  std::vector<int64_t> bucket_numels() const;
  int64_t bytes_per_sync() const;
  /// Buckets whose all-reduce started from a gradient hook, i.e. while
  /// backward was still computing, in the last synchronized backward.
  size_t buckets_overlapped() const {
    return bucketer_->buckets_overlapped();
  }

  // BucketHandler.
  void on_backward_begin() override;
  void fill(size_t param, bool used) override;
  distributed::Work launch(size_t bucket) override;
  void complete(size_t bucket) override {}
  void on_missing(const std::vector<size_t>& params) override;
  void before_wait() override;
  void on_finalized(bool synced) override;

 private:
  struct Slot {
    size_t bucket;
    int64_t offset;
    int64_t numel;
  };

  std::vector<std::vector<size_t>> plan_buckets();
  at::Tensor view_of(size_t param) const;

  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  distributed::ProcessGroupPtr group_;
  ReducerOptions options_;
  at::Tensor world_; // the group size, a 0-dim divisor

  std::vector<Slot> slots_;
  std::vector<at::Tensor> buffers_; // one per bucket
  std::shared_ptr<distributed::GradBucketer> bucketer_;

  // Per-backward: which parameters got a gradient here; after the
  // unused-parameter exchange, which got none on any rank.
  std::vector<int32_t> used_;
  std::vector<char> unused_;
  // static_graph: parameters found unused everywhere in the first iteration.
  bool unused_known_ = false;
  std::vector<char> globally_unused_;
};

} // namespace detail
} // namespace zero
} // namespace colossalai
