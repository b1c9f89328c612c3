// examples/finetune_lm end to end (ctest label `example`): short runs on 2
// ranks under HybridParallel tp 2 (through `colossalai run`) and ZeRO-2
// whose loss falls and which write their plot and a model transformers
// reads; a LLaMA directory whose only tokenizer is a SentencePiece
// tokenizer.model, and a Qwen 2 directory (NFC, its split regex), fine-tune
// and save a tokenizer transformers reads with the same ids; a run resumed
// from its checkpoint (full or LoRA) equals the straight run; a killed rank
// restarts and a SIGTERM saves on the way out; bad options are named.

#include <harness/multiprocess.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

#ifdef COLOSSALAI_FINETUNE_LM

const char* const kBin = COLOSSALAI_FINETUNE_LM;
const char* const kCli = COLOSSALAI_CLI;

// One of Debian's fortune files (./scripts/setup.sh installs them): a real
// text, small enough for a few seconds of training.
std::string corpus() {
  const std::string f = "/usr/share/games/fortunes/computers";
  return fs::exists(f) ? f : "";
}

struct Scratch : colossalai::testing::ScratchDir {
  Scratch() : ScratchDir("finetune") {}
};

// The losses.csv a run wrote: (step, loss) rows.
std::vector<std::pair<int, double>> losses(const std::string& out) {
  std::ifstream in(out + "/losses.csv");
  std::string line;
  std::getline(in, line); // header
  std::vector<std::pair<int, double>> rows;
  while (std::getline(in, line)) {
    std::istringstream s(line);
    int step = 0;
    double loss = 0;
    char comma = 0;
    s >> step >> comma >> loss;
    rows.emplace_back(step, loss);
  }
  return rows;
}

double mean(
    const std::vector<std::pair<int, double>>& v,
    size_t from,
    size_t to) {
  double s = 0;
  for (size_t i = from; i < to; ++i) {
    s += v[i].second;
  }
  return s / static_cast<double>(to - from);
}

std::pair<int, std::string> run(const std::string& args) {
  return colossalai::testing::run_shell(
      std::string(kBin) + " --data '" + corpus() + "' " + args + " 2>&1");
}

// The loss of the last 5 of 30 steps is clearly below the first 5's: a
// model that learns nothing stays near ln(512) = 6.24 (steps differ by
// about 0.1), one that learns drops by about 0.6 here; the plot is
// a PNG; the saved directory has its config, weights and tokenizer.
void expect_trains(
    const std::pair<int, std::string>& r,
    const std::string& out) {
  ASSERT_EQ(r.first, 0) << r.second;
  const auto l = losses(out);
  ASSERT_EQ(l.size(), 30u) << r.second;
  EXPECT_LT(mean(l, 25, 30), mean(l, 0, 5) - 0.3) << r.second;
  std::ifstream png(out + "/loss.png", std::ios::binary);
  char sig[8] = {};
  png.read(sig, 8);
  EXPECT_EQ(std::string(sig + 1, 3), "PNG");
  EXPECT_TRUE(fs::exists(out + "/model/config.json"));
  EXPECT_TRUE(
      fs::exists(out + "/model/model.safetensors.index.json") ||
      fs::exists(out + "/model/model.safetensors"));
  EXPECT_TRUE(
      fs::exists(out + "/model/vocab.json") ||
      fs::exists(out + "/model/tokenizer.json"));
  EXPECT_NE(r.second.find("samples of"), std::string::npos) << r.second;
}

const char* const kSmall =
    " --steps 30 --seq-len 32 --batch-size 8 --vocab-size 512 --lr 3e-3"
    " --warmup 3 --samples 1 ";

TEST(FinetuneLm, HybridTp2ThroughTheLauncherLossFalls) {
  if (corpus().empty()) {
    GTEST_SKIP() << "Debian's fortunes are absent: ./scripts/setup.sh";
  }
  Scratch dir;
  const auto r = colossalai::testing::run_shell(
      std::string(kCli) +
      // A free port: 29500, the launcher's default, may be another test's.
      " run --nproc_per_node 2 --master_port " +
      std::to_string(colossalai::testing::free_port()) + " " + kBin +
      " --data '" + corpus() + "' --plugin hybrid --tp 2" + kSmall + "--out " +
      dir.path + "/out --checkpoint " + dir.path + "/ckpt 2>&1");
  expect_trains(r, dir.path + "/out");
  // transformers reads what the boosted run saved: weights, config,
  // tokenizer; its loss on a training sequence is near the run's last.
  const auto py = colossalai::testing::run_shell(
      std::string(COLOSSALAI_TEST_HF_PYTHON) +
      " -c \"import sys; from transformers import AutoModelForCausalLM, "
      "AutoTokenizer; d = sys.argv[1]; m = AutoModelForCausalLM."
      "from_pretrained(d); t = AutoTokenizer.from_pretrained(d); "
      "ids = t(open(sys.argv[2]).read()[:4000], return_tensors='pt')"
      ".input_ids[:, :33]; print(float(m(input_ids=ids, labels=ids).loss))\" '" +
      dir.path + "/out/model' '" + corpus() + "' 2>&1");
  ASSERT_EQ(py.first, 0) << py.second;
  const double loss = std::stod(
      py.second.substr(py.second.rfind('\n', py.second.size() - 2) + 1));
  EXPECT_LT(loss, std::log(512.0)) << py.second;
}

TEST(FinetuneLm, Zero2LossFallsAndResumeEqualsTheStraightRun) {
  if (corpus().empty()) {
    GTEST_SKIP() << "Debian's fortunes are absent: ./scripts/setup.sh";
  }
  Scratch dir;
  const std::string common = std::string(" --nproc 2 --plugin zero2") + kSmall +
      "--config llama-tiny ";
  const auto straight =
      run(common + "--out " + dir.path + "/a --checkpoint " + dir.path + "/ca");
  expect_trains(straight, dir.path + "/a");
  // 12 steps with a checkpoint at 12, then the rest from it.
  const auto part =
      run(" --nproc 2 --plugin zero2 --steps 30 --seq-len 32 --batch-size 8 "
          "--vocab-size 512 --lr 3e-3 --warmup 3 --samples 0 --config "
          "llama-tiny --save-every 12 --out " +
          dir.path + "/b --checkpoint " + dir.path + "/cb --stop-after 12");
  ASSERT_EQ(part.first, 0) << part.second;
  const auto resumed =
      run(common + "--resume --out " + dir.path + "/c --checkpoint " +
          dir.path + "/cb");
  ASSERT_EQ(resumed.first, 0) << resumed.second;
  const auto a = losses(dir.path + "/a"), c = losses(dir.path + "/c");
  ASSERT_EQ(c.size(), 18u) << resumed.second;
  // The same steps on the same data from the same saved state: the same
  // arithmetic, bit for bit.
  for (size_t i = 0; i < c.size(); ++i) {
    EXPECT_EQ(c[i].first, a[12 + i].first);
    EXPECT_EQ(c[i].second, a[12 + i].second) << "step " << c[i].first;
  }
}

// The 7B recipe's options on a tiny LLaMA: every layer recomputed in
// backward, the fp32 state of half of Gemini's chunk bytes (or all of
// ZeRO-2's) in host memory, HybridAdam stepping it there (Gemini's during
// the backward: --overlap-host-step); and Gemini's auto placement moving
// chunks into the device margin at the first step.
TEST(FinetuneLm, OffloadedStatesWithRecomputationLossFalls) {
  if (corpus().empty()) {
    GTEST_SKIP() << "Debian's fortunes are absent: ./scripts/setup.sh";
  }
  Scratch dir;
  int run_index = 0;
  for (const std::string plugin :
       {"gemini --offload-frac 0.5 --overlap-host-step", "zero2 --offload",
        "gemini --placement auto --gpu-margin 0.5"}) {
    SCOPED_TRACE(plugin);
    const std::string out = dir.path + "/" + std::to_string(run_index++);
    expect_trains(
        run(" --nproc 2 --config llama-tiny --grad-checkpoint --plugin " +
            plugin + kSmall + "--out " + out + " --checkpoint " + out + "_ckpt"),
        out);
  }
}

// A LoRA run resumed from its checkpoint (the adapters, the optimizer and
// the scheduler of checkpoint-6) equals the straight run from step 7 on.
// Under ZeRO-2 in bf16 the fp32 master weights must follow the adapters
// loaded; they once kept the fresh start's, and step 8's loss was 2.4e-2
// off (growing). They are the loaded bf16 adapters widened, as ColossalAI
// re-derives masters from the model it loads, so the resumed run differs
// from the straight one by the masters' rounding to bf16 (2^-9 relative):
// 3e-4 in the loss over these 6 steps; the bound 3e-3 is 10x that and 8x
// below the failure.
TEST(FinetuneLm, LoraResumeEqualsTheStraightRun) {
  if (corpus().empty()) {
    GTEST_SKIP() << "Debian's fortunes are absent: ./scripts/setup.sh";
  }
  for (const std::string plugin : {"none", "zero2 --precision bf16"}) {
    SCOPED_TRACE(plugin);
    Scratch dir;
    const std::string common = " --plugin " + plugin +
        " --nproc 1 --config llama-tiny --steps 12 --seq-len 32 "
        "--batch-size 8 --vocab-size 512 --lr 3e-3 --warmup 3 --samples 0 "
        "--lora 4 --save-every 6 ";
    const auto straight = run(
        common + "--out " + dir.path + "/a --checkpoint " + dir.path + "/ca");
    ASSERT_EQ(straight.first, 0) << straight.second;
    const auto part =
        run(common + "--stop-after 6 --out " + dir.path + "/b --checkpoint " +
            dir.path + "/cb");
    ASSERT_EQ(part.first, 0) << part.second;
    EXPECT_TRUE(fs::exists(dir.path + "/cb/checkpoint-6/adapter"));
    const auto resumed =
        run(common + "--resume --out " + dir.path + "/c --checkpoint " +
            dir.path + "/cb");
    ASSERT_EQ(resumed.first, 0) << resumed.second;
    EXPECT_NE(resumed.second.find("checkpoint-6'"), std::string::npos)
        << resumed.second;
    const auto a = losses(dir.path + "/a"), c = losses(dir.path + "/c");
    ASSERT_EQ(c.size(), 6u) << resumed.second;
    const double tol = plugin == "none" ? 0.0 : 3e-3;
    for (size_t i = 0; i < c.size(); ++i) {
      EXPECT_EQ(c[i].first, a[6 + i].first);
      EXPECT_NEAR(c[i].second, a[6 + i].second, tol) << "step " << c[i].first;
    }
  }
}

// A file's bytes ("" when it cannot be read).
std::string slurp(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// A shell command that writes the previous command's exit status to `file`
// whole: a waiter that polls for `file` must not read it between the shell's
// creating it and writing the number (that read gives no status at all).
std::string save_status(const std::string& file) {
  return "echo $? > '" + file + ".part' && mv '" + file + ".part' '" + file +
      "'";
}

// The process of a job started with COLOSSALAI_TEST_MARK=`mark` (which its
// launcher and ranks inherit) for which `is(environ, cmdline)` holds, or -1.
pid_t job_process(
    const std::string& mark,
    const std::function<bool(const std::string&, const std::string&)>& is) {
  const std::string tag = "COLOSSALAI_TEST_MARK=" + mark + '\0';
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string env = slurp(e.path() / "environ");
    const std::string cmd = slurp(e.path() / "cmdline");
    if (env.find(tag) != std::string::npos && is(env, cmd)) {
      return std::stoi(e.path().filename().string());
    }
  }
  return -1;
}

// A rank killed (SIGKILL) mid-run under `colossalai run --max_restarts 1`:
// the launcher restarts both ranks, --resume takes the newest complete
// checkpoint, the job completes, and every loss after the restart equals
// the uninterrupted run's for the same step, bit for bit. Then SIGTERM to
// the launcher: a checkpoint at the step reached, exit 0, and the same
// command line resumes from it to the same losses.
TEST(FinetuneLm, KilledRankRestartsAndSigtermSavesOnTheWayOut) {
  if (corpus().empty()) {
    GTEST_SKIP() << "Debian's fortunes are absent: ./scripts/setup.sh";
  }
  Scratch dir;
  const std::string common = std::string(" --plugin zero2") + kSmall +
      "--config llama-tiny --save-every 6 --keep-last 2 ";
  const auto straight =
      run(" --nproc 2" + common + "--out " + dir.path + "/a --checkpoint " +
          dir.path + "/ca");
  ASSERT_EQ(straight.first, 0) << straight.second;
  const auto want = losses(dir.path + "/a");
  ASSERT_EQ(want.size(), 30u);

  const std::string ckpt = dir.path + "/cb";
  const auto started = colossalai::testing::run_shell(
      "(COLOSSALAI_TEST_MARK='" + dir.path + "' '" + kCli +
      "' run --nproc_per_node 2 --max_restarts 1 --master_port " +
      std::to_string(colossalai::testing::free_port()) + " " + kBin +
      " --data '" + corpus() + "'" + common + "--resume --out " + dir.path +
      "/b --checkpoint " + ckpt + " > '" + dir.path +
      "/log' 2>&1; " + save_status(dir.path + "/rc") +
      ") > /dev/null 2>&1 & echo started");
  ASSERT_EQ(started.first, 0) << started.second;
  const auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t)
        .count();
  };
  auto t0 = std::chrono::steady_clock::now();
  while (since(t0) < 300 && !fs::exists(ckpt + "/checkpoint-12")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(fs::exists(ckpt + "/checkpoint-12"));
  // Rank 1 of this job.
  const pid_t victim =
      job_process(dir.path, [](const std::string& env, const std::string&) {
        return env.find(std::string("\0RANK=1\0", 8)) != std::string::npos;
      });
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  const auto killed = std::chrono::steady_clock::now();
  // Training again: once the restarted rank 0 has said which checkpoint it
  // resumed from, the first loss row past that step (the restart keeps the
  // rows up to it and writes the rest).
  const std::string resumed_from = "resumed from '" + ckpt + "/checkpoint-";
  double back = -1;
  int resumed_at = -1;
  while (since(killed) < 300 && !fs::exists(dir.path + "/rc")) {
    if (resumed_at < 0) {
      const std::string text = slurp(dir.path + "/log");
      const auto at = text.find(resumed_from);
      if (at != std::string::npos) {
        resumed_at = std::atoi(text.c_str() + at + resumed_from.size());
      }
    }
    const auto l = losses(dir.path + "/b");
    if (back < 0 && resumed_at > 0 && !l.empty() &&
        l.back().first > resumed_at) {
      back = since(killed);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ifstream rc(dir.path + "/rc");
  int code = -1;
  rc >> code;
  const std::string log = slurp(dir.path + "/log");
  ASSERT_EQ(code, 0) << log;
  EXPECT_NE(
      log.find("restarting the local ranks (restart 1 of 1)"),
      std::string::npos)
      << log;
  EXPECT_NE(
      log.find("resumed from '" + ckpt + "/checkpoint-"), std::string::npos)
      << log;
  // The whole run's losses: those before the checkpoint from the first
  // attempt, the rest from the restart.
  const auto got = losses(dir.path + "/b");
  ASSERT_EQ(got.size(), 30u) << log;
  EXPECT_GE(resumed_at, 12) << log;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, static_cast<int>(i + 1)) << log;
    EXPECT_EQ(got[i].second, want[i].second) << "step " << got[i].first;
  }
  std::cout << "killed after checkpoint-12; training again (from step "
            << resumed_at << ") " << back << " s after the kill\n";

  // SIGTERM to the launcher (a pre-emption): the ranks finish their step,
  // save it and exit 0; the same command line then goes on from there.
  const std::string ck2 = dir.path + "/cc";
  const std::string job = "COLOSSALAI_TEST_MARK='" + dir.path + "/cc' '" +
      kCli + "' run --nproc_per_node 2 --master_port " +
      std::to_string(colossalai::testing::free_port()) + " " + kBin +
      " --data '" + corpus() + "'" + common + "--resume --out " + dir.path +
      "/c --checkpoint " + ck2 + " > '" + dir.path + "/log2' 2>&1";
  ASSERT_EQ(
      colossalai::testing::run_shell(
          "(" + job + "; " + save_status(dir.path + "/rc2") +
          ") > /dev/null 2>&1 &")
          .first,
      0);
  t0 = std::chrono::steady_clock::now();
  while (since(t0) < 300 && !fs::exists(ck2 + "/checkpoint-6")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const pid_t launcher = job_process(
      dir.path + "/cc", [](const std::string&, const std::string& cmd) {
        return cmd.rfind(std::string(kCli) + '\0', 0) == 0;
      });
  ASSERT_GT(launcher, 0);
  ASSERT_EQ(::kill(launcher, SIGTERM), 0);
  const auto termed = std::chrono::steady_clock::now();
  while (since(termed) < 120 && !fs::exists(dir.path + "/rc2")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double stop = since(termed);
  std::ifstream rc2(dir.path + "/rc2");
  code = -1;
  rc2 >> code;
  const std::string log2 = slurp(dir.path + "/log2");
  ASSERT_EQ(code, 0) << log2;
  const auto at = log2.find("SIGTERM: stopped after step ");
  ASSERT_NE(at, std::string::npos) << log2;
  const int stopped = std::stoi(log2.substr(at + 28));
  EXPECT_TRUE(fs::exists(ck2 + "/checkpoint-" + std::to_string(stopped)));
  EXPECT_LT(stop, 30.0) << log2;
  const auto again =
      colossalai::testing::run_shell(job + "; cat '" + dir.path + "/log2'");
  ASSERT_EQ(again.first, 0) << again.second;
  const auto rest = losses(dir.path + "/c");
  ASSERT_EQ(rest.size(), 30u) << again.second;
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].first, static_cast<int>(i + 1)) << again.second;
    EXPECT_EQ(rest[i].second, want[i].second) << "step " << rest[i].first;
  }
  std::cout << "SIGTERM after checkpoint-6: stopped after step " << stopped
            << ", saved, exited in " << stop << " s; resumed to step 30\n";
}

// The steps of every "resumed from '<ckpt>/checkpoint-N'" in `text`.
std::vector<int> resumed_steps(
    const std::string& text,
    const std::string& ckpt) {
  const std::string tag = "resumed from '" + ckpt + "/checkpoint-";
  std::vector<int> out;
  for (auto at = text.find(tag); at != std::string::npos;
       at = text.find(tag, at + 1)) {
    out.push_back(std::atoi(text.c_str() + at + tag.size()));
  }
  return out;
}

// `from`'s steps [first, last] are `want`'s, bit for bit.
void expect_same_losses(
    const std::vector<std::pair<int, double>>& got,
    const std::vector<std::pair<int, double>>& want,
    int first,
    int last,
    const std::string& what) {
  auto find = [](const std::vector<std::pair<int, double>>& v, int step) {
    for (const auto& row : v) {
      if (row.first == step) {
        return row.second;
      }
    }
    return std::nan("");
  };
  for (int step = first; step <= last; ++step) {
    EXPECT_EQ(find(got, step), find(want, step)) << what << ", step " << step;
  }
}

// NOTE [Elastic rendezvous] with real training: two nodes of one rank each
// (`colossalai run --nnodes 1:2`, on this host) fine-tune under ZeRO-2:
// a starts alone, b joins. Node b dies whole (launcher and rank, SIGKILL): node
// a's rank fails, a restarts it, and the job goes on alone, from the newest
// checkpoint, at world size 1. Node b comes back: a stops its rank (SIGTERM: it
// saves on the way out), and the job re-forms at two nodes and completes. Each
// part equals a plain run resumed from the same checkpoint at the same size,
// bit for bit, and the saved model is that run's.
TEST(FinetuneLm, ElasticJobShrinksWhenANodeDiesAndGrowsWhenItReturns) {
  if (corpus().empty()) {
    GTEST_SKIP() << "Debian's fortunes are absent: ./scripts/setup.sh";
  }
  Scratch dir;
  const std::string d = dir.path, ckpt = d + "/ckpt";
  constexpr int kSteps = 240;
  const std::string train = " --data '" + corpus() +
      "' --plugin zero2 --steps " + std::to_string(kSteps) +
      " --seq-len 32 --batch-size 8 --vocab-size 512 --lr 3e-3 --warmup 3"
      " --samples 0 --config llama-tiny --save-every 10 --keep-last 1000 ";
  const std::string endpoint =
      "127.0.0.1:" + std::to_string(colossalai::testing::free_port());
  auto start = [&](const std::string& name) {
    const auto r = colossalai::testing::run_shell(
        "(COLOSSALAI_TEST_MARK='" + d + "/" + name + "' '" + kCli +
        "' run --nnodes 1:2 --nproc_per_node 1 --rdzv_endpoint " + endpoint +
        " --rdzv_conf last_call_timeout=1,join_timeout=120 --max_restarts 3 " +
        kBin + train + "--resume --out " + d + "/out --checkpoint " + ckpt +
        " > '" + d + "/" + name + ".log' 2>&1; " +
        save_status(d + "/" + name + ".rc") + ") > /dev/null 2>&1 &");
    ASSERT_EQ(r.first, 0) << r.second;
  };
  const auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t)
        .count();
  };
  auto wait_for = [&](const std::function<bool()>& done, double seconds) {
    const auto t = std::chrono::steady_clock::now();
    while (!done() && since(t) < seconds) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return done();
  };
  auto newest = [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(ckpt)) {
      const auto name = e.path().filename().string();
      if (name.rfind("checkpoint-", 0) == 0) {
        n = std::max(n, std::atoi(name.c_str() + 11));
      }
    }
    return n;
  };
  auto two_nodes = [&](const std::string& log) {
    return slurp(d + "/" + log + ".log").find("2 node(s)") != std::string::npos;
  };
  // Node a first: it serves the rendezvous store (the endpoint's host must
  // outlive the job) and starts alone; b's arrival re-forms the job.
  start("a");
  ASSERT_TRUE(wait_for(
      [&] {
        return slurp(d + "/a.log").find("rendezvous round 0") !=
            std::string::npos;
      },
      120))
      << slurp(d + "/a.log");
  start("b");
  // Training on both nodes, with checkpoint-20 written.
  ASSERT_TRUE(wait_for(
      [&] { return two_nodes("a") && fs::exists(ckpt + "/checkpoint-20"); },
      300))
      << slurp(d + "/a.log") << slurp(d + "/b.log");

  // Node b dies whole: its launcher stopped first, so it restarts nothing.
  const auto mark = d + "/b";
  const pid_t b_launcher =
      job_process(mark, [](const std::string&, const std::string& cmd) {
        return cmd.rfind(std::string(kCli) + '\0', 0) == 0;
      });
  const pid_t b_rank =
      job_process(mark, [](const std::string& env, const std::string&) {
        return env.find(std::string("\0RANK=", 6)) != std::string::npos;
      });
  ASSERT_GT(b_launcher, 0);
  ASSERT_GT(b_rank, 0);
  const size_t resumes_before = resumed_steps(slurp(d + "/a.log"), ckpt).size();
  ::kill(b_launcher, SIGSTOP);
  ::kill(b_rank, SIGKILL);
  ::kill(b_launcher, SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  const int at_kill = newest();
  // Training again: a's rank 0 says where it resumed, then the step after.
  int k1 = -1;
  ASSERT_TRUE(wait_for(
      [&] {
        const auto text = slurp(d + "/a.log");
        const auto steps = resumed_steps(text, ckpt);
        if (steps.size() <= resumes_before) {
          return false;
        }
        k1 = steps.back();
        const auto from = text.rfind("resumed from '" + ckpt);
        return text.find("step " + std::to_string(k1 + 1) + "/", from) !=
            std::string::npos;
      },
      300))
      << slurp(d + "/a.log");
  const double back = since(killed);
  // Training again, alone: a checkpoint of world size 1 past the kill.
  ASSERT_TRUE(wait_for(
      [&] {
        return slurp(d + "/a.log").find("1 node(s)") != std::string::npos &&
            newest() >= at_kill + 20;
      },
      300))
      << slurp(d + "/a.log");
  EXPECT_EQ(resumed_steps(slurp(d + "/a.log"), ckpt).back(), k1);

  // Node b returns; the job grows back to two nodes and completes.
  start("b2");
  const auto returned = std::chrono::steady_clock::now();
  ASSERT_TRUE(wait_for([&] { return two_nodes("b2"); }, 120))
      << slurp(d + "/b2.log");
  const double grow = since(returned);
  ASSERT_TRUE(wait_for(
      [&] { return fs::exists(d + "/a.rc") && fs::exists(d + "/b2.rc"); },
      600));
  const std::string logs = slurp(d + "/a.log") + slurp(d + "/b2.log");
  EXPECT_EQ(std::atoi(slurp(d + "/a.rc").c_str()), 0) << logs;
  EXPECT_EQ(std::atoi(slurp(d + "/b2.rc").c_str()), 0) << logs;
  auto resumes = resumed_steps(logs, ckpt);
  ASSERT_FALSE(resumes.empty()) << logs;
  const int k2 = *std::max_element(resumes.begin(), resumes.end());
  ASSERT_GT(k2, k1) << logs;
  const auto got = losses(d + "/out");
  ASSERT_EQ(got.size(), static_cast<size_t>(kSteps)) << logs;

  // The references: plain runs resumed from copies of those checkpoints.
  auto reference =
      [&](int from, int nproc, int stop_after, const std::string& name) {
        const std::string ref = d + "/" + name;
        fs::create_directories(ref + "/ckpt");
        fs::copy(
            ckpt + "/checkpoint-" + std::to_string(from),
            ref + "/ckpt/checkpoint-" + std::to_string(from),
            fs::copy_options::recursive);
        const auto r =
            run(" --nproc " + std::to_string(nproc) +
                train.substr(train.find(" --plugin")) +
                "--resume --stop-after " + std::to_string(stop_after) +
                " --out " + ref + "/out --checkpoint " + ref + "/ckpt");
        EXPECT_EQ(r.first, 0) << r.second;
        return losses(ref + "/out");
      };
  expect_same_losses(
      got, reference(k1, 1, k2, "ref1"), k1 + 1, k2, "world size 1");
  expect_same_losses(
      got, reference(k2, 2, kSteps, "ref2"), k2 + 1, kSteps, "world size 2");
  for (const auto& e : fs::directory_iterator(d + "/out/model")) {
    if (e.path().extension() == ".safetensors") {
      EXPECT_EQ(
          slurp(e.path().string()),
          slurp(d + "/ref2/out/model/" + e.path().filename().string()))
          << e.path().filename() << " differs from the reference run's";
    }
  }
  for (const auto& name : fs::directory_iterator(ckpt)) {
    EXPECT_NE(name.path().filename().string()[0], '.')
        << name.path() << " left behind";
  }
  std::cout << "node b killed at checkpoint-" << at_kill
            << ": training again alone from checkpoint-" << k1 << " " << back
            << " s after the kill; b back: two nodes again " << grow
            << " s after it started, from checkpoint-" << k2 << "\n";
}

// A transformers model and tokenizer directory tokenizer_reference.py's
// `maker` ("llama-dir", "qwen2-dir") writes in `path`, its tokenizer
// trained on the corpus.
void make_transformers_dir(const std::string& maker, const std::string& path) {
  const std::string script =
      (fs::path(__FILE__).parent_path() / "python" / "tokenizer_reference.py")
          .string();
  const auto made = colossalai::testing::run_shell(
      std::string(COLOSSALAI_TEST_HF_PYTHON) + " '" + script + "' " + maker +
      " '" + path + "' '" + corpus() + "' 2>&1");
  ASSERT_EQ(made.first, 0) << made.second;
}

// A directory tokenizer_reference.py's `maker` writes (a transformers
// model and tokenizer) fine-tuned with `args`: it trains, and transformers
// reads the saved model's tokenizer with the source's ids for the corpus
// (`first` the first id, -1: any).
void expect_transformers_dir_trains(
    const std::string& maker,
    const std::string& args,
    const std::string& tokenizer_file,
    int first) {
  if (corpus().empty()) {
    GTEST_SKIP() << "Debian's fortunes are absent: ./scripts/setup.sh";
  }
  Scratch dir;
  const std::string py = COLOSSALAI_TEST_HF_PYTHON;
  make_transformers_dir(maker, dir.path + "/src");
  const auto r =
      run(args + kSmall + "--model '" + dir.path + "/src' --out " + dir.path +
          "/out --checkpoint " + dir.path + "/ckpt");
  expect_trains(r, dir.path + "/out");
  EXPECT_TRUE(fs::exists(dir.path + "/out/model/" + tokenizer_file));
  const auto same = colossalai::testing::run_shell(
      py +
      " -c \"import sys; from transformers import AutoTokenizer; "
      "a = AutoTokenizer.from_pretrained(sys.argv[1]); "
      "b = AutoTokenizer.from_pretrained(sys.argv[2]); "
      "text = open(sys.argv[3]).read()[:20000] + ' Cafe\u0301'; "
      "x, y = a(text).input_ids, b(text).input_ids; first = int(sys.argv[4]); "
      "print(len(x), x[:3]); "
      "sys.exit(0 if x == y and first in (-1, x[0]) else 1)\" '" +
      dir.path + "/src' '" + dir.path + "/out/model' '" + corpus() + "' " +
      std::to_string(first) + " 2>&1");
  EXPECT_EQ(same.first, 0) << same.second;
}

// A LLaMA directory whose tokenizer is a SentencePiece tokenizer.model only
// (as many LLaMA / Mistral checkpoints), under ZeRO-2: bos first.
TEST(FinetuneLm, SentencePieceLlamaDirectoryTrains) {
  expect_transformers_dir_trains(
      "llama-dir", " --nproc 2 --plugin zero2", "tokenizer.model", 1);
}

// A Qwen 2 directory (tokenizer.json with NFC and Qwen 2's split regex,
// tied embeddings) under HybridParallel tp 2.
TEST(FinetuneLm, Qwen2DirectoryTrainsWithTensorParallelism) {
  expect_transformers_dir_trains(
      "qwen2-dir", " --nproc 2 --plugin hybrid --tp 2", "tokenizer.json", -1);
}

// Supervised fine-tuning on a Qwen 2 directory given a ChatML template:
// JSON lines in both layouts, the loss on the answers only, a held-out
// split evaluated and plotted; bad lines are named by number.
TEST(FinetuneLm, ChatDataFineTunesWithTheTemplateAndEvaluates) {
  if (corpus().empty()) {
    GTEST_SKIP() << "Debian's fortunes are absent: ./scripts/setup.sh";
  }
  Scratch dir;
  make_transformers_dir("qwen2-dir", dir.path + "/src");
  std::ofstream(dir.path + "/src/chat_template.jinja")
      << "{% for message in messages %}{{'<|im_start|>' + message['role'] + "
         "'\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{% endif %}";
  const char* const colours[] = {"red", "green", "blue", "white"};
  {
    std::ofstream data(dir.path + "/chat.jsonl");
    for (int i = 0; i < 64; ++i) {
      const std::string c = colours[i % 4];
      if (i % 2 == 0) {
        data << "{\"messages\": [{\"role\": \"user\", \"content\": "
                "\"Name a colour like "
             << c << ".\"}, {\"role\": \"assistant\", \"content\": \"" << c
             << " is a colour.\"}]}\n";
      } else {
        data << "{\"prompt\": \"Name a colour like " << c
             << ".\", \"response\": \"" << c << " is a colour.\"}\n\n";
      }
    }
  }
  const auto r = colossalai::testing::run_shell(
      std::string(kBin) + " --data '" + dir.path + "/chat.jsonl' --model '" +
      dir.path + "/src' --nproc 2 --plugin zero2 --eval-split 0.25 " +
      "--eval-every 10 --steps 30 --seq-len 96 --batch-size 8 --lr 3e-3 " +
      "--warmup 3 --samples 1 --temperature 0 --prompt 'Name a colour like red.' --out " +
      dir.path + "/out --checkpoint " + dir.path + "/ckpt 2>&1");
  expect_trains(r, dir.path + "/out");
  EXPECT_NE(
      r.second.find("supervised fine-tuning: 64 conversations (the model's "
                    "chat template)"),
      std::string::npos)
      << r.second;
  EXPECT_NE(
      r.second.find("evaluation: 16 held-out sequences in 2 batches"),
      std::string::npos)
      << r.second;
  EXPECT_NE(r.second.find("eval step 30: loss"), std::string::npos) << r.second;
  // The answer, generated greedily with the KV cache, has learned the
  // answers' shape. Not a near-tie that another CPU's summation order could
  // flip: every plugin (ddp, zero1/2, fsdp, gemini, tp, pp, sp, each
  // reducing in its own order) gives this answer after these 30 steps.
  EXPECT_NE(r.second.find("--- red is a colour."), std::string::npos)
      << r.second;
  std::ifstream eval(dir.path + "/out/eval.csv");
  std::string line;
  int rows = 0;
  while (std::getline(eval, line)) {
    ++rows;
  }
  EXPECT_EQ(rows, 4); // the header and steps 10, 20, 30
  EXPECT_TRUE(fs::exists(dir.path + "/out/model/chat_template.jinja"));

  // Packed: several conversations per sequence, attention inside each; in
  // a pipeline's micro-batches, evaluated by its forward-only schedule.
  const auto p = colossalai::testing::run_shell(
      std::string(kBin) + " --data '" + dir.path + "/chat.jsonl' --model '" +
      dir.path + "/src' --nproc 2 --plugin hybrid --pp 2 --packing " +
      "--eval-split 0.25 --eval-every 10 --steps 30 --seq-len 192 " +
      "--batch-size 4 --lr 3e-3 --warmup 3 --samples 1 --out " + dir.path +
      "/packed --checkpoint " + dir.path + "/ckpt_packed 2>&1");
  expect_trains(p, dir.path + "/packed");
  EXPECT_NE(p.second.find("eval step 30: loss"), std::string::npos) << p.second;
  // About 64 tokens each: two to a sequence of 193.
  EXPECT_NE(
      p.second.find("packed 64 conversations into 32 sequences"),
      std::string::npos)
      << p.second;

  // Bad lines: named by number, nothing trained.
  auto refused = [&](const std::string& lines,
                     const std::string& what,
                     const std::string& extra = "") {
    { std::ofstream(dir.path + "/bad.jsonl") << lines; }
    const auto b = colossalai::testing::run_shell(
        std::string(kBin) + " --data '" + dir.path + "/bad.jsonl' --model '" +
        dir.path + "/src' --nproc 1 --plugin none --steps 1 --seq-len 16 " +
        extra + " --out " + dir.path + "/bad 2>&1");
    EXPECT_NE(b.first, 0) << lines;
    EXPECT_NE(b.second.find(what), std::string::npos)
        << lines << "\ngot: " << b.second;
  };
  const std::string ok = "{\"prompt\": \"Hi\", \"response\": \"Hello\"}\n";
  refused(ok + "\n{\"messages\": [\n", "line 3: not JSON");
  refused(
      ok + "{\"text\": \"x\"}\n",
      "line 2: needs \"messages\", or \"prompt\" and \"response\"");
  refused(
      ok +
          "{\"messages\": [{\"role\": \"user\", \"content\": "
          "\"x\"}]}\n",
      "line 2: no \"assistant\" message");
  refused(
      ok + "{\"messages\": [{\"role\": \"user\"}]}\n",
      "line 2: missing \"content\"");
  refused(
      "{\"prompt\": \"" + std::string(400, 'x') + "\", \"response\": \"y\"}\n",
      "line 1: the conversation is");
  refused(
      "{\"prompt\": \"" + std::string(400, 'x') + "\", \"response\": \"y\"}\n",
      "line 1: no assistant token is left to train on after truncation",
      "--truncate");
}

TEST(FinetuneLm, BadOptionsAreNamed) {
  auto has = [](const std::string& args, const std::string& what) {
    const auto r = colossalai::testing::run_shell(
        std::string(kBin) + " " + args + " 2>&1");
    EXPECT_NE(r.first, 0) << args;
    EXPECT_NE(r.second.find(what), std::string::npos)
        << args << "\ngot: " << r.second;
  };
  has("--plugin ddp --tp 2", "need --plugin hybrid");
  has("--qlora", "give --lora R");
  has("--plugin gemini --lora 8", "--lora works with");
  has("--plugin hybrid --nproc 3 --tp 2", "not a multiple of tp x pp x sp");
  has("--plugin hybrid --sp-mode zigzag", "--sp-mode must be");
  has("--plugin hybrid --sp-mode ring", "give --tp > 1");
  has("--plugin hybrid --tp 2 --sp-overlap", "--sp-overlap needs");
  has("--plugin hybrid --sp 2 --inner-ring 2", "--inner-ring needs");
  has("--model /nonexistent", "has no config.json");
  has("--data /nonexistent/corpus.txt", "does not exist");
  has("--plugin none --nproc 2", "--plugin none trains in one process");
  has("--plugin tensor", "--plugin");
  has("--plugin ddp --offload", "--offload needs --plugin zero1, zero2 or gemini");
  has("--plugin gemini --offload-frac 1.5", "--offload-frac is gemini's static share");
  has("--plugin zero2 --overlap-host-step", "--overlap-host-step needs states in host memory");
  has("--plugin zero2 --placement auto", "--placement needs --plugin gemini");
  has("--plugin gemini --gpu-margin 0.5", "--gpu-margin is gemini's");
  has("--plugin none --nproc 1 --fp8-communication",
      "--fp8-communication needs a");
  has("--plugin ddp --use-fp8", "--use-fp8 needs --plugin zero1, zero2");
}

#else

TEST(FinetuneLm, NeedsTheExamples) {
  GTEST_SKIP() << "configured with COLOSSALAI_BUILD_EXAMPLES=OFF";
}

#endif

} // namespace
