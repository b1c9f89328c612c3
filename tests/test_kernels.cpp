// Fused kernels (NOTE [Kernels]) against their reference paths: the fused
// algorithm in ATen on the CPU against autograd of the reference, and on a
// GPU the CUDA kernels against the reference, forward and backward, in
// every dtype they take.

#include <colossalai/kernels/rms_norm.h>
#include <colossalai/shardformer/layer/normalization.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>

namespace {

namespace kn = colossalai::kernels;

struct Grads {
  at::Tensor y, dx, dweight;
};

// y, dx and dweight of `norm` at (x, weight) under the upstream gradient dy.
template <class Norm>
Grads run(
    const Norm& norm,
    const at::Tensor& x0,
    const at::Tensor& w0,
    const at::Tensor& dy) {
  auto x = x0.detach().clone().requires_grad_(true);
  auto w = w0.detach().clone().requires_grad_(true);
  auto y = norm(x, w);
  y.backward(dy);
  return {y.detach(), x.grad(), w.grad()};
}

// Inputs of a LLaMA-like norm: rows of width `cols`, a weight near one.
std::tuple<at::Tensor, at::Tensor, at::Tensor> inputs(
    int64_t rows,
    int64_t cols,
    at::TensorOptions o) {
  torch::manual_seed(0);
  auto x = torch::randn({2, rows / 2, cols}).mul(3).to(o);
  auto w = (1 + 0.1 * torch::randn({cols})).to(o);
  auto dy = torch::randn({2, rows / 2, cols}).to(o);
  return {x, w, dy};
}

// The reference is the shardformer layer's computation, bit for bit.
TEST(Kernels, RmsNormReferenceIsTheLayersComputation) {
  namespace sl = colossalai::shardformer::layer;
  sl::RMSNorm layer(sl::RMSNormOptions(64).eps(1e-5));
  torch::NoGradGuard no_grad;
  layer->weight.copy_(1 + 0.1 * torch::randn({64}));
  for (auto t : {at::kFloat, at::kBFloat16}) {
    layer->to(t);
    auto x = torch::randn({3, 5, 64}).to(t);
    EXPECT_TRUE(at::equal(
        layer->forward(x), kn::rms_norm_reference(x, layer->weight, 1e-5)))
        << t;
  }
}

// The fused algorithm (one saved statistic per row, the analytic backward)
// equals autograd through the reference. float32: both compute in float32
// in another order of sums (the mean's, the backward's dot), so they agree
// to a few ulps of the values, 1e-5 relative. bfloat16: both round to
// bfloat16 at the same points, so an element differs only where a float32
// sum's last bits push a rounding the other way: one bfloat16 ulp (2^-8
// relative) of the element, on a small share of the elements.
TEST(Kernels, RmsNormFusedAlgorithmEqualsAutogradOfTheReference) {
  const double eps = 1e-6;
  auto fused = [eps](const at::Tensor& x, const at::Tensor& w) {
    return kn::detail::rms_norm_fused(x, w, eps);
  };
  auto reference = [eps](const at::Tensor& x, const at::Tensor& w) {
    return kn::rms_norm_reference(x, w, eps);
  };
  {
    auto [x, w, dy] = inputs(64, 384, at::kFloat);
    const auto a = run(fused, x, w, dy);
    const auto b = run(reference, x, w, dy);
    EXPECT_TRUE(at::allclose(a.y, b.y, 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose(a.dx, b.dx, 1e-5, 1e-5));
    EXPECT_TRUE(at::allclose(a.dweight, b.dweight, 1e-5, 1e-4));
  }
  {
    auto [x, w, dy] = inputs(64, 384, at::kBFloat16);
    const auto a = run(fused, x, w, dy);
    const auto b = run(reference, x, w, dy);
    for (const auto& [got, want] :
         {std::pair{a.y, b.y}, {a.dx, b.dx}, {a.dweight, b.dweight}}) {
      const auto g = got.to(at::kFloat), r = want.to(at::kFloat);
      const auto ulp = r.abs().clamp_min(1e-3) * std::pow(2.0, -7);
      EXPECT_TRUE(((g - r).abs() <= ulp).all().item<bool>());
      EXPECT_LT((g != r).to(at::kFloat).mean().item<double>(), 0.02);
    }
  }
  // An input of the wrong shape is refused by name.
  EXPECT_THROW(
      kn::detail::rms_norm_fused(torch::randn({4, 8}), torch::ones({7}), eps),
      c10::Error);
}

// rms_norm takes the reference path where no kernel applies (here: any
// CPU tensor), bit for bit.
TEST(Kernels, RmsNormOffTheGpuIsTheReference) {
  auto [x, w, dy] = inputs(16, 128, at::kFloat);
  EXPECT_FALSE(kn::rms_norm_fused_applies(x, w));
  EXPECT_TRUE(at::equal(
      kn::rms_norm(x, w, 1e-6), kn::rms_norm_reference(x, w, 1e-6)));
}

// On a GPU: the CUDA kernels against the reference on the same device.
// float32 within a few ulps (sums in another order, rsqrtf); half and
// bfloat16 within one ulp of their dtype on a small share of elements, as
// on the CPU. Rows of LLaMA-7B's width and one ragged width.
TEST(Kernels, RmsNormCudaKernelsEqualTheReference) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "needs a CUDA device";
  }
  const double eps = 1e-6;
  for (const int64_t cols : {4096, 1000}) {
    for (auto t : {at::kFloat, at::kHalf, at::kBFloat16}) {
      SCOPED_TRACE(std::to_string(cols) + " " + c10::toString(t));
      auto [x, w, dy] = inputs(512, cols, at::device(at::kCUDA).dtype(t));
      ASSERT_TRUE(kn::rms_norm_fused_applies(x, w));
      const auto a = run(
          [eps](const at::Tensor& x, const at::Tensor& w) {
            return kn::rms_norm(x, w, eps);
          },
          x,
          w,
          dy);
      const auto b = run(
          [eps](const at::Tensor& x, const at::Tensor& w) {
            return kn::rms_norm_reference(x, w, eps);
          },
          x,
          w,
          dy);
      const double rel = t == at::kFloat ? 1e-5
          : t == at::kHalf               ? std::pow(2.0, -10)
                                         : std::pow(2.0, -7);
      for (const auto& [got, want] :
           {std::pair{a.y, b.y}, {a.dx, b.dx}, {a.dweight, b.dweight}}) {
        const auto g = got.to(at::kFloat).cpu(), r = want.to(at::kFloat).cpu();
        const auto bound = r.abs().clamp_min(1e-3) * rel + 1e-5;
        EXPECT_TRUE(((g - r).abs() <= bound).all().item<bool>())
            << "max difference " << (g - r).abs().max().item<double>();
      }
    }
  }
}

} // namespace
