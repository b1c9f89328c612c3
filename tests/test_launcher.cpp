#include <colossalai/launcher.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
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
  std::thread sender([&] {
    while (seconds_since(start) < 20.0 &&
           !(fs::exists(dir.path() / "started_0") &&
             fs::exists(dir.path() / "started_1"))) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ::kill(::getpid(), SIGTERM);
  });
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
