// TorchDDPPlugin on real processes against single-process training.
//
// Tolerance: DDP averages per-rank mean gradients ((1/N) sum_r g_r) where the
// reference takes the mean over the global batch; both are the same sum in a
// different order, so fp32 results differ by rounding only. After 5 AdamW
// steps we require |ddp - ref| <= 1e-5 + 1e-4 |ref| (Adam's normalisation
// can amplify a 1e-7 gradient difference on near-zero gradients to ~1e-6 in
// the update).

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/torch_ddp_model.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>

#include <src/distributed/grad_bucketer.h>

#include <harness/multiprocess.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include <unistd.h>

namespace cb = colossalai::booster;
using colossalai::testing::run_distributed;

namespace {

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(bool with_unused = false) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 32));
    fc3 = register_module("fc3", torch::nn::Linear(32, 4));
    if (with_unused) {
      unused = register_module("unused", torch::nn::Linear(32, 4));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc3(torch::gelu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, unused{nullptr};
};
TORCH_MODULE(MLP);

at::Tensor mse(const at::Tensor& a, const at::Tensor& b) {
  return torch::mse_loss(a, b);
}

// The global batch of step s: 4 samples per rank for `world` ranks.
std::pair<at::Tensor, at::Tensor> global_batch(int step, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = at::randn({4 * world, 8}, gen);
  auto y = at::randn({4 * world, 4}, gen);
  return {x, y};
}

std::pair<at::Tensor, at::Tensor> local_batch(int step, int rank, int world) {
  auto b = global_batch(step, world);
  return {b.first.narrow(0, 4 * rank, 4), b.second.narrow(0, 4 * rank, 4)};
}

MLP make_model(bool with_unused = false) {
  torch::manual_seed(42);
  return MLP(with_unused);
}

std::shared_ptr<torch::optim::AdamW> adamw(MLP& m) {
  return std::make_shared<torch::optim::AdamW>(
      m->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
}

// Single-process training on the global batch.
std::vector<at::Tensor> reference(int steps, int world, double clip = 0) {
  auto model = make_model();
  auto opt = adamw(model);
  for (int s = 0; s < steps; ++s) {
    auto b = global_batch(s, world);
    opt->zero_grad();
    mse(model(b.first), b.second).backward();
    if (clip > 0) {
      torch::nn::utils::clip_grad_norm_(model->parameters(), clip);
    }
    opt->step();
  }
  return model->parameters();
}

void expect_close(
    const std::vector<at::Tensor>& got,
    const std::vector<at::Tensor>& want,
    const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const auto g = colossalai::testing::host(got[i]);
    EXPECT_TRUE(at::allclose(g, want[i], 1e-4, 1e-5))
        << what << ": parameter " << i << " differs by "
        << (g - want[i]).abs().max().item<double>();
  }
}

void train_ddp_matches(
    int rank,
    int world,
    cb::plugin::TorchDDPPluginOptions o,
    double clip = 0) {
  auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>(o);
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  // Different seeds per rank: the plugin must broadcast rank 0's weights.
  torch::manual_seed(42 + rank);
  MLP model;
  if (rank == 0) {
    model = make_model();
  }
  auto opt = adamw(model);
  auto boosted = booster.boost(model, opt, mse);
  const int steps = 5;
  for (int s = 0; s < steps; ++s) {
    auto b = local_batch(s, rank, world);
    boosted.optimizer->zero_grad();
    auto loss = boosted.criterion(boosted.model(b.first), b.second);
    booster.backward(loss, *boosted.optimizer);
    if (clip > 0) {
      boosted.optimizer->clip_grad_by_norm(clip);
    }
    boosted.optimizer->step();
  }
  expect_close(
      boosted.model.parameters(),
      reference(steps, world, clip),
      "DDP vs single process");
}

} // namespace

// The one bucket planner (DDP in bytes with a small first bucket per dtype
// and device; ZeRO in elements over every parameter alike; FSDP and Gemini
// by unit).
TEST(TorchDDP, OneBucketPlanner) {
  const std::vector<at::Tensor> params{
      at::zeros({4}), // 16 bytes
      at::zeros({8}, at::kBFloat16), // 16 bytes
      at::zeros({300}), // 1200 bytes
      at::zeros({2}), // 8 bytes
      at::zeros({10})}; // 40 bytes
  colossalai::distributed::BucketPlanOptions ddp;
  ddp.cap = 1024;
  ddp.first_cap = 32;
  // Reverse order: fp32 4 (40 bytes) fills the first fp32 bucket past its
  // 32, so 3 opens the next; 2 (1200 bytes) overflows that and has one
  // alone; 0 would pass 1024 with it; bf16 1 has a bucket of its own kind.
  using Plan = std::vector<std::vector<size_t>>;
  EXPECT_EQ(
      colossalai::distributed::plan_buckets(params, ddp),
      (Plan{{4}, {3}, {2}, {1}, {0}}));
  ddp.first_cap = -1;
  EXPECT_EQ(
      colossalai::distributed::plan_buckets(params, ddp),
      (Plan{{4, 3}, {2}, {1}, {0}}));
  colossalai::distributed::BucketPlanOptions zero;
  zero.cap = 14;
  zero.bytes = false;
  zero.by_dtype_and_device = false;
  EXPECT_EQ(
      colossalai::distributed::plan_buckets(params, zero),
      (Plan{{4, 3}, {2}, {1, 0}}));
  // FSDP / Gemini: one bucket per unit, whatever the sizes and dtypes.
  colossalai::distributed::BucketPlanOptions units;
  units.cap = std::numeric_limits<int64_t>::max();
  units.by_dtype_and_device = false;
  units.groups = {0, 0, 1, 1, 1};
  EXPECT_EQ(
      colossalai::distributed::plan_buckets(params, units),
      (Plan{{4, 3, 2}, {1, 0}}));
}

// A bucket whose launch starts no collective (one rank) completes in the
// hook that finished it with complete_local_at_once (what the sharded
// engines set, so a host shard's update can start there: NOTE [Host steps
// overlap the backward]); without it, it waits until max_in_flight later
// launches push it out, or until the backward finalizes. A refusal in
// before_backward leaves the bucketer as it was.
TEST(GradBucketer, LocalBucketsCompleteAtOnceWhereAsked) {
  namespace cd = colossalai::distributed;
  struct Recorder : cd::BucketHandler {
    std::vector<std::string> events;
    bool refuse = false;
    void before_backward() override {
      TORCH_CHECK(!refuse, "refused");
    }
    void fill(size_t, bool) override {}
    cd::Work launch(size_t b) override {
      events.push_back("launch " + std::to_string(b));
      return cd::Work(); // one rank: no collective
    }
    void complete(size_t b) override {
      events.push_back("complete " + std::to_string(b));
    }
    void on_finalized(bool) override {
      events.push_back("finalized");
    }
  };
  for (bool at_once : {false, true}) {
    SCOPED_TRACE(at_once);
    Recorder handler;
    cd::GradBucketerOptions o;
    o.ordered = false;
    o.max_in_flight = 2;
    o.complete_local_at_once = at_once;
    // The backward reaches c (bucket 2) first, then b, then a.
    auto c = torch::ones({2}, torch::requires_grad());
    auto b = torch::ones({2}, torch::requires_grad());
    auto a = torch::ones({2}, torch::requires_grad());
    auto bucketer = std::make_shared<cd::GradBucketer>(
        3, std::vector<std::vector<size_t>>{{0}, {1}, {2}}, &handler, o);
    size_t bad = 0;
    ASSERT_TRUE(bucketer->attach_hooks({a, b, c}, &bad));
    auto loss = ((c * 3).sum() * 2 + b.sum()) * 2 + a.sum();
    loss.backward();
    const std::vector<std::string> at_once_order = {
        "launch 2", "complete 2", "launch 1", "complete 1",
        "launch 0", "complete 0", "finalized"};
    // The third launch pushes the first out; finalize completes the rest.
    const std::vector<std::string> bounded_order = {
        "launch 2", "launch 1", "launch 0", "complete 2",
        "complete 1", "complete 0", "finalized"};
    EXPECT_EQ(handler.events, at_once ? at_once_order : bounded_order);
    handler.events.clear();
    handler.refuse = true;
    auto again = (a + b + c).sum();
    EXPECT_THROW(again.backward(), c10::Error);
    EXPECT_FALSE(bucketer->in_backward());
    EXPECT_TRUE(handler.events.empty());
  }
}

TEST(TorchDDP, MatchesSingleProcessTwoRanks) {
  run_distributed(
      2, [](int rank, int world) { train_ddp_matches(rank, world, {}); });
}

TEST(TorchDDP, MatchesSingleProcessThreeRanksManyBuckets) {
  run_distributed(3, [](int rank, int world) {
    // ~1 KB buckets: every parameter in its own bucket, many in flight.
    auto o = cb::plugin::TorchDDPPluginOptions().bucket_cap_mb(0.001);
    train_ddp_matches(rank, world, o);
  });
}

TEST(TorchDDP, GradientAsBucketView) {
  run_distributed(2, [](int rank, int world) {
    train_ddp_matches(
        rank,
        world,
        cb::plugin::TorchDDPPluginOptions().gradient_as_bucket_view(true));
  });
}

TEST(TorchDDP, ClipGradByNormMatches) {
  run_distributed(2, [](int rank, int world) {
    train_ddp_matches(rank, world, {}, /*clip=*/0.05);
  });
}

TEST(TorchDDP, BucketsFollowReverseOrderWithSmallFirstBucket) {
  run_distributed(2, [](int rank, int) {
    auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>(
        cb::plugin::TorchDDPPluginOptions().bucket_cap_mb(0.002));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make_model();
    auto boosted = booster.boost(model);
    auto* ddp = colossalai::interface::find_wrapper<cb::plugin::TorchDDPModel>(
        *boosted.model.wrapper());
    ASSERT_NE(ddp, nullptr);
    // Reverse registration order into a ~2 KB bucket: fc3.bias (4),
    // fc3.weight (128), fc2.bias (32); fc2.weight (4 KB) opens the next.
    auto numels = ddp->bucket_numels();
    ASSERT_GE(numels.size(), 2u);
    EXPECT_EQ(numels.front(), 4 + 128 + 32);
    EXPECT_EQ(numels[1], 32 * 32);
    int64_t total = 0;
    for (auto n : numels)
      total += n;
    EXPECT_EQ(total, 8 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4);

    // Communication overlaps backward: every bucket starts its all-reduce
    // from a gradient hook, while earlier layers' gradients are still being
    // computed, not after backward.
    auto x = at::randn({4, 8});
    boosted.model(x).sum().backward();
    EXPECT_EQ(ddp->buckets_overlapped(), numels.size());
  });
}

TEST(TorchDDP, NoSyncAccumulationEqualsOneStepOnTheUnion) {
  run_distributed(2, [](int rank, int world) {
    const int k = 3; // micro-batches
    auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make_model();
    auto opt = std::make_shared<torch::optim::SGD>(
        model->parameters(), torch::optim::SGDOptions(0.1));
    auto boosted = booster.boost(model, opt, mse);
    boosted.optimizer->zero_grad();
    for (int m = 0; m < k; ++m) {
      auto b = local_batch(m, rank, world);
      auto loss = boosted.criterion(boosted.model(b.first), b.second) / k;
      if (m < k - 1) {
        auto guard = booster.no_sync(boosted.model, boosted.optimizer.get());
        booster.backward(loss, *boosted.optimizer);
        // Not synchronized yet: local gradients differ between ranks.
        auto g = model->fc1->weight.grad().clone();
        auto other = g.clone();
        colossalai::distributed::broadcast(
            other, 0, *colossalai::distributed::world_group())
            .wait();
        if (rank == 1) {
          EXPECT_FALSE(at::allclose(g, other));
        }
      } else {
        booster.backward(loss, *boosted.optimizer);
      }
    }
    boosted.optimizer->step();

    // Reference: one SGD step on the union of all micro-batches of all ranks.
    auto ref = make_model();
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    std::vector<at::Tensor> xs, ys;
    for (int m = 0; m < k; ++m) {
      auto b = global_batch(m, world);
      xs.push_back(b.first);
      ys.push_back(b.second);
    }
    ref_opt.zero_grad();
    // Mean over micro-batches of per-micro-batch means.
    at::Tensor loss = at::zeros({});
    for (int m = 0; m < k; ++m) {
      loss = loss + mse(ref(xs[m]), ys[m]) / k;
    }
    loss.backward();
    ref_opt.step();
    expect_close(model->parameters(), ref->parameters(), "no_sync");
  });
}

TEST(TorchDDP, UnusedParametersAreReportedOrHandled) {
  run_distributed(2, [](int rank, int world) {
    {
      auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = make_model(/*with_unused=*/true);
      auto boosted = booster.boost(model, adamw(model), mse);
      auto b = local_batch(0, rank, world);
      try {
        booster.backward(
            boosted.criterion(boosted.model(b.first), b.second),
            *boosted.optimizer);
        ADD_FAILURE() << "expected an error naming the unused parameters";
      } catch (const c10::Error& e) {
        std::string msg = e.what();
        EXPECT_NE(msg.find("unused.weight"), std::string::npos) << msg;
        EXPECT_NE(msg.find("find_unused_parameters"), std::string::npos);
      }
    }
    for (bool static_graph : {false, true}) {
      auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>(
          cb::plugin::TorchDDPPluginOptions()
              .find_unused_parameters(true)
              .static_graph(static_graph));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = make_model(/*with_unused=*/true);
      auto opt = adamw(model);
      auto boosted = booster.boost(model, opt, mse);
      for (int s = 0; s < 3; ++s) {
        auto b = local_batch(s, rank, world);
        boosted.optimizer->zero_grad();
        booster.backward(
            boosted.criterion(boosted.model(b.first), b.second),
            *boosted.optimizer);
        EXPECT_FALSE(model->unused->weight.grad().defined());
        boosted.optimizer->step();
      }
      auto ref = reference(3, world);
      auto got = model->parameters();
      got.resize(ref.size()); // the unused layer is registered last
      expect_close(got, ref, "find_unused_parameters");
    }
  });
}

// NOTE [A backward that raised]: a flush right after a backward that
// raised (static_graph reports the unused parameters from inside the
// flush, through the bucketer's begin) recovers the bucketer once, first;
// training then equals training that never saw the raised backward.
TEST(TorchDDP, FlushRightAfterABackwardThatRaised) {
  run_distributed(2, [](int rank, int world) {
    auto train = [&](bool raise) {
      auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>(
          cb::plugin::TorchDDPPluginOptions()
              .find_unused_parameters(true)
              .static_graph(true)
              .bucket_cap_mb(0.002)); // several buckets, some launched
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = make_model(/*with_unused=*/true);
      auto boosted = booster.boost(model, adamw(model), mse);
      auto* ddp = colossalai::interface::find_wrapper<cb::plugin::TorchDDPModel>(
          *boosted.model.wrapper());
      bool fail = false;
      model->fc1->weight.register_hook([&fail](const at::Tensor& g) {
        TORCH_CHECK(!fail, "a hook raised");
        return g;
      });
      auto backward = [&](int s) {
        auto b = local_batch(s, rank, world);
        booster.backward(
            boosted.criterion(boosted.model(b.first), b.second),
            *boosted.optimizer);
      };
      for (int s = 0; s < 3; ++s) {
        boosted.optimizer->zero_grad();
        if (raise && s == 1) {
          fail = true;
          const auto msg = colossalai::testing::error_of([&] { backward(s); });
          fail = false;
          EXPECT_NE(msg.find("a hook raised"), std::string::npos) << msg;
          ddp->sync_gradients(); // averages what the raised one left
          boosted.optimizer->zero_grad();
        }
        backward(s);
        boosted.optimizer->step();
      }
      return colossalai::testing::snapshot(model->parameters());
    };
    EXPECT_EQ(
        colossalai::testing::differing(train(false), train(true)),
        std::vector<size_t>{});
  });
}

TEST(TorchDDP, Bf16TrainsAndStaysInSync) {
  run_distributed(2, [](int rank, int world) {
    auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
    cb::Booster booster(
        cb::BoosterOptions().plugin(plugin).mixed_precision("bf16"));
    auto model = make_model();
    auto boosted = booster.boost(model, adamw(model), mse);
    double first = 0, last = 0;
    auto b = local_batch(0, rank, world);
    for (int s = 0; s < 30; ++s) {
      boosted.optimizer->zero_grad();
      auto out = boosted.model(b.first);
      EXPECT_EQ(out.scalar_type(), at::kBFloat16); // autocast was on
      auto loss = boosted.criterion(out.to(at::kFloat), b.second);
      booster.backward(loss, *boosted.optimizer);
      boosted.optimizer->step();
      (s == 0 ? first : last) = loss.item<double>();
    }
    EXPECT_LT(last, 0.7 * first);
    // Replicas stay identical.
    for (auto& p : model->parameters()) {
      auto other = p.detach().clone();
      colossalai::distributed::broadcast(
          other, 0, *colossalai::distributed::world_group())
          .wait();
      EXPECT_TRUE(at::equal(other, p.detach()));
    }
  });
}

TEST(TorchDDP, BuffersBroadcastFromRankZero) {
  run_distributed(2, [](int rank, int) {
    torch::manual_seed(1);
    auto model = torch::nn::Sequential(
        torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
    auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto boosted = booster.boost(model.ptr());
    // Different data per rank: running stats diverge, then the next forward
    // brings rank 0's back.
    auto x = at::randn({8, 4}) + rank * 10;
    boosted.model(x);
    boosted.model(x);
    auto mean = model[1]->as<torch::nn::BatchNorm1d>()->running_mean;
    model->eval();
    boosted.model(x); // eval: broadcast only, no update
    auto after0 = mean.clone();
    colossalai::distributed::broadcast(
        after0, 0, *colossalai::distributed::world_group())
        .wait();
    EXPECT_TRUE(at::equal(mean, after0));
  });
}

TEST(TorchDDP, RankExitingMidTrainingStopsTheOthers) {
  colossalai::testing::MultiProcessOptions o;
  o.final_barrier = false;
  o.collective_timeout_seconds = 60;
  auto results = colossalai::testing::run_processes(
      2,
      [](int rank, int world) {
        auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
        cb::Booster booster(cb::BoosterOptions().plugin(plugin));
        auto model = make_model();
        auto boosted = booster.boost(model, adamw(model), mse);
        auto t0 = std::chrono::steady_clock::now();
        try {
          for (int s = 0; s < 1000; ++s) {
            if (rank == 1 && s == 3) {
              std::_Exit(3); // dies without a word
            }
            auto b = local_batch(s % 5, rank, world);
            boosted.optimizer->zero_grad();
            booster.backward(
                boosted.criterion(boosted.model(b.first), b.second),
                *boosted.optimizer);
            boosted.optimizer->step();
          }
          ADD_FAILURE() << "rank 0 trained on after its peer died";
        } catch (const colossalai::distributed::DistributedError& e) {
          std::string msg = e.what();
          EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
          // Found by the dead connection, not by the 60 s timeout.
          EXPECT_LT(
              std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
        }
      },
      o);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[1].exit_code, 3);
  EXPECT_EQ(results[0].exit_code, 0) << results[0].output;
  EXPECT_FALSE(results[0].timed_out);
}
