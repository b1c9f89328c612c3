// What needs a GPU: device selection, CUDA tensors over Gloo (several ranks
// on one GPU), NCCL at world size 1 and its failures as exceptions, every
// data-parallel plugin on CUDA against one process, fp16 with dynamic loss
// scaling and bf16, HybridAdam's CUDA path. Without a CUDA device each test
// skips and says why; tests/gpu/run.sh runs them where there is one.
//
// Tolerances: fp32 runs compare with one process on the same GPU by the
// bound test_strategies justifies (|w - ref| <= 1e-5 + 1e-4 |ref|: SGD is
// linear in the gradient, only the rounding of the batch sum differs). fp16
// and bf16 runs compare with fp32 one-process training: a few steps of SGD
// at lr 0.1 move weights by ~1e-2, and 16-bit autocast changes each matmul
// by its rounding (2^-8 relative for bf16), so the weights agree to 2e-2
// absolute, while a lost rank or a wrong average moves them by the update
// itself.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/graphed_step.h>
#include <colossalai/booster/mixed_precision/fp16_torch.h>
#include <colossalai/booster/plugin/gemini_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/booster/plugin/torch_fsdp_plugin.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/initialize.h>
#include <colossalai/models/llama.h>
#include <colossalai/nn/checkpoint.h>
#include <colossalai/nn/optimizer/fused_adam.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/shardformer/layer/normalization.h>
#include <colossalai/zero/fully_sharded.h>
#include <colossalai/zero/sharded_optimizer.h>

#include <harness/multiprocess.h>
#include <harness/zoo_util.h>
#include <zoo/gpt.h>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <optional>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
namespace cz = colossalai::zero;
namespace zoo = colossalai::zoo;
using colossalai::testing::max_abs_diff;
using colossalai::testing::MultiProcessOptions;
using colossalai::testing::run_distributed;

namespace {

int cuda_devices() {
  return torch::cuda::is_available()
      ? static_cast<int>(torch::cuda::device_count())
      : 0;
}

#define SKIP_WITHOUT_CUDA(n)                                            \
  if (cuda_devices() < (n)) {                                           \
    GTEST_SKIP() << "needs " << (n) << " CUDA device(s); this process " \
                 << "sees " << cuda_devices();                          \
  }

MultiProcessOptions on_cuda(const std::string& backend = "gloo") {
  MultiProcessOptions o;
  o.backend = backend;
  o.device = "cuda";
  return o;
}

constexpr int kMicro = 2;
constexpr int kSteps = 3;

zoo::GPTConfig tiny() {
  return zoo::GPTConfig::tiny_test();
}

std::pair<at::Tensor, at::Tensor> global_batch(int step, int world) {
  return zoo::random_tokens(kMicro * world, tiny(), 1000 + step);
}

// Weights after kSteps of SGD under `plugin` (null: this process alone
// with the global batch) and the Booster's `mixed_precision`, gathered
// where sharded, in fp32 on the host.
std::vector<at::Tensor> train(
    std::shared_ptr<cb::plugin::Plugin> plugin,
    const std::string& booster_precision,
    int rank,
    int world) {
  torch::manual_seed(42);
  zoo::GPT model(tiny());
  auto opt = colossalai::testing::make_optimizer(model->parameters(), true);
  const bool alone = plugin == nullptr;
  cb::Booster booster(
      cb::BoosterOptions().plugin(plugin).mixed_precision(booster_precision));
  auto boosted = booster.boost(model, opt);
  for (int step = 0; step < kSteps; ++step) {
    auto b = global_batch(step, world);
    // CPU batches: the Booster moves the model's inputs to its device.
    auto x = alone ? b.first : b.first.narrow(0, kMicro * rank, kMicro);
    auto y = alone ? b.second : b.second.narrow(0, kMicro * rank, kMicro);
    boosted.optimizer->zero_grad();
    booster.backward(
        zoo::gpt_loss(boosted.model(x), y.to(colossalai::current_device())),
        *boosted.optimizer);
    boosted.optimizer->step();
  }
  std::vector<at::Tensor> out;
  auto* f = colossalai::interface::find_wrapper<cz::FullyShardedModel>(
      *boosted.model.wrapper());
  std::optional<cz::FullyShardedModel::FullParams> guard;
  if (f != nullptr) {
    guard.emplace(f->summon_full_params());
  }
  for (const auto& p : model->parameters()) {
    out.push_back(p.detach().to(at::kCPU, at::kFloat, false, true));
  }
  return out;
}

struct Named {
  std::string name;
  std::function<std::shared_ptr<cb::plugin::Plugin>(const std::string&)> make;
};

// ZeRO's fp16 loss scale starts where the others' does, not at
// ColossalAI's 2^32: there the first steps' fp16 gradients overflow and are
// skipped (as designed), and a three-step comparison would measure the
// skips rather than the precision.
constexpr double kInitialScale = 65536.0;

std::vector<Named> plugins() {
  using P = std::shared_ptr<cb::plugin::Plugin>;
  return {
      {"ddp",
       [](const std::string&) -> P {
         return std::make_shared<cb::plugin::TorchDDPPlugin>();
       }},
      {"zero1",
       [](const std::string& p) -> P {
         return std::make_shared<cb::plugin::LowLevelZeroPlugin>(
             cb::plugin::LowLevelZeroPluginOptions()
                 .stage(1)
                 .precision(p)
                 .initial_scale(kInitialScale));
       }},
      {"zero2_cpu_offload",
       [](const std::string& p) -> P {
         return std::make_shared<cb::plugin::LowLevelZeroPlugin>(
             cb::plugin::LowLevelZeroPluginOptions()
                 .stage(2)
                 .precision(p)
                 .initial_scale(kInitialScale)
                 .cpu_offload(true));
       }},
      {"fsdp",
       [](const std::string& p) -> P {
         cb::plugin::TorchFSDPPluginOptions o;
         if (p == "fp16") {
           o.param_dtype(at::kHalf);
         } else if (p == "bf16") {
           o.param_dtype(at::kBFloat16);
         }
         return std::make_shared<cb::plugin::TorchFSDPPlugin>(o);
       }},
      {"gemini",
       [](const std::string& p) -> P {
         return std::make_shared<cb::plugin::GeminiPlugin>(
             cb::plugin::GeminiPluginOptions().precision(p));
       }},
      // Half the fp32 shards on the (pinned) host: gradients on two devices.
      {"gemini_half_offload",
       [](const std::string& p) -> P {
         return std::make_shared<cb::plugin::GeminiPlugin>(
             cb::plugin::GeminiPluginOptions().precision(p).offload_optim_frac(
                 0.5));
       }},
  };
}

} // namespace

TEST(Cuda, LaunchMakesTheLocalRanksDeviceCurrent) {
  SKIP_WITHOUT_CUDA(1);
  run_distributed(
      2,
      [](int rank, int) {
        const auto d = colossalai::current_device();
        ASSERT_TRUE(d.is_cuda());
        EXPECT_EQ(d.index(), rank % cuda_devices());
        // The current device is set: a plain CUDA tensor lands there.
        EXPECT_EQ(at::empty({1}, at::kCUDA).device().index(), d.index());
      },
      on_cuda());
}

TEST(Cuda, GlooCarriesCudaTensors) {
  SKIP_WITHOUT_CUDA(1);
  run_distributed(
      2,
      [](int rank, int world) {
        auto g = cd::world_group();
        const auto dev = colossalai::current_device();
        auto t = at::full({5}, rank + 1.0, at::TensorOptions(dev));
        cd::all_reduce(t, *g).wait();
        EXPECT_TRUE(t.is_cuda());
        EXPECT_TRUE(at::equal(t.cpu(), at::full({5}, 3.0)));
        auto h = at::full(
            {4}, rank + 1.0, at::TensorOptions(dev).dtype(at::kBFloat16));
        cd::all_reduce(h, *g, cd::ReduceOp::kAvg).wait();
        EXPECT_TRUE(at::equal(h.cpu().to(at::kFloat), at::full({4}, 1.5)));
        auto whole = at::empty({2 * world}, at::TensorOptions(dev));
        cd::all_gather(
            whole, at::full({2}, double(rank), at::TensorOptions(dev)), *g)
            .wait();
        EXPECT_TRUE(
            at::equal(whole.cpu(), torch::tensor({0.f, 0.f, 1.f, 1.f})));
        auto mine = at::empty({2}, at::TensorOptions(dev));
        cd::reduce_scatter(
            mine, at::arange(4, at::TensorOptions(dev).dtype(at::kFloat)), *g)
            .wait();
        EXPECT_TRUE(at::equal(
            mine.cpu(),
            (at::arange(4).to(at::kFloat) * 2).narrow(0, 2 * rank, 2)));
        auto b = at::full({3}, rank == 1 ? 7.0 : 0.0, at::TensorOptions(dev));
        cd::broadcast(b, 1, *g).wait();
        EXPECT_TRUE(at::equal(b.cpu(), at::full({3}, 7.0)));
        auto hop = cd::ring_exchange(
            at::full({3}, double(rank), at::TensorOptions(dev)), *g, 5);
        hop.arrived.wait();
        hop.sent.wait();
        EXPECT_TRUE(
            at::equal(hop.received.cpu(), at::full({3}, double(1 - rank))));
        EXPECT_TRUE(hop.received.is_cuda());
      },
      on_cuda());
}

TEST(Cuda, NcclAtWorldSizeOneAndItsFailuresAreCatchable) {
  SKIP_WITHOUT_CUDA(1);
  run_distributed(
      1,
      [](int, int) {
        auto g = cd::world_group();
        EXPECT_EQ(g->backend_type(), cd::BackendType::kNccl);
        auto t = at::ones({8}, at::TensorOptions(colossalai::current_device()));
        cd::all_reduce(t, *g).wait();
        cd::barrier(*g).wait();
        EXPECT_TRUE(at::equal(t.cpu(), at::ones({8})));
        // launch chose blocking waits and communicator aborts over the
        // watchdog's process teardown (NOTE [NCCL failures are exceptions]).
        EXPECT_STREQ(std::getenv("TORCH_NCCL_BLOCKING_WAIT"), "1");
        EXPECT_STREQ(std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "2");
      },
      on_cuda("nccl"));
}

TEST(Cuda, NcclPeerThatExitsIsADistributedError) {
  SKIP_WITHOUT_CUDA(2);
  MultiProcessOptions o = on_cuda("nccl");
  o.collective_timeout_seconds = 20;
  o.final_barrier = false;
  auto results = colossalai::testing::run_processes(
      2,
      [](int rank, int) {
        auto g = cd::world_group();
        auto t = at::ones({8}, at::TensorOptions(colossalai::current_device()));
        cd::all_reduce(t, *g).wait();
        if (rank == 1) {
          std::_Exit(0); // gone without a word
        }
        std::string error;
        try {
          cd::all_reduce(t, *g).wait();
        } catch (const cd::DistributedError& e) {
          error = e.what();
        }
        EXPECT_NE(error.find("all_reduce"), std::string::npos) << error;
      },
      o);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].exit_code, 0) << results[0].output;
  EXPECT_FALSE(results[0].timed_out) << results[0].output;
}

TEST(Cuda, EveryPluginMatchesOneProcessInFp32) {
  SKIP_WITHOUT_CUDA(1);
  run_distributed(
      2,
      [](int rank, int world) {
        auto ref = train(nullptr, "fp32", rank, world);
        for (const auto& p : plugins()) {
          auto got = train(p.make("fp32"), "fp32", rank, world);
          for (size_t i = 0; i < got.size(); ++i) {
            EXPECT_TRUE(at::allclose(got[i], ref[i], 1e-4, 1e-5))
                << p.name << ": parameter " << i << " differs by "
                << (got[i] - ref[i]).abs().max().item<double>();
          }
        }
      },
      on_cuda());
}

TEST(Cuda, EveryPluginTrainsInFp16AndBf16) {
  SKIP_WITHOUT_CUDA(1);
  run_distributed(
      2,
      [](int rank, int world) {
        auto ref = train(nullptr, "fp32", rank, world);
        for (const std::string precision : {"fp16", "bf16"}) {
          // One process under the Booster's own mixed precision.
          EXPECT_LE(
              max_abs_diff(train(nullptr, precision, rank, world), ref), 2e-2)
              << "one process, " << precision;
          for (const auto& p : plugins()) {
            // DDP takes the Booster's precision; FSDP (param_dtype), ZeRO
            // and Gemini their own.
            const bool own = p.name != "ddp";
            auto got = train(
                p.make(own ? precision : "fp32"),
                own ? "" : precision,
                rank,
                world);
            EXPECT_LE(max_abs_diff(got, ref), 2e-2)
                << p.name << ", " << precision;
          }
        }
      },
      on_cuda());
}

TEST(Cuda, Fp16LossScalerSkipsAnOverflowingStepAndBacksOff) {
  SKIP_WITHOUT_CUDA(1);
  run_distributed(
      1,
      [](int, int) {
        namespace mp = cb::mixed_precision;
        auto fp16 = std::make_shared<mp::FP16TorchMixedPrecision>(
            colossalai::amp::GradScalerOptions().init_scale(1e30));
        cb::Booster booster(cb::BoosterOptions().mixed_precision(fp16));
        torch::manual_seed(0);
        torch::nn::Linear model(8, 8);
        auto opt = std::make_shared<torch::optim::SGD>(
            model->parameters(), torch::optim::SGDOptions(0.1));
        auto boosted = booster.boost(model, opt);
        const auto before = model->weight.detach().clone();
        auto x = at::randn({4, 8}).to(colossalai::current_device());
        boosted.optimizer->zero_grad();
        booster.backward(boosted.model(x).pow(2).mean(), *boosted.optimizer);
        boosted.optimizer->step();
        auto* amp =
            dynamic_cast<mp::TorchAMPOptimizer*>(boosted.optimizer.get());
        ASSERT_NE(amp, nullptr);
        EXPECT_TRUE(amp->last_step_skipped()); // 1e30 overflows fp16
        EXPECT_TRUE(at::equal(model->weight.detach(), before));
        EXPECT_LT(amp->scaler().get_scale(), 1e30);
      },
      on_cuda());
}

// fp16 over FusedAdamW on a GPU, without a plugin and with LowLevelZero at
// one rank (its fp16 weights written by the AdamW kernel's pass): no value
// read back and no copy the host waits for in a step (the verdict reaches
// pinned memory behind an event); an overflowing step is skipped by the
// kernel on the device, and the host learns it at the next step, taking
// the step count back.
TEST(Cuda, Fp16WithFusedAdamWStepsWithoutWaitingForTheDevice) {
  SKIP_WITHOUT_CUDA(1);
  run_distributed(
      1,
      [](int, int) {
        namespace mp = cb::mixed_precision;
        using colossalai::testing::host_syncs;
        using colossalai::testing::op_calls;
        for (bool zero : {false, true}) {
          SCOPED_TRACE(zero ? "LowLevelZero fp16" : "no plugin, fp16");
          cb::BoosterOptions options;
          if (zero) {
            options.plugin(std::make_shared<cb::plugin::LowLevelZeroPlugin>(
                cb::plugin::LowLevelZeroPluginOptions().stage(2).precision(
                    "fp16")));
          } else {
            options.mixed_precision(
                std::make_shared<mp::FP16TorchMixedPrecision>(
                    colossalai::amp::GradScalerOptions().init_scale(1024)));
          }
          cb::Booster booster(options);
          torch::manual_seed(0);
          torch::nn::Linear model(64, 64);
          auto fused =
              std::make_shared<colossalai::nn::optimizer::FusedAdamW>(
                  model->parameters(), torch::optim::AdamWOptions(1e-3));
          auto boosted = booster.boost(model, fused);
          auto skipped = [&] {
            if (auto* amp = dynamic_cast<mp::TorchAMPOptimizer*>(
                    boosted.optimizer.get())) {
              return amp->last_step_skipped();
            }
            auto* sharded = dynamic_cast<colossalai::zero::ShardedOptimizer*>(
                boosted.optimizer.get());
            EXPECT_NE(sharded, nullptr);
            return sharded != nullptr && sharded->last_step_skipped();
          };
          const auto x = at::randn({16, 64}).to(colossalai::current_device());
          auto step = [&](bool plant) {
            boosted.optimizer->zero_grad();
            auto out = boosted.model(x);
            if (plant) {
              out = out * std::numeric_limits<float>::infinity();
            }
            booster.backward(
                out.to(at::kFloat).pow(2).mean(), *boosted.optimizer);
            boosted.optimizer->step();
          };
          step(false); // the optimizer's state and the scale move to the GPU
          for (bool plant : {false, true, false}) {
            const auto before = model->weight.detach().clone();
            const auto syncs = host_syncs(op_calls([&] { step(plant); }));
            EXPECT_TRUE(syncs.empty()) << "a step made the host wait";
            EXPECT_EQ(skipped(), plant);
            EXPECT_EQ(at::equal(model->weight.detach(), before), plant);
          }
          int64_t counts = 0;
          for (const auto& kv : fused->state()) {
            counts = std::max(
                counts,
                static_cast<torch::optim::AdamWParamState&>(*kv.second)
                    .step());
          }
          EXPECT_EQ(counts, 3); // four steps, one skipped
        }
      },
      on_cuda());
}

TEST(Cuda, HybridAdamOnCudaEqualsAdamW) {
  SKIP_WITHOUT_CUDA(1);
  torch::manual_seed(0);
  auto a = at::randn({1000}, at::kCUDA).requires_grad_();
  auto b = a.detach().clone().requires_grad_();
  colossalai::nn::optimizer::HybridAdam mine(
      std::vector<at::Tensor>{a},
      colossalai::nn::optimizer::HybridAdamOptions(1e-2).weight_decay(0.01));
  torch::optim::AdamW ref(
      std::vector<at::Tensor>{b},
      torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  for (int step = 0; step < 5; ++step) {
    auto g = at::randn({1000}, at::kCUDA);
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    mine.step();
    ref.step();
  }
  // The same formula in fp32; only the order of operations differs.
  EXPECT_TRUE(at::allclose(a.detach().cpu(), b.detach().cpu(), 1e-5, 1e-6));
}

// ------------------------------------------------------------ GraphedStep

namespace {

struct StepRecord {
  std::vector<at::Tensor> losses, weights;
  int64_t step_count = 0;
};

// Six steps of a tiny model (bf16: the booster's autocast, or LowLevelZero
// stage 1's bf16 weights and fp32 masters), FusedAdamW, the learning rate
// halved every two steps (powers of two: exact in float32, so ATen's fused
// kernel reading it from device memory gets the value an eager step passes
// as a double). `graphed`: through GraphedStep (two warm-up calls, the
// third captured); else plain calls.
template <class Model, class Loss>
StepRecord graph_run_of(
    Model model,
    const Loss& loss_of,
    const std::string& plugin,
    bool graphed) {
  auto opt = std::make_shared<colossalai::nn::optimizer::FusedAdamW>(
      model->parameters(),
      torch::optim::AdamWOptions(std::ldexp(1.0, -10)).weight_decay(0.0625));
  auto options = cb::BoosterOptions().device("cuda");
  // fp16: the loss scaler's verdict stays on the device; the loss of step
  // 4 (a replay) is made inf, so that step is skipped.
  const bool fp16 = plugin == "fp16" || plugin == "zero1_fp16";
  if (plugin == "fp16") {
    options.mixed_precision(
        std::make_shared<cb::mixed_precision::FP16TorchMixedPrecision>(
            colossalai::amp::GradScalerOptions().init_scale(1024)));
  } else if (plugin == "zero1_fp16") {
    options.plugin(std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions().stage(1).precision("fp16").initial_scale(
            1024)));
  } else if (plugin == "zero1" || plugin == "zero1_clip") {
    // zero1_clip: max_norm clips on the device (captured with the step).
    options.plugin(std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions().stage(1).precision("bf16").max_norm(
            plugin == "zero1_clip" ? 0.25 : 0.0)));
  } else {
    options.mixed_precision("bf16");
  }
  cb::Booster booster(options);
  auto boosted = booster.boost(model, opt);
  auto fn = [&](const std::vector<at::Tensor>& in) {
    boosted.optimizer->zero_grad();
    auto loss = loss_of(boosted, in);
    if (fp16) {
      loss = loss * in[2];
    }
    booster.backward(loss, *boosted.optimizer);
    if (plugin == "none_clip") { // on the device: captured with the step
      boosted.optimizer->clip_grad_by_norm_tensor(0.25);
    }
    boosted.optimizer->step();
    return loss;
  };
  std::optional<cb::GraphedStep> step;
  if (graphed) {
    step.emplace(boosted.optimizer, fn, cb::GraphedStepOptions().warmup(2));
  }
  StepRecord out;
  for (int s = 0; s < 6; ++s) {
    auto b = zoo::random_tokens(2, tiny(), 2000 + s);
    std::vector<at::Tensor> in{b.first.cuda(), b.second.cuda()};
    if (fp16) {
      in.push_back(at::full(
          {}, s == 4 ? std::numeric_limits<double>::infinity() : 1.0,
          at::device(at::kCUDA)));
    }
    auto loss = graphed ? (*step)(in) : fn(in);
    // A copy: a graph's output is overwritten by the next replay.
    out.losses.push_back(loss.detach().to(at::kCPU, at::kFloat, false, true));
    for (auto& g : opt->param_groups()) {
      g.options().set_lr(std::ldexp(1.0, -10 - (s + 1) / 2));
    }
  }
  EXPECT_EQ(!graphed || step->captured(), true);
  boosted.optimizer->synchronize_step(); // fp16: the last verdict's counts
  for (const auto& p : model->parameters()) {
    out.weights.push_back(p.detach().to(at::kCPU, at::kFloat, false, true));
  }
  for (const auto& kv : opt->state()) {
    out.step_count = static_cast<const torch::optim::AdamWParamState&>(*kv.second).step();
  }
  return out;
}

// `family` "gpt": the zoo's GPT, its fused loss; "llama": a tiny LLaMA
// (rotary tables, RMSNorm, SwiGLU, grouped-query attention), its
// forward_loss; "mixtral": a tiny Mixtral whose experts run in grouped
// GEMMs (no expert count read back to the host).
StepRecord graph_run(
    const std::string& plugin,
    bool graphed,
    const std::string& family = "gpt") {
  torch::manual_seed(42);
  if (family == "llama" || family == "mixtral") {
    auto config = colossalai::models::LlamaConfig::tiny_test();
    if (family == "mixtral") {
      config.model_type("mixtral").moe(
          colossalai::models::MoeConfig().num_experts(4).num_experts_per_tok(2));
    }
    colossalai::models::LlamaForCausalLM model(config);
    colossalai::models::set_grouped_expert_gemm(*model, family == "mixtral");
    return graph_run_of(
        model,
        [](auto& boosted, const std::vector<at::Tensor>& in) {
          return boosted.model.forward_loss(in[0], in[1]);
        },
        plugin,
        graphed);
  }
  return graph_run_of(
      zoo::GPT(tiny()),
      [](auto& boosted, const std::vector<at::Tensor>& in) {
        return boosted.model(in[0], in[1]); // the fused loss
      },
      plugin,
      graphed);
}

} // namespace

// A captured and replayed step equals the eager one bit for bit under
// deterministic algorithms: the replays run the kernels the eager step
// runs, with the scalars (step counts, the scheduled learning rate)
// rewritten between replays. Without plugin (ATen's fused AdamW) and with
// LowLevelZero at one rank (our AdamW kernel writing the bf16 weights),
// with and without clipping on the device (clip_grad_by_norm_tensor,
// max_norm); a LLaMA, whose forward must copy nothing from pageable host
// memory (its rotary frequencies reach the device once); and a Mixtral
// with grouped expert GEMMs, where the device's top-2 combine adds two
// values into zero (the same bits in either order).
TEST(Cuda, GraphedStepEqualsEagerSteps) {
  SKIP_WITHOUT_CUDA(1);
  run_distributed(
      1,
      [](int, int) {
        // cuBLAS picks the same algorithms on every stream only with a fixed
        // workspace configuration.
        setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
        at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
        for (const std::string run : {"none", "none_clip", "zero1", "zero1_clip",
                                      "fp16", "zero1_fp16", "llama none",
                                      "llama zero1", "mixtral none",
                                      "mixtral zero1"}) {
          SCOPED_TRACE(run);
          const auto space = run.find(' ');
          const auto plugin = space == std::string::npos ? run : run.substr(space + 1);
          const auto family = space == std::string::npos ? "gpt" : run.substr(0, space);
          const auto eager = graph_run(plugin, false, family);
          const auto graphed = graph_run(plugin, true, family);
          // fp16's step 4 overflows: skipped, its count taken back.
          const int64_t steps = plugin.find("fp16") != std::string::npos ? 5 : 6;
          EXPECT_EQ(eager.step_count, steps);
          EXPECT_EQ(graphed.step_count, steps);
          for (size_t i = 0; i < eager.losses.size(); ++i) {
            EXPECT_TRUE(at::equal(eager.losses[i], graphed.losses[i]))
                << "step " << i << ": " << eager.losses[i].item<float>() << " vs "
                << graphed.losses[i].item<float>();
          }
          EXPECT_EQ(max_abs_diff(graphed.weights, eager.weights), 0.0);
        }
        at::globalContext().setDeterministicAlgorithms(false, false);
      },
      on_cuda());
}

// Host reads inside the step are refused by name at the capture, and the
// step object then says the capture failed; inputs of another shape are
// refused before anything runs.
TEST(Cuda, GraphedStepRefusesHostReadsAndNewShapes) {
  SKIP_WITHOUT_CUDA(1);
  run_distributed(
      1,
      [](int, int) {
        // Boosts `model` (bf16 autocast, FusedAdamW) and hands `calls` a
        // GraphedStep whose step is zero_grad, `train` (the loss, its
        // backward and what a case adds) and the optimizer's step.
        auto with_step = [](auto model, auto train, const std::function<void(cb::GraphedStep&)>& calls) {
          auto opt = std::make_shared<colossalai::nn::optimizer::FusedAdamW>(
              model->parameters(), torch::optim::AdamWOptions(1e-3));
          cb::Booster booster(cb::BoosterOptions().device("cuda").mixed_precision("bf16"));
          auto boosted = booster.boost(model, opt);
          cb::GraphedStep step(
              boosted.optimizer,
              [&](const std::vector<at::Tensor>& in) {
                boosted.optimizer->zero_grad();
                auto loss = train(booster, boosted, in);
                boosted.optimizer->step();
                return loss;
              },
              cb::GraphedStepOptions().warmup(1));
          calls(step);
        };
        auto run = [&](const std::string& what, std::function<void(cb::GraphedStep&)> calls) {
          SCOPED_TRACE(what);
          torch::manual_seed(1);
          with_step(
              zoo::GPT(tiny()),
              [&](cb::Booster& booster, auto& boosted, const std::vector<at::Tensor>& in) {
                at::Tensor loss = boosted.model(in[0], in[1]);
                booster.backward(loss, *boosted.optimizer);
                if (what == "item") {
                  EXPECT_TRUE(std::isfinite(loss.item<float>()));
                } else if (what == "clip") {
                  boosted.optimizer->clip_grad_by_norm(1.0);
                } else if (what == "checkpoint") { // keeps the RNG states
                  loss = colossalai::nn::checkpoint(
                      [](const at::Tensor& l) { return l * 1.0; }, loss);
                } else if (what == "dropout") { // swaps in its own stream
                  namespace sl = colossalai::shardformer::layer;
                  loss = sl::Dropout(sl::DropoutOptions(0.5))(loss);
                }
                return loss;
              },
              calls);
        };
        auto batch = [](int64_t t) {
          auto b = zoo::random_tokens(2, tiny(), 7);
          return std::vector<at::Tensor>{
              b.first.narrow(1, 0, t).contiguous().cuda(),
              b.second.narrow(1, 0, t).contiguous().cuda()};
        };
        auto expect_error = [](const std::function<void()>& f, const std::string& part) {
          try {
            f();
            ADD_FAILURE() << "no error; expected one naming '" << part << "'";
          } catch (const c10::Error& e) {
            EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
          }
        };
        for (const std::string what : {"item", "clip", "checkpoint", "dropout"}) {
          run(what, [&](cb::GraphedStep& step) {
            step(batch(16)); // warm-up: eager, allowed
            expect_error([&] { step(batch(16)); }, "cannot capture");
            expect_error([&] { step(batch(16)); }, "failed earlier");
          });
        }
        // Random-state swaps are refused with their reason, not ATen's
        // generator assertion.
        for (const std::string what : {"checkpoint", "dropout"}) {
          run(what, [&](cb::GraphedStep& step) {
            step(batch(16));
            expect_error(
                [&] { step(batch(16)); },
                what == "checkpoint" ? "gradient_checkpointing_ratio 0" : "dropout 0");
          });
        }
        // A mixture of experts' expert loop reads its counts back: refused
        // by name, with the option that captures it.
        {
          auto config = colossalai::models::LlamaConfig::tiny_test().model_type("mixtral").moe(
              colossalai::models::MoeConfig().num_experts(4).num_experts_per_tok(2));
          with_step(
              colossalai::models::LlamaForCausalLM(config),
              [](cb::Booster& booster, auto& boosted, const std::vector<at::Tensor>& in) {
                auto loss = boosted.model.forward_loss(in[0], in[1]);
                booster.backward(loss, *boosted.optimizer);
                return loss;
              },
              [&](cb::GraphedStep& step) {
                step(batch(16));
                expect_error([&] { step(batch(16)); }, "set_grouped_expert_gemm");
              });
        }
        // LowLevelZero's fp16 loss scaler over an optimizer that cannot
        // skip on the device reads its overflow verdict on the host (the
        // CPU refuses fp16 before this question arises).
        {
          zoo::GPT model(tiny());
          auto opt = std::make_shared<torch::optim::AdamW>(
              model->parameters(), torch::optim::AdamWOptions(1e-3));
          cb::Booster booster(cb::BoosterOptions().device("cuda").plugin(
              std::make_shared<cb::plugin::LowLevelZeroPlugin>(
                  cb::plugin::LowLevelZeroPluginOptions().precision("fp16"))));
          const auto why = booster.boost(model, opt).optimizer->graph_capture_blocker();
          EXPECT_NE(why.find("fp16"), std::string::npos) << why;
        }
        run("shapes", [&](cb::GraphedStep& step) {
          step(batch(16));
          step(batch(16)); // captured
          EXPECT_TRUE(step.captured());
          expect_error([&] { step(batch(8)); }, "fixed shapes");
        });
      },
      on_cuda());
}
