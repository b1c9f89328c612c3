#include "raised_backward.h"

#include "backend.h"
#include "collective_ops.h"
#include "runtime.h"

#include <c10/util/ScopeExit.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
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

// This file's store calls come from the caller's thread and from a failed
// operation's lookup: one at a time. Never destroyed: a lookup across a
// dropped link may outlive the process's static objects.
std::mutex& store_mutex() {
  static auto* m = new std::mutex();
  return *m;
}

// The world group of a run of more than one rank, else null. `wait`: an
// operation may fail while its caller holds the runtime (creating a
// group), so its error only tries.
std::shared_ptr<const ProcessGroup> world_of_run(bool wait) {
  auto& rt = runtime();
  std::unique_lock<std::mutex> lock(rt.mutex, std::defer_lock);
  if (wait) {
    lock.lock();
  } else if (!lock.try_lock()) {
    return nullptr;
  }
  if (!rt.initialized || rt.world == nullptr || rt.world->size() < 2) {
    return nullptr;
  }
  return rt.world;
}

// The world's keys of the next agreement: every rank counts the world's
// agreements alike.
std::string board(const ProcessGroup& world) {
  return "raised/" +
      std::to_string(world.transport_handle().agreements.load() + 1) + "/";
}

// Files what raised here for the others' errors, unless another rank
// filed first (a rank whose error came from waiting on it may raise too);
// returns the keys it went under, "" where there is no run or the store
// does not answer (the agreement after it says so).
std::string file_cause(const std::string& text) {
  auto world = world_of_run(true);
  if (world == nullptr) {
    return "";
  }
  const std::string key = board(*world);
  const std::string value = std::to_string(world->rank()) + "\n" + text;
  try {
    std::lock_guard<std::mutex> lock(store_mutex());
    auto& store = *world->transport_handle().store;
    if (store.add(key + "filers", 1) == 1) {
      store.set(
          key + "cause", std::vector<uint8_t>(value.begin(), value.end()));
    }
  } catch (const std::exception&) {
    return "";
  }
  return key;
}

// Waits, at most `limit`, until `others` ranks have read the cause filed
// under `key`: a store hosted here leaves with this process.
void await_readers(
    const std::string& key,
    int64_t others,
    std::chrono::milliseconds limit) {
  auto world = world_of_run(true);
  if (key.empty() || world == nullptr || others <= 0) {
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  auto& store = *world->transport_handle().store;
  try {
    while (std::chrono::steady_clock::now() < deadline) {
      {
        std::lock_guard<std::mutex> lock(store_mutex());
        if (store.add(key + "read", 0) >= others) {
          return;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {
    // The store's host has left: nobody can read any more.
  }
}

std::string raised_where(const std::string& pass) {
  return "global rank " + std::to_string(runtime().rank) + "'s " + pass +
      " raised";
}

// Runs `body` on a thread of its own and waits for it at most `limit`:
// false where it has not finished by then (it goes on alone); its error,
// where it finished with one, is rethrown here. Store calls need it: a store
// whose host hung, or across a dropped link, blocks a call for as long as
// its socket waits (minutes).
bool finished_within(
    std::function<void()> body,
    std::chrono::milliseconds limit) {
  struct State {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  std::thread([state, body = std::move(body)] {
    std::exception_ptr error;
    try {
      body();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    state->error = error;
    state->done = true;
    state->done_cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mutex);
  if (!state->done_cv.wait_for(lock, limit, [&] { return state->done; })) {
    return false;
  }
  if (state->error) {
    std::rethrow_exception(state->error);
  }
  return true;
}

[[noreturn]] void fail(const ProcessGroup& g, const std::string& why) {
  const std::string reason =
      why + "; restart every rank and load the last checkpoint";
  break_group(g, reason);
  throw DistributedError(g.describe() + ": " + reason);
}

void agree_on(
    const ProcessGroup& g,
    const std::string& pass,
    const std::string& cause,
    const std::string& filed) {
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
    // Those that did not come time out in a collective this rank never
    // issued and read the cause.
    await_readers(filed, g.size() - arrived, g.timeout());
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
  if (groups.empty()) {
    return;
  }
  // The first group may wait its timeout for a slow member; a group that
  // fails waits at most its timeout for the others, as long again for them
  // to read the cause, and ends the agreement.
  std::chrono::milliseconds limit{0};
  for (const auto& g : groups) {
    limit = std::max(limit, 3 * g->timeout() + std::chrono::seconds(5));
  }
  const bool answered = finished_within(
      [groups, pass, cause] {
        const std::string filed =
            file_cause(raised_where(pass) + " (" + cause + ")");
        // In creation order, the same on every member (groups are created
        // in one order everywhere).
        for (const auto& g : groups) {
          agree_on(*g, pass, cause, filed);
        }
      },
      limit);
  if (!answered) {
    const std::string reason = "a " + pass + " raised here (" + cause +
        "), and the rendezvous store did not answer within " +
        std::to_string(limit.count()) + " ms while the ranks compared " +
        "where theirs stopped (its host hung, or the link to it dropped); " +
        "restart every rank and load the last checkpoint";
    for (const auto& g : groups) {
      break_group(*g, reason);
    }
    throw DistributedError(
        "rank " + std::to_string(runtime().rank) + ": " + reason);
  }
}

void guard_step(const std::function<void()>& step) {
  // A wrapper's step that calls its base's agrees once.
  static thread_local int depth = 0;
  if (depth > 0) {
    step();
    return;
  }
  std::exception_ptr raised;
  std::string cause;
  try {
    ++depth;
    const auto leave = c10::make_scope_exit([] { --depth; });
    step();
    return;
  } catch (const DistributedError&) {
    throw; // a group that cannot go on: nothing left to agree on
  } catch (const std::exception& e) {
    raised = std::current_exception();
    cause = error_text(e);
  } catch (...) {
    raised = std::current_exception();
    cause = "an exception of unknown type";
  }
  agree_after_raise("step", cause);
  std::rethrow_exception(raised);
}

uint64_t operations_issued() {
  return g_issued.load() + g_exchanged.load();
}

void fail_after_raised_pipeline(const std::string& cause) {
  const std::string after =
      " after the stages had exchanged activations or gradients: their "
      "sends and receives no longer pair up; restart every rank and load "
      "the last checkpoint";
  const std::string reason =
      "a pipeline step raised here (" + cause + ")" + after;
  std::vector<std::shared_ptr<const ProcessGroup>> groups;
  {
    auto& rt = runtime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    for (const auto& weak : rt.groups) {
      if (auto g = weak.lock()) {
        groups.push_back(std::move(g));
      }
    }
  }
  for (const auto& g : groups) {
    break_group(*g, reason);
  }
  // The others fail from operations that began about when this one
  // raised; a group timeout more for a rank still busy with its part. On a
  // thread of its own, as the agreement: the store may not answer.
  if (auto world = world_of_run(true)) {
    const auto wait = 2 * world->timeout();
    finished_within(
        [text = raised_where("pipeline step") + " (" + cause + ")" + after,
         others = world->size() - 1,
         wait] { await_readers(file_cause(text), others, wait); },
        wait + std::chrono::seconds(5));
  }
  throw DistributedError(
      "rank " + std::to_string(runtime().rank) + ": " + reason);
}

std::string raised_elsewhere(const ProcessGroup& group) {
  auto world = world_of_run(false);
  if (world == nullptr) {
    return "";
  }
  // Waited for a few seconds at most: this error must come within the
  // group timeout, not when a dropped link's socket gives up. A store that
  // did not answer once (its host died or hung) is not asked again: the
  // lookups would queue behind the first, each failed operation a wait
  // longer.
  static std::atomic<const void*> unanswered{nullptr};
  const void* asked = world->transport_handle().store.get();
  if (unanswered.load() == asked) {
    return "";
  }
  auto found = std::make_shared<std::string>();
  try {
    const bool answered = finished_within(
        [found,
         store = world->transport_handle().store,
         key = board(*world),
         me = std::to_string(world->rank())] {
          std::lock_guard<std::mutex> lock(store_mutex());
          if (!store->check({key + "cause"})) {
            return;
          }
          const auto value = store->get(key + "cause");
          std::string text(value.begin(), value.end());
          const auto line = text.find('\n');
          if (line == std::string::npos || text.compare(0, line, me) == 0) {
            return; // filed here
          }
          // Once per process and filing: the filer waits for that many.
          static auto* counted = new std::string();
          if (*counted != key) {
            store->add(key + "read", 1);
            *counted = key;
          }
          *found = text.substr(line + 1);
        },
        std::min<std::chrono::milliseconds>(
            group.timeout(), std::chrono::seconds(5)));
    if (!answered) {
      unanswered.store(asked);
      return "";
    }
  } catch (const std::exception&) {
    unanswered.store(asked);
    return ""; // the store's host has left
  }
  if (!found->empty()) {
    break_group(
        group, *found + "; restart every rank and load the last checkpoint");
  }
  return *found;
}

} // namespace detail
} // namespace distributed
} // namespace colossalai
