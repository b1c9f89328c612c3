// Single-GPU training step of gpt2-medium-gpu (shared reference workload):
// GPT-2 medium shape, bf16 autocast through the Booster, AdamW, micro-batch
// 8 x 1024 tokens (the zoo GPT, untied head); or (--model gpt2-medium-hf)
// colossalai::models::GPT2LMHeadModel, the transformers-compatible GPT-2
// (tied head, vocabulary 50257), in GPT-2 medium's shape without dropout;
// or (--model llama3.2-1b) a colossalai::models LlamaForCausalLM of Llama
// 3.2 1B's shape, --seq tokens (2048). Reports tokens/s and model FLOPs
// utilization against the bf16 matmul rate measured on the same device in
// the same run.
//
// Model FLOPs per token (the PaLM accounting, attention scores included):
//   6 * (parameters of matmuls) + 12 * n_layer * n_embd * T
// where a tied embedding counts as the head's matmul and a lookup-only
// one (the zoo GPT's token embedding, every position embedding) does not.
//
//   bench_gpu_gpt_step [--device cuda|cpu]
//                      [--model gpt2-medium|gpt-small-cpu|gpt2-medium-hf|
//                               gpt2-small-cpu-hf|llama3.2-1b|
//                               llama-small-cpu] [--seq N]
//                      [--batch 8] [--steps 20] [--warmup 3]
//                      [--matmul-n 8192] [--out FILE.json]
//                      [--optimizer adamw|fused_adamw|hybrid_adam]
//                      [--loss logits|fused] [--plugin none|zero1]
//                      [--split-steps 5] [--profile 0]
//                      [--recompute-mlp off|on] [--cuda-graph off|on]
//                      [--sdpa default|flash|cudnn|efficient|math]
//                      [--precision bf16|fp16] [--shared-casts on|off]
//                      [--use-fp8 off|on]
//
// --optimizer: LibTorch's AdamW (a loop of per-tensor ops), FusedAdamW
// (at::_fused_adamw_, one pass) or HybridAdam (its device path).
// --loss: the model's loss over the whole [B*T, V] logits, or
// kernels::fused_linear_cross_entropy over the final hidden states and the
// head's weight (the zoo GPT's forward(idx, targets); GPT2LMHeadModel's
// forward_loss; for the Llama models the backbone's output and the tied
// embedding), whose CUDA kernel takes
// each chunk's loss and logits gradient in place.
// After the timed steps, --split-steps more steps (default 5) each
// synchronise after the forward and the backward: the median forward
// (with the loss), backward and optimizer milliseconds ("split_ms").
// --profile N (CUDA, LibTorch 2.x) runs N more steps under LibTorch's
// Kineto profiler and reports the device's time per step by kernel and by
// kind of kernel, and which attention kernels ran ("kernels"); a profiler
// that fails is reported, not fatal.
// --recompute-mlp on: each block's MLP forms its activation again in
// backward instead of keeping it: gelu(fc(x)) in the GPT models
// (zoo::GPTConfig::recompute_gelu; models::set_mlp_activation_recompute
// for GPT2LMHeadModel; kernels::gelu_linear), silu(gate) * up in the LLaMA
// ones (models::set_mlp_activation_recompute, kernels::silu_mul_linear).
// Less activation memory, one elementwise pass more.
// --cuda-graph on: the whole step (forward, backward, optimizer) captured
// once in a CUDA graph after the warm-up steps and replayed
// (booster::GraphedStep; needs --optimizer fused_adamw). No split timing
// then: a replay is one launch.
// --sdpa KERNEL: attention may run only that kernel of SDPA's
// (compat::SdpaKernelGuard, LibTorch 2.5+); default: ATen's choice. The
// JSON names the kernel ATen picks for the model's attention either way
// ("sdpa_backend").
// --plugin zero1: LowLevelZeroPlugin (stage 1, precision bf16) at world size
// one: bf16 parameters, fp32 masters in the optimizer, no autocast (no cast
// of every weight in every forward), as ColossalAI trains in bf16.
// --precision fp16: fp16 instead (the booster's fp16 autocast with its
// GradScaler, or LowLevelZero's fp16 weights): dynamic loss scaling, whose
// overflow verdict stays on the device over fused_adamw and hybrid_adam.
// --use-fp8 on (with --plugin zero1): the plugin's use_fp8, each linear
// whose sizes allow it multiplied in FP8 (quantization/fp8_linear.h;
// Hopper's FP8 rate is twice bf16's). The MFU counts the same model FLOPs
// against the same bf16 peak.
// --shared-casts off: under autocast every linear casts its input itself
// (three kept copies of the norm's output for q, k and v) instead of one
// cast shared by the layers reading it (amp::SharedCast; the default). The
// same results either way; here only the LLaMA models differ (GPT-2's q, k
// and v are one linear, and so are its MLP's first).
//
// Builds against a CPU LibTorch as well (for a smoke test with
// --device cpu --model gpt-small-cpu); device memory statistics need CUDA.

#include <colossalai/colossalai.h>

#include <colossalai/booster/graphed_step.h>

#include <colossalai/kernels/fused_linear_cross_entropy.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/utils/compat.h>

#if defined(COLOSSALAI_WITH_CUDA) && COLOSSALAI_TORCH_AT_LEAST(2, 0)
#include <torch/csrc/autograd/profiler_kineto.h>
#define COLOSSALAI_BENCH_PROFILE 1
#endif

#include <zoo/gpt.h>

#include "../bench_util.h"
#include "device_util.h"
#include "../llama_workloads.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <map>
#include <optional>
#include <set>
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
  int64_t seq = 0; // llama3.2-1b's sequence; 0: 2048
  std::string out;
  std::string optimizer = "adamw";
  std::string loss = "logits";
  std::string plugin = "none";
  int split_steps = 5;
  int profile = 0;
  bool recompute_mlp = false;
  bool cuda_graph = false;
  std::string sdpa = "default";
  std::string precision = "bf16";
  bool shared_casts = true;
  bool use_fp8 = false;
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
    else if (k == "--optimizer")
      a.optimizer = v;
    else if (k == "--loss")
      a.loss = v;
    else if (k == "--plugin")
      a.plugin = v;
    else if (k == "--seq")
      a.seq = std::stoll(v);
    else if (k == "--split-steps")
      a.split_steps = std::stoi(v);
    else if (k == "--profile")
      a.profile = std::stoi(v);
    else if (k == "--recompute-mlp") {
      TORCH_CHECK(v == "on" || v == "off", "--recompute-mlp must be on or off, got ", v);
      a.recompute_mlp = v == "on";
    } else if (k == "--cuda-graph") {
      TORCH_CHECK(v == "on" || v == "off", "--cuda-graph must be on or off, got ", v);
      a.cuda_graph = v == "on";
    } else if (k == "--sdpa") {
      TORCH_CHECK(
          v == "default" || v == "flash" || v == "cudnn" || v == "efficient" || v == "math",
          "--sdpa must be default, flash, cudnn, efficient or math, got ",
          v);
      a.sdpa = v;
    } else if (k == "--precision") {
      TORCH_CHECK(v == "bf16" || v == "fp16", "--precision must be bf16 or fp16, got ", v);
      a.precision = v;
    } else if (k == "--shared-casts") {
      TORCH_CHECK(v == "on" || v == "off", "--shared-casts must be on or off, got ", v);
      a.shared_casts = v == "on";
    } else if (k == "--use-fp8") {
      TORCH_CHECK(
          v == "on" || v == "off", "--use-fp8 must be on or off, got ", v);
      a.use_fp8 = v == "on";
    } else
      TORCH_CHECK(false, "unknown option ", k);
  }
  TORCH_CHECK(
      a.optimizer == "adamw" || a.optimizer == "fused_adamw" ||
          a.optimizer == "hybrid_adam",
      "--optimizer must be adamw, fused_adamw or hybrid_adam, got ",
      a.optimizer);
  TORCH_CHECK(
      a.loss == "logits" || a.loss == "fused",
      "--loss must be logits or fused, got ",
      a.loss);
  TORCH_CHECK(
      a.plugin == "none" || a.plugin == "zero1",
      "--plugin must be none or zero1, got ",
      a.plugin);
  TORCH_CHECK(
      !a.use_fp8 || a.plugin == "zero1",
      "--use-fp8 on is the plugin's use_fp8: it needs --plugin zero1");
  a.device = cbench::resolve_device(a.device);
  return a;
}

using cbench::sync;

using cbench::matmul_rates;
using cbench::seconds_since;

using cbench::peak_device_bytes;

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

std::shared_ptr<torch::optim::Optimizer> make_optimizer(
    const Args& a,
    const std::vector<at::Tensor>& params) {
  namespace copt = colossalai::nn::optimizer;
  const auto adamw = torch::optim::AdamWOptions(3e-4)
                         .betas({0.9, 0.999})
                         .eps(1e-8)
                         .weight_decay(0.01);
  if (a.optimizer == "fused_adamw") {
    return std::make_shared<copt::FusedAdamW>(params, adamw);
  }
  if (a.optimizer == "hybrid_adam") {
    return std::make_shared<copt::HybridAdam>(
        params, copt::HybridAdamOptions(3e-4).eps(1e-8).weight_decay(0.01));
  }
  return std::make_shared<torch::optim::AdamW>(params, adamw);
}

// What a device kernel's name says it does.
std::string kind_of(std::string name) {
  for (auto& ch : name)
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  auto has = [&](std::initializer_list<const char*> words) {
    for (const char* w : words)
      if (name.find(w) != std::string::npos)
        return true;
    return false;
  };
  if (has({"flash", "fmha", "attention", "sdpa", "cudnn_generated"}))
    return "attention";
  if (has({"gemm", "cutlass", "xmma", "gemv", "sm90_", "sm80_", "cublas", "nvjet"}))
    return "matmul";
  if (has({"adam"}))
    return "optimizer";
  if (has({"cross_entropy", "log_softmax", "nll_loss", "logsumexp", "grad_kernel", "softmax"}))
    return "loss";
  if (has({"layer_norm", "layernorm", "rms"}))
    return "norm";
  if (has({"gelu", "silu"}))
    return "activation";
  if (has({"copy", "memcpy", "memset", "fill", "cat"}))
    return "copy / fill";
  if (has({"reduce"}))
    return "reduction";
  return "elementwise / other";
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s.substr(0, 160)) {
    if (ch == '"' || ch == '\\')
      out += '\\';
    if (static_cast<unsigned char>(ch) >= 0x20)
      out += ch;
  }
  return out + "\"";
}

// Random ids [batch, t] and their next tokens, the same every run (seed 100).
std::pair<at::Tensor, at::Tensor> next_token_batch(
    int64_t vocab,
    int64_t batch,
    int64_t t,
    const at::Device& dev) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100);
  auto tokens = torch::randint(vocab, {batch, t + 1}, gen, torch::kLong);
  using torch::indexing::Slice;
  return {
      tokens.index({Slice(), Slice(0, -1)}).contiguous().to(dev),
      tokens.index({Slice(), Slice(1, torch::indexing::None)}).contiguous().to(dev)};
}

// Median milliseconds of a step's phases (Args::split_steps).
struct Split {
  double forward = 0, backward = 0, optimizer = 0;
};

// Boosts `model` as --plugin says and times --steps training steps of
// `loss_of(boosted)` after --warmup; returns each step's milliseconds.
template <class M, class LossOf>
std::vector<double> time_steps(
    const Args& a,
    M model,
    const LossOf& loss_of,
    double& last_loss,
    Split& split,
    std::string& kernels_json) {
  const at::Device dev(a.device);
  auto optimizer = make_optimizer(a, model->parameters());
  auto booster_options = cb::BoosterOptions().device(a.device);
  if (a.plugin == "zero1") {
    // One process: launch_from_env without a launcher's variables.
    colossalai::launch_from_env(colossalai::LaunchOptions().device(a.device));
    booster_options.plugin(std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions()
            .stage(1)
            .precision(a.precision)
            .use_fp8(a.use_fp8)));
  } else {
    booster_options.mixed_precision(a.precision);
  }
  cb::Booster booster(booster_options);
  auto boosted = booster.boost(model, optimizer);
  auto train_step = [&](const std::vector<at::Tensor>&) {
    boosted.optimizer->zero_grad();
    auto loss = loss_of(boosted);
    booster.backward(loss, *boosted.optimizer);
    boosted.optimizer->step();
    return loss;
  };
  std::optional<cb::GraphedStep> graphed;
  // The batch is the same every step (loss_of holds it): the graph reads
  // it where it is, and GraphedStep's one input is a placeholder.
  const std::vector<at::Tensor> placeholder{at::zeros({1}, at::TensorOptions().device(dev))};
  if (a.cuda_graph) {
    graphed.emplace(
        boosted.optimizer,
        train_step,
        cb::GraphedStepOptions().warmup(std::max(1, a.warmup)));
  }
  auto step = [&]() {
    sync(dev);
    auto t0 = std::chrono::steady_clock::now();
    auto loss = graphed ? (*graphed)(placeholder) : train_step(placeholder);
    sync(dev);
    double s = seconds_since(t0);
    last_loss = loss.template item<double>();
    return s;
  };
  // With a graph: its warm-up calls, then the capture and first replay.
  for (int i = 0; i < (graphed ? std::max(1, a.warmup) + 1 : a.warmup); ++i)
    step();
  std::vector<double> times;
  for (int i = 0; i < a.steps; ++i) {
    times.push_back(step() * 1e3);
    if ((i + 1) % 5 == 0)
      std::fprintf(stderr, "step %d/%d: %.1f ms\n", i + 1, a.steps, times.back());
  }
  // The same step with a synchronisation after each phase.
  std::vector<double> fwd, bwd, opt;
  for (int i = 0; i < (graphed ? 0 : a.split_steps); ++i) {
    sync(dev);
    auto t0 = std::chrono::steady_clock::now();
    boosted.optimizer->zero_grad();
    auto loss = loss_of(boosted);
    sync(dev);
    fwd.push_back(seconds_since(t0) * 1e3);
    t0 = std::chrono::steady_clock::now();
    booster.backward(loss, *boosted.optimizer);
    sync(dev);
    bwd.push_back(seconds_since(t0) * 1e3);
    t0 = std::chrono::steady_clock::now();
    boosted.optimizer->step();
    sync(dev);
    opt.push_back(seconds_since(t0) * 1e3);
  }
  if (a.split_steps > 0 && !graphed) {
    split = {cbench::median(fwd), cbench::median(bwd), cbench::median(opt)};
  }
#ifdef COLOSSALAI_BENCH_PROFILE
  if (a.profile > 0 && dev.is_cuda()) {
    namespace tp = torch::profiler::impl;
    namespace ap = torch::autograd::profiler;
    try {
      const tp::ProfilerConfig config(tp::ProfilerState::KINETO);
      const std::set<tp::ActivityType> activities{tp::ActivityType::CPU, tp::ActivityType::CUDA};
      ap::prepareProfiler(config, activities);
      ap::enableProfiler(config, activities);
      for (int i = 0; i < a.profile; ++i)
        step();
      const auto result = ap::disableProfiler();
      std::map<std::string, std::pair<double, int64_t>> by_name; // ms per step, calls
      std::map<std::string, double> by_kind;
      double total = 0;
      for (const auto& e : result->events()) {
        if (e.deviceType() != c10::DeviceType::CUDA)
          continue;
        const double ms = e.durationNs() * 1e-6 / a.profile;
        auto& slot = by_name[e.name()];
        slot.first += ms;
        slot.second += 1;
        by_kind[kind_of(e.name())] += ms;
        total += ms;
      }
      std::vector<std::pair<std::string, std::pair<double, int64_t>>> top(by_name.begin(), by_name.end());
      std::sort(top.begin(), top.end(), [](const auto& x, const auto& y) {
        return x.second.first > y.second.first;
      });
      std::ostringstream os;
      os << "{\"steps\": " << a.profile << ", \"device_ms_per_step\": " << total
         << ", \"by_kind\": {";
      bool first = true;
      for (const auto& kv : by_kind) {
        os << (first ? "" : ", ") << json_string(kv.first) << ": " << kv.second;
        first = false;
      }
      os << "}, \"top\": [";
      for (size_t i = 0; i < top.size() && i < 25; ++i) {
        os << (i ? ", " : "") << "{\"name\": " << json_string(top[i].first)
           << ", \"kind\": " << json_string(kind_of(top[i].first))
           << ", \"ms\": " << top[i].second.first
           << ", \"calls_per_step\": " << top[i].second.second / a.profile << "}";
      }
      // Which attention kernels ran (SDPA's backend: flash, memory-
      // efficient, cuDNN, or the math path's matmuls and softmax).
      os << "], \"attention_kernels\": [";
      bool first_attention = true;
      for (const auto& kv : by_name) {
        if (kind_of(kv.first) == "attention") {
          os << (first_attention ? "" : ", ") << json_string(kv.first);
          first_attention = false;
        }
      }
      os << "]}";
      kernels_json = os.str();
      std::fprintf(stderr, "profiled %d steps: %.2f ms of device kernels per step\n", a.profile, total);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "profiling failed (the timings stand): %s\n", e.what());
    }
  }
#endif
  return times;
}

int run(const Args& a) {
  const at::Device dev(a.device);
  colossalai::amp::set_shared_casts(a.shared_casts);
  const bool llama = a.model == "llama3.2-1b" || a.model == "llama-small-cpu";
  const bool gpt2_hf = a.model == "gpt2-medium-hf" || a.model == "gpt2-small-cpu-hf";
  TORCH_CHECK(
      a.model == "gpt2-medium" || a.model == "gpt-small-cpu" || gpt2_hf || llama,
      "--model must be gpt2-medium, gpt-small-cpu, gpt2-medium-hf, gpt2-small-cpu-hf, "
      "llama3.2-1b or llama-small-cpu, got ",
      a.model);
  const int64_t n = dev.is_cuda() ? a.matmul_n : std::min<int64_t>(a.matmul_n, 1024);

  std::fprintf(stderr, "measuring bf16 matmul rate (%lld^3)\n", (long long)n);
  auto rates = matmul_rates(dev, n);
  const double peak = cbench::median(rates);

  namespace compat = colossalai::compat;
  c10::optional<compat::SdpaKernelGuard> only_kernel;
  if (a.sdpa != "default") {
    const auto b = a.sdpa == "flash" ? compat::SdpaBackend::flash
        : a.sdpa == "cudnn"          ? compat::SdpaBackend::cudnn
        : a.sdpa == "efficient"      ? compat::SdpaBackend::efficient
                                     : compat::SdpaBackend::math;
    only_kernel.emplace(std::vector<compat::SdpaBackend>{b});
  }
  // The kernel ATen picks for causal attention of these heads (bf16; its
  // choice depends on whether a gradient is wanted, as in training).
  std::string sdpa_backend;
  auto attention_kernel = [&](int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t seq) {
    const auto o = at::device(dev).dtype(at::kBFloat16);
    auto like = [&](int64_t h) { return at::empty({a.batch, h, seq, head_dim}, o).requires_grad_(); };
    sdpa_backend = compat::sdpa_backend(like(heads), like(kv_heads), like(kv_heads), {}, true);
  };

  std::fprintf(stderr, "building %s\n", a.model.c_str());
  torch::manual_seed(0);
  double last_loss = 0;
  Split split;
  std::string kernels_json;
  std::vector<double> times;
  int64_t t = 0;
  int64_t params = 0;
  double flops_per_token = 0;
  if (llama) {
    const bool small = a.model == "llama-small-cpu";
    t = a.seq > 0 ? a.seq : small ? 128 : 2048;
    const auto cfg = small
        ? colossalai::models::LlamaConfig::small_cpu().max_position_embeddings(t)
        : cbench::llama_workload("llama-1b").max_position_embeddings(t);
    attention_kernel(
        cfg.num_attention_heads(), cfg.num_key_value_heads(), cfg.resolved_head_dim(), t);
    colossalai::models::LlamaForCausalLM model(cfg);
    model->to(dev);
    colossalai::models::set_mlp_activation_recompute(*model, a.recompute_mlp);
    for (const auto& p : model->parameters())
      params += p.numel();
    // Every parameter as a matmul's (the tied embedding is the head's
    // product; its lookup is the only non-matmul use) plus the attention
    // scores, PaLM's accounting.
    flops_per_token = 6.0 * static_cast<double>(params) +
        12.0 * cfg.num_hidden_layers() * cfg.hidden_size() * static_cast<double>(t);
    const auto xy = next_token_batch(cfg.vocab_size(), a.batch, t, dev);
    const at::Tensor& x = xy.first;
    const at::Tensor& y = xy.second;
    const auto flat_y = y.flatten();
    times = time_steps(
        a,
        model,
        [&](auto& boosted) {
          auto m = boosted.model.unwrap();
          if (a.loss == "logits")
            return m->loss(boosted.model(x), y);
          // Read each step: a plugin may have replaced the parameters.
          const auto head = cfg.tie_word_embeddings() ? m->model->embed_tokens->weight
                                                      : m->lm_head->weight;
          TORCH_CHECK(
              head.size(0) == cfg.vocab_size(),
              "--loss fused needs the head unpadded: ", head.size(0),
              " rows for a vocabulary of ", cfg.vocab_size());
          // The booster's autocast, which a call past its wrapper leaves out.
          c10::optional<colossalai::compat::AutocastGuard> cast;
          if (a.plugin == "none")
            cast.emplace(dev.type(), at::kBFloat16);
          return colossalai::kernels::fused_linear_cross_entropy(
              m->model->forward(x).flatten(0, 1), head, c10::nullopt, flat_y);
        },
        last_loss,
        split,
        kernels_json);
  } else if (gpt2_hf) {
    // transformers' GPT2Config for gpt2-medium, dropout off as in the zoo
    // GPT and the peer (bench/gpu/torch_gpt_step.py).
    const auto cfg = a.model == "gpt2-small-cpu-hf"
        ? colossalai::models::GPT2Config::small_cpu()
        : colossalai::models::GPT2Config()
              .n_embd(1024)
              .n_layer(24)
              .n_head(16)
              .embd_pdrop(0)
              .attn_pdrop(0)
              .resid_pdrop(0);
    t = cfg.n_positions();
    attention_kernel(cfg.n_head(), cfg.n_head(), cfg.n_embd() / cfg.n_head(), t);
    colossalai::models::GPT2LMHeadModel model(cfg);
    model->to(dev);
    colossalai::models::set_mlp_activation_recompute(*model, a.recompute_mlp);
    for (const auto& p : model->parameters())
      params += p.numel();
    // The tied token embedding is the head's matmul; positions are a lookup.
    flops_per_token = 6.0 * static_cast<double>(params - cfg.n_positions() * cfg.n_embd()) +
        12.0 * cfg.n_layer() * cfg.n_embd() * static_cast<double>(t);
    const auto xy = next_token_batch(cfg.vocab_size(), a.batch, t, dev);
    const at::Tensor& x = xy.first;
    const at::Tensor& y = xy.second;
    times = time_steps(
        a,
        model,
        [&](auto& boosted) {
          return a.loss == "fused" ? boosted.model.forward_loss(x, y)
                                   : boosted.model.unwrap()->loss(boosted.model(x), y);
        },
        last_loss,
        split,
        kernels_json);
  } else {
    auto cfg = a.model == "gpt2-medium"
        ? colossalai::zoo::GPTConfig::gpt2_medium()
        : colossalai::zoo::GPTConfig::small_cpu();
    cfg.recompute_gelu(a.recompute_mlp);
    t = cfg.block_size();
    attention_kernel(cfg.n_head(), cfg.n_head(), cfg.n_embd() / cfg.n_head(), t);
    colossalai::zoo::GPT model(cfg);
    model->to(dev);
    params = cfg.num_parameters();
    const int64_t embed = (cfg.vocab_size() + cfg.block_size()) * cfg.n_embd();
    flops_per_token = 6.0 * (params - embed) +
        12.0 * cfg.n_layer() * cfg.n_embd() * static_cast<double>(t);
    auto batch = colossalai::zoo::random_tokens(a.batch, cfg, 100);
    auto x = batch.first.to(dev), y = batch.second.to(dev);
    times = time_steps(
        a,
        model,
        [&](auto& boosted) {
          return a.loss == "fused" ? boosted.model(x, y)
                                   : colossalai::zoo::gpt_loss(boosted.model(x), y);
        },
        last_loss,
        split,
        kernels_json);
  }

  const double step_ms = cbench::median(times);
  const double tokens_per_s = a.batch * t / (step_ms * 1e-3);
  const double mfu = tokens_per_s * flops_per_token / peak;

  std::ostringstream json;
  json << "{\n  \"benchmark\": \"gpu_gpt_step\",\n  \"implementation\": "
       << "\"ours (C++, Booster " << a.precision << ", " << a.optimizer
       << ", loss " << a.loss << ", plugin " << a.plugin
       << (a.recompute_mlp ? ", MLP activation recomputed" : "")
       << (a.cuda_graph ? ", CUDA graph" : "")
       << (a.sdpa != "default" ? ", attention " + a.sdpa + " only"
                               : std::string())
       << (a.shared_casts ? "" : ", a cast per linear")
       << (a.use_fp8 ? ", FP8 linears" : "")
       << ")\",\n  \"recompute_mlp\": " << (a.recompute_mlp ? "true" : "false")
       << ",\n  \"use_fp8\": " << (a.use_fp8 ? "true" : "false")
       << ",\n  \"shared_casts\": " << (a.shared_casts ? "true" : "false")
       << ",\n  \"cuda_graph\": " << (a.cuda_graph ? "true" : "false")
       << ",\n  \"sdpa\": \"" << a.sdpa << "\",\n  \"sdpa_backend\": \""
       << sdpa_backend << "\""
       << ",\n  \"optimizer_kind\": \"" << a.optimizer
       << "\",\n  \"plugin\": \"" << a.plugin << "\",\n  \"loss_kind\": \""
       << a.loss << "\",\n  \"model\": \"" << a.model
       << "\",\n  \"parameters\": " << params
       << ",\n  \"config\": {\"device\": \"" << a.device
       << "\", \"batch\": " << a.batch << ", \"seq_len\": " << t
       << ", \"precision\": \""
       << (a.plugin == "zero1" ? a.precision + " parameters, fp32 masters"
                               : a.precision + " autocast, fp32 parameters")
       << (a.precision == "fp16" ? ", dynamic loss scaling" : "")
       << "\", \"optimizer\": "
       << "\"" << a.optimizer << "(3e-4, wd 0.01)\", \"steps\": " << a.steps
       << ", \"warmup\": " << a.warmup
       << "},\n  \"machine\": " << cbench::machine_json()
       << ",\n  \"device_name\": \"" << device_name(dev)
       << "\",\n  \"matmul\": {\"n\": " << n
       << ", \"bf16_flops_median\": " << peak << ", \"bf16_flops_max\": "
       << *std::max_element(rates.begin(), rates.end())
       << "},\n  \"flops_per_token\": " << flops_per_token
       << ",\n  \"step_ms\": " << cbench::stats_json(times)
       << ",\n  \"split_ms\": {\"steps\": "
       << (a.cuda_graph ? 0 : a.split_steps)
       << ", \"forward\": " << split.forward
       << ", \"backward\": " << split.backward
       << ", \"optimizer\": " << split.optimizer << "}"
       << (kernels_json.empty() ? "" : ",\n  \"kernels\": " + kernels_json)
       << ",\n  \"tokens_per_s\": " << tokens_per_s << ",\n  \"mfu\": " << mfu
       << ",\n  \"final_loss\": " << last_loss
       << ",\n  \"peak_device_bytes\": " << peak_device_bytes(dev)
       << ",\n  \"peak_rss_bytes\": " << cbench::peak_rss_bytes() << "\n}\n";
  std::cout << json.str();
  if (!a.out.empty())
    std::ofstream(a.out) << json.str();
  std::printf(
      "| %s | %s | %s | loss %s | plugin %s | step %.1f ms | %.0f tokens/s | "
      "MFU %.1f%% of %.1f TFLOP/s bf16 matmul |\n",
      a.model.c_str(),
      a.device.c_str(),
      a.optimizer.c_str(),
      a.loss.c_str(),
      a.plugin.c_str(),
      step_ms,
      tokens_per_s,
      100 * mfu,
      peak / 1e12);
  if (a.plugin == "zero1") {
    colossalai::destroy();
  }
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
