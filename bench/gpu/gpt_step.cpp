// Single-GPU training step of gpt2-medium-gpu (shared reference workload):
// GPT-2 medium shape, bf16 autocast through the Booster, AdamW, micro-batch
// 8 x 1024 tokens. Reports tokens/s and model FLOPs utilization against the
// bf16 matmul rate measured on the same device in the same run.
//
// Model FLOPs per token (the PaLM accounting, attention scores included):
//   6 * (parameters without the embeddings) + 12 * n_layer * n_embd * T
//
//   bench_gpu_gpt_step [--device cuda|cpu] [--model gpt2-medium|gpt-small-cpu]
//                      [--batch 8] [--steps 20] [--warmup 3]
//                      [--matmul-n 8192] [--out FILE.json]
//
// Builds against a CPU LibTorch as well (for a smoke test with
// --device cpu --model gpt-small-cpu); device memory statistics need CUDA.

#include <colossalai/colossalai.h>

#include <zoo/gpt.h>

#include "../bench_util.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#ifdef COLOSSALAI_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

namespace cb = colossalai::booster;
namespace cbench = colossalai::bench;

namespace {

struct Args {
  std::string device;
  std::string model = "gpt2-medium";
  int64_t batch = 8;
  int steps = 20;
  int warmup = 3;
  int64_t matmul_n = 8192;
  std::string out;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    TORCH_CHECK(i + 1 < argc, "option ", k, " needs a value");
    std::string v = argv[++i];
    if (k == "--device")
      a.device = v;
    else if (k == "--model")
      a.model = v;
    else if (k == "--batch")
      a.batch = std::stoll(v);
    else if (k == "--steps")
      a.steps = std::stoi(v);
    else if (k == "--warmup")
      a.warmup = std::stoi(v);
    else if (k == "--matmul-n")
      a.matmul_n = std::stoll(v);
    else if (k == "--out")
      a.out = v;
    else
      TORCH_CHECK(false, "unknown option ", k);
  }
  if (a.device.empty())
    a.device = torch::cuda::is_available() ? "cuda" : "cpu";
  TORCH_CHECK(
      a.device == "cpu" || torch::cuda::is_available(),
      "--device cuda asked for, but CUDA is not available");
  return a;
}

void sync(const at::Device& d) {
  if (d.is_cuda())
    torch::cuda::synchronize();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

// Dense bf16 matmul rate (FLOP/s), median of 5 timed blocks: the ceiling MFU
// is measured against.
std::vector<double> matmul_rates(const at::Device& dev, int64_t n) {
  auto opts = at::TensorOptions().dtype(at::kBFloat16).device(dev);
  auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
  auto c = torch::empty({n, n}, opts);
  const int iters = dev.is_cuda() ? 20 : 2;
  for (int i = 0; i < 3; ++i)
    at::matmul_out(c, a, b);
  sync(dev);
  std::vector<double> rates;
  for (int r = 0; r < 5; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i)
      at::matmul_out(c, a, b);
    sync(dev);
    rates.push_back(2.0 * n * n * n * iters / seconds_since(t0));
  }
  return rates;
}

int64_t peak_device_bytes(const at::Device& dev) {
#ifdef COLOSSALAI_WITH_CUDA
  if (dev.is_cuda()) {
    auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(dev.has_index() ? dev.index() : 0);
    return stats.allocated_bytes[0].peak; // StatType::AGGREGATE
  }
#endif
  return -1;
}

std::string device_name(const at::Device& dev) {
  if (!dev.is_cuda())
    return cbench::cpu_model();
  std::string name = "cuda";
#ifdef COLOSSALAI_WITH_CUDA
  // The driver's name is read from Python's side of the report; here the
  // device count is what LibTorch exposes without CUDA runtime headers.
  name += " x" + std::to_string(torch::cuda::device_count());
#endif
  return name;
}

int run(const Args& a) {
  const at::Device dev(a.device);
  auto cfg = a.model == "gpt2-medium"
      ? colossalai::zoo::GPTConfig::gpt2_medium()
      : colossalai::zoo::GPTConfig::small_cpu();
  TORCH_CHECK(
      a.model == "gpt2-medium" || a.model == "gpt-small-cpu",
      "--model must be gpt2-medium or gpt-small-cpu");
  const int64_t t = cfg.block_size();
  const int64_t n = dev.is_cuda() ? a.matmul_n : std::min<int64_t>(a.matmul_n, 1024);

  std::fprintf(stderr, "measuring bf16 matmul rate (%lld^3)\n", (long long)n);
  auto rates = matmul_rates(dev, n);
  const double peak = cbench::median(rates);

  std::fprintf(stderr, "building %s\n", a.model.c_str());
  torch::manual_seed(0);
  colossalai::zoo::GPT model(cfg);
  model->to(dev);
  auto optimizer = std::make_shared<torch::optim::AdamW>(
      model->parameters(),
      torch::optim::AdamWOptions(3e-4)
          .betas({0.9, 0.999})
          .eps(1e-8)
          .weight_decay(0.01));
  cb::Booster booster(
      cb::BoosterOptions().device(a.device).mixed_precision("bf16"));
  auto boosted = booster.boost(model, optimizer);

  auto batch = colossalai::zoo::random_tokens(a.batch, cfg, 100);
  auto x = batch.first.to(dev), y = batch.second.to(dev);
  double last_loss = 0;
  auto step = [&]() {
    sync(dev);
    auto t0 = std::chrono::steady_clock::now();
    boosted.optimizer->zero_grad();
    auto loss = colossalai::zoo::gpt_loss(boosted.model(x), y);
    booster.backward(loss, *boosted.optimizer);
    boosted.optimizer->step();
    sync(dev);
    double s = seconds_since(t0);
    last_loss = loss.item<double>();
    return s;
  };
  for (int i = 0; i < a.warmup; ++i)
    step();
  std::vector<double> times;
  for (int i = 0; i < a.steps; ++i) {
    times.push_back(step() * 1e3);
    if ((i + 1) % 5 == 0)
      std::fprintf(stderr, "step %d/%d: %.1f ms\n", i + 1, a.steps, times.back());
  }

  const int64_t params = cfg.num_parameters();
  const int64_t embed = (cfg.vocab_size() + cfg.block_size()) * cfg.n_embd();
  const double flops_per_token = 6.0 * (params - embed) +
      12.0 * cfg.n_layer() * cfg.n_embd() * static_cast<double>(t);
  const double step_ms = cbench::median(times);
  const double tokens_per_s = a.batch * t / (step_ms * 1e-3);
  const double mfu = tokens_per_s * flops_per_token / peak;

  std::ostringstream json;
  json << "{\n  \"benchmark\": \"gpu_gpt_step\",\n  \"implementation\": "
       << "\"ours (C++, Booster bf16)\",\n  \"model\": \"" << a.model
       << "\",\n  \"parameters\": " << params
       << ",\n  \"config\": {\"device\": \"" << a.device
       << "\", \"batch\": " << a.batch << ", \"seq_len\": " << t
       << ", \"precision\": \"bf16 autocast, fp32 parameters\", \"optimizer\": "
       << "\"AdamW(3e-4, wd 0.01)\", \"steps\": " << a.steps
       << ", \"warmup\": " << a.warmup << "},\n  \"machine\": "
       << cbench::machine_json() << ",\n  \"device_name\": \""
       << device_name(dev) << "\",\n  \"matmul\": {\"n\": " << n
       << ", \"bf16_flops_median\": " << peak
       << ", \"bf16_flops_max\": " << *std::max_element(rates.begin(), rates.end())
       << "},\n  \"flops_per_token\": " << flops_per_token
       << ",\n  \"step_ms\": " << cbench::stats_json(times)
       << ",\n  \"tokens_per_s\": " << tokens_per_s << ",\n  \"mfu\": " << mfu
       << ",\n  \"final_loss\": " << last_loss
       << ",\n  \"peak_device_bytes\": " << peak_device_bytes(dev)
       << ",\n  \"peak_rss_bytes\": " << cbench::peak_rss_bytes() << "\n}\n";
  std::cout << json.str();
  if (!a.out.empty())
    std::ofstream(a.out) << json.str();
  std::printf(
      "| %s | %s | step %.1f ms | %.0f tokens/s | MFU %.1f%% of %.1f TFLOP/s "
      "bf16 matmul |\n",
      a.model.c_str(),
      a.device.c_str(),
      step_ms,
      tokens_per_s,
      100 * mfu,
      peak / 1e12);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
