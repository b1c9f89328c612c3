#pragma once

/// Point-to-point transfers between pipeline stages (ColossalAI's
/// `pipeline.p2p.PipelineP2PCommunication`): activations forward, their
/// gradients backward, asynchronous so compute overlaps them.
///
/// NOTE [Pipeline p2p]
/// Each transfer belongs to a stream (a tag: one per destination virtual
/// stage, direction and micro-batch), so transfers can be posted in any
/// order. A receiver must know the shape and dtype before it posts its
/// receive: the sender first sends a small metadata message (dtype, rank,
/// sizes). With `enable_metadata_cache` this happens once per stream key
/// (virtual stage and direction); later transfers reuse the cached metadata,
/// so the receive can be posted before it is needed (overlap), and a shape
/// that changes between micro-batches is an error on the sender, which
/// names the option. Sends are kept alive until `wait_sends`.
///
/// Example:
/// \code
///   PipelineP2PCommunication p2p(pp_group, /*enable_metadata_cache=*/true);
///   p2p.send(hidden, /*dst=*/1, StreamKey{1, false}, /*micro_batch=*/0);
///   auto pending = p2p.post_recv(/*src=*/0, StreamKey{1, false}, 0);
///   at::Tensor x = pending.wait();
/// \endcode

#include <colossalai/distributed/collectives.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace pipeline {

/// A stream between stages: the activations entering virtual stage
/// `virtual_stage` (grad false), or the gradient of that stage's output,
/// which the next stage sends back (grad true).
struct StreamKey {
  int virtual_stage = 0;
  bool grad = false;
  bool operator<(const StreamKey& o) const {
    return virtual_stage != o.virtual_stage ? virtual_stage < o.virtual_stage
                                            : grad < o.grad;
  }
};

/// A receive in flight.
class PendingRecv {
 public:
  PendingRecv() = default;
  PendingRecv(at::Tensor tensor, distributed::Work work)
      : tensor_(std::move(tensor)), work_(std::move(work)) {}
  bool valid() const {
    return tensor_.defined();
  }
  /// Blocks until the data is there (a DistributedError naming the rank
  /// after the group timeout).
  at::Tensor wait() {
    work_.wait();
    return tensor_;
  }

 private:
  at::Tensor tensor_;
  distributed::Work work_;
};

class PipelineP2PCommunication {
 public:
  PipelineP2PCommunication(
      distributed::ProcessGroupPtr group,
      bool enable_metadata_cache = true);

  /// Starts sending `tensor` to pipeline rank `dst`.
  void send(
      const at::Tensor& tensor,
      int dst,
      const StreamKey& key,
      int micro_batch);
  /// Posts the receive from pipeline rank `src`; blocks only for the
  /// metadata when it is not cached.
  PendingRecv post_recv(int src, const StreamKey& key, int micro_batch);
  /// Whether `post_recv` would return without blocking.
  bool can_post_early(const StreamKey& key) const;
  /// Completes every send started so far.
  void wait_sends();

  /// Metadata messages sent so far (tests: one per stream with the cache).
  int64_t metadata_sent() const {
    return metadata_sent_;
  }
  const distributed::ProcessGroupPtr& group() const {
    return group_;
  }

 private:
  struct Meta {
    at::ScalarType dtype;
    std::vector<int64_t> sizes;
  };
  int tag(const StreamKey& key, int micro_batch, bool meta) const;

  distributed::ProcessGroupPtr group_;
  bool cache_;
  std::map<StreamKey, Meta> sent_, received_;
  struct InFlight {
    at::Tensor tensor;
    distributed::Work work;
  };
  std::vector<InFlight> sends_;
  int64_t metadata_sent_ = 0;
};

} // namespace pipeline
} // namespace colossalai
