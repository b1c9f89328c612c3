// Pipeline parallelism: the schedules' shapes (simulated), and the zoo's
// GPT-2 and LLaMA trained through Booster::execute_pipeline on 2 and 4
// ranks (alone and beside tensor and data parallelism) against one process
// training the whole model on the same global batch.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/pipeline/schedule.h>
#include <harness/multiprocess.h>
#include <harness/test_util.h>
#include <harness/zoo_util.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include <unistd.h>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
namespace cp = colossalai::pipeline;
namespace sf = colossalai::shardformer;
namespace models = colossalai::models;
using cb::plugin::HybridParallelPlugin;
using HPO = cb::plugin::HybridParallelPluginOptions;
using colossalai::testing::remove_scratch;
using colossalai::testing::run_distributed;
using colossalai::testing::scratch;
using colossalai::testing::whole_weights;

namespace {

// ---- Schedules (no processes: the unit-cost simulation of all stages).

TEST(PipelineSchedule, OneFOneBHasTheTextbookBubble) {
  for (int p : {2, 4}) {
    for (int m : {1, 2, 4, 8}) {
      auto sim = cp::simulate(cp::generate("1f1b", p, 1, m), 1, false);
      // F and B cost one unit each: 2 (m + p - 1) steps, 2 m busy.
      EXPECT_EQ(sim.makespan, 2 * (m + p - 1)) << "p " << p << " m " << m;
      EXPECT_NEAR(sim.bubble, double(p - 1) / (m + p - 1), 1e-12);
    }
  }
  // Stage 1 of 4 with 8 micro-batches: 2 warm-up forwards.
  auto s = cp::one_f_one_b(1, 4, 8);
  EXPECT_EQ(cp::to_string(s[0]), "F0.0");
  EXPECT_EQ(cp::to_string(s[2]), "F0.2");
  EXPECT_EQ(cp::to_string(s[3]), "B0.0");
}

TEST(PipelineSchedule, InterleavedAndZeroBubbleShrinkTheBubble) {
  for (int p : {2, 4}) {
    for (int m : {4, 8}) {
      const double one_f_one_b = double(p - 1) / (m + p - 1);
      auto inter = cp::simulate(cp::generate("interleaved", p, 2, m), 2, false);
      // Each chunk is half a stage, so units are half as long: compare the
      // idle share, which Megatron's analysis puts at 1/chunks of 1F1B's.
      EXPECT_LT(inter.bubble, one_f_one_b)
          << "interleaved p " << p << " m " << m;
      auto zbv = cp::simulate(cp::generate("zbv", p, 2, m), 2, true);
      EXPECT_LT(zbv.bubble, inter.bubble) << "zbv p " << p << " m " << m;
      // Every (chunk, micro-batch) runs F, BI and W once on every stage.
      for (const auto& stage : cp::zero_bubble_v(p, m)) {
        EXPECT_EQ(stage.size(), size_t(3 * 2 * m));
      }
    }
  }
  EXPECT_THROW(cp::interleaved(0, 4, 2, 6), c10::Error); // m % p != 0
}

TEST(PipelineSchedule, EveryPairReceivesInSendOrder) {
  // NCCL matches a pair's messages by order, not by tag: every generated
  // schedule must receive each pair's messages in the order they were sent.
  struct Case {
    const char* style;
    int chunks;
  };
  for (const Case c :
       {Case{"1f1b", 1},
        Case{"interleaved", 2},
        Case{"interleaved", 3},
        Case{"zbv", 2}}) {
    const bool zbv = std::string(c.style) == "zbv";
    for (int p : {2, 3, 4}) {
      for (int m : {4, 8, 12}) {
        if (std::string(c.style) == "interleaved" && m % p != 0) {
          continue; // interleaved needs m % p == 0
        }
        EXPECT_EQ(
            cp::p2p_order_mismatch(
                cp::generate(c.style, p, c.chunks, m), c.chunks, zbv),
            "")
            << c.style << " p " << p << " chunks " << c.chunks << " m " << m;
      }
    }
  }
  // Stage 1 consumes micro-batch 1 before 0: found and named.
  std::vector<std::vector<cp::Action>> swapped = {
      {{cp::ActionKind::kForward, 0, 0},
       {cp::ActionKind::kForward, 0, 1},
       {cp::ActionKind::kBackward, 0, 0},
       {cp::ActionKind::kBackward, 0, 1}},
      {{cp::ActionKind::kForward, 0, 1},
       {cp::ActionKind::kForward, 0, 0},
       {cp::ActionKind::kBackward, 0, 0},
       {cp::ActionKind::kBackward, 0, 1}}};
  EXPECT_NE(
      cp::p2p_order_mismatch(swapped, 1, false)
          .find("stage 0 -> stage 1, message 0"),
      std::string::npos);
}

TEST(PipelineSchedule, CostsShapeTheZeroBubbleV) {
  // One micro-batch through 1F1B: p forwards and p backwards in a row,
  // 2 (p - 1) hops between them.
  for (int p : {2, 4}) {
    for (int64_t comm : {0, 1, 3}) {
      const auto sim = cp::simulate(
          cp::generate("1f1b", p, 1, 1),
          1,
          false,
          cp::ScheduleCosts().backward(3).comm(comm));
      EXPECT_EQ(sim.makespan, p * (1 + 3) + 2 * (p - 1) * comm)
          << "p " << p << " comm " << comm;
    }
  }
  // ZB-V generated for the costs it runs at is valid and, run at those
  // costs, finishes no later than the unit-cost schedule does (a tighter
  // activation budget instead trades time for memory).
  const std::vector<cp::ScheduleCosts> costs = {
      cp::ScheduleCosts().backward_weight(2),
      cp::ScheduleCosts().backward_input(2).comm(1),
      cp::ScheduleCosts().forward(2).backward_input(3).backward_weight(1).comm(
          2),
      cp::ScheduleCosts().max_in_flight(1)};
  for (int p : {2, 4}) {
    for (int m : {4, 8}) {
      for (size_t k = 0; k < costs.size(); ++k) {
        SCOPED_TRACE(
            "p " + std::to_string(p) + " m " + std::to_string(m) + " costs " +
            std::to_string(k));
        const auto v = cp::zero_bubble_v(p, m, costs[k]);
        EXPECT_EQ(cp::check_schedule(v, p, 2, true, "test"), m);
        const auto made = cp::simulate(v, 2, true, costs[k]);
        const auto unit =
            cp::simulate(cp::zero_bubble_v(p, m), 2, true, costs[k]);
        if (costs[k].max_in_flight() == 0) {
          EXPECT_LE(made.makespan, unit.makespan);
        }
        // Activations held per chunk stay within max_in_flight (p unset).
        const int budget =
            costs[k].max_in_flight() > 0 ? costs[k].max_in_flight() : p;
        for (int s = 0; s < p; ++s) {
          int held[2] = {0, 0}, most = 0;
          for (const auto& a : v[s]) {
            held[a.chunk] += a.kind == cp::ActionKind::kForward ? 1
                : a.kind == cp::ActionKind::kBackwardWeight     ? -1
                                                                : 0;
            most = std::max({most, held[0], held[1]});
          }
          EXPECT_LE(most, budget) << "stage " << s;
        }
      }
    }
  }
  EXPECT_THROW(
      cp::zero_bubble_v(2, 4, cp::ScheduleCosts().backward_weight(0)),
      c10::Error);
}

TEST(PipelineSchedule, CheckScheduleNamesTheProblem) {
  auto error = [](const std::vector<std::vector<cp::Action>>& s) {
    return colossalai::testing::error_of(
        [&] { cp::check_schedule(s, 2, 1, false, "scheduler_nodes"); });
  };
  using K = cp::ActionKind;
  const std::vector<cp::Action> gpipe = {
      {K::kForward, 0, 0},
      {K::kForward, 0, 1},
      {K::kBackward, 0, 0},
      {K::kBackward, 0, 1}};
  EXPECT_EQ(cp::check_schedule({gpipe, gpipe}, 2, 1, false, "x"), 2);
  EXPECT_NE(
      error({gpipe}).find("one list of actions per pipeline stage"),
      std::string::npos);
  auto chunk1 = gpipe;
  chunk1[1].chunk = 1;
  EXPECT_NE(
      error({gpipe, chunk1})
          .find("stage 1 runs F1.1, outside num_model_chunks"),
      std::string::npos);
  auto missing = gpipe;
  missing.pop_back();
  EXPECT_NE(
      error({gpipe, missing}).find("scheduler_nodes:"), std::string::npos);
  // Stage 1 takes micro-batch 1's forward first: out of send order.
  auto swapped = gpipe;
  std::swap(swapped[0], swapped[1]);
  EXPECT_NE(
      error({gpipe, swapped}).find("out of send order"), std::string::npos);
  // Stage 0 waits for micro-batch 0's gradient before sending micro-batch
  // 1's forward, which stage 1 waits for first.
  const std::vector<cp::Action> early_b = {
      {K::kForward, 0, 0},
      {K::kBackward, 0, 0},
      {K::kForward, 0, 1},
      {K::kBackward, 0, 1}};
  const std::vector<cp::Action> late_b = {
      {K::kForward, 0, 0},
      {K::kForward, 0, 1},
      {K::kBackward, 0, 1},
      {K::kBackward, 0, 0}};
  EXPECT_NE(error({early_b, late_b}).find("deadlocks"), std::string::npos);
}

TEST(PipelineSchedule, SimulatorFindsADeadlock) {
  // Stage 0 waits for a gradient before sending the forward it needs.
  std::vector<std::vector<cp::Action>> bad = {
      {{cp::ActionKind::kForward, 0, 1},
       {cp::ActionKind::kForward, 0, 0},
       {cp::ActionKind::kBackward, 0, 0},
       {cp::ActionKind::kBackward, 0, 1}},
      {{cp::ActionKind::kForward, 0, 0},
       {cp::ActionKind::kBackward, 0, 0},
       {cp::ActionKind::kForward, 0, 1},
       {cp::ActionKind::kBackward, 0, 1}}};
  EXPECT_NO_THROW(cp::simulate(bad, 1, false)); // out of order but valid
  std::swap(bad[1][0], bad[1][2]); // stage 1 first waits for micro-batch 1
  std::swap(bad[0][0], bad[0][1]);
  bad[0] = {
      {cp::ActionKind::kForward, 0, 0},
      {cp::ActionKind::kBackward, 0, 0},
      {cp::ActionKind::kForward, 0, 1},
      {cp::ActionKind::kBackward, 0, 1}};
  bad[1] = {
      {cp::ActionKind::kForward, 0, 1},
      {cp::ActionKind::kForward, 0, 0},
      {cp::ActionKind::kBackward, 0, 0},
      {cp::ActionKind::kBackward, 0, 1}};
  try {
    cp::simulate(bad, 1, false);
    ADD_FAILURE() << "no deadlock found";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("deadlocks"), std::string::npos);
  }
}

// ---- Training against one process.

constexpr int kSteps = 3;
constexpr int kGlobalBatch = 8;
constexpr int64_t kSeq = 16;
// The same bounds and argument as test_hybrid_parallel: the pipeline only
// moves activations between processes (bit-exact) and sums micro-batch
// gradients in another order, so the results differ from one process by
// fp32 rounding, grown through 8 blocks and 3 steps; 2e-5 for SGD leaves a
// factor 20 over that for other CPUs' BLAS, and AdamW's update rounding is
// at most 3.2 lr per step where v is tiny.
constexpr double kSgdAtol = 2e-5;
constexpr double kLossTol = 1e-5;

struct Setup {
  std::string name;
  HPO options;
};

HPO base() {
  return HPO().precision("fp32").num_microbatches(4);
}

// scheduler_nodes: ZB-V made for weight passes twice as long as the
// others and hops of one unit; it differs from the unit-cost ZB-V.
std::vector<std::vector<cp::Action>> costed_zbv(int pp) {
  auto v =
      cp::zero_bubble_v(pp, 4, cp::ScheduleCosts().backward_weight(2).comm(1));
  TORCH_INTERNAL_ASSERT(v != cp::zero_bubble_v(pp, 4));
  return v;
}

// scheduler_nodes: GPipe (every forward, then every backward) on 1F1B's
// layout.
std::vector<std::vector<cp::Action>> gpipe(int pp) {
  std::vector<cp::Action> stage;
  for (int i = 0; i < 4; ++i) {
    stage.push_back({cp::ActionKind::kForward, 0, i});
  }
  for (int i = 0; i < 4; ++i) {
    stage.push_back({cp::ActionKind::kBackward, 0, i});
  }
  return std::vector<std::vector<cp::Action>>(pp, stage);
}

std::vector<Setup> setups(int world) {
  std::vector<Setup> s;
  if (world == 2) {
    s.push_back({"pp2_1f1b", base().pp_size(2)});
    s.push_back(
        {"pp2_interleaved",
         base().pp_size(2).pp_style("interleaved").num_model_chunks(2)});
    s.push_back(
        {"pp2_zbv", base().pp_size(2).pp_style("zbv").num_model_chunks(2)});
    s.push_back(
        {"pp2_zbv_scheduler_nodes",
         base().pp_size(2).pp_style("zbv").num_model_chunks(2).scheduler_nodes(
             costed_zbv(2))});
    s.push_back(
        {"pp2_gpipe_scheduler_nodes",
         base().pp_size(2).scheduler_nodes(gpipe(2))});
    return s;
  }
  s.push_back({"pp4_1f1b", base().pp_size(4)});
  s.push_back(
      {"pp4_interleaved",
       base().pp_size(4).pp_style("interleaved").num_model_chunks(2)});
  s.push_back(
      {"pp4_zbv", base().pp_size(4).pp_style("zbv").num_model_chunks(2)});
  s.push_back(
      {"pp4_zbv_scheduler_nodes",
       base().pp_size(4).pp_style("zbv").num_model_chunks(2).scheduler_nodes(
           costed_zbv(4))});
  s.push_back({"pp2_tp2", base().pp_size(2).tp_size(2)});
  s.push_back({"pp2_dp2_zero1", base().pp_size(2).zero_stage(1)});
  // NOTE [All-gathers overlap the next forward]: a stage's embeddings or
  // head waited for as the pipeline step begins, its blocks in their
  // forwards (the first micro-batch's).
  s.push_back(
      {"pp2_dp2_zero1_overlap_allgather",
       base().pp_size(2).zero_stage(1).overlap_allgather(true)});
  s.push_back({"pp2_dp2_ddp", base().pp_size(2).zero_stage(0)});
  s.push_back(
      {"pp2_dp2_zbv_zero1_clip",
       base()
           .pp_size(2)
           .zero_stage(1)
           .pp_style("zbv")
           .num_model_chunks(2)
           .max_norm(0.05)});
  s.push_back(
      {"pp2_tp2_split_gather_uneven",
       base()
           .pp_size(2)
           .tp_size(2)
           .enable_sequence_parallelism(true)
           .sequence_parallelism_mode("split_gather")
           .num_layers_per_stage({3, 5})
           .max_norm(0.05)});
  return s;
}

std::pair<at::Tensor, at::Tensor> batch(int step, int64_t vocab) {
  auto gen = at::detail::createCPUGenerator(900 + step);
  auto tokens = at::randint(vocab, {kGlobalBatch, kSeq + 1}, gen);
  return {
      tokens.narrow(1, 0, kSeq).contiguous(),
      tokens.narrow(1, 1, kSeq).contiguous()};
}

template <class Model>
Model make() {
  torch::manual_seed(11);
  if constexpr (std::is_same_v<Model, models::GPT2LMHeadModel>) {
    return models::GPT2LMHeadModel(models::GPT2Config::tiny_test().n_layer(8));
  } else {
    return models::LlamaForCausalLM(
        models::LlamaConfig::tiny_test().num_hidden_layers(8));
  }
}

template <class Model>
std::pair<std::vector<double>, std::map<std::string, at::Tensor>> reference(
    bool sgd,
    double max_norm) {
  auto model = make<Model>();
  const int64_t vocab = model->config().vocab_size();
  return colossalai::testing::train_one_process(
      model, kSteps, sgd, max_norm, [vocab](int step) {
        return batch(step, vocab);
      });
}

template <class Model>
void check_setups(int world, bool sgd) {
  std::map<double, decltype(reference<Model>(sgd, 0))> refs;
  for (const auto& s : setups(world)) {
    SCOPED_TRACE(s.name + (sgd ? ", SGD" : ", AdamW"));
    const double max_norm = s.options.max_norm();
    if (!refs.count(max_norm)) {
      refs.emplace(max_norm, reference<Model>(sgd, max_norm));
    }
    const auto& expect = refs.at(max_norm);
    auto plugin = std::make_shared<HybridParallelPlugin>(s.options);
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make<Model>();
    auto boosted = booster.boost(
        model, colossalai::testing::make_optimizer(model->parameters(), sgd));
    const int dp = plugin->dp_size();
    const int64_t local = kGlobalBatch / dp;
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto b = batch(step, model->config().vocab_size());
      auto x = b.first.narrow(0, local * plugin->dp_rank(), local);
      auto y = b.second.narrow(0, local * plugin->dp_rank(), local);
      boosted.optimizer->zero_grad();
      auto out =
          colossalai::testing::pipeline_step(booster, boosted, model, x, y);
      boosted.optimizer->step();
      // The loss lives where the last stage is; the mean over dp there.
      const bool last = plugin->stage_manager()->holds_last_stage();
      ASSERT_EQ(out.loss.defined(), last);
      at::Tensor l = last ? out.loss.reshape({1}).clone() : at::zeros({1});
      cd::all_reduce(l, *plugin->dp_group()).wait();
      losses.push_back(last ? l.item<double>() / dp : -1);
    }
    if (!s.options.scheduler_nodes().empty()) {
      // The stage ran its list of scheduler_nodes, in that order.
      const auto& mine =
          s.options.scheduler_nodes()[plugin->stage_manager()->stage()];
      const auto& ran = plugin->schedule()->timeline();
      ASSERT_EQ(ran.size(), mine.size());
      for (size_t i = 0; i < ran.size(); ++i) {
        EXPECT_EQ(cp::to_string(ran[i].action), cp::to_string(mine[i]));
      }
    }
    if (plugin->stage_manager()->holds_last_stage()) {
      for (int step = 0; step < kSteps; ++step) {
        EXPECT_NEAR(losses[step], expect.first[step], kLossTol)
            << "step " << step;
      }
    }
    // Every held parameter equals the reference's; released ones are gone.
    boosted.model.wrapper()->synchronize_weights(); // overlap_allgather
    auto got = whole_weights(*model, plugin->shard_info());
    EXPECT_GT(got.size(), 0u);
    EXPECT_LT(got.size(), expect.second.size());
    const double atol = sgd ? kSgdAtol : 2 * kSteps * 3.2e-3;
    for (const auto& kv : got) {
      ASSERT_TRUE(expect.second.count(kv.first)) << kv.first;
      const at::Tensor& want = expect.second.at(kv.first);
      ASSERT_EQ(kv.second.sizes(), want.sizes()) << kv.first;
      const at::Tensor diff = kv.second - want;
      EXPECT_LE(diff.abs().max().item<double>(), atol) << kv.first;
    }
  }
}

TEST(Pipeline, Gpt2MatchesOneProcessOnTwoRanks) {
  run_distributed(2, [](int, int world) {
    check_setups<models::GPT2LMHeadModel>(world, true);
    check_setups<models::GPT2LMHeadModel>(world, false);
  });
}

TEST(Pipeline, Gpt2MatchesOneProcessOnFourRanks) {
  run_distributed(4, [](int, int world) {
    check_setups<models::GPT2LMHeadModel>(world, true);
  });
}

TEST(Pipeline, LlamaMatchesOneProcessOnFourRanks) {
  run_distributed(4, [](int, int world) {
    check_setups<models::LlamaForCausalLM>(world, false);
  });
}

// A backward that raises in one stage only (a hook on its first trainable
// parameter, at step 1) while the loop goes on past any error but a
// DistributedError, as a loop that skips failed batches does: the stages'
// sends, receives and collectives can no longer pair up, so no rank may
// complete a step from then on; every rank ends in a DistributedError that
// names the hook's error, the raised one at once (NOTE [A backward that
// raised on some ranks]), the others from their timeouts (none hangs: the
// harness's deadline). `in_step`: the stage's optimizer step raises
// instead (NOTE [A step that raised]); the other stages may complete that
// step, not the next, and name it.
void raise_in_one_stage(
    int world,
    const HPO& options,
    int raising_rank,
    bool in_step = false) {
  colossalai::testing::MultiProcessOptions o;
  // Also the rendezvous's limit, which 4 ranks on a loaded 2-core machine
  // need seconds of.
  o.collective_timeout_seconds = 8;
  o.final_barrier = false; // the groups are broken, by design
  run_distributed(
      world,
      [&](int rank, int) {
        auto plugin = std::make_shared<HybridParallelPlugin>(options);
        cb::Booster booster(cb::BoosterOptions().plugin(plugin));
        auto model = make<models::GPT2LMHeadModel>();
        bool raising_step = false;
        auto boosted = booster.boost(
            model,
            colossalai::testing::make_optimizer(
                model->parameters(), true, &raising_step));
        bool raising = false;
        for (auto& p : model->parameters()) {
          if (p.requires_grad()) { // held by this stage
            p.register_hook([&raising](const at::Tensor& g) {
              TORCH_CHECK(!raising, "a hook raised");
              return g;
            });
            break;
          }
        }
        const int64_t local = kGlobalBatch / plugin->dp_size();
        int step = 0;
        std::string error;
        for (; step < kSteps; ++step) {
          auto b = batch(step, model->config().vocab_size());
          auto x = b.first.narrow(0, local * plugin->dp_rank(), local);
          auto y = b.second.narrow(0, local * plugin->dp_rank(), local);
          boosted.optimizer->zero_grad();
          raising = step == 1 && rank == raising_rank && !in_step;
          raising_step = step == 1 && rank == raising_rank && in_step;
          try {
            colossalai::testing::pipeline_step(booster, boosted, model, x, y);
            boosted.optimizer->step();
            EXPECT_LE(step, in_step && rank != raising_rank ? 1 : 0)
                << "rank " << rank << " completed step " << step;
          } catch (const cd::DistributedError& e) {
            error = e.what();
            break;
          } catch (const std::exception& e) {
            ADD_FAILURE() << "rank " << rank << ": " << e.what();
          }
          raising = false;
          raising_step = false;
        }
        EXPECT_LE(step, 2) << "rank " << rank << " trained on";
        EXPECT_NE(
            error.find(in_step ? "a step raised" : "a hook raised"),
            std::string::npos)
            << error;
        const std::string pass = in_step ? "step" : "pipeline step";
        EXPECT_NE(
            error.find(
                rank == raising_rank
                    ? "a " + pass + " raised here"
                    : "global rank " + std::to_string(raising_rank) + "'s " +
                        pass + " raised"),
            std::string::npos)
            << error;
      },
      o);
}

TEST(Pipeline, ABackwardRaisedInOneStageFailsEveryRank) {
  raise_in_one_stage(2, base().pp_size(2), 0);
  // Beside data parallelism (ZeRO-1 buckets), in a last stage.
  raise_in_one_stage(4, base().pp_size(2).zero_stage(1), 3);
}

TEST(Pipeline, AStepRaisedInOneStageFailsEveryRank) {
  raise_in_one_stage(2, base().pp_size(2), 1, true);
  raise_in_one_stage(4, base().pp_size(2).zero_stage(1), 0, true);
}

TEST(Pipeline, MisuseNamesTheOption) {
  run_distributed(2, [](int, int) {
    auto expect_error = [](const std::function<void()>& fn,
                           const std::string& what) {
      try {
        fn();
        ADD_FAILURE() << "no error; expected one naming " << what;
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos)
            << e.what();
      }
    };
    expect_error(
        [] { HybridParallelPlugin(HPO().precision("fp32").pp_size(2)); },
        "num_microbatches");
    expect_error(
        [] { HybridParallelPlugin(base().pp_size(2).zero_stage(2)); },
        "zero_stage 2");
    expect_error(
        [] { HybridParallelPlugin(base().pp_size(2).pp_style("interleaved")); },
        "num_model_chunks");
    expect_error(
        [] { HybridParallelPlugin(base().pp_size(2).pp_style("zbv")); },
        "num_model_chunks 2");
    expect_error(
        [] { HybridParallelPlugin(base().pp_size(2).pp_style("gpipe")); },
        "pp_style");
    expect_error(
        [] { HybridParallelPlugin(base().scheduler_nodes(gpipe(2))); },
        "scheduler_nodes schedule a pipeline; they need pp_size > 1");
    expect_error(
        [] {
          HybridParallelPlugin(
              base().pp_size(2).num_microbatches(8).scheduler_nodes(gpipe(2)));
        },
        "scheduler_nodes schedule 4 micro-batches, num_microbatches is 8");
    expect_error(
        [] {
          auto split = gpipe(2);
          for (auto& stage : split) {
            stage.back().kind = cp::ActionKind::kBackwardInput;
            stage.push_back(
                {cp::ActionKind::kBackwardWeight, 0, stage.back().micro_batch});
          }
          HybridParallelPlugin(base()
                                   .pp_size(2)
                                   .scheduler_nodes(split)
                                   .gradient_checkpointing_ratio(0.5));
        },
        "scheduler_nodes with split backward passes (BI, W) cannot "
        "recompute blocks");
    expect_error(
        [] {
          HybridParallelPlugin(base().pp_size(2).scheduler_nodes(gpipe(3)));
        },
        "HybridParallelPlugin: scheduler_nodes: one list of actions per "
        "pipeline stage");
    {
      // microbatch_size 1 splits 6 samples into 6 micro-batches.
      auto mine = std::make_shared<HybridParallelPlugin>(
          HPO().precision("fp32").pp_size(2).microbatch_size(1).scheduler_nodes(
              gpipe(2)));
      cb::Booster b(cb::BoosterOptions().plugin(mine));
      auto m = make<models::GPT2LMHeadModel>();
      auto bm = b.boost(
          m, colossalai::testing::make_optimizer(m->parameters(), true));
      auto ids6 = at::randint(100, {6, kSeq});
      expect_error(
          [&] {
            b.execute_pipeline(
                [&] {
                  return cp::Batch{ids6, ids6};
                },
                bm.model,
                [&](const at::Tensor& logits, const cp::Batch& mb) {
                  return m->loss(logits, mb[1]);
                },
                bm.optimizer.get());
          },
          "scheduler_nodes schedule 4 micro-batches, and this step has 6");
    }

    auto plugin = std::make_shared<HybridParallelPlugin>(base().pp_size(2));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make<models::GPT2LMHeadModel>();
    auto boosted = booster.boost(
        model, colossalai::testing::make_optimizer(model->parameters(), true));
    auto ids = at::randint(100, {6, kSeq});
    auto criterion = [&](const at::Tensor& logits, const cp::Batch& mb) {
      return model->loss(logits, mb[1]);
    };
    // The conventional call.
    expect_error([&] { boosted.model(ids); }, "execute_pipeline");
    // 6 samples into 4 micro-batches.
    expect_error(
        [&] {
          booster.execute_pipeline(
              [&] {
                return cp::Batch{ids, ids};
              },
              boosted.model,
              criterion,
              boosted.optimizer.get());
        },
        "num_microbatches 4");
    // Micro-batches of another shape after the metadata was cached: the
    // sender names the option (the receiver then times out).
    // A non-pipeline plugin.
    auto ddp = std::make_shared<cb::plugin::TorchDDPPlugin>();
    cb::Booster other(cb::BoosterOptions().plugin(ddp));
    auto m2 = make<models::GPT2LMHeadModel>();
    auto b2 = other.boost(
        m2, colossalai::testing::make_optimizer(m2->parameters(), true));
    expect_error(
        [&] {
          other.execute_pipeline(
              [&] {
                return cp::Batch{ids, ids};
              },
              b2.model,
              criterion,
              b2.optimizer.get());
        },
        "pp_size > 1");
  });
}

TEST(Pipeline, StagesHoldOnlyTheirLayersAndCacheMetadata) {
  run_distributed(2, [](int rank, int) {
    auto plugin = std::make_shared<HybridParallelPlugin>(base().pp_size(2));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make<models::GPT2LMHeadModel>();
    int64_t whole = 0;
    for (const auto& p : model->parameters()) {
      whole += p.numel();
    }
    auto boosted = booster.boost(
        model, colossalai::testing::make_optimizer(model->parameters(), true));
    int64_t held = 0;
    for (const auto& p : model->parameters()) {
      held += p.numel();
    }
    // Four of eight blocks; the first adds wte + wpe, the last ln_f + wte.
    EXPECT_LT(held, whole * 3 / 4) << "rank " << rank;
    int64_t in_optimizer = 0;
    for (const auto& p : boosted.optimizer->parameters()) {
      in_optimizer += p.numel();
    }
    EXPECT_EQ(in_optimizer, held);
    EXPECT_TRUE(
        model->transformer->h[rank == 0 ? 5 : 0]
            ->parameters()
            .front()
            .numel() == 0);
  });
}

// Saved at pp 2 x tp 2 (one file: each stage sends the tensors it owns to
// the writer, one at a time; sharded: each stage writes its own shards
// under one index), the checkpoint holds whole Hugging Face-layout tensors:
// a plain model, pp 4 and pp 1 x tp 2 x dp 2 load it and hold the same
// weights.
TEST(Pipeline, CheckpointFromPp2Tp2LoadsAtPp4Pp1AndInAPlainModel) {
  run_distributed(4, [](int rank, int) {
    namespace cio = colossalai::checkpoint_io;
    const auto dir = scratch(colossalai::testing::test_process(), "pp_ckpt");
    auto gpt2 = [](int seed) {
      torch::manual_seed(seed);
      return models::GPT2LMHeadModel(
          models::GPT2Config::tiny_test().n_layer(8));
    };
    auto criterion = [](models::GPT2LMHeadModel& m) {
      return [&m](const at::Tensor& logits, const cp::Batch& mb) {
        return m->loss(logits, mb[1]);
      };
    };
    std::map<std::string, at::Tensor> saved; // this stage's whole tensors
    {
      auto plugin =
          std::make_shared<HybridParallelPlugin>(base().pp_size(2).tp_size(2));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = gpt2(3);
      auto boosted = booster.boost(
          model,
          colossalai::testing::make_optimizer(model->parameters(), false));
      auto b = batch(0, 100);
      booster.execute_pipeline(
          [&] {
            return cp::Batch{b.first, b.second};
          },
          boosted.model,
          criterion(model),
          boosted.optimizer.get());
      boosted.optimizer->step();
      saved = whole_weights(*model, plugin->shard_info());
      booster.save_model(
          boosted.model,
          dir + "/model.safetensors",
          cio::SaveModelOptions().use_safetensors(true));
      booster.save_model(
          boosted.model,
          dir + "/sharded",
          cio::SaveModelOptions().shard(true).size_per_shard(1));
      // A save in parts that cannot start fails on every rank, by name.
      EXPECT_NE(
          colossalai::testing::error_of([&] {
            booster.save_model(
                boosted.model,
                dir + "/model.safetensors",
                cio::SaveModelOptions().shard(true));
          }).find("a file of that name exists"),
          std::string::npos);
    }
    // Every key of both stages is in the file: a plain model loads it
    // strictly, and this stage's tensors are bit-exact there.
    auto plain = gpt2(99 + rank);
    cio::GeneralCheckpointIO io;
    colossalai::interface::ModelWrapper wrapped(plain.ptr());
    io.load_model(wrapped, dir + "/model.safetensors");
    const auto whole = whole_weights(*plain, sf::ShardInfo());
    for (const auto& kv : saved) {
      EXPECT_TRUE(at::equal(whole.at(kv.first), kv.second)) << kv.first;
    }
    auto expect_loaded = [&](const std::map<std::string, at::Tensor>& got,
                             const std::string& what) {
      EXPECT_GT(got.size(), 0u) << what;
      for (const auto& kv : got) {
        EXPECT_TRUE(at::equal(whole.at(kv.first), kv.second))
            << what << ": " << kv.first;
      }
    };
    for (const auto& options :
         {base().pp_size(4), base().tp_size(2).zero_stage(1)}) {
      auto plugin = std::make_shared<HybridParallelPlugin>(options);
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto m = gpt2(5);
      auto boosted = booster.boost(
          m, colossalai::testing::make_optimizer(m->parameters(), false));
      const bool pp = options.pp_size() > 1;
      booster.load_model(
          boosted.model, dir + (pp ? "/sharded" : "/model.safetensors"));
      expect_loaded(
          whole_weights(*m, plugin->shard_info()), pp ? "pp 4" : "tp 2 dp 2");
    }
  });
  remove_scratch("pp_ckpt");
}

// Checkpoints taken mid-training resume at another layout, and the next
// step equals uninterrupted one-process training (SGD with momentum, so a
// momentum buffer lost or given to the wrong parameter moves weights by
// about 0.09 x a gradient, far beyond kSgdAtol):
//   A  pp2 x tp2, step 0, saves model and optimizer sharded (each stage
//      writes its own shards under one index);
//   B  pp2 x dp2 ZeRO-1 loads A, step 1, saves single files (each stage's
//      states go to the one writer);
//   C  pp1 x tp2 x dp2 ZeRO-1 loads B, step 2;
//   D  pp4 loads A, step 1.
TEST(Pipeline, TrainingResumesFromCheckpointsAtOtherLayouts) {
  run_distributed(4, [](int, int) {
    namespace cio = colossalai::checkpoint_io;
    namespace fs = std::filesystem;
    const auto dir = scratch(colossalai::testing::test_process(), "pp_resume");
    auto gpt2 = [](int seed) {
      torch::manual_seed(seed);
      return models::GPT2LMHeadModel(
          models::GPT2Config::tiny_test().n_layer(8));
    };
    auto expect_after = [&](int steps) {
      return colossalai::testing::train_one_process(
                 gpt2(3),
                 steps,
                 true,
                 0.0,
                 [](int step) { return batch(step, 100); })
          .second;
    };
    // Boosts a fresh model at `options`, loads `from` (model, optimizer)
    // unless empty, trains step `step`, checks the weights against
    // `steps + 1` one-process steps and saves to `to` unless empty.
    auto phase = [&](const std::string& name,
                     HPO options,
                     const std::pair<std::string, std::string>& from,
                     int step,
                     const std::pair<std::string, std::string>& to,
                     bool shard) {
      SCOPED_TRACE(name);
      auto plugin = std::make_shared<HybridParallelPlugin>(options);
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = gpt2(from.first.empty() ? 3 : 50);
      auto boosted = booster.boost(
          model,
          colossalai::testing::make_optimizer(model->parameters(), true));
      if (!from.first.empty()) {
        booster.load_model(boosted.model, from.first);
        booster.load_optimizer(*boosted.optimizer, from.second);
      }
      const int dp = plugin->dp_size();
      const int64_t local = kGlobalBatch / dp;
      auto b = batch(step, 100);
      auto x = b.first.narrow(0, local * plugin->dp_rank(), local);
      auto y = b.second.narrow(0, local * plugin->dp_rank(), local);
      boosted.optimizer->zero_grad();
      if (options.pp_size() > 1) {
        colossalai::testing::pipeline_step(booster, boosted, model, x, y);
      } else {
        booster.backward(model->loss(boosted.model(x), y), *boosted.optimizer);
      }
      boosted.optimizer->step();
      const auto want = expect_after(step + 1);
      const auto got = whole_weights(*model, plugin->shard_info());
      EXPECT_GT(got.size(), 0u);
      for (const auto& kv : got) {
        const at::Tensor diff = kv.second - want.at(kv.first);
        EXPECT_LE(diff.abs().max().item<double>(), kSgdAtol) << kv.first;
      }
      if (!to.first.empty()) {
        booster.save_model(
            boosted.model,
            to.first,
            cio::SaveModelOptions()
                .shard(shard)
                .size_per_shard(1)
                .use_safetensors(true));
        booster.save_optimizer(
            *boosted.optimizer,
            to.second,
            cio::SaveOptimizerOptions().shard(shard).size_per_shard(1));
      }
    };
    const auto a = std::make_pair(dir + "/a_model", dir + "/a_optim");
    const auto b =
        std::make_pair(dir + "/b_model.safetensors", dir + "/b_optim.bin");
    phase("A pp2 x tp2", base().pp_size(2).tp_size(2), {}, 0, a, true);
    // One index names every stage's shards, numbered across stages, and
    // no temporary is left.
    for (const auto& d : {a.first, a.second}) {
      int shards = 0;
      for (const auto& e : fs::directory_iterator(d)) {
        const auto f = e.path().filename().string();
        EXPECT_NE(f[0], '.') << f;
        shards += f.find("-of-") != std::string::npos;
      }
      EXPECT_GE(shards, 2) << d;
    }
    EXPECT_TRUE(fs::exists(a.first + "/model.safetensors.index.json"));
    EXPECT_TRUE(fs::exists(a.second + "/pytorch_optim.bin.index.json"));
    phase(
        "B pp2 x dp2 ZeRO-1", base().pp_size(2).zero_stage(1), a, 1, b, false);
    phase(
        "C tp2 x dp2 ZeRO-1", base().tp_size(2).zero_stage(1), b, 2, {}, false);
    phase("D pp4", base().pp_size(4), a, 1, {}, false);
  });
  remove_scratch("pp_resume");
}

} // namespace
