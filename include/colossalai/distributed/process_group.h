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
struct Transport; // the c10d backend and shared memory
                  // (src/distributed/backend.h)
} // namespace detail

/// Which transport carries a group's operations, chosen once when the group
/// is created, and why. Every member gets the same choice.
///
/// Example:
/// \code
///   auto g = colossalai::distributed::new_group({0, 1}, "tp");
///   std::cout << g->name() << ": " << g->transport().name << " ("
///             << g->transport().reason << ")\n";
///   // tp: shared memory (all 2 members run on this host; 8 MiB segment)
/// \endcode
struct TransportInfo {
  /// "shared memory" (collectives through a segment, sends and receives
  /// through Gloo), "gloo", "nccl", or "local" (a group of one).
  std::string name;
  /// Why this one, e.g. "its members run on more than one host".
  std::string reason;
  /// Size of the shared-memory segment, 0 without one.
  int64_t segment_bytes = 0;
};

/// A set of processes that communicate together, with the c10d backend that
/// carries their collectives (Gloo for CPU tensors, NCCL for CUDA tensors).
///
/// Groups are created through `new_group` (or `cluster::ProcessGroupMesh`);
/// ranks passed to collectives are ranks *inside* the group.
class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  ProcessGroup(
      std::shared_ptr<detail::Transport> transport,
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
  /// Which transport carries this group's operations, and why.
  const TransportInfo& transport() const;
  /// The c10d backend and shared-memory channel (opaque outside the library).
  const detail::Transport& transport_handle() const {
    return *transport_;
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
  std::shared_ptr<detail::Transport> transport_;
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
