#pragma once

// The c10d side of ProcessGroup and Work (internal).

#include <colossalai/distributed/collectives.h>

#include "../utils/compat_c10d.h"
#include "shm_channel.h"

#include <functional>
#include <memory>
#include <string>

namespace colossalai {
namespace distributed {
namespace detail {

struct BackendHandle {
  compat::BackendPtr backend;
  // Set when every member runs on this host (NOTE [Shared-memory
  // collectives]); null otherwise.
  std::shared_ptr<ShmChannel> shm;
};

inline compat::Backend& backend(const ProcessGroup& group) {
  return *group.backend_handle().backend;
}

} // namespace detail

struct Work::State {
  compat::WorkPtr work;
  std::function<void()> finish;
  std::string op;
  const ProcessGroup* group = nullptr;
  // Keeps the group (and its connections) alive while the work is in flight.
  std::shared_ptr<const ProcessGroup> keep;
};

namespace detail {

/// A Work on `group` that waits for `work` (may be null) and then runs
/// `finish` (may be null) exactly once.
Work make_work(
    compat::WorkPtr work,
    std::function<void()> finish,
    std::string op,
    const ProcessGroup& group);

} // namespace detail
} // namespace distributed
} // namespace colossalai
