// QLoRA, one process, 1 thread: bytes per quantized base parameter (4-bit
// NF4 / FP4, with and without double quantization, and 8-bit) beside their
// formulas, and the forward and training-step time of a LLaMA-shaped model
// with LoRA adapters on an fp32, bf16, 4-bit or 8-bit frozen base, plus the
// 4-bit dequantizer alone, and a few rows (a generation step's tokens)
// through one quantized layer, fused against dequantize + matmul, and
// greedy generation with and without the fused products. NOTE
// [QLoRA in C++] says how the layers run.
//
// bench_qlora [--rounds R] [--steps S] [--warmup W] [--hidden H]
//             [--intermediate I] [--layers L] [--heads N] [--vocab V]
//             [--batch B] [--seq T] [--r RANK] [--dq-reps K]
//             [--gemv-reps K] [--threads N]
//             [--out FILE.json]

#include <colossalai/lora/lora_model.h>
#include <colossalai/models/generation.h>
#include <colossalai/models/llama.h>
#include <colossalai/quantization/bnb.h>
#include <colossalai/quantization/quantize_model.h>
#include <colossalai/quantization/quantized_weight.h>
#include <colossalai/shardformer/layer/linear.h>

#include "bench_util.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <utility>

namespace {

namespace cl = colossalai::lora;
namespace models = colossalai::models;
namespace q = colossalai::quantization;
namespace sl = colossalai::shardformer::layer;
using colossalai::bench::median;
using colossalai::bench::stats_json;

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// [out, in] of every quantized layer, in model order.
std::vector<std::pair<int64_t, int64_t>> quantized_shapes(
    torch::nn::Module& model) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    std::shared_ptr<q::QuantizedWeight> w;
    if (auto col = std::dynamic_pointer_cast<sl::Linear1D_ColImpl>(m)) {
      w = col->quantized;
    } else if (auto row = std::dynamic_pointer_cast<sl::Linear1D_RowImpl>(m)) {
      w = row->quantized;
    }
    if (w != nullptr) {
      out.emplace_back(w->shape()[0], w->shape()[1]);
    }
  }
  return out;
}

// Bytes a layer of N = out * in weights takes, as bnb.cpp stores it:
//   4-bit:        N/2 codes + 4 B absmax per block of 64 + the 16-entry
//                 fp32 code table (64 B);
//   4-bit + DQ:   N/2 + 1 B absmax code per block of 64 + 4 B per block of
//                 256 absmax values + 4 B offset + the 256-entry fp32 map
//                 (1 KiB) + the 16-entry table (64 B);
//   8-bit:        N int8 + 4 B row absmax per output row.
// The tables are per layer, so they are counted once per layer too.
int64_t formula_bytes(
    const q::BnbQuantizationConfig& c,
    int64_t out,
    int64_t in,
    bool with_tables) {
  const int64_t n = out * in;
  if (!c.load_in_4bit()) {
    return n + 4 * out;
  }
  const int64_t blocks = ceil_div(n, 64);
  int64_t b = ceil_div(n, 2);
  if (c.bnb_4bit_use_double_quant()) {
    b += blocks + 4 * ceil_div(blocks, 256) + 4 + (with_tables ? 1024 : 0);
  } else {
    b += 4 * blocks;
  }
  return b + (with_tables ? 64 : 0);
}

// The large-layer limit of formula_bytes / N.
double asymptotic_bytes_per_param(
    const q::BnbQuantizationConfig& c,
    const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  if (c.load_in_4bit()) {
    return c.bnb_4bit_use_double_quant() ? 0.5 + 1.0 / 64 + 4.0 / (64 * 256)
                                         : 0.5 + 4.0 / 64;
  }
  // 1 + 4 / in per layer, weighted by the layers' sizes.
  int64_t n = 0, rows = 0;
  for (const auto& s : shapes) {
    n += s.first * s.second;
    rows += s.first;
  }
  return 1.0 + 4.0 * rows / n;
}

int64_t module_bytes(torch::nn::Module& m) {
  auto ts = m.parameters();
  for (const auto& b : m.buffers()) {
    ts.push_back(b);
  }
  return colossalai::bench::tensor_bytes(ts);
}

// One model with adapters: forward and training step on fixed tokens.
struct Setup {
  std::string name;
  models::LlamaForCausalLM model{nullptr};
  std::shared_ptr<cl::LoraModel> lora;
  std::shared_ptr<torch::optim::AdamW> opt;
  int64_t trainable = 0, model_bytes = 0;
  std::vector<double> forward_ms, step_ms;
};

models::LlamaForCausalLM build(
    const models::LlamaConfig& config,
    const cl::LoraConfig& lora_config,
    const q::BnbQuantizationConfig* quant,
    std::shared_ptr<cl::LoraModel>* lora) {
  // The same seed: every setup starts from the same weights and adapters.
  torch::manual_seed(1);
  models::LlamaForCausalLM model(config);
  // Adapters first, then quantize: LoRA attaches to the full-precision
  // layers, and quantize_model then replaces only their frozen weights.
  *lora = std::make_shared<cl::LoraModel>(model.ptr(), lora_config);
  if (quant != nullptr) {
    q::quantize_model(*model, *quant);
  }
  return model;
}

Setup make(
    const std::string& name,
    const models::LlamaConfig& config,
    const cl::LoraConfig& lora_config,
    const q::BnbQuantizationConfig* quant,
    at::ScalarType dtype) {
  Setup s;
  s.name = name;
  s.model = build(config, lora_config, quant, &s.lora);
  if (dtype != at::kFloat) {
    // Adapters, norms, embeddings and head too, as a bf16 plugin casts.
    s.model->to(dtype);
  }
  const auto params = s.lora->trainable_parameters();
  for (const auto& p : params) {
    s.trainable += p.numel();
  }
  s.model_bytes =
      module_bytes(*s.model) + q::quantized_footprint(*s.model).state_bytes;
  s.opt = std::make_shared<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  return s;
}

} // namespace

int main(int argc, char** argv) {
  int rounds = 3, steps = 2, warmup = 1, dq_reps = 10, gemv_reps = 20,
      threads = 1;
  int64_t hidden = 1024, intermediate = 2816, layers = 4, heads = 16,
          vocab = 4096, batch = 4, seq = 128, rank = 8;
  std::string out;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rounds") {
      rounds = std::stoi(v);
    } else if (k == "--steps") {
      steps = std::stoi(v);
    } else if (k == "--warmup") {
      warmup = std::stoi(v);
    } else if (k == "--hidden") {
      hidden = std::stoll(v);
    } else if (k == "--intermediate") {
      intermediate = std::stoll(v);
    } else if (k == "--layers") {
      layers = std::stoll(v);
    } else if (k == "--heads") {
      heads = std::stoll(v);
    } else if (k == "--vocab") {
      vocab = std::stoll(v);
    } else if (k == "--batch") {
      batch = std::stoll(v);
    } else if (k == "--seq") {
      seq = std::stoll(v);
    } else if (k == "--r") {
      rank = std::stoll(v);
    } else if (k == "--dq-reps") {
      dq_reps = std::stoi(v);
    } else if (k == "--gemv-reps") {
      gemv_reps = std::stoi(v);
    } else if (k == "--threads") {
      threads = std::stoi(v);
    } else if (k == "--out") {
      out = v;
    } else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  at::set_num_threads(threads);
  const auto config = models::LlamaConfig()
                          .vocab_size(vocab)
                          .hidden_size(hidden)
                          .intermediate_size(intermediate)
                          .num_hidden_layers(layers)
                          .num_attention_heads(heads)
                          .num_key_value_heads(heads)
                          .max_position_embeddings(seq);
  const auto lora_config = cl::LoraConfig()
                               .r(rank)
                               .lora_alpha(2.0 * rank)
                               .target_modules(
                                   {"q_proj",
                                    "k_proj",
                                    "v_proj",
                                    "o_proj",
                                    "gate_proj",
                                    "up_proj",
                                    "down_proj"});
  const auto nf4 =
      q::BnbQuantizationConfig().load_in_4bit(true).bnb_4bit_quant_type("nf4");
  const auto nf4_dq =
      q::BnbQuantizationConfig(nf4).bnb_4bit_use_double_quant(true);
  const auto fp4 =
      q::BnbQuantizationConfig().load_in_4bit(true).bnb_4bit_quant_type("fp4");
  const auto int8 = q::BnbQuantizationConfig().load_in_8bit(true);
  const auto nf4_bf16 =
      q::BnbQuantizationConfig(nf4).bnb_4bit_compute_dtype(at::kBFloat16);

  std::ostringstream js;
  // Bytes per parameter differ from the formulas' limits in the 4th digit.
  js.precision(10);
  js << "{\n  \"machine\": " << colossalai::bench::machine_json()
     << ",\n  \"threads\": " << threads << ", \"vocab\": " << vocab
     << ", \"hidden\": " << hidden << ", \"intermediate\": " << intermediate
     << ", \"layers\": " << layers << ", \"heads\": " << heads
     << ", \"batch\": " << batch << ", \"seq\": " << seq << ", \"r\": " << rank
     << ", \"rounds\": " << rounds << ", \"steps\": " << steps
     << ", \"warmup\": " << warmup << ",\n";

  // ---- 1. memory: bytes per quantized base parameter ----------------------
  const std::vector<std::pair<std::string, q::BnbQuantizationConfig>> kinds = {
      {"nf4", nf4},
      {"nf4 + double quant", nf4_dq},
      {"fp4", fp4},
      {"int8", int8}};
  std::printf(
      "bytes per quantized base parameter (fp32 4, bf16 2; formula counts "
      "each layer's code tables: 64 B 4-bit, +1 KiB double quant)\n");
  std::printf(
      "%-20s %6s %11s %10s %11s %11s %8s %8s\n",
      "format",
      "layers",
      "params",
      "measured",
      "formula",
      "asymptotic",
      "vs fp32",
      "vs bf16");
  js << "  \"fp32_bytes_per_param\": 4, \"bf16_bytes_per_param\": 2,\n"
     << "  \"memory\": [\n";
  for (size_t i = 0; i < kinds.size(); ++i) {
    const auto& cfg = kinds[i].second;
    std::shared_ptr<cl::LoraModel> lora;
    auto model = build(config, lora_config, &cfg, &lora);
    const auto f = q::quantized_footprint(*model);
    const auto shapes = quantized_shapes(*model);
    int64_t formula = 0, formula_no_tables = 0;
    for (const auto& s : shapes) {
      formula += formula_bytes(cfg, s.first, s.second, true);
      formula_no_tables += formula_bytes(cfg, s.first, s.second, false);
    }
    const double measured = f.bytes_per_param();
    const double form = static_cast<double>(formula) / f.params;
    const double asym = asymptotic_bytes_per_param(cfg, shapes);
    std::printf(
        "%-20s %6zu %11lld %10.6f %11.6f %11.6f %7.2fx %7.2fx\n",
        kinds[i].first.c_str(),
        shapes.size(),
        static_cast<long long>(f.params),
        measured,
        form,
        asym,
        4.0 / measured,
        2.0 / measured);
    js << "    {\"name\": \"" << kinds[i].first
       << "\", \"layers\": " << shapes.size() << ", \"params\": " << f.params
       << ", \"data_bytes\": " << f.data_bytes
       << ", \"state_bytes\": " << f.state_bytes
       << ", \"bytes_per_param\": " << measured
       << ", \"formula_bytes\": " << formula
       << ", \"formula_bytes_per_param\": " << form
       << ", \"table_bytes\": " << formula - formula_no_tables
       << ", \"asymptotic_bytes_per_param\": " << asym << "}"
       << (i + 1 < kinds.size() ? "," : "") << "\n";
  }
  js << "  ],\n";

  // ---- 2. speed: forward and QLoRA training step -------------------------
  std::vector<Setup> setups;
  setups.push_back(make("fp32 base", config, lora_config, nullptr, at::kFloat));
  setups.push_back(
      make("bf16 base", config, lora_config, nullptr, at::kBFloat16));
  setups.push_back(make(
      "nf4 + double quant, compute fp32",
      config,
      lora_config,
      &nf4_dq,
      at::kFloat));
  setups.push_back(
      make("nf4, compute bf16", config, lora_config, &nf4_bf16, at::kFloat));
  setups.push_back(make("int8", config, lora_config, &int8, at::kFloat));
  auto gen = at::detail::createCPUGenerator(7);
  const auto tokens = at::randint(vocab, {batch, seq + 1}, gen);
  const auto x = tokens.narrow(1, 0, seq).contiguous();
  const auto y = tokens.narrow(1, 1, seq).contiguous();
  // The forward alone, as inference runs it (no graph kept).
  auto forward = [&](Setup& s) {
    torch::NoGradGuard no_grad;
    s.model->forward(x);
  };
  auto step = [&](Setup& s) {
    s.opt->zero_grad();
    s.model->loss(s.model->forward(x), y).backward();
    s.opt->step();
  };
  for (auto& s : setups) {
    for (int i = 0; i < warmup; ++i) {
      forward(s);
      step(s);
    }
  }
  // Setups alternate, so drift in the machine's speed hits all alike.
  for (int r = 0; r < rounds; ++r) {
    for (auto& s : setups) {
      for (int i = 0; i < steps; ++i) {
        const double t0 = now_ms();
        forward(s);
        s.forward_ms.push_back(now_ms() - t0);
      }
      for (int i = 0; i < steps; ++i) {
        const double t0 = now_ms();
        step(s);
        s.step_ms.push_back(now_ms() - t0);
      }
    }
    std::fprintf(stderr, "[qlora] round %d/%d done\n", r + 1, rounds);
  }
  const double fwd0 = median(setups[0].forward_ms);
  const double step0 = median(setups[0].step_ms);
  std::printf(
      "\nLLaMA vocab %lld, hidden %lld, MLP %lld, %lld layers, %lld heads; "
      "LoRA r %lld on q/k/v/o/gate/up/down; %lld x %lld tokens\n",
      static_cast<long long>(vocab),
      static_cast<long long>(hidden),
      static_cast<long long>(intermediate),
      static_cast<long long>(layers),
      static_cast<long long>(heads),
      static_cast<long long>(rank),
      static_cast<long long>(batch),
      static_cast<long long>(seq));
  std::printf(
      "%-34s %9s %9s %10s %8s %10s %8s\n",
      "setup",
      "trainable",
      "model MB",
      "forward ms",
      "vs fp32",
      "step ms",
      "vs fp32");
  js << "  \"setups\": [\n";
  for (size_t i = 0; i < setups.size(); ++i) {
    const auto& s = setups[i];
    const double fwd = median(s.forward_ms), st = median(s.step_ms);
    std::printf(
        "%-34s %9lld %9.1f %10.1f %7.2fx %10.1f %7.2fx\n",
        s.name.c_str(),
        static_cast<long long>(s.trainable),
        s.model_bytes / 1e6,
        fwd,
        fwd / fwd0,
        st,
        st / step0);
    js << "    {\"name\": \"" << s.name << "\", \"trainable\": " << s.trainable
       << ", \"model_bytes\": " << s.model_bytes
       << ", \"forward_ms\": " << stats_json(s.forward_ms)
       << ", \"step_ms\": " << stats_json(s.step_ms)
       << ", \"forward_vs_fp32\": " << fwd / fwd0
       << ", \"step_vs_fp32\": " << st / step0 << "}"
       << (i + 1 < setups.size() ? "," : "") << "\n";
  }
  js << "  ],\n";

  // Greedy generation (the KV cache's one token per step): a 16-token
  // prompt, `new_tokens` more, with the few-row products (gemv_max_rows 4)
  // against dequantizing every step (0), alternating run by run.
  const int64_t new_tokens = 32;
  const auto prompt =
      x.narrow(0, 0, 1).narrow(1, 0, std::min<int64_t>(16, seq));
  const auto gen_config = models::GenerationConfig()
                              .max_new_tokens(new_tokens)
                              .min_new_tokens(new_tokens);
  std::printf(
      "\ngreedy generation, 1 x %lld-token prompt, %lld new tokens: median ms per new "
      "token (prefill included) over %d runs\n",
      static_cast<long long>(prompt.size(1)),
      static_cast<long long>(new_tokens),
      rounds);
  std::printf(
      "%-34s %10s %14s %8s %10s\n",
      "setup",
      "fused ms",
      "dequantized ms",
      "speedup",
      "same ids");
  js << "  \"generate\": [\n";
  const int64_t saved_limit = q::gemv_max_rows();
  for (size_t i = 0; i < setups.size(); ++i) {
    auto& s = setups[i];
    s.model->eval();
    std::vector<double> ms[2];
    at::Tensor ids[2];
    for (int r = -1; r < rounds; ++r) { // r = -1: warm-up
      for (int mode = 0; mode < 2; ++mode) {
        q::set_gemv_max_rows(mode == 0 ? 4 : 0);
        torch::NoGradGuard no_grad;
        const double t0 = now_ms();
        ids[mode] = models::generate(s.model, prompt, at::Tensor(), gen_config);
        if (r >= 0) {
          ms[mode].push_back((now_ms() - t0) / new_tokens);
        }
      }
    }
    s.model->train();
    const bool same = at::equal(ids[0], ids[1]);
    const double f = median(ms[0]), d = median(ms[1]);
    std::printf(
        "%-34s %10.2f %14.2f %7.2fx %10s\n",
        s.name.c_str(),
        f,
        d,
        d / f,
        same ? "yes" : "no");
    js << "    {\"name\": \"" << s.name
       << "\", \"fused_ms_per_token\": " << stats_json(ms[0])
       << ", \"dequantized_ms_per_token\": " << stats_json(ms[1])
       << ", \"speedup\": " << d / f
       << ", \"same_ids\": " << (same ? "true" : "false") << "}"
       << (i + 1 < setups.size() ? "," : "") << "\n";
  }
  q::set_gemv_max_rows(saved_limit);
  js << "  ],\n";
  setups.clear();

  // ---- 3. the 4-bit dequantizer alone, one 4096 x 4096 weight --------------
  const auto w = at::randn({4096, 4096}, gen) * 0.02;
  const auto plain = q::quantize_4bit(w, 64, "nf4", false);
  const auto nested = q::quantize_4bit(w, 64, "nf4", true);
  struct Kernel {
    std::string name;
    at::ScalarType dtype;
    std::function<at::Tensor()> run;
    std::vector<double> ms;
  };
  std::vector<Kernel> kernels = {
      {"nf4 -> fp32",
       at::kFloat,
       [&] {
         return q::dequantize_4bit(plain.first, plain.second, at::kFloat);
       },
       {}},
      {"nf4 + double quant -> fp32",
       at::kFloat,
       [&] {
         return q::dequantize_4bit(nested.first, nested.second, at::kFloat);
       },
       {}},
      {"nf4 + double quant -> bf16",
       at::kBFloat16,
       [&] {
         return q::dequantize_4bit(nested.first, nested.second, at::kBFloat16);
       },
       {}},
      // What writing the same output costs without decoding anything.
      {"fp32 copy (reference)", at::kFloat, [&] { return w.clone(); }, {}},
  };
  for (auto& k : kernels) {
    k.run();
  }
  for (int r = 0; r < dq_reps; ++r) {
    for (auto& k : kernels) {
      const double t0 = now_ms();
      auto t = k.run();
      k.ms.push_back(now_ms() - t0);
    }
  }
  std::printf("\ndequantize one 4096 x 4096 weight\n");
  std::printf("%-30s %8s %12s\n", "kernel", "ms", "GB/s output");
  js << "  \"dequantize\": [\n";
  for (size_t i = 0; i < kernels.size(); ++i) {
    const auto& k = kernels[i];
    const double bytes =
        static_cast<double>(w.numel()) * c10::elementSize(k.dtype);
    const double m = median(k.ms);
    std::printf("%-30s %8.2f %12.2f\n", k.name.c_str(), m, bytes / m / 1e6);
    js << "    {\"name\": \"" << k.name << "\", \"numel\": " << w.numel()
       << ", \"output_bytes\": " << static_cast<int64_t>(bytes)
       << ", \"ms\": " << stats_json(k.ms)
       << ", \"gb_per_s\": " << bytes / m / 1e6 << "}"
       << (i + 1 < kernels.size() ? "," : "") << "\n";
  }
  js << "  ],\n";

  // ---- 4. a few rows through one quantized layer ---------------------------
  // What a generation step asks of each layer: 1-8 tokens times the frozen
  // weight, the fused few-row products (4-bit: gemv_4bit in the compute
  // dtype; int8: int8_linear with gemv_max_rows 8) against dequantize +
  // matmul (QuantizedWeight::linear with gemv_max_rows 0), alternating call
  // by call; plain fp32 / bf16 weights beside them. (On the CPU the layers
  // keep the composition for a 16-bit compute dtype: see the bf16 rows.)
  struct Layer {
    std::string name;
    q::BnbQuantizationConfig config;
  };
  const std::vector<Layer> layer_kinds = {
      {"nf4 + double quant, compute fp32", nf4_dq},
      {"nf4, compute bf16", nf4_bf16},
      {"int8", int8}};
  const std::vector<std::pair<int64_t, int64_t>> layer_shapes = {
      {4096, 4096}, {11008, 4096}};
  std::printf(
      "\na few rows through one layer: median ms of %d calls (fused = the "
      "packed bytes read directly; dequantized = dequantize, then matmul)\n",
      gemv_reps);
  std::printf(
      "%-34s %13s %5s %10s %12s %8s %10s %10s\n",
      "weight",
      "[out, in]",
      "rows",
      "fused ms",
      "dequant. ms",
      "speedup",
      "fp32 W ms",
      "bf16 W ms");
  js << "  \"few_rows\": [\n";
  const int64_t saved_rows = q::gemv_max_rows();
  bool first_row = true;
  for (const auto& shape : layer_shapes) {
    const auto wl = at::randn({shape.first, shape.second}, gen) * 0.02;
    const auto wl16 = wl.to(at::kBFloat16);
    for (const auto& kind : layer_kinds) {
      auto qw = q::QuantizedWeight::quantize(wl, kind.config);
      for (const int64_t rows : {1, 2, 4, 8}) {
        const auto xl = at::randn({rows, shape.second}, gen);
        const auto xl16 = xl.to(at::kBFloat16);
        torch::NoGradGuard no_grad;
        std::vector<double> fused, plain_ms, fp32_ms, bf16_ms;
        auto time = [&](std::vector<double>* into,
                        const std::function<void()>& f) {
          const double t0 = now_ms();
          f();
          if (into != nullptr) {
            into->push_back(now_ms() - t0);
          }
        };
        for (int r = -1; r < gemv_reps; ++r) { // r = -1: warm-up
          q::set_gemv_max_rows(8);
          time(r < 0 ? nullptr : &fused, [&] {
            if (kind.config.load_in_4bit()) {
              q::gemv_4bit(
                  xl.to(kind.config.bnb_4bit_compute_dtype()),
                  qw.first,
                  qw.second->state_4bit())
                  .to(at::kFloat);
            } else {
              qw.second->linear(xl, qw.first);
            }
          });
          q::set_gemv_max_rows(0);
          time(r < 0 ? nullptr : &plain_ms, [&] {
            qw.second->linear(xl, qw.first);
          });
          time(r < 0 ? nullptr : &fp32_ms, [&] { at::linear(xl, wl); });
          time(r < 0 ? nullptr : &bf16_ms, [&] { at::linear(xl16, wl16); });
        }
        const double f = median(fused), d = median(plain_ms);
        std::printf(
            "%-34s %6lld x %4lld %5lld %10.3f %12.3f %7.2fx %10.3f %10.3f\n",
            kind.name.c_str(),
            static_cast<long long>(shape.first),
            static_cast<long long>(shape.second),
            static_cast<long long>(rows),
            f,
            d,
            d / f,
            median(fp32_ms),
            median(bf16_ms));
        js << (first_row ? "" : ",\n") << "    {\"weight\": \"" << kind.name
           << "\", \"out\": " << shape.first << ", \"in\": " << shape.second
           << ", \"rows\": " << rows << ", \"fused_ms\": " << stats_json(fused)
           << ", \"dequantized_ms\": " << stats_json(plain_ms)
           << ", \"fp32_weight_ms\": " << stats_json(fp32_ms)
           << ", \"bf16_weight_ms\": " << stats_json(bf16_ms)
           << ", \"speedup\": " << d / f << "}";
        first_row = false;
      }
    }
  }
  q::set_gemv_max_rows(saved_rows);
  js << "\n  ],\n  \"peak_rss_bytes\": " << colossalai::bench::peak_rss_bytes()
     << "\n}\n";
  if (!out.empty()) {
    std::ofstream(out) << js.str();
  }
  return 0;
}
