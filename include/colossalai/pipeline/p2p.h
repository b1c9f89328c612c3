#pragma once

/// Point-to-point transfers between pipeline stages (ColossalAI's
/// `pipeline.p2p.PipelineP2PCommunication`): activations forward, their
/// gradients backward, asynchronous so compute overlaps them.
///
/// NOTE [Pipeline p2p]
/// A receiver must know the shape and dtype before it posts its receive:
/// the sender first sends a small metadata message (dtype, rank, sizes).
/// With `enable_metadata_cache` this happens once per stream key (virtual
/// stage and direction); later transfers reuse the cached metadata, so the
/// receive can be posted before it is needed (overlap), and a shape that
/// changes between micro-batches is an error on the sender, which names the
/// option. Sends are kept alive until `wait_sends`.
/// Messages are matched by order, never by tag: NCCL ignores tags, and
/// queues a pair's sends and receives on one stream, so two ranks that each
/// post a receive from the other before their send would wait forever.
/// Hence two groups over the same ranks: one carries every message to a
/// higher rank, the other every message to a lower one, and on each a pair
/// only ever moves data one way. The receiver posts its receives in the
/// order the sender sends (the engine posts them in its actions' order, and
/// `p2p_order_mismatch` proves every generated schedule consistent). Gloo
/// runs the same path with tag 0, so the CPU suite tests what NCCL relies on.
///
/// Example:
/// \code
///   PipelineP2PCommunication p2p(pp_group, /*enable_metadata_cache=*/true);
///   p2p.send(hidden, /*dst=*/1, StreamKey{1, false}, /*micro_batch=*/0);
///   auto pending = p2p.post_recv(/*src=*/0, StreamKey{1, false}, 0);
///   at::Tensor x = pending.wait();
/// \endcode

#include <colossalai/distributed/collectives.h>

#include <functional>
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
  /// `decode`, when set, turns what arrived into the tensor (FP8 bytes).
  PendingRecv(
      at::Tensor tensor,
      distributed::Work work,
      std::function<at::Tensor(const at::Tensor&)> decode = nullptr)
      : tensor_(std::move(tensor)),
        work_(std::move(work)),
        decode_(std::move(decode)) {}
  bool valid() const {
    return tensor_.defined();
  }
  /// Blocks until the data is there (a DistributedError naming the rank
  /// after the group timeout).
  at::Tensor wait() {
    work_.wait();
    if (decode_) {
      tensor_ = decode_(tensor_);
      decode_ = nullptr;
    }
    return tensor_;
  }

 private:
  at::Tensor tensor_;
  distributed::Work work_;
  std::function<at::Tensor(const at::Tensor&)> decode_;
};

class PipelineP2PCommunication {
 public:
  /// Collective over `group`'s members (creates the second direction's
  /// group) unless `one_way`: then messages only ever go to lower ranks.
  PipelineP2PCommunication(
      distributed::ProcessGroupPtr group,
      bool enable_metadata_cache = true,
      bool one_way = false);

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

  /// fp8_communication: floating-point tensors between stages on different
  /// nodes travel as FP8 with one scale per message (quantization/fp8.h),
  /// activations as e4m3 and gradients as e5m2; the receiver gets them
  /// back in the sender's dtype. Set on every stage alike.
  void set_fp8_communication(bool enabled) {
    fp8_ = enabled;
  }

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
  // The group that carries a message to (sending) or from `peer`.
  const distributed::ProcessGroup& channel(int peer, bool sending) const;
  // Whether a message of `dtype` to or from `peer` travels as FP8.
  bool fp8_with(int peer, at::ScalarType dtype) const;

  distributed::ProcessGroupPtr group_;
  distributed::ProcessGroupPtr up_; // messages to higher ranks (null: one way)
  bool cache_;
  bool fp8_ = false;
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
