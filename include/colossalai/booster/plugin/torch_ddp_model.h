#pragma once

#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/distributed/process_group.h>
#include <colossalai/interface/model.h>

#include <memory>
#include <set>
#include <string>

namespace colossalai {
namespace zero {
namespace detail {
class Reducer; // the DDP engine (src/zero/ddp)
} // namespace detail
} // namespace zero

namespace booster {
namespace plugin {

/// The model wrapper TorchDDPPlugin returns: broadcasts rank 0's parameters
/// and buffers at construction, rank 0's buffers before each forward (with
/// broadcast_buffers) and averages gradients over the group during backward.
///
/// NOTE [DDP gradient reduction]
/// Parameters are grouped in buckets in reverse registration order (a 1 MiB
/// first bucket, then bucket_cap_mb), one dtype per bucket. A post-hook on each
/// parameter's gradient accumulator copies the accumulated gradient into its
/// bucket; when a bucket's last gradient arrives its all-reduce starts
/// asynchronously, so communication overlaps the rest of backward. Buckets
/// start strictly in index order on every rank (collectives are matched by
/// order). A callback queued on the autograd engine runs at the end of
/// backward: it waits for the buckets and writes the averages back. The
/// machinery is the shared GradBucketer (NOTE [Gradient bucketing]) that
/// ZeRO and FSDP stand on too; this class adds only what DDP does with it.
class TorchDDPModel : public interface::ModelWrapper {
 public:
  /// `params_to_ignore` (parameter names) are neither broadcast nor
  /// reduced (torch's `_set_params_and_buffers_to_ignore_for_model`: the
  /// experts of expert parallelism, averaged over another group).
  TorchDDPModel(
      std::shared_ptr<interface::ModelWrapper> inner,
      distributed::ProcessGroupPtr group,
      const TorchDDPPluginOptions& options,
      const std::set<std::string>& params_to_ignore = {});
  ~TorchDDPModel() override;

  /// Gradient synchronization on/off (no_sync).
  void set_require_sync(bool require);
  bool require_sync() const;
  /// Averages now the gradients that backwards under no_sync accumulated
  /// (pipelines: once per step, after the last micro-batch).
  void sync_gradients();
  /// Element counts of the buckets, in launch order.
  std::vector<int64_t> bucket_numels() const;
  /// Bytes all-reduced per synchronized backward.
  int64_t bytes_per_sync() const;
  /// Buckets whose all-reduce started while backward was still running, in
  /// the last synchronized backward (the rest started at its end).
  size_t buckets_overlapped() const;
  /// Whether gradients travel as FP8 (fp8_communication, and the group
  /// spans nodes).
  bool fp8_communication() const;

 protected:
  void pre_forward() override;

 private:
  void broadcast_buffers();

  distributed::ProcessGroupPtr group_;
  TorchDDPPluginOptions options_;
  std::shared_ptr<zero::detail::Reducer> reducer_;
  bool fp8_ = false;
};

/// Broadcasts `tensors` from group rank `src`, coalesced per dtype into one
/// message each.
void broadcast_coalesced(
    const std::vector<at::Tensor>& tensors,
    int src,
    const distributed::ProcessGroup& group);

} // namespace plugin
} // namespace booster
} // namespace colossalai
