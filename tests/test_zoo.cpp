// Tests for the model zoo (zoo/): the GPT and CNN layouts other tests and
// benchmarks rely on, and the Fashion-MNIST reader's error handling.

#include <zoo/cnn_fmnist.h>
#include <zoo/fashion_mnist.h>
#include <zoo/gpt.h>

#include <colossalai/utils/compat.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace {

using colossalai::zoo::CNNFashionMNIST;
using colossalai::zoo::CNNFashionMNISTImpl;
using colossalai::zoo::FashionMNIST;
using colossalai::zoo::GPT;
using colossalai::zoo::GPTConfig;

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) {
    n += p.numel();
  }
  return n;
}

// Runs `fn`, expects a c10::Error, and returns its message.
template <typename Fn>
std::string error_message(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected a c10::Error";
  return "";
}

// ---------------------------------------------------------------- GPT

TEST(ZooGPT, DefaultConfigIsSmallCpu) {
  const auto c = GPTConfig::small_cpu();
  EXPECT_EQ(c.vocab_size(), 4096);
  EXPECT_EQ(c.block_size(), 128);
  EXPECT_EQ(c.n_embd(), 256);
  EXPECT_EQ(c.n_head(), 4);
  EXPECT_EQ(c.n_layer(), 4);
  const auto m = GPTConfig::gpt2_medium();
  EXPECT_EQ(m.vocab_size(), 50304);
  EXPECT_EQ(m.block_size(), 1024);
  EXPECT_EQ(m.n_embd(), 1024);
  EXPECT_EQ(m.n_head(), 16);
  EXPECT_EQ(m.n_layer(), 24);
  EXPECT_EQ(m.num_parameters(), 406382592);
}

TEST(ZooGPT, ParameterCount) {
  GPT model;
  EXPECT_EQ(count_parameters(*model), 5289472);
  EXPECT_EQ(GPTConfig().num_parameters(), 5289472);
  // The analytic count must follow the real layout for other shapes too.
  const auto other =
      GPTConfig().vocab_size(100).block_size(16).n_embd(32).n_head(2).n_layer(
          3);
  EXPECT_EQ(count_parameters(*GPT(other)), other.num_parameters());
}

TEST(ZooGPT, ParameterNames) {
  GPT model;
  std::vector<std::string> expected = {"wte.weight", "wpe.weight"};
  for (int i = 0; i < 4; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    for (const char* sub : {"ln1", "qkv", "proj", "ln2", "fc", "out"}) {
      expected.push_back(b + sub + ".weight");
      expected.push_back(b + sub + ".bias");
    }
  }
  expected.push_back("lnf.weight");
  expected.push_back("lnf.bias");
  expected.push_back("head.weight");

  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) {
    names.push_back(item.key());
  }
  EXPECT_EQ(names, expected);
  EXPECT_TRUE(model->named_buffers().is_empty());
  EXPECT_EQ(model->blocks->size(), 4u);
  EXPECT_NE(model->blocks[0]->as<colossalai::zoo::BlockImpl>(), nullptr);
}

TEST(ZooGPT, ForwardShapeAndLoss) {
  torch::manual_seed(0);
  GPT model;
  auto batch = colossalai::zoo::random_tokens(2, model->config(), 7);
  ASSERT_EQ(batch.first.sizes(), (std::vector<int64_t>{2, 128}));
  ASSERT_EQ(batch.second.sizes(), (std::vector<int64_t>{2, 128}));
  auto logits = model->forward(batch.first);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 128, 4096}));
  auto loss = colossalai::zoo::gpt_loss(logits, batch.second);
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  // Small init: the untrained model is close to uniform over the vocab.
  EXPECT_NEAR(loss.item<double>(), std::log(4096.0), 0.5);
  loss.backward();
  for (const auto& p : model->parameters()) {
    ASSERT_TRUE(p.grad().defined());
  }

  // Shorter sequences are fine.
  auto short_idx = batch.first.slice(1, 0, 10);
  EXPECT_EQ(
      model->forward(short_idx).sizes(), (std::vector<int64_t>{2, 10, 4096}));
}

TEST(ZooGPT, AttentionIsCausal) {
  torch::manual_seed(0);
  GPT model(
      GPTConfig().vocab_size(50).block_size(8).n_embd(16).n_head(2).n_layer(2));
  torch::NoGradGuard no_grad;
  auto idx = torch::randint(50, {1, 8}, torch::kLong);
  auto changed = idx.clone();
  changed[0][5] = (idx[0][5].item<int64_t>() + 1) % 50;
  auto a = model->forward(idx);
  auto b = model->forward(changed);
  // Positions before the change must not see it.
  EXPECT_TRUE(torch::allclose(a.slice(1, 0, 5), b.slice(1, 0, 5)));
  EXPECT_FALSE(torch::allclose(a.slice(1, 5, 8), b.slice(1, 5, 8)));
}

TEST(ZooGPT, DeterministicInitAndTokens) {
  torch::manual_seed(123);
  GPT a;
  torch::manual_seed(123);
  GPT b;
  auto pa = a->parameters();
  auto pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i], pb[i]));
  }
  EXPECT_NEAR(a->wte->weight.std().item<double>(), 0.02, 0.002);
  EXPECT_EQ(
      a->blocks[0]
          ->as<colossalai::zoo::BlockImpl>()
          ->qkv->bias.abs()
          .sum()
          .item<double>(),
      0.0);

  const GPTConfig c;
  auto t1 = colossalai::zoo::random_tokens(3, c, 99);
  auto t2 = colossalai::zoo::random_tokens(3, c, 99);
  auto t3 = colossalai::zoo::random_tokens(3, c, 100);
  EXPECT_TRUE(torch::equal(t1.first, t2.first));
  EXPECT_FALSE(torch::equal(t1.first, t3.first));
  // Targets are the inputs shifted left by one.
  EXPECT_TRUE(torch::equal(t1.first.slice(1, 1), t1.second.slice(1, 0, -1)));
  EXPECT_GE(t1.first.min().item<int64_t>(), 0);
  EXPECT_LT(t1.first.max().item<int64_t>(), c.vocab_size());
}

TEST(ZooGPT, RejectsBadInput) {
  GPT model(
      GPTConfig().vocab_size(10).block_size(4).n_embd(8).n_head(2).n_layer(1));
  EXPECT_THROW(model->forward(torch::zeros({1, 5}, torch::kLong)), c10::Error);
  EXPECT_THROW(model->forward(torch::zeros({1, 4}, torch::kInt)), c10::Error);
  EXPECT_THROW(GPT(GPTConfig().n_embd(10).n_head(4)), c10::Error);
}

// ---------------------------------------------------------------- CNN

TEST(ZooCNN, ParameterCountAndShape) {
  torch::manual_seed(0);
  CNNFashionMNIST model;
  EXPECT_EQ(count_parameters(*model), CNNFashionMNISTImpl::kNumParameters);
  EXPECT_EQ(count_parameters(*model), 147322);
  auto x = torch::randn({5, 1, 28, 28});
  auto logits = model->forward(x);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{5, 10}));
  auto loss = torch::nn::functional::cross_entropy(
      logits, torch::tensor({0, 1, 2, 3, 9}, torch::kLong));
  loss.backward();
  EXPECT_TRUE(model->fc->weight.grad().defined());
  model->eval();
  EXPECT_EQ(model->forward(x).sizes(), (std::vector<int64_t>{5, 10}));
  EXPECT_THROW(model->forward(torch::randn({2, 1, 32, 32})), c10::Error);
}

// -------------------------------------------------------- Fashion-MNIST

bool dataset_installed() {
  struct stat st;
  const auto root = FashionMNIST::default_root();
  return ::stat((root + "/train-images-idx3-ubyte.gz").c_str(), &st) == 0 &&
      ::stat((root + "/t10k-labels-idx1-ubyte.gz").c_str(), &st) == 0;
}

TEST(ZooFashionMNIST, RealData) {
  if (!dataset_installed()) {
    GTEST_SKIP() << FashionMNIST::default_root()
                 << " not found; install the Debian package "
                    "dataset-fashion-mnist to run this test";
  }
  FashionMNIST train(FashionMNIST::default_root(), FashionMNIST::Mode::kTrain);
  FashionMNIST test(FashionMNIST::default_root(), FashionMNIST::Mode::kTest);
  ASSERT_EQ(train.size().value(), 60000u);
  ASSERT_EQ(test.size().value(), 10000u);
  EXPECT_TRUE(train.is_train());
  EXPECT_FALSE(test.is_train());
  for (const auto* ds : {&train, &test}) {
    EXPECT_EQ(ds->labels().min().item<int64_t>(), 0);
    EXPECT_EQ(ds->labels().max().item<int64_t>(), 9);
  }
  // Normalisation constants are the training split's statistics.
  EXPECT_NEAR(train.images().mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(train.images().std().item<double>(), 1.0, 0.01);
  auto ex = train.get(0);
  EXPECT_EQ(ex.data.sizes(), (std::vector<int64_t>{1, 28, 28}));
  EXPECT_EQ(ex.target.dim(), 0);
  EXPECT_EQ(ex.target.scalar_type(), torch::kLong);
}

// A scratch directory with synthetic IDX files, removed afterwards.
class ZooFashionMNISTFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/zoo_fmnist_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }

  void TearDown() override {
    for (const auto& f : written_) {
      std::remove(f.c_str());
    }
    ::rmdir(dir_.c_str());
  }

  static void put_be32(std::vector<uint8_t>& out, uint32_t v) {
    out.push_back(v >> 24);
    out.push_back(v >> 16);
    out.push_back(v >> 8);
    out.push_back(v);
  }

  // IDX images: header for `count` images, then `pixels` bytes of data
  // (fewer than count*784 simulates a truncated file).
  static std::vector<uint8_t> idx_images(uint32_t count, size_t pixels) {
    std::vector<uint8_t> out;
    put_be32(out, 0x803);
    put_be32(out, count);
    put_be32(out, 28);
    put_be32(out, 28);
    for (size_t i = 0; i < pixels; ++i) {
      out.push_back(static_cast<uint8_t>(i % 256));
    }
    return out;
  }

  static std::vector<uint8_t> idx_labels(uint32_t count) {
    std::vector<uint8_t> out;
    put_be32(out, 0x801);
    put_be32(out, count);
    for (uint32_t i = 0; i < count; ++i) {
      out.push_back(static_cast<uint8_t>(i % 10));
    }
    return out;
  }

  std::string write_gz(
      const std::string& name,
      const std::vector<uint8_t>& data) {
    const std::string path = dir_ + "/" + name;
    gzFile f = gzopen(path.c_str(), "wb");
    EXPECT_NE(f, nullptr);
    EXPECT_EQ(
        gzwrite(f, data.data(), static_cast<unsigned>(data.size())),
        static_cast<int>(data.size()));
    gzclose(f);
    written_.push_back(path);
    return path;
  }

  // Cuts a file on disk down to `keep` bytes.
  static void truncate_file(const std::string& path, size_t keep) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
    in.close();
    ASSERT_GT(bytes.size(), keep);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(keep));
  }

  std::string dir_;
  std::vector<std::string> written_;
};

TEST_F(ZooFashionMNISTFiles, LoadsSyntheticFiles) {
  write_gz("t10k-images-idx3-ubyte.gz", idx_images(20, 20 * 784));
  write_gz("t10k-labels-idx1-ubyte.gz", idx_labels(20));
  FashionMNIST ds(dir_, FashionMNIST::Mode::kTest);
  ASSERT_EQ(ds.size().value(), 20u);
  EXPECT_EQ(ds.images().sizes(), (std::vector<int64_t>{20, 1, 28, 28}));
  EXPECT_EQ(ds.get(13).target.item<int64_t>(), 3);
  // Pixel 1 of image 0 has raw value 1.
  const double expected =
      (1.0 / 255.0 - FashionMNIST::kMean) / FashionMNIST::kStd;
  EXPECT_NEAR(ds.get(0).data[0][0][1].item<double>(), expected, 1e-6);
  EXPECT_THROW(ds.get(20), c10::Error);
}

TEST_F(ZooFashionMNISTFiles, MissingDirectory) {
  const std::string missing = dir_ + "/nope";
  auto msg = error_message([&] { FashionMNIST ds(missing); });
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  EXPECT_NE(
      msg.find("install the Debian package dataset-fashion-mnist"),
      std::string::npos)
      << msg;
}

TEST_F(ZooFashionMNISTFiles, MissingFile) {
  write_gz("train-images-idx3-ubyte.gz", idx_images(2, 2 * 784));
  auto msg = error_message([&] { FashionMNIST ds(dir_); });
  EXPECT_NE(msg.find(dir_ + "/train-labels-idx1-ubyte.gz"), std::string::npos)
      << msg;
  EXPECT_NE(
      msg.find("install the Debian package dataset-fashion-mnist"),
      std::string::npos)
      << msg;
}

TEST_F(ZooFashionMNISTFiles, TruncatedContent) {
  // A well-formed gzip stream whose IDX payload stops short.
  const auto images =
      write_gz("train-images-idx3-ubyte.gz", idx_images(10, 5 * 784));
  write_gz("train-labels-idx1-ubyte.gz", idx_labels(10));
  auto msg = error_message([&] { FashionMNIST ds(dir_); });
  EXPECT_NE(msg.find(images), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST_F(ZooFashionMNISTFiles, TruncatedGzipStream) {
  // The compressed file itself is cut off mid-stream.
  const auto images =
      write_gz("train-images-idx3-ubyte.gz", idx_images(10, 10 * 784));
  write_gz("train-labels-idx1-ubyte.gz", idx_labels(10));
  struct stat st;
  ASSERT_EQ(::stat(images.c_str(), &st), 0);
  truncate_file(images, static_cast<size_t>(st.st_size) / 2);
  auto msg = error_message([&] { FashionMNIST ds(dir_); });
  EXPECT_NE(msg.find(images), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST_F(ZooFashionMNISTFiles, WrongMagic) {
  // Labels where images belong.
  const auto images = write_gz("train-images-idx3-ubyte.gz", idx_labels(10));
  write_gz("train-labels-idx1-ubyte.gz", idx_labels(10));
  auto msg = error_message([&] { FashionMNIST ds(dir_); });
  EXPECT_NE(msg.find(images), std::string::npos) << msg;
  EXPECT_NE(msg.find("magic"), std::string::npos) << msg;
}

} // namespace

// compat::scaled_dot_product_attention (LibTorch's kernel on 2.x) against
// the explicit matmul / mask / softmax path, against a float64 reference
// written here, with causal, padding and both masks, Tq == Tk and Tq < Tk,
// and grouped-query attention (fewer key/value heads).
// Tolerance: both are float32 sums of D products and a softmax over Tk keys
// of values O(1): their rounding differs by a few ulps of the output, far
// below 2e-5 (the bound scales with D * 2^-24 ~ 4e-6 for D = 64).
TEST(Attention, FusedAndExplicitPathsAgree) {
  namespace compat = colossalai::compat;
  torch::manual_seed(0);
  const int64_t b = 2, h = 6, d = 64;
  // kv 6: as many key/value heads as query heads; 2: grouped-query
  // attention, each key/value head serving 3 consecutive query heads.
  for (int64_t kv : {h, int64_t(2)})
  for (int64_t tk : {1, 7, 33}) {
    for (int64_t tq : {tk, (tk + 1) / 2}) {
      auto q = torch::randn({b, h, tq, d});
      auto k = torch::randn({b, kv, tk, d});
      auto v = torch::randn({b, kv, tk, d});
      // Right padding: batch row 1 hides its last keys (never the first,
      // so every query sees at least one key).
      auto pad = torch::ones({b, 1, 1, tk}, torch::kBool);
      pad[1].narrow(-1, (tk + 1) / 2, tk - (tk + 1) / 2).fill_(false);
      for (bool causal : {false, true}) {
        for (bool masked : {false, true}) {
          const std::string tag = "kv=" + std::to_string(kv) +
              " tq=" + std::to_string(tq) +
              " tk=" + std::to_string(tk) + (causal ? " causal" : "") +
              (masked ? " padded" : "");
          c10::optional<at::Tensor> mask;
          if (masked) {
            mask = pad;
          }
          // float64 reference, the key/value heads repeated.
          const auto k64 = k.to(torch::kDouble).repeat_interleave(h / kv, 1);
          const auto v64 = v.to(torch::kDouble).repeat_interleave(h / kv, 1);
          auto s = torch::matmul(q.to(torch::kDouble), k64.transpose(-2, -1)) /
              std::sqrt(static_cast<double>(d));
          auto allow = torch::ones({tq, tk}, torch::kBool);
          if (causal) {
            allow = allow.tril(tk - tq);
          }
          if (masked) {
            allow = allow.logical_and(pad);
          }
          auto want = torch::matmul(
              torch::softmax(
                  s.masked_fill(allow.logical_not(), -INFINITY), -1),
              v64);
          auto fused =
              compat::scaled_dot_product_attention(q, k, v, mask, causal);
          auto plain = compat::explicit_attention(q, k, v, mask, causal);
          EXPECT_TRUE(torch::allclose(fused.to(torch::kDouble), want, 0, 2e-5))
              << tag << ": max diff "
              << (fused.to(torch::kDouble) - want).abs().max().item<double>();
          EXPECT_TRUE(torch::allclose(plain.to(torch::kDouble), want, 0, 2e-5))
              << tag;
          EXPECT_TRUE(torch::allclose(fused, plain, 0, 2e-5)) << tag;
        }
      }
    }
  }
  EXPECT_THROW(
      compat::scaled_dot_product_attention(
          torch::randn({1, 1, 2, 4}),
          torch::randn({1, 1, 2, 4}),
          torch::randn({1, 1, 2, 4}),
          torch::ones({2, 2}),
          false),
      c10::Error);
}

// Which kernel attention runs, and a scope that allows only some: on the
// CPU (LibTorch 2.5+) the fused kernel ("flash") runs by default, only
// "math" inside a guard that allows it alone, the default again after; a
// guard that allows no kernel that takes the inputs makes the call fail
// (ATen finds no viable kernel), not fall back. The math kernel's output
// is the explicit path's within fp32 rounding. Before 2.5 the guard is
// refused by name.
TEST(Attention, SdpaKernelGuardChoosesTheKernel) {
  namespace compat = colossalai::compat;
  torch::manual_seed(3);
  const auto q = torch::randn({2, 4, 16, 8}), k = torch::randn({2, 2, 16, 8}),
             v = torch::randn({2, 2, 16, 8});
  const auto before = compat::sdpa_backend(q, k, v, {}, true);
  if (!COLOSSALAI_TORCH_AT_LEAST(2, 5)) {
    EXPECT_THROW(compat::SdpaKernelGuard({compat::SdpaBackend::math}), c10::Error);
    return;
  }
  EXPECT_EQ(before, "flash");
  {
    compat::SdpaKernelGuard math({compat::SdpaBackend::math});
    EXPECT_EQ(compat::sdpa_backend(q, k, v, {}, true), "math");
    const auto y = compat::scaled_dot_product_attention(q, k, v, {}, true);
    EXPECT_TRUE(torch::allclose(y, compat::explicit_attention(q, k, v, {}, true), 0, 2e-5));
  }
  EXPECT_EQ(compat::sdpa_backend(q, k, v, {}, true), before);
  {
    // The CPU has no cuDNN kernel.
    compat::SdpaKernelGuard none({compat::SdpaBackend::cudnn});
    EXPECT_THROW(compat::scaled_dot_product_attention(q, k, v, {}, true), c10::Error);
  }
  EXPECT_EQ(compat::sdpa_backend(q, k, v, {}, true), before);
  EXPECT_THROW(compat::SdpaKernelGuard({}), c10::Error);
}

// On a GPU each of SDPA's kernels that takes Llama-shaped bf16 inputs (32
// query heads, 8 key/value heads of 64, causal, 2 x 256 tokens) computes
// the float64 attention and its gradients: norm-relative error under 1e-2,
// the upper end of bf16 operands' rounding (inputs and output rounded to
// 2^-9 relative, sums in float32 inside the kernels), so that choosing one
// (--sdpa in bench_gpu_gpt_step) trains the same model.
TEST(Attention, EverySdpaKernelOnCudaIsTheAttention) {
  namespace compat = colossalai::compat;
  if (!torch::cuda::is_available() || !COLOSSALAI_TORCH_AT_LEAST(2, 5)) {
    GTEST_SKIP() << "needs a CUDA device and LibTorch 2.5";
  }
  torch::manual_seed(4);
  const auto o = at::device(at::kCUDA).dtype(at::kBFloat16);
  const auto q0 = torch::randn({2, 32, 256, 64}, o), k0 = torch::randn({2, 8, 256, 64}, o),
             v0 = torch::randn({2, 8, 256, 64}, o), dy = torch::randn({2, 32, 256, 64}, o);
  auto grads = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool fused) {
    auto qq = q.detach().requires_grad_(), kk = k.detach().requires_grad_(),
         vv = v.detach().requires_grad_();
    auto y = fused ? compat::scaled_dot_product_attention(qq, kk, vv, {}, true)
                   : compat::explicit_attention(qq, kk, vv, {}, true);
    y.backward(dy.to(y.scalar_type()));
    return std::vector<at::Tensor>{y.detach(), qq.grad(), kk.grad(), vv.grad()};
  };
  const auto want = grads(q0.to(at::kDouble), k0.to(at::kDouble), v0.to(at::kDouble), false);
  const char* names[] = {"output", "dq", "dk", "dv"};
  int ran = 0;
  for (const auto b : {compat::SdpaBackend::flash, compat::SdpaBackend::cudnn,
                       compat::SdpaBackend::efficient}) {
    std::vector<at::Tensor> got;
    std::string kernel;
    try {
      compat::SdpaKernelGuard only({b});
      kernel = compat::sdpa_backend(q0, k0, v0, {}, true);
      got = grads(q0, k0, v0, true);
    } catch (const c10::Error&) {
      continue; // this kernel does not take these inputs here
    }
    ++ran;
    for (size_t i = 0; i < got.size(); ++i) {
      const auto err = (got[i].to(at::kDouble) - want[i]).norm().item<double>() /
          want[i].norm().item<double>();
      EXPECT_LT(err, 1e-2) << kernel << " " << names[i];
    }
  }
  EXPECT_GT(ran, 0) << "no fused attention kernel ran on this GPU";
}
