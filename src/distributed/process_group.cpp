#include <colossalai/distributed/error.h>
#include <colossalai/distributed/process_group.h>

#include "backend.h"
#include "runtime.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#ifdef COLOSSALAI_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <iostream>
#include <sstream>

namespace colossalai {
namespace distributed {

ProcessGroup::ProcessGroup(
    std::shared_ptr<detail::Transport> transport,
    BackendType type,
    std::vector<int> ranks,
    int global_rank,
    std::string name,
    std::chrono::milliseconds timeout,
    c10::Device device)
    : transport_(std::move(transport)),
      type_(type),
      ranks_(std::move(ranks)),
      name_(std::move(name)),
      timeout_(timeout),
      device_(device) {
  auto it = std::find(ranks_.begin(), ranks_.end(), global_rank);
  TORCH_INTERNAL_ASSERT(it != ranks_.end(), "rank not in its own group");
  rank_ = static_cast<int>(it - ranks_.begin());
}

ProcessGroup::~ProcessGroup() = default;

const TransportInfo& ProcessGroup::transport() const {
  return transport_->info;
}

std::string ProcessGroup::describe() const {
  std::ostringstream os;
  os << "rank " << ranks_[rank_] << " (group '" << name_ << "' rank " << rank_
     << " of " << ranks_.size() << ")";
  return os.str();
}

namespace detail {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

ProcessGroupPtr create_group(
    Runtime& rt,
    const std::vector<int>& global_ranks,
    const std::string& name) {
  TORCH_CHECK(!global_ranks.empty(), "new_group: empty rank list");
  std::vector<int> sorted = global_ranks;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK(
      std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
      "new_group('",
      name,
      "'): duplicate ranks");
  TORCH_CHECK(
      sorted.front() >= 0 && sorted.back() < rt.world_size,
      "new_group('",
      name,
      "'): ranks must lie in [0, ",
      rt.world_size,
      ")");
  auto me = std::find(global_ranks.begin(), global_ranks.end(), rt.rank);
  TORCH_CHECK(
      me != global_ranks.end(),
      "new_group('",
      name,
      "'): rank ",
      rt.rank,
      " is not a member; only members create a group");
  const int group_rank = static_cast<int>(me - global_ranks.begin());
  const int group_size = static_cast<int>(global_ranks.size());

  // The same name may be created again (e.g. two meshes): a use counter keeps
  // the store keys of the two rendezvous apart.
  std::ostringstream key;
  key << "colossalai/" << name << "[";
  for (size_t i = 0; i < global_ranks.size(); ++i) {
    key << (i ? "," : "") << global_ranks[i];
  }
  key << "]";
  const int use = rt.group_name_uses[key.str()]++;
  key << "#" << use << "/";
  auto store = c10::make_intrusive<::c10d::PrefixStore>(key.str(), rt.store);

  compat::BackendPtr backend;
  try {
    if (rt.backend == BackendType::kGloo) {
      auto opts = ::c10d::ProcessGroupGloo::Options::create(rt.timeout);
      opts->devices.push_back(rt.gloo_device);
      backend = c10::make_intrusive<::c10d::ProcessGroupGloo>(
          store, group_rank, group_size, opts);
    } else {
#ifdef COLOSSALAI_WITH_CUDA
      auto opts = ::c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = rt.timeout;
      backend = c10::make_intrusive<::c10d::ProcessGroupNCCL>(
          store, group_rank, group_size, opts);
#else
      TORCH_CHECK(false, "NCCL backend requested but not built");
#endif
    }
  } catch (const std::exception& e) {
    throw DistributedError(
        "rank " + std::to_string(rt.rank) + ": creating process group '" +
        name + "' failed (did every member join within " +
        std::to_string(rt.timeout.count()) + " ms?): " + error_text(e));
  }
  auto transport = std::make_shared<Transport>();
  transport->backend = std::move(backend);
  transport->store = store;
  TransportInfo& info = transport->info;
  if (group_size == 1) {
    info = {"local", "a group of one: every operation is a local copy", 0};
  } else if (rt.backend == BackendType::kNccl) {
    info = {"nccl", "the launch chose NCCL", 0};
  } else if (!rt.shm_collectives) {
    info = {
        "gloo",
        "shared memory is off (LaunchOptions::shm_collectives, "
        "COLOSSALAI_SHM_COLLECTIVES)",
        0};
  } else {
    std::string why;
    try {
      transport->shm = ShmChannel::open(
          *store, group_rank, group_size, rt.timeout, rt.shm_budget, &why);
    } catch (const std::exception& e) {
      throw DistributedError(
          "rank " + std::to_string(rt.rank) + ": setting up shared memory " +
          "for process group '" + name + "' failed: " + error_text(e));
    }
    info = {
        transport->shm ? "shared memory" : "gloo",
        why,
        transport->shm ? transport->shm->bytes() : 0};
  }
  // One line per group, from its first member, so a degraded group shows.
  if (group_rank == 0 && group_size > 1 && rt.log_transports) {
    std::ostringstream line;
    line << "colossalai: group '" << name << "' [";
    for (size_t i = 0; i < global_ranks.size(); ++i) {
      line << (i ? "," : "") << global_ranks[i];
    }
    line << "]: " << info.name << " (" << info.reason << ")\n";
    std::cerr << line.str() << std::flush;
  }
  auto group = std::make_shared<ProcessGroup>(
      std::move(transport),
      rt.backend,
      global_ranks,
      rt.rank,
      name,
      rt.timeout,
      rt.device);
  rt.groups.erase(
      std::remove_if(
          rt.groups.begin(),
          rt.groups.end(),
          [](const std::weak_ptr<const ProcessGroup>& g) {
            return g.expired();
          }),
      rt.groups.end());
  rt.groups.push_back(group);
  return group;
}

} // namespace detail

ProcessGroupPtr world_group() {
  auto& rt = detail::runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  TORCH_CHECK(
      rt.initialized,
      "the distributed runtime is not initialized: call colossalai::launch() "
      "or colossalai::launch_from_env() first");
  return rt.world;
}

ProcessGroupPtr new_group(
    const std::vector<int>& global_ranks,
    const std::string& name) {
  auto& rt = detail::runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  TORCH_CHECK(rt.initialized, "new_group: call colossalai::launch() first");
  return detail::create_group(rt, global_ranks, name);
}

int get_rank() {
  auto& rt = detail::runtime();
  return rt.initialized ? rt.rank : 0;
}

int get_world_size() {
  auto& rt = detail::runtime();
  return rt.initialized ? rt.world_size : 1;
}

bool is_initialized() {
  return detail::runtime().initialized;
}

} // namespace distributed
} // namespace colossalai
