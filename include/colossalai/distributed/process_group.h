#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace distributed {

enum class BackendType { kGloo, kNccl };

namespace detail {
struct BackendHandle; // the c10d backend (src/distributed/backend.h)
} // namespace detail

/// A set of processes that communicate together, with the c10d backend that
/// carries their collectives (Gloo for CPU tensors, NCCL for CUDA tensors).
///
/// Groups are created through `new_group` (or `cluster::ProcessGroupMesh`);
/// ranks passed to collectives are ranks *inside* the group.
class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  ProcessGroup(
      std::shared_ptr<detail::BackendHandle> backend,
      BackendType type,
      std::vector<int> ranks,
      int global_rank,
      std::string name,
      std::chrono::milliseconds timeout,
      c10::Device device = c10::Device(c10::kCPU));
  ~ProcessGroup();

  /// This process's rank inside the group.
  int rank() const {
    return rank_;
  }
  int size() const {
    return static_cast<int>(ranks_.size());
  }
  /// Global ranks of the members, in group-rank order.
  const std::vector<int>& ranks() const {
    return ranks_;
  }
  int global_rank(int group_rank) const {
    return ranks_.at(group_rank);
  }
  const std::string& name() const {
    return name_;
  }
  BackendType backend_type() const {
    return type_;
  }
  std::chrono::milliseconds timeout() const {
    return timeout_;
  }
  /// Where this group's tensors live: control tensors (flags, norms,
  /// counts) are made here, since NCCL takes no host tensors.
  c10::Device device() const {
    return device_;
  }
  /// The c10d backend (opaque outside the library).
  const detail::BackendHandle& backend_handle() const {
    return *backend_;
  }
  /// "rank 3 (group 'dp' rank 1 of 2)": used in every error message.
  std::string describe() const;
  /// Bytes this process handed to collectives on this group (payload, per
  /// operation counted once); benchmarks split traffic by mesh axis with it.
  int64_t bytes_communicated() const {
    return bytes_.load(std::memory_order_relaxed);
  }
  void add_bytes_communicated(int64_t n) const {
    bytes_.fetch_add(n, std::memory_order_relaxed);
  }

 private:
  std::shared_ptr<detail::BackendHandle> backend_;
  BackendType type_;
  std::vector<int> ranks_;
  int rank_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  c10::Device device_;
  mutable std::atomic<int64_t> bytes_{0};
};

using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

/// The group of all processes; requires `colossalai::launch`.
ProcessGroupPtr world_group();

/// Creates a group over `global_ranks` (sorted or not: the order given is the
/// group-rank order). Only members call it; every member must call it with the
/// same ranks and name, in the same order relative to other `new_group` calls.
ProcessGroupPtr new_group(
    const std::vector<int>& global_ranks,
    const std::string& name = "group");

/// Global rank and world size; require `colossalai::launch`.
int get_rank();
int get_world_size();
bool is_initialized();

} // namespace distributed
} // namespace colossalai
