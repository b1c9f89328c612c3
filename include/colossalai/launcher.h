#pragma once

/// The process launcher behind `colossalai run` (torchrun-compatible).
///
/// Example:
/// \code
///   colossalai::launcher::RunOptions opts;
///   opts.nproc_per_node = 2;
///   opts.program = {"./train", "--epochs", "1"};
///   int rc = colossalai::launcher::run(opts);
/// \endcode

#include <string>
#include <vector>

namespace colossalai {
namespace launcher {

struct RunOptions {
  int nproc_per_node = 1;
  /// Nodes of the job; with `min_nodes` > 0, the most it admits.
  int nnodes = 1;
  /// Elastic membership (`--nnodes MIN:MAX`, torchrun's c10d rendezvous;
  /// NOTE [Elastic rendezvous]): the job runs on whichever of its nodes are
  /// present, at least `min_nodes` and at most `nnodes`, and re-forms when a
  /// node fails, leaves or arrives. 0: a fixed job of `nnodes` nodes, each
  /// given its `node_rank`.
  int min_nodes = 0;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// Prefix every line of rank r's output with "[rank r] ".
  bool prefix_output = true;
  /// When set, each rank's stdout+stderr also goes to <log_dir>/rank_<r>.log.
  std::string log_dir;
  /// Seconds to wait for the other ranks after SIGTERM before SIGKILL.
  int kill_grace_seconds = 5;
  /// Times the local ranks are restarted, all together, after one fails
  /// (torchrun's --max-restarts): each restart runs the program again with
  /// TORCHELASTIC_RESTART_COUNT set to its number, so a program that resumes
  /// from its newest checkpoint (Booster::resume_or_start) goes on from it.
  /// A launcher stopped by a signal restarts nothing.
  int max_restarts = 0;
  /// The elastic rendezvous's store, "host:port" (empty: master_addr and
  /// master_port). The node whose address it is serves it and must live as
  /// long as the job; the others connect to it.
  std::string rdzv_endpoint;
  /// Names the job in that store, so jobs can share it.
  std::string rdzv_id = "none";
  /// Seconds a round stays open for more nodes once `min_nodes` have joined
  /// (torchrun's last_call_timeout).
  double rdzv_last_call_timeout = 30;
  /// Seconds a node waits to be admitted before it gives up, saying why
  /// (torchrun's join_timeout).
  double rdzv_join_timeout = 600;
  /// Program and its arguments.
  std::vector<std::string> program;
  /// Set by parse_run_args for -h/--help; the program is then optional.
  bool help = false;
};

/// Usage text of `colossalai run`.
std::string run_usage();

/// Parses `colossalai run` arguments (everything after "run"): options, then
/// the program and its arguments (options after the program, or after "--",
/// belong to the program). Accepts "--opt value" and "--opt=value". Throws
/// c10::Error naming the offending option on bad input.
RunOptions parse_run_args(const std::vector<std::string>& args);

/// Spawns the local ranks with RANK, WORLD_SIZE, LOCAL_RANK,
/// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
/// TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS set, forwards
/// SIGINT/SIGTERM/SIGHUP to them, and waits. When any rank fails, the others
/// are stopped (SIGTERM, then SIGKILL after the grace period), and all are
/// started again while `max_restarts` allows. Returns 0 when all ranks
/// succeed, else the last failure's exit code (128 + signal for a rank
/// killed by a signal). Ranks never outlive the launcher: however it dies,
/// the kernel sends them SIGTERM (PR_SET_PDEATHSIG), and a rank that called
/// colossalai::launch says that the launcher is gone. Rank r's stdout and stderr go to ours (prefixed
/// when asked); stdin is /dev/null, since ranks run in their own process
/// groups. With `min_nodes` > 0 the nodes first agree on the job's members
/// (NOTE [Elastic rendezvous]), and join again after every failure, and
/// whenever a node waits to join a job below `nnodes`: ranks stopped for a
/// new member (SIGTERM, as a pre-emption) are not a failure and use no
/// restart. POSIX only; one run() at a time per process.
int run(const RunOptions& options);

/// Re-runs this very program (same arguments) as `nproc` local ranks on a
/// free port, the way `colossalai run --nproc_per_node nproc` would, and
/// returns run()'s exit code. Lets a program launch itself when started
/// directly; check `launched_by_launcher()` first to avoid recursion.
int run_self(int nproc, int argc, char** argv, bool prefix_output = false);

/// A TCP port on the loopback interface that is free right now (for a
/// single-node run that must not collide with another job's port).
int find_free_port();

/// True when this process was started by a launcher (RANK or a cluster
/// launcher's variables are set).
bool launched_by_launcher();

} // namespace launcher
} // namespace colossalai
