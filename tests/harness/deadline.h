#pragma once

// Runs code that may crash or hang (hostile input) in a forked child with a
// deadline, so a test reports it instead of dying or waiting forever.
// Header-only. The child runs only what `fn` does: keep it to code that
// does not start threads (a tokenizer, small LibTorch tensors).

#include <harness/test_util.h>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>

namespace colossalai {
namespace testing {

struct ChildOutcome {
  bool threw = false; // and `error` is its message
  std::string error;
  int signal = 0; // the signal that ended the child (a crash), 0 if none
  bool timed_out = false; // killed at the deadline
  double seconds = 0; // how long it ran
  /// "threw: ..." / "returned" / "crashed (signal N)" / "hung", for
  /// messages.
  std::string describe() const {
    if (timed_out) {
      return "hung (killed after " + std::to_string(seconds) + " s)";
    }
    if (signal != 0) {
      return "crashed (signal " + std::to_string(signal) + ")";
    }
    return threw ? "threw: " + error : "returned";
  }
};

/// Runs `fn` in a forked child for at most `seconds`: what it threw (the
/// message), whether it crashed or hung, and its time.
inline ChildOutcome run_with_deadline(
    double seconds,
    const std::function<void()>& fn) {
  int fds[2];
  if (::pipe(fds) != 0) {
    std::abort();
  }
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    bool threw = false;
    std::string e;
    try {
      fn();
    } catch (const std::exception& ex) {
      threw = true;
      e = error_of([&] { throw; });
      if (e.empty()) {
        e = ex.what();
      }
    }
    const std::string msg = (threw ? "T" : "R") + e;
    for (size_t at = 0; at < msg.size();) {
      const ssize_t w = ::write(fds[1], msg.data() + at, msg.size() - at);
      if (w <= 0) {
        break;
      }
      at += static_cast<size_t>(w);
    }
    std::_Exit(0);
  }
  ::close(fds[1]);
  ChildOutcome out;
  std::string msg;
  const auto deadline =
      start + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) {
      out.timed_out = true;
      ::kill(pid, SIGKILL);
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) {
      continue;
    }
    char buf[4096];
    const ssize_t r = ::read(fds[0], buf, sizeof buf);
    if (r <= 0) {
      break; // the child exited (or crashed)
    }
    msg.append(buf, static_cast<size_t>(r));
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  out.seconds = std::chrono::duration<double>(
                    std::chrono::steady_clock::now() - start)
                    .count();
  if (!out.timed_out && WIFSIGNALED(status)) {
    out.signal = WTERMSIG(status);
  }
  if (!msg.empty()) {
    out.threw = msg[0] == 'T';
    out.error = msg.substr(1);
  }
  return out;
}

} // namespace testing
} // namespace colossalai
