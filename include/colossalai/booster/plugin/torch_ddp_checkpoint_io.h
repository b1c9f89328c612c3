#pragma once

#include <colossalai/checkpoint_io/distributed_checkpoint_io.h>

namespace colossalai {
namespace booster {
namespace plugin {

/// TorchDDPPlugin's checkpoint IO: replicas are identical, so rank 0 alone
/// writes the module's and optimizer's own tensors; every rank can load.
using TorchDDPCheckpointIO = checkpoint_io::DistributedCheckpointIO;

} // namespace plugin
} // namespace booster
} // namespace colossalai
