#pragma once

// What the launcher's files share (internal): a rank's process and output
// streams, the signals run() handles, and starting and stopping ranks.

#include <colossalai/launcher.h>

#include <c10/util/intrusive_ptr.h>

#include <netinet/in.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class Store;
}

namespace colossalai {
namespace launcher {
namespace detail {

// SIGCHLD wakes the loop; SIGPIPE is ignored so a closed stdout does not kill
// us and orphan the ranks. A forwarded signal that is ignored on entry (as
// under nohup) stays ignored, here and in the ranks.
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP};
constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE};
constexpr int kNumHandled = sizeof(kHandled) / sizeof(kHandled[0]);

enum class LineState { kStart, kAfterCR, kMiddle };

struct Stream {
  int fd = -1;
  int dest = STDOUT_FILENO;
  LineState state = LineState::kStart;
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  Stream out, err;
  int log_fd = -1;
};

// launcher.cpp
/// A TCP port free on `addr` right now, or 0 when none could be bound.
int free_tcp_port(in_addr addr);

// launcher_args.cpp
void validate(const RunOptions& o);

// launcher_rendezvous.cpp (NOTE [Elastic rendezvous])

/// One round of an elastic job, as this node takes part in it.
struct Round {
  int64_t round = -1;
  int node_rank = 0;
  int nnodes = 0;
  std::string master_addr;
  int master_port = 0;
};

class Rendezvous {
 public:
  using Say = std::function<void(const std::string&)>;
  /// The signal that stops the launcher, once one arrived (else 0).
  using Interrupted = std::function<int()>;
  /// Serves the store when the endpoint is this host's (and no one here
  /// serves it yet), else connects to it.
  Rendezvous(const RunOptions& o, Say say, Interrupted interrupted);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;
  /// Joins the first round after `after` (-1: any) that admits this node
  /// and returns once it closes (round -1: a signal came first). Throws,
  /// saying why, when none admits it within the join timeout.
  Round join(int64_t after);
  /// Why this node's ranks must stop and join again (a newer round began,
  /// or a node waits and the job has room), else "". Throws when the store
  /// is gone.
  std::string should_rejoin(const Round& round);
  /// This node's ranks all exited 0: "" once every member's did too (the
  /// job is done), else why the job must re-form instead (a member died or
  /// left, so the exit was a stop, not the end).
  std::string finish(const Round& round);
  /// Opens the next round so the others re-form without this node.
  void leave(const Round& round);
  const std::string& where() const {
    return where_;
  }

 private:
  std::string key(const std::string& k) const;
  std::string key(int64_t round, const std::string& k) const;
  int64_t current_round();
  void open_after(int64_t round);
  int64_t closed_size(int64_t round);
  int64_t close(int64_t round, int64_t n);
  Round admit(int64_t after);
  std::string finish_round(const Round& round);
  [[noreturn]] void lost(const std::string& what) const;
  std::string node_id(int64_t round, int64_t index);
  bool everyone_expected(int64_t round, int64_t joined);
  // Beats for this node; "" when every other member beat within
  // kDeadAfter, else which did not.
  std::string beat_and_check(const Round& round);

  const RunOptions& options_;
  Say say_;
  Interrupted interrupted_;
  std::string prefix_;
  std::string where_;
  bool serves_ = false;
  c10::intrusive_ptr<::c10d::Store> store_;
  std::pair<std::string, int> self_; // address and free port
  std::string id_; // host:pid of this launcher
  bool refused_ = false; // join's error is a refusal, not a lost store
  int64_t expected_round_ = -1;
  std::set<std::string> expected_;
  // Per member of the round watched: its last beat count, and when it
  // changed (here: clocks of different hosts are never compared).
  int64_t watched_round_ = -1;
  std::vector<std::pair<int64_t, std::chrono::steady_clock::time_point>>
      beats_;
};

// launcher_spawn.cpp
void set_cloexec(int fd);
/// Starts local rank `local_rank` of attempt `restart` (0: the first).
void spawn(const RunOptions& o, int local_rank, int restart, Rank& r);
void signal_group(const Rank& r, int sig);
void close_rank_fds(Rank& r);

} // namespace detail
} // namespace launcher
} // namespace colossalai
