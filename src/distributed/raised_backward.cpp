#include "raised_backward.h"

#include "backend.h"
#include "collective_ops.h"
#include "runtime.h"

#include <chrono>
#include <thread>

namespace colossalai {
namespace distributed {
namespace detail {

void check_usable(const ProcessGroup& g, const char* op) {
  const auto& t = g.transport_handle();
  if (!t.broken.load(std::memory_order_acquire)) {
    return;
  }
  std::lock_guard<std::mutex> lock(t.broken_mutex);
  throw DistributedError(
      g.describe() + ": " + op +
      " refused, the group cannot go on: " + t.broken_reason);
}

void break_group(const ProcessGroup& group, const std::string& reason) {
  const auto& t = group.transport_handle();
  std::lock_guard<std::mutex> lock(t.broken_mutex);
  if (!t.broken.load()) {
    t.broken_reason = reason;
    t.broken.store(true, std::memory_order_release);
  }
}

namespace {

[[noreturn]] void fail(const ProcessGroup& g, const std::string& why) {
  const std::string reason =
      why + "; restart every rank and load the last checkpoint";
  break_group(g, reason);
  throw DistributedError(g.describe() + ": " + reason);
}

void agree_on(
    const ProcessGroup& g,
    const std::string& pass,
    const std::string& cause) {
  const auto& t = g.transport_handle();
  check_usable(g, ("recovering from a " + pass + " that raised").c_str());
  const uint64_t issued = t.issued.load();
  const std::string key =
      "raised_backward/" + std::to_string(++t.agreements) + "/";
  const std::string mine = key + "issued/" + std::to_string(issued);
  const std::string raised = "a " + pass + " raised here (" + cause + ")";
  const auto deadline = std::chrono::steady_clock::now() + g.timeout();
  int64_t arrived = 0;
  int64_t alike = 0;
  try {
    t.store->add(mine, 1);
    arrived = t.store->add(key + "ranks", 1);
    auto pause = std::chrono::milliseconds(1);
    while (arrived < g.size() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
      arrived = t.store->add(key + "ranks", 0);
    }
    if (arrived == g.size()) {
      alike = t.store->add(mine, 0);
    }
  } catch (const std::exception& e) {
    fail(
        g,
        raised + ", and the rendezvous store did not answer while the " +
            "ranks compared where theirs stopped: " + error_text(e));
  }
  if (arrived == g.size()) {
    // The store's host may exit with its verdict: not before every rank
    // has read its own. Once the count is full, the store may be gone.
    try {
      int64_t read = t.store->add(key + "read", 1);
      while (read < g.size() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        read = t.store->add(key + "read", 0);
      }
    } catch (const std::exception&) {
      // Every rank had read: the host has left.
    }
  }
  if (arrived < g.size()) {
    fail(
        g,
        raised + ", and " + std::to_string(g.size() - arrived) + " of the " +
            "group's " + std::to_string(g.size()) + " ranks did not report " +
            "one within " + std::to_string(g.timeout().count()) +
            " ms: their collectives wait for ones this rank never issued, " +
            "so the group's operations no longer pair up (skipping a " +
            "batch whose " + pass + " raised works only where it raises " +
            "on every rank alike)");
  }
  if (alike < g.size()) {
    fail(
        g,
        raised + ", as on every rank of the group, but after different " +
            "numbers of the group's collectives (" + std::to_string(issued) +
            " here; " + std::to_string(g.size() - alike) + " ranks " +
            "differ): the operations still in flight no longer pair up");
  }
}

} // namespace

uint64_t collectives_issued() {
  return g_issued.load();
}

void agree_after_raise(const std::string& pass, const std::string& cause) {
  std::vector<std::shared_ptr<const ProcessGroup>> groups;
  {
    auto& rt = runtime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    if (!rt.initialized) {
      return;
    }
    for (const auto& weak : rt.groups) {
      auto g = weak.lock();
      if (g != nullptr && g->size() > 1) {
        groups.push_back(std::move(g));
      }
    }
  }
  // In creation order, the same on every member (groups are created in
  // one order everywhere).
  for (const auto& g : groups) {
    agree_on(*g, pass, cause);
  }
}

} // namespace detail
} // namespace distributed
} // namespace colossalai
