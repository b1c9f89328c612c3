// Pipeline parallelism in HybridParallelPlugin: the zoo's GPT-2 of
// gpt-small-cpu's width (vocab 4096, 128 positions, width 256, 4 heads) with
// 8 blocks, so that 4 stages x 2 chunks hold one block each; fp32 AdamW, 1
// thread per rank, pp_size = world size (tp 1, dp 1). Every (schedule,
// micro-batch count) lives in the same processes and their timed rounds
// alternate, as bench_hybrid_step alternates its setups.
//
// Per setup: step time (execute_pipeline + optimizer step, the slowest
// rank's, median over the timed steps); the bubble of each stage in the last
// timed step, 1 - busy / wall, where wall is execute_pipeline's time on that
// rank and busy is
//  - "span": the sum of the schedule's timeline spans (end - start) of this
//    stage's actions, as PipelineSchedule::timeline() records them. A span
//    includes the blocking receive of the action's input, so this counts
//    waiting for another stage as busy;
//  - "compute": the same spans with that receive wait cut off: a forward's
//    compute starts when the policy's stage_forward is entered, a backward's
//    when autograd reaches the chunk's output (a hook on it). The two clocks
//    are aligned through the forwards (see analyse()).
// Beside them the 1F1B formula (p - 1) / (m + p - 1) and the unit-cost bubble
// pipeline::simulate gives for each schedule (interleaved and ZB-V have no
// closed form). Peak activation memory per stage: the heap in use
// (compat::memory_allocated, mallinfo2), sampled after every chunk forward,
// every criterion and at the start of every backward, in one untimed step,
// minus the heap in use before that step (gradients kept allocated by
// zero_grad(false), so they are in the baseline). The last timed step's
// per-stage timelines (kind, chunk, micro-batch, start, end, compute start;
// one clock across ranks, steady_clock being system-wide) go to the JSON.
//
//   bench_pipeline_step [--nproc 4]
//                       [--schedules 1f1b,interleaved,zbv,zbv_costed]
//                       [--microbatches 4,8] [--microbatch-size 2]
//                       [--layers 8] [--warmup 1] [--steps 3] [--rounds 2]
//                       [--fp8 0,1] [--out FILE.json]
//
// zbv_costed: ZB-V generated for this machine's pass costs
// (pipeline::zero_bubble_v with ScheduleCosts, run as scheduler_nodes). The
// costs are the mean compute time of the forwards, input gradients and
// weight gradients of all stages in one step of the zbv setup of the same
// micro-batch count (run after the warm-up), in units of a quarter of the
// shortest; it needs zbv in --schedules.
//
// --fp8 0,1 runs each setup without and with fp8_communication (name
// suffix _fp8): the activations and gradients between stages on different
// nodes, and the tied embedding's gradients, travel as FP8 (across hosts,
// e.g. under bench/netns_link.sh).

#include "bench_launch.h"
#include "bench_util.h"

#include <colossalai/colossalai.h>
#include <colossalai/pipeline/schedule.h>
#include <colossalai/utils/compat.h>

#include <colossalai/models/gpt2.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
namespace cp = colossalai::pipeline;
namespace sf = colossalai::shardformer;
namespace models = colossalai::models;
using cb::plugin::HybridParallelPlugin;
using HPO = cb::plugin::HybridParallelPluginOptions;

namespace {

using colossalai::bench::split;

struct Options {
  int microbatch_size = 2, layers = 8, warmup = 1, steps = 3, rounds = 2;
  std::string schedules = "1f1b,interleaved,zbv", microbatches = "4,8", out;
  std::string fp8 = "0";
};

// Milliseconds on steady_clock (CLOCK_MONOTONIC: one clock for every process
// on the machine).
double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// CPU time of the calling thread (the engine computes on it), ms.
double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int64_t heap_in_use() {
  return colossalai::compat::memory_allocated(at::Device(at::kCPU));
}

// What the instrumented policy and criterion record during one step. The
// n-th stage_forward call is the n-th forward of the step's timeline (the
// engine calls it once per F action, in order).
struct Probe {
  bool sample_memory = false;
  int64_t heap_peak = 0;
  std::vector<double> fwd_call, fwd_ret;
  std::vector<std::vector<double>> backward_start; // per forward call

  void reset(bool memory) {
    sample_memory = memory;
    heap_peak = 0;
    fwd_call.clear();
    fwd_ret.clear();
    backward_start.clear();
  }
  void sample() {
    if (sample_memory) {
      heap_peak = std::max(heap_peak, heap_in_use());
    }
  }
};
Probe g_probe;

// GPT2Policy with clocks: when each chunk forward starts and ends, and when
// autograd reaches its output in each backward pass (BI and W both start
// there).
class TimedGPT2Policy : public models::GPT2Policy {
 public:
  std::string name() const override {
    return "TimedGPT2Policy";
  }
  at::Tensor stage_forward(
      torch::nn::Module& model,
      const sf::StageLayers& layers,
      const std::vector<at::Tensor>& micro_batch,
      const at::Tensor& hidden) const override {
    const size_t index = g_probe.fwd_call.size();
    g_probe.fwd_call.push_back(now_ms());
    at::Tensor out =
        models::GPT2Policy::stage_forward(model, layers, micro_batch, hidden);
    g_probe.fwd_ret.push_back(now_ms());
    g_probe.backward_start.emplace_back();
    if (out.requires_grad()) {
      out.register_hook([index](const at::Tensor&) {
        g_probe.backward_start[index].push_back(now_ms());
        g_probe.sample();
      });
    }
    g_probe.sample();
    return out;
  }
};

enum Kind { kF = 0, kB = 1, kBI = 2, kW = 3 };

int kind_of(cp::ActionKind k) {
  switch (k) {
    case cp::ActionKind::kForward:
      return kF;
    case cp::ActionKind::kBackward:
      return kB;
    case cp::ActionKind::kBackwardInput:
      return kBI;
    case cp::ActionKind::kBackwardWeight:
      return kW;
  }
  return -1;
}

// One stage's view of one step.
struct StageStep {
  double call = 0, ret = 0; // execute_pipeline, absolute ms
  double cpu = 0;           // this thread's CPU time in execute_pipeline, ms
  double busy_span = 0, busy_compute = 0;
  double align_gap = 0; // width of the clock-alignment bracket, ms
  int fallbacks = 0;    // backward actions with no hook time (span kept)
  // kind, chunk, micro-batch, start, end, compute start (absolute ms)
  std::vector<std::array<double, 6>> events;
};

// Aligns the timeline (ms from the engine's own start t0) with the probe's
// absolute clock: every forward returns before its span ends and is entered
// after its span starts, so t0 lies in [max(ret - end), min(call - start)].
// Then each action's compute start: a forward's entry; a backward that
// received its gradient from another stage: the hook on the chunk output
// (a BI on virtual stage 0 computes nothing, its input being token ids);
// anything else: its span start.
StageStep analyse(
    const cp::PipelineSchedule& schedule,
    const cp::PipelineStageManager& sm,
    double call,
    double ret) {
  StageStep st;
  st.call = call;
  st.ret = ret;
  const auto& tl = schedule.timeline();
  std::map<std::pair<int, int>, size_t> fwd_index;
  const double inf = std::numeric_limits<double>::infinity();
  double lo = call, hi = inf, hi_first = inf;
  size_t n = 0;
  for (const auto& e : tl) {
    if (e.action.kind != cp::ActionKind::kForward) {
      continue;
    }
    TORCH_CHECK(n < g_probe.fwd_call.size(), "more forwards than calls");
    fwd_index[{e.action.chunk, e.action.micro_batch}] = n;
    lo = std::max(lo, g_probe.fwd_ret[n] - e.end_ms);
    hi = std::min(hi, g_probe.fwd_call[n] - e.start_ms);
    if (sm.virtual_stage(e.action.chunk) == 0) {
      hi_first = std::min(hi_first, g_probe.fwd_call[n] - e.start_ms);
    }
    ++n;
  }
  TORCH_CHECK(n == g_probe.fwd_call.size(), "forward calls != F actions");
  // A forward of virtual stage 0 receives nothing: it is entered within
  // microseconds of its span's start, the tightest bound there is. Else the
  // latest lower bound (a send follows each forward inside its span).
  const double t0 = std::isfinite(hi_first) ? hi_first : std::min(lo, hi);
  st.align_gap = std::max(0.0, hi - lo);
  const int last_v = sm.num_virtual_stages() - 1;
  std::map<size_t, size_t> used; // hook times consumed per forward
  for (const auto& e : tl) {
    const auto& a = e.action;
    const int v = sm.virtual_stage(a.chunk);
    const size_t f = fwd_index.at({a.chunk, a.micro_batch});
    double compute = e.start_ms;
    if (a.kind == cp::ActionKind::kForward) {
      compute = g_probe.fwd_call[f] - t0;
    } else {
      const bool fires = !(a.kind == cp::ActionKind::kBackwardInput && v == 0);
      const bool receives =
          a.kind != cp::ActionKind::kBackwardWeight && v < last_v;
      const auto& times = g_probe.backward_start[f];
      double hook = std::numeric_limits<double>::quiet_NaN();
      if (fires) {
        size_t& u = used[f];
        if (u < times.size()) {
          hook = times[u++];
        }
      }
      if (receives) {
        if (!fires) {
          compute = e.end_ms; // only the wait
        } else if (!std::isnan(hook)) {
          compute = hook - t0;
        } else {
          ++st.fallbacks;
        }
      }
    }
    compute = std::min(std::max(compute, e.start_ms), e.end_ms);
    st.busy_span += e.end_ms - e.start_ms;
    st.busy_compute += e.end_ms - compute;
    st.events.push_back(
        {double(kind_of(a.kind)),
         double(a.chunk),
         double(a.micro_batch),
         t0 + e.start_ms,
         t0 + e.end_ms,
         t0 + compute});
  }
  return st;
}

struct Setup {
  std::string name, style;
  int chunks = 1, m = 0;
  bool fp8 = false; // fp8_communication
  std::shared_ptr<HybridParallelPlugin> plugin;
  std::unique_ptr<cb::Booster> booster;
  models::GPT2LMHeadModel model{nullptr};
  cb::Boosted<models::GPT2LMHeadModel, std::nullptr_t, std::nullptr_t> boosted;
  std::vector<double> ms; // this rank's step times
  int64_t activation = 0; // peak heap in use minus before, this rank
  StageStep last;
  std::string costs; // zbv_costed: the costs its schedule was made for
  cp::ScheduleCosts cost_model;
};

std::pair<at::Tensor, at::Tensor> global_batch(
    int step,
    int64_t batch,
    int64_t seq,
    int64_t vocab) {
  auto gen = at::detail::createCPUGenerator(900 + step);
  auto tokens = at::randint(vocab, {batch, seq + 1}, gen);
  return {
      tokens.narrow(1, 0, seq).contiguous(),
      tokens.narrow(1, 1, seq).contiguous()};
}

// Per-stage numbers, gathered to rank 0 (rows in rank order).
constexpr int kStageFields = 11;

std::string fmt(double v, int digits = 3) {
  std::ostringstream os;
  os.precision(digits);
  os << std::fixed << v;
  return os.str();
}

int run_rank(const Options& o) {
  colossalai::launch_from_env();
  at::set_num_threads(1);
  const int rank = cd::get_rank(), world = cd::get_world_size();
  const auto cfg = models::GPT2Config::small_cpu().n_layer(o.layers);
  const int64_t seq = cfg.n_positions(), vocab = cfg.vocab_size();

  std::vector<std::unique_ptr<Setup>> setups;
  auto make_setup = [&](const std::string& style,
                        const std::string& name,
                        int m,
                        bool fp8,
                        std::vector<std::vector<cp::Action>> nodes) {
    auto s = std::make_unique<Setup>();
    s->style = style;
    s->chunks = style == "1f1b" ? 1 : 2;
    s->m = m;
    s->name = name;
    s->fp8 = fp8;
    s->plugin = std::make_shared<HybridParallelPlugin>(
        HPO()
            .precision("fp32")
            .pp_size(world)
            .num_microbatches(m)
            .pp_style(style)
            .num_model_chunks(s->chunks)
            .fp8_communication(fp8)
            .scheduler_nodes(std::move(nodes))
            .custom_policy(std::make_shared<TimedGPT2Policy>()));
    s->booster =
        std::make_unique<cb::Booster>(cb::BoosterOptions().plugin(s->plugin));
    torch::manual_seed(0);
    s->model = models::GPT2LMHeadModel(cfg);
    auto opt = std::make_shared<torch::optim::AdamW>(
        s->model->parameters(),
        torch::optim::AdamWOptions(3e-4).weight_decay(0.01));
    s->boosted = s->booster->boost(s->model, opt);
    return s;
  };
  std::vector<std::pair<int, bool>> costed; // (m, fp8) of zbv_costed
  for (const auto& style : split(o.schedules)) {
    TORCH_CHECK(
        style == "1f1b" || style == "interleaved" || style == "zbv" ||
            style == "zbv_costed",
        "unknown schedule '",
        style,
        "' (1f1b, interleaved, zbv, zbv_costed)");
    for (const auto& ms : split(o.microbatches)) {
      for (const auto& f : split(o.fp8)) {
        const bool fp8 = f == "1";
        const int m = std::stoi(ms);
        if (style == "interleaved" && m % world != 0) {
          if (rank == 0)
            std::fprintf(
                stderr,
                "interleaved m=%d: m must be a multiple of %d stages\n",
                m,
                world);
          continue;
        }
        if (style == "zbv_costed") {
          costed.emplace_back(m, fp8);
          continue;
        }
        setups.push_back(make_setup(
            style,
            style + "_m" + std::to_string(m) + (fp8 ? "_fp8" : ""),
            m,
            fp8,
            {}));
      }
    }
  }
  TORCH_CHECK(!setups.empty(), "no setup fits ", world, " stages");

  // One step: execute_pipeline and the optimizer step, from a barrier.
  auto step = [&](Setup& s, int i, bool memory, bool keep) {
    const int64_t batch = int64_t(s.m) * o.microbatch_size;
    auto b = global_batch(i, batch, seq, vocab);
    s.boosted.optimizer->zero_grad(false); // gradients stay allocated
    g_probe.reset(memory);
    cd::barrier(*cd::world_group()).wait();
    const int64_t heap0 = memory ? heap_in_use() : 0;
    const double t0 = now_ms(), c0 = thread_cpu_ms();
    s.booster->execute_pipeline(
        [&] {
          return cp::Batch{b.first, b.second};
        },
        s.boosted.model,
        [&](const at::Tensor& logits, const cp::Batch& mb) {
          at::Tensor loss = s.model->loss(logits, mb[1]);
          g_probe.fwd_ret.back() = now_ms(); // the F span ends after this
          g_probe.sample();
          return loss;
        },
        s.boosted.optimizer.get());
    const double t1 = now_ms(), c1 = thread_cpu_ms();
    s.boosted.optimizer->step();
    const double t2 = now_ms();
    if (memory) {
      s.activation = g_probe.heap_peak - heap0;
    }
    if (keep) {
      s.last =
          analyse(*s.plugin->schedule(), *s.plugin->stage_manager(), t0, t1);
      s.last.cpu = c1 - c0;
    }
    return t2 - t0;
  };

  int counter = 0;
  for (auto& s : setups) {
    for (int i = 0; i < o.warmup; ++i)
      step(*s, counter++, false, false); // creates the optimizer states
    step(*s, counter++, true, false);    // memory, untimed
  }
  // zbv_costed: one analysed step of the zbv setup of the same m, its mean
  // compute time per pass kind over all stages, then ZB-V for those costs.
  for (const auto& [m, fp8] : costed) {
    Setup* zbv = nullptr;
    for (auto& s : setups)
      if (s->style == "zbv" && s->m == m && s->fp8 == fp8)
        zbv = s.get();
    TORCH_CHECK(
        zbv != nullptr, "zbv_costed needs zbv in --schedules (m ", m, ")");
    step(*zbv, counter++, false, true);
    at::Tensor sums = at::zeros({6}, at::kDouble); // F, BI, W: time, count
    for (const auto& e : zbv->last.events) {
      const int k = int(e[0]) == kF ? 0 : int(e[0]) == kBI ? 1 : 2;
      const double ms = e[4] - e[5];
      if (int(e[0]) != kB && ms > 0) { // a BI of stage 0 computes nothing
        sums[2 * k] += ms;
        sums[2 * k + 1] += 1;
      }
    }
    cd::all_reduce(sums, *cd::world_group()).wait();
    double mean[3];
    for (int k = 0; k < 3; ++k)
      mean[k] = sums[2 * k].item<double>() /
          std::max(1.0, sums[2 * k + 1].item<double>());
    const double unit = *std::min_element(mean, mean + 3) / 4;
    auto units = [&](double ms) {
      return std::max<int64_t>(1, std::llround(ms / unit));
    };
    const auto costs = cp::ScheduleCosts()
                           .forward(units(mean[0]))
                           .backward_input(units(mean[1]))
                           .backward_weight(units(mean[2]));
    auto s = make_setup(
        "zbv",
        "zbv_costed_m" + std::to_string(m) + (fp8 ? "_fp8" : ""),
        m,
        fp8,
        cp::zero_bubble_v(world, m, costs));
    std::ostringstream c;
    c << "F " << costs.forward() << " : BI " << costs.backward_input()
      << " : W " << costs.backward_weight() << " (F " << fmt(mean[0], 2)
      << " ms, BI " << fmt(mean[1], 2) << " ms, W " << fmt(mean[2], 2)
      << " ms)";
    s->costs = c.str();
    s->cost_model = costs;
    for (int i = 0; i < o.warmup; ++i)
      step(*s, counter++, false, false);
    step(*s, counter++, true, false);
    setups.push_back(std::move(s));
  }
  if (rank == 0)
    std::fprintf(stderr, "warm-up and memory steps done\n");
  for (int r = 0; r < o.rounds; ++r) {
    for (auto& s : setups) {
      for (int i = 0; i < o.steps; ++i) {
        const bool last = r + 1 == o.rounds && i + 1 == o.steps;
        s->ms.push_back(step(*s, counter++, false, last));
      }
    }
    if (rank == 0)
      std::fprintf(stderr, "round %d/%d done\n", r + 1, o.rounds);
  }

  // Gather: step times (slowest rank per step), per-stage numbers and the
  // last step's timelines.
  const auto& group = *cd::world_group();
  std::ostringstream json;
  std::ostringstream table;
  table << "GPT-2 " << o.layers << " blocks, " << world
        << " stages, micro-batch " << o.microbatch_size << " x " << seq
        << "\n| schedule | m | step ms | compute ms (all stages) | bubble "
           "span | bubble compute (per stage) | 1F1B formula | simulated | "
           "peak act MB per stage |\n|---|---|---|---|---|---|---|---|---|\n";
  json << "{\n  \"benchmark\": \"pipeline_step\",\n  \"world_size\": " << world
       << ",\n  \"stages\": " << world << ",\n  \"n_layer\": " << o.layers
       << ",\n  \"microbatch_size\": " << o.microbatch_size
       << ",\n  \"seq\": " << seq << ",\n  \"warmup\": " << o.warmup
       << ",\n  \"steps\": " << o.steps << ",\n  \"rounds\": " << o.rounds
       << ",\n  \"machine\": " << colossalai::bench::machine_json()
       << ",\n  \"setups\": {";
  bool first_setup = true;
  for (auto& sp : setups) {
    Setup& s = *sp;
    at::Tensor t = at::tensor(s.ms, at::kDouble);
    cd::all_reduce(t, group, cd::ReduceOp::kMax).wait();
    std::vector<double> ms(
        t.data_ptr<double>(), t.data_ptr<double>() + t.numel());

    const StageStep& st = s.last;
    const int stage = s.plugin->stage_manager()->stage();
    const double wall = st.ret - st.call;
    at::Tensor mine = at::tensor(
        {double(stage),
         wall,
         st.busy_span,
         st.busy_compute,
         double(s.activation),
         st.call,
         st.ret,
         st.align_gap,
         double(st.fallbacks),
         double(st.events.size()),
         st.cpu},
        at::kDouble);
    at::Tensor rows = at::zeros({world * kStageFields}, at::kDouble);
    cd::gather(rows, mine, 0, group).wait();
    at::Tensor n = at::tensor({double(st.events.size())}, at::kDouble);
    cd::all_reduce(n, group, cd::ReduceOp::kMax).wait();
    const int64_t max_events = static_cast<int64_t>(n.item<double>());
    at::Tensor ev = at::full({max_events * 6}, -1.0, at::kDouble);
    for (size_t i = 0; i < st.events.size(); ++i)
      for (int k = 0; k < 6; ++k)
        ev[i * 6 + k] = st.events[i][k];
    at::Tensor all_ev = at::zeros({world * max_events * 6}, at::kDouble);
    cd::gather(all_ev, ev, 0, group).wait();
    if (rank != 0)
      continue;

    auto row = rows.reshape({world, kStageFields});
    auto evs = all_ev.reshape({world, max_events, 6});
    const int p = world;
    const double formula =
        s.style == "1f1b" ? double(p - 1) / (s.m + p - 1) : -1;
    const auto& nodes = s.plugin->options().scheduler_nodes();
    const auto sim = cp::simulate(
        nodes.empty() ? cp::generate(s.style, p, s.chunks, s.m) : nodes,
        s.chunks,
        s.style == "zbv");
    double origin = std::numeric_limits<double>::infinity();
    for (int r = 0; r < world; ++r)
      origin = std::min(origin, row[r][5].item<double>());
    // Stages in stage order.
    std::vector<int> by_stage(world);
    for (int r = 0; r < world; ++r)
      by_stage[static_cast<int>(row[r][0].item<double>())] = r;
    double mean_span = 0, mean_compute = 0, work = 0;
    std::ostringstream stages, timeline, per_bubble, per_act;
    for (int si = 0; si < world; ++si) {
      const int r = by_stage[si];
      const double w = row[r][1].item<double>(), bs = row[r][2].item<double>(),
                   bc = row[r][3].item<double>();
      const double b_span = 1 - bs / w, b_compute = 1 - bc / w;
      mean_span += b_span / world;
      mean_compute += b_compute / world;
      work += bc;
      per_bubble << (si ? " / " : "") << fmt(b_compute, 2);
      per_act << (si ? " / " : "") << fmt(row[r][4].item<double>() / 1e6, 1);
      stages << (si ? "," : "") << "\n        {\"stage\": " << si
             << ", \"rank\": " << r << ", \"wall_ms\": " << w
             << ", \"busy_span_ms\": " << bs << ", \"busy_compute_ms\": " << bc
             << ", \"thread_cpu_ms\": " << row[r][10].item<double>()
             << ", \"bubble_span\": " << b_span
             << ", \"bubble_compute\": " << b_compute
             << ", \"activation_peak_bytes\": "
             << static_cast<int64_t>(row[r][4].item<double>())
             << ", \"clock_alignment_ms\": " << row[r][7].item<double>()
             << ", \"hook_fallbacks\": "
             << static_cast<int>(row[r][8].item<double>()) << "}";
      timeline << (si ? "," : "") << "\n        {\"stage\": " << si
               << ", \"call_ms\": " << row[r][5].item<double>() - origin
               << ", \"return_ms\": " << row[r][6].item<double>() - origin
               << ", \"events\": [";
      const int64_t ne = static_cast<int64_t>(row[r][9].item<double>());
      for (int64_t i = 0; i < ne; ++i) {
        auto e = evs[r][i];
        timeline << (i ? ", " : "") << "[" << int(e[0].item<double>()) << ", "
                 << int(e[1].item<double>()) << ", " << int(e[2].item<double>())
                 << ", " << fmt(e[3].item<double>() - origin) << ", "
                 << fmt(e[4].item<double>() - origin) << ", "
                 << fmt(e[5].item<double>() - origin) << "]";
      }
      timeline << "]}";
    }
    json << (first_setup ? "" : ",") << "\n    \"" << s.name << "\": {"
         << "\"schedule\": \"" << s.style << "\", \"chunks\": " << s.chunks
         << ", \"costs\": \"" << s.costs << "\"";
    if (!s.costs.empty()) {
      // What the generator expects: this schedule and the unit-cost ZB-V,
      // both run at the measured costs.
      json << ", \"simulated_makespan_at_costs\": "
           << cp::simulate(nodes, 2, true, s.cost_model).makespan
           << ", \"unit_zbv_simulated_makespan_at_costs\": "
           << cp::simulate(cp::zero_bubble_v(p, s.m), 2, true, s.cost_model)
                  .makespan;
    }
    json << ", \"fp8_communication\": " << (s.fp8 ? "true" : "false")
         << ", \"microbatches\": " << s.m
         << ", \"global_batch\": " << s.m * o.microbatch_size
         << ", \"step_ms\": " << colossalai::bench::stats_json(ms)
         << ", \"bubble_span_mean\": " << mean_span
         << ", \"bubble_compute_mean\": " << mean_compute
         << ", \"busy_compute_sum_ms\": " << work << ", \"bubble_formula\": "
         << (formula < 0 ? std::string("null") : fmt(formula, 6))
         << ", \"bubble_simulated\": " << sim.bubble
         << ", \"simulated_makespan\": " << sim.makespan
         << ",\n      \"per_stage\": [" << stages.str()
         << "],\n      \"timeline\": [" << timeline.str() << "]}";
    first_setup = false;
    table << "| " << (s.costs.empty() ? s.style : "zbv costed")
          << (s.fp8 ? " (FP8)" : "") << " | " << s.m << " | "
          << fmt(colossalai::bench::median(ms), 0) << " | " << fmt(work, 0)
          << " | " << fmt(mean_span, 3) << " | " << fmt(mean_compute, 2) << " ("
          << per_bubble.str() << ") | "
          << (formula < 0 ? std::string("-") : fmt(formula, 2)) << " | "
          << fmt(sim.bubble, 2) << " | " << per_act.str() << " |\n";
  }
  if (rank != 0)
    return 0;
  json << "\n  },\n  \"event_fields\": [\"kind (0 F, 1 B, 2 BI, 3 W)\", "
          "\"chunk\", \"micro_batch\", \"start_ms\", \"end_ms\", "
          "\"compute_start_ms\"]\n}\n";
  std::printf("%s", table.str().c_str());
  if (!o.out.empty())
    std::ofstream(o.out) << json.str();
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  int nproc = 4;
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--nproc")
      nproc = std::stoi(v);
    else if (k == "--schedules")
      o.schedules = v;
    else if (k == "--microbatches")
      o.microbatches = v;
    else if (k == "--microbatch-size")
      o.microbatch_size = std::stoi(v);
    else if (k == "--layers")
      o.layers = std::stoi(v);
    else if (k == "--warmup")
      o.warmup = std::stoi(v);
    else if (k == "--steps")
      o.steps = std::stoi(v);
    else if (k == "--rounds")
      o.rounds = std::stoi(v);
    else if (k == "--fp8")
      o.fp8 = v;
    else if (k == "--out")
      o.out = v;
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  return colossalai::bench::launch_ranks(
      nproc, argc, argv, [&] { return run_rank(o); });
}
