#include "multiprocess.h"

#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/initialize.h>
#include <colossalai/launcher.h>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

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
struct ChildMustReachItsInvocation {
  ChildMustReachItsInvocation() {
    if (std::getenv(kChild) != nullptr) {
      std::atexit([] {
        std::cerr << "test harness: this child rank never reached "
                     "run_processes invocation "
                  << std::getenv("COLOSSALAI_TEST_INVOCATION") << " of its test"
                  << std::endl;
        std::_Exit(3);
      });
    }
  }
} child_must_reach_its_invocation;

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

std::vector<RankResult> run_processes(
    int world,
    const RankFn& fn,
    MultiProcessOptions o) {
  const int invocation = next_invocation();
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
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
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
          ::kill(pids[r], SIGKILL);
          ::waitpid(pids[r], nullptr, 0);
          results[r].timed_out = true;
          results[r].exit_code = 128 + SIGKILL;
        }
      }
      break;
    }
    if (!progressed) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
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

void run_distributed(int world, const RankFn& fn, MultiProcessOptions o) {
  auto results = run_processes(world, fn, o);
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
