#pragma once

// Process-wide state of the distributed runtime (internal).

#include <colossalai/distributed/process_group.h>

#include "../utils/compat_c10d.h"

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace colossalai {
namespace distributed {
namespace detail {

struct Runtime {
  std::mutex mutex;
  bool initialized = false;
  int rank = 0;
  int world_size = 1;
  BackendType backend = BackendType::kGloo;
  bool shm_collectives = false; // LaunchOptions::shm_collectives
  int64_t shm_budget = 0;       // bytes of segments per process
  bool log_transports = true;   // COLOSSALAI_LOG_TRANSPORTS
  std::chrono::milliseconds timeout{0};
  std::string host;
  c10::Device device{c10::kCPU};
  c10::intrusive_ptr<::c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  ProcessGroupPtr world;
  std::map<std::string, int> group_name_uses; // makes store prefixes unique
  // Every group this process created, in creation order (NOTE [A backward
  // that raised on some ranks]).
  std::vector<std::weak_ptr<const ProcessGroup>> groups;
};

Runtime& runtime();

/// Creates the backend for `global_ranks` (this rank must be a member).
ProcessGroupPtr create_group(
    Runtime& rt,
    const std::vector<int>& global_ranks,
    const std::string& name);

} // namespace detail
} // namespace distributed
} // namespace colossalai
