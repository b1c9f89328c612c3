// Single-process pieces of the Booster: loss scaling with planted overflows,
// the optimizer wrapper against torch's own clipping, the distributed sampler,
// mesh arithmetic, and the errors users see for bad configuration.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/graphed_step.h>
#include <colossalai/booster/mixed_precision/bf16.h>
#include <colossalai/booster/mixed_precision/fp16_torch.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/data/distributed_sampler.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/initialize.h>
#include <colossalai/nn/optimizer/fused_adam.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/utils/compat.h>

#include <harness/multiprocess.h>

#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <limits>
#include <set>
#include <tuple>

namespace cb = colossalai::booster;
namespace ci = colossalai::interface;

namespace {

using colossalai::testing::error_of;

} // namespace

TEST(GradScaler, SkipsStepOnPlantedOverflowAndBacksOff) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 2);
  auto sgd = std::make_shared<torch::optim::SGD>(
      lin->parameters(), torch::optim::SGDOptions(0.1));
  cb::mixed_precision::TorchAMPOptimizer opt(
      sgd, colossalai::amp::GradScalerOptions().growth_interval(3));
  EXPECT_EQ(opt.scaler().get_scale(), 65536.0);

  auto x = torch::randn({8, 4});
  auto run = [&](bool plant, double value) {
    opt.zero_grad();
    opt.backward(lin(x).pow(2).mean());
    if (plant) {
      lin->weight.mutable_grad()[0][1] = value;
    }
    auto before = lin->weight.detach().clone();
    opt.step();
    return !at::equal(before, lin->weight.detach());
  };
  // inf and nan: step skipped, scale halves, growth restarts.
  EXPECT_FALSE(run(true, std::numeric_limits<double>::infinity()));
  EXPECT_TRUE(opt.last_step_skipped());
  EXPECT_EQ(opt.scaler().get_scale(), 32768.0);
  EXPECT_FALSE(run(true, std::nan("")));
  EXPECT_EQ(opt.scaler().get_scale(), 16384.0);
  // Clean steps update; after growth_interval of them the scale doubles.
  EXPECT_TRUE(run(false, 0));
  EXPECT_TRUE(run(false, 0));
  EXPECT_EQ(opt.scaler().get_scale(), 16384.0);
  EXPECT_TRUE(run(false, 0));
  EXPECT_EQ(opt.scaler().get_scale(), 32768.0);
  EXPECT_EQ(opt.scaler().growth_tracker(), 0);
}

TEST(GradScaler, UnscaledGradientsEqualUnscaledTraining) {
  torch::manual_seed(0);
  torch::nn::Linear a(4, 2), b(4, 2);
  b->weight.data().copy_(a->weight.data());
  b->bias.data().copy_(a->bias.data());
  auto x = torch::randn({8, 4});
  cb::mixed_precision::TorchAMPOptimizer opt(
      std::make_shared<torch::optim::SGD>(
          a->parameters(), torch::optim::SGDOptions(0.1)));
  opt.backward(a(x).sum());
  double norm = opt.clip_grad_by_norm(1e9);
  b(x).sum().backward();
  EXPECT_TRUE(at::allclose(a->weight.grad(), b->weight.grad()));
  EXPECT_NEAR(
      norm, torch::nn::utils::clip_grad_norm_(b->parameters(), 1e9), 1e-5);
}

TEST(GradScaler, RejectsBadOptions) {
  EXPECT_NE(
      error_of([] {
        colossalai::amp::GradScaler(
            colossalai::amp::GradScalerOptions().backoff_factor(2));
      }).find("backoff_factor"),
      std::string::npos);
}

// The one scaler under GradScaler, ZeRO and FSDP: hysteresis delays the
// back-off, growth restores it, both stop at the bounds.
TEST(DynamicLossScaler, HysteresisGrowthAndBounds) {
  colossalai::amp::DynamicLossScaler s(
      colossalai::amp::DynamicLossScalerOptions()
          .initial_scale(8)
          .min_scale(2)
          .max_scale(32)
          .growth_interval(2)
          .hysteresis(2));
  std::vector<double> seen;
  for (bool inf :
       {true,
        true,
        true,
        true,
        true,
        true,
        false,
        false,
        false,
        false,
        true,
        false,
        false,
        false,
        false,
        false,
        false}) {
    s.update(inf);
    seen.push_back(s.scale());
  }
  EXPECT_EQ(
      seen,
      (std::vector<double>{
          8, 4, 4, 2, 2, 2, 2, 4, 4, 8, 8, 8, 16, 16, 32, 32, 32}));
  EXPECT_NE(
      error_of([] {
        colossalai::amp::DynamicLossScaler(
            colossalai::amp::DynamicLossScalerOptions().hysteresis(0));
      }).find("hysteresis"),
      std::string::npos);
}

// Unscaling on the device takes float32, float16 and bfloat16 gradients in
// one list (ATen's CUDA pass takes no bf16, which is unscaled apart), each
// divided exactly (powers of two), and finds an inf in any of them; on the
// CPU, and on a GPU where there is one.
TEST(GradScaler, UnscaleAndCheckTakesEveryDtype) {
  std::vector<at::Device> devices{at::kCPU};
  if (torch::cuda::is_available()) {
    devices.emplace_back(at::kCUDA);
  }
  for (const auto& dev : devices) {
    SCOPED_TRACE(dev.str());
    for (int bad = -1; bad < 3; ++bad) {
      std::vector<at::Tensor> grads;
      for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
        grads.push_back(at::full({5}, 6.0, at::device(dev).dtype(dtype)));
      }
      if (bad >= 0) {
        grads[bad][2] = std::numeric_limits<double>::infinity();
      }
      const auto found = colossalai::amp::unscale_and_check_(
          grads, at::full({}, 0.5, at::device(dev).dtype(at::kFloat)));
      EXPECT_EQ(found.item<float>(), bad >= 0 ? 1.0f : 0.0f) << bad;
      for (size_t i = 0; i < grads.size(); ++i) {
        EXPECT_EQ(grads[i][0].item<double>(), 3.0) << bad << ", " << i;
      }
    }
  }
}

// The rule on a device (here the CPU's tensors) is the host's rule:
// the same scales and growth counts over a long random run of verdicts,
// with the bounds and the hysteresis reached. Powers of two are exact in
// the device's float32; other factors round once per update there, so
// after k updates the two differ by at most k float32 roundings.
TEST(DynamicLossScaler, RuleOnTheDeviceIsTheHostsRule) {
  namespace amp = colossalai::amp;
  for (bool powers_of_two : {true, false}) {
    const auto options = amp::DynamicLossScalerOptions()
                             .initial_scale(8)
                             .min_scale(0.25)
                             .max_scale(64)
                             .growth_factor(powers_of_two ? 2.0 : 1.5)
                             .backoff_factor(powers_of_two ? 0.5 : 0.7)
                             .growth_interval(3)
                             .hysteresis(2);
    amp::DynamicLossScaler host(options), device(options);
    EXPECT_FALSE(device.on_device());
    EXPECT_EQ(device.scale_tensor(at::kCPU).item<float>(), 8.0f);
    EXPECT_TRUE(device.on_device());
    auto gen = at::detail::createCPUGenerator(11);
    const auto draws = at::rand({400}, gen);
    bool saw_min = false, saw_max = false;
    for (int64_t k = 0; k < draws.numel(); ++k) {
      // Runs of overflows early, clean runs late: both bounds are reached.
      const bool inf = draws[k].item<double>() < (k < 200 ? 0.6 : 0.15);
      host.update(inf);
      if (k % 2 == 0) {
        device.update(at::full({1}, inf ? 1.0 : 0.0));
      } else {
        device.update(inf); // on the device too, from a host verdict
      }
      const double bound = (k + 1) * std::ldexp(1.0, -23) * host.scale();
      ASSERT_NEAR(device.scale(), host.scale(), powers_of_two ? 0 : bound)
          << "update " << k;
      ASSERT_EQ(device.growth_tracker(), host.growth_tracker())
          << "update " << k;
      saw_min = saw_min || host.scale() == 0.25;
      saw_max = saw_max || host.scale() == 64;
    }
    if (powers_of_two) {
      EXPECT_TRUE(saw_min && saw_max);
    }
  }
}

namespace {

// `param`'s step count in `optimizer`'s state (of type State).
template <class State, class Optimizer>
int64_t step_count(Optimizer& optimizer, const at::Tensor& param) {
  auto& state = optimizer.state();
  return static_cast<State&>(
             *state.at(colossalai::compat::optimizer_state_key<
                       std::remove_reference_t<decltype(state)>>(param)))
      .step();
}

// FusedAdamW made to take the verdict on the host, for comparison.
struct HostVerdictAdamW : colossalai::nn::optimizer::FusedAdamW {
  using FusedAdamW::FusedAdamW;
  bool skips_step_on_device() const override {
    return false;
  }
};

// Two copies of one model trained side by side in fp16 through `on_device`
// (the verdict left to the optimizer) and `on_host` (read before the
// step), planted[k] put into step k's weight gradient: the device side
// reads nothing back in a step, and both skip the same steps and reach the
// same weights, scales and step counts (count_a, count_b: each side's
// weight's). `tentative`: a skipped step's count stays advanced until its
// verdict is read.
void expect_both_verdicts_train_alike(
    cb::mixed_precision::TorchAMPOptimizer& on_device,
    torch::nn::Linear& a,
    cb::mixed_precision::TorchAMPOptimizer& on_host,
    torch::nn::Linear& b,
    const at::Tensor& x,
    const std::vector<double>& planted,
    bool tentative,
    const std::function<int64_t()>& count_a,
    const std::function<int64_t()>& count_b) {
  using colossalai::testing::host_syncs;
  using colossalai::testing::op_calls;
  for (size_t k = 0; k < planted.size(); ++k) {
    std::map<std::string, int> calls;
    for (auto* which : {&on_device, &on_host}) {
      auto& model = which == &on_device ? a : b;
      auto run = [&] {
        which->zero_grad();
        which->backward(model(x).pow(2).mean());
        if (planted[k] != 0) {
          model->weight.mutable_grad()[1][2] = planted[k];
        }
        which->step();
      };
      if (which == &on_device) {
        calls = op_calls(run);
      } else {
        run();
      }
    }
    EXPECT_TRUE(host_syncs(calls).empty()) << "step " << k << " read back";
    const int64_t counted = count_a();
    const bool skipped = planted[k] != 0;
    EXPECT_EQ(on_device.last_step_skipped(), skipped) << "step " << k;
    EXPECT_EQ(on_host.last_step_skipped(), skipped) << "step " << k;
    EXPECT_EQ(counted - (tentative && skipped ? 1 : 0), count_a());
    EXPECT_EQ(count_a(), count_b()) << "step " << k;
    EXPECT_TRUE(at::equal(a->weight, b->weight)) << "step " << k;
    EXPECT_TRUE(at::equal(a->bias, b->bias)) << "step " << k;
    EXPECT_EQ(on_device.scaler().get_scale(), on_host.scaler().get_scale())
        << "step " << k;
  }
}

} // namespace

// fp16's loss scaling over FusedAdamW reads nothing back per step: the
// kernel skips an overflowing step where the verdict is, the scale is
// updated there, and the host takes the skipped step's count back at the
// next step. Bit for bit the training of the same optimizer given the
// verdict on the host (the same kernel, the same float32 unscale), with
// inf and nan planted, the scale backing off and growing again.
TEST(GradScaler, FusedAdamWSkipsOnTheDeviceWithoutAReadBack) {
  using colossalai::testing::host_syncs;
  using colossalai::testing::op_calls;
  namespace opt_ns = colossalai::nn::optimizer;
  if (!colossalai::compat::has_fused_adam(at::kCPU)) {
    GTEST_SKIP() << "this LibTorch has no fused Adam on the CPU (2.4+)";
  }
  torch::manual_seed(0);
  torch::nn::Linear a(4, 3), b(4, 3);
  b->weight.data().copy_(a->weight.data());
  b->bias.data().copy_(a->bias.data());
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  auto fused_a = std::make_shared<opt_ns::FusedAdamW>(a->parameters(), options);
  auto fused_b = std::make_shared<HostVerdictAdamW>(b->parameters(), options);
  const auto scaler = colossalai::amp::GradScalerOptions()
                          .init_scale(1024)
                          .growth_interval(2);
  cb::mixed_precision::TorchAMPOptimizer on_device(fused_a, scaler);
  cb::mixed_precision::TorchAMPOptimizer on_host(fused_b, scaler);
  const auto x = torch::randn({8, 4});
  const auto step_of = [](opt_ns::FusedAdamW& o, const at::Tensor& p) {
    return step_count<torch::optim::AdamWParamState>(o, p);
  };
  const double inf = std::numeric_limits<double>::infinity();
  expect_both_verdicts_train_alike(
      on_device, a, on_host, b, x, {0, inf, 0, 0, std::nan(""), 0, 0, 0},
      /*tentative=*/true,
      [&] { return step_of(*fused_a, a->weight); },
      [&] { return step_of(*fused_b, b->weight); });
  // 1024, backed off twice, grown twice (growth_interval 2 clean steps).
  EXPECT_EQ(on_device.scaler().get_scale(), 1024.0);
  EXPECT_EQ(step_of(*fused_a, a->weight), 6);

  // A checkpoint saved right after a skipped step holds the count the
  // host takes back (save_optimizer asks for the verdict first).
  {
    on_device.zero_grad();
    on_device.backward(a(x).pow(2).mean());
    a->weight.mutable_grad()[0][0] = inf;
    on_device.step();
    const colossalai::testing::ScratchDir dir("fp16-skip");
    colossalai::checkpoint_io::GeneralCheckpointIO io;
    io.save_optimizer(on_device, dir.path + "/optim.bin");
    auto fresh = std::make_shared<opt_ns::FusedAdamW>(a->parameters(), options);
    ci::OptimizerWrapper loaded(fresh);
    io.load_optimizer(loaded, dir.path + "/optim.bin");
    EXPECT_EQ(step_of(*fresh, a->weight), 6);
    EXPECT_TRUE(on_device.last_step_skipped());
    EXPECT_EQ(step_of(*fused_a, a->weight), 6);
  }

  // Clipping on the device too: the unscaled gradients' norm, nothing
  // read back; the host-verdict optimizer is refused by name.
  for (auto* which : {&on_device, &on_host}) {
    which->zero_grad();
    which->backward((which == &on_device ? a : b)(x).pow(2).mean());
  }
  on_host.clip_grad_by_norm(1e9);
  const double want = torch::nn::utils::clip_grad_norm_(b->parameters(), 1e9);
  at::Tensor norm;
  const auto calls =
      op_calls([&] { norm = on_device.clip_grad_by_norm_tensor(1e9); });
  EXPECT_TRUE(host_syncs(calls).empty());
  EXPECT_NEAR(norm.item<double>(), want, 1e-6 * want);
  EXPECT_NE(
      error_of([&] { on_host.clip_grad_by_norm_tensor(1.0); })
          .find("FusedAdamW"),
      std::string::npos);
}

// The same with HybridAdam on the CPU (ColossalAI's optimizer for ZeRO and
// Gemini): its host step reads the verdict where it is, on the host, for
// free; a skipped step advances no count.
TEST(GradScaler, HybridAdamTakesTheVerdictWithoutAReadBack) {
  namespace opt_ns = colossalai::nn::optimizer;
  struct HostVerdictAdam : opt_ns::HybridAdam {
    using HybridAdam::HybridAdam;
    bool skips_step_on_device() const override {
      return false;
    }
  };
  torch::manual_seed(0);
  torch::nn::Linear a(4, 3), b(4, 3);
  b->weight.data().copy_(a->weight.data());
  b->bias.data().copy_(a->bias.data());
  const auto options = opt_ns::HybridAdamOptions(1e-2).weight_decay(0.1);
  auto adam_a = std::make_shared<opt_ns::HybridAdam>(a->parameters(), options);
  auto adam_b = std::make_shared<HostVerdictAdam>(b->parameters(), options);
  const auto scaler = colossalai::amp::GradScalerOptions()
                          .init_scale(1024)
                          .growth_interval(2);
  cb::mixed_precision::TorchAMPOptimizer on_device(adam_a, scaler);
  cb::mixed_precision::TorchAMPOptimizer on_host(adam_b, scaler);
  const auto x = torch::randn({8, 4});
  const auto step_of = [](opt_ns::HybridAdam& o, const at::Tensor& p) {
    return step_count<opt_ns::HybridAdamParamState>(o, p);
  };
  const double inf = std::numeric_limits<double>::infinity();
  // A skipped host step advances no count.
  expect_both_verdicts_train_alike(
      on_device, a, on_host, b, x, {0, inf, 0, std::nan(""), 0},
      /*tentative=*/false,
      [&] { return step_of(*adam_a, a->weight); },
      [&] { return step_of(*adam_b, b->weight); });
  EXPECT_EQ(step_of(*adam_a, a->weight), 3);
}

// fp16 in graph mode (what booster::GraphedStep drives on a GPU), outside
// a capture: after warm-up steps, set_graph_mode; then per step the host's
// half (prepare_graph_step: the previous step's verdict read, a skip's
// counts taken back, the counts advanced), the step, after_graph_replay.
// Bit for bit the eager steps with the verdict on the device, an inf
// planted in a graph-mode step. The learning rate is a power of two: exact
// in the float32 the graph-mode kernel reads from memory.
TEST(GradScaler, GraphModeStepsEqualEagerSteps) {
  namespace opt_ns = colossalai::nn::optimizer;
  if (!colossalai::compat::has_fused_adam_tensor_lr(at::kCPU)) {
    GTEST_SKIP() << "this LibTorch has no fused Adam on the CPU reading the "
                    "learning rate from memory (2.4+)";
  }
  const auto x = torch::randn({8, 4});
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> planted = {0, 0, 0, inf, 0, 0};
  auto train = [&](bool graph_mode) {
    torch::manual_seed(0);
    torch::nn::Linear model(4, 3);
    auto fused = std::make_shared<opt_ns::FusedAdamW>(
        model->parameters(),
        torch::optim::AdamWOptions(std::ldexp(1.0, -7)).weight_decay(0.125));
    cb::mixed_precision::TorchAMPOptimizer opt(
        fused, colossalai::amp::GradScalerOptions().init_scale(1024));
    EXPECT_EQ(opt.graph_capture_blocker(), "");
    // Nothing asks for a verdict between steps: prepare_graph_step (and an
    // eager step) must read the previous one itself.
    for (size_t k = 0; k < planted.size(); ++k) {
      if (graph_mode && k == 2) {
        opt.set_graph_mode(true);
      } else if (graph_mode && k > 2) {
        opt.prepare_graph_step();
      }
      // Zeroed in place: graph mode reads the gradients it bound, as a
      // replayed backward writes into the same memory.
      opt.zero_grad(/*set_to_none=*/false);
      opt.backward(model(x).pow(2).mean());
      if (planted[k] != 0) {
        model->weight.mutable_grad()[0][1] = planted[k];
      }
      opt.step();
      opt.after_graph_replay();
    }
    EXPECT_FALSE(opt.last_step_skipped());
    return std::make_tuple(
        model->weight.detach().clone(),
        step_count<torch::optim::AdamWParamState>(*fused, model->weight),
        opt.scaler().get_scale());
  };
  const auto eager = train(false);
  const auto graphed = train(true);
  EXPECT_TRUE(at::equal(std::get<0>(eager), std::get<0>(graphed)));
  EXPECT_EQ(std::get<1>(eager), 5); // six steps, one skipped
  EXPECT_EQ(std::get<1>(graphed), 5);
  EXPECT_EQ(std::get<2>(eager), 512.0); // backed off once
  EXPECT_EQ(std::get<2>(graphed), 512.0);
  // Over an optimizer that cannot skip on the device: refused by name.
  torch::nn::Linear other(4, 3);
  cb::mixed_precision::TorchAMPOptimizer sgd(std::make_shared<torch::optim::SGD>(
      other->parameters(), torch::optim::SGDOptions(0.1)));
  EXPECT_NE(sgd.graph_capture_blocker().find("FusedAdamW"), std::string::npos);
}

TEST(OptimizerWrapper, ClippingMatchesTorch) {
  for (double norm_type : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
    torch::manual_seed(3);
    torch::nn::Linear a(6, 3), b(6, 3);
    b->weight.data().copy_(a->weight.data());
    b->bias.data().copy_(a->bias.data());
    auto x = torch::randn({5, 6});
    ci::OptimizerWrapper opt(std::make_shared<torch::optim::Adam>(
        a->parameters(), torch::optim::AdamOptions(1e-3)));
    opt.backward(a(x).pow(2).sum());
    b(x).pow(2).sum().backward();
    double got = opt.clip_grad_by_norm(0.5, norm_type);
    double want =
        torch::nn::utils::clip_grad_norm_(b->parameters(), 0.5, norm_type);
    EXPECT_NEAR(got, want, 1e-4 * want) << "norm_type " << norm_type;
    EXPECT_TRUE(at::allclose(a->weight.grad(), b->weight.grad(), 1e-5, 1e-6));
  }
}

TEST(OptimizerWrapper, WorksWithEveryTorchOptimizer) {
  auto make = [](const std::string& kind, std::vector<at::Tensor> p)
      -> std::shared_ptr<torch::optim::Optimizer> {
    if (kind == "SGD")
      return std::make_shared<torch::optim::SGD>(
          p, torch::optim::SGDOptions(0.1).momentum(0.9));
    if (kind == "Adam")
      return std::make_shared<torch::optim::Adam>(p);
    if (kind == "AdamW")
      return std::make_shared<torch::optim::AdamW>(p);
    if (kind == "RMSprop")
      return std::make_shared<torch::optim::RMSprop>(p);
    return std::make_shared<torch::optim::Adagrad>(p);
  };
  for (std::string kind : {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad"}) {
    torch::manual_seed(0);
    torch::nn::Linear a(3, 3), b(3, 3);
    b->weight.data().copy_(a->weight.data());
    b->bias.data().copy_(a->bias.data());
    auto x = torch::randn({4, 3});
    cb::Booster booster;
    auto boosted = booster.boost(a, make(kind, a->parameters()));
    auto plain = make(kind, b->parameters());
    for (int s = 0; s < 3; ++s) {
      boosted.optimizer->zero_grad();
      booster.backward(boosted.model(x).pow(2).mean(), *boosted.optimizer);
      boosted.optimizer->step();
      plain->zero_grad();
      b(x).pow(2).mean().backward();
      plain->step();
    }
    EXPECT_TRUE(at::equal(a->weight, b->weight)) << kind;
    EXPECT_EQ(boosted.optimizer->param_groups().size(), 1u);
  }
}

TEST(OptimizerWrapper, ZeroGradKeepsOrDropsGradients) {
  torch::nn::Linear a(2, 2);
  ci::OptimizerWrapper opt(std::make_shared<torch::optim::SGD>(
      a->parameters(), torch::optim::SGDOptions(0.1)));
  a(torch::ones({1, 2})).sum().backward();
  opt.zero_grad(/*set_to_none=*/false);
  ASSERT_TRUE(a->weight.grad().defined());
  EXPECT_EQ(a->weight.grad().abs().sum().item<float>(), 0.0f);
  opt.zero_grad();
  EXPECT_FALSE(a->weight.grad().defined());
}

TEST(Booster, BoostedModelKeepsTheForwardSignatureAndUnwraps) {
  struct TwoInputsImpl : torch::nn::Module {
    TwoInputsImpl() {
      lin = register_module("lin", torch::nn::Linear(2, 2));
    }
    at::Tensor forward(const at::Tensor& a, double scale) {
      return lin(a) * scale;
    }
    torch::nn::Linear lin{nullptr};
  };
  auto model = std::make_shared<TwoInputsImpl>();
  cb::Booster booster(cb::BoosterOptions().mixed_precision("bf16"));
  auto [m, opt, crit, dl, sched] = booster.boost(model);
  auto out = m(torch::ones({1, 2}), 2.0);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16); // autocast around forward
  EXPECT_EQ(m.unwrap().get(), model.get());
  EXPECT_EQ(opt, nullptr);
  // Autocast is off again outside the boosted call.
  EXPECT_EQ(model->forward(torch::ones({1, 2}), 1.0).scalar_type(), at::kFloat);
}

TEST(Booster, TakesMixedPrecisionObjects) {
  namespace mp = cb::mixed_precision;
  // A policy object with no device follows the Booster's, like the string.
  auto bf16 = std::make_shared<mp::BF16MixedPrecision>();
  cb::Booster booster(cb::BoosterOptions().mixed_precision(bf16));
  EXPECT_EQ(booster.options().mixed_precision(), "bf16");
  auto [m, opt, crit, dl, sched] = booster.boost(torch::nn::Linear(2, 2));
  EXPECT_EQ(m(torch::ones({1, 2})).scalar_type(), at::kBFloat16);
  EXPECT_EQ(bf16->device_type(), std::optional<at::DeviceType>(at::kCPU));
  // Built for another device: named, not silently a no-op.
  EXPECT_NE(
      error_of([] {
        cb::Booster(cb::BoosterOptions().mixed_precision(
            std::make_shared<mp::BF16MixedPrecision>(at::kCUDA)));
      }).find("built for cuda but the Booster runs on cpu"),
      std::string::npos);
  // fp16 with its scaler's options still needs CUDA.
  EXPECT_NE(
      error_of([] {
        cb::Booster(cb::BoosterOptions().mixed_precision(
            std::make_shared<mp::FP16TorchMixedPrecision>(
                colossalai::amp::GradScalerOptions().init_scale(1024))));
      }).find("needs a CUDA device"),
      std::string::npos);
  // A string set afterwards wins over the object.
  auto opts = cb::BoosterOptions().mixed_precision(bf16).mixed_precision("");
  EXPECT_EQ(opts.mixed_precision_policy(), nullptr);
}

// NOTE [Freed host memory stays in the process]: after boost, a training
// step reuses the pages the last step freed. The step below touches about
// 55,000 pages of activations and gradients: 48 MiB activations (above
// glibc's largest mmap threshold, so mapped afresh by any threshold) and
// 8 MiB weight gradients. glibc's default settings fault about 52,000 in
// again every step, a 32 MiB mmap threshold alone about 49,000, the
// retaining setting none (measured on Debian 12). Only the retaining
// rank is checked: a kernel that backs fresh mappings with huge pages
// faults little either way. Child processes, since the setting is
// process-wide.
TEST(Booster, FreedHostMemoryIsReusedAfterBoost) {
  colossalai::testing::run_distributed(2, [](int rank, int) {
    const bool retain = rank == 1;
    torch::manual_seed(0);
    auto model = torch::nn::Sequential(
        torch::nn::Linear(256, 8192),
        torch::nn::GELU(),
        torch::nn::Linear(8192, 256));
    auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), 0.01);
    cb::Booster booster(cb::BoosterOptions().retain_freed_memory(retain));
    auto boosted = booster.boost(model, opt);
    auto x = torch::randn({1536, 256});
    auto step = [&] {
      boosted.optimizer->zero_grad();
      booster.backward(boosted.model(x).pow(2).mean(), *boosted.optimizer);
      boosted.optimizer->step();
    };
    step();
    step();
    // The least of four windows: a kernel that reclaims idle pages on its
    // own (DAMON's proactive reclaim, seen on these machines) now and then
    // takes back retained pages between steps, which then fault in again.
    long per_step = std::numeric_limits<long>::max();
    for (int window = 0; window < 4; ++window) {
      rusage before{}, after{};
      getrusage(RUSAGE_SELF, &before);
      for (int i = 0; i < 3; ++i) {
        step();
      }
      getrusage(RUSAGE_SELF, &after);
      per_step = std::min(per_step, (after.ru_minflt - before.ru_minflt) / 3);
    }
    std::printf("retain %d: %ld faults a step\n", retain ? 1 : 0, per_step);
    if (retain) {
      EXPECT_LT(per_step, 4000);
    }
  });
}

TEST(Booster, BadPrecisionAndPluginCombinationsAreClearErrors) {
  EXPECT_NE(
      error_of([] {
        cb::Booster(cb::BoosterOptions().mixed_precision("fp8"));
      }).find("mixed_precision"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        cb::Booster(cb::BoosterOptions().mixed_precision("fp16"));
      }).find("CUDA"),
      std::string::npos);

  struct Fp32OnlyPlugin : cb::plugin::Plugin {
    std::string name() const override {
      return "Fp32OnlyPlugin";
    }
    std::vector<std::string> supported_devices() const override {
      return {"cpu"};
    }
    std::vector<std::string> supported_precisions() const override {
      return {"fp32"};
    }
    bool control_precision() const override {
      return false;
    }
    bool control_device() const override {
      return false;
    }
    bool support_no_sync() const override {
      return false;
    }
    void configure(
        std::shared_ptr<ci::ModelWrapper>&,
        std::shared_ptr<ci::OptimizerWrapper>&) override {}
  };
  auto plugin = std::make_shared<Fp32OnlyPlugin>();
  auto msg = error_of([&] {
    cb::Booster(cb::BoosterOptions().plugin(plugin).mixed_precision("bf16"));
  });
  EXPECT_NE(msg.find("Fp32OnlyPlugin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bf16"), std::string::npos) << msg;

  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  torch::nn::Linear lin(2, 2);
  auto boosted = booster.boost(lin);
  msg = error_of([&] { booster.no_sync(boosted.model); });
  EXPECT_NE(
      msg.find("Fp32OnlyPlugin does not support no_sync"), std::string::npos)
      << msg;
  msg = error_of([&] { plugin->enable_lora(lin.ptr()); });
  EXPECT_NE(
      msg.find("Fp32OnlyPlugin does not support LoRA"), std::string::npos);
  msg = error_of([&] { plugin->get_checkpoint_io(); });
  EXPECT_NE(msg.find("checkpoint IO"), std::string::npos);
  // No data parallelism: every rank takes the whole batch.
  const cb::plugin::Plugin& base = *plugin;
  EXPECT_EQ(base.dp_rank(), 0);
  EXPECT_EQ(base.dp_size(), 1);
}

// Every plugin answers dp_rank() / dp_size() through the base class: the
// data-parallel plugins their group's, HybridParallelPlugin its data-parallel
// axis's (tensor ranks share one). LoRA under tp_size > 1 is refused naming
// that setting.
TEST(Booster, PluginsGiveTheirDataParallelRankAndSize) {
  colossalai::testing::run_distributed(2, [](int rank, int world) {
    std::shared_ptr<cb::plugin::Plugin> ddp =
        std::make_shared<cb::plugin::TorchDDPPlugin>();
    EXPECT_EQ(ddp->dp_rank(), rank);
    EXPECT_EQ(ddp->dp_size(), world);
    std::shared_ptr<cb::plugin::Plugin> dp2 =
        std::make_shared<cb::plugin::HybridParallelPlugin>(
            cb::plugin::HybridParallelPluginOptions().precision("fp32"));
    EXPECT_EQ(dp2->dp_rank(), rank);
    EXPECT_EQ(dp2->dp_size(), world);
    std::shared_ptr<cb::plugin::Plugin> tp2 =
        std::make_shared<cb::plugin::HybridParallelPlugin>(
            cb::plugin::HybridParallelPluginOptions().tp_size(2).precision(
                "fp32"));
    EXPECT_EQ(tp2->dp_rank(), 0);
    EXPECT_EQ(tp2->dp_size(), 1);

    cb::Booster booster(cb::BoosterOptions().plugin(tp2));
    torch::nn::Linear lin(2, 2);
    const auto msg = error_of([&] {
      booster.enable_lora(
          lin, "", colossalai::lora::LoraConfig().r(1).target_modules({""}));
    });
    EXPECT_NE(
        msg.find("HybridParallelPlugin does not support LoRA with tp_size 2 "
                 "> 1"),
        std::string::npos)
        << msg;
    EXPECT_EQ(msg.find("HybridParallelPlugin at tp_size 1"), std::string::npos)
        << msg;
  });
}

TEST(Booster, DDPPluginNeedsLaunch) {
  auto msg = error_of([] { cb::plugin::TorchDDPPlugin plugin; });
  EXPECT_NE(msg.find("colossalai::launch"), std::string::npos) << msg;
}

TEST(DistributedSampler, ShardsAreDisjointDeterministicAndPadded) {
  const size_t n = 10;
  for (int world : {1, 2, 3, 4}) {
    std::multiset<size_t> all;
    for (int r = 0; r < world; ++r) {
      colossalai::data::DistributedSampler s(n, world, r, true, 7);
      auto a = s.indices();
      colossalai::data::DistributedSampler again(n, world, r, true, 7);
      EXPECT_EQ(a, again.indices()); // same seed + epoch, same order
      EXPECT_EQ(a.size(), (n + world - 1) / world);
      s.set_epoch(1);
      EXPECT_NE(a, s.indices()); // reshuffled
      all.insert(a.begin(), a.end());
    }
    // Every sample is drawn; only padding repeats.
    std::set<size_t> distinct(all.begin(), all.end());
    EXPECT_EQ(distinct.size(), n);
    EXPECT_EQ(all.size(), ((n + world - 1) / world) * world);
  }
  colossalai::data::DistributedSampler dropped(10, 3, 2, false, 0, true);
  EXPECT_EQ(dropped.indices(), (std::vector<size_t>{2, 5, 8}));
}

// A stop after b batches of B on R replicas, resumed on R2 replicas: the
// epoch's samples are drawn once each, padding aside; at R2 = R every rank
// draws what it would have drawn without the stop.
TEST(DistributedSampler, ResumesMidEpochAtAnyReplicaCount) {
  namespace cdata = colossalai::data;
  for (bool drop_last : {false, true}) {
    for (size_t n : {size_t(23), size_t(24)}) {
      for (int before : {1, 2, 3, 4}) {
        for (int after : {1, 2, 3, 5}) {
          for (size_t batches : {size_t(0), size_t(1), size_t(2)}) {
            const size_t b = 2;
            std::multiset<size_t> drawn;
            size_t seen = 0;
            for (int r = 0; r < before; ++r) {
              cdata::DistributedSampler s(n, before, r, true, 3, drop_last);
              s.set_epoch(4);
              auto idx = s.indices();
              const size_t take = std::min(idx.size(), batches * b);
              drawn.insert(idx.begin(), idx.begin() + take);
              seen = std::min(batches * b * before, s.total_size());
            }
            for (int r = 0; r < after; ++r) {
              cdata::DistributedSampler s(n, after, r, true, 3, drop_last);
              s.set_epoch(4);
              const auto whole = s.indices();
              s.set_samples_seen(seen);
              auto idx = s.indices();
              EXPECT_EQ(idx.size(), s.num_samples());
              drawn.insert(idx.begin(), idx.end());
              if (after == before) {
                const size_t skip = std::min(whole.size(), batches * b);
                EXPECT_EQ(
                    idx, std::vector<size_t>(whole.begin() + skip, whole.end()));
              }
              s.set_epoch(5); // a new epoch starts from its beginning
              EXPECT_EQ(s.samples_seen(), 0u);
              EXPECT_EQ(s.indices().size(), whole.size());
            }
            const std::set<size_t> distinct(drawn.begin(), drawn.end());
            const std::string where = "n " + std::to_string(n) + ", " +
                std::to_string(before) + " -> " + std::to_string(after) +
                " replicas after " + std::to_string(batches) +
                " batches, drop_last " + std::to_string(drop_last);
            if (drop_last) {
              // At most the tail a replica count cannot split is dropped.
              EXPECT_EQ(distinct.size(), drawn.size()) << where;
              EXPECT_GT(distinct.size() + before + after, n) << where;
            } else {
              EXPECT_EQ(distinct.size(), n) << where;
              EXPECT_LT(drawn.size(), n + before + after) << where;
            }
          }
        }
      }
    }
  }
}

TEST(Launch, BadEnvironmentNamesTheVariable) {
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  ::unsetenv("SLURM_PROCID");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ::unsetenv("SLURM_NTASKS");
  // No launcher: one process.
  colossalai::launch_from_env();
  EXPECT_EQ(colossalai::distributed::get_world_size(), 1);
  EXPECT_EQ(colossalai::distributed::get_rank(), 0);
  colossalai::destroy();

  ::setenv("RANK", "zero", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  auto msg = error_of([] { colossalai::launch_from_env(); });
  EXPECT_NE(msg.find("RANK='zero'"), std::string::npos) << msg;

  ::setenv("RANK", "0", 1);
  ::unsetenv("MASTER_ADDR");
  msg = error_of([] { colossalai::launch_from_env(); });
  EXPECT_NE(msg.find("MASTER_ADDR"), std::string::npos) << msg;

  ::setenv("RANK", "5", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "1234", 1);
  msg = error_of([] { colossalai::launch_from_env(); });
  EXPECT_NE(msg.find("rank must be in [0, world_size=2)"), std::string::npos)
      << msg;
  for (auto v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    ::unsetenv(v);
  }
  msg = error_of([] {
    colossalai::launch(
        colossalai::LaunchOptions().rank(0).world_size(1).backend("mpi"));
  });
  EXPECT_NE(msg.find("backend"), std::string::npos) << msg;
}

TEST(Launch, UnreachableMasterTimesOutWithAClearError) {
  // Rank 1 of 2 with nobody serving the port: the rendezvous must give up
  // after the timeout and say where it tried.
  int port = colossalai::testing::free_port();
  auto t0 = std::chrono::steady_clock::now();
  auto msg = error_of([&] {
    colossalai::launch(
        colossalai::LaunchOptions().rank(1).world_size(2).port(port).timeout(
            std::chrono::seconds(2)));
  });
  auto elapsed = std::chrono::steady_clock::now() - t0;
  EXPECT_NE(
      msg.find("rendezvous at 127.0.0.1:" + std::to_string(port)),
      std::string::npos)
      << msg;
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_LT(elapsed, std::chrono::seconds(60)); // bounded, not a hang
}

TEST(ProcessGroupMesh, GroupsAlongAxes) {
  colossalai::testing::run_distributed(4, [](int rank, int) {
    colossalai::cluster::ProcessGroupMesh mesh({2, 2});
    EXPECT_EQ(mesh.coordinate(), (std::vector<int>{rank / 2, rank % 2}));
    auto tp = mesh.get_group_along_axis(1);
    auto dp = mesh.get_group_along_axis(0);
    EXPECT_EQ(tp->ranks(), (std::vector<int>{rank / 2 * 2, rank / 2 * 2 + 1}));
    EXPECT_EQ(dp->ranks(), (std::vector<int>{rank % 2, rank % 2 + 2}));
    EXPECT_EQ(mesh.get_group_along_axis(1).get(), tp.get()); // cached
    // The groups really communicate among their members only.
    auto t = at::full({1}, static_cast<double>(rank));
    colossalai::distributed::all_reduce(t, *tp).wait();
    EXPECT_EQ(t.item<float>(), (rank / 2 * 2) * 2 + 1);
    t.fill_(rank);
    colossalai::distributed::all_reduce(t, *dp).wait();
    EXPECT_EQ(t.item<float>(), (rank % 2) * 2 + 2);
    EXPECT_EQ(mesh.get_group_along_axis({0, 1})->size(), 4);
    EXPECT_THROW(colossalai::cluster::ProcessGroupMesh({3}), c10::Error);
  });
}

// What a CUDA graph cannot capture is refused by name, before any capture:
// each optimizer wrapper says why its step cannot be captured (the
// captured step itself runs on a GPU: test_cuda).
TEST(GraphedStep, RefusesWhatItCannotCaptureByName) {
  namespace cp = colossalai::booster::plugin;
  namespace copt = colossalai::nn::optimizer;
  const bool fused_here =
      colossalai::compat::has_fused_adam(at::kCPU) && COLOSSALAI_TORCH_AT_LEAST(2, 2);
  auto contains = [](const std::string& what, const std::string& part) {
    EXPECT_NE(what.find(part), std::string::npos) << "'" << part << "' not in: " << what;
  };
  auto blocker = [](std::shared_ptr<cp::Plugin> plugin, bool fused, const std::string& precision = "") {
    torch::manual_seed(0);
    auto model = torch::nn::Linear(8, 4);
    std::shared_ptr<torch::optim::Optimizer> opt;
    if (fused) {
      opt = std::make_shared<copt::FusedAdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
    } else {
      opt = std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
    }
    cb::Booster booster(cb::BoosterOptions().plugin(plugin).mixed_precision(precision));
    return booster.boost(model, opt).optimizer->graph_capture_blocker();
  };
  colossalai::testing::run_distributed(1, [&](int, int) {
    auto zero = [](cp::LowLevelZeroPluginOptions o) {
      return std::make_shared<cp::LowLevelZeroPlugin>(o);
    };
    const auto bf16 = cp::LowLevelZeroPluginOptions().precision("bf16");
    // The booster's own wrapper and LowLevelZero's at one rank: the
    // optimizer decides.
    const auto fused_why = blocker(nullptr, true);
    EXPECT_EQ(fused_why.empty(), fused_here) << fused_why;
    EXPECT_EQ(blocker(zero(bf16), true), fused_why);
    contains(blocker(nullptr, false), "FusedAdamW");
    contains(blocker(zero(bf16), false), "FusedAdamW");
    // max_norm at one rank clips on the device: captured.
    EXPECT_EQ(blocker(zero(cp::LowLevelZeroPluginOptions(bf16).max_norm(1.0)), true), fused_why);
    contains(blocker(zero(cp::LowLevelZeroPluginOptions(bf16).stage(2).cpu_offload(true)), true), "cpu_offload");
    contains(blocker(std::make_shared<cp::TorchDDPPlugin>(), true), "TorchDDPPlugin");
    // LowLevelZero's gradient hooks made again (on a capture's stream):
    // refused while a graph holds them, and then training is unchanged,
    // each gradient counted once.
    {
      auto train = [&](bool rehook) {
        torch::manual_seed(3);
        auto model = torch::nn::Linear(8, 4);
        auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
        cb::Booster booster(cb::BoosterOptions().plugin(zero(bf16)));
        auto boosted = booster.boost(model, opt);
        for (int step = 0; step < 3; ++step) {
          torch::manual_seed(100 + step);
          auto loss = boosted.model(torch::randn({4, 8})).pow(2).mean();
          if (rehook && step == 1) {
            EXPECT_THROW(boosted.optimizer->prepare_graph_stream(), c10::Error); // `loss` holds them
          }
          booster.backward(loss, *boosted.optimizer);
          boosted.optimizer->step();
          boosted.optimizer->zero_grad();
          if (rehook && step == 1) {
            loss = at::Tensor();
            boosted.optimizer->prepare_graph_stream();
          }
        }
        return model->weight.detach().to(at::kFloat).clone();
      };
      EXPECT_TRUE(torch::equal(train(true), train(false)));
    }
    // fp16: over FusedAdamW the optimizer decides (the verdict stays on
    // the device); over an optimizer that cannot skip there, refused.
    {
      auto model = torch::nn::Linear(8, 4);
      cb::mixed_precision::TorchAMPOptimizer amp(
          std::make_shared<copt::FusedAdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3)));
      EXPECT_EQ(amp.graph_capture_blocker(), fused_why);
      cb::mixed_precision::TorchAMPOptimizer sgd(
          std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1)));
      contains(sgd.graph_capture_blocker(), "bf16");
      contains(sgd.graph_capture_blocker(), "FusedAdamW");
    }
    // The step object refuses before its first call.
    auto model = torch::nn::Linear(8, 4);
    auto opt = std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
    cb::Booster booster{cb::BoosterOptions()};
    auto boosted = booster.boost(model, opt);
    auto fn = [&](const std::vector<at::Tensor>& in) { return model(in[0]).sum(); };
    try {
      cb::GraphedStep step(boosted.optimizer, fn);
      ADD_FAILURE() << "an uncapturable optimizer was taken";
    } catch (const c10::Error& e) {
#ifdef COLOSSALAI_WITH_CUDA
      contains(e.what(), "cannot be captured");
      contains(e.what(), "FusedAdamW");
#else
      contains(e.what(), "no CUDA");
#endif
    }
#ifdef COLOSSALAI_WITH_CUDA
    if (fused_here) {
      auto fused = std::make_shared<copt::FusedAdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
      auto fused_boosted = booster.boost(model, fused);
      EXPECT_THROW(
          cb::GraphedStep(fused_boosted.optimizer, fn, cb::GraphedStepOptions().warmup(0)),
          c10::Error);
      cb::GraphedStep step(fused_boosted.optimizer, fn);
      try {
        step({torch::randn({2, 8})});
        ADD_FAILURE() << "a host input was taken";
      } catch (const c10::Error& e) {
        contains(e.what(), "must be a CUDA tensor");
      }
    }
#endif
  });
  // Several ranks: LowLevelZero's collectives are not captured.
  colossalai::testing::run_distributed(2, [&](int, int) {
    contains(
        blocker(std::make_shared<cp::LowLevelZeroPlugin>(
                    cp::LowLevelZeroPluginOptions().precision("bf16")),
                true),
        "2 ranks");
  });
}

// LowLevelZero stage 1 in bf16 at one rank over FusedAdamW in graph mode,
// stepped as GraphedStep's replays step it (prepare_graph_step, then the
// device's half) but with the host logic around it run each time, as the
// CPU has no graphs: the plan over the shard pieces, the gradients bound
// to the flat gradient shard's views, max_norm's clipping on the device and
// the bf16 working copies written by the step equal ordinary training bit
// for bit, with the learning rate halving (powers of two: exact in
// float32).
TEST(GraphedStep, LowLevelZeroGraphModeEqualsOrdinarySteps) {
  if (!(colossalai::compat::has_fused_adam(at::kCPU) && COLOSSALAI_TORCH_AT_LEAST(2, 2))) {
    GTEST_SKIP() << "no fused Adam on the CPU in this LibTorch";
  }
  namespace cp = colossalai::booster::plugin;
  colossalai::testing::run_distributed(1, [](int, int) {
    auto train = [](bool graph_mode) {
      torch::manual_seed(5);
      auto model = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(), torch::nn::Linear(32, 4));
      auto opt = std::make_shared<colossalai::nn::optimizer::FusedAdamW>(
          model->parameters(), torch::optim::AdamWOptions(std::ldexp(1.0, -6)).weight_decay(0.125));
      // max_norm binds (gradients of a few units): clipped on the device.
      cb::Booster booster(cb::BoosterOptions().plugin(std::make_shared<cp::LowLevelZeroPlugin>(
          cp::LowLevelZeroPluginOptions().stage(1).precision("bf16").max_norm(0.05))));
      auto boosted = booster.boost(model, opt);
      EXPECT_EQ(boosted.optimizer->graph_capture_blocker(), "");
      for (int step = 0; step < 6; ++step) {
        if (graph_mode && step == 2) {
          boosted.optimizer->set_graph_mode(true);
        } else if (graph_mode && step > 2) {
          boosted.optimizer->prepare_graph_step();
        }
        torch::manual_seed(200 + step);
        boosted.optimizer->zero_grad();
        auto loss = boosted.model(torch::randn({8, 16})).pow(2).mean();
        booster.backward(loss, *boosted.optimizer);
        boosted.optimizer->step();
        for (auto& g : boosted.optimizer->param_groups()) {
          g.options().set_lr(g.options().get_lr() / 2);
        }
      }
      std::vector<at::Tensor> out;
      for (const auto& p : model->parameters()) {
        out.push_back(p.detach().to(at::kFloat).clone());
      }
      for (const auto& kv : opt->state()) {
        EXPECT_EQ(static_cast<const torch::optim::AdamWParamState&>(*kv.second).step(), 6);
      }
      return out;
    };
    const auto graphed = train(true);
    const auto ordinary = train(false);
    ASSERT_EQ(graphed.size(), ordinary.size());
    for (size_t i = 0; i < graphed.size(); ++i) {
      EXPECT_TRUE(torch::equal(graphed[i], ordinary[i])) << "parameter " << i;
    }
  });
}

// clip_grad_by_norm_tensor clips with torch.nn.utils.clip_grad_norm_'s
// arithmetic and reads nothing back: without plugin and under LowLevelZero
// at one rank, 3 SGD steps whose clip binds equal a plain model clipped by
// clip_grad_norm_ within float32 rounding (a norm of per-parameter norms
// in another grouping: a few ulps), and the returned norm (a float32 scalar
// on the gradients' device) is clip_grad_norm_'s. Where the norm is
// reduced on the host it is refused by name: LowLevelZero over 2 ranks,
// HybridParallelPlugin.
TEST(OptimizerWrapper, ClipGradByNormTensorIsTorchsClipGradNorm) {
  namespace cp = colossalai::booster::plugin;
  colossalai::testing::run_distributed(1, [](int, int) {
    auto make = [] {
      torch::manual_seed(19);
      return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(), torch::nn::Linear(32, 4));
    };
    auto batch = [](int step) {
      torch::manual_seed(400 + step);
      return torch::randn({8, 16});
    };
    for (const std::string plugin : {"none", "zero"}) {
      SCOPED_TRACE(plugin);
      auto plain = make();
      torch::optim::SGD plain_opt(plain->parameters(), torch::optim::SGDOptions(0.5));
      auto model = make();
      auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.5));
      auto options = cb::BoosterOptions();
      if (plugin == "zero") {
        options.plugin(std::make_shared<cp::LowLevelZeroPlugin>(
            cp::LowLevelZeroPluginOptions().stage(2).precision("fp32")));
      }
      cb::Booster booster(options);
      auto boosted = booster.boost(model, opt);
      for (int step = 0; step < 3; ++step) {
        plain_opt.zero_grad();
        plain->forward(batch(step)).pow(2).mean().mul(100).backward();
        const double want = torch::nn::utils::clip_grad_norm_(plain->parameters(), 0.05);
        EXPECT_GT(want, 0.05); // the clip binds
        plain_opt.step();
        boosted.optimizer->zero_grad();
        booster.backward(boosted.model(batch(step)).pow(2).mean() * 100, *boosted.optimizer);
        const auto norm = boosted.optimizer->clip_grad_by_norm_tensor(0.05);
        EXPECT_EQ(norm.dim(), 0);
        EXPECT_EQ(norm.scalar_type(), at::kFloat);
        EXPECT_NEAR(norm.item<double>(), want, 1e-5 * want);
        boosted.optimizer->step();
      }
      const auto a = plain->parameters();
      const auto b = model->parameters();
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(at::allclose(a[i], b[i], 1e-5, 1e-6))
            << "parameter " << i << " differs by " << (a[i] - b[i]).abs().max().item<double>();
      }
    }
  });
  colossalai::testing::run_distributed(2, [](int, int) {
    auto refused = [](cb::BoosterOptions options, const std::string& part) {
      torch::manual_seed(19);
      auto model = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Linear(32, 4));
      auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.5));
      cb::Booster booster(options);
      auto boosted = booster.boost(model, opt);
      booster.backward(boosted.model(torch::randn({8, 16})).pow(2).mean(), *boosted.optimizer);
      try {
        boosted.optimizer->clip_grad_by_norm_tensor(1.0);
        ADD_FAILURE() << "no error; expected one naming '" << part << "'";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      }
      // The host-side clip still works there.
      EXPECT_GT(boosted.optimizer->clip_grad_by_norm(1.0), 0.0);
    };
    refused(
        cb::BoosterOptions().plugin(std::make_shared<cp::LowLevelZeroPlugin>(
            cp::LowLevelZeroPluginOptions().stage(2).precision("fp32"))),
        "several ranks");
    refused(
        cb::BoosterOptions().plugin(std::make_shared<cp::HybridParallelPlugin>(
            cp::HybridParallelPluginOptions().tp_size(1).pp_size(1).precision("fp32"))),
        "HybridParallelPlugin");
  });
}

// LowLevelZero's max_norm at one rank clips on the gradients' device with
// torch.nn.utils.clip_grad_norm_'s arithmetic (float32 coefficient, clamped
// to 1): after 3 SGD steps whose clip binds, the weights equal a plain
// model clipped by clip_grad_norm_ within float32 rounding (the norm of the
// flat shard against the norm of per-parameter norms: a few ulps).
TEST(ShardedOptimizer, OneRankMaxNormIsTorchsClipGradNorm) {
  namespace cp = colossalai::booster::plugin;
  colossalai::testing::run_distributed(1, [](int, int) {
    auto make = [] {
      torch::manual_seed(9);
      return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(), torch::nn::Linear(32, 4));
    };
    auto batch = [](int step) {
      torch::manual_seed(300 + step);
      return torch::randn({8, 16});
    };
    auto plain = make();
    torch::optim::SGD plain_opt(plain->parameters(), torch::optim::SGDOptions(0.5));
    auto model = make();
    auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.5));
    cb::Booster booster(cb::BoosterOptions().plugin(std::make_shared<cp::LowLevelZeroPlugin>(
        cp::LowLevelZeroPluginOptions().stage(2).precision("fp32").max_norm(0.05))));
    auto boosted = booster.boost(model, opt);
    for (int step = 0; step < 3; ++step) {
      plain_opt.zero_grad();
      auto loss = plain->forward(batch(step)).pow(2).mean() * 100;
      loss.backward();
      const double norm = torch::nn::utils::clip_grad_norm_(plain->parameters(), 0.05);
      EXPECT_GT(norm, 0.05); // the clip binds
      plain_opt.step();
      boosted.optimizer->zero_grad();
      booster.backward(boosted.model(batch(step)).pow(2).mean() * 100, *boosted.optimizer);
      boosted.optimizer->step();
    }
    const auto a = plain->parameters();
    const auto b = model->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::allclose(a[i], b[i], 1e-5, 1e-6))
          << "parameter " << i << " differs by " << (a[i] - b[i]).abs().max().item<double>();
    }
  });
}
