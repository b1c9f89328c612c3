#pragma once

/// Starting and stopping the distributed runtime (`colossalai.launch`).
///
/// Example:
/// \code
///   // under `colossalai run --nproc_per_node 2 ./train`:
///   colossalai::launch_from_env();
///   // or explicitly:
///   colossalai::launch(colossalai::LaunchOptions().rank(r).world_size(2));
/// \endcode

#include <c10/core/Device.h>
#include <torch/arg.h>

#include <chrono>
#include <string>

namespace colossalai {

struct LaunchOptions {
  /// Global rank of this process and the number of processes.
  TORCH_ARG(int, rank) = -1;
  TORCH_ARG(int, world_size) = -1;
  /// Address and port of the rendezvous server, which rank 0 hosts.
  TORCH_ARG(std::string, host) = "127.0.0.1";
  TORCH_ARG(int, port) = 29500;
  /// "gloo", "nccl" or "auto" (NCCL when CUDA is available, else Gloo).
  TORCH_ARG(std::string, backend) = "auto";
  /// Rank on this node; selects the CUDA device (local_rank modulo the
  /// device count, made the current device). -1: the global rank.
  TORCH_ARG(int, local_rank) = -1;
  /// Where this rank computes: "auto" (CUDA when the backend is NCCL, else
  /// the CPU), "cpu" or "cuda". "cuda" with Gloo runs CUDA tensors over Gloo
  /// through pinned host copies (several ranks may share one GPU). The
  /// environment's COLOSSALAI_DEVICE takes the place of "auto".
  TORCH_ARG(std::string, device) = "auto";
  /// Limit for the rendezvous and for every collective.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// All-reduce, reduce-scatter, all-gather, broadcast, all-to-all and
  /// barrier of a Gloo group whose members all run on this host go through a
  /// segment of shared memory instead of TCP sockets (a group that cannot map
  /// one stays on Gloo; `ProcessGroup::transport()` and one line on stderr
  /// per group say which and why, COLOSSALAI_LOG_TRANSPORTS=0 silences the
  /// lines). False, or COLOSSALAI_SHM_COLLECTIVES=0 in the environment, keeps
  /// every collective on Gloo.
  TORCH_ARG(bool, shm_collectives) = true;
  /// MiB of shared-memory segments each process may map over all its groups;
  /// segments shrink to fit, and a group that no longer fits stays on Gloo.
  /// -1: COLOSSALAI_SHM_BUDGET_MB from the environment, else 1/16 of the
  /// memory this process may use (its cgroup's limit included), at most 256.
  TORCH_ARG(int64_t, shm_budget_mb) = -1;
};

/// Joins the process group of `world_size` processes. Rank 0 serves the
/// rendezvous store at host:port, unless torchrun's agent serves it there
/// (TORCHELASTIC_USE_AGENT_STORE=True with that MASTER_ADDR and MASTER_PORT):
/// then every rank connects to the agent's, as torch.distributed does. The
/// whole rendezvous ends within `timeout`: otherwise it throws
/// `distributed::DistributedError` naming the rank, the master address and
/// the phase it was stuck in (a master port held by something that never
/// answers included). Sets SIGPIPE to be ignored, as Python does, so a peer
/// that dies mid-collective gives every survivor a DistributedError instead
/// of a silent death. Under torchrun (TORCHELASTIC_ERROR_FILE set), an
/// exception that later escapes to std::terminate is written to torchrun's
/// error file (`record_uncaught_exceptions`, colossalai/record.h).
void launch(const LaunchOptions& options);

/// Reads rank, world size, local rank and the master address from the
/// environment the launcher set, and launches:
///  - torchrun / `colossalai run`: RANK, WORLD_SIZE, LOCAL_RANK,
///    MASTER_ADDR, MASTER_PORT (required beyond one process); torchrun's
///    agent store is used where it serves (see `launch`);
///  - OpenMPI's mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK;
///  - Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID.
/// OpenMPI and Slurm give no rendezvous address: MASTER_ADDR and MASTER_PORT
/// from the environment when set; otherwise, with every rank on one host
/// (OMPI_COMM_WORLD_LOCAL_SIZE == _SIZE, or SLURM_NNODES 1), `base`'s host
/// and port (127.0.0.1:29500 by default), and across hosts an error saying
/// to export them. `base` supplies backend, timeout and those defaults. With
/// none of these variables set, runs as one process (world size 1) on a free
/// local port and says so in one line on stderr.
void launch_from_env(LaunchOptions base = LaunchOptions());

/// How many times torchrun has restarted the worker group
/// (TORCHELASTIC_RESTART_COUNT; 0 on the first start and without torchrun).
/// A job run with `torchrun --max-restarts N` resumes from its last
/// checkpoint when this is above 0.
int restart_count();

/// Tears the runtime down (groups, store). Safe to call when not launched.
void destroy();

/// The device this rank computes on (LaunchOptions::device). Before launch,
/// CPU.
c10::Device current_device();

} // namespace colossalai
