#pragma once

// What the launcher's files share (internal): a rank's process and output
// streams, the signals run() handles, and starting and stopping ranks.

#include <colossalai/launcher.h>

#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

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

// launcher_args.cpp
void validate(const RunOptions& o);

// launcher_spawn.cpp
void set_cloexec(int fd);
/// Starts local rank `local_rank` of attempt `restart` (0: the first).
void spawn(const RunOptions& o, int local_rank, int restart, Rank& r);
void signal_group(const Rank& r, int sig);
void close_rank_fds(Rank& r);

} // namespace detail
} // namespace launcher
} // namespace colossalai
