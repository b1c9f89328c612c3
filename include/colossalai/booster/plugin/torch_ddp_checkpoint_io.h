#pragma once

#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/distributed/process_group.h>

namespace colossalai {
namespace booster {
namespace plugin {

/// TorchDDPPlugin's checkpoint IO: replicas are identical, so rank 0 alone
/// writes; every rank can load. A barrier after each save and before each load
/// keeps readers from seeing half-written files.
class TorchDDPCheckpointIO : public checkpoint_io::GeneralCheckpointIO {
 public:
  explicit TorchDDPCheckpointIO(distributed::ProcessGroupPtr group)
      : group_(std::move(group)) {}

 protected:
  bool is_writer() const override;
  void sync_point() override;

 private:
  distributed::ProcessGroupPtr group_;
};

} // namespace plugin
} // namespace booster
} // namespace colossalai
