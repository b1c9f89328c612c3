// FP8 communication: the casts, the collectives, and the plugins'
// fp8_communication, on real processes.
//
// Bounds come from the formats, not from a run (quantization/fp8.h): with
// the scale taken from the largest magnitude `amax` of a message, a value
// x decodes within 2^-4 |x| + amax 2^-18 (e4m3) or 2^-3 |x| + amax 2^-32
// (e5m2), plus float32's rounding (2^-22 |x| here covers it). An FP8
// all-reduce rounds each rank's block once (e5m2) and the owner's sum once
// more, so the result s' of s = sum_r x_r is within
// 2^-3 sum_r |x_r| + 2^-3 (|s| + 2^-3 sum_r |x_r|) <= 0.27 sum_r |x_r|
// (+ the amax terms, below 2^-30 of the tensor's largest contribution).
//
// Every test also checks that the values did change (a test that still
// passes when nothing is compressed cannot fail), and that every rank ends
// with the same bytes.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/gemini_plugin.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/moe_hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_model.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/booster/plugin/torch_fsdp_plugin.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/functional.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/pipeline/p2p.h>
#include <colossalai/quantization/fp8.h>

#include <harness/multiprocess.h>
#include <harness/test_util.h>
#include <harness/zoo_util.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
namespace cz = colossalai::zero;
namespace q = colossalai::quantization;
using colossalai::testing::run_distributed;

namespace {

// Each rank its own node, so that fp8_communication compresses groups of
// ranks on this one host.
colossalai::testing::MultiProcessOptions nodes_of_one() {
  colossalai::testing::MultiProcessOptions o;
  o.env[-1]["LOCAL_WORLD_SIZE"] = "1";
  return o;
}

// Values over 12 binades, signs mixed, some zeros: both formats' normal and
// subnormal ranges.
at::Tensor spread(int64_t n, int seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto mag = at::exp2(at::rand({n}, gen) * 24 - 12);
  auto sign = at::where(at::rand({n}, gen) < 0.5, -1.0, 1.0);
  auto zero = at::rand({n}, gen) < 0.05;
  return at::where(zero, at::zeros({n}), mag * sign).to(at::kFloat);
}

double rel_bound(const std::string& format) {
  return (format == "e4m3" ? std::ldexp(1.0, -4) : std::ldexp(1.0, -3)) +
      std::ldexp(1.0, -22);
}
double abs_bound(const std::string& format, double amax) {
  return amax *
      (format == "e4m3" ? std::ldexp(1.0, -18) : std::ldexp(1.0, -32));
}

// Every rank's copy of `t`, stacked in rank order (plain all-gather).
at::Tensor every_rank(const at::Tensor& t, const cd::ProcessGroup& g) {
  auto flat = t.detach().to(at::kFloat).reshape({-1}).contiguous();
  auto out = at::empty({g.size() * flat.numel()}, flat.options());
  cd::all_gather(out, flat, g).wait();
  return out.view({g.size(), -1});
}

void expect_same_on_every_rank(
    const at::Tensor& t,
    const cd::ProcessGroup& g,
    const std::string& what) {
  auto all = every_rank(t, g);
  for (int r = 1; r < g.size(); ++r) {
    EXPECT_TRUE(at::equal(all[0], all[r])) << what << ": rank " << r;
  }
}

// Before LibTorch 2.1: `make`, which builds `plugin` with
// fp8_communication, is refused by name, inside launched ranks (a plugin
// needs the runtime before its own checks run).
void expect_fp8_refused(
    const std::string& plugin,
    const std::function<void()>& make) {
  run_distributed(2, [&](int, int) {
    auto err = colossalai::testing::error_of(make);
    EXPECT_NE(
        err.find(plugin + ": fp8_communication needs LibTorch 2.1"),
        std::string::npos)
        << err;
  });
}

} // namespace

TEST(Fp8, CastsWithinTheFormatsBounds) {
  if (!q::fp8_supported()) {
    auto err = colossalai::testing::error_of(
        [] { q::cast_to_fp8(at::ones({4}), "e4m3"); });
    EXPECT_NE(err.find("LibTorch 2.1"), std::string::npos) << err;
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  for (const std::string format : {"e4m3", "e5m2"}) {
    auto x = spread(4099, 7);
    const double amax = x.abs().max().item<double>();
    auto fx = q::cast_to_fp8(x, format);
    EXPECT_EQ(fx.data.scalar_type(), at::kByte);
    EXPECT_EQ(fx.data.sizes(), x.sizes());
    auto back = q::cast_from_fp8(fx, format, at::kFloat);
    auto err = (back - x).abs().to(at::kDouble);
    auto bound =
        x.abs().to(at::kDouble) * rel_bound(format) + abs_bound(format, amax);
    EXPECT_TRUE((err <= bound).all().item<bool>())
        << format << ": worst excess " << (err - bound).max().item<double>();
    // It did round (3 or 2 mantissa bits), and the largest value is kept.
    EXPECT_GT((err > x.abs() * 1e-3).sum().item<int64_t>(), 1000) << format;
    EXPECT_NEAR(back.abs().max().item<double>(), amax, amax * 1e-6);
    // Zeros stay zeros; bf16 in, bf16 out.
    EXPECT_TRUE(at::equal(
        q::cast_from_fp8(
            q::cast_to_fp8(at::zeros({5}), format), format, at::kFloat),
        at::zeros({5})));
    EXPECT_EQ(
        q::cast_from_fp8(
            q::cast_to_fp8(x.to(at::kBFloat16), format), format, at::kBFloat16)
            .scalar_type(),
        at::kBFloat16);
    // An infinity makes the message NaN: overflow checks still see it.
    auto inf = x.clone();
    inf[3] = std::numeric_limits<float>::infinity();
    EXPECT_TRUE(
        q::cast_from_fp8(q::cast_to_fp8(inf, format), format, at::kFloat)
            .isnan()
            .all()
            .item<bool>());
  }
  auto err = colossalai::testing::error_of(
      [] { q::cast_to_fp8(at::ones({4}), "e3m4"); });
  EXPECT_NE(
      err.find("fp8_format must be \"e4m3\" or \"e5m2\""), std::string::npos)
      << err;
}

// 3 ranks, a length that does not divide: uneven shards, padded blocks.
TEST(Fp8, CollectivesOnThreeRanks) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(
      3,
      [](int rank, int world) {
        auto g = cd::world_group();
        const int64_t n = 1001;
        // all_gather_fp8: every rank decodes every shard, its own included,
        // exactly as cast_from_fp8(cast_to_fp8(shard)).
        {
          auto full = spread(n, 100);
          auto range = cd::shard_range(n, world, rank);
          auto mine = full.narrow(0, range.first, range.second - range.first)
                          .contiguous();
          auto out = at::empty({n});
          q::all_gather_fp8(out, mine, *g).wait();
          for (int r = 0; r < world; ++r) {
            auto rr = cd::shard_range(n, world, r);
            auto shard = full.narrow(0, rr.first, rr.second - rr.first);
            auto want = q::cast_from_fp8(
                q::cast_to_fp8(shard, "e4m3"), "e4m3", at::kFloat);
            EXPECT_TRUE(
                at::equal(out.narrow(0, rr.first, rr.second - rr.first), want))
                << "shard of rank " << r;
          }
          EXPECT_FALSE(at::equal(out, full));
        }
        // reduce_scatter_fp8, sum and mean, float32 and bf16: this rank's
        // shard is the float32 sum, in rank order, of every rank's shard
        // decoded as cast_from_fp8(cast_to_fp8(shard)) (float32's 2
        // roundings in a sum of 3 and one in the mean's division: within
        // 3 * 2^-24 of the magnitudes), and within the e5m2 bound of the
        // float64 sum.
        for (auto op : {cd::ReduceOp::kSum, cd::ReduceOp::kAvg}) {
          for (auto dtype : {at::kFloat, at::kBFloat16}) {
            const auto mine = cd::shard_range(n, world, rank);
            const int64_t len = mine.second - mine.first;
            auto decoded = at::zeros({len}, at::kDouble);
            auto decoded_magnitude = at::zeros({len}, at::kDouble);
            auto exact = at::zeros({len}, at::kDouble);
            auto magnitude = at::zeros({len}, at::kDouble);
            for (int r = 0; r < world; ++r) {
              auto shard =
                  spread(n, 400 + r).to(dtype).narrow(0, mine.first, len);
              auto d = q::cast_from_fp8(
                           q::cast_to_fp8(shard.to(at::kFloat), "e5m2"),
                           "e5m2",
                           at::kFloat)
                           .to(at::kDouble);
              decoded += d;
              decoded_magnitude += d.abs();
              exact += shard.to(at::kDouble);
              magnitude += shard.to(at::kDouble).abs();
            }
            const double div = op == cd::ReduceOp::kAvg ? world : 1;
            auto out = at::empty({len}, dtype);
            q::reduce_scatter_fp8(out, spread(n, 400 + rank).to(dtype), *g, op)
                .wait();
            auto got = out.to(at::kDouble);
            // bf16: the sum is rounded to bf16 once more (2^-8 of it).
            const double out_rel =
                dtype == at::kFloat ? 0 : std::ldexp(1.0, -8);
            auto near_decoded = (got - decoded / div).abs() <=
                (decoded_magnitude * std::ldexp(1.0, -22) +
                 decoded.abs() * out_rel) /
                    div;
            EXPECT_TRUE(near_decoded.all().item<bool>());
            auto err = (got - exact / div).abs();
            auto bound = (magnitude * (rel_bound("e5m2") + out_rel / 8) +
                          exact.abs() * out_rel) /
                    div +
                magnitude.max() * 1e-8;
            EXPECT_TRUE((err <= bound).all().item<bool>())
                << "worst excess " << (err - bound).max().item<double>();
            EXPECT_GT(err.max().item<double>(), 0);
          }
        }
        // A wrong output length is named.
        {
          auto out = at::empty({5});
          auto err = colossalai::testing::error_of(
              [&] { q::reduce_scatter_fp8(out, at::ones({n}), *g); });
          EXPECT_NE(
              err.find("reduce_scatter_fp8: output has 5"), std::string::npos)
              << err;
        }
        // all_reduce_fp8, sum and mean, float32 and bf16, against float64.
        for (auto op : {cd::ReduceOp::kSum, cd::ReduceOp::kAvg}) {
          for (auto dtype : {at::kFloat, at::kBFloat16}) {
            std::vector<at::Tensor> xs;
            for (int r = 0; r < world; ++r) {
              xs.push_back(spread(n, 200 + r).to(dtype));
            }
            auto exact = at::zeros({n}, at::kDouble);
            auto magnitude = at::zeros({n}, at::kDouble);
            for (auto& x : xs) {
              exact += x.to(at::kDouble);
              magnitude += x.to(at::kDouble).abs();
            }
            const double div = op == cd::ReduceOp::kAvg ? world : 1;
            auto t = xs[rank].clone();
            const int64_t before = cd::bytes_communicated();
            q::all_reduce_fp8(t, *g, op).wait();
            const int64_t sent = cd::bytes_communicated() - before;
            auto err = (t.to(at::kDouble) - exact / div).abs();
            // bf16: the result is rounded to bf16 once more (2^-8 of it;
            // 0.27 leaves room for 2^-8 of its error).
            auto bound = magnitude / div * 0.27 + exact.abs() / div * 0.004 +
                magnitude.max() * 1e-8;
            EXPECT_TRUE((err <= bound).all().item<bool>())
                << "worst excess " << (err - bound).max().item<double>();
            EXPECT_GT(err.max().item<double>(), 0);
            expect_same_on_every_rank(t, *g, "all_reduce_fp8");
            // A quarter (float32) or half (bf16) of a plain all-reduce's
            // payload, plus the scales and padding.
            auto plain = xs[rank].clone();
            const int64_t plain_before = cd::bytes_communicated();
            cd::all_reduce(plain, *g).wait();
            const int64_t plain_sent = cd::bytes_communicated() - plain_before;
            EXPECT_LE(
                sent * (dtype == at::kFloat ? 4 : 2), plain_sent * 21 / 10)
                << sent << " bytes against " << plain_sent;
          }
        }
        // all_to_all_fp8: block r of every rank arrives at rank r, each rounded
        // with its own scale (e5m2).
        {
          auto in = spread(world * 50, 300 + rank);
          auto out = at::empty_like(in);
          q::all_to_all_fp8(out, in, *g).wait();
          for (int r = 0; r < world; ++r) {
            auto sent_by_r =
                spread(world * 50, 300 + r).narrow(0, rank * 50, 50);
            auto want = q::cast_from_fp8(
                q::cast_to_fp8(sent_by_r, "e5m2"), "e5m2", at::kFloat);
            EXPECT_TRUE(at::equal(out.narrow(0, r * 50, 50), want))
                << "from " << r;
          }
        }
      },
      nodes_of_one());
}

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (record) { // the weights this forward computes with
      seen.clear();
      for (const auto& p : parameters()) {
        seen.push_back(p.detach().to(at::kDouble).clone());
      }
    }
    return fc2(torch::tanh(fc1(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  bool record = false;
  std::vector<at::Tensor> seen;
};
TORCH_MODULE(Net);

at::Tensor mse(const at::Tensor& a, const at::Tensor& b) {
  return torch::mse_loss(a, b);
}

std::pair<at::Tensor, at::Tensor> batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + 31 * step + rank);
  return {at::randn({8, 16}, gen), at::randn({8, 4}, gen)};
}

Net make_net() {
  torch::manual_seed(3);
  return Net();
}

using NetBoosted = cb::Boosted<Net, std::nullptr_t, std::nullptr_t>;

// Bytes this rank hands to collectives in one training step.
int64_t step_bytes(
    cb::Booster& booster,
    NetBoosted& boosted,
    const std::pair<at::Tensor, at::Tensor>& b) {
  const int64_t before = cd::bytes_communicated();
  boosted.optimizer->zero_grad();
  booster.backward(
      boosted.criterion(boosted.model(b.first), b.second), *boosted.optimizer);
  boosted.optimizer->step();
  return cd::bytes_communicated() - before;
}

using OptimizerOf =
    std::function<std::shared_ptr<torch::optim::Optimizer>(Net&)>;

OptimizerOf adamw() {
  return [](Net& m) {
    return std::make_shared<torch::optim::AdamW>(
        m->parameters(), torch::optim::AdamWOptions(1e-2));
  };
}
OptimizerOf sgd(double lr) {
  return [lr](Net& m) {
    return std::make_shared<torch::optim::SGD>(
        m->parameters(), torch::optim::SGDOptions(lr));
  };
}

// The bytes of the first step of a fresh model under `plugin`: the same
// step without FP8, to compare with.
int64_t plain_step_bytes(
    std::shared_ptr<cb::plugin::Plugin> plugin,
    const OptimizerOf& optimizer,
    int rank) {
  cb::Booster booster(cb::BoosterOptions().plugin(std::move(plugin)));
  auto model = make_net();
  auto boosted = booster.boost(model, optimizer(model), mse);
  return step_bytes(booster, boosted, batch(0, rank));
}

// 20 steps on a fixed batch lower its loss.
void expect_loss_falls(cb::Booster& booster, NetBoosted& boosted, int rank) {
  double first = 0, last = 0;
  const auto fixed = batch(1, rank);
  for (int s = 1; s <= 20; ++s) {
    boosted.optimizer->zero_grad();
    auto loss = boosted.criterion(boosted.model(fixed.first), fixed.second);
    booster.backward(loss, *boosted.optimizer);
    boosted.optimizer->step();
    (s == 1 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first);
}

// DDP's first backward: every rank's gradients against the mean of the
// ranks' local gradients, computed here in float64 from the same weights.
void ddp_gradients(int rank, int world, bool expect_fp8) {
  auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>(
      cb::plugin::TorchDDPPluginOptions().fp8_communication(true));
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  auto model = make_net();
  auto opt = std::make_shared<torch::optim::SGD>(
      model->parameters(), torch::optim::SGDOptions(0.1));
  auto boosted = booster.boost(model, opt, mse);
  auto* ddp = colossalai::interface::find_wrapper<cb::plugin::TorchDDPModel>(
      *boosted.model.wrapper());
  ASSERT_NE(ddp, nullptr);
  EXPECT_EQ(ddp->fp8_communication(), expect_fp8);

  std::vector<at::Tensor> mean, magnitude;
  for (int r = 0; r < world; ++r) {
    auto ref = make_net();
    ref->to(at::kDouble);
    auto b = batch(0, r);
    mse(ref(b.first.to(at::kDouble)), b.second.to(at::kDouble)).backward();
    auto params = ref->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      auto g = params[i].grad() / world;
      if (r == 0) {
        mean.push_back(g.clone());
        magnitude.push_back(g.abs());
      } else {
        mean[i] += g;
        magnitude[i] += g.abs();
      }
    }
  }
  auto b = batch(0, rank);
  booster.backward(
      boosted.criterion(boosted.model(b.first), b.second), *boosted.optimizer);
  auto params = boosted.model.parameters();
  double worst = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    auto got = params[i].grad().to(at::kDouble);
    auto err = (got - mean[i]).abs();
    worst = std::max(worst, err.max().item<double>());
    auto bound =
        expect_fp8 ? magnitude[i] * 0.27 + 1e-7 : magnitude[i] * 1e-5 + 1e-7;
    EXPECT_TRUE((err <= bound).all().item<bool>())
        << "parameter " << i << " worst excess "
        << (err - bound).max().item<double>();
    expect_same_on_every_rank(params[i].grad(), *cd::world_group(), "gradient");
  }
  if (expect_fp8) {
    EXPECT_GT(worst, 1e-5); // rounded to 2 mantissa bits, not float32
  }
  // Training goes on through FP8 gradients: the weights stay the same on
  // every rank and the loss on a fixed batch falls.
  boosted.optimizer->step();
  expect_loss_falls(booster, boosted, rank);
  for (const auto& p : boosted.model.parameters()) {
    expect_same_on_every_rank(p, *cd::world_group(), "weight");
  }
}

} // namespace

TEST(Fp8, TorchDDPReducesGradientsThroughFp8AcrossNodes) {
  if (!q::fp8_supported()) {
    expect_fp8_refused("TorchDDPPlugin", [] {
      cb::plugin::TorchDDPPlugin(
          cb::plugin::TorchDDPPluginOptions().fp8_communication(true));
    });
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(
      3,
      [](int rank, int world) { ddp_gradients(rank, world, true); },
      nodes_of_one());
}

TEST(Fp8, TorchDDPKeepsFullPrecisionWithinANode) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  colossalai::testing::MultiProcessOptions one_node;
  one_node.env[-1]["LOCAL_WORLD_SIZE"] = "2";
  run_distributed(
      2,
      [](int rank, int world) { ddp_gradients(rank, world, false); },
      one_node);
}

namespace {

// ZeRO with FP8 communication: a step hands the collectives a quarter of
// float32's bytes (half of bf16's), the weights every rank computes with
// are the masters rounded to e4m3 (the same on every rank), and a saved
// model holds the masters themselves.
void zero_fp8(int rank, int world, int stage, const std::string& precision) {
  auto plugin_of = [&](bool fp8) {
    return std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions()
            .stage(stage)
            .precision(precision)
            .fp8_communication(fp8));
  };
  const int64_t plain_bytes = plain_step_bytes(plugin_of(false), adamw(), rank);
  cb::Booster booster(cb::BoosterOptions().plugin(plugin_of(true)));
  auto model = make_net();
  auto boosted = booster.boost(model, adamw()(model), mse);
  // Gradient reduce-scatters and weight all-gathers both in FP8: a quarter
  // of float32's bytes (0.75 with only the gathers in FP8, 0.5 with only
  // the reduce-scatters), half of bf16's (0.83, 0.67).
  const int64_t fp8_bytes = step_bytes(booster, boosted, batch(0, rank));
  EXPECT_LE(fp8_bytes * 10, plain_bytes * (precision == "bf16" ? 6 : 3))
      << fp8_bytes << " bytes against " << plain_bytes;
  expect_loss_falls(booster, boosted, rank);
  std::vector<at::Tensor> rounded;
  for (const auto& p : boosted.model.parameters()) {
    rounded.push_back(p.detach().to(at::kDouble).clone());
    expect_same_on_every_rank(p, *cd::world_group(), "weight");
  }
  const auto dir = colossalai::testing::scratch(
      colossalai::testing::test_process(), "fp8_zero_" + precision);
  booster.save_model(boosted.model, dir + "/model");
  // The save gathered the masters at full precision.
  auto exact = boosted.model.parameters();
  double amax = 0, worst = 0;
  for (const auto& p : exact) {
    amax = std::max(amax, p.detach().abs().max().item<double>());
  }
  // bf16 weights: the FP8 value is rounded to bf16 once more (2^-8 of
  // it, which is within 1 + 2^-4 of the master).
  const double rel = rel_bound("e4m3") + (precision == "bf16" ? 0.0042 : 0);
  for (size_t i = 0; i < exact.size(); ++i) {
    auto e = exact[i].detach().to(at::kDouble);
    auto err = (rounded[i] - e).abs();
    worst = std::max(worst, err.max().item<double>());
    auto bound = e.abs() * rel + abs_bound("e4m3", amax);
    EXPECT_TRUE((err <= bound).all().item<bool>())
        << "parameter " << i << " worst excess "
        << (err - bound).max().item<double>();
  }
  EXPECT_GT(worst, 0);
  // A plain model reads the same exact values back.
  auto plain = make_net();
  cb::Booster plain_booster;
  auto loaded = plain_booster.boost(plain);
  plain_booster.load_model(loaded.model, dir + "/model");
  auto plain_params = plain->parameters();
  for (size_t i = 0; i < exact.size(); ++i) {
    EXPECT_TRUE(
        at::equal(plain_params[i], exact[i].detach().to(at::kFloat).cpu()))
        << "parameter " << i;
  }
  cd::barrier(*cd::world_group()).wait();
  if (rank == 0) {
    colossalai::testing::remove_scratch("fp8_zero_" + precision);
  }
}

} // namespace

TEST(Fp8, LowLevelZeroCommunicatesThroughFp8AndSavesTheMasters) {
  if (!q::fp8_supported()) {
    expect_fp8_refused("LowLevelZeroPlugin", [] {
      cb::plugin::LowLevelZeroPlugin(
          cb::plugin::LowLevelZeroPluginOptions().fp8_communication(true));
    });
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(
      2,
      [](int rank, int world) {
        zero_fp8(rank, world, 1, "fp32");
        zero_fp8(rank, world, 2, "bf16");
      },
      nodes_of_one());
}

namespace {

// The full fp32 values of a fully sharded model's parameters.
std::vector<at::Tensor> full_values(cz::FullyShardedModel& fsdp, Net& model) {
  std::vector<at::Tensor> out;
  auto guard = fsdp.summon_full_params();
  for (const auto& p : model->parameters()) {
    out.push_back(p.detach().to(at::kDouble).clone());
  }
  return out;
}

// A save of `boosted` loads into a plain model as exactly `want`.
void expect_saved_exactly(
    cb::Booster& booster,
    NetBoosted& boosted,
    const std::vector<at::Tensor>& want,
    const std::string& name) {
  const auto dir =
      colossalai::testing::scratch(colossalai::testing::test_process(), name);
  booster.save_model(boosted.model, dir + "/model");
  auto plain = make_net();
  cb::Booster plain_booster;
  auto loaded = plain_booster.boost(plain);
  plain_booster.load_model(loaded.model, dir + "/model");
  auto params = plain->parameters();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(at::equal(params[i].to(at::kDouble), want[i]))
        << name << ": parameter " << i;
  }
  cd::barrier(*cd::world_group()).wait();
  if (cd::world_group()->rank() == 0) {
    colossalai::testing::remove_scratch(name);
  }
}

// TorchFSDPPlugin across 2 nodes (one unit, fp32, SGD): the forward computes
// with the e4m3 rounding of the exact shards, the same on every rank; the
// step applies the e5m2 reduce-scatter of the ranks' gradients at those
// weights, recovered as (before - after) / lr; a step hands the
// collectives about a quarter of the bytes it does without FP8; saves hold
// the exact shards.
void fsdp_fp8(int rank, int world) {
  const double lr = 0.1;
  auto plugin_of = [](bool fp8) {
    return std::make_shared<cb::plugin::TorchFSDPPlugin>(
        cb::plugin::TorchFSDPPluginOptions().fp8_communication(fp8));
  };
  const int64_t plain_bytes = plain_step_bytes(plugin_of(false), sgd(lr), rank);
  cb::Booster booster(cb::BoosterOptions().plugin(plugin_of(true)));
  auto model = make_net();
  auto boosted = booster.boost(model, sgd(lr)(model), mse);
  auto* fsdp = colossalai::interface::find_wrapper<cz::FullyShardedModel>(
      *boosted.model.wrapper());
  ASSERT_NE(fsdp, nullptr);
  EXPECT_TRUE(fsdp->fp8_communication());

  const auto before = full_values(*fsdp, model);
  model->record = true;
  const int64_t fp8_bytes = step_bytes(booster, boosted, batch(0, rank));
  model->record = false;
  const auto seen = model->seen;
  const auto after = full_values(*fsdp, model);
  // A quarter of float32's bytes plus a 4-byte scale per rank's row: the
  // gathers alone in FP8 would leave 0.75 of them, the reduce-scatters
  // alone 0.5.
  EXPECT_LE(fp8_bytes * 10, plain_bytes * 3)
      << fp8_bytes << " bytes against " << plain_bytes;

  double amax = 0;
  for (const auto& w : before) {
    amax = std::max(amax, w.abs().max().item<double>());
  }
  ASSERT_EQ(seen.size(), before.size());
  double worst_weight = 0;
  for (size_t i = 0; i < seen.size(); ++i) {
    auto err = (seen[i] - before[i]).abs();
    worst_weight = std::max(worst_weight, err.max().item<double>());
    auto bound = before[i].abs() * rel_bound("e4m3") + abs_bound("e4m3", amax);
    EXPECT_TRUE((err <= bound).all().item<bool>())
        << "weight " << i << " worst excess "
        << (err - bound).max().item<double>();
    expect_same_on_every_rank(seen[i], *cd::world_group(), "forward weight");
  }
  EXPECT_GT(worst_weight, 0);

  // The ranks' gradients at the weights the forward used, in float64.
  std::vector<at::Tensor> mean, magnitude;
  for (int r = 0; r < world; ++r) {
    auto ref = make_net();
    ref->to(at::kDouble);
    {
      at::NoGradGuard no_grad;
      auto params = ref->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].copy_(seen[i]);
      }
    }
    auto b = batch(0, r);
    mse(ref(b.first.to(at::kDouble)), b.second.to(at::kDouble)).backward();
    auto params = ref->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      auto g = params[i].grad() / world;
      if (r == 0) {
        mean.push_back(g.clone());
        magnitude.push_back(g.abs());
      } else {
        mean[i] += g;
        magnitude[i] += g.abs();
      }
    }
  }
  // (before - after) / lr carries float32's rounding of the weights
  // (|w| <= 1: 2^-24 each) over lr, and float32's forward and backward.
  double worst_grad = 0;
  for (size_t i = 0; i < mean.size(); ++i) {
    auto got = (before[i] - after[i]) / lr;
    auto err = (got - mean[i]).abs();
    worst_grad = std::max(worst_grad, err.max().item<double>());
    auto bound = magnitude[i] * rel_bound("e5m2") + 2e-6;
    EXPECT_TRUE((err <= bound).all().item<bool>())
        << "gradient " << i << " worst excess "
        << (err - bound).max().item<double>();
  }
  EXPECT_GT(worst_grad, 1e-5); // rounded to 2 mantissa bits

  // Training goes on; every rank computes with the same weights.
  expect_loss_falls(booster, boosted, rank);
  expect_saved_exactly(booster, boosted, full_values(*fsdp, model), "fp8_fsdp");
}

// GeminiPlugin (bf16 chunks) across 2 nodes: FP8 chunk gathers and gradient
// reduce-scatters, about half of bf16's bytes; it trains, every rank
// computes with the same weights, and saves hold the exact fp32 shards.
void gemini_fp8(int rank, int /*world*/) {
  auto plugin_of = [](bool fp8) {
    return std::make_shared<cb::plugin::GeminiPlugin>(
        cb::plugin::GeminiPluginOptions()
            .precision("bf16")
            .chunk_size(512)
            .fp8_communication(fp8));
  };
  const int64_t plain_bytes = plain_step_bytes(plugin_of(false), adamw(), rank);
  cb::Booster booster(cb::BoosterOptions().plugin(plugin_of(true)));
  auto model = make_net();
  auto boosted = booster.boost(model, adamw()(model), mse);
  auto* fsdp = colossalai::interface::find_wrapper<cz::FullyShardedModel>(
      *boosted.model.wrapper());
  ASSERT_NE(fsdp, nullptr);
  EXPECT_TRUE(fsdp->fp8_communication());
  const int64_t fp8_bytes = step_bytes(booster, boosted, batch(0, rank));
  // Half of bf16's bytes plus the scales: 0.75 or 1 if either kind of
  // collective kept bf16.
  EXPECT_LE(fp8_bytes * 10, plain_bytes * 6)
      << fp8_bytes << " bytes against " << plain_bytes;
  expect_loss_falls(booster, boosted, rank);
  // A forward computes with the same 8-bit rounding of the exact shards on
  // every rank: the bf16 shard (2^-8), its e4m3 rounding (2^-4), and that
  // in bf16 (2^-8): within (1 + 2^-8)^2 (1 + 2^-4) - 1 < 2^-4 + 0.0084.
  const auto exact = full_values(*fsdp, model);
  model->record = true;
  {
    at::NoGradGuard no_grad;
    boosted.model(batch(1, rank).first);
  }
  model->record = false;
  double amax = 0, worst = 0;
  for (const auto& w : exact) {
    amax = std::max(amax, w.abs().max().item<double>());
  }
  ASSERT_EQ(model->seen.size(), exact.size());
  for (size_t i = 0; i < exact.size(); ++i) {
    auto err = (model->seen[i] - exact[i]).abs();
    worst = std::max(worst, err.max().item<double>());
    auto bound = exact[i].abs() * (rel_bound("e4m3") + 0.0084) +
        abs_bound("e4m3", amax * 1.01);
    EXPECT_TRUE((err <= bound).all().item<bool>())
        << "weight " << i << " worst excess "
        << (err - bound).max().item<double>();
    expect_same_on_every_rank(
        model->seen[i], *cd::world_group(), "forward weight");
  }
  EXPECT_GT(worst, 0);
  expect_saved_exactly(booster, boosted, exact, "fp8_gemini");
}

// HSDP: shards within each node of 2 ranks, replicas across the 2 nodes:
// only the replicas' gradient all-reduce travels as FP8. Per step, in
// units of a float32 shard s: a gather (1) and a reduce-scatter (2) stay
// float32, the all-reduce's 1 becomes about 3/8 (its all-to-all and
// all-gather of FP8 halves): 3.38 / 4 = 0.84 of the bytes; FP8 on the shard
// group too would leave about 0.25.
void hsdp_fp8(int rank, int /*world*/) {
  auto plugin_of = [](bool fp8) {
    return std::make_shared<cb::plugin::TorchFSDPPlugin>(
        cb::plugin::TorchFSDPPluginOptions()
            .sharding_strategy(cz::ShardingStrategy::kHybridShard)
            .hybrid_shard_size(2)
            .fp8_communication(fp8));
  };
  const int64_t plain_bytes =
      plain_step_bytes(plugin_of(false), sgd(0.1), rank);
  cb::Booster booster(cb::BoosterOptions().plugin(plugin_of(true)));
  auto model = make_net();
  auto boosted = booster.boost(model, sgd(0.1)(model), mse);
  auto* fsdp = colossalai::interface::find_wrapper<cz::FullyShardedModel>(
      *boosted.model.wrapper());
  ASSERT_NE(fsdp, nullptr);
  EXPECT_TRUE(fsdp->fp8_communication());
  const int64_t fp8_bytes = step_bytes(booster, boosted, batch(0, rank));
  EXPECT_GE(fp8_bytes * 100, plain_bytes * 75)
      << fp8_bytes << " bytes against " << plain_bytes;
  EXPECT_LE(fp8_bytes * 100, plain_bytes * 92)
      << fp8_bytes << " bytes against " << plain_bytes;
  expect_loss_falls(booster, boosted, rank);
  for (const auto& w : full_values(*fsdp, model)) {
    expect_same_on_every_rank(w, *cd::world_group(), "weight");
  }
}

} // namespace

TEST(Fp8, TorchFSDPGathersAndReducesThroughFp8AcrossNodes) {
  if (!q::fp8_supported()) {
    expect_fp8_refused("TorchFSDPPlugin", [] {
      cb::plugin::TorchFSDPPlugin(
          cb::plugin::TorchFSDPPluginOptions().fp8_communication(true));
    });
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(2, fsdp_fp8, nodes_of_one());
}

TEST(Fp8, GeminiGathersAndReducesThroughFp8AcrossNodes) {
  if (!q::fp8_supported()) {
    expect_fp8_refused("GeminiPlugin", [] {
      cb::plugin::GeminiPlugin(
          cb::plugin::GeminiPluginOptions().precision("bf16").fp8_communication(
              true));
    });
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(2, gemini_fp8, nodes_of_one());
}

TEST(Fp8, HybridShardReducesOnlyTheReplicasThroughFp8) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  colossalai::testing::MultiProcessOptions two_nodes;
  two_nodes.env[-1]["LOCAL_WORLD_SIZE"] = "2";
  run_distributed(4, hsdp_fp8, two_nodes);
}

namespace {

// Pipeline transfers between stages on two nodes: activations arrive as
// the e4m3 rounding of what was sent and gradients as the e5m2 one, bit
// for bit, in the sender's dtype and shape; integer tensors, and anything
// within one node, arrive exact.
void p2p_fp8(int rank, bool across_nodes) {
  namespace cp = colossalai::pipeline;
  cp::PipelineP2PCommunication p2p(cd::world_group());
  p2p.set_fp8_communication(true);
  auto activations = spread(7 * 143, 600).view({7, 143});
  auto grad = spread(7 * 143, 601).view({7, 143}).to(at::kBFloat16);
  auto ids = at::arange(50, at::kLong);
  auto rounded = [](const at::Tensor& x, const char* format) {
    return q::cast_from_fp8(
               q::cast_to_fp8(x.to(at::kFloat), format), format, at::kFloat)
        .to(x.scalar_type());
  };
  if (rank == 0) {
    p2p.send(activations, 1, cp::StreamKey{1, false}, 0);
    p2p.send(ids, 1, cp::StreamKey{2, false}, 0);
    auto got = p2p.post_recv(1, cp::StreamKey{1, true}, 0).wait();
    EXPECT_EQ(got.scalar_type(), at::kBFloat16);
    EXPECT_EQ(got.sizes(), grad.sizes());
    EXPECT_TRUE(at::equal(got, across_nodes ? rounded(grad, "e5m2") : grad));
    EXPECT_EQ(across_nodes, !at::equal(got, grad));
  } else {
    auto got = p2p.post_recv(0, cp::StreamKey{1, false}, 0).wait();
    EXPECT_EQ(got.scalar_type(), at::kFloat);
    EXPECT_EQ(got.sizes(), activations.sizes());
    EXPECT_TRUE(at::equal(
        got, across_nodes ? rounded(activations, "e4m3") : activations));
    EXPECT_EQ(across_nodes, !at::equal(got, activations));
    EXPECT_TRUE(
        at::equal(p2p.post_recv(0, cp::StreamKey{2, false}, 0).wait(), ids));
    p2p.send(grad, 0, cp::StreamKey{1, true}, 0);
  }
  p2p.wait_sends();
}

// One step of HybridParallelPlugin with `options` on GPT-2 (8 samples over
// the data-parallel ranks): the loss where the last stage is (or 0) and the
// bytes this rank handed to collectives.
std::pair<double, int64_t> hybrid_step(
    const cb::plugin::HybridParallelPluginOptions& options) {
  namespace models = colossalai::models;
  auto plugin = std::make_shared<cb::plugin::HybridParallelPlugin>(options);
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  torch::manual_seed(11);
  models::GPT2LMHeadModel model(models::GPT2Config::tiny_test().n_layer(4));
  auto opt = std::make_shared<torch::optim::SGD>(
      model->parameters(), torch::optim::SGDOptions(0.1));
  auto boosted = booster.boost(model, opt);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(900);
  auto tokens = at::randint(model->config().vocab_size(), {8, 17}, gen);
  const int64_t local = 8 / plugin->dp_size();
  auto rows = tokens.narrow(0, local * plugin->dp_rank(), local);
  auto x = rows.narrow(1, 0, 16).contiguous();
  auto y = rows.narrow(1, 1, 16).contiguous();
  const int64_t before = cd::bytes_communicated();
  boosted.optimizer->zero_grad();
  double loss = 0;
  if (options.pp_size() > 1) {
    auto out =
        colossalai::testing::pipeline_step(booster, boosted, model, x, y);
    loss = out.loss.defined() ? out.loss.item<double>() : 0;
  } else {
    auto l = model->loss(boosted.model(x), y);
    booster.backward(l, *boosted.optimizer);
    loss = l.item<double>();
  }
  boosted.optimizer->step();
  return {loss, cd::bytes_communicated() - before};
}

// HybridParallelPlugin across 2 nodes: pipeline stages (and the tied
// embedding's gradients between the first and last), tensor-parallel
// layers and ZeRO's data-parallel traffic exchange FP8. Payload handed to
// the collectives, against float32's: a quarter for transfers, gathers and
// reduce-scatters (plus a 4-byte scale per message); 3/8 for an
// all-reduce, whose all-to-all hands over every block (its own included)
// and whose all-gather the sum, though it sends a quarter of the bytes on
// a link; tensor parallelism's loss (its statistics and its input's
// gradient) stays float32. Bounds: 0.3 for ZeRO; 0.35 for the pipeline,
// where the tied embedding's all-reduce is about half of the bytes (about
// 0.7 with either it or the transfers in float32); 0.45 for tensor
// parallelism (0.69 with its backward all-reduces in float32); 1 with
// nothing compressed. ZeRO's first loss is the same (the weights differ
// only after the first gather); where activations travel, the loss is that
// of rounded activations, a sanity check at 5% (a tiny model's
// cross-entropy, about ln(vocab), moves by a fraction of their 2^-4
// relative change).
void hybrid_fp8(int rank, int /*world*/) {
  using HPO = cb::plugin::HybridParallelPluginOptions;
  const std::vector<std::pair<std::string, HPO>> layouts = {
      {"pp2", HPO().precision("fp32").pp_size(2).num_microbatches(2)},
      {"tp2", HPO().precision("fp32").tp_size(2)},
      {"dp2 zero1", HPO().precision("fp32").zero_stage(1)}};
  for (const auto& [name, base] : layouts) {
    SCOPED_TRACE(name);
    const auto plain = hybrid_step(base);
    auto with = base;
    const auto fp8 = hybrid_step(with.fp8_communication(true));
    const int64_t percent = name == "tp2" ? 45 : name == "pp2" ? 35 : 30;
    EXPECT_LE(fp8.second * 100, plain.second * percent)
        << fp8.second << " bytes against " << plain.second;
    if (name == "dp2 zero1") {
      EXPECT_EQ(fp8.first, plain.first);
    } else if (name == "tp2" || rank == 1) { // where the loss is
      EXPECT_NEAR(fp8.first, plain.first, 0.05 * plain.first);
      EXPECT_NE(fp8.first, plain.first);
    }
  }
}

} // namespace

TEST(Fp8, PipelineStagesExchangeFp8AcrossNodes) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(
      2, [](int rank, int) { p2p_fp8(rank, true); }, nodes_of_one());
  colossalai::testing::MultiProcessOptions one_node;
  one_node.env[-1]["LOCAL_WORLD_SIZE"] = "2";
  run_distributed(
      2, [](int rank, int) { p2p_fp8(rank, false); }, one_node);
}

TEST(Fp8, HybridParallelCommunicatesThroughFp8AcrossNodes) {
  if (!q::fp8_supported()) {
    expect_fp8_refused("HybridParallelPlugin", [] {
      cb::plugin::HybridParallelPlugin(cb::plugin::HybridParallelPluginOptions()
                                           .precision("fp32")
                                           .fp8_communication(true));
    });
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(2, hybrid_fp8, nodes_of_one());
}

namespace {

// e4m3 / e5m2 rounding of `x` sent as one message.
at::Tensor fp8_rounded(const at::Tensor& x, const char* format) {
  return q::cast_from_fp8(
             q::cast_to_fp8(x.contiguous().to(at::kFloat), format),
             format,
             at::kFloat)
      .to(x.scalar_type())
      .view(x.sizes());
}

// The autograd collectives with fp8 on 3 ranks as 3 nodes: forward as
// e4m3, backward as e5m2, each rank's message under its own scale, bit
// for bit what the FP8 collectives give.
void functional_fp8(int rank, int world) {
  namespace cdf = cd::functional;
  auto g = cd::world_group();
  // gather_along_dim: every rank's chunk, rounded as its own message.
  {
    auto x = spread(4 * 6, 700 + rank).view({4, 6}).requires_grad_();
    auto y = cdf::gather_along_dim(x, -1, g, /*fp8=*/true);
    for (int r = 0; r < world; ++r) {
      auto sent = spread(4 * 6, 700 + r).view({4, 6});
      EXPECT_TRUE(at::equal(y.narrow(1, 6 * r, 6), fp8_rounded(sent, "e4m3")))
          << "chunk of rank " << r;
    }
  }
  // copy_to_group: its backward all-reduce is all_reduce_fp8 in e5m2.
  {
    auto x = spread(30, 710).requires_grad_();
    auto go = spread(30, 720 + rank);
    cdf::copy_to_group(x, g, /*fp8=*/true).backward(go);
    auto want = go.clone();
    q::all_reduce_fp8(want, *g, cd::ReduceOp::kSum, "e5m2").wait();
    EXPECT_TRUE(at::equal(x.grad(), want));
    auto plain = go.clone();
    cd::all_reduce(plain, *g).wait();
    EXPECT_FALSE(at::equal(x.grad(), plain));
  }
  // all_to_all_single, uneven: rank r sends 1 + (r + j) % 3 rows of 5 to
  // rank j; each block arrives rounded as its own message, and the
  // gradients go back the same way in e5m2.
  {
    std::vector<int64_t> splits(world);
    int64_t rows = 0;
    for (int j = 0; j < world; ++j) {
      splits[j] = 1 + (rank + j) % 3;
      rows += splits[j];
    }
    // Symmetric: what rank j sends here is 1 + (j + rank) % 3 rows.
    auto x = spread(rows * 5, 730 + rank).view({rows, 5}).requires_grad_();
    auto y = cdf::all_to_all_single(x, splits, splits, g, /*fp8=*/true);
    auto go = spread(rows * 5, 740 + rank).view({rows, 5});
    y.backward(go);
    int64_t at_row = 0;
    for (int j = 0; j < world; ++j) {
      // Rank j's block for this rank, and this rank's gradient block for j
      // as it came back from j.
      int64_t offset = 0;
      for (int k = 0; k < rank; ++k) {
        offset += 1 + (j + k) % 3;
      }
      int64_t their_rows = 0;
      for (int k = 0; k < world; ++k) {
        their_rows += 1 + (j + k) % 3;
      }
      auto theirs = spread(their_rows * 5, 730 + j).view({their_rows, 5});
      EXPECT_TRUE(at::equal(
          y.narrow(0, at_row, splits[j]),
          fp8_rounded(theirs.narrow(0, offset, splits[j]), "e4m3")))
          << "from rank " << j;
      auto their_go = spread(their_rows * 5, 740 + j).view({their_rows, 5});
      EXPECT_TRUE(at::equal(
          x.grad().narrow(0, at_row, splits[j]),
          fp8_rounded(their_go.narrow(0, offset, splits[j]), "e5m2")))
          << "gradient from rank " << j;
      at_row += splits[j];
    }
  }
}

// MoeHybridParallelPlugin, experts split over 2 ranks as 2 nodes: the
// token exchange hands the expert-parallel group about a quarter of its
// float32 bytes (1 uncompressed; the per-expert counts, 32 bytes a layer,
// stay int64).
void moe_fp8(int rank, int /*world*/) {
  namespace models = colossalai::models;
  using HPO = cb::plugin::HybridParallelPluginOptions;
  auto run = [rank](bool fp8) {
    auto plugin = std::make_shared<cb::plugin::MoeHybridParallelPlugin>(
        HPO().precision("fp32").ep_size(2).zero_stage(1).fp8_communication(
            fp8));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    torch::manual_seed(5);
    models::LlamaForCausalLM model(
        models::LlamaConfig::tiny_test().model_type("mixtral").moe(
            models::MoeConfig().num_experts(4)));
    auto opt = std::make_shared<torch::optim::SGD>(
        model->parameters(), torch::optim::SGDOptions(0.1));
    auto boosted = booster.boost(model, opt);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(910 + rank);
    auto tokens = at::randint(model->config().vocab_size(), {4, 17}, gen);
    auto x = tokens.narrow(1, 0, 16).contiguous();
    auto y = tokens.narrow(1, 1, 16).contiguous();
    const int64_t before = plugin->ep_group()->bytes_communicated();
    boosted.optimizer->zero_grad();
    auto loss = model->loss(boosted.model(x), y);
    booster.backward(loss, *boosted.optimizer);
    boosted.optimizer->step();
    return std::make_pair(
        loss.item<double>(), plugin->ep_group()->bytes_communicated() - before);
  };
  const auto plain = run(false);
  const auto fp8 = run(true);
  EXPECT_GT(plain.second, 0);
  EXPECT_LE(fp8.second * 10, plain.second * 3)
      << fp8.second << " bytes against " << plain.second;
  // A sanity check, as the pipeline's above: the experts see their tokens
  // rounded to e4m3.
  EXPECT_NEAR(fp8.first, plain.first, 0.05 * plain.first);
  EXPECT_NE(fp8.first, plain.first);
}

} // namespace

TEST(Fp8, FunctionalCollectivesTravelAsFp8AcrossNodes) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(3, functional_fp8, nodes_of_one());
}

TEST(Fp8, MoeExpertExchangeTravelsAsFp8AcrossNodes) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(2, moe_fp8, nodes_of_one());
}
