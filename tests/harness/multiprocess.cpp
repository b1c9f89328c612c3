#include "multiprocess.h"

#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/initialize.h>
#include <colossalai/launcher.h>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

extern char** environ;

namespace colossalai {
namespace testing {

namespace {

const char* kChild = "COLOSSALAI_TEST_CHILD";

std::string current_test() {
  auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

// Counts run_processes calls within the current test, so a child runs only
// the call it was spawned for.
int next_invocation() {
  static std::string test;
  static int count = 0;
  std::string now = current_test();
  if (now != test) {
    test = now;
    count = 0;
  }
  return count++;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string tail(const std::string& s, size_t lines) {
  if (s.empty()) {
    return s;
  }
  size_t pos = s.size();
  for (size_t n = 0; n <= lines && pos > 0; ++n) {
    pos = s.rfind('\n', pos - 1);
    if (pos == std::string::npos) {
      return s;
    }
  }
  return s.substr(pos + 1);
}

// A child re-runs its test only to reach one run_processes call, where
// run_child ends the process. A child that instead returns from the test
// (the call was skipped, the test body changed its path, or an assertion
// returned early) would exit 0 and pass without running anything: fail it.
void child_must_reach_its_invocation() {
  static bool armed = false;
  if (armed || std::getenv(kChild) == nullptr) {
    return;
  }
  armed = true;
  std::atexit([] {
    std::cerr << "test harness: this child rank never reached "
                 "run_processes invocation "
              << std::getenv("COLOSSALAI_TEST_INVOCATION") << " of its test"
              << std::endl;
    std::_Exit(3);
  });
}

struct ArmChildCheck {
  ArmChildCheck() {
    child_must_reach_its_invocation();
  }
} arm_child_check;

// NOTE [Rank zygote]
// A rank used to be this binary executed again, and each paid LibTorch's
// static initialisation: about 0.35 s of CPU (its kernel registrations; the
// dynamic loader's share is 15 ms), for each of the suite's several hundred
// ranks. Before main, while the process has run nothing of a test and has
// no threads but OpenBLAS's (which it stops around fork), the harness forks
// a zygote. run_processes asks it for each rank over a socket; the rank,
// forked from the zygote, takes the environment, working directory, output
// file and test filter it was sent and goes on into main as an executed
// child would. The zygote reports each rank's pid and exit status (the
// ranks are its children, so their getppid() is the zygote: files a test
// shares with its ranks are named after test_process()) and exits with the
// test program. COLOSSALAI_TEST_ZYGOTE=0, or any other thread at start,
// keeps fork and exec.

int g_argc = 0;
char** g_argv = nullptr;
int g_zygote = -1;             // the test program's end of the socket
std::map<pid_t, int> g_exited; // statuses the zygote reported, not yet read

std::string pack(const std::vector<std::string>& parts) {
  std::string out;
  for (const auto& p : parts) {
    out += p;
    out.push_back('\0');
  }
  return out;
}

std::vector<std::string> unpack(const char* data, size_t n) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i < n; ++i) {
    if (data[i] == '\0') {
      out.emplace_back(data + start, i - start);
      start = i + 1;
    }
  }
  return out;
}

bool send_packet(int fd, const std::string& data) {
  return ::send(fd, data.data(), data.size(), MSG_NOSIGNAL) ==
      static_cast<ssize_t>(data.size());
}

// In a rank forked from the zygote: becomes what an executed child is.
// request: output file, test filter, working directory, then the whole
// environment as NAME=VALUE.
void become_rank(const std::vector<std::string>& request) {
  ::clearenv();
  for (size_t i = 3; i < request.size(); ++i) {
    ::putenv(::strdup(request[i].c_str()));
  }
  if (::chdir(request[2].c_str()) != 0) {
    std::perror("test harness: chdir");
  }
  const int fd = ::open(request[0].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::dup2(fd, 1);
  ::dup2(fd, 2);
  ::close(fd);
  // The filter takes the place of the program's own GoogleTest flags.
  bool placed = false;
  for (int i = 1; i < g_argc; ++i) {
    if (std::strncmp(g_argv[i], "--gtest_", 8) == 0) {
      g_argv[i] = ::strdup(placed ? "--gtest_brief=1" : request[1].c_str());
      placed = true;
    }
  }
  if (!placed) {
    ::setenv(
        "GTEST_FILTER", request[1].c_str() + 15, 1); // after "--gtest_filter="
  }
  ::setenv("GTEST_BRIEF", "1", 1);
  child_must_reach_its_invocation();
}

// The zygote's loop. Returns only in a newly forked rank, with its request.
std::vector<std::string> serve(int fd) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  sigset_t chld, old;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  ::sigprocmask(SIG_BLOCK, &chld, &old);
  const int sfd = ::signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
  std::vector<char> buf(1 << 20);
  for (;;) {
    pollfd fds[2] = {{fd, POLLIN, 0}, {sfd, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      continue; // EINTR
    }
    if (fds[1].revents & POLLIN) {
      signalfd_siginfo info;
      while (::read(sfd, &info, sizeof info) == sizeof info) {
      }
      int status = 0;
      pid_t pid;
      while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
        send_packet(
            fd, pack({"X", std::to_string(pid), std::to_string(status)}));
      }
    }
    if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
      if (n <= 0) {
        std::_Exit(0); // the test program is gone
      }
      auto request = unpack(buf.data(), static_cast<size_t>(n));
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::close(fd);
        ::close(sfd);
        ::sigprocmask(SIG_SETMASK, &old, nullptr);
        ::prctl(PR_SET_PDEATHSIG, SIGKILL); // dies with the zygote
        return request;
      }
      send_packet(fd, pack({"P", std::to_string(pid)}));
    }
  }
}

// Threads that may exist before main without making fork unsafe: OpenBLAS
// (Debian's LibTorch) starts its workers while loading, stops them around
// fork (pthread_atfork) and starts them again when needed. Any other thread
// could hold a lock that the zygote's children would inherit locked.
int threads_allowed_at_start() {
  using GetThreads = int (*)();
  auto openblas = reinterpret_cast<GetThreads>(
      ::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return 1 + (openblas != nullptr ? std::max(openblas() - 1, 0) : 0);
}

int thread_count() {
  int n = 0;
  for ([[maybe_unused]] const auto& e :
       std::filesystem::directory_iterator("/proc/self/task")) {
    ++n;
  }
  return n;
}

// Runs before main (glibc passes main's arguments to constructors).
__attribute__((constructor)) void start_zygote(int argc, char** argv, char**) {
  g_argc = argc;
  g_argv = argv;
  const char* off = std::getenv("COLOSSALAI_TEST_ZYGOTE");
  if (std::getenv(kChild) != nullptr || (off != nullptr && off[0] == '0') ||
      thread_count() > threads_allowed_at_start()) {
    return;
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return;
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(sv[0]);
    ::close(sv[1]);
    return;
  }
  if (pid > 0) {
    ::close(sv[1]);
    g_zygote = sv[0];
    return;
  }
  ::close(sv[0]);
  if (::getppid() != parent) {
    std::_Exit(0);
  }
  become_rank(serve(sv[1]));
}

// Reads one message from the zygote: a rank's pid ("P"), or stores an exit
// status ("X") and returns -1. Throws when the zygote is gone.
pid_t zygote_message() {
  std::vector<char> buf(256);
  const ssize_t n = ::recv(g_zygote, buf.data(), buf.size(), 0);
  TORCH_CHECK(n > 0, "test harness: the rank zygote exited");
  const auto m = unpack(buf.data(), static_cast<size_t>(n));
  TORCH_INTERNAL_ASSERT(m.size() >= 2);
  if (m[0] == "P") {
    return std::stoi(m[1]);
  }
  g_exited[std::stoi(m[1])] = std::stoi(m[2]);
  return -1;
}

pid_t spawn_from_zygote(
    const std::string& log,
    const std::string& filter,
    const std::map<std::string, std::string>& extra) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq != nullptr) {
      env[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
    }
  }
  for (const auto& [k, v] : extra) {
    env[k] = v;
  }
  std::vector<std::string> request{
      log, filter, std::filesystem::current_path().string()};
  for (const auto& [k, v] : env) {
    request.push_back(k + "=" + v);
  }
  TORCH_CHECK(
      send_packet(g_zygote, pack(request)),
      "test harness: cannot reach the rank zygote");
  pid_t pid;
  while ((pid = zygote_message()) < 0) {
  }
  return pid;
}

// The exit status of `pid` if it has exited (waits up to `wait_ms`).
bool reap(pid_t pid, int* status, int wait_ms) {
  if (g_zygote < 0) {
    if (wait_ms > 0) {
      return ::waitpid(pid, status, 0) == pid;
    }
    return ::waitpid(pid, status, WNOHANG) == pid;
  }
  auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  for (;;) {
    auto it = g_exited.find(pid);
    if (it != g_exited.end()) {
      *status = it->second;
      g_exited.erase(it);
      return true;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    pollfd p{g_zygote, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(left, 0))) <= 0) {
      return false;
    }
    zygote_message();
  }
}

[[noreturn]] void run_child(const RankFn& fn, const MultiProcessOptions& o) {
  int rank = std::atoi(std::getenv("COLOSSALAI_TEST_RANK"));
  int world = std::atoi(std::getenv("COLOSSALAI_TEST_WORLD"));
  int port = std::atoi(std::getenv("COLOSSALAI_TEST_PORT"));
  at::set_num_threads(o.threads_per_rank);
  int code = 0;
  try {
    colossalai::launch(
        colossalai::LaunchOptions()
            .rank(rank)
            .world_size(world)
            .port(port)
            .backend(o.backend)
            .device(o.device)
            .timeout(std::chrono::seconds(o.collective_timeout_seconds))
            .shm_collectives(o.shm_collectives));
    fn(rank, world);
    code = ::testing::Test::HasFailure() ? 1 : 0;
    if (code == 0 && o.final_barrier) {
      distributed::barrier(*distributed::world_group()).wait();
    }
  } catch (const std::exception& e) {
    std::cerr << "rank " << rank << " threw: " << distributed::error_text(e)
              << std::endl;
    code = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  // Skip static destructors: peers may already be gone.
  std::_Exit(code);
}

} // namespace

int free_port() {
  return colossalai::launcher::find_free_port();
}

int test_process() {
  const char* parent = std::getenv("COLOSSALAI_TEST_PARENT");
  return parent != nullptr ? std::atoi(parent) : ::getpid();
}

namespace {

// run_processes for its `invocation`-th call in the test (so a retry of
// one call reaches the same call in the children).
std::vector<RankResult> run_invocation(
    int invocation,
    int world,
    const RankFn& fn,
    const MultiProcessOptions& o) {
  if (const char* child = std::getenv(kChild)) {
    if (std::atoi(std::getenv("COLOSSALAI_TEST_INVOCATION")) == invocation) {
      run_child(fn, o);
    }
    return {};
  }

  const int port = free_port();
  const std::string filter = "--gtest_filter=" + current_test();
  char dir_template[] = "/tmp/colossalai_test_XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  std::vector<pid_t> pids(world);
  std::vector<std::string> logs(world);
  for (int r = 0; r < world; ++r) {
    logs[r] = dir + "/rank" + std::to_string(r) + ".log";
    if (g_zygote >= 0) {
      std::map<std::string, std::string> env{
          {kChild, "1"},
          {"COLOSSALAI_TEST_RANK", std::to_string(r)},
          {"COLOSSALAI_TEST_WORLD", std::to_string(world)},
          {"COLOSSALAI_TEST_PORT", std::to_string(port)},
          {"COLOSSALAI_TEST_INVOCATION", std::to_string(invocation)},
          {"COLOSSALAI_TEST_PARENT", std::to_string(::getpid())}};
      for (int key : {-1, r}) {
        if (o.env.count(key)) {
          for (const auto& [name, value] : o.env.at(key)) {
            env[name] = value;
          }
        }
      }
      pids[r] = spawn_from_zygote(logs[r], filter, env);
      continue;
    }
    pid_t pid = ::fork();
    if (pid == 0) {
      int fd = ::open(logs[r].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::setenv(kChild, "1", 1);
      ::setenv("COLOSSALAI_TEST_RANK", std::to_string(r).c_str(), 1);
      ::setenv("COLOSSALAI_TEST_WORLD", std::to_string(world).c_str(), 1);
      ::setenv("COLOSSALAI_TEST_PORT", std::to_string(port).c_str(), 1);
      ::setenv(
          "COLOSSALAI_TEST_INVOCATION", std::to_string(invocation).c_str(), 1);
      ::setenv(
          "COLOSSALAI_TEST_PARENT", std::to_string(::getppid()).c_str(), 1);
      for (int key : {-1, r}) {
        if (o.env.count(key)) {
          for (const auto& [name, value] : o.env.at(key)) {
            ::setenv(name.c_str(), value.c_str(), 1);
          }
        }
      }
      ::execl(
          "/proc/self/exe",
          "/proc/self/exe",
          filter.c_str(),
          "--gtest_brief=1",
          static_cast<char*>(nullptr));
      std::perror("exec");
      std::_Exit(127);
    }
    pids[r] = pid;
  }

  std::vector<RankResult> results(world);
  std::vector<bool> done(world, false);
  int remaining = world;
  auto deadline = std::chrono::steady_clock::now() +
      std::chrono::seconds(o.timeout_seconds);
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < world; ++r) {
      if (done[r]) {
        continue;
      }
      int status = 0;
      if (reap(pids[r], &status, 0)) {
        done[r] = true;
        --remaining;
        progressed = true;
        results[r].exit_code =
            WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
    }
    if (remaining == 0) {
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world; ++r) {
        if (!done[r]) {
          int status = 0;
          ::kill(pids[r], SIGKILL);
          reap(pids[r], &status, 60 * 1000);
          results[r].timed_out = true;
          results[r].exit_code = 128 + SIGKILL;
        }
      }
      break;
    }
    if (!progressed) {
      if (g_zygote >= 0) {
        pollfd p{g_zygote, POLLIN, 0};
        if (::poll(&p, 1, 10) > 0) {
          zygote_message(); // an exit status, read by reap
        }
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    results[r].rank = r;
    results[r].output = read_file(logs[r]);
    ::unlink(logs[r].c_str());
  }
  ::rmdir(dir.c_str());
  return results;
}

} // namespace

std::vector<RankResult> run_processes(
    int world,
    const RankFn& fn,
    MultiProcessOptions o) {
  return run_invocation(next_invocation(), world, fn, o);
}

void run_distributed(int world, const RankFn& fn, MultiProcessOptions o) {
  const int invocation = next_invocation();
  auto results = run_invocation(invocation, world, fn, o);
  // The free port the parent picked can be taken before rank 0's store
  // binds it (another test's connection gets it as its local port): once,
  // the same call again on another port.
  for (const auto& r : results) {
    if (r.exit_code != 0 &&
        r.output.find("Address already in use") != std::string::npos) {
      results = run_invocation(invocation, world, fn, o);
      break;
    }
  }
  for (const auto& r : results) {
    if (r.timed_out) {
      ADD_FAILURE() << "rank " << r.rank << " of " << world
                    << " hung (killed after " << o.timeout_seconds
                    << " s); output:\n"
                    << tail(r.output, 40);
    } else if (r.exit_code != 0) {
      ADD_FAILURE() << "rank " << r.rank << " of " << world
                    << " failed with exit code " << r.exit_code << "; output:\n"
                    << tail(r.output, 40);
    }
  }
}

} // namespace testing
} // namespace colossalai
