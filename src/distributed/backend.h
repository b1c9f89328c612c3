#pragma once

// The c10d side of ProcessGroup and Work (internal).

#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>

#include "../utils/compat_c10d.h"
#include "shm_channel.h"

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

namespace colossalai {
namespace distributed {
namespace detail {

// How a group communicates, fixed when it is created: its c10d backend,
// and, when the collectives go through shared memory, the channel that
// also orders every collective of the group (NOTE [One order per group]).
struct Transport {
  compat::BackendPtr backend;
  std::shared_ptr<ShmChannel> shm;
  TransportInfo info;
  // The group's own keys in the rendezvous store (out of band: usable while
  // the group's collectives are stuck).
  c10::intrusive_ptr<::c10d::Store> store;
  // NOTE [A backward that raised on some ranks]: collectives the caller
  // issued on the group, agreements made on it, and why it may not go on.
  mutable std::atomic<uint64_t> issued{0};
  mutable std::atomic<uint64_t> agreements{0};
  mutable std::atomic<bool> broken{false};
  mutable std::mutex broken_mutex;
  mutable std::string broken_reason;
};

inline compat::Backend& backend(const ProcessGroup& group) {
  return *group.transport_handle().backend;
}

} // namespace detail

struct Work::State {
  compat::WorkPtr work;
  // Runs after `work`: local post-processing when `work` is set; the
  // operation itself (waits on other Works) when it is null.
  std::function<void()> finish;
  // Whether the operation is done when `work` is null; null: ask `work`
  // (or, without one, done unless `finish` is pending).
  std::function<bool()> ready;
  std::string op;
  const ProcessGroup* group = nullptr;
  // Keeps the group (and its connections) alive while the work is in flight.
  std::shared_ptr<const ProcessGroup> keep;
};

namespace detail {

/// A Work on `group` that waits for `work` (may be null) and then runs
/// `finish` (may be null) exactly once. With `work` set, `finish` must be
/// local (is_completed() asks `work`); without, `ready` answers
/// is_completed().
Work make_work(
    compat::WorkPtr work,
    std::function<void()> finish,
    std::string op,
    const ProcessGroup& group,
    std::function<bool()> ready = nullptr);

/// The DistributedError for `op` on `group` failing with `cause`.
DistributedError failure(
    const ProcessGroup& group,
    const std::string& op,
    const std::exception& cause);

/// Posts an operation on the group's c10d backend: `post()`'s failure (Gloo
/// starts sends and receives at once and throws on a closed connection)
/// becomes the DistributedError a wait() would give. "Unsupported" errors
/// pass unchanged: callers take a replacement for them.
template <class F>
compat::WorkPtr post(const ProcessGroup& group, const std::string& op, F&& f) {
  try {
    return f();
  } catch (const DistributedError&) {
    throw;
  } catch (const std::exception& e) {
    if (compat::is_unsupported(e)) {
      throw;
    }
    throw failure(group, op, e);
  }
}

} // namespace detail
} // namespace distributed
} // namespace colossalai
