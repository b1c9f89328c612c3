// FP8 linear layers (quantization/fp8_linear.h) and the plugins' use_fp8.
//
// Bounds come from the formats and float32's sums, not from a run. With a
// tensor's scale taken from its largest magnitude, an e4m3 value is within
// 2^-4 of itself (e5m2: 2^-3) plus half a subnormal step, amax 2^-18 (e5m2:
// amax 2^-32). The products accumulate in float32 (2^-24 per addition, k
// terms: k 2^-24 sum|a||b| bounds the sum's error) and round once to bf16
// (2^-8 of the result, the bound used across this project's tests).
//
// So against the product of the operands' own FP8 roundings (computed here
// in float64 through the casts of quantization/fp8.h, which use the same
// scale rule), an output is within 2^-8 |ref| + k 2^-23 sum|a||b|; against
// the exact product of the 16-bit operands, within
// (2^-4 + 2^-4 + 2^-8) sum|x||w| more (e4m3 x e4m3), or
// (2^-3 + 2^-4 + 2^-7) for a gradient (e5m2 x e4m3), plus the subnormal
// terms.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/gemini_plugin.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/moe_hybrid_parallel_plugin.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/nn/checkpoint.h>
#include <colossalai/quantization/fp8.h>
#include <colossalai/quantization/fp8_linear.h>
#include <colossalai/utils/compat.h>

#include <harness/multiprocess.h>
#include <harness/test_util.h>
#include <harness/zoo_util.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>

namespace cb = colossalai::booster;
namespace q = colossalai::quantization;
namespace models = colossalai::models;
using colossalai::testing::run_distributed;

namespace {

at::Tensor random(at::IntArrayRef shape, int seed, double scale = 1.0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return (at::randn(shape, gen) * scale).to(at::kBFloat16);
}

// The value `x` stands for after its cast to `format` under one scale, in
// float64.
at::Tensor fp8_value(const at::Tensor& x, const char* format) {
  return q::cast_from_fp8(
             q::cast_to_fp8(x.to(at::kFloat), format), format, at::kFloat)
      .to(at::kDouble);
}

double d(const at::Tensor& t) {
  return t.item<double>();
}

// |got - want| <= rel |want| + abs elementwise; returns the largest excess
// (<= 0 when within).
double excess(
    const at::Tensor& got,
    const at::Tensor& want,
    const at::Tensor& rel,
    const at::Tensor& abs) {
  return d(((got.to(at::kDouble) - want).abs() - rel * want.abs() - abs).max());
}

} // namespace

TEST(Fp8Linear, ForwardAndGradientsWithinTheFormatsBounds) {
  if (!q::fp8_supported()) {
    auto err = colossalai::testing::error_of([] {
      auto w = random({16, 16}, 1).requires_grad_(true);
      q::linear_fp8(random({16, 16}, 2), w, {});
    });
    EXPECT_NE(err.find("LibTorch 2.1"), std::string::npos) << err;
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  // 3 x 16 = 48 rows, 48 -> 80 features; magnitudes over a few binades.
  auto x = (random({3, 16, 48}, 10) *
            at::exp2(at::randint(-4, 4, {3, 16, 48}).to(at::kBFloat16)))
               .requires_grad_(true);
  auto w = random({80, 48}, 11, 0.1).requires_grad_(true);
  auto b = random({80}, 12, 0.1).requires_grad_(true);
  auto dy = random({3, 16, 80}, 13);
  ASSERT_TRUE(q::linear_fp8_applies(x, w, b));
  auto y = q::linear_fp8(x, w, b);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 16, 80}));
  y.backward(dy);
  ASSERT_TRUE(x.grad().defined() && w.grad().defined() && b.grad().defined());
  EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
  EXPECT_EQ(w.grad().scalar_type(), at::kBFloat16);

  const auto x2 = x.detach().reshape({48, 48});
  const auto dy2 = dy.reshape({48, 80});
  const auto x8 = fp8_value(x2, "e4m3");
  const auto w8 = fp8_value(w.detach(), "e4m3");
  const auto dy8 = fp8_value(dy2, "e5m2");
  const auto xd = x2.to(at::kDouble);
  const auto wd = w.detach().to(at::kDouble);
  const auto dyd = dy2.to(at::kDouble);
  const auto bd = b.detach().to(at::kDouble);
  const double bf16 = std::ldexp(1.0, -8);
  const double sum = [](int64_t k) { return k * std::ldexp(1.0, -23); }(80);
  auto amax = [](const at::Tensor& t) { return d(t.abs().max()); };
  const auto rel = at::full({}, bf16, at::kDouble);

  // Against the FP8 roundings' own product: the kernel's sums and bf16.
  const auto y_ref = at::matmul(x8, w8.t()) + bd;
  const auto dx_ref = at::matmul(dy8, w8);
  const auto dw_ref = at::matmul(dy8.t(), x8);
  EXPECT_LE(
      excess(
          y.detach().reshape({48, 80}),
          y_ref,
          rel,
          sum * at::matmul(x8.abs(), w8.abs().t()) + bf16 * bd.abs()),
      0);
  EXPECT_LE(
      excess(
          x.grad().reshape({48, 48}),
          dx_ref,
          rel,
          sum * at::matmul(dy8.abs(), w8.abs())),
      0);
  EXPECT_LE(
      excess(w.grad(), dw_ref, rel, sum * at::matmul(dy8.abs().t(), x8.abs())),
      0);
  // The bias's gradient is the 16-bit sum of dy: no FP8 in it.
  EXPECT_LE(excess(b.grad(), dyd.sum(0), rel, sum * dyd.abs().sum(0)), 0);

  // Against the exact product: the formats' rounding of each operand.
  const double e4 = std::ldexp(1.0, -4), e5 = std::ldexp(1.0, -3);
  const auto y_exact = at::matmul(xd, wd.t()) + bd;
  const auto xw = at::matmul(xd.abs(), wd.abs().t());
  const double sub_x = amax(xd) * std::ldexp(1.0, -18);
  const double sub_w = amax(wd) * std::ldexp(1.0, -18);
  const double sub_dy = amax(dyd) * std::ldexp(1.0, -32);
  EXPECT_LE(
      excess(
          y.detach().reshape({48, 80}),
          y_exact,
          rel,
          (2 * e4 + e4 * e4 + bf16 + sum) * xw +
              48 * (sub_x * amax(wd) + sub_w * amax(xd) + sub_x * sub_w) +
              bf16 * bd.abs()),
      0);
  const auto dyw = at::matmul(dyd.abs(), wd.abs());
  EXPECT_LE(
      excess(
          x.grad().reshape({48, 48}),
          at::matmul(dyd, wd),
          rel,
          (e5 + e4 + e5 * e4 + bf16 + sum) * dyw +
              80 * (sub_dy * amax(wd) + sub_w * amax(dyd) + sub_dy * sub_w)),
      0);
  // FP8 did run: the plain bf16 product differs.
  EXPECT_FALSE(at::equal(y, at::linear(x.detach(), w.detach(), b.detach())));
}

namespace {

// Values over 24 binades, signs mixed, some zeros: both formats' normal
// and subnormal ranges once scaled.
at::Tensor spread(int64_t n, int seed, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto mag = at::exp2(at::rand({n}, gen) * 24 - 12);
  auto sign = at::where(at::rand({n}, gen) < 0.5, -1.0, 1.0);
  auto zero = at::rand({n}, gen) < 0.05;
  return at::where(zero, at::zeros({n}), mag * sign).to(dtype);
}

// linear_fp8's cast against fp8.h's (the same scale rule, tested against
// the formats in test_fp8_communication), as bytes.
void expect_cast_equals_fp8h(const at::Tensor& x, const at::Device& device) {
  for (const bool e4m3 : {true, false}) {
    SCOPED_TRACE(e4m3 ? "e4m3" : "e5m2");
    const auto format = e4m3 ? "e4m3" : "e5m2";
    const auto [values, scale_inv] =
        q::detail::fp8_linear_cast(x.to(device), e4m3);
    const auto want = q::cast_to_fp8(x.to(at::kFloat), format);
    EXPECT_EQ(values.sizes(), x.sizes());
    EXPECT_TRUE(values.is_contiguous());
    EXPECT_TRUE(at::equal(
        values.cpu().view(at::kByte), want.data.contiguous().view(x.sizes())));
    EXPECT_EQ(scale_inv.dim(), 0);
    EXPECT_EQ(scale_inv.item<float>(), want.scale_inv.item<float>());
  }
}

} // namespace

TEST(Fp8Linear, CastIsFp8CommunicationsCast) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  for (const auto dtype : {at::kBFloat16, at::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    expect_cast_equals_fp8h(spread(4099, 40, dtype), at::kCPU);
    // A transposed view (a Conv1D weight) comes out row-major.
    expect_cast_equals_fp8h(
        spread(48 * 32, 41, dtype).view({48, 32}).t(), at::kCPU);
  }
  // All zeros: amax taken as 1, the values zero. An infinity: its operand
  // decodes (values x scale) as NaN throughout, so the product does too.
  const auto zeros = q::detail::fp8_linear_cast(at::zeros({32}), true);
  EXPECT_EQ(zeros.second.item<float>(), 1.0f / 448);
  EXPECT_TRUE(at::equal(zeros.first.to(at::kFloat), at::zeros({32})));
  auto inf = spread(32, 42, at::kFloat);
  inf[3] = INFINITY;
  const auto [values, scale_inv] = q::detail::fp8_linear_cast(inf, true);
  EXPECT_TRUE((values.to(at::kFloat) * scale_inv).isnan().all().item<bool>());
  auto w = random({16, 32}, 43).requires_grad_(true);
  EXPECT_TRUE(q::linear_fp8(inf.to(at::kBFloat16).expand({16, 32}), w, {})
                  .isnan()
                  .all()
                  .item<bool>());
}

// On a GPU (compute capability 8.9+): the cast kernel gives fp8.h's bytes,
// aligned or not, in every dtype, and the op trains within the formats'
// bounds with at::_scaled_mm's products (Hopper's fast accumulation in the
// forward stays far inside them).
TEST(Fp8Linear, GpuCastAndProducts) {
  if (!q::fp8_supported() || !torch::cuda::is_available() ||
      !colossalai::compat::has_scaled_mm(at::Device("cuda"))) {
    GTEST_SKIP() << "needs a GPU of compute capability 8.9+ and LibTorch 2.4+";
  }
  const at::Device cuda("cuda");
  for (const auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    expect_cast_equals_fp8h(spread(1 << 16, 50, dtype), cuda);
    // Unaligned start, odd length: the element-wise path.
    expect_cast_equals_fp8h(spread(4100, 51, dtype).narrow(0, 1, 4099), cuda);
    expect_cast_equals_fp8h(
        spread(48 * 32, 52, dtype).view({48, 32}).t(), cuda);
  }
  auto x = random({64, 96}, 53).to(cuda).requires_grad_(true);
  auto w = random({48, 96}, 54, 0.1).to(cuda).requires_grad_(true);
  auto b = random({48}, 55, 0.1).to(cuda).requires_grad_(true);
  const auto dy = random({64, 48}, 56).to(cuda);
  auto y = q::linear_fp8(x, w, b);
  y.backward(dy);
  const auto xd = x.detach().cpu().to(at::kDouble);
  const auto wd = w.detach().cpu().to(at::kDouble);
  const auto bd = b.detach().cpu().to(at::kDouble);
  const auto dyd = dy.cpu().to(at::kDouble);
  const double e4 = std::ldexp(1.0, -4), e5 = std::ldexp(1.0, -3);
  const double slack = std::ldexp(1.0, -6); // sums, bf16, subnormals
  const auto rel = at::full({}, std::ldexp(1.0, -8), at::kDouble);
  EXPECT_LE(
      excess(
          y.detach().cpu(),
          at::matmul(xd, wd.t()) + bd,
          rel,
          (2 * e4 + e4 * e4 + slack) * at::matmul(xd.abs(), wd.abs().t()) +
              slack * bd.abs()),
      0);
  EXPECT_LE(
      excess(
          x.grad().cpu(),
          at::matmul(dyd, wd),
          rel,
          (e5 + e4 + e5 * e4 + slack) * at::matmul(dyd.abs(), wd.abs())),
      0);
  EXPECT_LE(
      excess(
          w.grad().cpu(),
          at::matmul(dyd.t(), xd),
          rel,
          (e5 + e4 + e5 * e4 + slack) * at::matmul(dyd.abs().t(), xd.abs())),
      0);
}

TEST(Fp8Linear, EverythingElseIsThePlainLinear) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  auto plain = [](const at::Tensor& x, const at::Tensor& w) {
    return at::linear(x, w);
  };
  const auto w = random({32, 48}, 20).requires_grad_(true);
  const std::vector<std::pair<std::string, std::pair<at::Tensor, at::Tensor>>>
      cases = {
          {"40 features", {random({16, 40}, 21), random({32, 40}, 22)}},
          {"24 rows", {random({24, 48}, 23), w}},
          {"24 outputs", {random({16, 48}, 24), random({24, 48}, 25)}},
          {"float32", {random({16, 48}, 26).to(at::kFloat), w.to(at::kFloat)}},
      };
  for (const auto& [name, c] : cases) {
    SCOPED_TRACE(name);
    EXPECT_FALSE(q::linear_fp8_applies(c.first, c.second, {}));
    EXPECT_TRUE(at::equal(
        q::linear_fp8(c.first, c.second, {}), plain(c.first, c.second)));
  }
  EXPECT_FALSE(
      q::linear_fp8_applies(random({16, 48}, 27).to(at::kFloat), w, {}));
  // `linear` outside a scope is at::linear; inside, a frozen weight too.
  const auto x = random({16, 48}, 28);
  EXPECT_TRUE(at::equal(q::linear(x, w, {}), plain(x, w)));
  const auto frozen = w.detach();
  const auto before = q::fp8_linear_counts();
  {
    q::Fp8LinearScope scope;
    EXPECT_TRUE(q::fp8_linear_enabled());
    EXPECT_TRUE(at::equal(q::linear(x, frozen, {}), plain(x, frozen)));
    EXPECT_TRUE(at::equal(q::linear(x, w, {}), q::linear_fp8(x, w, {})));
    {
      q::Fp8LinearScope off(false);
      EXPECT_TRUE(at::equal(q::linear(x, w, {}), plain(x, w)));
    }
    EXPECT_TRUE(q::fp8_linear_enabled());
  }
  EXPECT_FALSE(q::fp8_linear_enabled());
  const auto after = q::fp8_linear_counts();
  EXPECT_EQ(after.calls - before.calls, 2);
  EXPECT_EQ(after.fp8 - before.fp8, 1);
}

TEST(Fp8Linear, AutocastAndCheckpointingKeepTheFp8Path) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  // float32 weights under CPU autocast: the bf16 casts autocast would make,
  // then FP8; the gradient reaches the float32 weight through the cast.
  auto w = random({32, 48}, 30).to(at::kFloat).requires_grad_(true);
  const auto x = random({16, 48}, 31).to(at::kFloat);
  at::Tensor y;
  {
    colossalai::compat::AutocastGuard cast(at::kCPU, at::kBFloat16);
    q::Fp8LinearScope scope;
    y = q::linear(x, w, {});
  }
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(
      y, q::linear_fp8(x.to(at::kBFloat16), w.to(at::kBFloat16), {})));
  y.sum().backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);

  // A checkpointed function recomputes under the scope of its first run:
  // its gradients are those of the FP8 forward bit for bit (a recompute in
  // bf16 would give the plain product's).
  auto w1 = random({64, 48}, 32).requires_grad_(true);
  auto w2 = random({48, 64}, 33).requires_grad_(true);
  const auto input = random({32, 48}, 34).requires_grad_(true);
  auto block = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{
        q::linear(at::gelu(q::linear(in[0], w1, {})), w2, {})};
  };
  auto grads = [&](bool checkpointed) {
    for (auto* t : {&w1, &w2}) {
      t->mutable_grad() = at::Tensor();
    }
    {
      q::Fp8LinearScope scope;
      const std::vector<at::Tensor> in{input};
      auto out = checkpointed
          ? colossalai::nn::checkpoint(
                colossalai::nn::CheckpointFunction(block), in)[0]
          : block(in)[0];
      out.to(at::kFloat).pow(2).sum().backward();
    }
    return std::make_pair(w1.grad().clone(), w2.grad().clone());
  };
  const auto kept = grads(false);
  const auto recomputed = grads(true);
  EXPECT_TRUE(at::equal(kept.first, recomputed.first));
  EXPECT_TRUE(at::equal(kept.second, recomputed.second));
}

namespace {

// A GPT-2 of 2 blocks whose products are all FP8-sized (32 wide, 16-token
// rows; the vocabulary's head, 100 wide, stays 16-bit).
models::GPT2LMHeadModel make_gpt2() {
  torch::manual_seed(5);
  return models::GPT2LMHeadModel(models::GPT2Config::tiny_test());
}

// 8 samples of 16 tokens (+ the next); the data-parallel rank's rows.
std::pair<at::Tensor, at::Tensor> tokens(int64_t dp_rank, int64_t dp_size) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  auto all = at::randint(100, {8, 17}, gen);
  const int64_t local = 8 / dp_size;
  auto rows = all.narrow(0, local * dp_rank, local);
  return {
      rows.narrow(1, 0, 16).contiguous(), rows.narrow(1, 1, 16).contiguous()};
}

struct Run {
  std::vector<double> losses; // where the loss is (0 elsewhere)
  int64_t fp8_products = 0;   // this rank's
  at::Tensor first_logits;    // without a pipeline
};

// `steps` steps of AdamW on a fixed batch under `plugin`.
Run train(
    const std::shared_ptr<cb::plugin::Plugin>& plugin,
    int64_t dp_rank,
    int64_t dp_size,
    bool pipeline,
    int steps = 8) {
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  auto model = make_gpt2();
  auto opt = std::make_shared<torch::optim::AdamW>(
      model->parameters(), torch::optim::AdamWOptions(3e-3));
  auto boosted = booster.boost(model, opt);
  const auto [x, y] = tokens(dp_rank, dp_size);
  Run run;
  const auto before = q::fp8_linear_counts();
  for (int s = 0; s < steps; ++s) {
    boosted.optimizer->zero_grad();
    if (pipeline) {
      auto out =
          colossalai::testing::pipeline_step(booster, boosted, model, x, y);
      run.losses.push_back(out.loss.defined() ? out.loss.item<double>() : 0);
    } else {
      auto logits = boosted.model(x);
      if (s == 0) {
        run.first_logits = logits.detach().clone();
      }
      auto loss = model->loss(logits, y);
      booster.backward(loss, *boosted.optimizer);
      run.losses.push_back(loss.item<double>());
    }
    boosted.optimizer->step();
  }
  run.fp8_products = q::fp8_linear_counts().fp8 - before.fp8;
  return run;
}

// Trained through FP8, against the same run without: 4 FP8 products per
// block in each forward (qkv, the attention's output, the MLP's two), the
// loss within 5% of the plain run's at every step (a tiny model's
// cross-entropy, about ln(100), moves by a fraction of the operands' 2^-4
// relative rounding) and falling.
void expect_fp8_training(
    const Run& fp8,
    const Run& plain,
    int64_t min_products) {
  EXPECT_GE(fp8.fp8_products, min_products);
  EXPECT_EQ(plain.fp8_products, 0);
  ASSERT_EQ(fp8.losses.size(), plain.losses.size());
  if (fp8.losses.front() == 0) {
    return; // not the last pipeline stage
  }
  for (size_t s = 0; s < fp8.losses.size(); ++s) {
    EXPECT_NEAR(fp8.losses[s], plain.losses[s], 0.05 * plain.losses[s]) << s;
  }
  EXPECT_LT(fp8.losses.back(), fp8.losses.front() - 0.1);
}

void zero_and_gemini(int rank, int /*world*/) {
  using cb::plugin::GeminiPluginOptions;
  using cb::plugin::LowLevelZeroPluginOptions;
  auto zero = [](bool fp8) {
    return std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        LowLevelZeroPluginOptions().stage(2).precision("bf16").use_fp8(fp8));
  };
  const auto zero_fp8 = train(zero(true), rank, 2, false);
  expect_fp8_training(zero_fp8, train(zero(false), rank, 2, false), 8 * 8);
  // The first forward is the model's bf16 forward inside the scope, on the
  // same weights, bit for bit.
  {
    auto model = make_gpt2();
    model->to(at::kBFloat16);
    q::Fp8LinearScope scope;
    EXPECT_TRUE(at::equal(
        model->forward(tokens(rank, 2).first), zero_fp8.first_logits));
  }
  auto gemini = [](bool fp8) {
    return std::make_shared<cb::plugin::GeminiPlugin>(
        GeminiPluginOptions().precision("bf16").use_fp8(fp8));
  };
  expect_fp8_training(
      train(gemini(true), rank, 2, false),
      train(gemini(false), rank, 2, false),
      8 * 8);
}

void hybrid(int rank, int /*world*/) {
  using HPO = cb::plugin::HybridParallelPluginOptions;
  // tp2 over ZeRO-1 bf16; pp2 with every block recomputed in backward.
  const std::vector<std::pair<std::string, HPO>> layouts = {
      {"tp2", HPO().tp_size(2).zero_stage(1).precision("bf16")},
      {"pp2 checkpointed",
       HPO()
           .pp_size(2)
           .num_microbatches(2)
           .precision("bf16")
           .gradient_checkpointing_ratio(1.0)},
  };
  for (const auto& [name, base] : layouts) {
    SCOPED_TRACE(name);
    auto with = base;
    with.use_fp8(true);
    const bool pp = base.pp_size() > 1;
    const auto fp8 = train(
        std::make_shared<cb::plugin::HybridParallelPlugin>(with), 0, 1, pp);
    const auto plain = train(
        std::make_shared<cb::plugin::HybridParallelPlugin>(base), 0, 1, pp);
    // tp2: 4 products per block per step; pp2: one block per stage, two
    // micro-batches, each block's forward run twice (the recompute).
    expect_fp8_training(fp8, plain, pp ? 8 * 4 * 2 * 2 : 8 * 8);
  }
  (void)rank;
}

// ZeRO-2 with use_fp8 and fp8_communication across 2 nodes (weights
// gathered in e4m3, then cast again for the products), and
// MoeHybridParallelPlugin at ep 2 (a Mixtral-shaped LLaMA: attention's
// products in FP8; an expert's routed rows are rarely a multiple of 16 and
// stay bf16).
void fp8_with_others(int rank, int /*world*/) {
  {
    SCOPED_TRACE("zero2 + fp8_communication");
    auto zero = [](bool fp8) {
      return std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions()
              .stage(2)
              .precision("bf16")
              .fp8_communication(fp8)
              .use_fp8(fp8));
    };
    expect_fp8_training(
        train(zero(true), rank, 2, false),
        train(zero(false), rank, 2, false),
        8 * 8);
  }
  SCOPED_TRACE("moe_hybrid ep2");
  auto run = [rank](bool fp8) {
    auto plugin = std::make_shared<cb::plugin::MoeHybridParallelPlugin>(
        cb::plugin::HybridParallelPluginOptions()
            .precision("bf16")
            .ep_size(2)
            .zero_stage(1)
            .use_fp8(fp8));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    torch::manual_seed(5);
    models::LlamaForCausalLM model(
        models::LlamaConfig::tiny_test().model_type("mixtral").moe(
            models::MoeConfig().num_experts(4)));
    auto opt = std::make_shared<torch::optim::AdamW>(
        model->parameters(), torch::optim::AdamWOptions(3e-3));
    auto boosted = booster.boost(model, opt);
    const auto [x, y] = tokens(rank, 2);
    Run r;
    const auto before = q::fp8_linear_counts();
    for (int s = 0; s < 8; ++s) {
      boosted.optimizer->zero_grad();
      auto loss = model->loss(boosted.model(x), y);
      booster.backward(loss, *boosted.optimizer);
      boosted.optimizer->step();
      r.losses.push_back(loss.item<double>());
    }
    r.fp8_products = q::fp8_linear_counts().fp8 - before.fp8;
    return r;
  };
  // q, k, v and o in each of 2 layers, 8 steps.
  expect_fp8_training(run(true), run(false), 4 * 2 * 8);
}

#if COLOSSALAI_TORCH_AT_LEAST(2, 1)
// Collects warnings while alive.
struct Warnings : c10::WarningHandler {
  Warnings() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~Warnings() override {
    c10::WarningUtils::set_warning_handler(previous_);
  }
  void process(const c10::Warning& warning) override {
    text += warning.msg() + "\n";
  }
  std::string text;

 private:
  c10::WarningHandler* previous_;
};
#endif

struct LinearNet : torch::nn::Module {
  LinearNet() {
    fc = register_module("fc", torch::nn::Linear(32, 32));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
};

// A model of LibTorch's torch::nn::Linear: nothing takes part, and the
// first forward says so.
void unreachable(int, int) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 1)
  auto plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
      cb::plugin::LowLevelZeroPluginOptions().precision("bf16").use_fp8(true));
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  auto model = std::make_shared<LinearNet>();
  auto opt = std::make_shared<torch::optim::SGD>(
      model->parameters(), torch::optim::SGDOptions(0.1));
  auto boosted = booster.boost(model, opt);
  Warnings warnings;
  boosted.model(at::randn({16, 32}));
  EXPECT_NE(
      warnings.text.find("LowLevelZeroPlugin: use_fp8 reached no linear layer"),
      std::string::npos)
      << warnings.text;
  const auto first = warnings.text;
  boosted.model(at::randn({16, 32}));
  EXPECT_EQ(warnings.text, first); // once
#endif
}

} // namespace

TEST(Fp8Linear, LowLevelZeroAndGeminiTrainThroughFp8) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(2, zero_and_gemini);
}

TEST(Fp8Linear, HybridParallelTrainsThroughFp8) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  run_distributed(2, hybrid);
}

TEST(Fp8Linear, TrainsBesideFp8CommunicationAndExperts) {
  if (!q::fp8_supported()) {
    GTEST_SKIP() << "no float8 dtypes before LibTorch 2.1";
  }
  colossalai::testing::MultiProcessOptions nodes;
  nodes.env[-1]["LOCAL_WORLD_SIZE"] = "1"; // each rank its own node
  run_distributed(2, fp8_with_others, nodes);
}

TEST(Fp8Linear, RefusedOrWarnedByName) {
  run_distributed(2, [](int rank, int world) {
    using namespace cb::plugin;
    const std::string need = q::fp8_supported()
        ? ": use_fp8 replaces 16-bit matmuls and needs precision 'bf16' or "
          "'fp16', got 'fp32'"
        : ": use_fp8 needs LibTorch 2.1";
    for (const auto& [who, make] :
         std::vector<std::pair<std::string, std::function<void()>>>{
             {"LowLevelZeroPlugin",
              [] {
                LowLevelZeroPlugin(
                    LowLevelZeroPluginOptions().precision("fp32").use_fp8(
                        true));
              }},
             {"GeminiPlugin",
              [] {
                GeminiPlugin(
                    GeminiPluginOptions().precision("fp32").use_fp8(true));
              }},
             {"HybridParallelPlugin", [] {
                HybridParallelPlugin(
                    HybridParallelPluginOptions().precision("fp32").use_fp8(
                        true));
              }}}) {
      auto err = colossalai::testing::error_of(make);
      EXPECT_NE(err.find(who + need), std::string::npos) << err;
    }
    if (q::fp8_supported()) {
      unreachable(rank, world);
    }
  });
}
