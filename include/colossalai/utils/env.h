#pragma once

#include <optional>
#include <string>

namespace colossalai {
namespace utils {

/// Every environment variable the library reads is read here, once per call.
struct DistEnv {
  std::string source; // "torchrun", "openmpi", "slurm" or "" when none found
  std::optional<int> rank;
  std::optional<int> world_size;
  std::optional<int> local_rank;
  std::optional<int> local_world_size;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  /// Slurm's SLURM_STEP_NUM_NODES (else SLURM_NNODES): hosts of the job step.
  std::optional<int> num_nodes;
  /// torchrun's TORCHELASTIC_RESTART_COUNT: restarts of the worker group so
  /// far (0 when unset).
  int restart_count = 0;
};

/// Reads torchrun's variables, else OpenMPI's, else Slurm's. A variable that is
/// set but not an integer raises an error naming it.
DistEnv read_dist_env();

/// Whether torchrun's elastic agent serves the rendezvous store at
/// `host`:`port`: TORCHELASTIC_USE_AGENT_STORE is "True" and they are the
/// MASTER_ADDR and MASTER_PORT the agent exported, as written
/// (torch.distributed.rendezvous's `_agent_store_serves`).
bool agent_store_serves(const std::string& host, int port);

/// TORCHELASTIC_ERROR_FILE: where torchrun wants this worker's error.
std::optional<std::string> torchelastic_error_file();

/// GLOO_SOCKET_IFNAME, when set.
std::optional<std::string> gloo_socket_ifname();

/// Integer environment variable, or nullopt; throws naming the variable when
/// it is set but malformed.
std::optional<int> env_int(const char* name);
std::optional<std::string> env_str(const char* name);

} // namespace utils
} // namespace colossalai
