#pragma once

/// Training checkpoints (NOTE [Training checkpoints]): the model (or its LoRA
/// adapters), the optimizer, the LR scheduler and where training stands,
/// saved by `Booster::save_checkpoint` as one set that commits atomically,
/// kept `keep_last` deep, and taken back by `Booster::resume_or_start` from
/// the newest complete, verified set, at any world size and under any
/// plugin. The same program serves the first start and every restart.
///
/// Example:
/// \code
///   namespace cb = colossalai::booster;
///   auto state = booster.resume_or_start(
///       "ckpt", boosted.model, boosted.optimizer.get(), &scheduler);
///   for (int64_t step = state.step; step < steps; ++step) {
///     // ... the step ...
///     if ((step + 1) % 100 == 0) {
///       booster.save_checkpoint("ckpt", cb::TrainingState().step(step + 1),
///                               boosted.model, boosted.optimizer.get(),
///                               &scheduler);
///     }
///   }
/// \endcode

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace colossalai {
namespace booster {

// NOTE [Training checkpoints]
// DIR holds "checkpoint-<step>" directories (Hugging Face Trainer's names),
// each one complete set:
//   model/ (sharded; adapter/ instead for a LoRA model), optimizer/
//   (sharded), scheduler.pt (when a scheduler is given), trainer_state.json,
//   manifest.json (every other file's path, size and CRC-32).
// A save writes the set into the hidden ".checkpoint-<step>.partial"; when
// every rank's part is written, rank 0 writes trainer_state.json and the
// manifest, fsyncs, and renames the directory to its final name: the one
// commit point. A rank killed before it leaves only a hidden directory,
// which resumes never read and the next save removes. Older sets beyond
// `keep_last` are then renamed hidden and removed, so a set is never seen
// half-deleted. A resume checks the newest set against its manifest (every
// byte), falls back to the one before when it does not match, and says
// which it skipped and why; it fails on every rank together, never on some.

/// Where training stands, saved with a checkpoint (trainer_state.json).
struct TrainingState {
  /// Optimizer steps completed.
  TORCH_ARG(int64_t, step) = 0;
  /// The data loader's epoch, and the samples of that epoch already trained
  /// on, counted over all ranks (`DistributedDataLoader::samples_seen`), so
  /// a resume at another world size starts from the same place.
  TORCH_ARG(int64_t, epoch) = 0;
  TORCH_ARG(int64_t, samples_in_epoch) = 0;
};

struct TrainingCheckpointOptions {
  /// Complete checkpoints kept; older ones go once a save commits.
  TORCH_ARG(int64_t, keep_last) = 2;
  /// Model and optimizer shard files: safetensors (else .bin) and size (MB).
  TORCH_ARG(bool, use_safetensors) = true;
  TORCH_ARG(int64_t, size_per_shard) = 1024;
};

/// One checkpoint directory of DIR, as resume sees it.
struct TrainingCheckpointInfo {
  std::string path;
  int64_t step = 0;
  /// Empty when the set matches its manifest; else what does not.
  std::string problem;
};

/// DIR's checkpoints, newest first, with `verify` each checked against its
/// manifest (reads every byte). Hidden (partial, retiring) directories are
/// not listed.
std::vector<TrainingCheckpointInfo> list_training_checkpoints(
    const std::string& dir,
    bool verify = true);

} // namespace booster
} // namespace colossalai
