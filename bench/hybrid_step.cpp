// Tensor parallelism against data parallelism on the same global batch:
// HybridParallelPlugin on gpt-small-cpu's shape (the zoo's Hugging
// Face-layout GPT-2: vocab 4096, 128 positions, width 256, 4 heads, 4 blocks,
// head tied to the embedding) and a LLaMA of similar size (LlamaConfig::
// small_cpu), fp32 AdamW, 1 thread per rank. Every setup lives in the same
// processes and their timed rounds alternate, so the ratios compare like with
// like on a noisy machine.
//
// Per setup and rank: step time; bytes handed to collectives per step on the
// tensor group and on the data-parallel group, each beside its formula
// (Megatron's 4 all-reduces of B x T x C per block, plus the embedding's,
// the LM head's and the parallel cross entropy's; all-reduce or
// reduce-scatter + all-gather of the local gradients); model-state bytes
// beside 16 bytes per local parameter (ZeRO's formulas over the local
// parameters); activation bytes (heap in use after the forward minus
// before it).
//
//   bench_hybrid_step [--nproc 4] [--global-batch 16] [--steps 3]
//                     [--rounds 3] [--models gpt2,llama]
//                     [--setups dp,tp,tp2_dp2,tp2_zero1,tp_split_gather,
//                               tp_split_gather_overlap,tp_ring,
//                               sp_all_to_all,sp_ring_attn,
//                               sp_ring_attn_double]
//                     [--out FILE.json]
//
// Setups: dp (tp 1, DDP over every rank), tp (tp over every rank), tp2_dp2
// (tp 2, DDP over the rest), tp2_zero1 (tp 2, ZeRO-1 over the rest), and the
// sequence-parallel modes over every rank: tp_split_gather,
// tp_split_gather_overlap (enable_sequence_overlap) and tp_ring (on the
// tensor group), sp_all_to_all and sp_ring_attn (sp axis, tp 1), and
// sp_ring_attn_double (inner_ring_size: the ranks per host, LOCAL_WORLD_SIZE,
// where it splits the world; half the ranks on one host). Setups
// that do not fit the world size or the model's heads are skipped. The
// sequence-parallel setups have no byte formula here (-1).

#include "bench_launch.h"
#include "bench_util.h"

#include <colossalai/colossalai.h>
#include <colossalai/utils/compat.h>

#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
namespace models = colossalai::models;
using cb::plugin::HybridParallelPlugin;
using HPO = cb::plugin::HybridParallelPluginOptions;

namespace {

using colossalai::bench::split;

using colossalai::bench::tensor_bytes;

struct Options {
  int global_batch = 16, steps = 3, rounds = 3;
  std::string models = "gpt2,llama",
              setups =
                  "dp,tp,tp2_dp2,tp2_zero1,tp_split_gather,tp_ring,"
                  "sp_all_to_all,sp_ring_attn",
              out;
};

struct Result {
  std::string name;
  int tp = 1, dp = 1, zero = 0, sp = 1;
  std::string sp_mode;
  int64_t micro = 0, local_params = 0;
  std::vector<double> ms;
  int64_t tp_bytes = 0, dp_bytes = 0, sp_bytes = 0, other_bytes = 0; // /step
  int64_t tp_formula = 0, dp_formula = 0;
  int64_t tp_gap = 0, dp_gap = 0; // largest |measured - formula|, any rank
  int64_t model_state = 0, model_state_formula = 0;
  int64_t activation = 0;
};

template <class Model>
struct Setup {
  Result r;
  std::shared_ptr<HybridParallelPlugin> plugin;
  std::unique_ptr<cb::Booster> booster;
  Model model{nullptr};
  cb::Boosted<Model, std::nullptr_t, std::nullptr_t> boosted;
};

template <class Model>
Model make_model();

template <>
models::GPT2LMHeadModel make_model<models::GPT2LMHeadModel>() {
  return models::GPT2LMHeadModel(models::GPT2Config::small_cpu());
}

template <>
models::LlamaForCausalLM make_model<models::LlamaForCausalLM>() {
  return models::LlamaForCausalLM(models::LlamaConfig::small_cpu());
}

// Whether tensor parallelism of size tp can split the model's heads.
template <class Model>
bool splits_heads(int tp);
template <>
bool splits_heads<models::GPT2LMHeadModel>(int tp) {
  return models::GPT2Config::small_cpu().n_head() % tp == 0;
}
template <>
bool splits_heads<models::LlamaForCausalLM>(int tp) {
  return models::LlamaConfig::small_cpu().num_key_value_heads() % tp == 0;
}

int64_t vocab_of(const models::GPT2LMHeadModel& m) {
  return m->config().vocab_size();
}
int64_t vocab_of(const models::LlamaForCausalLM& m) {
  return m->config().vocab_size();
}
int64_t width_of(const models::GPT2LMHeadModel& m) {
  return m->config().n_embd();
}
int64_t width_of(const models::LlamaForCausalLM& m) {
  return m->config().hidden_size();
}
int64_t layers_of(const models::GPT2LMHeadModel& m) {
  return m->config().n_layer();
}
int64_t layers_of(const models::LlamaForCausalLM& m) {
  return m->config().num_hidden_layers();
}
int64_t seq_of(const models::GPT2LMHeadModel& m) {
  return m->config().n_positions();
}
int64_t seq_of(const models::LlamaForCausalLM& m) {
  return m->config().max_position_embeddings();
}

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

template <class Model>
std::vector<Result> run_model(const Options& o, int world) {
  std::vector<std::unique_ptr<Setup<Model>>> setups;
  for (const auto& name : split(o.setups)) {
    HPO opts = HPO().precision("fp32");
    int tp = 1, zero = 0, sp = 1;
    std::string mode;
    if (name == "tp") {
      tp = world;
    } else if (
        name == "tp_split_gather" || name == "tp_ring" ||
        name == "tp_split_gather_overlap") {
      tp = world;
      mode = name == "tp_ring" ? "ring" : "split_gather";
    } else if (name == "sp_all_to_all" || name == "sp_ring_attn") {
      sp = world;
      mode = name.substr(3);
    } else if (name == "sp_ring_attn_double") {
      if (world % 2 != 0)
        continue;
      sp = world;
      mode = "ring_attn";
      const char* local = std::getenv("LOCAL_WORLD_SIZE");
      const int per_host = local == nullptr ? 0 : std::atoi(local);
      opts.inner_ring_size(
          per_host > 0 && per_host < world && world % per_host == 0
              ? per_host
              : world / 2);
    } else if (name == "tp2_dp2" || name == "tp2_zero1") {
      if (world != 4)
        continue;
      tp = 2;
      zero = name == "tp2_zero1" ? 1 : 0;
    } else {
      TORCH_CHECK(name == "dp", "unknown setup '", name, "'");
    }
    const int head_split = mode == "all_to_all" ? sp : tp;
    if (!splits_heads<Model>(head_split)) {
      if (cd::get_rank() == 0)
        std::fprintf(
            stderr,
            "%s: the heads do not split %d ways\n",
            name.c_str(),
            head_split);
      continue;
    }
    opts.tp_size(tp).zero_stage(zero);
    if (!mode.empty()) {
      opts.enable_sequence_parallelism(true)
          .sequence_parallelism_mode(mode)
          .enable_sequence_overlap(name == "tp_split_gather_overlap");
      if (sp > 1)
        opts.sp_size(sp);
    }
    auto s = std::make_unique<Setup<Model>>();
    s->r.name = name;
    s->r.tp = tp;
    s->r.zero = zero;
    s->r.sp = sp;
    s->r.sp_mode = mode;
    s->plugin = std::make_shared<HybridParallelPlugin>(opts);
    s->booster =
        std::make_unique<cb::Booster>(cb::BoosterOptions().plugin(s->plugin));
    torch::manual_seed(0);
    s->model = make_model<Model>();
    auto opt = std::make_shared<torch::optim::AdamW>(
        s->model->parameters(),
        torch::optim::AdamWOptions(3e-4).weight_decay(0.01));
    s->boosted = s->booster->boost(s->model, opt);
    s->r.dp = s->plugin->dp_size();
    TORCH_CHECK(
        o.global_batch % s->r.dp == 0,
        "--global-batch ",
        o.global_batch,
        " must divide by the data-parallel size ",
        s->r.dp);
    s->r.micro = o.global_batch / s->r.dp;
    setups.push_back(std::move(s));
  }
  TORCH_CHECK(!setups.empty(), "no setup fits ", world, " ranks");
  const int64_t vocab = vocab_of(setups[0]->model),
                seq = seq_of(setups[0]->model);
  auto step = [&](Setup<Model>& s, int i, bool measure_activation) {
    auto b = global_batch(i, o.global_batch, seq, vocab);
    const int64_t m = s.r.micro, off = m * s.plugin->dp_rank();
    auto x = b.first.narrow(0, off, m), y = b.second.narrow(0, off, m);
    auto t0 = std::chrono::steady_clock::now();
    s.boosted.optimizer->zero_grad();
    const int64_t heap0 =
        colossalai::compat::memory_allocated(at::Device(at::kCPU));
    at::Tensor logits = s.boosted.model(x);
    if (measure_activation) {
      s.r.activation =
          colossalai::compat::memory_allocated(at::Device(at::kCPU)) - heap0;
    }
    at::Tensor loss = s.model->loss(logits, y);
    logits.reset();
    s.booster->backward(loss, *s.boosted.optimizer);
    s.boosted.optimizer->step();
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now() - t0)
        .count();
  };
  for (auto& s : setups)
    step(*s, 0, false); // warm up, creates optimizer states
  for (auto& s : setups)
    step(*s, 0, true);
  std::map<std::string, int64_t> tp_b, dp_b, sp_b, all_b;
  int counter = 1;
  for (int r = 0; r < o.rounds; ++r) {
    for (auto& s : setups) {
      cd::barrier(*cd::world_group()).wait();
      const int64_t a0 = cd::bytes_communicated(),
                    t0 = s->plugin->tp_group()->bytes_communicated(),
                    d0 = s->plugin->mixed_dp_group()->bytes_communicated(),
                    s0 = s->plugin->sp_group()->bytes_communicated();
      for (int i = 0; i < o.steps; ++i)
        s->r.ms.push_back(step(*s, counter++, false));
      tp_b[s->r.name] += s->plugin->tp_group()->bytes_communicated() - t0;
      dp_b[s->r.name] += s->plugin->mixed_dp_group()->bytes_communicated() - d0;
      sp_b[s->r.name] += s->plugin->sp_group()->bytes_communicated() - s0;
      all_b[s->r.name] += cd::bytes_communicated() - a0;
    }
    if (cd::get_rank() == 0)
      std::fprintf(stderr, "round %d/%d done\n", r + 1, o.rounds);
  }
  const int64_t steps = static_cast<int64_t>(o.rounds) * o.steps;
  std::vector<Result> out;
  for (auto& sp : setups) {
    auto& s = *sp;
    Result r = s.r;
    // A group of one rank is the identity: its traffic counts nowhere.
    // Gradients are averaged over dp x sp (sequence-parallel ranks too).
    const int64_t mixed = s.plugin->mixed_dp_group()->size();
    const bool tp_on = r.tp > 1, dp_on = mixed > 1;
    r.tp_bytes = tp_on ? tp_b[r.name] / steps : 0;
    r.dp_bytes = dp_on ? dp_b[r.name] / steps : 0;
    // split_gather and ring run on the tensor group itself. With dp 1 the
    // sp axis is the data-parallel group too: its bytes are reported as
    // dp + sp (dp_bytes, no formula; sp_bytes -1).
    const bool own_sp = s.plugin->sp_group() != s.plugin->tp_group();
    const bool sp_is_dp = s.plugin->sp_group() == s.plugin->mixed_dp_group();
    r.sp_bytes = !own_sp || r.sp == 1 ? 0
        : sp_is_dp                    ? -1
                                      : sp_b[r.name] / steps;
    r.other_bytes = all_b[r.name] / steps - r.tp_bytes - r.dp_bytes -
        std::max<int64_t>(r.sp_bytes, 0);
    const int64_t bsc = r.micro * seq * width_of(s.model) * 4;
    r.tp_formula = !r.sp_mode.empty() ? -1
        : tp_on ? (4 * layers_of(s.model) + 2) * bsc + 3 * r.micro * seq * 4
                : 0;
    std::vector<at::Tensor> params = s.model->parameters(), grads;
    r.local_params = 0;
    for (const auto& p : params) {
      r.local_params += p.numel();
      grads.push_back(p.grad());
    }
    const int64_t psi = r.local_params;
    if (r.sp_bytes < 0) {
      r.dp_formula = -1; // dp and sp traffic share one group here
    }
    if (r.zero == 0) {
      // DDP: one all-reduce of every local gradient.
      if (r.dp_formula == 0)
        r.dp_formula = dp_on ? 4 * psi : 0;
      int64_t states = 0;
      for (auto& kv : s.boosted.optimizer->unwrap().state()) {
        auto* a = dynamic_cast<torch::optim::AdamWParamState*>(kv.second.get());
        states += tensor_bytes({a->exp_avg(), a->exp_avg_sq()});
      }
      r.model_state = tensor_bytes(params) + tensor_bytes(grads) + states;
      r.model_state_formula = 16 * psi;
    } else {
      // ZeRO-1: the gradients reduce-scattered (the whole local gradient
      // handed over) and the updated shards all-gathered.
      if (r.dp_formula == 0)
        r.dp_formula = 4 * psi + 4 * psi / mixed;
      auto* z = dynamic_cast<colossalai::zero::LowLevelZeroOptimizer*>(
          s.boosted.optimizer.get());
      TORCH_INTERNAL_ASSERT(z);
      auto st = z->memory_stats();
      r.model_state = st.working_params + st.gradients + st.master_weights +
          st.optimizer_states;
      // fp32 ZeRO-1 at rest in our layout: the weights, and fp32 slices of
      // gradients and both moments ((4 + 12 / N) Psi, bench_zero_step).
      r.model_state_formula = 4 * psi + 12 * psi / mixed;
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::string result_json(const Result& r, double base_ms) {
  using colossalai::bench::stats_json;
  const double ms = colossalai::bench::median(r.ms);
  std::ostringstream os;
  os << "{\"tp\": " << r.tp << ", \"dp\": " << r.dp << ", \"sp\": " << r.sp
     << ", \"sp_mode\": \"" << r.sp_mode << "\", \"zero_stage\": " << r.zero
     << ", \"micro_batch\": " << r.micro
     << ", \"local_parameters\": " << r.local_params
     << ", \"step_ms\": " << stats_json(r.ms) << ", \"vs_dp\": " << ms / base_ms
     << ", \"tp_bytes_per_step\": " << r.tp_bytes
     << ", \"tp_formula_bytes\": " << r.tp_formula
     << ", \"dp_bytes_per_step\": " << r.dp_bytes
     << ", \"dp_formula_bytes\": " << r.dp_formula
     << ", \"tp_gap_any_rank\": " << r.tp_gap
     << ", \"dp_gap_any_rank\": " << r.dp_gap
     << ", \"sp_bytes_per_step\": " << r.sp_bytes
     << ", \"other_bytes_per_step\": " << r.other_bytes
     << ", \"model_state_bytes\": " << r.model_state
     << ", \"model_state_formula_bytes\": " << r.model_state_formula
     << ", \"activation_bytes\": " << r.activation << "}";
  return os.str();
}

int run_rank(const Options& o) {
  colossalai::launch_from_env();
  at::set_num_threads(1);
  const int rank = cd::get_rank(), world = cd::get_world_size();
  std::map<std::string, std::vector<Result>> results;
  for (const auto& m : split(o.models)) {
    if (m == "gpt2") {
      results[m] = run_model<models::GPT2LMHeadModel>(o, world);
    } else if (m == "llama") {
      results[m] = run_model<models::LlamaForCausalLM>(o, world);
    } else {
      TORCH_CHECK(false, "unknown model '", m, "' (gpt2, llama)");
    }
  }
  // Rank 0 reports; the largest gap between measured and formula bytes over
  // every rank comes with it.
  for (auto& kv : results) {
    for (auto& r : kv.second) {
      auto gap_of = [](int64_t got, int64_t formula) {
        return formula < 0 ? 0.0 : static_cast<double>(std::abs(got - formula));
      };
      at::Tensor gap = at::tensor(
          {gap_of(r.tp_bytes, r.tp_formula), gap_of(r.dp_bytes, r.dp_formula)},
          at::kDouble);
      cd::all_reduce(gap, *cd::world_group(), cd::ReduceOp::kMax).wait();
      r.tp_gap = static_cast<int64_t>(gap[0].item<double>());
      r.dp_gap = static_cast<int64_t>(gap[1].item<double>());
    }
  }
  if (rank != 0)
    return 0;
  std::ostringstream json;
  json << "{\n  \"benchmark\": \"hybrid_step\",\n  \"world_size\": " << world
       << ",\n  \"global_batch\": " << o.global_batch
       << ",\n  \"machine\": " << colossalai::bench::machine_json()
       << ",\n  \"models\": {";
  bool first_model = true;
  for (const auto& kv : results) {
    json << (first_model ? "" : ",") << "\n    \"" << kv.first << "\": {";
    first_model = false;
    std::printf(
        "%s, %d ranks, global batch %d x 128\n"
        "| setup | step ms | vs dp | tp bytes/step | formula | dp "
        "bytes/step | formula | sp bytes/step | model state MB | formula MB | "
        "activations MB |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
        kv.first.c_str(),
        world,
        o.global_batch);
    const double base = colossalai::bench::median(kv.second[0].ms);
    for (size_t i = 0; i < kv.second.size(); ++i) {
      const auto& r = kv.second[i];
      json << (i ? "," : "") << "\n      \"" << r.name
           << "\": " << result_json(r, base);
      std::printf(
          "| %s | %.0f | %.2fx | %lld | %lld | %lld | %lld | %lld | %.1f | "
          "%.1f | %.1f |\n",
          r.name.c_str(),
          colossalai::bench::median(r.ms),
          colossalai::bench::median(r.ms) / base,
          (long long)r.tp_bytes,
          (long long)r.tp_formula,
          (long long)r.dp_bytes,
          (long long)r.dp_formula,
          (long long)r.sp_bytes,
          r.model_state / 1e6,
          r.model_state_formula / 1e6,
          r.activation / 1e6);
    }
    json << "\n    }";
  }
  json << "\n  }\n}\n";
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
    else if (k == "--global-batch")
      o.global_batch = std::stoi(v);
    else if (k == "--steps")
      o.steps = std::stoi(v);
    else if (k == "--rounds")
      o.rounds = std::stoi(v);
    else if (k == "--models")
      o.models = v;
    else if (k == "--setups")
      o.setups = v;
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
