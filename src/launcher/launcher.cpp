// run(): the local ranks under one supervisor (signals, output, failures),
// and the helpers to start a program under itself.

#include <colossalai/launcher.h>

#include "launcher_internal.h"

#include <colossalai/distributed/error.h>
#include <colossalai/utils/env.h>

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace colossalai {
namespace launcher {

using detail::close_rank_fds;
using detail::kForwarded;
using detail::kHandled;
using detail::kNumHandled;
using detail::LineState;
using detail::Rank;
using detail::set_cloexec;
using detail::signal_group;
using detail::spawn;
using detail::Stream;
using detail::validate;

namespace {

using Clock = std::chrono::steady_clock;

// Once every rank has exited, output still held open by their leftover
// descendants is read for this long at most, so such a daemon cannot hang us.
constexpr auto kDrainTimeout = std::chrono::seconds(1);

// Writes everything, waiting out EINTR and a full non-blocking descriptor.
// Returns false when the descriptor is gone (e.g. EPIPE).
bool write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w > 0) {
      data += w;
      n -= static_cast<size_t>(w);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 1000);
    } else {
      return false;
    }
  }
  return true;
}

// Unbuffered, so our messages keep their place among the ranks' output.
void say(const std::string& msg) {
  std::string line = "colossalai run: " + msg + "\n";
  write_all(STDERR_FILENO, line.data(), line.size());
}

// The signal handler only wakes the poll loop through this pipe; forwarding
// happens there, outside signal context.
std::atomic<int> g_wake_fd{-1};

void on_signal(int sig) {
  int saved = errno;
  int fd = g_wake_fd.load();
  unsigned char b = static_cast<unsigned char>(sig);
  if (fd >= 0) {
    (void)!::write(fd, &b, 1);
  }
  errno = saved;
}

// Installs our handlers and the wake pipe for the duration of run().
class SignalScope {
 public:
  SignalScope() {
    TORCH_CHECK(
        ::pipe(fds_) == 0, "cannot create a pipe: ", std::strerror(errno));
    for (int fd : fds_) {
      set_cloexec(fd);
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    }
    g_wake_fd.store(fds_[1]);
    for (int i = 0; i < kNumHandled; ++i) {
      int sig = kHandled[i];
      ::sigaction(sig, nullptr, &old_[i]);
      bool forwarded = sig != SIGCHLD && sig != SIGPIPE;
      if (forwarded && old_[i].sa_handler == SIG_IGN) {
        continue;
      }
      struct sigaction sa {};
      sa.sa_handler = sig == SIGPIPE ? SIG_IGN : on_signal;
      sa.sa_flags = SA_RESTART | (sig == SIGCHLD ? SA_NOCLDSTOP : 0);
      sigemptyset(&sa.sa_mask);
      ::sigaction(sig, &sa, nullptr);
    }
  }
  ~SignalScope() {
    for (int i = 0; i < kNumHandled; ++i) {
      ::sigaction(kHandled[i], &old_[i], nullptr);
    }
    g_wake_fd.store(-1);
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  int read_fd() const {
    return fds_[0];
  }

 private:
  int fds_[2] = {-1, -1};
  struct sigaction old_[kNumHandled];
};

// Inserts `prefix` before the first character of every line. '\r' ends a line
// too, so progress bars keep their prefix; "\r\n" counts as one line end.
std::string add_prefixes(
    const char* data,
    size_t n,
    const std::string& prefix,
    LineState& state) {
  std::string out;
  out.reserve(n + prefix.size() * 2);
  for (size_t i = 0; i < n; ++i) {
    char c = data[i];
    if (state == LineState::kAfterCR && c == '\n') {
      out += c;
      state = LineState::kStart;
      continue;
    }
    // A '\r' that starts a line would only print a prefix to overwrite.
    if (state != LineState::kMiddle && c != '\r') {
      out += prefix;
    }
    out += c;
    if (c == '\n') {
      state = LineState::kStart;
    } else if (c == '\r') {
      state = LineState::kAfterCR;
    } else {
      state = LineState::kMiddle;
    }
  }
  return out;
}

std::string signal_name(int sig) {
  const char* s = ::strsignal(sig);
  return s != nullptr ? s : "unknown signal";
}

// The wait loop of run(): pumps output, forwards signals, reaps the ranks and
// stops the others after the first failure.
class Supervisor {
 public:
  /// Asked every second while the ranks run: why they must stop to let
  /// the job re-form ("" : they go on). Throws when it cannot tell.
  using Monitor = std::function<std::string()>;

  Supervisor(
      const RunOptions& o,
      std::vector<Rank>& ranks,
      int wake_fd,
      Monitor monitor = nullptr)
      : options_(o),
        ranks_(ranks),
        wake_fd_(wake_fd),
        monitor_(std::move(monitor)) {}

  int wait() {
    std::optional<Clock::time_point> drain_until;
    while (true) {
      reap();
      bool any_running =
          std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
            return r.running;
          });
      auto now = Clock::now();
      if (monitor_ && any_running && !stopping() && now >= next_check_) {
        check_membership();
        now = Clock::now();
        next_check_ = now + kMonitorInterval;
      }
      if (stopping() && !killed_ && any_running && now >= kill_at_) {
        for (const Rank& r : ranks_) {
          if (r.running) {
            signal_group(r, SIGKILL);
          }
        }
        killed_ = true;
      }
      if (!any_running && !drain_until) {
        drain_until = now + kDrainTimeout;
      }

      std::vector<pollfd> fds{{wake_fd_, POLLIN, 0}};
      std::vector<std::pair<Stream*, Rank*>> streams{{nullptr, nullptr}};
      for (Rank& r : ranks_) {
        for (Stream* s : {&r.out, &r.err}) {
          if (s->fd >= 0) {
            fds.push_back({s->fd, POLLIN, 0});
            streams.emplace_back(s, &r);
          }
        }
      }
      if (!any_running && (fds.size() == 1 || now >= *drain_until)) {
        break;
      }

      // The timeout is a backstop; SIGCHLD and EOF normally wake us first.
      auto timeout = std::chrono::milliseconds(200);
      if (stopping() && !killed_ && any_running) {
        timeout = std::min(timeout, until(kill_at_, now));
      }
      if (drain_until) {
        timeout = std::min(timeout, until(*drain_until, now));
      }
      int n = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
      if (n <= 0) {
        continue; // timeout or EINTR
      }
      if (fds[0].revents != 0) {
        handle_signals();
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents != 0) {
          pump(*streams[i].first, *streams[i].second);
        }
      }
    }
    return first_failure_;
  }

  /// Whether the launcher itself was told to stop (a forwarded signal).
  bool signalled() const {
    return signalled_;
  }
  /// Whether the ranks were stopped for the job to re-form (the monitor).
  bool rejoin() const {
    return rejoin_;
  }

 private:
  static std::chrono::milliseconds until(
      Clock::time_point t,
      Clock::time_point now) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t - now);
    return std::max(left, std::chrono::milliseconds(0)) +
        std::chrono::milliseconds(1);
  }

  void handle_signals() {
    unsigned char buf[64];
    ssize_t n;
    while ((n = ::read(wake_fd_, buf, sizeof(buf))) > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        int sig = buf[i];
        if (std::find(std::begin(kForwarded), std::end(kForwarded), sig) ==
            std::end(kForwarded)) {
          continue; // SIGCHLD: the next reap() handles it
        }
        signalled_ = true;
        say("got signal " + std::to_string(sig) + " (" + signal_name(sig) +
            "), forwarding it to the ranks");
        for (const Rank& r : ranks_) {
          if (r.running) {
            signal_group(r, sig);
          }
        }
      }
    }
  }

  void pump(Stream& s, Rank& r) {
    char buf[65536];
    ssize_t n = ::read(s.fd, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
      return;
    }
    if (n <= 0) {
      ::close(s.fd);
      s.fd = -1;
      return;
    }
    size_t len = static_cast<size_t>(n);
    if (r.log_fd >= 0 && !write_all(r.log_fd, buf, len)) {
      ::close(r.log_fd);
      r.log_fd = -1;
    }
    // A consumer that went away (EPIPE) only loses the output; keep draining.
    bool& dest_ok = s.dest == STDOUT_FILENO ? stdout_ok_ : stderr_ok_;
    if (!dest_ok) {
      return;
    }
    if (options_.prefix_output) {
      std::string prefix = "[rank " + std::to_string(r.rank) + "] ";
      std::string text = add_prefixes(buf, len, prefix, s.state);
      dest_ok = write_all(s.dest, text.data(), text.size());
    } else {
      dest_ok = write_all(s.dest, buf, len);
    }
  }

  void reap() {
    for (Rank& r : ranks_) {
      if (!r.running) {
        continue;
      }
      int status = 0;
      pid_t p = ::waitpid(r.pid, &status, WNOHANG);
      if (p == 0 || (p < 0 && errno == EINTR)) {
        continue;
      }
      r.running = false;
      std::string what;
      int code;
      if (p < 0) {
        code = 1; // reaped by someone else; its status is lost
        what = "could not be waited for (" + std::string(std::strerror(errno)) +
            ")";
      } else if (WIFSIGNALED(status)) {
        code = 128 + WTERMSIG(status);
        what = "was killed by signal " + std::to_string(WTERMSIG(status)) +
            " (" + signal_name(WTERMSIG(status)) + ")";
      } else {
        code = WEXITSTATUS(status);
        what = "exited with code " + std::to_string(code);
      }
      if (code != 0 && !stopping()) {
        fail(r, code, what);
      }
    }
  }

  bool stopping() const {
    return failed_ || rejoin_;
  }

  void fail(const Rank& failed, int code, const std::string& what) {
    failed_ = true;
    first_failure_ = code;
    bool others = std::any_of(
        ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
    say("rank " + std::to_string(failed.rank) + " (pid " +
        std::to_string(failed.pid) + ") " + what +
        (others ? "; stopping the other ranks" : ""));
    // The failed rank's group too: its leftover descendants may hold output
    // pipes open.
    signal_group(failed, SIGTERM);
    stop_all();
  }

  void stop_all() {
    for (const Rank& r : ranks_) {
      if (r.running) {
        signal_group(r, SIGTERM);
      }
    }
    kill_at_ = Clock::now() + std::chrono::seconds(options_.kill_grace_seconds);
  }

  // NOTE [Elastic rendezvous]: the ranks stop (SIGTERM, so a program can
  // save on the way out) and the node joins the next round; a lost store is
  // a failure.
  void check_membership() {
    std::string why;
    try {
      why = monitor_();
    } catch (const std::exception& e) {
      failed_ = true;
      first_failure_ = 1;
      say("lost the rendezvous store (" + distributed::error_text(e) +
          "); stopping the ranks");
      stop_all();
      return;
    }
    if (!why.empty()) {
      rejoin_ = true;
      say(why + "; stopping the ranks to re-form the job");
      stop_all();
    }
  }

  static constexpr auto kMonitorInterval = std::chrono::seconds(1);

  const RunOptions& options_;
  std::vector<Rank>& ranks_;
  int wake_fd_;
  Monitor monitor_;
  Clock::time_point next_check_ = Clock::now() + kMonitorInterval;
  bool rejoin_ = false;
  bool failed_ = false;
  bool killed_ = false;
  bool signalled_ = false;
  int first_failure_ = 0;
  Clock::time_point kill_at_;
  bool stdout_ok_ = true;
  bool stderr_ok_ = true;
};

std::atomic<bool> g_in_run{false};

} // namespace

int run(const RunOptions& options) {
  validate(options);
  TORCH_CHECK(!g_in_run.exchange(true), "launcher::run() is already running");
  struct Release {
    ~Release() {
      g_in_run.store(false);
    }
  } release;

  if (!options.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options.log_dir, ec);
    TORCH_CHECK(
        !ec,
        "--log_dir: cannot create '",
        options.log_dir,
        "': ",
        ec.message());
  }
  // Handlers go in before the first fork so no signal slips past a rank.
  SignalScope signals;
  std::unique_ptr<detail::Rendezvous> rendezvous;
  detail::Round round;
  int attempts = 0; // ranks started, restarts and new rounds included
  int stop_signal = 0; // a signal that came while no rank ran
  if (options.min_nodes > 0) {
    rendezvous = std::make_unique<detail::Rendezvous>(
        options, say, [&signals, &stop_signal] {
          unsigned char b;
          while (stop_signal == 0 && ::read(signals.read_fd(), &b, 1) == 1) {
            if (std::find(std::begin(kForwarded), std::end(kForwarded), b) !=
                std::end(kForwarded)) {
              stop_signal = b;
            }
          }
          return stop_signal;
        });
  }
  for (int restart = 0;;) {
    RunOptions placed = options; // where this attempt's ranks go
    if (rendezvous) {
      round = rendezvous->join(round.round);
      if (round.round < 0) {
        say("got signal " + std::to_string(stop_signal) + " (" +
            signal_name(stop_signal) + ") while joining; no ranks to stop");
        return 128 + stop_signal;
      }
      placed.node_rank = round.node_rank;
      placed.nnodes = round.nnodes;
      placed.master_addr = round.master_addr;
      placed.master_port = round.master_port;
      say("rendezvous round " + std::to_string(round.round) + " at " +
          rendezvous->where() + ": " + std::to_string(round.nnodes) +
          " node(s), this is node " + std::to_string(round.node_rank) +
          "; ranks " + std::to_string(round.node_rank * options.nproc_per_node) +
          "-" +
          std::to_string((round.node_rank + 1) * options.nproc_per_node - 1) +
          " of " + std::to_string(round.nnodes * options.nproc_per_node));
    }
    std::vector<Rank> ranks(options.nproc_per_node);
    for (int r = 0; r < options.nproc_per_node; ++r) {
      ranks[r].rank = placed.node_rank * options.nproc_per_node + r;
    }
    try {
      for (int r = 0; r < options.nproc_per_node; ++r) {
        if (!options.log_dir.empty()) {
          auto path = std::filesystem::path(options.log_dir) /
              ("rank_" + std::to_string(ranks[r].rank) + ".log");
          // A restart's output follows the failed attempt's.
          ranks[r].log_fd = ::open(
              path.c_str(),
              O_WRONLY | O_CREAT | O_CLOEXEC | (attempts > 0 ? O_APPEND : O_TRUNC),
              0644);
          TORCH_CHECK(
              ranks[r].log_fd >= 0,
              "--log_dir: cannot open '",
              path.string(),
              "': ",
              std::strerror(errno));
        }
        spawn(placed, r, restart, ranks[r]);
      }
    } catch (...) {
      // Do not leave the ranks that did start running unsupervised.
      for (Rank& r : ranks) {
        if (r.running) {
          signal_group(r, SIGKILL);
          ::waitpid(r.pid, nullptr, 0);
        }
        close_rank_fds(r);
      }
      throw;
    }
    ++attempts;
    Supervisor::Monitor monitor;
    if (rendezvous) {
      monitor = [&] { return rendezvous->should_rejoin(round); };
    }
    Supervisor supervisor(placed, ranks, signals.read_fd(), monitor);
    const int rc = supervisor.wait();
    for (Rank& r : ranks) {
      close_rank_fds(r);
    }
    if (supervisor.rejoin() && !supervisor.signalled()) {
      continue; // the job re-forms; not a failure, no restart used
    }
    if (rendezvous && rc == 0 && !supervisor.signalled()) {
      // Ranks that exit 0 may have been stopped by a member's departure
      // (a program saving on a peer's SIGTERM): the job is done only once
      // every member's ranks are.
      const std::string why = rendezvous->finish(round);
      if (!why.empty()) {
        say(why + "; joining again");
        continue;
      }
    }
    const bool last =
        rc == 0 || supervisor.signalled() || restart >= options.max_restarts;
    if (rendezvous && last && (rc != 0 || supervisor.signalled())) {
      rendezvous->leave(round); // the others re-form without this node
    }
    if (last) {
      if (rc != 0 && options.max_restarts > 0 && !supervisor.signalled()) {
        say("no restarts left (--max_restarts " +
            std::to_string(options.max_restarts) + ")");
      }
      return rc;
    }
    ++restart;
    say("restarting the local ranks (restart " + std::to_string(restart) +
        " of " + std::to_string(options.max_restarts) + ")");
  }
}

bool launched_by_launcher() {
  return utils::env_str("RANK") || utils::env_str("OMPI_COMM_WORLD_RANK") ||
      utils::env_str("SLURM_PROCID");
}

int run_self(int nproc, int argc, char** argv, bool prefix_output) {
  RunOptions o;
  o.nproc_per_node = nproc;
  o.master_port = find_free_port();
  o.prefix_output = prefix_output;
  char exe[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  TORCH_CHECK(
      n > 0, "run_self: cannot read /proc/self/exe: ", std::strerror(errno));
  exe[n] = '\0';
  o.program.assign(argv, argv + argc);
  o.program[0] = exe;
  return run(o);
}

int find_free_port() {
  in_addr loopback{};
  loopback.s_addr = htonl(INADDR_LOOPBACK);
  const int port = detail::free_tcp_port(loopback);
  TORCH_CHECK(port > 0, "find_free_port: no free loopback port");
  return port;
}

namespace detail {

int free_tcp_port(in_addr addr) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return 0;
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr = addr;
  a.sin_port = 0; // the kernel picks a free one
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  return ok ? ntohs(a.sin_port) : 0;
}

} // namespace detail

} // namespace launcher
} // namespace colossalai
