#pragma once

// Runs a test body on N real processes (GoogleTest, spawn mode).
//
// The parent starts this test binary N times with a filter selecting the
// current test (forked from a zygote that has LibTorch initialised, NOTE
// [Rank zygote] in multiprocess.cpp); each child joins a process group
// through colossalai::launch on a free port and runs the body for its rank.
// The parent collects exit codes and output, kills every rank when one hangs
// past the deadline, and reports each failing rank with the tail of its
// output.

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace colossalai {
namespace testing {

struct RankResult {
  int rank = 0;
  int exit_code = 0; // 128 + signal when killed by one
  bool timed_out = false;
  std::string output; // stdout + stderr
};

struct MultiProcessOptions {
  int timeout_seconds = 180;
  /// Timeout of collectives inside the ranks.
  int collective_timeout_seconds = 60;
  /// Intra-op threads per rank (ranks share the machine's cores).
  int threads_per_rank = 1;
  /// LaunchOptions::shm_collectives of every rank.
  bool shm_collectives = true;
  /// LaunchOptions::backend and ::device of every rank ("auto": the
  /// environment's COLOSSALAI_DEVICE, else the CPU with Gloo).
  std::string backend = "gloo";
  std::string device = "auto";
  /// Ranks whose body succeeded meet in a barrier before exiting, so none
  /// tears down connections a slower peer still uses.
  bool final_barrier = true;
  /// Extra environment of the ranks: `env[r]` for rank r, `env[-1]` for
  /// every rank (e.g. a fault point, NOTE [Fault points]).
  std::map<int, std::map<std::string, std::string>> env;
};

using RankFn = std::function<void(int rank, int world)>;

/// Runs `fn` on `world` processes and returns what each did. In a child, runs
/// the body for its rank and exits.
std::vector<RankResult> run_processes(
    int world,
    const RankFn& fn,
    MultiProcessOptions options = {});

/// Like run_processes, adding a test failure for every rank that failed or
/// hung, with its rank and output.
void run_distributed(
    int world,
    const RankFn& fn,
    MultiProcessOptions options = {});

/// A free TCP port on the loopback interface.
int free_port();

/// The test program's process id, the same in its ranks (which are not its
/// children when they come from the zygote): names the files a test and its
/// ranks share.
int test_process();

} // namespace testing
} // namespace colossalai
