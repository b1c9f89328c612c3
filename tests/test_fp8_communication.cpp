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
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_model.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/quantization/fp8.h>

#include <harness/multiprocess.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
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
            // bf16: the result is rounded to bf16 once more (2^-9).
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
    return fc2(torch::tanh(fc1(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
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

// ZeRO with FP8 all-gathers: the weights every rank computes with are the
// masters rounded to e4m3 (the same on every rank), and a saved model holds
// the masters themselves.
void zero_fp8(int rank, int world, int stage, const std::string& precision) {
  auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
      cb::plugin::LowLevelZeroPluginOptions()
          .stage(stage)
          .precision(precision)
          .fp8_communication(true));
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  auto model = make_net();
  auto opt = std::make_shared<torch::optim::AdamW>(
      model->parameters(), torch::optim::AdamWOptions(1e-2));
  auto boosted = booster.boost(model, opt, mse);
  double first = 0, last = 0;
  const auto b = batch(1, rank);
  for (int s = 0; s < 20; ++s) {
    boosted.optimizer->zero_grad();
    auto loss = boosted.criterion(boosted.model(b.first), b.second);
    booster.backward(loss, *boosted.optimizer);
    boosted.optimizer->step();
    (s == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first);
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
  // bf16 weights: the FP8 value is rounded to bf16 once more (2^-9).
  const double rel = rel_bound("e4m3") + (precision == "bf16" ? 0.004 : 0);
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

TEST(Fp8, LowLevelZeroGathersWeightsThroughFp8AndSavesTheMasters) {
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
