// Full fine-tuning of a 7B-class LLaMA on one GPU (the llama2-7b and
// llama3-8b workloads of BENCH_MODELS.md): bf16 compute, fp32 masters and
// AdamW states where the plugin puts them, activation checkpointing, the
// fused causal-LM loss, HybridAdam (device step for device shards, the
// all-core CPU step for host shards). One process; the setups:
//   gemini_static  GeminiPlugin, static placement: the first
//                  --offload-optim-frac of the chunk bytes keep their fp32
//                  shard, gradient and AdamW states in host memory ("auto":
//                  the least share that leaves --activation-gb free on the
//                  device, by the formula below)
//   gemini_auto    GeminiPlugin, auto placement (every chunk's fp32 state on
//                  the host, parameter shards cached on the device; with
//                  --gpu-margin-mem-ratio R, chunks whose states fit in R
//                  of the device memory the first step finds spare move
//                  to the device, their steps with them)
//   zero2_offload  LowLevelZeroPlugin stage 2, cpu_offload (bf16 weights on
//                  the device; masters, gradients and states on the host)
//   zero2          LowLevelZeroPlugin stage 2, everything on the device
//
// Memory formulas of model data at rest (P parameters, f the host share of
// chunk bytes): gemini_static (1 - f) 14P (fp32 master, bf16 gradient: NOTE
// [Gradient shards in bf16], two fp32 AdamW moments) + f 2P (bf16 weights of
// host chunks) on the device, f 14P on the host; gemini_auto at most 2P and
// 14P (with M parameters' chunks moved into the margin: 2(P - M) + 14M and
// 14(P - M)); zero2_offload 2P (bf16 weights) and 14P; zero2 16P on the
// device. bf16 weights a module gathers
// while it computes, activations and the loss's chunks come on top. The run reports the allocator's peak and
// the engine's own accounting against them; --check-formula TOL exits 1
// when the engine's model state differs from the formula by more than TOL
// (the CPU smoke test's check).
//
// Model FLOPs per token: 6 (P - vocab x hidden) + 12 L H T (the input
// embedding is a lookup, the untied head a matmul); with the recomputed
// forward of checkpointed layers, + 2 P_layers + 4 L H T.
//
//   bench_gpu_scale_step [--model llama2-7b|llama3-8b|llama-small-cpu]
//       [--layers N] [--vocab V] [--seq 4096] [--batch 1] [--setup gemini_static]
//       [--offload-optim-frac auto|F] [--activation-gb 16] [--gpu-margin-mem-ratio 0]
//       [--chunk-size-m 0] [--checkpointing 1] [--overlap-host-step 0]
//       [--steps 5] [--warmup 2]
//       [--split-steps 2] [--matmul-n 8192] [--device cuda|cpu]
//       [--check-formula TOL] [--out FILE.json]

#include <colossalai/colossalai.h>

#include <colossalai/lazy/lazy_init.h>
#include <colossalai/models/llama.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>

#include "../bench_util.h"
#include "device_util.h"
#include "../llama_workloads.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#ifdef COLOSSALAI_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

namespace cb = colossalai::booster;
namespace cbench = colossalai::bench;
namespace cm = colossalai::models;
namespace cz = colossalai::zero;

namespace {

struct Args {
  std::string model = "llama2-7b";
  int64_t layers = 0;
  int64_t vocab = 0;
  int64_t seq = 0;
  int64_t batch = 1;
  std::string setup = "gemini_static";
  std::string offload_frac = "auto";
  double activation_gb = 16;
  double margin_ratio = 0; // gemini_auto's gpu_margin_mem_ratio
  double chunk_size_m = 0;
  bool checkpointing = true;
  bool overlap_host_step = false;
  int steps = 5;
  int warmup = 2;
  int split_steps = 2;
  int64_t matmul_n = 8192;
  std::string device;
  double check_formula = -1;
  std::string out;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    TORCH_CHECK(i + 1 < argc, "option ", k, " needs a value");
    const std::string v = argv[++i];
    if (k == "--model") a.model = v;
    else if (k == "--layers") a.layers = std::stoll(v);
    else if (k == "--vocab") a.vocab = std::stoll(v);
    else if (k == "--seq") a.seq = std::stoll(v);
    else if (k == "--batch") a.batch = std::stoll(v);
    else if (k == "--setup") a.setup = v;
    else if (k == "--offload-optim-frac") a.offload_frac = v;
    else if (k == "--activation-gb") a.activation_gb = std::stod(v);
    else if (k == "--gpu-margin-mem-ratio") a.margin_ratio = std::stod(v);
    else if (k == "--chunk-size-m") a.chunk_size_m = std::stod(v);
    else if (k == "--checkpointing") a.checkpointing = v != "0";
    else if (k == "--overlap-host-step") a.overlap_host_step = v != "0";
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--warmup") a.warmup = std::stoi(v);
    else if (k == "--split-steps") a.split_steps = std::stoi(v);
    else if (k == "--matmul-n") a.matmul_n = std::stoll(v);
    else if (k == "--device") a.device = v;
    else if (k == "--check-formula") a.check_formula = std::stod(v);
    else if (k == "--out") a.out = v;
    else TORCH_CHECK(false, "unknown option ", k);
  }
  TORCH_CHECK(
      a.setup == "gemini_static" || a.setup == "gemini_auto" ||
          a.setup == "zero2_offload" || a.setup == "zero2",
      "--setup must be gemini_static, gemini_auto, zero2_offload or zero2, got ", a.setup);
  a.device = cbench::resolve_device(a.device);
  if (a.seq == 0)
    a.seq = a.model == "llama-small-cpu" ? 128 : 4096;
  return a;
}

using cbench::seconds_since;

int64_t device_capacity(const at::Device& dev) {
#ifdef COLOSSALAI_WITH_CUDA
  if (dev.is_cuda()) {
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) == cudaSuccess)
      return static_cast<int64_t>(total);
  }
#endif
  (void)dev;
  return 0;
}

struct Shape {
  cm::LlamaConfig cfg;
  int64_t params = 0, layer_params = 0;
  double flops = 0, flops_recompute = 0; // per token
};

// Counted on a lazy (meta) build of the model: no memory.
Shape shape_of(const Args& a) {
  Shape s;
  s.cfg = cbench::llama_workload(a.model).max_position_embeddings(a.seq);
  if (a.layers > 0)
    s.cfg.num_hidden_layers(a.layers);
  if (a.vocab > 0)
    s.cfg.vocab_size(a.vocab);
  const auto& c = s.cfg;
  {
    colossalai::lazy::LazyInitContext context;
    cm::LlamaForCausalLM m(c);
    s.params = cbench::numel(m->parameters());
    s.layer_params = cbench::numel(m->model->layers[0]->parameters());
  }
  const int64_t h = c.hidden_size(), embed = c.vocab_size() * h;
  const double lht = static_cast<double>(c.num_hidden_layers()) * h * a.seq;
  s.flops = 6.0 * static_cast<double>(s.params - embed) + 12.0 * lht;
  s.flops_recompute = s.flops +
      (a.checkpointing ? 2.0 * c.num_hidden_layers() * s.layer_params + 4.0 * lht : 0.0);
  return s;
}

// The host share of chunk bytes that leaves --activation-gb of the device
// free (gathered weights and activations): (1 - f) 14P + f 2P <= capacity
// - activations.
double auto_offload_frac(const Args& a, const Shape& s, int64_t capacity) {
  if (a.offload_frac != "auto")
    return std::stod(a.offload_frac);
  if (capacity <= 0)
    return 0.5; // no device to fit: half, to exercise both tiers
  const double p = static_cast<double>(s.params);
  const double room = static_cast<double>(capacity) - a.activation_gb * (1 << 30);
  const double f = (14 * p - room) / (12 * p);
  return std::min(1.0, std::max(0.0, std::ceil(f * 100) / 100));
}

struct Formula {
  double device = 0, host = 0; // model data, bytes
};

// At rest after a step. Gemini gathers bf16 weights only while a module
// computes (not counted); a host-tier chunk keeps a bf16 copy of its
// weights on the device.
Formula formula(const std::string& setup, double p, double f) {
  if (setup == "zero2_offload")
    return {2 * p, 14 * p};
  if (setup == "zero2")
    return {16 * p, 0};
  if (setup == "gemini_auto")
    return {2 * p, 14 * p}; // every fp32 state on the host, weights cached
  return {(1 - f) * 14 * p + f * 2 * p, f * 14 * p};
}

// The setup as the report names it: the overlapped host step is a setup of
// its own.
std::string setup_name(const Args& a) {
  return a.setup + (a.overlap_host_step ? "_overlap" : "");
}

// What a run that does not fit writes: the setup, the reason, no timings.
int does_not_fit(const Args& a, const Shape& s, const Formula& want, const std::string& why) {
  std::ostringstream j;
  j << "{\n  \"benchmark\": \"scale_step\",\n  \"model\": \"" << a.model
    << "\",\n  \"parameters\": " << s.params << ",\n  \"plugin\": \"" << setup_name(a)
    << "\",\n  \"error\": \"does not fit: " << why << "\",\n  \"tokens_per_s\": null"
    << ",\n  \"formula\": {\"device_model_bytes\": " << want.device
    << ", \"host_model_bytes\": " << want.host << "}\n}\n";
  std::cout << j.str();
  if (!a.out.empty())
    std::ofstream(a.out) << j.str();
  std::fprintf(stderr, "| %s | %s | does not fit: %s |\n", a.model.c_str(), a.setup.c_str(), why.c_str());
  return 0;
}

std::string gib(double bytes) {
  std::ostringstream os;
  os.precision(1);
  os << std::fixed << bytes / (1 << 30) << " GiB";
  return os.str();
}

std::string num(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

int train(const Args& a, const Shape& s, Formula want, double frac, int64_t capacity);

int run(const Args& a) {
  const at::Device dev(a.device);
  const auto s = shape_of(a);
  const int64_t capacity = device_capacity(dev);
  const double frac = a.setup == "gemini_static" ? auto_offload_frac(a, s, capacity) : 0.0;
  auto want = formula(a.setup, static_cast<double>(s.params), frac);
  if (a.setup == "gemini_auto" && a.margin_ratio > 0 && capacity > 0) {
    // Expected before the run: the margin as the engine will measure it
    // (steady_cuda_cap_ratio 0.9, --activation-gb of non-model memory),
    // that share of it in chunks of 14 bytes a parameter. Every fp32 shard
    // and bf16 gradient is on the host until the first step moves some (6P).
    const double p = static_cast<double>(s.params);
    const double margin = 0.9 * static_cast<double>(capacity) - a.activation_gb * (1 << 30);
    const double moved = std::clamp(a.margin_ratio * margin / 14, 0.0, p);
    want = {2 * (p - moved) + 14 * moved, std::max(6 * p, 14 * (p - moved))};
  }
  std::fprintf(
      stderr, "%s: %lld layers, %.3f B parameters, seq %lld x batch %lld, %s (host share %.2f)\n",
      a.model.c_str(), (long long)s.cfg.num_hidden_layers(), s.params / 1e9,
      (long long)a.seq, (long long)a.batch, a.setup.c_str(), frac);
  // The host tier must fit beside the process (the OOM killer is no
  // report); the device's excess shows as an out-of-memory error below.
  const double available = static_cast<double>(cbench::proc_kb("/proc/meminfo", "MemAvailable:"));
  if (available > 0 && want.host > 0.95 * available)
    return does_not_fit(
        a, s, want, "the host tier needs " + gib(want.host) + ", MemAvailable is " + gib(available));
  if (capacity > 0 && want.device > 0.95 * static_cast<double>(capacity))
    return does_not_fit(
        a, s, want, "the device tier needs " + gib(want.device) + " of " + gib(static_cast<double>(capacity)));
  // Everything on the device: the activations and the loss's chunks too
  // (an 8B model's 16P leaves too little beside them; reported without
  // loading it only to run out of memory).
  const double activations = a.activation_gb * (1 << 30);
  if (a.setup == "zero2" && capacity > 0 &&
      want.device + activations > 0.95 * static_cast<double>(capacity))
    return does_not_fit(
        a, s, want,
        "the model state needs " + gib(want.device) + " and --activation-gb " + gib(activations) +
            " of " + gib(static_cast<double>(capacity)));
  try {
    return train(a, s, want, frac, capacity);
  } catch (const c10::OutOfMemoryError& e) {
    std::string msg = e.what_without_backtrace();
    msg = msg.substr(0, std::min<size_t>(msg.find('\n'), 300));
    for (auto& ch : msg)
      ch = ch == '"' || ch == '\\' ? '\'' : ch;
    return does_not_fit(a, s, want, "out of memory: " + msg);
  }
}

int train(const Args& a, const Shape& s, Formula want, double frac, int64_t capacity) {
  const at::Device dev(a.device);
  const double peak_rate =
      cbench::median(cbench::matmul_rates(dev, dev.is_cuda() ? a.matmul_n : std::min<int64_t>(a.matmul_n, 512)));

  colossalai::launch_from_env(colossalai::LaunchOptions().device(a.device));
  std::shared_ptr<cb::plugin::Plugin> plugin;
  if (a.setup.rfind("gemini", 0) == 0) {
    auto o = cb::plugin::GeminiPluginOptions().precision("bf16");
    if (a.chunk_size_m > 0)
      o.chunk_size(static_cast<int64_t>(a.chunk_size_m * 1024 * 1024));
    if (a.setup == "gemini_auto")
      o.placement_policy("auto").gpu_margin_mem_ratio(a.margin_ratio);
    else
      o.offload_optim_frac(frac);
    o.overlap_host_step(a.overlap_host_step);
    plugin = std::make_shared<cb::plugin::GeminiPlugin>(o);
  } else {
    plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions()
            .stage(2)
            .precision("bf16")
            .cpu_offload(a.setup == "zero2_offload")
            .overlap_host_step(a.overlap_host_step));
  }
  cb::Booster booster(cb::BoosterOptions().plugin(plugin).device(a.device));

  // Lazily built: Gemini materialises each tensor into its chunk; ZeRO gets
  // each tensor on the device as it is computed. The host never holds the
  // float32 model.
  torch::manual_seed(0);
  cm::LlamaForCausalLM model{nullptr};
  {
    colossalai::lazy::LazyInitContext context;
    model = cm::LlamaForCausalLM(s.cfg);
  }
  if (a.setup.rfind("zero2", 0) == 0)
    colossalai::lazy::materialize(
        *model, [&](const std::string&, const at::Tensor& t) { return t.to(dev); });
  auto optimizer = std::make_shared<colossalai::nn::optimizer::HybridAdam>(
      model->parameters(),
      colossalai::nn::optimizer::HybridAdamOptions(3e-4).eps(1e-8).weight_decay(0.01));
  auto t_boost = std::chrono::steady_clock::now();
  auto boosted = booster.boost(model, optimizer);
  const double boost_s = seconds_since(t_boost);
  model->parallel_state().gradient_checkpointing_ratio = a.checkpointing ? 1.0 : 0.0;
  auto* fsdp = colossalai::interface::find_wrapper<cz::FullyShardedModel>(*boosted.model.wrapper());
  auto* zero = dynamic_cast<cz::LowLevelZeroOptimizer*>(boosted.optimizer.get());

  auto gen = at::make_generator<at::CPUGeneratorImpl>(100);
  auto tokens = torch::randint(s.cfg.vocab_size(), {a.batch, a.seq + 1}, gen, torch::kLong);
  using torch::indexing::Slice;
  const auto x = tokens.index({Slice(), Slice(0, -1)}).contiguous().to(dev);
  const auto y = tokens.index({Slice(), Slice(1, torch::indexing::None)}).contiguous().to(dev);

  double fwd = 0, bwd = 0, opt = 0, first_loss = -1, last_loss = 0;
  auto step = [&](bool split) {
    cbench::sync(dev);
    auto t0 = std::chrono::steady_clock::now();
    boosted.optimizer->zero_grad();
    auto loss = boosted.model.forward_loss(x, y);
    if (split) {
      cbench::sync(dev);
      fwd = seconds_since(t0);
    }
    booster.backward(loss, *boosted.optimizer);
    if (split) {
      cbench::sync(dev);
      bwd = seconds_since(t0) - fwd;
    }
    boosted.optimizer->step();
    cbench::sync(dev);
    const double total = seconds_since(t0);
    opt = total - fwd - bwd;
    last_loss = loss.template item<double>();
    if (first_loss < 0)
      first_loss = last_loss;
    return total;
  };
  for (int i = 0; i < a.warmup; ++i) {
    const double took = step(false);
    std::fprintf(stderr, "warm-up step %d: %.1f s, loss %.4f\n", i, took, last_loss);
  }
  cz::PlacementStats before;
  if (fsdp != nullptr)
    before = fsdp->placement_stats();
  std::vector<double> times;
  for (int i = 0; i < a.steps; ++i) {
    times.push_back(step(false) * 1e3);
    std::fprintf(stderr, "step %d: %.1f ms, loss %.4f\n", i, times.back(), last_loss);
  }
  // Flat groups (chunks, buckets) whose host masters reached the device
  // during the host step (NOTE [Publishing during the host step]).
  const auto* sharded = dynamic_cast<const cz::ShardedOptimizer*>(boosted.optimizer.get());
  const int64_t published = sharded != nullptr ? sharded->groups_published_during_step() : -1;
  // ... and those updated during the backward (NOTE [Host steps overlap the
  // backward]).
  const int64_t ahead = sharded != nullptr ? sharded->groups_stepped_ahead() : -1;
  int64_t h2d = -1, d2h = -1;
  if (fsdp != nullptr && a.steps > 0) {
    const auto after = fsdp->placement_stats();
    h2d = (after.host_to_device - before.host_to_device) / a.steps;
    d2h = (after.device_to_host - before.device_to_host) / a.steps;
  }
  std::vector<double> f_ms, b_ms, o_ms;
  for (int i = 0; i < a.split_steps; ++i) {
    step(true);
    f_ms.push_back(fwd * 1e3);
    b_ms.push_back(bwd * 1e3);
    o_ms.push_back(opt * 1e3);
  }

  // The engine's accounting of model state, at rest after a step.
  double engine_device = -1, engine_total = -1;
  std::string margin_json = "null";
  if (fsdp != nullptr) {
    const auto m = fsdp->memory_stats();
    engine_total = static_cast<double>(m.total());
    const auto p = fsdp->placement_stats();
    engine_device = static_cast<double>(p.device_model);
    if (p.margin_units > 0) { // the chunks moved into the device margin
      const double moved = static_cast<double>(p.margin_shard_bytes) / 4;
      const double rest = static_cast<double>(s.params) - moved;
      want = {2 * rest + 14 * moved, 14 * rest};
      margin_json = c10::str(
          "{\"ratio\": ", a.margin_ratio, ", \"margin_bytes\": ", p.device_margin,
          ", \"chunks\": ", p.margin_units, ", \"parameters\": ", moved, "}");
    }
  } else if (zero != nullptr) {
    const auto m = zero->memory_stats();
    engine_total = static_cast<double>(m.working_params + m.gradients + m.master_weights + m.optimizer_states);
    engine_device = a.setup == "zero2_offload" ? static_cast<double>(m.working_params) : engine_total;
  }
  const double want_total = want.device + want.host;
  const double step_ms = times.empty() ? 0 : cbench::median(times);
  const double tokens_per_s = step_ms > 0 ? a.batch * a.seq / (step_ms * 1e-3) : 0;
  const double spec = 989e12; // H100 / H200 SXM dense bf16

  std::ostringstream j;
  const std::string setup = setup_name(a);
  j << "{\n  \"benchmark\": \"scale_step\",\n  \"implementation\": \"ours (C++, " << setup
    << ", HybridAdam, fused loss)\",\n  \"model\": \"" << a.model << "\",\n  \"parameters\": " << s.params
    << ",\n  \"plugin\": \"" << setup << "\",\n  \"config\": {\"device\": \"" << a.device
    << "\", \"batch\": " << a.batch << ", \"seq_len\": " << a.seq << ", \"layers\": "
    << s.cfg.num_hidden_layers() << ", \"checkpointing\": " << (a.checkpointing ? "true" : "false")
    << ", \"offload_optim_frac\": " << frac
    << ", \"overlap_host_step\": " << (a.overlap_host_step ? "true" : "false") << ", \"precision\": \"bf16 parameters, fp32 masters\""
    << ", \"optimizer\": \"HybridAdam(3e-4, wd 0.01)\", \"steps\": " << a.steps
    << ", \"warmup\": " << a.warmup << ", \"host_threads\": " << at::get_num_threads()
    << "},\n  \"machine\": " << cbench::machine_json() << ",\n  \"matmul\": {\"n\": "
    << (dev.is_cuda() ? a.matmul_n : std::min<int64_t>(a.matmul_n, 512))
    << ", \"bf16_flops_median\": " << peak_rate << "},\n  \"flops_per_token\": " << s.flops
    << ",\n  \"flops_per_token_with_recompute\": " << s.flops_recompute
    << ",\n  \"boost_s\": " << boost_s << ",\n  \"step_ms\": " << cbench::stats_json(times)
    << ",\n  \"split_ms\": {\"steps\": " << a.split_steps << ", \"forward\": "
    << (f_ms.empty() ? 0 : cbench::median(f_ms)) << ", \"backward\": "
    << (b_ms.empty() ? 0 : cbench::median(b_ms)) << ", \"optimizer\": "
    << (o_ms.empty() ? 0 : cbench::median(o_ms)) << "},\n  \"copies_per_step\": {\"host_to_device_bytes\": "
    << h2d << ", \"device_to_host_bytes\": " << d2h
    << ", \"groups_published_during_step\": " << published
    << ", \"groups_stepped_ahead\": " << ahead << "},\n  \"tokens_per_s\": " << tokens_per_s
    << ",\n  \"mfu_measured\": " << tokens_per_s * s.flops / peak_rate
    << ",\n  \"mfu_measured_with_recompute\": " << tokens_per_s * s.flops_recompute / peak_rate
    << ",\n  \"mfu_spec\": " << tokens_per_s * s.flops / spec
    << ",\n  \"first_loss\": " << first_loss << ",\n  \"final_loss\": " << last_loss
    << ",\n  \"peak_device_bytes\": " << cbench::peak_device_bytes(dev)
    << ",\n  \"peak_host_bytes\": " << cbench::peak_rss_bytes()
    << ",\n  \"device_capacity_bytes\": " << capacity
    << ",\n  \"device_margin\": " << margin_json
    << ",\n  \"formula\": {\"device_model_bytes\": " << num(want.device)
    << ", \"host_model_bytes\": " << num(want.host) << "},\n  \"engine\": {\"device_model_bytes\": "
    << num(engine_device) << ", \"model_state_bytes\": " << num(engine_total) << "}\n}\n";
  std::cout << j.str();
  if (!a.out.empty())
    std::ofstream(a.out) << j.str();
  std::fprintf(
      stderr, "| %s | %s | %.0f ms | %.0f tokens/s | MFU %.1f%% (%.1f%% with recompute) of %.0f TFLOP/s |\n",
      a.model.c_str(), a.setup.c_str(), step_ms, tokens_per_s, 100 * tokens_per_s * s.flops / peak_rate,
      100 * tokens_per_s * s.flops_recompute / peak_rate, peak_rate / 1e12);
  int rc = 0;
  if (a.check_formula >= 0) {
    const double off = std::abs(engine_total - want_total) / want_total;
    std::fprintf(stderr, "model state: engine %.0f bytes, formula %.0f (%.1f%% off, %.1f%% allowed)\n",
                 engine_total, want_total, 100 * off, 100 * a.check_formula);
    rc = off <= a.check_formula ? 0 : 1;
  }
  colossalai::destroy();
  return rc;
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
