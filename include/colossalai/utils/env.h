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
};

/// Reads torchrun's variables, else OpenMPI's, else Slurm's. A variable that is
/// set but not an integer raises an error naming it.
DistEnv read_dist_env();

/// GLOO_SOCKET_IFNAME, when set.
std::optional<std::string> gloo_socket_ifname();

/// Integer environment variable, or nullopt; throws naming the variable when
/// it is set but malformed.
std::optional<int> env_int(const char* name);
std::optional<std::string> env_str(const char* name);

} // namespace utils
} // namespace colossalai
