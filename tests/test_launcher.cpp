#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/initialize.h>
#include <colossalai/launcher.h>
#include <colossalai/record.h>
#include <colossalai/utils/env.h>

#include <src/distributed/tcp_store_client.h>

#include <harness/multiprocess.h>
#include <harness/test_util.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
using colossalai::launcher::parse_run_args;
using colossalai::launcher::RunOptions;

namespace {

// A fresh directory, removed with its contents at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl =
        (fs::temp_directory_path() / "colossalai_launcher_XXXXXX").string();
    char* dir = ::mkdtemp(&tmpl[0]);
    EXPECT_NE(dir, nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const {
    return path_;
  }

 private:
  fs::path path_;
};

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Redirects a standard descriptor into a file while alive.
class CaptureFd {
 public:
  CaptureFd(int fd, const fs::path& file) : fd_(fd) {
    std::fflush(nullptr);
    saved_ = ::dup(fd);
    int f = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(f, fd);
    ::close(f);
  }
  ~CaptureFd() {
    std::fflush(nullptr);
    ::dup2(saved_, fd_);
    ::close(saved_);
  }

 private:
  int fd_;
  int saved_;
};

// Sets (or unsets) an environment variable while alive.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      old_ = old;
    }
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

RunOptions sh(int nproc, const std::string& script) {
  RunOptions o;
  o.nproc_per_node = nproc;
  o.program = {"/bin/sh", "-c", script};
  return o;
}

// The parse error's message, or "" when parsing succeeded.
std::string parse_error(const std::vector<std::string>& args) {
  try {
    parse_run_args(args);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// Sends this process SIGTERM once ranks 0 and 1 wrote `dir`/started_<rank>
// (or after 20 s): the launcher under test then runs, handling it.
std::thread sigterm_when_started(
    const fs::path& dir,
    std::chrono::steady_clock::time_point start) {
  return std::thread([dir, start] {
    while (seconds_since(start) < 20.0 &&
           !(fs::exists(dir / "started_0") && fs::exists(dir / "started_1"))) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ::kill(::getpid(), SIGTERM);
  });
}

} // namespace

TEST(LauncherParse, SpaceAndEqualsForms) {
  RunOptions o = parse_run_args(
      {"--nproc_per_node",
       "4",
       "--nnodes=2",
       "--node_rank",
       "1",
       "--master_addr=10.0.0.1",
       "--master_port",
       "1234",
       "--log_dir=/tmp/l",
       "--no_prefix",
       "--kill_grace_seconds=2",
       "./train",
       "--nnodes",
       "9"});
  EXPECT_EQ(o.nproc_per_node, 4);
  EXPECT_EQ(o.nnodes, 2);
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_EQ(o.master_addr, "10.0.0.1");
  EXPECT_EQ(o.master_port, 1234);
  EXPECT_EQ(o.log_dir, "/tmp/l");
  EXPECT_FALSE(o.prefix_output);
  EXPECT_EQ(o.kill_grace_seconds, 2);
  // Options after the program are the program's.
  EXPECT_EQ(o.program, (std::vector<std::string>{"./train", "--nnodes", "9"}));
  EXPECT_FALSE(o.help);
}

TEST(LauncherParse, DefaultsDashesAndSeparator) {
  RunOptions o = parse_run_args({"--nproc-per-node=2", "--", "--odd-name"});
  EXPECT_EQ(o.nproc_per_node, 2);
  EXPECT_EQ(o.nnodes, 1);
  EXPECT_EQ(o.node_rank, 0);
  EXPECT_EQ(o.master_addr, "127.0.0.1");
  EXPECT_EQ(o.master_port, 29500);
  EXPECT_TRUE(o.prefix_output);
  EXPECT_EQ(o.program, (std::vector<std::string>{"--odd-name"}));
}

TEST(LauncherParse, Help) {
  EXPECT_TRUE(parse_run_args({"--help"}).help);
  EXPECT_TRUE(parse_run_args({"-h"}).help);
  EXPECT_NE(
      colossalai::launcher::run_usage().find("--nproc_per_node"),
      std::string::npos);
}

TEST(LauncherParse, ErrorsNameTheOption) {
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--nproc_per_node", "0", "prog"}, "--nproc_per_node"},
      {{"--nproc_per_node=abc", "prog"}, "--nproc_per_node"},
      {{"--nproc_per_node=2x", "prog"}, "--nproc_per_node"},
      {{"--nproc_per_node=99999999999", "prog"}, "--nproc_per_node"},
      {{"--nproc_per_node"}, "--nproc_per_node"},
      {{"--nproc_per_node=1", "--master_port=", "prog"},
       "--master_port needs a value"},
      {{"prog"}, "--nproc_per_node is required"},
      {{"--nproc_per_node=1", "--nnodes=0", "prog"}, "--nnodes"},
      {{"--nproc_per_node=1", "--node_rank=2", "--nnodes=2", "prog"},
       "--node_rank"},
      {{"--nproc_per_node=1", "--node_rank=-1", "prog"}, "--node_rank"},
      {{"--nproc_per_node=1", "--master_port=70000", "prog"}, "--master_port"},
      {{"--nproc_per_node=1", "--master_port=0", "prog"}, "--master_port"},
      {{"--nproc_per_node=1", "--master_addr=", "prog"}, "--master_addr"},
      {{"--nproc_per_node=1", "--no_prefix=1", "prog"}, "no_prefix"},
      {{"--nproc_per_node=1", "--bogus", "prog"}, "--bogus"},
      {{"--nproc_per_node=1", "--bogus=3", "prog"}, "'--bogus'"},
      {{"--nproc_per_node=1", "-x", "prog"}, "-x"},
      {{"--nproc_per_node=1"}, "no program"},
      {{"--nproc_per_node=1", "--"}, "no program"},
  };
  for (const Case& c : cases) {
    std::string msg = parse_error(c.args);
    EXPECT_NE(msg.find(c.expected), std::string::npos)
        << "args[0]=" << c.args[0] << " message: '" << msg << "'";
  }
}

TEST(LauncherRun, ValidatesOptions) {
  RunOptions o = sh(1, "true");
  o.nproc_per_node = 0;
  EXPECT_THROW(colossalai::launcher::run(o), c10::Error);
  o = sh(1, "true");
  o.program.clear();
  EXPECT_THROW(colossalai::launcher::run(o), c10::Error);
}

TEST(LauncherRun, SetsTheRankEnvironment) {
  TempDir dir;
  RunOptions o =
      sh(2,
         "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK "
         "$MASTER_ADDR $MASTER_PORT $OMP_NUM_THREADS\" > \"$0/env_$RANK\"");
  o.program.push_back(dir.path().string()); // $0 of the script
  o.nnodes = 3;
  o.node_rank = 1;
  o.master_addr = "node0";
  o.master_port = 12345;
  ASSERT_EQ(colossalai::launcher::run(o), 0);

  const char* omp = std::getenv("OMP_NUM_THREADS");
  std::string threads = omp != nullptr && *omp != '\0' ? omp : "1";
  for (int local = 0; local < 2; ++local) {
    int rank = 2 + local;
    std::string expected = std::to_string(rank) + " 6 " +
        std::to_string(local) + " 2 1 node0 12345 " + threads + "\n";
    EXPECT_EQ(
        read_file(dir.path() / ("env_" + std::to_string(rank))), expected);
  }
}

TEST(LauncherRun, KeepsTheParentsOmpNumThreads) {
  TempDir dir;
  ScopedEnv omp("OMP_NUM_THREADS", "7");
  RunOptions o = sh(1, "echo \"$OMP_NUM_THREADS\" > \"$0/omp\"");
  o.program.push_back(dir.path().string());
  ASSERT_EQ(colossalai::launcher::run(o), 0);
  EXPECT_EQ(read_file(dir.path() / "omp"), "7\n");
}

TEST(LauncherRun, FailureStopsTheOtherRanks) {
  auto start = std::chrono::steady_clock::now();
  RunOptions o = sh(2, "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60");
  // Long enough that only the SIGTERM can stop rank 0 within the bound.
  o.kill_grace_seconds = 120;
  EXPECT_EQ(colossalai::launcher::run(o), 3);
  EXPECT_LT(seconds_since(start), 30.0);
}

TEST(LauncherRun, SigkillAfterTheGracePeriod) {
  auto start = std::chrono::steady_clock::now();
  // Rank 0 (and the sleep it starts) ignores SIGTERM.
  RunOptions o =
      sh(2,
         "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 5; fi; "
         "trap '' TERM; sleep 60");
  o.kill_grace_seconds = 1;
  EXPECT_EQ(colossalai::launcher::run(o), 5);
  EXPECT_LT(seconds_since(start), 30.0);
}

TEST(LauncherRun, KilledBySignalGives128PlusSignal) {
  RunOptions o = sh(1, "kill -9 $$");
  EXPECT_EQ(colossalai::launcher::run(o), 128 + 9);
}

TEST(LauncherRun, MissingProgramGives127) {
  TempDir dir;
  RunOptions o;
  o.nproc_per_node = 1;
  o.program = {"/nonexistent/colossalai_no_such_program"};
  o.log_dir = dir.path().string();
  EXPECT_EQ(colossalai::launcher::run(o), 127);
  std::string log = read_file(dir.path() / "rank_0.log");
  EXPECT_NE(
      log.find("cannot execute /nonexistent/colossalai_no_such_program"),
      std::string::npos)
      << log;
}

TEST(LauncherRun, LogDirRecordsEachRank) {
  TempDir dir;
  RunOptions o = sh(2, "echo \"out $RANK\"; echo \"err $RANK\" >&2");
  o.log_dir = (dir.path() / "logs" / "nested").string(); // created by run()
  ASSERT_EQ(colossalai::launcher::run(o), 0);
  for (int rank = 0; rank < 2; ++rank) {
    std::string r = std::to_string(rank);
    std::string log = read_file(fs::path(o.log_dir) / ("rank_" + r + ".log"));
    // stdout and stderr are separate pipes: their relative order may vary.
    EXPECT_NE(log.find("out " + r + "\n"), std::string::npos) << log;
    EXPECT_NE(log.find("err " + r + "\n"), std::string::npos) << log;
    EXPECT_EQ(log.size(), 12u) << log;
  }
}

TEST(LauncherRun, PrefixesEveryLine) {
  TempDir dir;
  // Global rank 1: node 1 of 2 with one rank each.
  RunOptions o =
      sh(1,
         "printf 'one\\ntwo\\n\\r1%%\\r2%%\\n'; printf 'a\\rb\\r\\nc'; "
         "printf 'e1\\ne2' >&2");
  o.nnodes = 2;
  o.node_rank = 1;
  o.log_dir = (dir.path() / "logs").string();
  int rc;
  {
    CaptureFd out(STDOUT_FILENO, dir.path() / "stdout");
    CaptureFd err(STDERR_FILENO, dir.path() / "stderr");
    rc = colossalai::launcher::run(o);
  }
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(
      read_file(dir.path() / "stdout"),
      "[rank 1] one\n[rank 1] two\n\r[rank 1] 1%\r[rank 1] 2%\n"
      "[rank 1] a\r[rank 1] b\r\n[rank 1] c");
  EXPECT_EQ(read_file(dir.path() / "stderr"), "[rank 1] e1\n[rank 1] e2");
  // The log holds the rank's raw output.
  std::string log = read_file(dir.path() / "logs" / "rank_1.log");
  EXPECT_NE(log.find("one\ntwo\n\r1%\r2%\na\rb\r\nc"), std::string::npos)
      << log;
}

TEST(LauncherRun, NoPrefixPassesBytesThrough) {
  TempDir dir;
  RunOptions o = sh(1, "printf 'x\\ry\\n\\nz'");
  o.prefix_output = false;
  int rc;
  {
    CaptureFd out(STDOUT_FILENO, dir.path() / "stdout");
    rc = colossalai::launcher::run(o);
  }
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(read_file(dir.path() / "stdout"), "x\ry\n\nz");
}

TEST(LauncherRun, ForwardsSigtermToTheRanks) {
  TempDir dir;
  RunOptions o = sh(2, "touch \"$0/started_$RANK\"; sleep 60");
  o.program.push_back(dir.path().string());
  auto start = std::chrono::steady_clock::now();
  // run() handles SIGTERM while it runs; send it once both ranks are up.
  std::thread sender = sigterm_when_started(dir.path(), start);
  int rc = colossalai::launcher::run(o);
  sender.join();
  EXPECT_EQ(rc, 128 + SIGTERM);
  EXPECT_LT(seconds_since(start), 30.0);
}

TEST(LauncherRun, LeftoverDescendantDoesNotHang) {
  TempDir dir;
  auto start = std::chrono::steady_clock::now();
  // The background sleep keeps the output pipes open after the rank exits.
  RunOptions o = sh(1, "sleep 60 & echo $! > \"$0/pid\"; exit 0");
  o.program.push_back(dir.path().string());
  EXPECT_EQ(colossalai::launcher::run(o), 0);
  EXPECT_LT(seconds_since(start), 30.0);
  std::string pid = read_file(dir.path() / "pid");
  if (!pid.empty()) {
    ::kill(std::stoi(pid), SIGKILL);
  }
}

TEST(LauncherRun, MaxRestartsRestartsTheLocalGroup) {
  TempDir dir;
  // Rank 1 fails in the first attempt while rank 0 waits; the restart, with
  // TORCHELASTIC_RESTART_COUNT 1, succeeds. Rank 1 fails only once rank 0
  // has written its line (on a loaded machine the launcher could otherwise
  // stop rank 0 before its shell ran the echo).
  RunOptions o =
      sh(2,
         "echo \"$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS\" >> "
         "\"$0/runs_$RANK\"; "
         "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
         "  if [ \"$RANK\" = 1 ]; then "
         "    while [ ! -s \"$0/runs_0\" ]; do sleep 0.01; done; exit 3; fi; "
         "  sleep 60; fi");
  o.program.push_back(dir.path().string());
  o.max_restarts = 2;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(colossalai::launcher::run(o), 0);
  EXPECT_LT(seconds_since(start), 30.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(
        read_file(dir.path() / ("runs_" + std::to_string(r))), "0 2\n1 2\n");
  }
  // Out of restarts: the last failure's code, after 1 + 2 attempts.
  RunOptions always = sh(1, "echo x >> \"$0/n\"; exit 4");
  always.program.push_back(dir.path().string());
  always.max_restarts = 2;
  EXPECT_EQ(colossalai::launcher::run(always), 4);
  EXPECT_EQ(read_file(dir.path() / "n"), "x\nx\nx\n");
  EXPECT_NE(parse_error({"--nproc_per_node", "1", "--max_restarts", "-1", "prog"}).find("max_restarts"),
            std::string::npos);
  EXPECT_EQ(parse_run_args({"--nproc_per_node", "1", "--max-restarts", "3", "p"})
                .max_restarts,
            3);
}

TEST(LauncherRun, SignalledLauncherRestartsNothing) {
  TempDir dir;
  RunOptions o = sh(2, "echo x >> \"$0/started_$RANK\"; sleep 60");
  o.program.push_back(dir.path().string());
  o.max_restarts = 3;
  auto start = std::chrono::steady_clock::now();
  std::thread sender = sigterm_when_started(dir.path(), start);
  EXPECT_EQ(colossalai::launcher::run(o), 128 + SIGTERM);
  sender.join();
  EXPECT_EQ(read_file(dir.path() / "started_0"), "x\n");
}

TEST(LauncherParse, ElasticOptions) {
  auto o = parse_run_args(
      {"--nproc_per_node", "2", "--nnodes", "1:3", "--rdzv_endpoint",
       "10.0.0.1:29400", "--rdzv-id", "job7", "--rdzv_conf",
       "last_call_timeout=2.5,join_timeout=60", "prog"});
  EXPECT_EQ(o.min_nodes, 1);
  EXPECT_EQ(o.nnodes, 3);
  EXPECT_EQ(o.rdzv_endpoint, "10.0.0.1:29400");
  EXPECT_EQ(o.rdzv_id, "job7");
  EXPECT_EQ(o.rdzv_last_call_timeout, 2.5);
  EXPECT_EQ(o.rdzv_join_timeout, 60);
  // c10d with a fixed size: elastic at exactly that size.
  o = parse_run_args(
      {"--nproc_per_node=1", "--nnodes=2", "--rdzv_backend=c10d", "prog"});
  EXPECT_EQ(o.min_nodes, 2);
  EXPECT_EQ(o.nnodes, 2);
  EXPECT_EQ(parse_run_args({"--nproc_per_node=1", "--nnodes=2", "prog"}).min_nodes, 0);
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--nnodes", "3:2"}, "MIN <= MAX"},
      {{"--nnodes", "0:2"}, "MIN >= 1"},
      {{"--nnodes", "a:b"}, "--nnodes must be N or MIN:MAX"},
      {{"--nnodes", "1:2:3"}, "--nnodes must be N or MIN:MAX"},
      {{"--nnodes", "1:2", "--node_rank", "1"}, "--node_rank is given by"},
      {{"--nnodes", "1:2", "--rdzv_endpoint", "host"}, "HOST:PORT"},
      {{"--nnodes", "1:2", "--rdzv_endpoint", "host:99999"}, "HOST:PORT"},
      {{"--nnodes", "1:2", "--rdzv_id", "a/b"}, "--rdzv_id"},
      {{"--nnodes", "1:2", "--rdzv_conf", "timeout=3"}, "last_call_timeout=S"},
      {{"--nnodes", "1:2", "--rdzv_conf", "join_timeout=x"}, "number of seconds"},
      {{"--nnodes", "1:2", "--rdzv_conf", "join_timeout=0"}, "join_timeout in (0, 1e7]"},
      {{"--nnodes", "1:2", "--rdzv_conf", "join_timeout=inf"}, "join_timeout in (0, 1e7]"},
      {{"--nnodes", "1:2", "--rdzv_conf", "last_call_timeout=nan"}, "last_call_timeout must be"},
      {{"--rdzv_backend", "etcd"}, "'static' or 'c10d'"},
  };
  for (const auto& [args, expected] : bad) {
    std::vector<std::string> full = {"--nproc_per_node=1"};
    full.insert(full.end(), args.begin(), args.end());
    full.push_back("prog");
    const std::string msg = parse_error(full);
    EXPECT_NE(msg.find(expected), std::string::npos)
        << args[0] << " " << args[1] << ": '" << msg << "'";
  }
}

namespace {

// `colossalai run ARGS` in the background, its output into `log`.
pid_t start_cli(const std::vector<std::string>& args, const fs::path& log) {
  std::vector<std::string> all = {COLOSSALAI_CLI};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) {
    argv.push_back(&a[0]);
  }
  argv.push_back(nullptr);
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(fd);
  return pid;
}

// The exit code of `pid` (128 + signal), or -1 when it runs past `seconds`
// (it is then killed).
int wait_cli(pid_t pid, double seconds) {
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (seconds_since(start) > seconds) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

std::vector<std::string> lines_of(const fs::path& file) {
  std::istringstream in(read_file(file));
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    out.push_back(line);
  }
  return out;
}

// Waits until `file` has `n` lines (at most `seconds`); returns them.
std::vector<std::string> await_lines(const fs::path& file, size_t n, double seconds) {
  const auto start = std::chrono::steady_clock::now();
  auto lines = lines_of(file);
  while (lines.size() < n && seconds_since(start) < seconds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    lines = lines_of(file);
  }
  return lines;
}

} // namespace

// NOTE [Elastic rendezvous] on one host: node a starts alone (world 1);
// node b arrives and the job re-forms at two nodes; b's rank is killed and
// b restarts it (--max_restarts), so both re-form again, b counting one
// restart and a none; a third node finds the job at its maximum and is
// turned away, saying why; b is pre-empted (SIGTERM) and a goes on alone
// and finishes with 0.
TEST(LauncherElastic, GrowsReformsAfterAFailureAndTurnsAwayAThirdNode) {
  TempDir dir;
  const std::string d = dir.path().string();
  const std::string endpoint =
      "127.0.0.1:" + std::to_string(colossalai::launcher::find_free_port());
  // Each rank writes "RANK WORLD_SIZE MASTER RESTARTS PID" and waits for
  // the stop file.
  const std::string script =
      "echo \"$RANK $WORLD_SIZE $MASTER_ADDR:$MASTER_PORT "
      "$TORCHELASTIC_RESTART_COUNT $$\" >> \"$0/rounds\"; "
      "while [ ! -e \"$0/stop\" ]; do sleep 0.05; done";
  auto node = [&](const std::string& name, const std::string& join_timeout) {
    return start_cli(
        {"run", "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_endpoint",
         endpoint, "--rdzv_conf",
         "last_call_timeout=3,join_timeout=" + join_timeout,
         "--max_restarts", "2", "/bin/sh", "-c", script, d},
        dir.path() / (name + ".log"));
  };
  auto fields = [](const std::string& line) {
    std::istringstream in(line);
    std::vector<std::string> f;
    for (std::string x; in >> x;) {
      f.push_back(x);
    }
    return f;
  };
  const fs::path rounds = dir.path() / "rounds";
  const pid_t a = node("a", "60");
  auto lines = await_lines(rounds, 1, 60);
  ASSERT_EQ(lines.size(), 1u) << read_file(dir.path() / "a.log");
  EXPECT_EQ(fields(lines[0])[1], "1"); // alone: world size 1

  const pid_t b = node("b", "60");
  auto t0 = std::chrono::steady_clock::now();
  lines = await_lines(rounds, 3, 60);
  const double grew = seconds_since(t0);
  ASSERT_EQ(lines.size(), 3u) << read_file(dir.path() / "a.log")
                              << read_file(dir.path() / "b.log");
  std::set<std::string> ranks;
  for (size_t i = 1; i < 3; ++i) {
    const auto f = fields(lines[i]);
    EXPECT_EQ(f[1], "2") << lines[i];
    EXPECT_EQ(f[2], fields(lines[1])[2]) << "one master for the round";
    EXPECT_EQ(f[3], "0") << lines[i];
    ranks.insert(f[0]);
  }
  EXPECT_EQ(ranks, (std::set<std::string>{"0", "1"}));

  // A rank of the two-node job dies; its node restarts it.
  const std::string victim = fields(lines[1])[4];
  ASSERT_EQ(::kill(std::stoi(victim), SIGKILL), 0);
  t0 = std::chrono::steady_clock::now();
  lines = await_lines(rounds, 5, 60);
  const double reformed = seconds_since(t0);
  ASSERT_EQ(lines.size(), 5u) << read_file(dir.path() / "a.log")
                              << read_file(dir.path() / "b.log");
  std::multiset<std::string> restarts;
  for (size_t i = 3; i < 5; ++i) {
    EXPECT_EQ(fields(lines[i])[1], "2") << lines[i];
    restarts.insert(fields(lines[i])[3]);
  }
  EXPECT_EQ(restarts, (std::multiset<std::string>{"0", "1"}));

  // A third node: the job already has the most --nnodes 1:2 admits.
  const pid_t c = node("c", "2");
  EXPECT_EQ(wait_cli(c, 60), 1);
  const std::string c_log = read_file(dir.path() / "c.log");
  EXPECT_NE(c_log.find("the most that --nnodes 1:2 admits"), std::string::npos)
      << c_log;
  EXPECT_EQ(lines_of(rounds).size(), 5u) << "the turned-away node disturbed the job";

  // Node b is pre-empted (SIGTERM to its launcher): it forwards the signal,
  // leaves, and a goes on alone.
  ASSERT_EQ(::kill(b, SIGTERM), 0);
  EXPECT_EQ(wait_cli(b, 60), 128 + SIGTERM) << read_file(dir.path() / "b.log");
  lines = await_lines(rounds, 6, 60);
  ASSERT_EQ(lines.size(), 6u) << read_file(dir.path() / "a.log");
  EXPECT_EQ(fields(lines[5])[0], "0") << lines[5];
  EXPECT_EQ(fields(lines[5])[1], "1") << lines[5];

  std::ofstream(dir.path() / "stop") << "";
  EXPECT_EQ(wait_cli(a, 60), 0) << read_file(dir.path() / "a.log");
  const std::string a_log = read_file(dir.path() / "a.log");
  EXPECT_NE(a_log.find("a node is waiting to join"), std::string::npos) << a_log;
  std::cout << "grew to 2 nodes " << grew << " s after the second started; "
            << "re-formed " << reformed << " s after a rank was killed\n";
}

// A launcher waiting for the nodes --nnodes 2:2 needs ends on SIGTERM with
// 128 + 15, saying so, instead of waiting out the join timeout (600 s).
TEST(LauncherElastic, SignalWhileJoiningEndsTheLauncher) {
  TempDir dir;
  const int port = colossalai::launcher::find_free_port();
  const pid_t a = start_cli(
      {"run", "--nnodes", "2:2", "--nproc_per_node", "1", "--rdzv_endpoint",
       "127.0.0.1:" + std::to_string(port), "/bin/true"},
      dir.path() / "a.log");
  // Its store listening means its signal handling is in place (the
  // launcher installs it first) and it is about to join.
  const auto start = std::chrono::steady_clock::now();
  auto listening = [port] {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok =
        ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    return ok;
  };
  while (!listening() && seconds_since(start) < 30) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(listening()) << read_file(dir.path() / "a.log");
  ASSERT_EQ(::kill(a, SIGTERM), 0);
  EXPECT_EQ(wait_cli(a, 60), 128 + SIGTERM) << read_file(dir.path() / "a.log");
  const std::string log = read_file(dir.path() / "a.log");
  EXPECT_NE(log.find("while joining"), std::string::npos) << log;
}

TEST(Launcher, LaunchedByLauncher) {
  ScopedEnv rank("RANK", nullptr);
  ScopedEnv ompi("OMPI_COMM_WORLD_RANK", nullptr);
  ScopedEnv slurm("SLURM_PROCID", nullptr);
  EXPECT_FALSE(colossalai::launcher::launched_by_launcher());
  {
    ScopedEnv r("RANK", "0");
    EXPECT_TRUE(colossalai::launcher::launched_by_launcher());
  }
  {
    ScopedEnv r("OMPI_COMM_WORLD_RANK", "3");
    EXPECT_TRUE(colossalai::launcher::launched_by_launcher());
  }
  {
    ScopedEnv r("SLURM_PROCID", "1");
    EXPECT_TRUE(colossalai::launcher::launched_by_launcher());
  }
}

// ---------------------------------------------------------------------------
// launch_from_env under real launchers: torchrun (the pinned torch's), OpenMPI's
// mpirun, and Slurm's variables.

namespace {

namespace cb = colossalai::booster;

std::string self_exe() {
  return fs::read_symlink("/proc/self/exe").string();
}

// One SGD step of a DDP-boosted Linear on this rank's batch must equal one
// process stepping on the mean of every rank's loss; a world all-reduce of
// rank + 1 must give the sum. Throws (TORCH_CHECK) otherwise.
void check_ddp_step(int rank, int world) {
  auto batch = [](int r) {
    torch::manual_seed(100 + r);
    auto x = torch::randn({2, 4});
    return std::make_pair(x, torch::randn({2, 3}));
  };
  torch::manual_seed(0);
  torch::nn::Linear model(4, 3);
  torch::manual_seed(0);
  torch::nn::Linear reference(4, 3);

  auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  auto opt = std::make_shared<torch::optim::SGD>(
      model->parameters(), torch::optim::SGDOptions(0.1));
  auto boosted = booster.boost(model, opt);
  const auto mine = batch(plugin->dp_rank());
  boosted.optimizer->zero_grad();
  booster.backward(
      torch::mse_loss(boosted.model(mine.first), mine.second),
      *boosted.optimizer);
  boosted.optimizer->step();

  torch::optim::SGD ref_opt(
      reference->parameters(), torch::optim::SGDOptions(0.1));
  auto loss = torch::zeros({});
  for (int r = 0; r < world; ++r) {
    const auto b = batch(r);
    loss = loss + torch::mse_loss(reference(b.first), b.second) / world;
  }
  loss.backward();
  ref_opt.step();
  TORCH_CHECK(
      torch::allclose(model->weight, reference->weight, 1e-5, 1e-6) &&
          torch::allclose(model->bias, reference->bias, 1e-5, 1e-6),
      "rank ",
      rank,
      ": the DDP step differs from one process's");

  auto t = torch::full({1}, static_cast<float>(rank + 1));
  colossalai::distributed::all_reduce(t, *colossalai::distributed::world_group())
      .wait();
  TORCH_CHECK(
      t.item<float>() == world * (world + 1) / 2,
      "rank ",
      rank,
      ": all-reduce gave ",
      t.item<float>());
}

// What LaunchedRank.Body does as one rank of a launcher test:
// COLOSSALAI_TEST_LAUNCHER names the launcher whose variables it expects,
// COLOSSALAI_TEST_LAUNCHED "train" (a DDP step), "fail" (rank 1 throws) or
// "uncaught" (rank 1 throws on a thread nobody catches on).
int launched_rank(const std::string& launcher, const std::string& mode) {
  const auto env = colossalai::utils::read_dist_env();
  // `colossalai run` exports torchrun's variables.
  TORCH_CHECK(
      env.source == (launcher == "colossalai" ? "torchrun" : launcher),
      "expected ",
      launcher,
      "'s variables, found '",
      env.source,
      "'");
  if (launcher == "torchrun") {
    // The case under test: torchrun's agent already serves the store.
    TORCH_CHECK(
        colossalai::utils::agent_store_serves(
            env.master_addr.value_or(""), env.master_port.value_or(0)),
        "torchrun did not announce its agent store");
  }
  colossalai::launch_from_env(
      colossalai::LaunchOptions().backend("gloo").timeout(
          std::chrono::seconds(60)));
  const int rank = colossalai::distributed::get_rank();
  const int world = colossalai::distributed::get_world_size();
  TORCH_CHECK(
      rank == env.rank && world == env.world_size && env.local_rank == rank,
      "rank ",
      rank,
      " of ",
      world,
      " (local rank ",
      env.local_rank.value_or(-1),
      ") does not match the launcher's");
  if (mode == "sleep") { // until the launcher's death stops it
    std::ofstream(
        std::string(std::getenv("COLOSSALAI_TEST_DIR")) + "/pid_" +
        std::to_string(rank))
        << ::getpid() << "\n";
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  if (mode == "fail" || mode == "uncaught") {
    if (rank == 1 && mode == "fail") {
      TORCH_CHECK(false, "planted failure on rank 1");
    }
    if (rank == 1) {
      std::thread([] {
        throw std::runtime_error("planted uncaught error on rank 1");
      }).join();
    }
    // The launcher stops this rank when rank 1 fails.
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  check_ddp_step(rank, world);
  std::cout << "rank " << rank << " of " << world << " (" << launcher
            << "): DDP step and all-reduce match" << std::endl;
  colossalai::destroy();
  return 0;
}

// Runs this test program's LaunchedRank.Body under `launcher_command`, the
// rank's mode and launcher in its environment: exit status and output.
std::pair<int, std::string> run_launched(
    const std::string& launcher_command,
    const std::string& launcher,
    const std::string& mode) {
  return colossalai::testing::run_shell(
      "COLOSSALAI_TEST_LAUNCHER=" + launcher +
      " COLOSSALAI_TEST_LAUNCHED=" + mode + " OMP_NUM_THREADS=1 timeout 300 " +
      launcher_command + " " + self_exe() +
      " --gtest_filter=LaunchedRank.Body");
}

// torchrun's static rendezvous at a free port; `standalone`: its c10d
// rendezvous on a port of its own choosing (--standalone).
std::string torchrun_command(bool standalone = false) {
  return std::string(COLOSSALAI_TEST_TORCHRUN) +
      " --no-python --nproc_per_node 2 " +
      (standalone ? std::string("--standalone")
                  : "--master_port " +
               std::to_string(colossalai::testing::free_port()));
}

// Both ranks of a "train" run said they matched.
void expect_both_ranks_trained(
    const std::string& output,
    const std::string& launcher) {
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(
        output.find(
            "rank " + std::to_string(rank) + " of 2 (" + launcher +
            "): DDP step and all-reduce match"),
        std::string::npos)
        << output;
  }
}

// The part of torchrun's failure summary that names the root cause.
std::string root_cause(const std::string& output) {
  const auto at = output.find("Root Cause (first observed failure):");
  return at == std::string::npos ? "" : output.substr(at);
}

} // namespace

TEST(LaunchedRank, Body) {
  const char* launcher = std::getenv("COLOSSALAI_TEST_LAUNCHER");
  const char* mode = std::getenv("COLOSSALAI_TEST_LAUNCHED");
  if (launcher == nullptr || mode == nullptr) {
    GTEST_SKIP() << "runs only as a rank of the LaunchFromEnv tests";
  }
  const int rc =
      colossalai::record([&] { return launched_rank(launcher, mode); });
  if (rc != 0) {
    std::fflush(nullptr);
    std::_Exit(rc);
  }
}

TEST(LaunchFromEnv, TorchrunTrainsTwoRanksOnItsAgentStore) {
  if (::access(COLOSSALAI_TEST_TORCHRUN, X_OK) != 0) {
    GTEST_SKIP() << "no " << COLOSSALAI_TEST_TORCHRUN
                 << " (./scripts/setup.sh --tests installs the pinned torch)";
  }
  for (const bool standalone : {false, true}) {
    SCOPED_TRACE(standalone ? "--standalone" : "--master_port");
    const auto start = std::chrono::steady_clock::now();
    const auto [rc, output] =
        run_launched(torchrun_command(standalone), "torchrun", "train");
    EXPECT_EQ(rc, 0) << output;
    expect_both_ranks_trained(output, "torchrun");
    std::cout << "torchrun " << (standalone ? "--standalone" : "--master_port")
              << ", 2 ranks, start to exit with a DDP step: "
              << seconds_since(start) << " s\n";
  }
}

TEST(LaunchFromEnv, TorchrunReportsTheFailingRanksError) {
  if (::access(COLOSSALAI_TEST_TORCHRUN, X_OK) != 0) {
    GTEST_SKIP() << "no " << COLOSSALAI_TEST_TORCHRUN
                 << " (./scripts/setup.sh --tests installs the pinned torch)";
  }
  struct Case {
    const char* mode;
    const char* exit;
    const char* traceback;
  };
  // "fail": colossalai::record ends the rank with exit code 1 and the error
  // in torchrun's error file; "uncaught": no record, launch's terminate
  // handler writes the file, then the rank aborts.
  for (const Case& c :
       {Case{"fail", "exitcode  : 1 ", "c10::Error: planted failure on rank 1"},
        Case{
            "uncaught",
            "(SIGABRT)",
            "std::runtime_error: planted uncaught error on rank 1"}}) {
    SCOPED_TRACE(c.mode);
    const auto [rc, output] =
        run_launched(torchrun_command(), "torchrun", c.mode);
    EXPECT_NE(rc, 0) << output;
    const std::string cause = root_cause(output);
    EXPECT_NE(cause.find("rank      : 1"), std::string::npos) << output;
    EXPECT_NE(cause.find(c.exit), std::string::npos) << output;
    EXPECT_EQ(cause.find("error_file: <N/A>"), std::string::npos) << output;
    EXPECT_NE(
        cause.find(std::string("traceback : ") + c.traceback),
        std::string::npos)
        << output;
  }
}

TEST(LaunchFromEnv, MpirunTrainsTwoRanks) {
  if (colossalai::testing::run_shell("command -v mpirun").first != 0) {
    GTEST_SKIP() << "no mpirun (Debian's openmpi-bin)";
  }
  // OpenMPI names no master: one host, so 127.0.0.1 and MASTER_PORT.
  const std::string mpirun =
      "env -u RANK -u WORLD_SIZE -u MASTER_ADDR mpirun --allow-run-as-root "
      "--oversubscribe --bind-to none -np 2 -x COLOSSALAI_TEST_LAUNCHER "
      "-x COLOSSALAI_TEST_LAUNCHED -x OMP_NUM_THREADS -x MASTER_PORT=" +
      std::to_string(colossalai::testing::free_port());
  const auto [rc, output] = run_launched(mpirun, "openmpi", "train");
  EXPECT_EQ(rc, 0) << output;
  expect_both_ranks_trained(output, "openmpi");
}

TEST(LaunchFromEnv, SlurmVariablesTrainTwoRanks) {
  // What srun sets for two tasks on one node (no MASTER_ADDR either).
  const std::string port = std::to_string(colossalai::testing::free_port());
  std::string script;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string r = std::to_string(rank);
    script += "env -u RANK -u WORLD_SIZE -u MASTER_ADDR SLURM_PROCID=" + r +
        " SLURM_LOCALID=" + r +
        " SLURM_NTASKS=2 SLURM_NNODES=1 SLURM_STEP_NUM_NODES=1 MASTER_PORT=" +
        port + " COLOSSALAI_TEST_LAUNCHER=slurm COLOSSALAI_TEST_LAUNCHED=train"
        " OMP_NUM_THREADS=1 timeout 300 " + self_exe() +
        " --gtest_filter=LaunchedRank.Body & p" + r + "=$!; ";
  }
  script += "wait $p0; a=$?; wait $p1; b=$?; exit $((a + b))";
  const auto [rc, output] = colossalai::testing::run_shell(
      "sh -c '" + script + "'");
  EXPECT_EQ(rc, 0) << output;
  expect_both_ranks_trained(output, "slurm");
}

// What read_dist_env makes of the launcher variables set now, and
// launch_from_env's refusal of ranks on several hosts without MASTER_ADDR,
// which must say `how` to pass it.
void expect_ranks_and_refusal(
    const std::string& source,
    int rank,
    int world,
    int local_rank,
    const std::string& how) {
  const auto env = colossalai::utils::read_dist_env();
  EXPECT_EQ(env.source, source);
  EXPECT_EQ(env.rank, rank);
  EXPECT_EQ(env.world_size, world);
  EXPECT_EQ(env.local_rank, local_rank);
  const auto msg =
      colossalai::testing::error_of([] { colossalai::launch_from_env(); });
  EXPECT_NE(msg.find("MASTER_ADDR is not set"), std::string::npos) << msg;
  EXPECT_NE(msg.find(how), std::string::npos) << msg;
}

TEST(LaunchFromEnv, ReadsOpenMpiAndSlurmVariables) {
  ScopedEnv rank("RANK", nullptr);
  ScopedEnv world("WORLD_SIZE", nullptr);
  ScopedEnv addr("MASTER_ADDR", nullptr);
  {
    ScopedEnv r("OMPI_COMM_WORLD_RANK", "3");
    ScopedEnv w("OMPI_COMM_WORLD_SIZE", "4");
    ScopedEnv lr("OMPI_COMM_WORLD_LOCAL_RANK", "1");
    ScopedEnv lw("OMPI_COMM_WORLD_LOCAL_SIZE", "2"); // two hosts
    expect_ranks_and_refusal("openmpi", 3, 4, 1, "mpirun -x MASTER_ADDR=");
    EXPECT_EQ(colossalai::utils::read_dist_env().local_world_size, 2);
  }
  {
    ScopedEnv ompi("OMPI_COMM_WORLD_RANK", nullptr);
    ScopedEnv r("SLURM_PROCID", "5");
    ScopedEnv w("SLURM_NTASKS", "8");
    ScopedEnv lr("SLURM_LOCALID", "1");
    ScopedEnv n("SLURM_NNODES", "4");
    ScopedEnv sn("SLURM_STEP_NUM_NODES", nullptr);
    expect_ranks_and_refusal("slurm", 5, 8, 1, "scontrol show hostnames");
    EXPECT_EQ(colossalai::utils::read_dist_env().num_nodes, 4);
  }
}

TEST(LaunchFromEnv, RestartCountAndAgentStoreFromTorchrunsVariables) {
  {
    ScopedEnv count("TORCHELASTIC_RESTART_COUNT", nullptr);
    EXPECT_EQ(colossalai::restart_count(), 0);
  }
  {
    ScopedEnv count("TORCHELASTIC_RESTART_COUNT", "3");
    EXPECT_EQ(colossalai::restart_count(), 3);
  }
  {
    ScopedEnv count("TORCHELASTIC_RESTART_COUNT", "three");
    const auto msg =
        colossalai::testing::error_of([] { colossalai::restart_count(); });
    EXPECT_NE(msg.find("TORCHELASTIC_RESTART_COUNT='three'"), std::string::npos)
        << msg;
  }
  ScopedEnv addr("MASTER_ADDR", "127.0.0.1");
  ScopedEnv port("MASTER_PORT", "1234");
  using colossalai::utils::agent_store_serves;
  {
    ScopedEnv agent("TORCHELASTIC_USE_AGENT_STORE", "True");
    EXPECT_TRUE(agent_store_serves("127.0.0.1", 1234));
    // Only at the address the agent exported, as torch.distributed checks.
    EXPECT_FALSE(agent_store_serves("localhost", 1234));
    EXPECT_FALSE(agent_store_serves("127.0.0.1", 1235));
  }
  {
    ScopedEnv agent("TORCHELASTIC_USE_AGENT_STORE", "False");
    EXPECT_FALSE(agent_store_serves("127.0.0.1", 1234));
  }
}

// torch's own TCPStore server (the pinned torch's, as torchrun's agent
// serves it) at MASTER_ADDR:MASTER_PORT: our client speaks its protocol, keys
// included (Python reads what C++ wrote), and rank 0 joins it only when
// TORCHELASTIC_USE_AGENT_STORE says the agent serves it, else binds the port
// and fails as it did under torchrun.
TEST(LaunchFromEnv, JoinsTorchsStoreAsTorchrunsWorkersDo) {
  const std::string python = COLOSSALAI_TEST_HF_PYTHON;
  if (::access(python.c_str(), X_OK) != 0) {
    GTEST_SKIP() << "no " << python
                 << " (./scripts/setup.sh --tests installs the pinned torch)";
  }
  TempDir dir;
  const fs::path script = dir.path() / "agent.py";
  std::ofstream(script)
      << "import sys, datetime\n"
         "from torch.distributed import TCPStore\n"
         "s = TCPStore('127.0.0.1', int(sys.argv[1]), None, True,\n"
         "             timeout=datetime.timedelta(seconds=120),\n"
         "             wait_for_workers=False)\n"
         "s.set('from_python', 'hello')\n"
         "s.wait(['stop'])\n"
         "print('from_cpp=' + s.get('from_cpp').decode(), flush=True)\n";
  const int port = colossalai::testing::free_port();
  FILE* agent = ::popen(
      (python + " " + script.string() + " " + std::to_string(port) + " 2>&1")
          .c_str(),
      "r");
  ASSERT_NE(agent, nullptr);
  using Client = colossalai::distributed::detail::TcpStoreClient;
  std::unique_ptr<Client> client;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
  while (!client && std::chrono::steady_clock::now() < deadline) {
    try {
      client = std::make_unique<Client>(
          "127.0.0.1", port, std::chrono::seconds(30));
    } catch (const c10::Error&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  ASSERT_TRUE(client) << "torch's TCPStore did not start";
  auto bytes = [](const std::string& s) {
    return std::vector<uint8_t>(s.begin(), s.end());
  };
  EXPECT_EQ(client->get("from_python"), bytes("hello"));
  client->set("from_cpp", bytes("world"));
  EXPECT_EQ(client->add("n", 2), 2);
  EXPECT_EQ(client->add("n", 3), 5);
  EXPECT_TRUE(client->check({"n", "from_python"}));
  EXPECT_FALSE(client->check({"n", "missing"}));
  EXPECT_EQ(client->compareSet("cs", {}, bytes("a")), bytes("a"));
  EXPECT_EQ(client->compareSet("cs", bytes("a"), bytes("b")), bytes("b"));
  EXPECT_EQ(client->compareSet("cs", bytes("x"), bytes("c")), bytes("b"));
  const auto msg = colossalai::testing::error_of(
      [&] { client->wait({"never"}, std::chrono::milliseconds(200)); });
  EXPECT_NE(msg.find("waiting for keys [never]"), std::string::npos) << msg;
  // init/ (our connect counted us, as Python's workers count themselves)
  // and four keys: the connection is still in step after the cancel.
  EXPECT_EQ(client->getNumKeys(), 5);
  EXPECT_TRUE(client->deleteKey("cs"));
  EXPECT_FALSE(client->deleteKey("cs"));

  ScopedEnv rank("RANK", "0");
  ScopedEnv world("WORLD_SIZE", "1");
  ScopedEnv addr("MASTER_ADDR", "127.0.0.1");
  ScopedEnv master_port("MASTER_PORT", std::to_string(port).c_str());
  const auto options = colossalai::LaunchOptions().backend("gloo").timeout(
      std::chrono::seconds(20));
  {
    ScopedEnv no_agent("TORCHELASTIC_USE_AGENT_STORE", nullptr);
    const auto refused = colossalai::testing::error_of(
        [&] { colossalai::launch_from_env(options); });
    EXPECT_NE(
        refused.find("cannot start the rendezvous store"), std::string::npos)
        << refused;
  }
  {
    ScopedEnv use_agent("TORCHELASTIC_USE_AGENT_STORE", "True");
    colossalai::launch_from_env(options);
    auto t = torch::ones({1});
    colossalai::distributed::all_reduce(
        t, *colossalai::distributed::world_group())
        .wait();
    EXPECT_EQ(t.item<float>(), 1.0f);
    colossalai::destroy();
  }

  client->set("stop", bytes("1"));
  std::string output;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), agent)) > 0) {
    output.append(buf, n);
  }
  EXPECT_EQ(::pclose(agent), 0) << output;
  EXPECT_NE(output.find("from_cpp=world"), std::string::npos) << output;
}

TEST(Record, WritesTorchsErrorFileAndReturnsOne) {
  TempDir dir;
  const fs::path file = dir.path() / "error.json";
  ScopedEnv error_file("TORCHELASTIC_ERROR_FILE", file.c_str());
  EXPECT_EQ(colossalai::record([] { return 7; }), 7);
  EXPECT_FALSE(fs::exists(file));

  const auto before = std::time(nullptr);
  {
    TempDir quiet;
    CaptureFd err(2, quiet.path() / "stderr");
    EXPECT_EQ(colossalai::record([]() -> int {
                TORCH_CHECK(false, "bad option 'x'");
                return 0;
              }),
              1);
  }
  const auto data = nlohmann::json::parse(read_file(file));
  const auto& message = data.at("message");
  EXPECT_EQ(message.at("message"), "c10::Error: bad option 'x'");
  const std::string callstack = message.at("extraInfo").at("py_callstack");
  EXPECT_EQ(callstack.rfind("c10::Error: bad option 'x'", 0), 0) << callstack;
  const std::string timestamp = message.at("extraInfo").at("timestamp");
  EXPECT_GE(std::stoll(timestamp), before);
  EXPECT_LE(std::stoll(timestamp), std::time(nullptr));

  {
    TempDir quiet;
    CaptureFd err(2, quiet.path() / "stderr");
    EXPECT_EQ(colossalai::record([]() -> int {
                throw std::out_of_range("index 9");
              }),
              1);
    EXPECT_NE(
        read_file(quiet.path() / "stderr").find("std::out_of_range: index 9"),
        std::string::npos);
  }
  EXPECT_EQ(
      nlohmann::json::parse(read_file(file))["message"]["message"],
      "std::out_of_range: index 9");

  // torch's own reader takes it as a worker's error.
  const std::string python = COLOSSALAI_TEST_HF_PYTHON;
  if (::access(python.c_str(), X_OK) == 0) {
    const auto [rc, out] = colossalai::testing::run_shell(
        python +
        " -c 'import sys; from torch.distributed.elastic.multiprocessing."
        "errors import ProcessFailure; f = ProcessFailure(local_rank=0, "
        "pid=1, exitcode=1, error_file=sys.argv[1]); "
        "print(f.message[\"message\"], f.timestamp > 0)' " +
        file.string());
    EXPECT_EQ(rc, 0) << out;
    EXPECT_NE(out.find("std::out_of_range: index 9 True"), std::string::npos)
        << out;
  }

  // Without torchrun's variable: nothing written, still 1.
  fs::remove(file);
  ScopedEnv no_file("TORCHELASTIC_ERROR_FILE", nullptr);
  TempDir quiet;
  CaptureFd err(2, quiet.path() / "stderr");
  EXPECT_EQ(colossalai::record([]() -> int { throw 3; }), 1);
  EXPECT_FALSE(fs::exists(file));
}

namespace {

// Whether `pid` is gone (or a zombie nobody reaped yet).
bool gone(pid_t pid) {
  if (::kill(pid, 0) != 0) {
    return true;
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), {});
  const auto close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() &&
      text[close + 2] == 'Z';
}

} // namespace

// The launcher killed with SIGKILL: its ranks stop at once (the kernel's
// SIGTERM on their parent's death), and ranks that called colossalai::launch
// say so on the launcher's stderr.
TEST(LauncherRun, RanksDoNotOutliveAKilledLauncher) {
  TempDir dir;
  const auto d = dir.path().string();
  const std::string cli = COLOSSALAI_CLI;
  const auto started = colossalai::testing::run_shell(
      "COLOSSALAI_TEST_LAUNCHER=colossalai COLOSSALAI_TEST_LAUNCHED=sleep "
      "COLOSSALAI_TEST_DIR='" + d + "' OMP_NUM_THREADS=1 '" + cli +
      "' run --nproc_per_node 2 --master_port " +
      std::to_string(colossalai::testing::free_port()) + " " + self_exe() +
      " --gtest_filter=LaunchedRank.Body > '" + d + "/console' 2>&1 & echo $!");
  ASSERT_EQ(started.first, 0) << started.second;
  const pid_t launcher = std::stoi(started.second);
  // Each rank's pid, once its file holds a whole line.
  auto pid_of = [&](int r) -> pid_t {
    const auto text = read_file(dir.path() / ("pid_" + std::to_string(r)));
    return text.empty() || text.back() != '\n' ? -1 : std::stoi(text);
  };
  auto start = std::chrono::steady_clock::now();
  while (seconds_since(start) < 60.0 && (pid_of(0) < 0 || pid_of(1) < 0)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const pid_t ranks[] = {pid_of(0), pid_of(1)};
  ASSERT_GT(ranks[0], 0);
  ASSERT_GT(ranks[1], 0);
  ASSERT_EQ(::kill(launcher, SIGKILL), 0);
  const auto killed = std::chrono::steady_clock::now();
  while (seconds_since(killed) < 10.0 && !(gone(ranks[0]) && gone(ranks[1]))) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const double took = seconds_since(killed);
  EXPECT_TRUE(gone(ranks[0]) && gone(ranks[1])) << "ranks outlived the launcher";
  EXPECT_LT(took, 5.0);
  std::cout << "ranks gone " << took << " s after the launcher's SIGKILL\n";
  const auto console = read_file(dir.path() / "console");
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(
        console.find("rank " + std::to_string(r) + ": the launcher (pid " +
                     std::to_string(launcher) + ") is gone"),
        std::string::npos)
        << console;
  }
}
