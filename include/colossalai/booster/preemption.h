#pragma once

/// Saving on the way out: while a `PreemptionGuard` lives, SIGTERM (a
/// scheduler pre-empting the job, `colossalai run` forwarding one, or the
/// launcher's death) does not kill the rank; `requested()`, called by every
/// rank at the same point of each step, tells all of them at once, so they
/// finish the step, save a checkpoint together and exit. A rank that has not
/// exited `grace_seconds` after its SIGTERM is killed (SIGALRM's default),
/// so a loop that never asks cannot hang the job.
///
/// Example:
/// \code
///   colossalai::booster::PreemptionGuard guard;
///   for (int64_t step = state.step(); step < steps; ++step) {
///     // ... the step ...
///     if (guard.requested()) {  // once per step: every rank the same
///       booster.save_checkpoint("ckpt", TrainingState().step(step + 1), ...);
///       return 0;
///     }
///   }
/// \endcode

namespace colossalai {
namespace booster {

class PreemptionGuard {
 public:
  explicit PreemptionGuard(int grace_seconds = 120);
  /// Puts back the SIGTERM handling that was there before.
  ~PreemptionGuard();
  PreemptionGuard(const PreemptionGuard&) = delete;
  PreemptionGuard& operator=(const PreemptionGuard&) = delete;

  /// Whether any rank got SIGTERM. Under a process group it is a collective
  /// (a one-element all-reduce): every rank calls it at the same point and
  /// gets the same answer; without one, this process's flag.
  bool requested();
  /// Whether this process got SIGTERM (no communication).
  static bool signalled();

 private:
  int grace_seconds_;
};

} // namespace booster
} // namespace colossalai
