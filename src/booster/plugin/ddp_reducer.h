#pragma once

// Gradient bucketing and overlapped all-reduce for TorchDDPModel; see
// NOTE [DDP gradient reduction].

#include <colossalai/distributed/collectives.h>

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

struct ReducerOptions {
  int64_t first_bucket_bytes = 1 << 20;
  int64_t bucket_bytes = 25 << 20;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
};

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  Reducer(
      std::vector<std::string> names,
      std::vector<at::Tensor> params,
      distributed::ProcessGroupPtr group,
      ReducerOptions options);

  /// Installs the gradient-accumulator hooks; call once after make_shared.
  void register_hooks();

  bool require_sync = true;

  std::vector<int64_t> bucket_numels() const;
  int64_t bytes_per_sync() const;
  /// Buckets whose all-reduce started from a gradient hook, i.e. while
  /// backward was still computing, in the last synchronized backward.
  size_t buckets_overlapped() const {
    return overlapped_last_;
  }

 private:
  struct Slot {
    size_t bucket;
    int64_t offset;
    int64_t numel;
  };
  struct Bucket {
    std::vector<size_t> params;
    at::Tensor buffer;
    size_t pending = 0;
    distributed::Work work;
  };

  void build_buckets();
  void on_grad_ready(size_t index);
  void mark_ready(size_t index, bool used);
  void launch_ready_buckets();
  void finalize();
  void reset();

  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  distributed::ProcessGroupPtr group_;
  ReducerOptions options_;

  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;

  // Per-backward state.
  std::vector<char> ready_;
  std::vector<int32_t> used_;
  size_t next_bucket_ = 0;
  bool in_backward_ = false;
  bool finalizing_ = false;
  size_t overlapped_ = 0;
  size_t overlapped_last_ = 0;

  // static_graph: parameters found unused everywhere in the first iteration.
  bool unused_known_ = false;
  std::vector<char> globally_unused_;
};

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
