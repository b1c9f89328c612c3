// One cross-strategy harness: the same GPT, the same single-process
// reference, every data-parallel strategy (DDP, ZeRO-1, ZeRO-2, FSDP with one
// unit, FSDP with a unit per block, FSDP SHARD_GRAD_OP, Gemini) at world sizes
// 1, 2 and 4, with SGD + momentum and with AdamW, fp32. Adding a strategy means
// adding one line to `strategies()`.
//
// Exact equality where the arithmetic is the same:
//  - every strategy computes each rank's gradient with the same kernels on
//    the same micro-batch; only the averaging collective differs;
//  - at world 1 and 2 every average is the same (a + b is commutative, / 2 is
//    exact), so all strategies give identical weights;
//  - at world 4 the order in which four values are added depends on the
//    collective: Gloo's ring all-reduce starts each chunk's sum at another
//    rank, and its chunks follow the buffer's size, so DDP's buckets and
//    ZeRO-1's flat buckets add in different orders; our reduce-scatter adds
//    in rank order whatever the buffer. Strategies of one family (same
//    collective and buffers) are identical; families differ by rounding.
// Against one process with the global batch (SGD only, see the FSDP
// per-block test for why AdamW is not compared element by element):
// |w - ref| <= 1e-5 + 1e-4 |ref| — only the rounding of the batch sum
// differs, and SGD is linear in the gradient with coefficient <= lr (1 +
// momentum) per step; a wrong average (2x) or a lost rank moves weights by
// ~1e-2.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/gemini_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/booster/plugin/torch_fsdp_plugin.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/initialize.h>

#include <harness/multiprocess.h>
#include <harness/test_util.h>
#include <harness/zoo_util.h>
#include <zoo/gpt.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace cb = colossalai::booster;
namespace cz = colossalai::zero;
namespace zoo = colossalai::zoo;
using colossalai::testing::max_abs_diff;
using colossalai::testing::run_distributed;

namespace {

constexpr int kMicro = 2; // sequences per rank per step
constexpr int kSteps = 3;

zoo::GPTConfig tiny() {
  return zoo::GPTConfig::tiny_test();
}

struct Strategy {
  std::string name;
  // Reduction family: strategies of one family add values in one order.
  std::string family;
  std::function<std::shared_ptr<cb::plugin::Plugin>()> make;
  // Its AdamW steps some chunks on the host (offloaded optimizer state).
  bool host_optimizer = false;
};

std::vector<Strategy> strategies() {
  using P = std::shared_ptr<cb::plugin::Plugin>;
  auto zero = [](int stage) {
    return [stage]() -> P {
      return std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions()
              .stage(stage)
              .precision("fp32")
              .reduce_bucket_size_in_m(0.005)); // several buckets
    };
  };
  auto fsdp = [](bool per_block, cz::ShardingStrategy s) {
    return [per_block, s]() -> P {
      cb::plugin::TorchFSDPPluginOptions o;
      o.sharding_strategy(s);
      if (per_block) {
        o.auto_wrap_policy(cz::module_type_wrap_policy<zoo::BlockImpl>());
      }
      return std::make_shared<cb::plugin::TorchFSDPPlugin>(o);
    };
  };
  // Chunks of 4,500 elements (the largest parameter, 4,096, rounded up to
  // the 500-element search interval) that straddle the blocks: a block
  // gathers several chunks and a chunk serves several modules.
  using GO = cb::plugin::GeminiPluginOptions;
  auto gemini = [](std::function<GO(GO)> placement) {
    return [placement]() -> P {
      return std::make_shared<cb::plugin::GeminiPlugin>(
          placement(GO().precision("fp32")
                        .min_chunk_size_m(2000.0 / (1 << 20))
                        .search_range_m(0)
                        .hidden_dim(500)
                        .max_prefetch(1)));
    };
  };
  return {
      {"ddp",
       "all_reduce",
       []() -> P { return std::make_shared<cb::plugin::TorchDDPPlugin>(); }},
      {"zero1", "all_reduce over flat buckets", zero(1)},
      {"zero2", "reduce_scatter", zero(2)},
      // Two copies of the sharded states, each over half the ranks; at one
      // rank, one copy.
      {"zero2_extra_dp",
       "reduce_scatter + all_reduce",
       []() -> P {
         return std::make_shared<cb::plugin::LowLevelZeroPlugin>(
             cb::plugin::LowLevelZeroPluginOptions()
                 .stage(2)
                 .precision("fp32")
                 .reduce_bucket_size_in_m(0.005)
                 .extra_dp_size(std::min(
                     2, colossalai::distributed::world_group()->size())));
       }},
      {"fsdp", "reduce_scatter", fsdp(false, cz::ShardingStrategy::kFullShard)},
      {"fsdp_blocks",
       "reduce_scatter",
       fsdp(true, cz::ShardingStrategy::kFullShard)},
      {"fsdp_shard_grad_op",
       "reduce_scatter",
       fsdp(true, cz::ShardingStrategy::kShardGradOp)},
      {"gemini", "reduce_scatter", gemini([](GO o) { return o; })},
      // Static placement with every fp32 shard on the host and half the
      // chunks reading their parameters from there at each gather.
      {"gemini_offload",
       "reduce_scatter",
       gemini([](GO o) {
         return o.offload_optim_frac(1.0).offload_param_frac(0.5);
       }),
       true},
      // Two copies of the chunks (hybrid sharding), each sharded over half
      // the ranks; at one rank, one copy.
      {"gemini_extra_dp", "reduce_scatter + all_reduce", gemini([](GO o) {
         return o.extra_dp_size(
             std::min(2, colossalai::distributed::world_group()->size()));
       })},
      // Auto placement, half the chunks kept gathered between uses.
      {"gemini_auto",
       "reduce_scatter",
       gemini([](GO o) {
         return o.placement_policy("auto").shard_param_frac(0.5);
       }),
       true},
  };
}

Strategy strategy_named(const std::string& name) {
  for (auto& s : strategies()) {
    if (s.name == name) {
      return s;
    }
  }
  TORCH_CHECK(false, "no strategy named ", name);
}

std::shared_ptr<torch::optim::Optimizer> make_opt(
    zoo::GPT& m,
    bool sgd,
    const bool* raising_step = nullptr) {
  return colossalai::testing::make_optimizer(
      m->parameters(), sgd, raising_step);
}

zoo::GPT make_model() {
  torch::manual_seed(42);
  return zoo::GPT(tiny());
}

std::pair<at::Tensor, at::Tensor> global_batch(int step, int world) {
  return zoo::random_tokens(kMicro * world, tiny(), 1000 + step);
}

// A first backward at step `step` raises halfway, from a hook on parameter
// `where[rank]` of model->parameters() (`where[0]` when there is none for
// the rank), on the ranks listed (every rank: none listed). The loop goes on
// as a training loop that skips such a batch would: zero_grad, the step
// again. `booster` false: the raised backward is the loss's own, not
// Booster::backward. `forward`: the forward raises instead, as it begins,
// after FSDP and Gemini gathered (token ids of a floating dtype: checked on
// the host, where an id out of range would be a device-side assert on a
// GPU). `in_step`: the optimizer's step raises instead, after a whole
// backward; `skip_step`: no raise, that step is not taken.
struct Raise {
  int step = -1;
  std::vector<size_t> where{kMiddle};
  std::vector<int> ranks;
  bool booster = true;
  bool forward = false;
  bool in_step = false;
  bool skip_step = false;
  static constexpr size_t kMiddle = static_cast<size_t>(-1);
};

// Full weights after kSteps under `plugin` (gathered where sharded), with
// the pass that `raise` says raising.
std::vector<at::Tensor> train(
    const Strategy& s,
    bool sgd,
    int rank,
    int world,
    const Raise& raise = {}) {
  cb::Booster booster(cb::BoosterOptions().plugin(s.make()));
  auto model = make_model();
  bool raising = false;
  bool raising_step = false;
  auto boosted = booster.boost(model, make_opt(model, sgd, &raising_step));
  const auto params = model->parameters();
  const size_t where = raise.where.size() > static_cast<size_t>(rank)
      ? raise.where[rank]
      : raise.where[0];
  params[where == Raise::kMiddle ? params.size() / 2 : where].register_hook(
      [&raising](const at::Tensor& g) {
        TORCH_CHECK(!raising, "a hook raised");
        return g;
      });
  const bool raises_here = raise.ranks.empty() ||
      std::count(raise.ranks.begin(), raise.ranks.end(), rank) > 0;
  for (int step = 0; step < kSteps; ++step) {
    auto b = global_batch(step, world);
    auto x = b.first.narrow(0, kMicro * rank, kMicro);
    auto y = b.second.narrow(0, kMicro * rank, kMicro);
    boosted.optimizer->zero_grad();
    if (step == raise.step && raises_here && !raise.in_step &&
        !raise.skip_step) {
      raising = true;
      try {
        auto loss = zoo::gpt_loss(
            boosted.model(raise.forward ? x.to(at::kFloat) : x), y);
        if (raise.booster) {
          booster.backward(loss, *boosted.optimizer);
        } else {
          loss.backward();
        }
        ADD_FAILURE() << "the pass did not raise";
      } catch (const colossalai::distributed::DistributedError&) {
        throw; // the ranks did not raise alike: the run is over
      } catch (const std::exception& e) {
        const std::string msg = e.what();
        EXPECT_NE(
            msg.find(raise.forward ? "int64 token ids" : "a hook raised"),
            std::string::npos)
            << msg;
      }
      raising = false;
      // FSDP's full parameters (a checkpoint's save or load) put its
      // gradient hooks back while the raised backward's leftovers may
      // still hold the accumulators: one report per backward all the same.
      if (auto* f = colossalai::interface::find_wrapper<cz::FullyShardedModel>(
              *boosted.model.wrapper())) {
        auto guard = f->summon_full_params();
      }
      boosted.optimizer->zero_grad();
    }
    booster.backward(zoo::gpt_loss(boosted.model(x), y), *boosted.optimizer);
    if (step == raise.step && raises_here && raise.skip_step) {
      continue;
    }
    if (step == raise.step && raises_here && raise.in_step) {
      raising_step = true;
      try {
        boosted.optimizer->step();
        ADD_FAILURE() << "the step did not raise";
      } catch (const colossalai::distributed::DistributedError&) {
        throw; // the ranks did not raise alike: the run is over
      } catch (const std::exception& e) {
        EXPECT_NE(
            std::string(e.what()).find("a step raised"), std::string::npos)
            << e.what();
      }
      raising_step = false;
      continue;
    }
    boosted.optimizer->step();
  }
  auto* f = colossalai::interface::find_wrapper<cz::FullyShardedModel>(
      *boosted.model.wrapper());
  // On the host: the reference trains there (COLOSSALAI_DEVICE=cuda runs
  // the strategies on a GPU).
  std::vector<at::Tensor> out;
  if (f != nullptr) {
    auto guard = f->summon_full_params();
    for (const auto& p : model->parameters()) {
      out.push_back(p.detach().cpu().clone());
    }
  } else {
    for (const auto& p : model->parameters()) {
      out.push_back(p.detach().cpu().clone());
    }
  }
  return out;
}

std::vector<at::Tensor> reference(bool sgd, int world) {
  auto model = make_model();
  auto opt = make_opt(model, sgd);
  for (int step = 0; step < kSteps; ++step) {
    auto b = global_batch(step, world);
    opt->zero_grad();
    zoo::gpt_loss(model(b.first), b.second).backward();
    opt->step();
  }
  return model->parameters();
}

void every_strategy(int rank, int world) {
  colossalai::testing::deterministic_on_gpu(); // runs compare bitwise
  const bool on_gpu = !colossalai::current_device().is_cpu();
  for (bool sgd : {true, false}) {
    const std::string opt = sgd ? "SGD" : "AdamW";
    std::map<std::string, std::vector<at::Tensor>> first_of_family;
    std::vector<at::Tensor> ddp;
    for (const auto& s : strategies()) {
      // On the host: references are computed on the CPU.
      auto got = colossalai::testing::host(train(s, sgd, rank, world));
      if (ddp.empty()) {
        ddp = got;
      }
      // On a GPU, AdamW stepped on the host rounds differently from the
      // device's (testing::same_across_tiers): those strategies are a family
      // of their own there, and the bound against ddp below covers both.
      const std::string tier =
          on_gpu && !sgd && s.host_optimizer ? " (AdamW on the host)" : "";
      auto& anchor = first_of_family[(world > 2 ? s.family : "") + tier];
      if (anchor.empty()) {
        anchor = got;
      }
      ASSERT_EQ(got.size(), anchor.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(at::equal(got[i], anchor[i]))
            << s.name << ", " << opt << ", world " << world << ": parameter "
            << i << " differs from the first " << s.family << tier
            << " strategy by "
            << (got[i] - anchor[i]).abs().max().item<double>();
      }
      if (sgd) {
        auto ref = reference(sgd, world);
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_TRUE(at::allclose(got[i], ref[i], 1e-4, 1e-5))
              << s.name << ", SGD, world " << world << ": parameter " << i
              << " differs from one process by "
              << (got[i] - ref[i]).abs().max().item<double>();
        }
      }
      // Families differ by rounding alone: for SGD by the bound above; for
      // AdamW by at most twice the largest update, lr (1 - b1) / sqrt(1 -
      // b2) = 3.2 lr per step, the most rounding can do to an update.
      EXPECT_LE(max_abs_diff(got, ddp), sgd ? 1e-5 : 2 * kSteps * 3.2e-3)
          << s.name << ", " << opt;
    }
  }
}

// NOTE [A backward that raised]: a backward that raised halfway leaves
// nothing behind that zero_grad does not clear. The hook raises after the
// later half's gradients were bucketed (some collectives launched, some
// completed, FSDP's units gathered for the backward), on every rank alike;
// FSDP's full parameters are summoned before the next backward. Through
// Booster::backward, through the loss's own backward, and a forward that
// raised instead (as it began, after FSDP and Gemini gathered).
void raised_pass_dropped(int rank, int world) {
  colossalai::testing::deterministic_on_gpu();
  for (const auto& s : strategies()) {
    for (int variant = 0; variant < 3; ++variant) {
      Raise raise;
      raise.step = 1;
      raise.booster = variant != 1;
      raise.forward = variant == 2;
      EXPECT_EQ(
          colossalai::testing::differing(
              train(s, false, rank, world),
              train(s, false, rank, world, raise)),
          std::vector<size_t>{})
          << s.name << ", world " << world
          << (variant == 1       ? ", the loss's own backward"
                  : variant == 2 ? ", the forward"
                                 : "");
    }
  }
}

// NOTE [A step that raised]: a step whose optimizer raised on every rank
// (before it updated anything) is the same, bit for bit, as a step not
// taken, under every strategy.
void raised_step_dropped(int rank, int world) {
  colossalai::testing::deterministic_on_gpu();
  for (const auto& s : strategies()) {
    Raise skip;
    skip.step = 1;
    skip.skip_step = true;
    Raise raise;
    raise.step = 1;
    raise.in_step = true;
    const auto skipped = train(s, false, rank, world, skip);
    EXPECT_EQ(
        colossalai::testing::differing(
            skipped, train(s, false, rank, world, raise)),
        std::vector<size_t>{})
        << s.name << ", world " << world;
    // The skip is visible: the runs differ from one that took the step.
    EXPECT_FALSE(
        colossalai::testing::differing(skipped, train(s, false, rank, world))
            .empty())
        << s.name;
  }
}

// NOTE [A backward that raised on some ranks]: a backward raised on rank 0
// alone (raise.ranks), or on both ranks after different collectives
// (raise.where); every rank then fails with a DistributedError, none goes
// on with gradients paired across two backwards, and the group refuses
// what comes next by name.
void raised_unlike(const std::string& strategy, const Raise& raise) {
  colossalai::testing::MultiProcessOptions o;
  // What the raised rank waits for; also the rendezvous's limit, which a
  // loaded 2-core machine needs seconds of.
  o.collective_timeout_seconds = 6;
  o.final_barrier = false;          // the group is broken, by design
  run_distributed(
      2,
      [&](int rank, int world) {
        const auto s = strategy_named(strategy);
        std::string msg;
        try {
          train(s, false, rank, world, raise);
          ADD_FAILURE() << strategy << ": rank " << rank << " went on";
        } catch (const colossalai::distributed::DistributedError& e) {
          msg = e.what();
        }
        const bool raised = raise.ranks.empty() || raise.ranks.front() == rank;
        const std::string cause = raise.forward ? "int64 token ids"
            : raise.in_step                     ? "a step raised"
                                                : "a hook raised";
        if (raised) {
          EXPECT_NE(msg.find(cause), std::string::npos) << msg;
          EXPECT_NE(
              msg.find(
                  raise.ranks.empty() ? "after different numbers"
                                      : "1 of the group's 2 ranks did not"),
              std::string::npos)
              << msg;
          const auto refused = colossalai::testing::error_of([] {
            colossalai::distributed::barrier(
                *colossalai::distributed::world_group())
                .wait();
          });
          EXPECT_NE(refused.find("barrier refused"), std::string::npos)
              << refused;
        } else {
          // Its collectives wait for ones rank 0 never issues; its error
          // names what raised there.
          EXPECT_NE(msg.find("failed: global rank 0's"), std::string::npos)
              << msg;
          EXPECT_NE(msg.find(cause), std::string::npos) << msg;
        }
      },
      o);
}

} // namespace

TEST(Strategies, ARaisedPassIsDroppedOnOneRank) {
  run_distributed(1, raised_pass_dropped);
}

TEST(Strategies, ARaisedPassIsDroppedOnTwoRanks) {
  run_distributed(2, raised_pass_dropped);
}

TEST(Strategies, ARaisedStepIsDroppedOnOneRank) {
  run_distributed(1, raised_step_dropped);
}

TEST(Strategies, ARaisedStepIsDroppedOnTwoRanks) {
  run_distributed(2, raised_step_dropped);
}

// NOTE [A step that raised]: on one rank only, every rank fails, whether
// the step communicates (ZeRO's all-gather) or not (DDP's replicas, FSDP's
// and Gemini's shards).
TEST(Strategies, AStepRaisedOnOneRankFailsEveryRank) {
  Raise raise;
  raise.step = 1;
  raise.ranks = {0};
  raise.in_step = true;
  for (const char* s : {"ddp", "zero2", "fsdp_blocks", "gemini_auto"}) {
    SCOPED_TRACE(s);
    raised_unlike(s, raise);
  }
}

TEST(Strategies, ABackwardRaisedOnOneRankFailsEveryRank) {
  Raise raise;
  raise.step = 1;
  raise.ranks = {0};
  for (const char* s : {"zero2", "fsdp_blocks", "gemini_offload"}) {
    SCOPED_TRACE(s);
    raised_unlike(s, raise);
  }
}

// NOTE [A backward that raised on some ranks]: a pass that raised on one
// rank before it issued any collective left nothing to pair up: the other
// ranks wait for its collectives as for a slow rank, and its step again
// issues them. DDP's one bucket of the tiny GPT is not full when the hook
// raises; LowLevelZero and DDP communicate nothing in the forward. Bit for
// bit the weights of training without the raise, on both ranks.
void raised_before_any_collective(const std::string& strategy, Raise raise) {
  raise.step = 1;
  raise.ranks = {0};
  run_distributed(2, [&](int rank, int world) {
    const auto s = strategy_named(strategy);
    EXPECT_EQ(
        colossalai::testing::differing(
            train(s, false, rank, world), train(s, false, rank, world, raise)),
        std::vector<size_t>{})
        << strategy << (raise.forward ? ", forward" : ", backward");
  });
}

TEST(Strategies, APassRaisedOnOneRankBeforeAnyCollectiveIsDropped) {
  raised_before_any_collective("ddp", Raise());
  Raise forward;
  forward.forward = true;
  for (const char* s : {"ddp", "zero1", "zero2"}) {
    raised_before_any_collective(s, forward);
  }
}

// A forward that gathers parameters (FSDP, Gemini) and raised on one rank
// fails every rank.
TEST(Strategies, AForwardRaisedOnOneRankFailsEveryRankWhereItGathers) {
  Raise raise;
  raise.step = 1;
  raise.ranks = {0};
  raise.forward = true;
  for (const char* s : {"fsdp_blocks", "gemini"}) {
    SCOPED_TRACE(s);
    raised_unlike(s, raise);
  }
}

TEST(Strategies, BackwardsRaisedAtDifferentPointsFailEveryRank) {
  // Rank 0 raises after the first bucket launched, rank 1 after the second
  // and before it waits on any (two may be in flight). Rank 1 raising later
  // waits in a collective rank 0 never issues (as it does where the
  // backward gathers parameters, FSDP and Gemini): the case above.
  Raise raise;
  raise.step = 1;
  const size_t n = zoo::GPT(tiny())->parameters().size();
  raise.where = {n - 6, n - 10};
  for (const char* s : {"zero1", "zero2"}) {
    SCOPED_TRACE(s);
    raised_unlike(s, raise);
  }
}

TEST(Strategies, AllMatchOnOneRank) {
  run_distributed(1, every_strategy);
}

TEST(Strategies, AllMatchOnTwoRanks) {
  run_distributed(2, every_strategy);
}

TEST(Strategies, AllMatchOnFourRanks) {
  run_distributed(4, every_strategy);
}
