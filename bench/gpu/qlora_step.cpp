// QLoRA on one GPU at a 7B / 8B shape (llama3-8b, llama2-7b of
// BENCH_MODELS.md): a 4-bit NF4 frozen base (bf16 compute, no double
// quantization, as bench/gpu/qlora_peer.py configures bitsandbytes), LoRA
// adapters of rank --r on every attention and MLP projection, bf16 autocast
// through the Booster, FusedAdamW on the adapters, the fused causal-LM
// loss, every layer recomputed in backward (--checkpointing 1). The
// user's path: a lazily built model materialised on the device,
// booster.enable_lora(..., quantize=true), booster.boost.
//
// Model FLOPs per token: 4 (P - vocab x hidden) + 6 P_lora + 12 L H T (a
// frozen weight needs no weight gradient: its forward and input-gradient
// products only; P counted before quantization).
//
//   bench_gpu_qlora_step [--model llama3-8b|llama2-7b|llama-small-cpu]
//       [--layers N] [--seq 2048] [--batch 4] [--r 16] [--alpha 32]
//       [--checkpointing 1] [--steps 10] [--warmup 2] [--split-steps 3]
//       [--matmul-n 8192] [--generate 32] [--device cuda|cpu] [--out FILE.json]
//       [--shared-casts on|off]
//
// --generate N then times greedy generation of N tokens after a 16-token
// prompt (batch 1, KV cache, bf16 autocast) with the few-row products on
// the packed weight (gemv_max_rows 4) and with dequantize + matmul (0),
// alternating, two runs each: ms per token (prefill included); 0: none.
// --shared-casts off: under autocast each adapter casts its float32 input
// itself, instead of the adapters reading one input sharing one cast
// (amp::SharedCast; the default). The same results either way.

#include <colossalai/colossalai.h>

#include <colossalai/lazy/lazy_init.h>
#include <colossalai/lora/lora_model.h>
#include <colossalai/models/generation.h>
#include <colossalai/models/llama.h>
#include <colossalai/nn/optimizer/fused_adam.h>
#include <colossalai/quantization/bnb.h>
#include <colossalai/quantization/quantize_model.h>
#include <colossalai/utils/compat.h>

#include "../bench_util.h"
#include "../llama_workloads.h"
#include "device_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/torch.h>


#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

namespace cb = colossalai::booster;
namespace cbench = colossalai::bench;
namespace cl = colossalai::lora;
namespace cm = colossalai::models;
namespace q = colossalai::quantization;

namespace {

struct Args {
  std::string model = "llama3-8b", device, out;
  int64_t layers = 0, seq = 0, batch = 4, r = 16;
  double alpha = 32;
  bool checkpointing = true;
  int steps = 10, warmup = 2, split_steps = 3;
  int64_t matmul_n = 8192;
  int64_t generate = 32;
  bool shared_casts = true;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    TORCH_CHECK(i + 1 < argc, "option ", k, " needs a value");
    const std::string v = argv[++i];
    if (k == "--model") a.model = v;
    else if (k == "--layers") a.layers = std::stoll(v);
    else if (k == "--seq") a.seq = std::stoll(v);
    else if (k == "--batch") a.batch = std::stoll(v);
    else if (k == "--r") a.r = std::stoll(v);
    else if (k == "--alpha") a.alpha = std::stod(v);
    else if (k == "--checkpointing") a.checkpointing = v != "0";
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--warmup") a.warmup = std::stoi(v);
    else if (k == "--split-steps") a.split_steps = std::stoi(v);
    else if (k == "--matmul-n") a.matmul_n = std::stoll(v);
    else if (k == "--generate") a.generate = std::stoll(v);
    else if (k == "--device") a.device = v;
    else if (k == "--out") a.out = v;
    else if (k == "--shared-casts") {
      TORCH_CHECK(v == "on" || v == "off", "--shared-casts must be on or off, got ", v);
      a.shared_casts = v == "on";
    }
    else TORCH_CHECK(false, "unknown option ", k);
  }
  a.device = cbench::resolve_device(a.device);
  if (a.seq == 0)
    a.seq = a.model == "llama-small-cpu" ? 64 : 2048;
  return a;
}

using cbench::numel;

int run(const Args& a) {
  const at::Device dev(a.device);
  colossalai::amp::set_shared_casts(a.shared_casts);
  auto cfg = cbench::llama_workload(a.model).max_position_embeddings(a.seq);
  if (a.layers > 0)
    cfg.num_hidden_layers(a.layers);
  const double rate = cbench::median(
      cbench::matmul_rates(dev, dev.is_cuda() ? a.matmul_n : std::min<int64_t>(a.matmul_n, 512)));

  // Built lazily, each tensor computed straight on the device in float32
  // (the adapters take the base's dtype: float32, as PEFT's), then the
  // frozen projections quantized in place.
  torch::manual_seed(0);
  cm::LlamaForCausalLM model{nullptr};
  {
    colossalai::lazy::LazyInitContext context;
    model = cm::LlamaForCausalLM(cfg);
  }
  const int64_t params = numel(model->parameters());
  colossalai::lazy::materialize(
      *model, [&](const std::string&, const at::Tensor& t) { return t.to(dev); });
  if (a.checkpointing)
    model->parallel_state().gradient_checkpointing_ratio = 1.0;
  cb::Booster booster(cb::BoosterOptions().mixed_precision("bf16").device(a.device));
  const auto lora_config = cl::LoraConfig().r(a.r).lora_alpha(a.alpha).target_modules(
      {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"});
  const auto nf4 = q::BnbQuantizationConfig()
                       .load_in_4bit(true)
                       .bnb_4bit_quant_type("nf4")
                       .bnb_4bit_use_double_quant(false)
                       .bnb_4bit_compute_dtype(at::kBFloat16);
  cbench::sync(dev);
  const auto t_build = std::chrono::steady_clock::now();
  auto lora = booster.enable_lora(model, "", lora_config, nf4, /*quantize=*/true);
  cbench::sync(dev);
  const double quantize_s = cbench::seconds_since(t_build);
  const auto trainable = lora->trainable_parameters();
  const int64_t lora_params = numel(trainable);
  const auto footprint = q::quantized_footprint(*model);
  auto optimizer = std::make_shared<colossalai::nn::optimizer::FusedAdamW>(
      trainable, torch::optim::AdamWOptions(2e-4).weight_decay(0.0));
  auto boosted = booster.boost(model, optimizer);
  const int64_t build_peak = cbench::peak_device_bytes(dev);
  cbench::reset_peak_device_bytes(dev);

  auto gen = at::make_generator<at::CPUGeneratorImpl>(100);
  auto tokens = torch::randint(cfg.vocab_size(), {a.batch, a.seq + 1}, gen, torch::kLong);
  using torch::indexing::Slice;
  const auto x = tokens.index({Slice(), Slice(0, -1)}).contiguous().to(dev);
  const auto y = tokens.index({Slice(), Slice(1, torch::indexing::None)}).contiguous().to(dev);
  double first_loss = -1, last_loss = 0, fwd = 0, bwd = 0;
  auto step = [&](bool split) {
    cbench::sync(dev);
    const auto t0 = std::chrono::steady_clock::now();
    boosted.optimizer->zero_grad();
    auto loss = boosted.model.forward_loss(x, y);
    if (split) {
      cbench::sync(dev);
      fwd = cbench::seconds_since(t0);
    }
    booster.backward(loss, *boosted.optimizer);
    if (split) {
      cbench::sync(dev);
      bwd = cbench::seconds_since(t0) - fwd;
    }
    boosted.optimizer->step();
    cbench::sync(dev);
    last_loss = loss.template item<double>();
    if (first_loss < 0)
      first_loss = last_loss;
    return cbench::seconds_since(t0);
  };
  for (int i = 0; i < a.warmup; ++i)
    step(false);
  std::vector<double> times, f_ms, b_ms, o_ms;
  for (int i = 0; i < a.steps; ++i)
    times.push_back(step(false) * 1e3);
  for (int i = 0; i < a.split_steps; ++i) {
    const double total = step(true);
    f_ms.push_back(fwd * 1e3);
    b_ms.push_back(bwd * 1e3);
    o_ms.push_back((total - fwd - bwd) * 1e3);
  }
  const int64_t h = cfg.hidden_size();
  const double flops = 4.0 * static_cast<double>(params - cfg.vocab_size() * h) +
      6.0 * static_cast<double>(lora_params) +
      12.0 * static_cast<double>(cfg.num_hidden_layers()) * h * a.seq;
  const double step_ms = times.empty() ? 0 : cbench::median(times);
  const double tps = step_ms > 0 ? a.batch * a.seq / (step_ms * 1e-3) : 0;
  auto med = [](const std::vector<double>& v) { return v.empty() ? 0.0 : cbench::median(v); };

  // Greedy generation: the few-row products against dequantizing per step.
  std::vector<double> gen_ms[2];
  bool same_ids = true;
  if (a.generate > 0) {
    model->eval();
    const auto prompt = x.narrow(0, 0, 1).narrow(1, 0, std::min<int64_t>(16, a.seq));
    const auto gcfg = cm::GenerationConfig().max_new_tokens(a.generate).min_new_tokens(a.generate);
    const int64_t saved = q::gemv_max_rows();
    at::Tensor ids[2];
    for (int r = -1; r < 2; ++r) { // r = -1: warm-up
      for (int mode = 0; mode < 2; ++mode) {
        q::set_gemv_max_rows(mode == 0 ? 4 : 0);
        torch::NoGradGuard no_grad;
        colossalai::compat::AutocastGuard autocast(dev.type(), at::kBFloat16);
        cbench::sync(dev);
        const auto t0 = std::chrono::steady_clock::now();
        ids[mode] = cm::generate(model, prompt, at::Tensor(), gcfg);
        cbench::sync(dev);
        if (r >= 0)
          gen_ms[mode].push_back(cbench::seconds_since(t0) * 1e3 / a.generate);
      }
    }
    q::set_gemv_max_rows(saved);
    same_ids = at::equal(ids[0].cpu(), ids[1].cpu());
    model->train();
  }

  std::ostringstream j;
  j << "{\n  \"benchmark\": \"qlora_step\",\n  \"implementation\": \"ours (C++, NF4 base, LoRA r "
    << a.r << ", bf16 autocast, FusedAdamW, fused loss)\",\n  \"model\": \"" << a.model
    << "\",\n  \"parameters\": " << params << ",\n  \"trainable_parameters\": " << lora_params
    << ",\n  \"base\": \"nf4 (colossalai::quantization)\",\n  \"base_bytes\": "
    << footprint.data_bytes + footprint.state_bytes << ",\n  \"config\": {\"device\": \"" << a.device << "\", \"batch\": "
    << a.batch << ", \"seq_len\": " << a.seq << ", \"layers\": " << cfg.num_hidden_layers()
    << ", \"r\": " << a.r << ", \"alpha\": " << a.alpha << ", \"checkpointing\": "
    << (a.checkpointing ? "true" : "false") << ", \"shared_casts\": "
    << (a.shared_casts ? "true" : "false") << ", \"steps\": " << a.steps
    << ", \"warmup\": " << a.warmup << "},\n  \"machine\": " << cbench::machine_json()
    << ",\n  \"matmul\": {\"bf16_flops_median\": " << rate << "},\n  \"flops_per_token\": " << flops
    << ",\n  \"quantize_s\": " << quantize_s << ",\n  \"step_ms\": " << cbench::stats_json(times)
    << ",\n  \"split_ms\": {\"forward\": " << med(f_ms) << ", \"backward\": " << med(b_ms)
    << ", \"optimizer\": " << med(o_ms) << "},\n  \"tokens_per_s\": " << tps
    << ",\n  \"mfu_measured\": " << tps * flops / rate << ",\n  \"first_loss\": " << first_loss
    << ",\n  \"final_loss\": " << last_loss << ",\n  \"peak_device_bytes\": " << cbench::peak_device_bytes(dev)
    << ",\n  \"peak_device_bytes_build\": " << build_peak
    << ",\n  \"generate\": {\"new_tokens\": " << a.generate
    << ", \"fused_ms_per_token\": " << med(gen_ms[0])
    << ", \"dequantized_ms_per_token\": " << med(gen_ms[1])
    << ", \"same_ids\": " << (same_ids ? "true" : "false") << "}"
    << ",\n  \"peak_host_bytes\": " << cbench::peak_rss_bytes() << "\n}\n";
  std::cout << j.str();
  if (!a.out.empty())
    std::ofstream(a.out) << j.str();
  std::fprintf(
      stderr, "| %s | ours NF4 + LoRA r %lld | %.1f ms | %.0f tokens/s | MFU %.1f%% | %lld trainable |\n",
      a.model.c_str(), (long long)a.r, step_ms, tps, 100 * tps * flops / rate, (long long)lora_params);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const c10::OutOfMemoryError& e) {
    std::cerr << "error: out of memory: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
