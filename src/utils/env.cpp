#include <colossalai/utils/env.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>

namespace colossalai {
namespace utils {

std::optional<std::string> env_str(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    return std::nullopt;
  }
  return std::string(v);
}

std::optional<int> env_int(const char* name) {
  auto s = env_str(name);
  if (!s) {
    return std::nullopt;
  }
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(s->c_str(), &end, 10);
  TORCH_CHECK(
      errno == 0 && end != s->c_str() && *end == '\0' && v >= INT32_MIN &&
          v <= INT32_MAX,
      "environment variable ",
      name,
      "='",
      *s,
      "' is not an integer");
  return static_cast<int>(v);
}

std::optional<std::string> gloo_socket_ifname() {
  return env_str("GLOO_SOCKET_IFNAME");
}

DistEnv read_dist_env() {
  DistEnv env;
  if (env_str("RANK") || env_str("WORLD_SIZE")) {
    env.source = "torchrun";
    env.rank = env_int("RANK");
    env.world_size = env_int("WORLD_SIZE");
    env.local_rank = env_int("LOCAL_RANK");
    env.local_world_size = env_int("LOCAL_WORLD_SIZE");
  } else if (env_str("OMPI_COMM_WORLD_RANK")) {
    env.source = "openmpi";
    env.rank = env_int("OMPI_COMM_WORLD_RANK");
    env.world_size = env_int("OMPI_COMM_WORLD_SIZE");
    env.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK");
    env.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE");
  } else if (env_str("SLURM_PROCID")) {
    env.source = "slurm";
    env.rank = env_int("SLURM_PROCID");
    env.world_size = env_int("SLURM_NTASKS");
    env.local_rank = env_int("SLURM_LOCALID");
    env.local_world_size = env_int("SLURM_NTASKS_PER_NODE");
    env.num_nodes = env_int("SLURM_STEP_NUM_NODES");
    if (!env.num_nodes) {
      env.num_nodes = env_int("SLURM_NNODES");
    }
  }
  env.master_addr = env_str("MASTER_ADDR");
  env.master_port = env_int("MASTER_PORT");
  env.restart_count = env_int("TORCHELASTIC_RESTART_COUNT").value_or(0);
  return env;
}

bool agent_store_serves(const std::string& host, int port) {
  // Python compares the strings: "True" exactly, and the port as exported.
  return env_str("TORCHELASTIC_USE_AGENT_STORE") == std::string("True") &&
      env_str("MASTER_ADDR") == host &&
      env_str("MASTER_PORT") == std::to_string(port);
}

std::optional<std::string> torchelastic_error_file() {
  return env_str("TORCHELASTIC_ERROR_FILE");
}

} // namespace utils
} // namespace colossalai
