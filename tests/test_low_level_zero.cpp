// LowLevelZeroPlugin (ZeRO-1/2) on real processes against single-process
// AdamW with the same global batch.
//
// fp32 tolerance: |zero - ref| <= 1e-5 + 1e-4 |ref| after 5 steps — the
// gradient average is the same sum in another order (per-rank means
// averaged), and Adam's update is otherwise identical arithmetic on slices.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/initialize.h>
#include <colossalai/nn/hookable_module.h>
#include <colossalai/nn/optimizer/fused_adam.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/utils/compat.h>

#include <harness/multiprocess.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>

namespace cb = colossalai::booster;
namespace cz = colossalai::zero;
using colossalai::testing::run_distributed;

namespace {

struct MLPImpl : torch::nn::Module {
  MLPImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 33)); // odd sizes pad
    fc2 = register_module("fc2", torch::nn::Linear(33, 32));
    fc3 = register_module("fc3", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc3(torch::gelu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(MLP);

std::pair<at::Tensor, at::Tensor> global_batch(int step, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return {at::randn({4 * world, 8}, gen), at::randn({4 * world, 4}, gen)};
}

std::pair<at::Tensor, at::Tensor> local_batch(int step, int rank, int world) {
  auto b = global_batch(step, world);
  return {b.first.narrow(0, 4 * rank, 4), b.second.narrow(0, 4 * rank, 4)};
}

// Backward through the booster of the MSE loss, in float32, of the boosted
// (possibly bf16) model on this rank's batch of step `step`.
template <class Boosted>
void mse_backward(cb::Booster& booster, Boosted& boosted, int step, int rank, int world) {
  auto b = local_batch(step, rank, world);
  booster.backward(
      torch::mse_loss(boosted.model(b.first).to(at::kFloat), b.second), *boosted.optimizer);
}

MLP make_model() {
  torch::manual_seed(42);
  return MLP();
}

// adamw()'s hyperparameters.
std::shared_ptr<colossalai::nn::optimizer::HybridAdam> hybrid_adam(MLP& m) {
  namespace opt = colossalai::nn::optimizer;
  return std::make_shared<opt::HybridAdam>(
      m->parameters(), opt::HybridAdamOptions(1e-2).weight_decay(0.01));
}

std::shared_ptr<torch::optim::AdamW> adamw(MLP& m) {
  return std::make_shared<torch::optim::AdamW>(
      m->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
}

// Adam is blind to the gradients' scale; SGD with momentum is not, so it
// catches a wrong average.
std::shared_ptr<torch::optim::Optimizer> make_opt(MLP& m, bool sgd) {
  if (sgd) {
    return std::make_shared<torch::optim::SGD>(
        m->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return adamw(m);
}

std::vector<at::Tensor> reference(int steps, int world, double clip, bool sgd) {
  auto model = make_model();
  auto opt = make_opt(model, sgd);
  for (int s = 0; s < steps; ++s) {
    auto b = global_batch(s, world);
    opt->zero_grad();
    torch::mse_loss(model(b.first), b.second).backward();
    if (clip > 0) {
      torch::nn::utils::clip_grad_norm_(model->parameters(), clip);
    }
    opt->step();
  }
  return model->parameters();
}

void zero_matches(
    int rank,
    int world,
    int stage,
    double clip,
    bool sgd = false,
    bool offload = false,
    bool overlap = true,
    bool overlap_allgather = false) {
  auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
      cb::plugin::LowLevelZeroPluginOptions()
          .stage(stage)
          .precision("fp32")
          .max_norm(clip)
          .cpu_offload(offload)
          .overlap_communication(overlap)
          .overlap_allgather(overlap_allgather)
          .reduce_bucket_size_in_m(0.0005)); // several buckets
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  torch::manual_seed(7 + rank); // rank 0's weights must win
  MLP model;
  if (rank == 0) {
    model = make_model();
  }
  auto boosted = booster.boost(model, make_opt(model, sgd));
  for (int s = 0; s < 5; ++s) {
    auto b = local_batch(s, rank, world);
    boosted.optimizer->zero_grad();
    booster.backward(
        colossalai::testing::mse_loss(boosted.model(b.first), b.second),
        *boosted.optimizer);
    boosted.optimizer->step();
  }
  auto ref = reference(5, world, clip, sgd);
  auto got = boosted.model.parameters(); // after overlap_allgather's gathers
  for (size_t i = 0; i < ref.size(); ++i) {
    const auto g = colossalai::testing::host(got[i]);
    EXPECT_TRUE(at::allclose(g, ref[i], 1e-4, 1e-5))
        << "stage " << stage << (offload ? ", cpu_offload" : "")
        << (overlap ? "" : ", no overlap")
        << (overlap_allgather ? ", overlap_allgather" : "") << ": parameter "
        << i << " differs by " << (g - ref[i]).abs().max().item<double>();
  }
}

// One process, bf16 model on the global batch, fp32 master copies stepped
// by `make_opt(masters)` and rounded back to bf16 after every step: the
// weights after `steps` steps.
template <class MakeOpt>
std::vector<at::Tensor> bf16_master_reference(int steps, int world, const MakeOpt& make_opt) {
  auto ref = make_model();
  std::vector<at::Tensor> masters;
  for (auto& p : ref->parameters()) {
    masters.push_back(p.detach().clone().set_requires_grad(true));
  }
  ref->to(at::kBFloat16);
  auto opt = make_opt(masters);
  for (int s = 0; s < steps; ++s) {
    auto b = global_batch(s, world);
    for (auto& p : ref->parameters())
      p.mutable_grad() = at::Tensor();
    torch::mse_loss(ref(b.first.to(at::kBFloat16)).to(at::kFloat), b.second)
        .backward();
    auto params = ref->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      masters[i].mutable_grad() = params[i].grad().to(at::kFloat);
    }
    opt->step();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].copy_(masters[i]);
    }
  }
  return ref->parameters();
}

} // namespace

TEST(LowLevelZero, Stage1And2MatchSingleProcessOnTwoRanks) {
  run_distributed(2, [](int rank, int world) {
    zero_matches(rank, world, 1, 0);
    zero_matches(rank, world, 2, 0);
    zero_matches(rank, world, 2, /*clip=*/0.05);
    zero_matches(rank, world, 1, 0, /*sgd=*/true);
    zero_matches(rank, world, 2, 0, /*sgd=*/true);
    zero_matches(rank, world, 2, /*clip=*/0.05, /*sgd=*/true);
    zero_matches(rank, world, 2, 0, /*sgd=*/true, /*offload=*/true);
    zero_matches(rank, world, 1, 0.05, /*sgd=*/true, /*offload=*/true);
    zero_matches(rank, world, 1, 0, true, false, /*overlap=*/false);
    zero_matches(rank, world, 2, 0.05, true, false, /*overlap=*/false);
    // A model without hookable modules: the whole wait before the forward.
    zero_matches(
        rank, world, 1, 0, true, false, true, /*overlap_allgather=*/true);
    zero_matches(
        rank, world, 2, 0.05, true, true, true, /*overlap_allgather=*/true);
  });
}

TEST(LowLevelZero, Stage1And2MatchSingleProcessOnThreeRanks) {
  run_distributed(3, [](int rank, int world) {
    zero_matches(rank, world, 1, 0);
    zero_matches(rank, world, 2, 0);
  });
}

TEST(LowLevelZero, Bf16TrainsAndReplicasAgree) {
  run_distributed(2, [](int rank, int world) {
    auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions().stage(2).precision("bf16"));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make_model();
    auto boosted = booster.boost(model, adamw(model));
    EXPECT_EQ(model->fc1->weight.scalar_type(), at::kBFloat16);
    auto b = local_batch(0, rank, world);
    double first = 0, last = 0;
    for (int s = 0; s < 30; ++s) {
      boosted.optimizer->zero_grad();
      auto loss = colossalai::testing::mse_loss(
          boosted.model(b.first).to(at::kFloat), b.second);
      booster.backward(loss, *boosted.optimizer);
      boosted.optimizer->step();
      (s == 0 ? first : last) = loss.item<double>();
    }
    EXPECT_LT(last, 0.7 * first);
    for (auto& p : model->parameters()) {
      auto other = p.detach().clone();
      colossalai::distributed::broadcast(
          other, 0, *colossalai::distributed::world_group())
          .wait();
      EXPECT_TRUE(at::equal(other, p.detach()));
    }
  });
}

namespace {

// Records the dtype of the input its forward received.
struct InputDtypeImpl : torch::nn::Module {
  InputDtypeImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    seen = x.scalar_type();
    return fc(x.to(fc->weight.scalar_type()));
  }
  torch::nn::Linear fc;
  at::ScalarType seen = at::kFloat;
};
TORCH_MODULE(InputDtype);

} // namespace

TEST(LowLevelZero, CastInputsFalsePassesInputsAsGiven) {
  run_distributed(1, [](int, int) {
    for (const bool cast : {true, false}) {
      auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions().precision("bf16").cast_inputs(
              cast));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      InputDtype model;
      auto boosted = booster.boost(
          model,
          std::make_shared<torch::optim::SGD>(
              model->parameters(), torch::optim::SGDOptions(0.1)));
      boosted.model(torch::randn({2, 4}));
      EXPECT_EQ(model->seen, cast ? at::kBFloat16 : at::kFloat);
    }
  });
}

TEST(LowLevelZero, NoSyncOnlyWithStage1) {
  run_distributed(2, [](int rank, int world) {
    {
      auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions().stage(2).precision("fp32"));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = make_model();
      auto boosted = booster.boost(model, adamw(model));
      try {
        booster.no_sync(boosted.model, boosted.optimizer.get());
        ADD_FAILURE() << "stage 2 must refuse no_sync";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("no_sync"), std::string::npos);
      }
    }
    // Stage 1: k micro-batches with no_sync then a synced one == the union.
    auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions().stage(1).precision("fp32"));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make_model();
    auto opt = std::make_shared<torch::optim::SGD>(
        model->parameters(), torch::optim::SGDOptions(0.1));
    auto boosted = booster.boost(model, opt);
    boosted.optimizer->zero_grad();
    const int k = 3;
    for (int m = 0; m < k; ++m) {
      auto b = local_batch(m, rank, world);
      auto loss =
          colossalai::testing::mse_loss(boosted.model(b.first), b.second) / k;
      if (m < k - 1) {
        auto guard = booster.no_sync(boosted.model, boosted.optimizer.get());
        booster.backward(loss, *boosted.optimizer);
      } else {
        booster.backward(loss, *boosted.optimizer);
      }
    }
    boosted.optimizer->step();
    auto ref = make_model();
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    at::Tensor loss = at::zeros({});
    for (int m = 0; m < k; ++m) {
      auto b = global_batch(m, world);
      loss = loss + torch::mse_loss(ref(b.first), b.second) / k;
    }
    loss.backward();
    ref_opt.step();
    for (size_t i = 0; i < ref->parameters().size(); ++i) {
      EXPECT_TRUE(at::allclose(
          colossalai::testing::host(model->parameters()[i]),
          ref->parameters()[i],
          1e-4,
          1e-5))
          << "parameter " << i;
    }
  });
}

TEST(LowLevelZero, OverflowOnOneRankSkipsTheStepEverywhere) {
  run_distributed(2, [](int rank, int world) {
    // Loss scaling is an fp16 feature; CPU cannot run fp16 matmuls, so the
    // optimizer is driven directly with fp32 parameters and fp16 scaling.
    auto model = make_model();
    auto group = colossalai::distributed::world_group();
    auto opt = std::make_shared<cz::LowLevelZeroOptimizer>(
        adamw(model),
        group,
        cz::LowLevelZeroOptimizerOptions()
            .stage(2)
            .dtype(at::kHalf)
            .loss_scaler(colossalai::amp::DynamicLossScalerOptions()
                             .initial_scale(1024)
                             .hysteresis(2)));
    // Rank 1 plants an inf in the last element of fc1.weight's gradient,
    // which lands in rank 1's own slice only.
    if (rank == 1) {
      model->fc1->weight.register_hook([](at::Tensor g) {
        g = g.clone();
        g.view({-1})[-1] = std::numeric_limits<float>::infinity();
        return g;
      });
    }
    auto before = model->fc2->weight.detach().clone();
    for (int s = 0; s < 2; ++s) {
      auto b = local_batch(s, rank, world);
      opt->zero_grad();
      opt->backward(torch::mse_loss(model(b.first), b.second));
      opt->step();
      EXPECT_TRUE(opt->last_step_skipped()) << "rank " << rank;
    }
    EXPECT_TRUE(at::equal(before, model->fc2->weight.detach()));
    // Hysteresis 2: the second overflow halves the scale.
    EXPECT_EQ(opt->loss_scale(), 512.0);
  });
}

// fp16's loss scaling over FusedAdamW at two ranks reads nothing back
// per step: each rank's verdict is agreed across ranks on the device
// (all-reduce MAX), the kernel skips there, the host learns it at the next
// step. Bit for bit the same training as the same optimizer given the
// verdict on the host, with an inf on one rank, a nan on the other, and an
// inf that a clip by value would make finite (the verdict is taken before
// the clip, as PyTorch's GradScaler takes it).
TEST(LowLevelZero, Fp16OverFusedAdamWAgreesOnTheVerdictWithoutAReadBack) {
  if (!colossalai::compat::has_fused_adam(at::kCPU)) {
    GTEST_SKIP() << "this LibTorch has no fused Adam on the CPU (2.4+)";
  }
  run_distributed(2, [](int rank, int world) {
    using colossalai::nn::optimizer::FusedAdamW;
    using colossalai::testing::host_syncs;
    using colossalai::testing::op_calls;
    struct HostVerdictAdamW : FusedAdamW {
      using FusedAdamW::FusedAdamW;
      bool skips_step_on_device() const override {
        return false;
      }
    };
    // step -> (rank, value) planted in fc1.weight's last gradient element.
    const std::map<int, std::pair<int, float>> planted = {
        {1, {1, std::numeric_limits<float>::infinity()}},
        {3, {0, std::nanf("")}},
        {4, {1, std::numeric_limits<float>::infinity()}}};
    struct Run {
      std::vector<at::Tensor> params;
      std::vector<bool> skipped;
      std::vector<double> scales;
      int reads = 0;
    };
    auto train = [&](bool on_device) {
      auto model = make_model();
      const auto o = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
      std::shared_ptr<torch::optim::Optimizer> inner;
      if (on_device) {
        inner = std::make_shared<FusedAdamW>(model->parameters(), o);
      } else {
        inner = std::make_shared<HostVerdictAdamW>(model->parameters(), o);
      }
      auto opt = std::make_shared<cz::LowLevelZeroOptimizer>(
          inner,
          colossalai::distributed::world_group(),
          cz::LowLevelZeroOptimizerOptions()
              .stage(2)
              .dtype(at::kHalf)
              .loss_scaler(colossalai::amp::DynamicLossScalerOptions()
                               .initial_scale(1024)
                               .hysteresis(1)
                               .growth_interval(2)));
      int step = 0;
      model->fc1->weight.register_hook([&](at::Tensor g) {
        auto it = planted.find(step);
        if (it == planted.end() || it->second.first != rank) {
          return g;
        }
        g = g.clone();
        g.view({-1})[-1] = it->second.second;
        return g;
      });
      Run out;
      for (step = 0; step < 6; ++step) {
        auto b = local_batch(step, rank, world);
        const auto calls = op_calls([&] {
          opt->zero_grad();
          opt->backward(torch::mse_loss(model(b.first), b.second));
          if (step == 4) {
            opt->clip_grad_by_value(0.5);
          }
          opt->step();
        });
        out.reads += static_cast<int>(host_syncs(calls).size());
        out.skipped.push_back(opt->last_step_skipped());
        out.scales.push_back(opt->loss_scale());
      }
      for (const auto& p : model->parameters()) {
        out.params.push_back(p.detach().clone());
      }
      return out;
    };
    const auto device = train(true);
    const auto host = train(false);
    EXPECT_EQ(device.reads, 0) << "rank " << rank;
    EXPECT_GT(host.reads, 0) << "rank " << rank; // the host's verdict
    EXPECT_EQ(
        device.skipped,
        (std::vector<bool>{false, true, false, true, true, false}));
    EXPECT_EQ(device.skipped, host.skipped);
    EXPECT_EQ(
        device.scales,
        (std::vector<double>{1024, 512, 512, 256, 128, 128}));
    EXPECT_EQ(device.scales, host.scales);
    for (size_t i = 0; i < device.params.size(); ++i) {
      EXPECT_TRUE(at::equal(device.params[i], host.params[i]))
          << "rank " << rank << ", parameter " << i;
    }
  });
}

// fp16 in graph mode at one rank (what booster::GraphedStep drives on a
// GPU), outside a capture: after two ordinary steps, set_graph_mode; then
// per step the host's half (prepare_graph_step: the previous step's verdict
// read, a skip's counts taken back, the counts advanced) and the step.
// Bit for bit the ordinary steps, an inf planted in a graph-mode step; the
// learning rate a power of two (exact in the float32 graph mode reads).
TEST(LowLevelZero, Fp16GraphModeEqualsOrdinarySteps) {
  if (!colossalai::compat::has_fused_adam_tensor_lr(at::kCPU)) {
    GTEST_SKIP() << "no fused Adam reading its learning rate from memory on "
                    "the CPU in this LibTorch (2.4+)";
  }
  run_distributed(1, [](int, int) {
    auto train = [](bool graph_mode) {
      auto model = make_model();
      auto fused = std::make_shared<colossalai::nn::optimizer::FusedAdamW>(
          model->parameters(),
          torch::optim::AdamWOptions(std::ldexp(1.0, -7)).weight_decay(0.125));
      auto opt = std::make_shared<cz::LowLevelZeroOptimizer>(
          fused,
          colossalai::distributed::world_group(),
          cz::LowLevelZeroOptimizerOptions().stage(1).dtype(at::kHalf).loss_scaler(
              colossalai::amp::DynamicLossScalerOptions().initial_scale(1024).hysteresis(1)));
      EXPECT_EQ(opt->graph_capture_blocker(), "");
      int step = 0;
      model->fc1->weight.register_hook([&](at::Tensor g) {
        if (step != 4) {
          return g;
        }
        g = g.clone();
        g.view({-1})[0] = std::numeric_limits<float>::infinity();
        return g;
      });
      // Nothing asks for a verdict between steps: prepare_graph_step (and
      // an ordinary step) must read the previous one itself.
      for (step = 0; step < 6; ++step) {
        if (graph_mode && step == 2) {
          opt->set_graph_mode(true);
        } else if (graph_mode && step > 2) {
          opt->prepare_graph_step();
        }
        auto b = local_batch(step, 0, 1);
        opt->zero_grad();
        opt->backward(torch::mse_loss(model(b.first), b.second));
        opt->step();
        opt->after_graph_replay();
      }
      EXPECT_FALSE(opt->last_step_skipped());
      std::vector<at::Tensor> out;
      for (const auto& p : model->parameters()) {
        out.push_back(p.detach().clone());
      }
      for (const auto& kv : fused->state()) {
        EXPECT_EQ(
            static_cast<const torch::optim::AdamWParamState&>(*kv.second).step(), 5);
      }
      EXPECT_EQ(opt->loss_scale(), 512.0); // backed off once
      return out;
    };
    const auto graphed = train(true);
    const auto ordinary = train(false);
    for (size_t i = 0; i < graphed.size(); ++i) {
      EXPECT_TRUE(at::equal(graphed[i], ordinary[i])) << "parameter " << i;
    }
  });
}

TEST(LowLevelZero, MemoryMatchesZeroFormulas) {
  for (int world : {1, 2, 4}) {
    run_distributed(world, [](int rank, int world) {
      for (int stage : {1, 2}) {
        auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
            cb::plugin::LowLevelZeroPluginOptions().stage(stage).precision(
                "fp32"));
        cb::Booster booster(cb::BoosterOptions().plugin(plugin));
        auto model = make_model();
        auto boosted = booster.boost(model, adamw(model));
        auto b = local_batch(0, rank, world);
        booster.backward(
            colossalai::testing::mse_loss(boosted.model(b.first), b.second),
            *boosted.optimizer);
        boosted.optimizer->step();
        auto* zo =
            dynamic_cast<cz::LowLevelZeroOptimizer*>(boosted.optimizer.get());
        ASSERT_NE(zo, nullptr);
        auto stats = zo->memory_stats();
        // Psi parameters in one bucket (the model is far below the bucket
        // size), padded to a multiple of N and sliced: s = ceil(Psi / N).
        int64_t psi = 0;
        for (auto& p : model->parameters()) {
          psi += p.numel();
        }
        const int64_t slices = (psi + world - 1) / world;
        EXPECT_EQ(zo->bucket_numels(), (std::vector<int64_t>{slices * world}));
        // fp32 ZeRO-2 (shared/NOTES.md): (4 + (4 + 8)/N) Psi — working
        // parameters 4 Psi (the padded flat buffer they view), gradient
        // slices and Adam's two moments as fp32 slices (4 + 8) Psi / N; in
        // fp32 the master slice is the working weights' own storage. Stage 1
        // holds the same at rest (it reduces into slices too). Buckets are
        // freed at rest.
        EXPECT_EQ(stats.working_params, 4 * slices * world);
        EXPECT_EQ(stats.gradients, 4 * slices);
        EXPECT_EQ(stats.master_weights, 0);
        // States exist for real elements only (not the padding).
        const int64_t mine = std::max<int64_t>(
            0, std::min(psi, (rank + 1) * slices) - rank * slices);
        EXPECT_EQ(stats.optimizer_states, 8 * mine);
        EXPECT_LT(slices * world - psi, world); // padding < N per bucket
        // One all-gather per bucket after the step (none alone).
        EXPECT_EQ(zo->gathers_last_step(), world > 1 ? 1 : 0);
      }
    });
  }
}

TEST(LowLevelZero, BadOptionsAreClearErrors) {
  run_distributed(1, [](int, int) {
    auto msg = [](const std::function<void()>& fn) {
      try {
        fn();
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace());
      }
      return std::string();
    };
    EXPECT_NE(
        msg([] {
          cb::plugin::LowLevelZeroPlugin(
              cb::plugin::LowLevelZeroPluginOptions().stage(3));
        }).find("stage"),
        std::string::npos);
    if (colossalai::current_device().is_cpu()) {
      EXPECT_NE(
          msg([] {
            cb::plugin::LowLevelZeroPlugin(
                cb::plugin::LowLevelZeroPluginOptions());
          }).find("fp16"),
          std::string::npos); // the fp16 default needs CUDA
    }
    EXPECT_NE(
        msg([] {
          cb::plugin::LowLevelZeroPlugin(cb::plugin::LowLevelZeroPluginOptions()
                                             .precision("fp32")
                                             .norm_type(1.0));
        }).find("norm_type"),
        std::string::npos);
    EXPECT_NE(
        msg([] {
          cb::plugin::LowLevelZeroPlugin(cb::plugin::LowLevelZeroPluginOptions()
                                             .precision("fp32")
                                             .extra_dp_size(2)); // 1 rank
        }).find("extra_dp_size"),
        std::string::npos);
    // The plugin applies its own precision: a Booster mixed_precision that
    // contradicts it is refused (it used to train in fp32 without a word);
    // one that repeats it is accepted.
    auto fp32 = [] {
      return std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions().precision("fp32"));
    };
    auto contradiction = msg([&] {
      cb::Booster(cb::BoosterOptions().plugin(fp32()).mixed_precision("bf16"));
    });
    EXPECT_NE(contradiction.find("contradicts"), std::string::npos)
        << contradiction;
    EXPECT_NE(contradiction.find("'fp32'"), std::string::npos) << contradiction;
    EXPECT_EQ(
        msg([&] {
          cb::Booster(
              cb::BoosterOptions().plugin(fp32()).mixed_precision("fp32"));
        }),
        "");
  });
}

namespace {

// Global batch of 12 samples (divides by 1, 2 and 3 ranks) split by rank.
std::pair<at::Tensor, at::Tensor> batch12(int step, int rank, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  auto x = at::randn({12, 8}, gen), y = at::randn({12, 4}, gen);
  int64_t per = 12 / world;
  return {x.narrow(0, per * rank, per), y.narrow(0, per * rank, per)};
}

std::string ckpt_dir() {
  return "/tmp/colossalai_zero_ckpt_" +
      std::to_string(colossalai::testing::test_process());
}

template <class Plugin>
std::vector<at::Tensor> resume_and_train(
    std::shared_ptr<Plugin> plugin,
    int rank,
    int world,
    int from,
    int to) {
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  torch::manual_seed(99); // overwritten by the checkpoint
  MLP model;
  auto boosted = booster.boost(model, adamw(model));
  booster.load_model(boosted.model, ckpt_dir() + "/model");
  booster.load_optimizer(*boosted.optimizer, ckpt_dir() + "/optim");
  for (int s = from; s < to; ++s) {
    auto b = batch12(s, rank, world);
    boosted.optimizer->zero_grad();
    booster.backward(
        colossalai::testing::mse_loss(boosted.model(b.first), b.second),
        *boosted.optimizer);
    boosted.optimizer->step();
  }
  return model->parameters();
}

std::vector<at::Tensor> uninterrupted(int steps) {
  auto model = make_model();
  auto opt = adamw(model);
  for (int s = 0; s < steps; ++s) {
    auto b = batch12(s, 0, 1);
    opt->zero_grad();
    torch::mse_loss(model(b.first), b.second).backward();
    opt->step();
  }
  return model->parameters();
}

void expect_close_to_reference(
    const std::vector<at::Tensor>& got,
    const std::string& what) {
  auto ref = uninterrupted(5);
  for (size_t i = 0; i < ref.size(); ++i) {
    const auto g = colossalai::testing::host(got[i]);
    EXPECT_TRUE(at::allclose(g, ref[i], 1e-4, 1e-5))
        << what << ": parameter " << i << " differs by "
        << (g - ref[i]).abs().max().item<double>();
  }
}

cb::plugin::LowLevelZeroPluginOptions zero2() {
  return cb::plugin::LowLevelZeroPluginOptions().stage(2).precision("fp32");
}

// 3 steps of ZeRO under `options` on batch12, then the model and the
// sharded optimizer saved to ckpt_dir().
void train_three_steps_and_save(
    const cb::plugin::LowLevelZeroPluginOptions& options,
    int rank,
    int world) {
  auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(options);
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  auto model = make_model();
  auto boosted = booster.boost(model, adamw(model));
  for (int s = 0; s < 3; ++s) {
    auto b = batch12(s, rank, world);
    boosted.optimizer->zero_grad();
    booster.backward(
        colossalai::testing::mse_loss(boosted.model(b.first), b.second),
        *boosted.optimizer);
    boosted.optimizer->step();
  }
  booster.save_model(boosted.model, ckpt_dir() + "/model");
  booster.save_optimizer(
      *boosted.optimizer,
      ckpt_dir() + "/optim",
      colossalai::checkpoint_io::SaveOptimizerOptions().shard(true));
}

} // namespace

TEST(LowLevelZero, CheckpointSavedOnTwoRanksLoadsAtAnyWorldSizeAndUnderDDP) {
  // 3 steps on 2 ranks, save (optimizer states gathered from the slices).
  run_distributed(2, [](int rank, int world) {
    train_three_steps_and_save(zero2(), rank, world);
  });
  // Then 2 more steps at 1, 2 and 3 ranks and under DDP: all equal the 5
  // uninterrupted single-process steps.
  for (int world : {1, 2, 3}) {
    run_distributed(world, [](int rank, int world) {
      auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(zero2());
      expect_close_to_reference(
          resume_and_train(plugin, rank, world, 3, 5),
          "ZeRO-2 on " + std::to_string(world));
    });
  }
  run_distributed(2, [](int rank, int world) {
    auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
    expect_close_to_reference(
        resume_and_train(plugin, rank, world, 3, 5), "DDP");
  });
  std::filesystem::remove_all(ckpt_dir());
}

TEST(LowLevelZero, ExtraDpSizeTrainsAndItsCheckpointLoadsAnywhere) {
  // extra_dp_size 2 at 4 ranks: two copies, each sharded over 2 ranks.
  // 3 steps, save; then 2 more at 1 rank without copies and at 4 ranks with
  // them: both equal the 5 uninterrupted single-process steps.
  run_distributed(4, [](int rank, int world) {
    train_three_steps_and_save(zero2().extra_dp_size(2), rank, world);
  });
  run_distributed(1, [](int rank, int world) {
    auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(zero2());
    expect_close_to_reference(
        resume_and_train(plugin, rank, world, 3, 5), "ZeRO-2 on 1");
  });
  run_distributed(4, [](int rank, int world) {
    auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        zero2().extra_dp_size(2));
    expect_close_to_reference(
        resume_and_train(plugin, rank, world, 3, 5),
        "ZeRO-2, extra_dp_size 2, on 4");
  });
  std::filesystem::remove_all(ckpt_dir());
}

TEST(LowLevelZero, Bf16MatchesBf16WorkingFp32MasterReference) {
  // Reference: one process, bf16 model on the global batch, fp32 master
  // copies updated by AdamW and rounded back to bf16 after every step.
  // Tolerance: the gradients are bf16 sums over different sample groupings
  // (per-rank halves, then averaged), so they agree to bf16's ~3 significant
  // digits. Adam normalises each element's step to about lr, so where a
  // gradient is near zero a rounding difference can move that element by up
  // to lr per step: with lr 1e-3 and 5 steps we allow 5e-3 absolute plus 1%
  // relative (bf16 itself resolves ~4e-3 at 1.0).
  run_distributed(2, [](int rank, int world) {
    auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions()
            .stage(2)
            .precision("bf16")
            .communication_dtype("fp32"));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make_model();
    auto boosted = booster.boost(
        model,
        std::make_shared<torch::optim::AdamW>(
            model->parameters(),
            torch::optim::AdamWOptions(1e-3).weight_decay(0.01)));
    for (int s = 0; s < 5; ++s) {
      auto b = local_batch(s, rank, world);
      boosted.optimizer->zero_grad();
      booster.backward(
          colossalai::testing::mse_loss(
              boosted.model(b.first).to(at::kFloat), b.second),
          *boosted.optimizer);
      boosted.optimizer->step();
    }

    auto got = colossalai::testing::host(model->parameters());
    auto want = bf16_master_reference(5, world, [](std::vector<at::Tensor> m) {
      return std::make_shared<torch::optim::AdamW>(
          m, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    });
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(at::allclose(
          got[i].to(at::kFloat), want[i].to(at::kFloat), 1e-2, 5e-3))
          << "parameter " << i << " differs by "
          << (got[i].to(at::kFloat) - want[i].to(at::kFloat))
                 .abs()
                 .max()
                 .item<double>();
    }
  });
}

// At one rank with a FusedAdamW or a HybridAdam, the optimizer's step
// writes the bf16 weights itself (no gather) and the gradient skips the
// average and the scatter: each weight is its fp32 master rounded, exactly.
// Against one process keeping fp32 masters by hand, the bound of the test
// above: the weights here are views at other offsets of one flat buffer,
// and the CPU's bf16 kernels (matmul blocking, vectorised heads and tails
// of AdamW) round differently by alignment, so gradients agree to bf16's
// digits and Adam may move a near-zero-gradient element by up to lr per
// step.
TEST(LowLevelZero, Bf16AtOneRankIsTheMasterStepRounded) {
  namespace opt = colossalai::nn::optimizer;
  using MakeOptimizer = std::function<std::shared_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;
  const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  const auto hybrid = opt::HybridAdamOptions(1e-3).weight_decay(0.01);
  const std::vector<std::pair<const char*, MakeOptimizer>> optimizers{
      {"FusedAdamW", [adamw](std::vector<at::Tensor> ps) { return std::make_shared<opt::FusedAdamW>(ps, adamw); }},
      {"HybridAdam", [hybrid](std::vector<at::Tensor> ps) { return std::make_shared<opt::HybridAdam>(ps, hybrid); }}};
  for (const auto& [name, make] : optimizers) {
    SCOPED_TRACE(name);
    run_distributed(1, [&make = make](int rank, int world) {
      auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions().stage(1).precision("bf16"));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = make_model();
      auto boosted = booster.boost(model, make(model->parameters()));
      auto* zo = dynamic_cast<cz::LowLevelZeroOptimizer*>(boosted.optimizer.get());
      ASSERT_NE(zo, nullptr);
      for (int s = 0; s < 4; ++s) {
        boosted.optimizer->zero_grad();
        mse_backward(booster, boosted, s, rank, world);
        boosted.optimizer->step();
        EXPECT_EQ(zo->gathers_last_step(), 0);
      }

      auto got = model->parameters();
      auto want = bf16_master_reference(4, world, make);
      const auto& masters_got = zo->unwrap().param_groups().at(0).params();
      ASSERT_EQ(masters_got.size(), got.size());
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(at::equal(got[i].flatten(), masters_got[i].to(at::kBFloat16)))
            << "parameter " << i << " is not its master rounded";
        EXPECT_TRUE(at::allclose(
            got[i].to(at::kFloat), want[i].to(at::kFloat), 1e-2, 5e-3))
            << "parameter " << i << " differs by "
            << (got[i].to(at::kFloat) - want[i].to(at::kFloat)).abs().max().item<double>();
      }
    });
  }
}

// NOTE [Publishing during the host step]: with cpu_offload at one rank and
// HybridAdam, each bucket's bf16 weights are refreshed from its host master
// as soon as HybridAdam finished that bucket, during the step. Every bucket
// is published so (three buckets of the MLP at a 0.0005 M bucket size),
// and the weights equal those of the same training without offload, whose
// weights HybridAdam writes as it updates the masters, bit for bit (the
// same host update and the same rounding; a bucket published before its
// last piece was updated would keep that piece's old value). On a GPU the resident masters step
// on the device and the offloaded ones on the host: equal within
// testing::same_across_tiers' bound there.
TEST(LowLevelZero, OffloadPublishesEachBucketDuringHybridAdamsStep) {
  run_distributed(1, [](int rank, int world) {
    auto train = [&](bool offload) {
      auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions()
              .stage(2)
              .precision("bf16")
              .reduce_bucket_size_in_m(0.0005)
              .cpu_offload(offload));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = make_model();
      auto boosted = booster.boost(model, hybrid_adam(model));
      auto* zo = dynamic_cast<cz::LowLevelZeroOptimizer*>(boosted.optimizer.get());
      EXPECT_NE(zo, nullptr);
      for (int s = 0; s < 3; ++s) {
        boosted.optimizer->zero_grad();
        mse_backward(booster, boosted, s, rank, world);
        boosted.optimizer->step();
        // Resident masters: HybridAdam writes the weights (no gather).
        EXPECT_EQ(zo->gathers_last_step(), offload ? 3 : 0);
        EXPECT_EQ(zo->groups_published_during_step(), offload ? 3 : 0);
      }
      std::vector<at::Tensor> out;
      for (const auto& p : model->parameters()) {
        out.push_back(p.detach().clone());
      }
      return out;
    };
    const auto offloaded = train(true);
    const auto resident = train(false);
    ASSERT_EQ(offloaded.size(), resident.size());
    const bool bitwise = colossalai::current_device().is_cpu();
    for (size_t i = 0; i < offloaded.size(); ++i) {
      double diff = 0;
      EXPECT_TRUE(colossalai::testing::same_across_tiers(
          offloaded[i], resident[i], 3, 1e-2, bitwise, &diff))
          << "parameter " << i << " differs by " << diff;
    }
  });
}

// NOTE [Host steps overlap the backward]: with cpu_offload and
// overlap_host_step, HybridAdam updates each bucket's host master slice
// during the backward, as soon as its reduced gradient is on the host (at
// one rank the bucket's weights are uploaded then too; across ranks the
// all-gathers stay in step()). The weights equal the same training without
// it bit for bit (the same update on the same values), at one and two
// ranks, in fp32 and bf16, and with stage 1's no_sync micro-batches before
// the synchronising backward. From the second step on (the first creates
// the states) every bucket is taken ahead, none published
// during step() (that is what the overlap replaced).
TEST(LowLevelZero, OverlapHostStepUpdatesBucketsDuringTheBackward) {
  for (int n : {1, 2}) {
    run_distributed(n, [](int rank, int world) {
      for (const std::string precision : {"fp32", "bf16"}) {
        for (int stage : {1, 2}) {
          auto train = [&](bool overlap) {
            auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
                cb::plugin::LowLevelZeroPluginOptions()
                    .stage(stage)
                    .precision(precision)
                    .reduce_bucket_size_in_m(0.0005)
                    .cpu_offload(true)
                    .overlap_host_step(overlap));
            cb::Booster booster(cb::BoosterOptions().plugin(plugin));
            auto model = make_model();
            auto hybrid = hybrid_adam(model);
            auto boosted = booster.boost(model, hybrid);
            auto* zo =
                dynamic_cast<cz::LowLevelZeroOptimizer*>(boosted.optimizer.get());
            EXPECT_NE(zo, nullptr);
            for (int s = 0; s < 3; ++s) {
              boosted.optimizer->zero_grad();
              if (stage == 1) { // a micro-batch that does not synchronise
                auto guard =
                    booster.no_sync(boosted.model, boosted.optimizer.get());
                mse_backward(booster, boosted, 10 + s, rank, world);
                EXPECT_FALSE(hybrid->stepped_ahead());
              }
              mse_backward(booster, boosted, s, rank, world);
              // The first step creates the states: nothing taken ahead.
              const bool ahead = overlap && s > 0;
              EXPECT_EQ(hybrid->stepped_ahead(), ahead);
              boosted.optimizer->step();
              EXPECT_EQ(zo->groups_stepped_ahead(), ahead ? 3 : 0);
              EXPECT_EQ(
                  zo->groups_published_during_step(),
                  ahead || world > 1 ? 0 : 3);
            }
            return colossalai::testing::snapshot(model->parameters());
          };
          EXPECT_EQ(
              colossalai::testing::differing(train(false), train(true)),
              std::vector<size_t>{})
              << precision << " stage " << stage << " at " << world
              << " ranks";
        }
      }
    });
  }
}

TEST(LowLevelZero, OverlapHostStepRefusesWhatItCannotServe) {
  namespace opt = colossalai::nn::optimizer;
  run_distributed(1, [](int rank, int world) {
    using O = cb::plugin::LowLevelZeroPluginOptions;
    const auto base =
        O().stage(2).precision("fp32").cpu_offload(true).overlap_host_step(true);
    for (const auto& c : std::vector<std::pair<O, std::string>>{
             {O(base).cpu_offload(false), "cpu_offload"},
             {O(base).max_norm(1.0), "max_norm"}}) {
      const auto msg = colossalai::testing::error_of(
          [&] { cb::plugin::LowLevelZeroPlugin plugin(c.first); });
      EXPECT_NE(msg.find("overlap_host_step"), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.second), std::string::npos) << msg;
    }
    auto boost = [&](cb::Booster& booster, MLP& model, bool hybrid) {
      std::shared_ptr<torch::optim::Optimizer> o;
      if (hybrid) {
        o = std::make_shared<opt::HybridAdam>(
            model->parameters(), opt::HybridAdamOptions(1e-2));
      } else {
        o = adamw(model);
      }
      return booster.boost(model, o);
    };
    {
      cb::Booster booster(cb::BoosterOptions().plugin(
          std::make_shared<cb::plugin::LowLevelZeroPlugin>(base)));
      auto model = make_model();
      const auto msg = colossalai::testing::error_of(
          [&] { boost(booster, model, false); });
      EXPECT_NE(msg.find("HybridAdam"), std::string::npos) << msg;
    }
    // A second synchronising backward before step() is refused before it
    // adds to any gradient; step() then goes through.
    cb::Booster booster(cb::BoosterOptions().plugin(
        std::make_shared<cb::plugin::LowLevelZeroPlugin>(base)));
    auto model = make_model();
    auto boosted = boost(booster, model, true);
    boosted.optimizer->zero_grad();
    mse_backward(booster, boosted, 0, rank, world);
    boosted.optimizer->step(); // creates the states
    boosted.optimizer->zero_grad();
    mse_backward(booster, boosted, 1, rank, world);
    const auto msg = colossalai::testing::error_of(
        [&] { mse_backward(booster, boosted, 2, rank, world); });
    EXPECT_NE(msg.find("second backward"), std::string::npos) << msg;
    EXPECT_EQ(
        colossalai::testing::error_of([&] { boosted.optimizer->step(); }), "");
  });
}

// At one rank each bf16 gradient goes straight into the zero gradient
// shard (no flat buffer in between), which keeps bf16 for AdamW (NOTE
// [Gradient shards in bf16]), or float32 with communication_dtype fp32: the
// optimizer's pieces hold the plain model's gradients, bit for bit on the
// CPU (on a GPU within a bf16 rounding: cuBLAS may pick other kernels for
// the booster's flat views). A second backward without zero_grad adds to
// them in the shard's dtype (bf16: what the plain model's own accumulation
// gives); zero_grad then clears them. At rest the gradients take 2 (4)
// bytes per element of the shards.
TEST(LowLevelZero, OneRankGradientShardsHoldTheModelsGradients) {
  run_distributed(1, [](int rank, int world) {
    for (const std::string comm : {"", "fp32"}) {
      SCOPED_TRACE("communication_dtype '" + comm + "'");
      const auto dtype = comm.empty() ? at::kBFloat16 : at::kFloat;
      auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions()
              .stage(2)
              .precision("bf16")
              .communication_dtype(comm)
              .reduce_bucket_size_in_m(0.0005));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      const auto dev = colossalai::current_device();
      auto model = make_model();
      auto plain = make_model();
      plain->to(dev, at::kBFloat16);
      auto boosted = booster.boost(
          model, std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(0.1)));
      auto* zo = dynamic_cast<cz::LowLevelZeroOptimizer*>(boosted.optimizer.get());
      ASSERT_NE(zo, nullptr);
      const auto& pieces = zo->unwrap().param_groups().at(0).params();
      ASSERT_EQ(pieces.size(), plain->parameters().size());
      std::vector<at::Tensor> sum(pieces.size());
      for (int pass = 0; pass < 2; ++pass) {
        auto b = local_batch(pass, rank, world);
        booster.backward(
            torch::mse_loss(boosted.model(b.first).to(at::kFloat), b.second), *boosted.optimizer);
        for (auto& p : plain->parameters()) {
          p.mutable_grad() = at::Tensor();
        }
        torch::mse_loss(plain(b.first.to(dev, at::kBFloat16)).to(at::kFloat), b.second.to(dev))
            .backward();
        for (size_t i = 0; i < pieces.size(); ++i) {
          const auto g = plain->parameters()[i].grad().to(dtype).flatten();
          sum[i] = pass == 0 ? g : sum[i] + g; // rounded to the shard's dtype
          const auto got = pieces[i].grad();
          EXPECT_EQ(got.scalar_type(), dtype);
          if (dev.is_cpu()) {
            EXPECT_TRUE(at::equal(got, sum[i])) << "pass " << pass << ", parameter " << i;
          } else {
            EXPECT_LE(
                (got.to(at::kFloat) - sum[i].to(at::kFloat)).abs().max().item<double>(),
                1e-2 * sum[i].to(at::kFloat).abs().max().item<double>())
                << "pass " << pass << ", parameter " << i;
          }
        }
      }
      boosted.optimizer->zero_grad();
      for (const auto& p : pieces) {
        EXPECT_EQ(p.grad().count_nonzero().item<int64_t>(), 0);
      }
      int64_t elements = 0;
      for (auto n : zo->bucket_numels()) {
        elements += n; // one rank: the shard is the padded bucket
      }
      EXPECT_EQ(zo->memory_stats().gradients, elements * (comm.empty() ? 2 : 4));
    }
    // SGD makes its momentum buffer a copy of the first gradient: float32
    // shards for it, and so a float32 buffer.
    auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions().stage(2).precision("bf16"));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make_model();
    auto boosted = booster.boost(
        model,
        std::make_shared<torch::optim::SGD>(
            model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)));
    mse_backward(booster, boosted, 0, rank, world);
    boosted.optimizer->step();
    for (const auto& kv : boosted.optimizer->unwrap().state()) {
      const auto& s = static_cast<const torch::optim::SGDParamState&>(*kv.second);
      EXPECT_EQ(s.momentum_buffer().scalar_type(), at::kFloat);
    }
  });
}

// NOTE [Host steps overlap the backward]: a backward that raised after
// some buckets were updated ahead leaves a step that can be neither
// finished nor taken back. Everything but loading a checkpoint is refused
// by name, and from the checkpoint training goes on as if nothing had
// happened. At one rank, where the later buckets are taken before the hook
// on the first layer raises.
TEST(LowLevelZero, OverlapHostStepRefusesTheStepOfABackwardThatRaised) {
  run_distributed(1, [](int rank, int world) {
    const std::string dir = ckpt_dir() + "/raised";
    auto train = [&](bool raise) {
      auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          zero2().reduce_bucket_size_in_m(0.0005).cpu_offload(true)
              .overlap_host_step(true));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = make_model();
      auto hybrid = hybrid_adam(model);
      auto boosted = booster.boost(model, hybrid);
      bool fail = false;
      model->fc1->weight.register_hook([&fail](const at::Tensor& g) {
        TORCH_CHECK(!fail, "a hook raised");
        return g;
      });
      for (int s = 0; s < 3; ++s) {
        boosted.optimizer->zero_grad();
        if (raise && s == 1) {
          booster.save_model(boosted.model, dir + "/model");
          booster.save_optimizer(*boosted.optimizer, dir + "/optim");
          fail = true;
          auto msg = colossalai::testing::error_of(
              [&] { mse_backward(booster, boosted, s, rank, world); });
          fail = false;
          EXPECT_NE(msg.find("a hook raised"), std::string::npos) << msg;
          EXPECT_TRUE(hybrid->stepped_ahead());
          const std::vector<std::pair<std::string, std::function<void()>>>
              refused = {
                  {"zero_grad", [&] { boosted.optimizer->zero_grad(); }},
                  {"step", [&] { boosted.optimizer->step(); }},
                  {"backward",
                   [&] { mse_backward(booster, boosted, s, rank, world); }},
                  {"save_optimizer",
                   [&] {
                     booster.save_optimizer(
                         *boosted.optimizer, dir + "/refused");
                   }},
                  {"HybridAdam::save", [&] {
                     torch::serialize::OutputArchive archive;
                     hybrid->save(archive);
                   }}};
          for (const auto& [what, call] : refused) {
            msg = colossalai::testing::error_of(call);
            EXPECT_NE(msg.find(what == "HybridAdam::save"
                                   ? "between step_ahead and step()"
                                   : "the last backward raised"),
                      std::string::npos)
                << what << ": " << msg;
          }
          booster.load_model(boosted.model, dir + "/model");
          booster.load_optimizer(*boosted.optimizer, dir + "/optim");
          EXPECT_FALSE(hybrid->stepped_ahead());
          // The raised backward's gradients, as after any that raised.
          boosted.optimizer->zero_grad();
        }
        mse_backward(booster, boosted, s, rank, world);
        boosted.optimizer->step();
      }
      return colossalai::testing::snapshot(model->parameters());
    };
    EXPECT_EQ(
        colossalai::testing::differing(train(false), train(true)),
        std::vector<size_t>{});
  });
  std::filesystem::remove_all(ckpt_dir());
}

namespace {

// NOTE [All-gathers overlap the next forward]: a model whose blocks open a
// ForwardScope, and a probe each block's forward calls once its own
// parameters are complete.
std::function<void(int)> g_block_probe;

struct BlockImpl : torch::nn::Module, colossalai::nn::HookableModule {
  explicit BlockImpl(int index) : index(index) {
    fc = register_module("fc", torch::nn::Linear(16, 16));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto scope = forward_scope();
    if (g_block_probe) {
      g_block_probe(index);
    }
    return scope.exit(x + torch::gelu(fc(x)));
  }
  int index;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

struct TowerImpl : torch::nn::Module {
  TowerImpl() {
    in = register_module("in", torch::nn::Linear(8, 16));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) {
      blocks->push_back(Block(i));
    }
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = in(x);
    for (const auto& b : *blocks) {
      h = b->as<BlockImpl>()->forward(h);
    }
    return head(h);
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Tower);

std::string overlap_ckpt() {
  return ckpt_dir() + "_overlap";
}

// 6 steps of ZeRO on the tower, saving the model and optimizer after step
// 2 and loading them back after step 4 (with the all-gathers of step 4 in
// flight when overlap_allgather is on): the weights at the end. With
// `in_flight_per_block`, the all-gathers still in flight as each block
// began, in the forwards that followed a step (not those after the save
// and the load, which waited for them).
std::vector<at::Tensor> train_tower(
    int rank,
    int world,
    int stage,
    const std::string& precision,
    bool overlap_allgather,
    std::vector<std::vector<int64_t>>* in_flight_per_block = nullptr) {
  auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
      cb::plugin::LowLevelZeroPluginOptions()
          .stage(stage)
          .precision(precision)
          .reduce_bucket_size_in_m(0.0002) // ~200 elements: ~one layer each
          .overlap_allgather(overlap_allgather));
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  torch::manual_seed(11);
  Tower model;
  auto opt = std::make_shared<torch::optim::AdamW>(
      model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  auto boosted = booster.boost(model, opt);
  auto* zo = dynamic_cast<cz::LowLevelZeroOptimizer*>(boosted.optimizer.get());
  EXPECT_NE(zo, nullptr);
  if (overlap_allgather) {
    // Issued by first use: the root's layers (before the forward), then
    // block by block.
    const auto& order = zo->gather_order();
    auto at = [&](const at::Tensor& p) {
      return std::find(order.begin(), order.end(), zo->bucket_of(p)) -
          order.begin();
    };
    auto blocks = model->blocks;
    EXPECT_LT(
        at(model->head->weight), at(blocks[0]->as<BlockImpl>()->fc->weight));
    EXPECT_LT(
        at(model->in->weight), at(blocks[0]->as<BlockImpl>()->fc->weight));
    EXPECT_LT(
        at(blocks[0]->as<BlockImpl>()->fc->weight),
        at(blocks[1]->as<BlockImpl>()->fc->weight));
    EXPECT_LT(
        at(blocks[1]->as<BlockImpl>()->fc->weight),
        at(blocks[2]->as<BlockImpl>()->fc->weight));
  }
  std::vector<int64_t> seen;
  g_block_probe = [&](int) { seen.push_back(zo->gathers_in_flight()); };
  for (int s = 0; s < 6; ++s) {
    seen.clear();
    mse_backward(booster, boosted, s, rank, world);
    if (in_flight_per_block != nullptr && s % 2 == 1) {
      in_flight_per_block->push_back(seen);
    }
    boosted.optimizer->step();
    boosted.optimizer->zero_grad();
    if (overlap_allgather && world > 1) {
      // Every bucket's all-gather is left to the next forward.
      EXPECT_GT(zo->gathers_last_step(), 0);
      EXPECT_EQ(zo->gathers_in_flight(), zo->gathers_last_step());
    } else {
      EXPECT_EQ(zo->gathers_in_flight(), 0);
    }
    if (s == 1) {
      booster.save_model(boosted.model, overlap_ckpt() + "/model");
      booster.save_optimizer(*boosted.optimizer, overlap_ckpt() + "/optim");
    }
    if (s == 3) {
      booster.load_model(boosted.model, overlap_ckpt() + "/model");
      booster.load_optimizer(*boosted.optimizer, overlap_ckpt() + "/optim");
      EXPECT_EQ(zo->gathers_in_flight(), 0);
    }
  }
  g_block_probe = nullptr;
  std::vector<at::Tensor> out;
  for (const auto& p : boosted.model.parameters()) { // waits for the gathers
    out.push_back(p.detach().clone());
  }
  EXPECT_EQ(zo->gathers_in_flight(), 0);
  return out;
}

} // namespace

TEST(LowLevelZero, OverlapAllgatherLeavesTheGathersToTheNextForward) {
  run_distributed(2, [](int rank, int world) {
    for (int stage : {1, 2}) {
      for (const char* precision : {"fp32", "bf16"}) {
        const std::string what =
            "stage " + std::to_string(stage) + ", " + precision;
        std::vector<std::vector<int64_t>> in_flight;
        auto overlapped =
            train_tower(rank, world, stage, precision, true, &in_flight);
        auto waited = train_tower(rank, world, stage, precision, false);
        // The same bits (an all-gather copies them), saves and loads with
        // gathers in flight included.
        EXPECT_EQ(
            colossalai::testing::differing(overlapped, waited),
            std::vector<size_t>{})
            << what;
        // Each block found the later blocks' all-gathers still in flight,
        // and its own done.
        ASSERT_EQ(in_flight.size(), 3u) << what;
        for (const auto& v : in_flight) {
          ASSERT_EQ(v.size(), 3u) << what;
          EXPECT_GT(v[0], v[1]) << what;
          EXPECT_GT(v[1], v[2]) << what;
          EXPECT_EQ(v[2], 0) << what;
        }
      }
    }
  });
  std::filesystem::remove_all(overlap_ckpt());
}

TEST(LowLevelZero, OverlapAllgatherRefusesABlockWithHooksOfItsOwn) {
  struct OtherHooks : colossalai::nn::ForwardHooks {
    void pre_forward() override {}
    at::Tensor post_forward(const at::Tensor& y) override {
      return y;
    }
  };
  run_distributed(1, [](int, int) {
    auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions()
            .precision("fp32")
            .overlap_allgather(true));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    Tower model;
    model->blocks[1]->as<BlockImpl>()->set_forward_hooks(
        std::make_shared<OtherHooks>());
    auto opt = std::make_shared<torch::optim::AdamW>(
        model->parameters(), torch::optim::AdamWOptions(1e-2));
    try {
      booster.boost(model, opt);
      ADD_FAILURE() << "boost accepted a block with hooks of its own";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("overlap_allgather"), std::string::npos) << msg;
      EXPECT_NE(msg.find("'blocks.1'"), std::string::npos) << msg;
    }
  });
}
