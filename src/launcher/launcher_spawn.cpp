// Starting one rank: its torchrun environment, fork/exec into its own
// process group with piped output; signalling its group, closing its fds.

#include "launcher_internal.h"

#include <colossalai/utils/env.h>

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

extern char** environ;

namespace colossalai {
namespace launcher {
namespace detail {

void set_cloexec(int fd) {
  ::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) | FD_CLOEXEC);
}

namespace {

// linux/close_range.h's CLOSE_RANGE_CLOEXEC (Linux 5.11; on older kernels
// the call fails and changes nothing).
constexpr unsigned kCloseRangeCloexec = 1u << 2;

std::vector<std::string> child_env(
    const RunOptions& o,
    int local_rank,
    int restart,
    int console_fd) {
  std::vector<std::pair<std::string, std::string>> vars = {
      {"RANK", std::to_string(o.node_rank * o.nproc_per_node + local_rank)},
      {"WORLD_SIZE", std::to_string(o.nnodes * o.nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"GROUP_RANK", std::to_string(o.node_rank)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(o.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
      // The rank reports the launcher's death by it (colossalai::launch).
      {"COLOSSALAI_LAUNCHER_PID", std::to_string(::getpid())},
      // Where the rank can still write once the launcher, which reads its
      // output, is gone: the launcher's own stderr.
      {"COLOSSALAI_LAUNCHER_STDERR_FD", std::to_string(console_fd)},
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

} // namespace

// Forks one rank into its own process group with stdout/stderr on fresh
// pipes. Everything the child needs is prepared before fork(): after it, only
// async-signal-safe calls are allowed in a multithreaded process.
void spawn(const RunOptions& o, int local_rank, int restart, Rank& r) {
  // A copy of our stderr the rank inherits (dup leaves it open across exec).
  const int console = ::dup(STDERR_FILENO);
  std::vector<std::string> env = child_env(o, local_rank, restart, console);
  const pid_t launcher = ::getpid();
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
    // However the launcher dies (SIGKILL included), the rank gets SIGTERM;
    // a launcher already gone before this line is seen by its new parent.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != launcher) {
      ::_exit(1);
    }
    // Only stdio and the console cross into the rank, not the launcher's
    // own sockets (an elastic job's store) that lack close-on-exec.
    if (console > 3) {
      ::syscall(SYS_close_range, 3u, console - 1u, kCloseRangeCloexec);
    }
    ::syscall(
        SYS_close_range,
        console >= 3 ? console + 1u : 3u,
        ~0u,
        kCloseRangeCloexec);
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
  if (console >= 0) {
    ::close(console);
  }
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

} // namespace detail
} // namespace launcher
} // namespace colossalai
