#include <colossalai/launcher.h>

#include <CLI/CLI.hpp>
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
#include <optional>
#include <string>
#include <vector>

extern char** environ;

namespace colossalai {
namespace launcher {
namespace {

using Clock = std::chrono::steady_clock;

// Once every rank has exited, output still held open by their leftover
// descendants is read for this long at most, so such a daemon cannot hang us.
constexpr auto kDrainTimeout = std::chrono::seconds(1);

void validate(const RunOptions& o) {
  TORCH_CHECK(
      o.nproc_per_node >= 1,
      "--nproc_per_node must be >= 1, got ",
      o.nproc_per_node);
  TORCH_CHECK(o.nnodes >= 1, "--nnodes must be >= 1, got ", o.nnodes);
  TORCH_CHECK(
      o.node_rank >= 0 && o.node_rank < o.nnodes,
      "--node_rank must be in [0, --nnodes=",
      o.nnodes,
      "), got ",
      o.node_rank);
  TORCH_CHECK(
      o.master_port >= 1 && o.master_port <= 65535,
      "--master_port must be in [1, 65535], got ",
      o.master_port);
  TORCH_CHECK(!o.master_addr.empty(), "--master_addr must not be empty");
  TORCH_CHECK(
      o.kill_grace_seconds >= 0,
      "--kill_grace_seconds must be >= 0, got ",
      o.kill_grace_seconds);
  TORCH_CHECK(
      static_cast<long long>(o.nnodes) * o.nproc_per_node <= INT_MAX,
      "--nnodes * --nproc_per_node is too large");
  TORCH_CHECK(
      !o.program.empty() && !o.program[0].empty(),
      "no program given (usage: colossalai run [options] PROGRAM [ARGS...])");
}

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

void set_cloexec(int fd) {
  ::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) | FD_CLOEXEC);
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

// SIGCHLD wakes the loop; SIGPIPE is ignored so a closed stdout does not kill
// us and orphan the ranks. A forwarded signal that is ignored on entry (as
// under nohup) stays ignored, here and in the ranks.
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP};
constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE};
constexpr int kNumHandled = sizeof(kHandled) / sizeof(kHandled[0]);

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

std::vector<std::string> child_env(const RunOptions& o, int local_rank) {
  std::vector<std::pair<std::string, std::string>> vars = {
      {"RANK", std::to_string(o.node_rank * o.nproc_per_node + local_rank)},
      {"WORLD_SIZE", std::to_string(o.nnodes * o.nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"GROUP_RANK", std::to_string(o.node_rank)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(o.master_port)},
  };
  // Like torchrun: N ranks each using every core would oversubscribe.
  if (!utils::env_str("OMP_NUM_THREADS")) {
    vars.emplace_back("OMP_NUM_THREADS", "1");
  }
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    std::string name = entry.substr(0, entry.find('='));
    bool replaced = std::any_of(vars.begin(), vars.end(), [&](const auto& v) {
      return v.first == name;
    });
    if (!replaced) {
      env.push_back(std::move(entry));
    }
  }
  for (const auto& v : vars) {
    env.push_back(v.first + "=" + v.second);
  }
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) {
    out.push_back(&s[0]);
  }
  out.push_back(nullptr);
  return out;
}

// Forks one rank into its own process group with stdout/stderr on fresh
// pipes. Everything the child needs is prepared before fork(): after it, only
// async-signal-safe calls are allowed in a multithreaded process.
void spawn(const RunOptions& o, int local_rank, Rank& r) {
  std::vector<std::string> env = child_env(o, local_rank);
  std::vector<std::string> args = o.program;
  std::vector<char*> envp = c_strings(env);
  std::vector<char*> argv = c_strings(args);
  std::string exec_error = "colossalai run: cannot execute " + o.program[0];

  int out[2], err[2];
  TORCH_CHECK(::pipe(out) == 0, "cannot create a pipe: ", std::strerror(errno));
  if (::pipe(err) != 0) {
    int e = errno;
    ::close(out[0]);
    ::close(out[1]);
    TORCH_CHECK(false, "cannot create a pipe: ", std::strerror(e));
  }
  for (int fd : {out[0], out[1], err[0], err[1]}) {
    set_cloexec(fd);
  }
  int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);

  // Blocked across fork() so the child cannot run our handler (which would
  // write into our wake pipe) before it restores the defaults.
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, &old);
  pid_t pid = ::fork();
  if (pid == 0) {
    for (int sig : kHandled) {
      struct sigaction cur;
      ::sigaction(sig, nullptr, &cur);
      if (sig == SIGPIPE || cur.sa_handler != SIG_IGN) {
        ::signal(sig, SIG_DFL);
      }
    }
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    ::setpgid(0, 0);
    if (null_fd >= 0) {
      ::dup2(null_fd, STDIN_FILENO);
    }
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    environ = envp.data();
    ::execvp(argv[0], argv.data());
    const char* why = std::strerror(errno);
    (void)!::write(STDERR_FILENO, exec_error.data(), exec_error.size());
    (void)!::write(STDERR_FILENO, ": ", 2);
    (void)!::write(STDERR_FILENO, why, std::strlen(why));
    (void)!::write(STDERR_FILENO, "\n", 1);
    ::_exit(127);
  }
  int fork_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ::close(out[1]);
  ::close(err[1]);
  if (null_fd >= 0) {
    ::close(null_fd);
  }
  if (pid < 0) {
    ::close(out[0]);
    ::close(err[0]);
    TORCH_CHECK(false, "fork failed: ", std::strerror(fork_errno));
  }
  // Also set here, so a signal sent right away reaches the group.
  ::setpgid(pid, pid);
  r.pid = pid;
  r.running = true;
  r.out.fd = out[0];
  r.out.dest = STDOUT_FILENO;
  r.err.fd = err[0];
  r.err.dest = STDERR_FILENO;
}

void signal_group(const Rank& r, int sig) {
  if (r.pid > 0) {
    ::kill(-r.pid, sig);
  }
}

void close_rank_fds(Rank& r) {
  for (int* fd : {&r.out.fd, &r.err.fd, &r.log_fd}) {
    if (*fd >= 0) {
      ::close(*fd);
      *fd = -1;
    }
  }
}

std::string signal_name(int sig) {
  const char* s = ::strsignal(sig);
  return s != nullptr ? s : "unknown signal";
}

// The wait loop of run(): pumps output, forwards signals, reaps the ranks and
// stops the others after the first failure.
class Supervisor {
 public:
  Supervisor(const RunOptions& o, std::vector<Rank>& ranks, int wake_fd)
      : options_(o), ranks_(ranks), wake_fd_(wake_fd) {}

  int wait() {
    std::optional<Clock::time_point> drain_until;
    while (true) {
      reap();
      bool any_running =
          std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
            return r.running;
          });
      auto now = Clock::now();
      if (failed_ && !killed_ && any_running && now >= kill_at_) {
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
      if (failed_ && !killed_ && any_running) {
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
      if (code != 0 && !failed_) {
        fail(r, code, what);
      }
    }
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
    for (const Rank& r : ranks_) {
      if (r.running) {
        signal_group(r, SIGTERM);
      }
    }
    kill_at_ = Clock::now() + std::chrono::seconds(options_.kill_grace_seconds);
  }

  const RunOptions& options_;
  std::vector<Rank>& ranks_;
  int wake_fd_;
  bool failed_ = false;
  bool killed_ = false;
  int first_failure_ = 0;
  Clock::time_point kill_at_;
  bool stdout_ok_ = true;
  bool stderr_ok_ = true;
};

std::atomic<bool> g_in_run{false};

} // namespace

namespace {

// The options of `colossalai run`, bound to `o`. torchrun's grammar:
// launcher options, then PROGRAM and its own arguments, untouched
// (prefix_command stops at the first argument that is not ours).
std::unique_ptr<CLI::App> run_app(RunOptions& o) {
  auto app = std::make_unique<CLI::App>(
      "Starts N local ranks of PROGRAM with torchrun's environment (RANK,\n"
      "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
      "MASTER_PORT). When a rank fails, the others are stopped and its exit\n"
      "code is returned (128 + signal when it was killed by a signal).",
      "colossalai run");
  app->footer(
      "PROGRAM and its ARGS follow the options (after '--' when PROGRAM\n"
      "starts with '-'); options also take the form --opt=value.");
  app->set_help_flag("-h,--help", "show this help");
  // "--nproc-per-node" is accepted for "--nproc_per_node", as in torchrun.
  app->add_option(
         "--nproc_per_node,--nproc-per-node",
         o.nproc_per_node,
         "ranks on this node")
      ->required();
  app->add_option("--nnodes", o.nnodes, "number of nodes")
      ->capture_default_str();
  app->add_option(
         "--node_rank,--node-rank", o.node_rank, "this node's index in [0, M)")
      ->capture_default_str();
  app->add_option("--master_addr,--master-addr", o.master_addr, "rank 0's host")
      ->capture_default_str();
  app->add_option("--master_port,--master-port", o.master_port, "rank 0's port")
      ->capture_default_str();
  app->add_option(
      "--log_dir,--log-dir",
      o.log_dir,
      "also write rank r's output to DIR/rank_<r>.log");
  app->add_flag_function(
         "--no_prefix,--no-prefix",
         [&o](int64_t) { o.prefix_output = false; },
         "do not prefix output lines with \"[rank r] \"")
      ->disable_flag_override();
  app->add_option(
         "--kill_grace_seconds,--kill-grace-seconds",
         o.kill_grace_seconds,
         "after a failure, seconds between SIGTERM and SIGKILL")
      ->capture_default_str();
  app->prefix_command();
  return app;
}

} // namespace

std::string run_usage() {
  RunOptions o;
  return run_app(o)->help();
}

RunOptions parse_run_args(const std::vector<std::string>& args) {
  RunOptions o;
  for (const auto& a : args) {
    if (a == "--") {
      break;
    }
    // CLI11 would take the next argument as the value of "--opt=".
    TORCH_CHECK(
        !(a.size() > 3 && a.compare(0, 2, "--") == 0 && a.back() == '='),
        a.substr(0, a.size() - 1),
        " needs a value (got '",
        a,
        "')");
  }
  auto app = run_app(o);
  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());
    app->parse(reversed);
  } catch (const CLI::CallForHelp&) {
    o.help = true;
    return o;
  } catch (const CLI::ParseError& e) {
    TORCH_CHECK(false, e.what());
  }
  auto rest = app->remaining();
  if (!rest.empty() && rest.front() == "--") {
    rest.erase(rest.begin()); // what follows is the program, dashes or not
  } else if (
      !rest.empty() && rest.front().size() > 1 && rest.front()[0] == '-') {
    TORCH_CHECK(
        false,
        "unknown option '",
        rest.front().substr(0, rest.front().find('=')),
        "'");
  }
  o.program = std::move(rest);
  validate(o);
  return o;
}

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
  std::vector<Rank> ranks(options.nproc_per_node);
  for (int r = 0; r < options.nproc_per_node; ++r) {
    ranks[r].rank = options.node_rank * options.nproc_per_node + r;
  }

  // Handlers go in before the first fork so no signal slips past a rank.
  SignalScope signals;
  try {
    for (int r = 0; r < options.nproc_per_node; ++r) {
      if (!options.log_dir.empty()) {
        auto path = std::filesystem::path(options.log_dir) /
            ("rank_" + std::to_string(ranks[r].rank) + ".log");
        ranks[r].log_fd = ::open(
            path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        TORCH_CHECK(
            ranks[r].log_fd >= 0,
            "--log_dir: cannot open '",
            path.string(),
            "': ",
            std::strerror(errno));
      }
      spawn(options, r, ranks[r]);
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

  int rc = Supervisor(options, ranks, signals.read_fd()).wait();
  for (Rank& r : ranks) {
    close_rank_fds(r);
  }
  return rc;
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
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(
      fd >= 0, "find_free_port: socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0; // the kernel picks a free one
  socklen_t len = sizeof(addr);
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  TORCH_CHECK(ok, "find_free_port: no free loopback port");
  return ntohs(addr.sin_port);
}

} // namespace launcher
} // namespace colossalai
