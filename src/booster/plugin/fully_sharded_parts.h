#pragma once

// FSDP's engine as plugins use it: TorchFSDPPlugin and GeminiPlugin each
// hold their own options and compose these (neither derives from the
// other).

#include <colossalai/booster/plugin/plugin_base.h>
#include <colossalai/checkpoint_io/checkpoint_io_base.h>
#include <colossalai/interface/model.h>
#include <colossalai/interface/optimizer.h>
#include <colossalai/zero/fully_sharded.h>

#include <memory>
#include <string>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

/// Wraps `model` in FSDP's engine under `options`, and `optimizer` (if any)
/// in its sharded optimizer.
void shard_fully(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer,
    const zero::FullyShardedOptions& options,
    const zero::ShardedOptimizerOptions& optimizer_options);

/// Checkpoints of a model the engine sharded: whole tensors in the
/// GeneralCheckpointIO layout, written from rank 0 of `group` a shard file
/// at a time; errors name `plugin`.
std::shared_ptr<checkpoint_io::CheckpointIO> fully_sharded_checkpoint_io(
    distributed::ProcessGroupPtr group,
    const std::string& plugin);

/// no_sync of a model the engine sharded.
NoSyncGuard fully_sharded_no_sync(
    interface::ModelWrapper& model,
    const std::string& plugin);

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
