// HybridAdam / CPUAdam against LibTorch's Adam and AdamW, the ISA paths
// against each other, working copies, NVMe offload and option checks.

#include <colossalai/nn/optimizer/cpu_adam.h>
#include <colossalai/nn/optimizer/fused_adam.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/utils/compat.h>

#include <src/nn/optimizer/grad_slices.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace opt = colossalai::nn::optimizer;
namespace fs = std::filesystem;

const std::vector<int64_t> kSizes = {1, 7, 15, 16, 17, 1000, 4097, 100003};

std::vector<torch::Tensor> make_params(
    const std::vector<int64_t>& sizes,
    uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> params;
  for (int64_t n : sizes) {
    params.push_back(torch::randn({n}).requires_grad_());
  }
  return params;
}

std::vector<torch::Tensor> clone_params(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) {
    out.push_back(p.detach().clone().requires_grad_());
  }
  return out;
}

// Fresh gradients for step `step`, the same for every optimizer compared.
std::vector<torch::Tensor> make_grads(
    const std::vector<torch::Tensor>& params,
    int step) {
  torch::manual_seed(1000 + step);
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    // Mixed magnitudes exercise eps and the bias correction.
    grads.push_back(torch::randn_like(p) * (step % 2 ? 1e-3 : 1.0));
  }
  return grads;
}

void set_grads(
    std::vector<torch::Tensor>& params,
    const std::vector<torch::Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = grads[i].clone();
  }
}

// Norm-wise relative error max|a - b| / max|b|: an elementwise ratio means
// nothing where a step cancels a value down to almost zero.
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto bd = b.detach().to(torch::kDouble);
  auto diff = (a.detach().to(torch::kDouble) - bd).abs().max().item<double>();
  return diff / std::max(bd.abs().max().item<double>(), 1e-30);
}

// The key of `param` in `optimizer.state()`.
auto state_key(
    const torch::optim::Optimizer& optimizer,
    const torch::Tensor& p) {
  return colossalai::compat::optimizer_state_key<std::remove_const_t<
      std::remove_reference_t<decltype(optimizer.state())>>>(p);
}

// LibTorch's Adam/AdamW step written out with the same ATen ops, so the
// bias_correction = false case has a reference too.
void reference_step(
    torch::Tensor p,
    torch::Tensor g,
    torch::Tensor m,
    torch::Tensor v,
    const opt::HybridAdamOptions& o,
    int64_t step) {
  torch::NoGradGuard no_grad;
  const double lr = o.lr(), wd = o.weight_decay(), eps = o.eps();
  const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
  if (o.adamw_mode() && wd != 0) {
    p.mul_(1 - lr * wd);
  }
  if (!o.adamw_mode() && wd != 0) {
    g = g.add(p, wd);
  }
  const double bc1 = o.bias_correction() ? 1 - std::pow(b1, step) : 1.0;
  const double bc2 = o.bias_correction() ? 1 - std::pow(b2, step) : 1.0;
  m.mul_(b1).add_(g, 1 - b1);
  v.mul_(b2).addcmul_(g, g, 1 - b2);
  auto denom = (v.sqrt() / std::sqrt(bc2)).add_(eps);
  p.addcdiv_(m, denom, -lr / bc1);
}

struct Case {
  bool adamw;
  double weight_decay;
};

class HybridAdamVsTorch : public ::testing::TestWithParam<Case> {};

TEST_P(HybridAdamVsTorch, MatchesLibTorchWithTwoGroups) {
  const Case c = GetParam();
  // Two groups with their own lr / weight decay, every size in each.
  auto params_a = make_params(kSizes, 1);
  auto params_b = make_params(kSizes, 2);
  auto ref_a = clone_params(params_a);
  auto ref_b = clone_params(params_b);

  const double wd_b = c.weight_decay * 3;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      params_a,
      std::make_unique<opt::HybridAdamOptions>(opt::HybridAdamOptions(1e-3)
                                                   .betas({0.9, 0.999})
                                                   .weight_decay(c.weight_decay)
                                                   .adamw_mode(c.adamw)));
  groups.emplace_back(
      params_b,
      std::make_unique<opt::HybridAdamOptions>(opt::HybridAdamOptions(5e-3)
                                                   .betas({0.8, 0.99})
                                                   .eps(1e-6)
                                                   .weight_decay(wd_b)
                                                   .adamw_mode(c.adamw)));
  opt::HybridAdam ours(std::move(groups));

  std::unique_ptr<torch::optim::Optimizer> theirs;
  if (c.adamw) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(
        ref_a,
        std::make_unique<torch::optim::AdamWOptions>(
            torch::optim::AdamWOptions(1e-3).weight_decay(c.weight_decay)));
    g.emplace_back(
        ref_b,
        std::make_unique<torch::optim::AdamWOptions>(
            torch::optim::AdamWOptions(5e-3)
                .betas({0.8, 0.99})
                .eps(1e-6)
                .weight_decay(wd_b)));
    theirs = std::make_unique<torch::optim::AdamW>(std::move(g));
  } else {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(
        ref_a,
        std::make_unique<torch::optim::AdamOptions>(
            torch::optim::AdamOptions(1e-3).weight_decay(c.weight_decay)));
    g.emplace_back(
        ref_b,
        std::make_unique<torch::optim::AdamOptions>(
            torch::optim::AdamOptions(5e-3)
                .betas({0.8, 0.99})
                .eps(1e-6)
                .weight_decay(wd_b)));
    theirs = std::make_unique<torch::optim::Adam>(std::move(g));
  }

  for (int step = 1; step <= 5; ++step) {
    auto ga = make_grads(params_a, step);
    auto gb = make_grads(params_b, step + 100);
    set_grads(params_a, ga);
    set_grads(params_b, gb);
    set_grads(ref_a, ga);
    set_grads(ref_b, gb);
    ours.step();
    theirs->step();
    for (size_t i = 0; i < kSizes.size(); ++i) {
      EXPECT_LE(rel_diff(params_a[i], ref_a[i]), 1e-6)
          << "size " << kSizes[i] << " step " << step;
      EXPECT_LE(rel_diff(params_b[i], ref_b[i]), 1e-6)
          << "size " << kSizes[i] << " step " << step;
    }
  }
  // The moments match too.
  double rel_moment = 0;
  auto compare_moments = [&](const std::vector<torch::Tensor>& mine,
                             const std::vector<torch::Tensor>& ref) {
    for (size_t i = 0; i < mine.size(); ++i) {
      const auto& s = static_cast<const opt::HybridAdamParamState&>(
          *ours.state().at(state_key(ours, mine[i])));
      const auto& t = *theirs->state().at(state_key(*theirs, ref[i]));
      torch::Tensor m, v;
      if (c.adamw) {
        const auto& r = static_cast<const torch::optim::AdamWParamState&>(t);
        m = r.exp_avg();
        v = r.exp_avg_sq();
        EXPECT_EQ(s.step(), r.step());
      } else {
        const auto& r = static_cast<const torch::optim::AdamParamState&>(t);
        m = r.exp_avg();
        v = r.exp_avg_sq();
        EXPECT_EQ(s.step(), r.step());
      }
      rel_moment = std::max(rel_moment, rel_diff(s.exp_avg(), m));
      rel_moment = std::max(rel_moment, rel_diff(s.exp_avg_sq(), v));
    }
  };
  compare_moments(params_a, ref_a);
  compare_moments(params_b, ref_b);
  EXPECT_LE(rel_moment, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(
    Modes,
    HybridAdamVsTorch,
    ::testing::Values(
        Case{true, 0.0},
        Case{true, 0.01},
        Case{false, 0.0},
        Case{false, 0.01}));

TEST(HybridAdam, MatchesReferenceWithAndWithoutBiasCorrection) {
  for (bool bias_correction : {true, false}) {
    for (bool adamw : {true, false}) {
      for (double wd : {0.0, 0.05}) {
        const auto o = opt::HybridAdamOptions(2e-3)
                           .bias_correction(bias_correction)
                           .adamw_mode(adamw)
                           .weight_decay(wd);
        auto params = make_params(kSizes, 3);
        auto ref = clone_params(params);
        std::vector<torch::Tensor> m, v;
        for (auto& p : ref) {
          m.push_back(torch::zeros_like(p));
          v.push_back(torch::zeros_like(p));
        }
        opt::CPUAdam ours(params, o);
        for (int step = 1; step <= 4; ++step) {
          auto grads = make_grads(params, step);
          set_grads(params, grads);
          ours.step();
          for (size_t i = 0; i < params.size(); ++i) {
            reference_step(ref[i], grads[i], m[i], v[i], o, step);
            EXPECT_LE(rel_diff(params[i], ref[i]), 1e-6)
                << "bias_correction " << bias_correction << " adamw " << adamw
                << " wd " << wd << " size " << kSizes[i];
          }
        }
      }
    }
  }
}

TEST(HybridAdam, ReferenceIsLibTorch) {
  // The written-out reference is LibTorch's AdamW op for op.
  auto params = make_params({4097}, 4);
  auto ref = clone_params(params);
  auto m = torch::zeros_like(ref[0]), v = torch::zeros_like(ref[0]);
  torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(1e-3));
  for (int step = 1; step <= 3; ++step) {
    auto grads = make_grads(params, step);
    set_grads(params, grads);
    adamw.step();
    reference_step(
        ref[0],
        grads[0],
        m,
        v,
        opt::HybridAdamOptions(1e-3).weight_decay(1e-2),
        step);
  }
  EXPECT_TRUE(torch::equal(params[0], ref[0]));
}

TEST(HybridAdam, LowPrecisionGradients) {
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    auto params = make_params(kSizes, 5);
    auto ref = clone_params(params);
    opt::HybridAdam ours(params, opt::HybridAdamOptions(1e-3));
    torch::optim::AdamW theirs(
        ref, torch::optim::AdamWOptions(1e-3).weight_decay(0));
    for (int step = 1; step <= 3; ++step) {
      auto grads = make_grads(params, step);
      for (size_t i = 0; i < params.size(); ++i) {
        auto low = grads[i].to(dtype);
        params[i].mutable_grad() = low;
        ref[i].mutable_grad() = low.to(torch::kFloat);
      }
      ours.step();
      theirs.step();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LE(rel_diff(params[i], ref[i]), 1e-6)
          << dtype << " size " << kSizes[i];
    }
  }
}

TEST(HybridAdam, WorkingCopyIsRoundedMaster) {
  for (auto dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat}) {
    auto params = make_params(kSizes, 6);
    opt::HybridAdam ours(params, opt::HybridAdamOptions(1e-2));
    std::vector<torch::Tensor> working;
    for (auto& p : params) {
      working.push_back(torch::zeros({p.numel()}, dtype));
      ours.set_working_copy(p, working.back());
    }
    for (int step = 1; step <= 3; ++step) {
      auto grads = make_grads(params, step);
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].mutable_grad() = grads[i].to(torch::kBFloat16);
      }
      ours.step();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(torch::equal(working[i], params[i].detach().to(dtype)))
            << dtype << " size " << kSizes[i] << " step " << step;
      }
    }
    EXPECT_TRUE(ours.working_copy(params[0]).is_same(working[0]));
    ours.remove_working_copy(params[0]);
    EXPECT_FALSE(ours.working_copy(params[0]).defined());
  }
}

TEST(HybridAdam, WorkingCopyRoundsSpecialValues) {
  // Ties, NaN, inf and overflow round as Tensor::to() does.
  std::vector<float> values = {
      1.0f + 1.0f / 256, // bf16 tie, rounds to even
      1.0f + 3.0f / 256,
      -0.0f,
      1e-40f, // subnormal
      3.4e38f,
      65520.0f, // fp16 overflow to inf
      std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::quiet_NaN()};
  for (int r = 0; r < 13; ++r) {
    values.push_back(static_cast<float>(r) * 0.3337f - 2);
  }
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (auto isa :
         {opt::CpuAdamIsa::kScalar,
          opt::CpuAdamIsa::kAvx2,
          opt::CpuAdamIsa::kAvx512}) {
      if (!opt::cpu_adam_isa_supported(isa)) {
        continue;
      }
      opt::set_cpu_adam_isa(isa);
      // lr 0 leaves the parameter as it is; only the copy is exercised.
      auto p = torch::tensor(values).requires_grad_();
      opt::HybridAdam ours({p}, opt::HybridAdamOptions(0));
      auto w = torch::empty({p.numel()}, dtype);
      ours.set_working_copy(p, w);
      p.mutable_grad() = torch::zeros_like(p);
      ours.step();
      // Any NaN encoding will do (LibTorch's own kernels differ on it).
      auto expected = p.detach().to(dtype);
      auto nan = torch::isnan(expected);
      EXPECT_TRUE(torch::equal(torch::isnan(w), nan));
      auto keep = nan.logical_not();
      EXPECT_TRUE(torch::equal(
          w.view(torch::kShort).masked_select(keep),
          expected.view(torch::kShort).masked_select(keep)))
          << dtype << " " << opt::to_string(isa) << "\n"
          << w.view(torch::kShort) << expected.view(torch::kShort);
    }
  }
  opt::set_cpu_adam_isa(opt::CpuAdamIsa::kAuto);
}

// Runs a few steps on fresh copies with the given ISA and thread count and
// returns params, moments and working copies.
std::vector<torch::Tensor> run_isa(
    opt::CpuAdamIsa isa,
    int threads,
    const opt::HybridAdamOptions& o,
    torch::ScalarType grad_dtype) {
  opt::set_cpu_adam_isa(isa);
  const int saved = at::get_num_threads();
  at::set_num_threads(threads);
  auto params = make_params(kSizes, 7);
  opt::HybridAdam ours(params, o);
  std::vector<torch::Tensor> working;
  for (auto& p : params) {
    working.push_back(torch::empty({p.numel()}, torch::kBFloat16));
    ours.set_working_copy(p, working.back());
  }
  for (int step = 1; step <= 3; ++step) {
    auto grads = make_grads(params, step);
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = grads[i].to(grad_dtype);
    }
    ours.step();
  }
  at::set_num_threads(saved);
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& s = static_cast<const opt::HybridAdamParamState&>(
        *ours.state().at(state_key(ours, params[i])));
    out.push_back(params[i].detach().clone());
    out.push_back(s.exp_avg().clone());
    out.push_back(s.exp_avg_sq().clone());
    out.push_back(working[i]);
  }
  return out;
}

TEST(HybridAdam, IsaPathsAgreeBitForBit) {
  const std::vector<opt::CpuAdamIsa> isas = {
      opt::CpuAdamIsa::kScalar,
      opt::CpuAdamIsa::kAvx2,
      opt::CpuAdamIsa::kAvx512};
  int tested = 0;
  for (auto grad_dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (bool adamw : {true, false}) {
      const auto o =
          opt::HybridAdamOptions(1e-3).weight_decay(0.02).adamw_mode(adamw);
      auto expected = run_isa(opt::CpuAdamIsa::kScalar, 1, o, grad_dtype);
      for (auto isa : isas) {
        if (!opt::cpu_adam_isa_supported(isa)) {
          std::cout << "skipping " << opt::to_string(isa)
                    << ": not supported by this CPU\n";
          continue;
        }
        for (int threads : {1, 2}) {
          auto got = run_isa(isa, threads, o, grad_dtype);
          ASSERT_EQ(got.size(), expected.size());
          EXPECT_EQ(opt::cpu_adam_isa(), isa);
          for (size_t i = 0; i < got.size(); ++i) {
            EXPECT_TRUE(torch::equal(got[i], expected[i]))
                << opt::to_string(isa) << " threads " << threads << " tensor "
                << i << " grad " << grad_dtype << " adamw " << adamw;
          }
          ++tested;
        }
      }
    }
  }
  EXPECT_GE(tested, 6);
  opt::set_cpu_adam_isa(opt::CpuAdamIsa::kAuto);
  EXPECT_NE(opt::cpu_adam_isa(), opt::CpuAdamIsa::kAuto);
}

TEST(HybridAdam, UsableAsPlainOptimizer) {
  // A model trained through the base-class interface, closure included.
  torch::manual_seed(0);
  torch::nn::Linear model(8, 1);
  auto x = torch::randn({64, 8});
  auto y = x.sum(1, true);
  std::unique_ptr<torch::optim::Optimizer> optimizer =
      std::make_unique<opt::HybridAdam>(
          model->parameters(), opt::HybridAdamOptions(5e-2));
  double first = 0, last = 0;
  for (int i = 0; i < 200; ++i) {
    auto loss = optimizer->step([&] {
      optimizer->zero_grad();
      auto l = torch::mse_loss(model(x), y);
      l.backward();
      return l;
    });
    (i == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first * 1e-2);
  // The lr is reachable through the generic options, as schedulers need.
  optimizer->param_groups()[0].options().set_lr(0.5);
  EXPECT_EQ(
      static_cast<opt::HybridAdamOptions&>(
          optimizer->param_groups()[0].options())
          .lr(),
      0.5);
}

TEST(HybridAdam, SaveLoadResumes) {
  auto params = make_params({1000, 17}, 8);
  auto copy = clone_params(params);
  opt::HybridAdam a(params, opt::HybridAdamOptions(1e-3).weight_decay(0.1));
  opt::HybridAdam b(copy, opt::HybridAdamOptions(1e-3).weight_decay(0.1));
  for (int step = 1; step <= 2; ++step) {
    set_grads(params, make_grads(params, step));
    a.step();
  }
  std::stringstream buffer;
  {
    torch::serialize::OutputArchive archive;
    a.save(archive);
    archive.save_to(buffer);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    torch::NoGradGuard g;
    copy[i].copy_(params[i]);
  }
  {
    torch::serialize::InputArchive archive;
    archive.load_from(buffer);
    b.load(archive);
  }
  for (int step = 3; step <= 4; ++step) {
    auto grads = make_grads(params, step);
    set_grads(params, grads);
    set_grads(copy, grads);
    a.step();
    b.step();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::equal(params[i], copy[i]));
  }
}

std::string make_temp_dir() {
  std::string templ = (fs::temp_directory_path() / "hybrid_adam_test_XXXXXX");
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  EXPECT_NE(::mkdtemp(buf.data()), nullptr);
  return buf.data();
}

TEST(HybridAdam, NvmeOffloadMatchesInMemory) {
  const std::string dir = make_temp_dir();
  for (double fraction : {0.3, 1.0}) {
    auto params = make_params(kSizes, 9);
    auto ref = clone_params(params);
    const auto o = opt::HybridAdamOptions(1e-3).weight_decay(0.01);
    opt::HybridAdam off(
        params,
        opt::HybridAdamOptions(o)
            .nvme_offload_fraction(fraction)
            .nvme_offload_dir(dir));
    opt::HybridAdam mem(ref, o);
    std::vector<torch::Tensor> working;
    for (auto& p : params) {
      working.push_back(torch::empty({p.numel()}, torch::kBFloat16));
      off.set_working_copy(p, working.back());
    }
    for (int step = 1; step <= 4; ++step) {
      auto grads = make_grads(params, step);
      set_grads(params, grads);
      set_grads(ref, grads);
      off.step();
      mem.step();
      for (size_t i = 0; i < params.size(); ++i) {
        ASSERT_TRUE(torch::equal(params[i], ref[i]))
            << "fraction " << fraction << " size " << kSizes[i];
        ASSERT_TRUE(
            torch::equal(working[i], ref[i].detach().to(torch::kBFloat16)));
      }
    }
    // The first parameters that fit in the share are offloaded.
    int64_t total = 0, expected = 0;
    for (int64_t n : kSizes) {
      total += n;
    }
    const auto budget = static_cast<int64_t>(total * fraction);
    for (size_t i = 0; i < params.size(); ++i) {
      const bool should = expected + kSizes[i] <= budget;
      expected += should ? kSizes[i] : 0;
      EXPECT_EQ(off.is_offloaded(params[i]), should) << kSizes[i];
      const auto& s = static_cast<const opt::HybridAdamParamState&>(
          *off.state().at(state_key(off, params[i])));
      if (should) {
        auto files = off.offload_files(params[i]);
        ASSERT_EQ(files.size(), 2u);
        for (const auto& f : files) {
          EXPECT_TRUE(fs::exists(f)) << f;
          EXPECT_EQ(fs::file_size(f), static_cast<uintmax_t>(kSizes[i] * 4));
        }
        EXPECT_FALSE(s.exp_avg().defined()); // not resident
      } else {
        EXPECT_TRUE(off.offload_files(params[i]).empty());
        EXPECT_TRUE(s.exp_avg().defined());
      }
    }
    EXPECT_EQ(off.offloaded_numel(), expected);
    EXPECT_GT(expected, 0);

    // A save includes offloaded states; an in-memory optimizer resumes
    // from it and stays equal.
    std::stringstream buffer;
    {
      torch::serialize::OutputArchive archive;
      off.save(archive);
      archive.save_to(buffer);
    }
    auto resumed_params = clone_params(params);
    opt::HybridAdam resumed(resumed_params, o);
    {
      torch::serialize::InputArchive archive;
      archive.load_from(buffer);
      resumed.load(archive);
    }
    // Fetched states equal the in-memory optimizer's.
    off.fetch_offloaded_states();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& a = static_cast<const opt::HybridAdamParamState&>(
          *off.state().at(state_key(off, params[i])));
      const auto& b = static_cast<const opt::HybridAdamParamState&>(
          *mem.state().at(state_key(mem, ref[i])));
      ASSERT_TRUE(a.exp_avg().defined());
      EXPECT_TRUE(torch::equal(a.exp_avg(), b.exp_avg()));
      EXPECT_TRUE(torch::equal(a.exp_avg_sq(), b.exp_avg_sq()));
    }
    for (int step = 5; step <= 6; ++step) {
      auto grads = make_grads(params, step);
      set_grads(params, grads);
      set_grads(ref, grads);
      set_grads(resumed_params, grads);
      off.step(); // writes the fetched states back out
      mem.step();
      resumed.step();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::equal(params[i], ref[i]));
      EXPECT_TRUE(torch::equal(resumed_params[i], ref[i]));
    }
    // Loading into the offloaded optimizer spills the loaded states.
    {
      std::stringstream b2;
      torch::serialize::OutputArchive archive;
      mem.save(archive);
      archive.save_to(b2);
      torch::serialize::InputArchive in;
      in.load_from(b2);
      off.load(in);
    }
    auto grads = make_grads(params, 7);
    set_grads(params, grads);
    set_grads(ref, grads);
    off.step();
    mem.step();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::equal(params[i], ref[i]));
    }
    const std::string own = off.offload_dir();
    EXPECT_TRUE(fs::is_directory(own));
    EXPECT_EQ(fs::path(own).parent_path(), fs::path(dir));
  }
  // Each optimizer removed its own directory.
  EXPECT_TRUE(fs::is_empty(dir));
  fs::remove_all(dir);
}

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << e.what();
  }
}

// The host step hook sees each CPU parameter once per step, in step order,
// already updated (its value then is its value after the step), with and
// without states in files (those parameters are stepped after the others);
// a parameter without a gradient is not stepped and not reported; a null
// hook removes it.
TEST(HybridAdam, HostStepHookSeesEachParameterOnceUpdated) {
  const std::string dir = make_temp_dir();
  for (double fraction : {0.0, 0.5}) {
    SCOPED_TRACE(fraction);
    auto params = make_params(kSizes, 3);
    opt::HybridAdam adam(
        params,
        opt::HybridAdamOptions(1e-3).nvme_offload_fraction(fraction).nvme_offload_dir(dir));
    std::vector<const c10::TensorImpl*> seen;
    std::vector<torch::Tensor> values;
    adam.set_host_step_hook([&](const torch::Tensor& p) {
      seen.push_back(p.unsafeGetTensorImpl());
      values.push_back(p.detach().clone());
    });
    for (int step = 1; step <= 2; ++step) {
      seen.clear();
      values.clear();
      set_grads(params, make_grads(params, step));
      params[1].mutable_grad() = torch::Tensor(); // not stepped
      const auto before = clone_params(params);
      adam.step();
      ASSERT_EQ(seen.size(), params.size() - 1);
      for (size_t i = 0; i < params.size(); ++i) {
        if (i == 1) {
          EXPECT_TRUE(torch::equal(params[i], before[i]));
          continue;
        }
        const auto at = std::find(seen.begin(), seen.end(), params[i].unsafeGetTensorImpl());
        ASSERT_NE(at, seen.end()) << "parameter " << i;
        const auto& v = values[static_cast<size_t>(at - seen.begin())];
        EXPECT_TRUE(torch::equal(v, params[i])) << "parameter " << i;
        EXPECT_FALSE(torch::equal(v, before[i])) << "parameter " << i;
      }
      if (fraction == 0.0) { // in memory: the parameters' order
        for (size_t i = 0, j = 0; i < params.size(); ++i) {
          if (i != 1) {
            EXPECT_EQ(seen[j++], params[i].unsafeGetTensorImpl());
          }
        }
      }
    }
    adam.set_host_step_hook(nullptr);
    seen.clear();
    set_grads(params, make_grads(params, 3));
    adam.step();
    EXPECT_TRUE(seen.empty());
  }
  fs::remove_all(dir);
}

// NOTE [Host steps overlap the backward]: step_ahead takes some parameters'
// update of the coming step on a background thread, after `ready` and
// before `then`; step() waits for it and steps the rest. With two groups
// (different learning rates and weight decay), after a first step() that
// creates the states, three steps with half the parameters taken ahead
// equal every parameter stepped by step() bit for bit, states included. A
// call that includes a parameter without states yet (before its first
// step) or whose states are in files takes nothing; a changed learning
// rate, a loss scaler's verdict, a second call for the same parameter are
// refused; a failure in the job comes out of step().
TEST(HybridAdam, StepAheadEqualsStep) {
  auto a = make_params(kSizes, 5);
  auto b = clone_params(a);
  auto groups = [](const std::vector<torch::Tensor>& ps) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(
        std::vector<torch::Tensor>(ps.begin(), ps.begin() + 4),
        std::make_unique<opt::HybridAdamOptions>(
            opt::HybridAdamOptions(1e-3).weight_decay(0.1)));
    g.emplace_back(
        std::vector<torch::Tensor>(ps.begin() + 4, ps.end()),
        std::make_unique<opt::HybridAdamOptions>(
            opt::HybridAdamOptions(3e-3)));
    return g;
  };
  opt::HybridAdam plain(groups(a));
  opt::HybridAdam ahead(groups(b));
  for (int step = 1; step <= 4; ++step) {
    const auto grads = make_grads(a, step);
    set_grads(a, grads);
    set_grads(b, grads);
    plain.step();
    if (step == 1) { // no states yet: the first step() creates them
      EXPECT_EQ(ahead.step_ahead(b), 0u);
      EXPECT_FALSE(ahead.stepped_ahead());
      ahead.step();
      continue;
    }
    // Every other parameter, across both groups, in two calls.
    std::vector<std::string> events;
    std::vector<torch::Tensor> first = {b[0], b[2], b[4]};
    std::vector<torch::Tensor> second = {b[6]};
    const auto before = b[0].detach().clone();
    EXPECT_EQ(
        ahead.step_ahead(
            first,
            [&] {
              events.push_back("ready");
              EXPECT_TRUE(torch::equal(b[0], before)); // not yet updated
            },
            [&] {
              events.push_back("then");
              EXPECT_FALSE(torch::equal(b[0], before)); // updated
            }),
        3u);
    EXPECT_EQ(ahead.step_ahead(second), 1u);
    EXPECT_TRUE(ahead.stepped_ahead());
    expect_error([&] { ahead.step_ahead({b[2]}); }, "already updated ahead");
    ahead.step();
    EXPECT_FALSE(ahead.stepped_ahead());
    EXPECT_EQ(events, (std::vector<std::string>{"ready", "then"}));
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(torch::equal(a[i], b[i])) << "step " << step << " param " << i;
      const auto& sa = static_cast<const opt::HybridAdamParamState&>(
          *plain.state().at(colossalai::compat::optimizer_state_key<
                            std::remove_reference_t<decltype(plain.state())>>(
              a[i])));
      const auto& sb = static_cast<const opt::HybridAdamParamState&>(
          *ahead.state().at(colossalai::compat::optimizer_state_key<
                            std::remove_reference_t<decltype(ahead.state())>>(
              b[i])));
      EXPECT_EQ(sa.step(), sb.step());
      EXPECT_TRUE(torch::equal(sa.exp_avg(), sb.exp_avg()));
      EXPECT_TRUE(torch::equal(sa.exp_avg_sq(), sb.exp_avg_sq()));
    }
  }
  // The learning rate changed after the update was taken ahead.
  set_grads(b, make_grads(b, 4));
  ahead.step_ahead({b[0]});
  ahead.param_groups()[0].options().set_lr(0.5);
  expect_error([&] { ahead.step(); }, "changed between the backward and step()");
  // A loss scaler's verdict for the coming step.
  set_grads(b, make_grads(b, 5));
  ahead.skip_step_if(torch::zeros({}));
  expect_error([&] { ahead.step_ahead({b[0]}); }, "loss scaler");
  ahead.step();
  // A failure in the job (here the wait for the gradient) comes out of step().
  set_grads(b, make_grads(b, 6));
  ahead.step_ahead({b[1]}, [] { TORCH_CHECK(false, "copy failed"); });
  expect_error([&] { ahead.step(); }, "copy failed");
  EXPECT_FALSE(ahead.stepped_ahead());
  // States in files: the whole call is left to step().
  const std::string dir = make_temp_dir();
  {
    auto c = make_params(kSizes, 6);
    opt::HybridAdam files(
        c, opt::HybridAdamOptions(1e-3).nvme_offload_fraction(0.3).nvme_offload_dir(dir));
    set_grads(c, make_grads(c, 1));
    // Before the first step() nothing is taken: step() decides which
    // parameters' states go to files, in group order.
    EXPECT_EQ(files.step_ahead({c.back()}), 0u);
    files.step();
    set_grads(c, make_grads(c, 2));
    EXPECT_EQ(files.step_ahead(c), 0u);
    EXPECT_FALSE(files.stepped_ahead());
    files.step();
  }
  fs::remove_all(dir);
}

TEST(HybridAdam, RejectsBadOptions) {
  auto p = torch::zeros({4}, torch::requires_grad());
  using O = opt::HybridAdamOptions;
  expect_error([&] { opt::HybridAdam({p}, O(-1)); }, "lr must be >= 0, got -1");
  expect_error([&] { opt::HybridAdam({p}, O().eps(-1e-8)); }, "eps");
  expect_error(
      [&] {
        opt::HybridAdam({p}, O().betas({1.0, 0.999}));
      },
      "betas[0] must be in [0, 1), got 1");
  expect_error(
      [&] {
        opt::HybridAdam({p}, O().betas({0.9, -0.1}));
      },
      "betas[1]");
  expect_error(
      [&] { opt::HybridAdam({p}, O().weight_decay(-0.1)); }, "weight_decay");
  expect_error(
      [&] { opt::HybridAdam({p}, O().nvme_offload_fraction(1.5)); },
      "nvme_offload_fraction must be in [0, 1], got 1.5");
  expect_error(
      [&] { opt::HybridAdam({p}, O().nvme_offload_fraction(-0.1)); },
      "nvme_offload_fraction must be in [0, 1]");
  expect_error(
      [&] {
        opt::HybridAdam(
            {p},
            O().nvme_offload_fraction(0.5).nvme_offload_dir(
                "/nonexistent/hybrid_adam"));
      },
      "nvme_offload_dir: '/nonexistent/hybrid_adam' is not an existing "
      "directory");
  if (::geteuid() != 0) { // root may write anywhere
    const std::string dir = make_temp_dir();
    fs::permissions(dir, fs::perms::owner_read | fs::perms::owner_exec);
    expect_error(
        [&] {
          opt::HybridAdam(
              {p}, O().nvme_offload_fraction(0.5).nvme_offload_dir(dir));
        },
        "is not writable");
    fs::permissions(dir, fs::perms::owner_all);
    fs::remove_all(dir);
  }
  // Group options: right type, valid, no per-group offload settings.
  {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(
        std::vector<torch::Tensor>{p},
        std::make_unique<torch::optim::AdamOptions>(1e-3));
    expect_error(
        [&] { opt::HybridAdam(std::move(groups)); },
        "parameter group 0: options must be HybridAdamOptions");
  }
  {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{p});
    groups.emplace_back(
        std::vector<torch::Tensor>{torch::zeros({2}, torch::requires_grad())},
        std::make_unique<O>(O().weight_decay(-1)));
    expect_error(
        [&] { opt::HybridAdam(std::move(groups)); },
        "parameter group 1: weight_decay must be >= 0, got -1");
  }
  {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(
        std::vector<torch::Tensor>{p},
        std::make_unique<O>(O().nvme_offload_fraction(0.5)));
    expect_error(
        [&] { opt::HybridAdam(std::move(groups)); },
        "apply to the whole optimizer");
  }
  // Tensors.
  {
    auto half = torch::zeros({4}, torch::kHalf).requires_grad_();
    opt::HybridAdam a({half});
    half.mutable_grad() = torch::ones_like(half);
    expect_error([&] { a.step(); }, "parameters must be fp32");
  }
  {
    auto q = torch::zeros({4}, torch::requires_grad());
    opt::HybridAdam a({q});
    q.mutable_grad() = torch::ones({4}, torch::kDouble);
    expect_error([&] { a.step(); }, "gradients must be fp32, bf16 or fp16");
    q.mutable_grad() = torch::ones({5});
    expect_error([&] { a.step(); }, "does not match its parameter");
    expect_error(
        [&] { a.set_working_copy(q, torch::zeros({3}, torch::kBFloat16)); },
        "working copy has 3 elements");
    expect_error(
        [&] { a.set_working_copy(q, torch::zeros({4}, torch::kInt)); },
        "must be bf16, fp16 or fp32");
    expect_error(
        [&] {
          a.set_working_copy(
              q, torch::zeros({4, 2}, torch::kBFloat16).select(1, 0));
        },
        "contiguous");
    expect_error(
        [&] { a.set_working_copy(torch::zeros({4}), torch::zeros({4})); },
        "not a parameter of this optimizer");
  }
}

TEST(HybridAdam, IsaSelection) {
  for (auto isa :
       {opt::CpuAdamIsa::kScalar,
        opt::CpuAdamIsa::kAvx2,
        opt::CpuAdamIsa::kAvx512}) {
    if (opt::cpu_adam_isa_supported(isa)) {
      opt::set_cpu_adam_isa(isa);
      EXPECT_EQ(opt::cpu_adam_isa(), isa);
    } else {
      expect_error([&] { opt::set_cpu_adam_isa(isa); }, "does not support");
    }
  }
  opt::set_cpu_adam_isa(opt::CpuAdamIsa::kAuto);
  std::cout << "best ISA here: " << opt::to_string(opt::cpu_adam_isa()) << "\n";
}

// ---------------------------------------------- FusedAdam / FusedAdamW ---

// FusedAdamW (and FusedAdam) against LibTorch's AdamW (Adam) over steps of
// mixed gradient magnitudes, two groups, one with amsgrad: the fused kernel
// rounds its bias corrections to float32 where LibTorch keeps them in
// double, which moves an update by a few float32 ulps of its size (lr):
// after 6 steps within 1e-6 of the largest parameter. Where LibTorch has no
// fused kernel (1.13; the CPU before 2.4) the step is AdamW's own.
template <class Fused, class Ref, class Options>
void fused_matches_reference() {
  auto params = make_params({17, 1000, 4097}, 21);
  auto copy = clone_params(params);
  auto groups = [](std::vector<torch::Tensor>& ps) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(
        std::vector<torch::Tensor>{ps[0], ps[1]},
        std::make_unique<Options>(Options(1e-2).weight_decay(0.1)));
    g.emplace_back(
        std::vector<torch::Tensor>{ps[2]},
        std::make_unique<Options>(Options(3e-3).weight_decay(0.01).amsgrad(true)));
    return g;
  };
  Fused fused(groups(params), Options(1e-3));
  Ref ref(groups(copy), Options(1e-3));
  for (int step = 1; step <= 6; ++step) {
    auto grads = make_grads(params, step);
    set_grads(params, grads);
    set_grads(copy, grads);
    fused.step();
    ref.step();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_LT(rel_diff(params[i], copy[i]), 1e-6);
    const auto& a = fused.state().at(state_key(fused, params[i]));
    const auto& b = ref.state().at(state_key(ref, copy[i]));
    using State = std::conditional_t<
        std::is_same_v<Ref, torch::optim::AdamW>,
        torch::optim::AdamWParamState,
        torch::optim::AdamParamState>;
    const auto& sa = static_cast<const State&>(*a);
    const auto& sb = static_cast<const State&>(*b);
    EXPECT_EQ(sa.step(), 6);
    EXPECT_EQ(sa.step(), sb.step());
    EXPECT_LT(rel_diff(sa.exp_avg(), sb.exp_avg()), 1e-6);
    EXPECT_LT(rel_diff(sa.exp_avg_sq(), sb.exp_avg_sq()), 1e-6);
    EXPECT_EQ(sa.max_exp_avg_sq().defined(), sb.max_exp_avg_sq().defined());
  }
}

TEST(FusedAdam, FusedAdamWMatchesAdamW) {
  EXPECT_EQ(
      colossalai::compat::has_fused_adam(at::kCPU),
      COLOSSALAI_TORCH_AT_LEAST(2, 4));
  fused_matches_reference<opt::FusedAdamW, torch::optim::AdamW, torch::optim::AdamWOptions>();
}

TEST(FusedAdam, FusedAdamMatchesAdam) {
  fused_matches_reference<opt::FusedAdam, torch::optim::Adam, torch::optim::AdamOptions>();
}

// A FusedAdamW's state is AdamW's: its archive loads into a plain AdamW
// (and the other way), and both then step alike.
TEST(FusedAdam, StateLoadsIntoAdamW) {
  auto params = make_params({1000, 17}, 22);
  auto copy = clone_params(params);
  opt::FusedAdamW fused(params, torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW plain(copy, torch::optim::AdamWOptions(1e-3));
  for (int step = 1; step <= 2; ++step) {
    set_grads(params, make_grads(params, step));
    fused.step();
  }
  std::stringstream buffer;
  {
    torch::serialize::OutputArchive archive;
    fused.save(archive);
    archive.save_to(buffer);
  }
  {
    torch::serialize::InputArchive archive;
    archive.load_from(buffer);
    plain.load(archive);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(
        *plain.state().at(state_key(plain, copy[i])));
    const auto& f = static_cast<const torch::optim::AdamWParamState&>(
        *fused.state().at(state_key(fused, params[i])));
    EXPECT_EQ(s.step(), 2);
    EXPECT_TRUE(torch::equal(s.exp_avg(), f.exp_avg()));
    EXPECT_TRUE(torch::equal(s.exp_avg_sq(), f.exp_avg_sq()));
  }
}

// Working copies: after every step each copy is its parameter rounded to
// the copy's dtype (bf16 here), and the parameters step as without copies:
// bit for bit where the copy follows the step (CPU); on a GPU the kernel
// that writes both (kernels::adamw_step_) is float32 arithmetic in another
// order than ATen's fused AdamW, a few ulps of the update (1e-6 of the
// largest parameter, as above).
TEST(FusedAdam, FusedAdamWWritesWorkingCopies) {
  std::vector<at::Device> devices{at::kCPU};
  if (torch::cuda::is_available()) {
    devices.emplace_back(at::kCUDA);
  }
  for (const auto& dev : devices) {
    SCOPED_TRACE(dev.str());
    auto params = make_params({17, 1000, 4097}, 23);
    for (auto& p : params) {
      p = p.detach().to(dev).requires_grad_();
    }
    auto plain = clone_params(params);
    opt::FusedAdamW with(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    opt::FusedAdamW without(plain, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    std::vector<at::Tensor> copies;
    for (size_t i = 0; i < 2; ++i) { // the last parameter has none
      copies.push_back(at::zeros({params[i].numel()}, params[i].options().dtype(at::kBFloat16)));
      with.set_working_copy(params[i], copies.back());
    }
    for (int step = 1; step <= 4; ++step) {
      auto grads = make_grads(params, step);
      set_grads(params, grads);
      set_grads(plain, grads);
      with.step();
      without.step();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      SCOPED_TRACE(i);
      if (dev.is_cpu()) {
        EXPECT_TRUE(torch::equal(params[i], plain[i]));
      } else {
        EXPECT_LT(rel_diff(params[i], plain[i]), 1e-6);
      }
      if (i < copies.size()) {
        EXPECT_TRUE(torch::equal(copies[i], params[i].detach().to(at::kBFloat16)));
      }
    }
    // Copies of two dtypes in one step (the kernel takes one working dtype):
    // the step still runs, each copy its parameter rounded.
    opt::FusedAdamW mixed(plain, torch::optim::AdamWOptions(1e-2));
    const auto bf16 = at::zeros({plain[0].numel()}, plain[0].options().dtype(at::kBFloat16));
    const auto fp16 = at::zeros({plain[1].numel()}, plain[1].options().dtype(at::kHalf));
    mixed.set_working_copy(plain[0], bf16);
    mixed.set_working_copy(plain[1], fp16);
    mixed.step();
    EXPECT_TRUE(torch::equal(bf16, plain[0].detach().to(at::kBFloat16)));
    EXPECT_TRUE(torch::equal(fp16, plain[1].detach().to(at::kHalf)));
  }
  auto params = make_params({17, 8}, 24);
  opt::FusedAdamW adamw(params, torch::optim::AdamWOptions(1e-2));
  EXPECT_THROW(
      adamw.set_working_copy(torch::zeros({17}), torch::zeros({17}, at::kBFloat16)),
      c10::Error); // not its parameter
  EXPECT_THROW(
      adamw.set_working_copy(params[0], torch::zeros({8}, at::kBFloat16)),
      c10::Error); // another size
  EXPECT_THROW(
      adamw.set_working_copy(params[0], torch::zeros({17}, at::kDouble)),
      c10::Error); // a dtype no kernel writes
}

// NOTE [Gradient shards in bf16]: float32 masters whose gradients are bf16
// or fp16 step exactly as with those gradients in float32 (the conversion
// is exact and every path computes in float32): LibTorch's own optimizers
// through their ops' promotion, FusedAdam / FusedAdamW (a slice of
// converted gradients at a time into ATen's kernel; where it has none,
// the LibTorch step; on a GPU with working copies the AdamW kernel reading
// them), HybridAdam's device step (on a GPU). Bit for bit.
template <class Make>
void low_gradients_step_as_float(const at::Device& dev, const Make& make, const char* what) {
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(std::string(what) + " " + c10::toString(dtype) + " on " + dev.str());
    auto low = make_params({17, 1000, 4097}, 25);
    for (auto& p : low) {
      p = p.detach().to(dev).requires_grad_();
    }
    auto high = clone_params(low);
    std::vector<at::Tensor> copies_low, copies_high;
    auto a = make(low, copies_low);
    auto b = make(high, copies_high);
    for (int step = 1; step <= 3; ++step) {
      auto grads = make_grads(low, step);
      for (size_t i = 0; i < low.size(); ++i) {
        low[i].mutable_grad() = grads[i].to(dtype);
        high[i].mutable_grad() = grads[i].to(dtype).to(at::kFloat);
      }
      a->step();
      b->step();
    }
    for (size_t i = 0; i < low.size(); ++i) {
      EXPECT_EQ(low[i].grad().scalar_type(), dtype); // not replaced
      EXPECT_TRUE(torch::equal(low[i], high[i])) << "parameter " << i;
    }
    for (size_t i = 0; i < copies_low.size(); ++i) {
      EXPECT_TRUE(torch::equal(copies_low[i], copies_high[i])) << "copy " << i;
    }
  }
}

TEST(FusedAdam, SixteenBitGradientsOfFloatMastersStepAsTheirFloatValues) {
  using Params = std::vector<at::Tensor>;
  std::vector<at::Device> devices{at::kCPU};
  if (torch::cuda::is_available()) {
    devices.emplace_back(at::kCUDA);
  }
  for (const auto& dev : devices) {
    low_gradients_step_as_float(dev, [](Params& ps, Params&) {
      return std::make_unique<opt::FusedAdamW>(ps, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    }, "FusedAdamW");
    low_gradients_step_as_float(dev, [](Params& ps, Params&) {
      return std::make_unique<opt::FusedAdam>(ps, torch::optim::AdamOptions(1e-2).weight_decay(0.1).amsgrad(true));
    }, "FusedAdam amsgrad");
    low_gradients_step_as_float(dev, [](Params& ps, Params& copies) {
      auto o = std::make_unique<opt::FusedAdamW>(ps, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      for (auto& p : ps) {
        copies.push_back(at::zeros({p.numel()}, p.options().dtype(at::kBFloat16)));
        o->set_working_copy(p, copies.back());
      }
      return o;
    }, "FusedAdamW with working copies");
    low_gradients_step_as_float(dev, [](Params& ps, Params&) {
      return std::make_unique<torch::optim::AdamW>(ps, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    }, "AdamW");
    low_gradients_step_as_float(dev, [](Params& ps, Params&) {
      return std::make_unique<torch::optim::Adam>(ps, torch::optim::AdamOptions(1e-2).weight_decay(0.1));
    }, "Adam");
    low_gradients_step_as_float(dev, [](Params& ps, Params&) {
      return std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(1e-2).momentum(0.9).weight_decay(0.1));
    }, "SGD");
    if (!dev.is_cpu()) {
      low_gradients_step_as_float(dev, [](Params& ps, Params&) {
        return std::make_unique<opt::HybridAdam>(ps, opt::HybridAdamOptions(1e-2).weight_decay(0.1));
      }, "HybridAdam");
    }
  }
}

// The conversion's slices: consecutive ranges covering every gradient,
// each converted, at most the limit of elements unless one tensor alone
// is larger; gradients already of the dtype pass as they are, in one call.
TEST(FusedAdam, GradientSlicesCoverEveryTensorWithinTheLimit) {
  namespace d = colossalai::nn::optimizer::detail;
  std::vector<at::Tensor> grads;
  for (int64_t n : {3, 4, 9, 2, 2, 1, 12, 5}) {
    grads.push_back(at::randn({n}).to(at::kBFloat16));
  }
  size_t next = 0;
  d::in_grad_slices(grads, at::kFloat, [&](size_t lo, size_t hi, const std::vector<at::Tensor>& got) {
    EXPECT_EQ(lo, next);
    EXPECT_LT(lo, hi);
    ASSERT_EQ(got.size(), hi - lo);
    int64_t elements = 0;
    for (size_t i = lo; i < hi; ++i) {
      EXPECT_EQ(got[i - lo].scalar_type(), at::kFloat);
      EXPECT_TRUE(torch::equal(got[i - lo], grads[i].to(at::kFloat)));
      elements += got[i - lo].numel();
    }
    EXPECT_TRUE(elements <= 8 || hi - lo == 1) << lo << ".." << hi;
    next = hi;
  }, /*max_elements=*/8);
  EXPECT_EQ(next, grads.size());
  int calls = 0;
  d::in_grad_slices(grads, at::kBFloat16, [&](size_t lo, size_t hi, const std::vector<at::Tensor>& got) {
    ++calls;
    EXPECT_EQ(lo, 0u);
    EXPECT_EQ(hi, grads.size());
    EXPECT_TRUE(got[0].is_same(grads[0]));
  }, 8);
  EXPECT_EQ(calls, 1);
}

// fused_adam_in_slices with slices of at most 5000 elements over tensors of
// 17, 1000, 4097 and 3000 (three slices: 17 and 1000, 4097, 3000), bf16
// gradients and amsgrad: equal, bit for bit,
// to one fused call over the same values in float32, states included.
// Where LibTorch has ATen's fused kernel for the device.
TEST(FusedAdam, SlicedFusedCallsEqualOneCall) {
  namespace d = colossalai::nn::optimizer::detail;
  std::vector<at::Device> devices;
  if (colossalai::compat::has_fused_adam(at::kCPU)) {
    devices.emplace_back(at::kCPU);
  }
  if (torch::cuda::is_available() && colossalai::compat::has_fused_adam(at::kCUDA)) {
    devices.emplace_back(at::kCUDA);
  }
  if (devices.empty()) {
    GTEST_SKIP() << "no fused Adam kernel in this LibTorch";
  }
  for (const auto& dev : devices) {
    SCOPED_TRACE(dev.str());
    auto make = [&](int seed) {
      auto ps = make_params({17, 1000, 4097, 3000}, seed);
      std::vector<at::Tensor> out;
      for (auto& p : ps) {
        out.push_back(p.detach().to(dev));
      }
      return out;
    };
    auto p1 = make(26), p2 = make(26);
    auto zeros = [](const std::vector<at::Tensor>& ps) {
      std::vector<at::Tensor> z;
      for (const auto& p : ps) {
        z.push_back(at::zeros_like(p));
      }
      return z;
    };
    auto m1 = zeros(p1), v1 = zeros(p1), x1 = zeros(p1);
    auto m2 = zeros(p2), v2 = zeros(p2), x2 = zeros(p2);
    for (int step = 1; step <= 3; ++step) {
      auto grads = make_grads(p1, step);
      std::vector<at::Tensor> low, high, steps1, steps2;
      for (auto& g : grads) {
        low.push_back(g.to(dev, at::kBFloat16));
        high.push_back(low.back().to(at::kFloat));
        steps1.push_back(at::full({}, static_cast<double>(step), p1[0].options()));
        steps2.push_back(steps1.back().clone());
      }
      d::fused_adam_in_slices(
          p1, low, m1, v1, x1, steps1, 1e-2, 0.9, 0.999, 0.1, 1e-8, true, true,
          at::Tensor(), 5000);
      colossalai::compat::fused_adam_(
          p2, high, m2, v2, x2, steps2, 1e-2, 0.9, 0.999, 0.1, 1e-8, true, true);
    }
    for (size_t i = 0; i < p1.size(); ++i) {
      EXPECT_TRUE(torch::equal(p1[i], p2[i])) << "parameter " << i;
      EXPECT_TRUE(torch::equal(m1[i], m2[i])) << "exp_avg " << i;
      EXPECT_TRUE(torch::equal(v1[i], v2[i])) << "exp_avg_sq " << i;
      EXPECT_TRUE(torch::equal(x1[i], x2[i])) << "max_exp_avg_sq " << i;
    }
  }
}

// Graph mode (NOTE [Captured optimizer steps]) outside a capture: the
// first step in graph mode is an ordinary one; each later one, after
// prepare_graph_step, launches the calls the first one found with the
// scalars just written, as a replay of a captured step does. Two groups
// (one with amsgrad), a working copy on one parameter (on a GPU: our
// kernel's half), the learning rate halved every step (powers of two:
// exact in the float32 the fused kernel reads from device memory, where
// the ordinary step passes a double): equal to ordinary steps bit for bit,
// states and step counts included; then ordinary steps again.
TEST(FusedAdam, GraphModeStepsEqualOrdinarySteps) {
  std::vector<at::Device> devices;
  if (colossalai::compat::has_fused_adam(at::kCPU) && COLOSSALAI_TORCH_AT_LEAST(2, 2)) {
    devices.emplace_back(at::kCPU);
  }
  if (torch::cuda::is_available()) {
    devices.emplace_back(at::kCUDA);
  }
  {
    auto params = make_params({17}, 25);
    opt::FusedAdamW adamw(params, torch::optim::AdamWOptions(1e-2));
    const auto why = adamw.graph_capture_blocker();
    if (colossalai::compat::has_fused_adam(at::kCPU) && COLOSSALAI_TORCH_AT_LEAST(2, 2)) {
      EXPECT_EQ(why, "");
    } else {
      EXPECT_NE(why.find("FusedAdamW"), std::string::npos) << why;
    }
  }
  if (devices.empty()) {
    GTEST_SKIP() << "no device with a fused Adam kernel in this LibTorch";
  }
  for (const auto& dev : devices) {
    SCOPED_TRACE(dev.str());
    auto params = make_params({17, 1000, 4097}, 26);
    for (auto& p : params) {
      p = p.detach().to(dev).requires_grad_();
    }
    auto plain = clone_params(params);
    auto groups = [](std::vector<torch::Tensor>& ps) {
      std::vector<torch::optim::OptimizerParamGroup> g;
      g.emplace_back(
          std::vector<torch::Tensor>{ps[0], ps[1]},
          std::make_unique<torch::optim::AdamWOptions>(
              torch::optim::AdamWOptions(std::ldexp(1.0, -7)).weight_decay(0.1)));
      g.emplace_back(
          std::vector<torch::Tensor>{ps[2]},
          std::make_unique<torch::optim::AdamWOptions>(
              torch::optim::AdamWOptions(std::ldexp(1.0, -8)).weight_decay(0.01).amsgrad(true)));
      return g;
    };
    opt::FusedAdamW graphed(groups(params), torch::optim::AdamWOptions(1e-3));
    opt::FusedAdamW ordinary(groups(plain), torch::optim::AdamWOptions(1e-3));
    const auto copy = at::zeros({1000}, params[1].options().dtype(at::kBFloat16));
    const auto plain_copy = copy.clone();
    graphed.set_working_copy(params[1], copy);
    ordinary.set_working_copy(plain[1], plain_copy);
    auto halve = [](torch::optim::Optimizer& o) {
      for (auto& g : o.param_groups()) {
        auto& opts = static_cast<torch::optim::AdamWOptions&>(g.options());
        opts.lr(opts.lr() / 2);
      }
    };
    // Into the same tensors, as a replayed backward writes them.
    auto write_grads = [&](int step) {
      const auto grads = make_grads(params, step);
      for (size_t i = 0; i < params.size(); ++i) {
        for (auto* p : {&params[i], &plain[i]}) {
          auto& g = p->mutable_grad();
          if (g.defined()) {
            g.copy_(grads[i]);
          } else {
            g = grads[i].to(dev);
          }
        }
      }
    };
    for (int step = 1; step <= 6; ++step) {
      write_grads(step);
      if (step == 3) {
        graphed.set_graph_mode(true);
      } else if (step > 3) {
        graphed.prepare_graph_step();
      }
      graphed.step();
      ordinary.step();
      halve(graphed);
      halve(ordinary);
    }
    auto expect_equal = [&](int steps) {
      for (size_t i = 0; i < params.size(); ++i) {
        SCOPED_TRACE(i);
        EXPECT_TRUE(torch::equal(params[i], plain[i]));
        const auto& a = static_cast<const torch::optim::AdamWParamState&>(
            *graphed.state().at(state_key(graphed, params[i])));
        const auto& b = static_cast<const torch::optim::AdamWParamState&>(
            *ordinary.state().at(state_key(ordinary, plain[i])));
        EXPECT_EQ(a.step(), steps);
        EXPECT_EQ(b.step(), steps);
        EXPECT_TRUE(torch::equal(a.exp_avg(), b.exp_avg()));
        EXPECT_TRUE(torch::equal(a.exp_avg_sq(), b.exp_avg_sq()));
        if (b.max_exp_avg_sq().defined()) {
          EXPECT_TRUE(torch::equal(a.max_exp_avg_sq(), b.max_exp_avg_sq()));
        }
      }
      EXPECT_TRUE(torch::equal(copy, plain_copy));
      EXPECT_TRUE(torch::equal(copy, params[1].detach().to(at::kBFloat16)));
    };
    expect_equal(6);
    // What the captured launch holds by value cannot change under it.
    auto& opts = static_cast<torch::optim::AdamWOptions&>(graphed.param_groups()[1].options());
    opts.eps(1e-6);
    try {
      graphed.prepare_graph_step();
      ADD_FAILURE() << "a new eps was taken in graph mode";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("new capture"), std::string::npos) << e.what();
    }
    opts.eps(1e-8);
    // Ordinary steps again, from the same state.
    graphed.set_graph_mode(false);
    write_grads(7);
    graphed.step();
    ordinary.step();
    expect_equal(7);
  }
}

} // namespace
