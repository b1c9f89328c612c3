// Fine-tunes a causal language model on a text corpus with the Booster.
//
//   finetune_lm [--model DIR | --config gpt2-tiny|llama-tiny] [--data PATH]
//               [--plugin none|ddp|zero1|zero2|fsdp|gemini|hybrid|moe_hybrid]
//               [--tp N] [--pp N] [--sp N] [--sp-mode M] [--sp-overlap]
//               [--inner-ring N]
//               [--zero N] [--ep N]
//               [--lora R] [--qlora] [--offload] [--offload-frac F]
//               [--overlap-host-step]
//               [--placement static|auto] [--gpu-margin F] [--grad-checkpoint]
//               [--precision fp32|bf16|fp16] [--steps N] [--seq-len T]
//               [--batch-size B] [--lr X] [--warmup N] [--schedule S]
//               [--checkpoint DIR] [--save-every N] [--keep-last K]
//               [--resume] [--out DIR]
//               [--truncate] [--packing] [--eval-split F] [--eval-every N]
//
// --model reads a directory transformers wrote (GPT-2 or the LLaMA family,
// with its tokenizer.json, vocab.json + merges.txt or SentencePiece
// tokenizer.model); without it a small
// model of --config is built and a byte-level BPE is trained on the corpus.
// The default corpus is Debian's fortunes. --data FILE.jsonl fine-tunes on
// conversations instead (supervised fine-tuning: one JSON object per line,
// {"messages": [{"role", "content"}...]} or {"prompt", "response"}), rendered
// by the model directory's chat template, the loss on the assistant's
// tokens only, each conversation one sequence padded to --seq-len;
// --eval-split holds some out and prints their loss and perplexity every
// --eval-every steps (and plots it). Started directly it launches
// --nproc ranks of itself (as `colossalai run` would). At the end: the loss
// curve (out/loss.png), a table, continuations of each --prompt sampled
// with a KV cache, and the model (out/model) or adapter (out/adapter) that
// transformers / PEFT load.

#include <colossalai/colossalai.h>
#include <colossalai/lora/lora_model.h>
#include <colossalai/models/generation.h>
#include <colossalai/models/pretrained.h>
#include <colossalai/models/tokenizer.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/nn/lr_scheduler/cosine.h>
#include <colossalai/quantization/quantize_model.h>

#include "plot.h"
#include "sft_data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <sstream>
#include <thread>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
namespace models = colossalai::models;
namespace fs = std::filesystem;

namespace {

const char* const kFortunes = "/usr/share/games/fortunes";

struct Args {
  int nproc = 2;
  std::string model_dir, config = "gpt2-tiny", data = kFortunes;
  std::string plugin = "ddp";
  int tp = 1, pp = 1, sp = 1, zero = 0, ep = 1;
  std::string sp_mode = "all_to_all";
  int lora = 0;
  bool qlora = false;
  bool offload = false, grad_checkpoint = false, overlap_host_step = false;
  bool fp8_communication = false;
  bool use_fp8 = false;
  bool sp_overlap = false;
  int inner_ring = 0;
  double offload_frac = -1; // unset
  std::string placement = "static";
  double gpu_margin = 0; // gemini auto: gpu_margin_mem_ratio
  std::string precision = "fp32";
  int64_t steps = 100, seq_len = 64, batch_size = 8, vocab_size = 1024;
  double lr = 1e-3;
  int64_t warmup = 10;
  std::string schedule = "cosine";
  std::string checkpoint = "checkpoints/finetune_lm";
  int64_t save_every = 0, stop_after = 0, keep_last = 2;
  bool resume = false;
  std::string out = "finetune_lm_out";
  std::vector<std::string> prompts{"The"};
  int samples = 3;
  double temperature = 0.8;
  uint64_t seed = 42;
  bool truncate = false, packing = false;
  double eval_split = 0;
  int64_t eval_every = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app(
      "Fine-tunes a causal language model on a text corpus through the "
      "Booster.",
      "finetune_lm");
  app.add_option("--nproc", a.nproc, "ranks to start")->capture_default_str();
  app.add_option("--model", a.model_dir, "a transformers model directory");
  app.add_option("--config", a.config, "the model to build without --model")
      ->check(CLI::IsMember({"gpt2-tiny", "llama-tiny"}))
      ->capture_default_str();
  app.add_option("--data", a.data, "a text file, or a directory of them")
      ->capture_default_str();
  app.add_option("--plugin", a.plugin, "parallel strategy")
      ->check(CLI::IsMember(
          {"none",
           "ddp",
           "zero1",
           "zero2",
           "fsdp",
           "gemini",
           "hybrid",
           "moe_hybrid"}))
      ->capture_default_str();
  app.add_option("--tp", a.tp, "hybrid: tensor-parallel size")
      ->capture_default_str();
  app.add_option("--pp", a.pp, "hybrid: pipeline stages")
      ->capture_default_str();
  app.add_option(
         "--sp", a.sp, "hybrid: sequence-parallel size (all_to_all, ring_attn)")
      ->capture_default_str();
  app.add_option(
         "--sp-mode",
         a.sp_mode,
         "hybrid: all_to_all or ring_attn (over --sp ranks), split_gather or "
         "ring (over the --tp group)")
      ->capture_default_str();
  app.add_flag(
      "--sp-overlap",
      a.sp_overlap,
      "hybrid, --sp-mode split_gather: each block's input-gradient "
      "reduce-scatter travels while the weight gradients are computed "
      "(enable_sequence_overlap)");
  app.add_option(
         "--inner-ring",
         a.inner_ring,
         "hybrid, --sp-mode ring_attn: double ring attention, inner rings of "
         "N consecutive sp ranks (inner_ring_size; 0: one ring)")
      ->capture_default_str();
  app.add_option("--zero", a.zero, "hybrid: ZeRO stage (0, 1, 2)")
      ->capture_default_str();
  app.add_option(
         "--ep",
         a.ep,
         "moe_hybrid: expert-parallel size (splits the data-parallel ranks)")
      ->capture_default_str();
  app.add_option("--lora", a.lora, "LoRA rank (0: full fine-tuning)")
      ->capture_default_str();
  app.add_flag("--qlora", a.qlora, "LoRA on a 4-bit NF4 base (--lora R)");
  app.add_flag(
      "--offload",
      a.offload,
      "zero1 / zero2: fp32 masters, gradients and AdamW states in host "
      "memory (cpu_offload); gemini: all chunks' (offload_optim_frac 1)");
  app.add_option(
      "--offload-frac",
      a.offload_frac,
      "gemini, static placement: share of the chunk bytes whose fp32 state "
      "lives in host memory");
  app.add_flag(
      "--overlap-host-step",
      a.overlap_host_step,
      "with --offload or --offload-frac: HybridAdam updates each host chunk "
      "or bucket during the backward, as soon as its gradient is on the "
      "host (overlap_host_step)");
  app.add_flag(
      "--fp8-communication",
      a.fp8_communication,
      "what crosses nodes (ranks on other hosts) travels as FP8: gradients, "
      "gathered parameters, pipeline and tensor-parallel activations "
      "(fp8_communication; LibTorch 2.1+)");
  app.add_flag(
      "--use-fp8",
      a.use_fp8,
      "linear layers multiply in FP8 (use_fp8; zero1, zero2, gemini, hybrid "
      "and moe_hybrid with --precision bf16 or fp16; LibTorch 2.1+, on a GPU "
      "Ada or Hopper)");
  app.add_option("--placement", a.placement, "gemini: placement policy")
      ->check(CLI::IsMember({"static", "auto"}))
      ->capture_default_str();
  app.add_option(
      "--gpu-margin",
      a.gpu_margin,
      "gemini, --placement auto: share of the device memory the first step "
      "finds spare that takes chunks' fp32 states (gpu_margin_mem_ratio)");
  app.add_flag(
      "--grad-checkpoint",
      a.grad_checkpoint,
      "recompute every layer's activations in backward (less memory, one "
      "more forward)");
  app.add_option("--precision", a.precision, "fp16 needs CUDA")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--steps", a.steps, "optimizer steps in all")
      ->capture_default_str();
  app.add_option("--seq-len", a.seq_len, "tokens per sequence")
      ->capture_default_str();
  app.add_option("--batch-size", a.batch_size, "sequences per step, global")
      ->capture_default_str();
  app.add_option(
         "--vocab-size", a.vocab_size, "the trained tokenizer's (no --model)")
      ->capture_default_str();
  app.add_option("--lr", a.lr, "AdamW peak learning rate")
      ->capture_default_str();
  app.add_option("--warmup", a.warmup, "linear warm-up steps")
      ->capture_default_str();
  app.add_option("--schedule", a.schedule, "learning-rate schedule")
      ->check(CLI::IsMember({"cosine", "constant"}))
      ->capture_default_str();
  app.add_option("--checkpoint", a.checkpoint, "checkpoint directory")
      ->capture_default_str();
  app.add_option("--save-every", a.save_every, "checkpoint every N steps")
      ->capture_default_str();
  app.add_flag(
      "--resume",
      a.resume,
      "continue from the newest complete checkpoint under --checkpoint, or "
      "start fresh when there is none (the same command line serves the first "
      "start and every restart)");
  app.add_option(
         "--keep-last", a.keep_last, "checkpoints kept under --checkpoint")
      ->capture_default_str();
  app.add_flag(
      "--truncate",
      a.truncate,
      "--data FILE.jsonl: cut conversations longer than --seq-len (counted) "
      "instead of refusing them");
  app.add_flag(
      "--packing",
      a.packing,
      "--data FILE.jsonl: several conversations per sequence, attention "
      "kept inside each (LLaMA family)");
  app.add_option(
         "--eval-split",
         a.eval_split,
         "share of the sequences held out for evaluation (0: none)")
      ->capture_default_str();
  app.add_option(
         "--eval-every",
         a.eval_every,
         "evaluate every N steps (0: five times over the run)")
      ->capture_default_str();
  app.add_option(
         "--stop-after",
         a.stop_after,
         "stop at this step (the schedule still spans --steps)")
      ->capture_default_str();
  app.add_option("--out", a.out, "plot, losses, samples, model")
      ->capture_default_str();
  app.add_option(
      "--prompt", a.prompts, "continued (answered) at the end; repeatable")
      ->capture_default_str();
  app.add_option("--samples", a.samples, "continuations to sample")
      ->capture_default_str();
  app.add_option(
         "--temperature", a.temperature, "of the samples (top-k 40); 0: greedy")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--seed", a.seed, "random seed")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  TORCH_CHECK(a.nproc >= 1, "--nproc must be >= 1, got ", a.nproc);
  TORCH_CHECK(a.steps >= 1, "--steps must be >= 1, got ", a.steps);
  TORCH_CHECK(a.seq_len >= 2, "--seq-len must be >= 2, got ", a.seq_len);
  TORCH_CHECK(a.batch_size >= 1, "--batch-size must be >= 1");
  TORCH_CHECK(a.lora >= 0, "--lora must be >= 0, got ", a.lora);
  TORCH_CHECK(
      !a.qlora || a.lora > 0,
      "--qlora trains LoRA adapters on a quantized base: give --lora R");
  const bool hybrid = a.plugin == "hybrid" || a.plugin == "moe_hybrid";
  TORCH_CHECK(
      hybrid || (a.tp == 1 && a.pp == 1 && a.sp == 1),
      "--tp, --pp and --sp need --plugin hybrid or moe_hybrid (got --plugin ",
      a.plugin,
      ")");
  TORCH_CHECK(
      hybrid || a.zero == 0,
      "--zero sets the hybrid plugin's ZeRO stage; for ZeRO alone use "
      "--plugin zero1 or zero2");
  TORCH_CHECK(
      a.plugin == "moe_hybrid" || a.ep == 1,
      "--ep needs --plugin moe_hybrid (got --plugin ",
      a.plugin,
      ")");
  TORCH_CHECK(a.ep >= 1, "--ep must be >= 1, got ", a.ep);
  TORCH_CHECK(
      a.tp >= 1 && a.pp >= 1 && a.sp >= 1, "--tp, --pp and --sp must be >= 1");
  TORCH_CHECK(
      a.zero >= 0 && a.zero <= 2, "--zero must be 0, 1 or 2, got ", a.zero);
  const bool over_tp = a.sp_mode == "split_gather" || a.sp_mode == "ring";
  TORCH_CHECK(
      over_tp || a.sp_mode == "all_to_all" || a.sp_mode == "ring_attn",
      "--sp-mode must be all_to_all, ring_attn, split_gather or ring, got '",
      a.sp_mode,
      "'");
  TORCH_CHECK(
      !over_tp || (a.sp == 1 && a.tp > 1),
      "--sp-mode ",
      a.sp_mode,
      " splits the sequence over the tensor-parallel group: give --tp > 1 "
      "and leave --sp at 1");
  TORCH_CHECK(
      !a.sp_overlap ||
          ((a.plugin == "hybrid" || a.plugin == "moe_hybrid") && over_tp),
      "--sp-overlap needs --plugin hybrid (or moe_hybrid) with --sp-mode "
      "split_gather or ring");
  TORCH_CHECK(
      a.inner_ring == 0 || (a.sp_mode == "ring_attn" && a.sp > 1),
      "--inner-ring needs --sp-mode ring_attn with --sp > 1");
  TORCH_CHECK(
      a.plugin != "none" || a.nproc == 1,
      "--plugin none trains in one process: use --nproc 1");
  TORCH_CHECK(
      a.nproc % (a.tp * a.pp * a.sp) == 0,
      "--nproc ",
      a.nproc,
      " is not a multiple of tp x pp x sp = ",
      a.tp * a.pp * a.sp);
  TORCH_CHECK(
      a.lora == 0 ||
          (a.plugin != "fsdp" && a.plugin != "gemini" && a.tp == 1 &&
           a.pp == 1 && a.ep == 1),
      "--lora works with --plugin none, ddp, zero1, zero2 and hybrid at "
      "--tp 1 --pp 1 --ep 1");
  const bool zero = a.plugin == "zero1" || a.plugin == "zero2";
  TORCH_CHECK(
      !a.offload || zero || a.plugin == "gemini",
      "--offload needs --plugin zero1, zero2 or gemini (got --plugin ",
      a.plugin,
      ")");
  TORCH_CHECK(
      a.offload_frac < 0 ||
          (a.plugin == "gemini" && a.placement == "static" && !a.offload &&
           a.offload_frac <= 1),
      "--offload-frac is gemini's static share in [0, 1], without --offload "
      "(its share is 1) or --placement auto");
  TORCH_CHECK(
      a.placement == "static" || a.plugin == "gemini",
      "--placement needs --plugin gemini");
  TORCH_CHECK(
      !a.fp8_communication || a.plugin != "none",
      "--fp8-communication needs a --plugin that communicates (not none)");
  TORCH_CHECK(
      !a.use_fp8 ||
          !(a.plugin == "none" || a.plugin == "ddp" || a.plugin == "fsdp"),
      "--use-fp8 needs --plugin zero1, zero2, gemini, hybrid or moe_hybrid "
      "(their use_fp8), not ",
      a.plugin);
  TORCH_CHECK(
      !a.overlap_host_step ||
          (a.offload || (a.plugin == "gemini" && a.offload_frac > 0)),
      "--overlap-host-step needs states in host memory: --offload (zero1, "
      "zero2, gemini) or gemini's --offload-frac");
  TORCH_CHECK(
      a.gpu_margin == 0 ||
          (a.placement == "auto" && a.gpu_margin > 0 && a.gpu_margin <= 1),
      "--gpu-margin is gemini's gpu_margin_mem_ratio in [0, 1], with "
      "--placement auto");
  TORCH_CHECK(
      a.save_every >= 0, "--save-every must be >= 0, got ", a.save_every);
  TORCH_CHECK(a.keep_last >= 1, "--keep-last must be >= 1, got ", a.keep_last);
  TORCH_CHECK(
      a.eval_split >= 0 && a.eval_split < 1,
      "--eval-split must be in [0, 1), got ",
      a.eval_split);
  TORCH_CHECK(
      a.eval_every >= 0, "--eval-every must be >= 0, got ", a.eval_every);
  TORCH_CHECK(
      a.model_dir.empty() || fs::exists(fs::path(a.model_dir) / "config.json"),
      "--model '",
      a.model_dir,
      "' has no config.json (a directory transformers' save_pretrained "
      "wrote)");
  TORCH_CHECK(
      fs::exists(a.data),
      "--data '",
      a.data,
      "' does not exist",
      a.data == kFortunes
          ? " (Debian's fortunes: ./scripts/setup.sh installs them)"
          : "");
  return a;
}

// Every fortune (the files are fortunes separated by lines holding "%"),
// or a text file's paragraphs, as documents.
std::vector<std::string> read_corpus(const std::string& path) {
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (const auto& e : fs::directory_iterator(path)) {
      // fortune's index (.dat) and UTF-8 links (.u8) are not text.
      if (e.is_regular_file() && e.path().extension().empty()) {
        files.push_back(e.path());
      }
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::vector<std::string> docs;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    TORCH_CHECK(in, "cannot read '", f.string(), "'");
    std::string line, doc;
    auto flush = [&] {
      if (doc.find_first_not_of(" \n\t") != std::string::npos) {
        docs.push_back(doc);
      }
      doc.clear();
    };
    while (std::getline(in, line)) {
      if (line == "%" || line.empty()) {
        flush();
      } else {
        doc += line + "\n";
      }
    }
    flush();
  }
  TORCH_CHECK(!docs.empty(), "--data '", path, "' holds no text");
  return docs;
}

// The corpus as sequences of seq_len + 1 tokens, cut end to end: each
// document with the tokens its tokenizer adds (LLaMA's bos), and an
// end-of-text token after it unless the tokenizer added one.
at::Tensor make_sequences(
    const std::vector<std::string>& docs,
    const models::Tokenizer& tok,
    int64_t seq_len) {
  std::vector<int64_t> ids;
  for (const auto& d : docs) {
    auto t = tok.encode(d, /*add_special_tokens=*/true);
    ids.insert(ids.end(), t.begin(), t.end());
    if (tok.eos_token_id() >= 0 &&
        (t.empty() || t.back() != tok.eos_token_id())) {
      ids.push_back(tok.eos_token_id());
    }
  }
  const int64_t n = static_cast<int64_t>(ids.size()) / (seq_len + 1);
  TORCH_CHECK(
      n >= 1,
      "the corpus has ",
      ids.size(),
      " tokens, fewer than one sequence of --seq-len + 1");
  return at::tensor(ids, at::kLong)
      .narrow(0, 0, n * (seq_len + 1))
      .view({n, seq_len + 1});
}

std::string hms(double s) {
  const int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  std::snprintf(
      buf,
      sizeof buf,
      "%lld:%02lld:%02lld",
      static_cast<long long>(t / 3600),
      static_cast<long long>(t / 60 % 60),
      static_cast<long long>(t % 60));
  return buf;
}

void progress(
    int64_t step,
    int64_t steps,
    double loss,
    double tok_per_s,
    double eta_s) {
  const int width = 30;
  const int filled =
      static_cast<int>(width * step / std::max<int64_t>(steps, 1));
  std::printf(
      "\rstep %lld/%lld [%s%s] loss %.4f | %.0f tok/s | ETA %s   ",
      static_cast<long long>(step),
      static_cast<long long>(steps),
      std::string(filled, '#').c_str(),
      std::string(width - filled, '.').c_str(),
      loss,
      tok_per_s,
      hms(eta_s).c_str());
  std::fflush(stdout);
}

// The plugin and the precision left to the Booster (DDP's autocast).
std::pair<std::shared_ptr<cb::plugin::DPPluginBase>, std::string> make_plugin(
    const Args& a) {
  using namespace cb::plugin;
  if (a.plugin == "none") {
    return {nullptr, a.precision};
  }
  if (a.plugin == "ddp") {
    return {
        std::make_shared<TorchDDPPlugin>(
            TorchDDPPluginOptions().fp8_communication(a.fp8_communication)),
        a.precision};
  }
  if (a.plugin == "zero1" || a.plugin == "zero2") {
    return {
        std::make_shared<LowLevelZeroPlugin>(
            LowLevelZeroPluginOptions()
                .stage(a.plugin == "zero1" ? 1 : 2)
                .precision(a.precision)
                .cpu_offload(a.offload)
                .overlap_host_step(a.overlap_host_step)
                .fp8_communication(a.fp8_communication)
                .use_fp8(a.use_fp8)),
        ""};
  }
  if (a.plugin == "fsdp") {
    TORCH_CHECK(
        a.precision != "fp16" || at::hasCUDA(),
        "--plugin fsdp --precision fp16 needs CUDA");
    return {
        std::make_shared<TorchFSDPPlugin>(
            TorchFSDPPluginOptions()
                .param_dtype(
                    a.precision == "bf16"       ? at::kBFloat16
                        : a.precision == "fp16" ? at::kHalf
                                                : at::kFloat)
                .fp8_communication(a.fp8_communication)),
        ""};
  }
  if (a.plugin == "gemini") {
    auto o = GeminiPluginOptions()
                 .precision(a.precision)
                 .placement_policy(a.placement)
                 .fp8_communication(a.fp8_communication)
                 .use_fp8(a.use_fp8);
    if (a.placement == "static") {
      o.offload_optim_frac(a.offload ? 1.0 : std::max(0.0, a.offload_frac));
      o.overlap_host_step(a.overlap_host_step);
    } else {
      o.gpu_margin_mem_ratio(a.gpu_margin);
    }
    return {std::make_shared<GeminiPlugin>(o), ""};
  }
  auto o = HybridParallelPluginOptions()
               .tp_size(a.tp)
               .pp_size(a.pp)
               .zero_stage(a.zero)
               .precision(a.precision)
               .ep_size(a.ep)
               .gradient_checkpointing_ratio(a.grad_checkpoint ? 1.0 : 0.0)
               .fp8_communication(a.fp8_communication)
               .use_fp8(a.use_fp8);
  if (a.pp > 1) {
    o.num_microbatches(a.pp);
  }
  if (a.sp > 1) {
    o.sp_size(a.sp)
        .enable_sequence_parallelism(true)
        .sequence_parallelism_mode(a.sp_mode)
        .inner_ring_size(a.inner_ring);
  } else if (a.sp_mode == "split_gather" || a.sp_mode == "ring") {
    o.enable_sequence_parallelism(true)
        .sequence_parallelism_mode(a.sp_mode)
        .enable_sequence_overlap(a.sp_overlap);
  }
  if (a.plugin == "moe_hybrid") {
    return {std::make_shared<MoeHybridParallelPlugin>(o), ""};
  }
  return {std::make_shared<HybridParallelPlugin>(o), ""};
}

// The trained tokenizer's end-of-text id in config.json, as transformers
// reads it (its defaults are GPT-2's and LLaMA's own vocabularies').
std::string token_ids_json(int64_t eos) {
  return "{\"bos_token_id\": " + std::to_string(eos) +
      ", \"eos_token_id\": " + std::to_string(eos) + "}";
}

models::GPT2Config tiny_gpt2(int64_t vocab, int64_t seq_len, int64_t eos) {
  return models::GPT2Config()
      .source_json(token_ids_json(eos))
      .vocab_size(vocab)
      .n_positions(std::max<int64_t>(256, seq_len))
      .n_embd(128)
      .n_layer(4)
      .n_head(4)
      .embd_pdrop(0)
      .attn_pdrop(0)
      .resid_pdrop(0);
}

models::LlamaConfig tiny_llama(int64_t vocab, int64_t seq_len, int64_t eos) {
  return models::LlamaConfig()
      .source_json(token_ids_json(eos))
      .vocab_size(vocab)
      .hidden_size(128)
      .intermediate_size(352)
      .num_hidden_layers(4)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .max_position_embeddings(std::max<int64_t>(256, seq_len));
}

// A fresh model: the --model directory's weights, or --config's under the
// seed.
template <class M>
M build_model(const Args& a, const models::Tokenizer& tok) {
  torch::manual_seed(a.seed);
  if (!a.model_dir.empty()) {
    return models::from_pretrained<M>(a.model_dir);
  }
  if constexpr (std::is_same_v<M, models::GPT2LMHeadModel>) {
    return M(tiny_gpt2(tok.vocab_size(), a.seq_len, tok.eos_token_id()));
  } else {
    return M(tiny_llama(tok.vocab_size(), a.seq_len, tok.eos_token_id()));
  }
}

colossalai::quantization::BnbQuantizationConfig qlora_config() {
  return colossalai::quantization::BnbQuantizationConfig()
      .load_in_4bit(true)
      .bnb_4bit_quant_type("nf4")
      .bnb_4bit_use_double_quant(true)
      .bnb_4bit_compute_dtype(at::kFloat);
}

colossalai::lora::LoraConfig lora_config(const Args& a, bool gpt2) {
  auto targets = gpt2 ? std::vector<std::string>{"c_attn", "c_proj", "c_fc"}
                      : std::vector<std::string>{
                            "q_proj",
                            "k_proj",
                            "v_proj",
                            "o_proj",
                            "gate_proj",
                            "up_proj",
                            "down_proj"};
  return colossalai::lora::LoraConfig()
      .r(a.lora)
      .lora_alpha(2 * a.lora)
      .target_modules(targets)
      .task_type("CAUSAL_LM");
}

// Continuations of `prompt` sampled at `temperature` with top-k 40 (0:
// greedy), one process, generated with a KV cache, all `n` as one batch. With a chat
// template: of the assistant's answer to `prompt` as a user turn (the
// answer alone is returned). Stop tokens: the tokenizer's end of text and
// those of the model directory's generation config.
template <class M>
std::vector<std::string> sample(
    M& model,
    const models::Tokenizer& tok,
    const std::string& prompt,
    int n,
    int64_t max_new,
    int64_t context,
    double temperature,
    uint64_t seed,
    const std::string& model_dir,
    const models::ChatTemplate* chat = nullptr) {
  model->eval();
  // The prompt after the tokens the tokenizer puts first (LLaMA's bos),
  // without an end-of-text after it: the text to continue.
  auto ids = chat != nullptr
      ? models::apply_chat_template(
            tok, *chat, {{"user", prompt}}, /*add_generation_prompt=*/true)
      : tok.encode(prompt, /*add_special_tokens=*/true);
  if (chat == nullptr && ids.size() > 1 && ids.back() == tok.eos_token_id()) {
    ids.pop_back();
  }
  const size_t lead = chat != nullptr
      ? ids.size()
      : ids.size() - std::min(ids.size(), tok.encode(prompt).size());
  // The context the model was trained on holds prompt and answer.
  const int64_t keep = std::min<int64_t>(ids.size(), context - 1);
  std::vector<int64_t> kept(ids.end() - keep, ids.end());
  auto cfg = model_dir.empty()
      ? models::GenerationConfig()
      : models::GenerationConfig::from_pretrained(model_dir);
  auto stops = cfg.eos_token_id();
  if (tok.eos_token_id() >= 0 &&
      std::find(stops.begin(), stops.end(), tok.eos_token_id()) ==
          stops.end()) {
    stops.push_back(tok.eos_token_id());
  }
  cfg.do_sample(temperature > 0)
      .temperature(temperature > 0 ? temperature : 1.0)
      .top_k(40)
      .top_p(1.0)
      .seed(seed)
      .eos_token_id(stops)
      .max_new_tokens(std::min<int64_t>(max_new, context - keep));
  const auto prompts =
      at::tensor(kept, at::kLong).unsqueeze(0).expand({n, keep}).contiguous();
  const auto out = models::generate(model, prompts, at::Tensor(), cfg);
  std::vector<std::string> texts;
  for (int i = 0; i < n; ++i) {
    std::vector<int64_t> row(ids.begin(), ids.end() - keep);
    const auto r = out[i].contiguous();
    const int64_t* tokens = r.template data_ptr<int64_t>();
    for (int64_t j = 0; j < r.size(0); ++j) {
      const int64_t id = tokens[j];
      if (j >= keep &&
          std::find(stops.begin(), stops.end(), id) != stops.end()) {
        break;
      }
      row.push_back(id);
    }
    // Prompt and continuation decoded together (SentencePiece's decoder
    // drops a leading space).
    texts.push_back(
        tok.decode(std::vector<int64_t>(row.begin() + lead, row.end())));
  }
  return texts;
}

template <class M>
int train(const Args& a) {
  const bool distributed = a.plugin != "none";
  if (distributed) {
    colossalai::launch_from_env();
  }
  const int rank = distributed ? cd::get_rank() : 0;
  const int world = distributed ? cd::get_world_size() : 1;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  at::set_num_threads(std::max(1, cores / world));
  const bool gpt2 = std::is_same_v<M, models::GPT2LMHeadModel>;

  // The tokenizer: the model's own, or one trained on the corpus (every
  // rank trains the same one: deterministic).
  const bool sft = fs::path(a.data).extension() == ".jsonl";
  std::vector<finetune_lm::Conversation> conversations;
  std::vector<std::string> docs;
  if (sft) {
    conversations = finetune_lm::read_sft_jsonl(a.data);
    for (const auto& c : conversations) {
      std::string text;
      for (const auto& m : c.messages) {
        text += m.role + ": " + m.content + "\n";
      }
      docs.push_back(text);
    }
  } else {
    docs = read_corpus(a.data);
  }
  const auto tok = a.model_dir.empty()
      ? [&] {
          std::string text;
          for (const auto& d : docs) {
            if (text.size() > (2u << 20)) {
              break; // enough text for a small vocabulary
            }
            text += d;
          }
          return models::Tokenizer::train(text, a.vocab_size);
        }()
      : models::Tokenizer::from_pretrained(a.model_dir);
  // Sequences of seq_len + 1 tokens and their targets (-100: no loss);
  // with --packing their positions (restarting with each conversation).
  at::Tensor data, labels, positions;
  std::unique_ptr<models::ChatTemplate> chat_template;
  finetune_lm::SftBatch sft_batch;
  if (sft) {
    if (!a.model_dir.empty()) {
      try {
        chat_template = std::make_unique<models::ChatTemplate>(
            models::ChatTemplate::from_pretrained(a.model_dir));
      } catch (const models::ChatTemplateError& e) {
        if (std::string(e.what()).find("has none") == std::string::npos) {
          throw; // a template that cannot be read is an error
        }
      }
    }
    sft_batch = finetune_lm::make_sft_sequences(
        conversations,
        tok,
        chat_template.get(),
        a.seq_len,
        a.truncate,
        a.packing);
    data = sft_batch.ids;
    labels = sft_batch.labels;
    positions = sft_batch.positions;
  } else {
    TORCH_CHECK(
        !a.packing, "--packing packs conversations: give --data FILE.jsonl");
    data = make_sequences(docs, tok, a.seq_len);
    labels = data;
  }

  auto [plugin, booster_precision] = make_plugin(a);
  cb::Booster booster(
      cb::BoosterOptions().plugin(plugin).mixed_precision(booster_precision));
  M model = build_model<M>(a, tok);
  const auto config = model->config();
  fs::create_directories(a.out);
  std::shared_ptr<colossalai::lora::LoraModel> lora;
  if (a.lora > 0) {
    if (a.model_dir.empty() && rank == 0) {
      // The base the adapter belongs to, for PEFT.
      models::save_pretrained(model, a.out + "/base");
      tok.save_pretrained(a.out + "/base");
    }
    // A resume loads the adapters' values (resume_or_start).
    lora = booster.enable_lora(
        model,
        "",
        lora_config(a, gpt2),
        a.qlora ? std::optional(qlora_config()) : std::nullopt,
        a.qlora);
  }
  // Optimizer states in host memory step on the host: HybridAdam's
  // all-core CPU kernel there (its device step elsewhere), as ColossalAI
  // pairs it with Gemini and ZeRO offload; LibTorch's AdamW otherwise.
  const bool host_states =
      a.offload || a.offload_frac > 0 || a.placement == "auto";
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  if (host_states) {
    optimizer = std::make_shared<colossalai::nn::optimizer::HybridAdam>(
        model->parameters(),
        colossalai::nn::optimizer::HybridAdamOptions(a.lr).weight_decay(0.01));
  } else {
    optimizer = std::make_shared<torch::optim::AdamW>(
        model->parameters(),
        torch::optim::AdamWOptions(a.lr).weight_decay(0.01));
  }
  auto boosted = booster.boost(model, optimizer);
  if (a.grad_checkpoint) { // the hybrid plugin's option set it already
    model->parallel_state().gradient_checkpointing_ratio = 1.0;
  }

  const int dp_rank = plugin ? plugin->dp_rank() : 0;
  const int dp = plugin ? plugin->dp_size() : 1;
  TORCH_CHECK(
      a.batch_size % dp == 0,
      "--batch-size ",
      a.batch_size,
      " must split over the ",
      dp,
      " data-parallel ranks");
  const int64_t local = a.batch_size / dp;
  TORCH_CHECK(
      a.pp == 1 || local % a.pp == 0,
      "with --pp ",
      a.pp,
      " each data-parallel rank's batch (",
      local,
      ") must split into ",
      a.pp,
      " micro-batches");
  namespace ls = colossalai::nn::lr_scheduler;
  std::unique_ptr<ls::LRScheduler> scheduler;
  if (a.schedule == "cosine") {
    scheduler = std::make_unique<ls::CosineAnnealingWarmupLR>(
        *optimizer,
        ls::CosineAnnealingWarmupLROptions(a.steps)
            .warmup_steps(std::min(a.warmup, a.steps))
            .eta_min(0.1 * a.lr));
  }

  // NOTE [Training checkpoints]: one set per save under --checkpoint,
  // committed atomically; --resume takes the newest complete one.
  int64_t first = 0;
  if (a.resume) {
    first = booster
                .resume_or_start(
                    a.checkpoint,
                    boosted.model,
                    boosted.optimizer.get(),
                    scheduler.get())
                .step();
    TORCH_CHECK(
        first <= a.steps,
        "--resume: the newest checkpoint under '",
        a.checkpoint,
        "' is at step ",
        first,
        ", past --steps ",
        a.steps);
  }
  auto save_checkpoint = [&](int64_t step) {
    booster.save_checkpoint(
        a.checkpoint,
        cb::TrainingState().step(step),
        boosted.model,
        boosted.optimizer.get(),
        scheduler.get(),
        cb::TrainingCheckpointOptions().keep_last(a.keep_last));
  };

  // The same sequences for a step on every run (resume included): a fixed
  // permutation, consumed in order.
  // Training takes the permutation's first n sequences, evaluation (with
  // --eval-split) the rest, in whole batches (what does not fill one is
  // left out and counted).
  const int64_t n_all = data.size(0);
  const auto order =
      at::randperm(n_all, at::detail::createCPUGenerator(a.seed), at::kLong);
  const auto order_at = order.accessor<int64_t, 1>();
  const int64_t n_held = a.eval_split > 0
      ? std::max<int64_t>(1, std::llround(a.eval_split * n_all))
      : 0;
  const int64_t n = n_all - n_held;
  TORCH_CHECK(
      n >= 1,
      "--eval-split ",
      a.eval_split,
      " leaves no sequence to train on (",
      n_all,
      " in all)");
  const int64_t eval_batches = n_held / a.batch_size;
  TORCH_CHECK(
      n_held == 0 || eval_batches >= 1,
      "--eval-split holds out ",
      n_held,
      " sequences, fewer than one --batch-size ",
      a.batch_size,
      " batch; raise --eval-split or lower --batch-size");
  const int64_t eval_every =
      a.eval_every > 0 ? a.eval_every : std::max<int64_t>(1, a.steps / 5);
  // The model on the sequences `idx` picked: with --packing, their
  // positions too (and no attention mask: every token is real), so
  // attention stays inside each conversation.
  auto positions_of = [&](const at::Tensor& idx) {
    return positions.defined()
        ? positions.index_select(0, idx).narrow(1, 0, a.seq_len).contiguous()
        : at::Tensor();
  };
  // Its loss against the targets `y`, without the whole logits where one
  // rank holds the head (NOTE [Fused causal-LM loss]).
  auto loss_of = [&](const at::Tensor& x, const at::Tensor& y, const at::Tensor& idx) {
    const auto pos = positions_of(idx);
    return pos.defined() ? boosted.model.forward_loss(x, y, at::Tensor(), pos)
                         : boosted.model.forward_loss(x, y);
  };
  // A pipeline's step on the sequences `idx` picked (training, or under a
  // NoGradGuard the forwards only): the micro-batches carry the positions
  // with --packing (no attention mask). The loss comes back on the ranks
  // of the last stage.
  auto pipeline_step = [&](const at::Tensor& x,
                           const at::Tensor& y,
                           const at::Tensor& idx,
                           colossalai::interface::OptimizerWrapper* opt) {
    const auto pos = positions_of(idx);
    return booster
        .execute_pipeline(
            [&] {
              return pos.defined()
                  ? colossalai::pipeline::Batch{x, y, at::Tensor(), pos}
                  : colossalai::pipeline::Batch{x, y};
            },
            boosted.model,
            [&](const at::Tensor& logits,
                const colossalai::pipeline::Batch& mb) {
              return model->loss(logits, mb[1]);
            },
            opt)
        .loss;
  };
  // The held-out sequences' token-mean loss (every rank, no gradients).
  auto evaluate = [&]() {
    at::NoGradGuard no_grad;
    model->eval();
    auto sum = at::zeros({2}, at::kDouble);
    for (int64_t b = 0; b < eval_batches; ++b) {
      std::vector<int64_t> pick(local);
      for (int64_t i = 0; i < local; ++i) {
        pick[i] = order_at[n + b * a.batch_size + dp_rank * local + i];
      }
      const auto idx = at::tensor(pick, at::kLong);
      auto x = data.index_select(0, idx).narrow(1, 0, a.seq_len).contiguous();
      auto y = labels.index_select(0, idx).narrow(1, 1, a.seq_len).contiguous();
      const double count = y.ne(-100).sum().item<double>();
      const auto loss = a.pp > 1 ? pipeline_step(x, y, idx, nullptr)
                                 : loss_of(x, y, idx);
      if (loss.defined()) { // a pipeline's last stage only
        sum[0] +=
            loss.to(at::kCPU, at::kDouble).template item<double>() * count;
        sum[1] += count;
      }
    }
    // Over the data-parallel ranks; a pipeline's losses are on its last
    // stage (the same on each of its tensor ranks: counted alike in both
    // sums), so over every rank.
    if (plugin) {
      cd::all_reduce(sum, a.pp > 1 ? *cd::world_group() : *plugin->dp_group())
          .wait();
    }
    model->train();
    return sum[0].item<double>() / std::max(sum[1].item<double>(), 1.0);
  };
  std::vector<double> eval_x, eval_losses;
  std::ofstream eval_csv;
  if (rank == 0) {
    std::printf(
        "finetune_lm: %s (%lld parameters, %lld trainable), %zu documents, "
        "%lld sequences of %lld tokens; %d rank(s), plugin %s%s, %s%s%s\n",
        a.model_dir.empty() ? a.config.c_str() : a.model_dir.c_str(),
        static_cast<long long>([&] {
          int64_t c = 0;
          for (const auto& p : model->parameters()) {
            c += p.numel();
          }
          return c;
        }()),
        static_cast<long long>([&] {
          int64_t c = 0;
          for (const auto& p : model->parameters()) {
            c += p.requires_grad() ? p.numel() : 0;
          }
          return c;
        }()),
        docs.size(),
        static_cast<long long>(n),
        static_cast<long long>(a.seq_len),
        world,
        a.plugin.c_str(),
        a.plugin == "hybrid" || a.plugin == "moe_hybrid"
            ? (" (tp " + std::to_string(a.tp) + ", pp " + std::to_string(a.pp) +
               ", sp " + std::to_string(a.sp) + " " + a.sp_mode + ", zero " +
               std::to_string(a.zero) +
               (a.ep > 1 ? ", ep " + std::to_string(a.ep) : "") + ")")
                  .c_str()
            : "",
        a.lora ? (a.qlora ? "QLoRA" : "LoRA") : "full fine-tuning",
        host_states ? ", optimizer states in host memory (HybridAdam)" : "",
        a.grad_checkpoint ? ", every layer recomputed in backward" : "");
    if (first > 0) {
      std::printf(
          "resumed from '%s/checkpoint-%lld'\n",
          a.checkpoint.c_str(),
          static_cast<long long>(first));
    } else if (a.resume) {
      std::printf(
          "no complete checkpoint under '%s': starting at step 0\n",
          a.checkpoint.c_str());
    }
    if (sft) {
      std::printf(
          "supervised fine-tuning: %zu conversations (%s), %lld assistant "
          "tokens trained on, %lld truncated to --seq-len\n",
          conversations.size(),
          chat_template ? "the model's chat template"
                        : "no chat template: \"role: content\" lines",
          static_cast<long long>(sft_batch.trained_tokens),
          static_cast<long long>(sft_batch.truncated));
      if (a.packing) {
        std::printf(
            "packed %lld conversations into %lld sequences of %lld tokens\n",
            static_cast<long long>(sft_batch.conversations),
            static_cast<long long>(n_all),
            static_cast<long long>(a.seq_len + 1));
      }
    }
    if (n_held > 0) {
      std::printf(
          "evaluation: %lld held-out sequences in %lld batches every %lld "
          "steps (%lld left out to fill whole batches)\n",
          static_cast<long long>(n_held),
          static_cast<long long>(eval_batches),
          static_cast<long long>(eval_every),
          static_cast<long long>(n_held - eval_batches * a.batch_size));
      eval_csv.open(a.out + "/eval.csv");
      eval_csv << "step,loss,perplexity\n" << std::flush;
    }
  }

  std::vector<double> steps_x, losses;
  std::ofstream csv;
  if (rank == 0) {
    // A resumed run keeps the losses of the steps before its checkpoint
    // (the run it resumes wrote them to the same --out), so the file and
    // the plot cover the whole training.
    std::vector<std::string> kept;
    if (first > 0) {
      std::ifstream old(a.out + "/losses.csv");
      std::string line;
      while (std::getline(old, line)) {
        long long step = 0;
        double loss = 0;
        if (std::sscanf(line.c_str(), "%lld,%lf", &step, &loss) == 2 &&
            step >= 1 && step <= first) {
          kept.push_back(line);
          steps_x.push_back(static_cast<double>(step));
          losses.push_back(loss);
        }
      }
    }
    csv.open(a.out + "/losses.csv");
    csv << "step,loss,lr\n";
    for (const auto& line : kept) {
      csv << line << "\n";
    }
    csv << std::flush;
  }
  cb::PreemptionGuard preemption;
  const auto t0 = std::chrono::steady_clock::now();
  double tokens = 0;
  for (int64_t step = first; step < a.steps; ++step) {
    std::vector<int64_t> pick(local);
    for (int64_t i = 0; i < local; ++i) {
      pick[i] = order_at[(step * a.batch_size + dp_rank * local + i) % n];
    }
    const auto idx = at::tensor(pick, at::kLong);
    auto x = data.index_select(0, idx).narrow(1, 0, a.seq_len).contiguous();
    auto y = labels.index_select(0, idx).narrow(1, 1, a.seq_len).contiguous();
    torch::manual_seed(a.seed + 1000 + step); // dropout, resume or not
    boosted.optimizer->zero_grad();
    at::Tensor loss;
    if (a.pp > 1) {
      loss = pipeline_step(x, y, idx, boosted.optimizer.get());
    } else {
      loss = loss_of(x, y, idx);
      booster.backward(loss, *boosted.optimizer);
    }
    boosted.optimizer->step();
    const double lr = optimizer->param_groups()[0].options().get_lr();
    if (scheduler) {
      scheduler->step();
    }
    // The step's loss over the ranks that hold one (every rank, or the
    // last pipeline stage), averaged.
    auto sum = at::zeros({2}, at::kDouble);
    if (loss.defined()) {
      sum[0] = loss.detach().to(at::kCPU, at::kDouble).item<double>();
      sum[1] = 1;
    }
    if (distributed) {
      cd::all_reduce(sum, *cd::world_group()).wait();
    }
    const double l = sum[0].item<double>() / sum[1].item<double>();
    tokens += static_cast<double>(a.batch_size * a.seq_len);
    if (rank == 0) {
      steps_x.push_back(static_cast<double>(step + 1));
      losses.push_back(l);
      csv << step + 1 << "," << l << "," << lr << "\n" << std::flush;
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count();
      const double done = static_cast<double>(step + 1 - first);
      progress(
          step + 1,
          a.steps,
          l,
          tokens / s,
          s / done * static_cast<double>(a.steps - step - 1));
    }
    if (n_held > 0 &&
        ((step + 1) % eval_every == 0 || step + 1 == a.steps ||
         step + 1 == a.stop_after)) {
      const double eval_loss = evaluate();
      if (rank == 0) {
        eval_x.push_back(static_cast<double>(step + 1));
        eval_losses.push_back(eval_loss);
        eval_csv << step + 1 << "," << eval_loss << "," << std::exp(eval_loss)
                 << "\n"
                 << std::flush;
        std::printf(
            "\neval step %lld: loss %.4f, perplexity %.2f\n",
            static_cast<long long>(step + 1),
            eval_loss,
            std::exp(eval_loss));
        std::fflush(stdout);
      }
    }
    const bool saved = a.save_every > 0 && (step + 1) % a.save_every == 0;
    if (saved) {
      save_checkpoint(step + 1);
    }
    // SIGTERM on any rank (a pre-emption, the launcher stopping the job or
    // gone): all stop after this step with it saved, and a restart with
    // --resume goes on from there.
    if (preemption.requested()) {
      if (!saved) {
        save_checkpoint(step + 1);
      }
      if (rank == 0) {
        std::printf(
            "\nfinetune_lm: SIGTERM: stopped after step %lld, saved in "
            "'%s/checkpoint-%lld'\n",
            static_cast<long long>(step + 1),
            a.checkpoint.c_str(),
            static_cast<long long>(step + 1));
        std::fflush(stdout);
      }
      return 0;
    }
    if (step + 1 == a.stop_after) {
      break;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();

  // The result as transformers / PEFT load it.
  const std::string result = a.out + (lora ? "/adapter" : "/model");
  if (lora) {
    booster.save_lora_as_pretrained(boosted.model, result, true);
  } else {
    booster.save_model(
        boosted.model,
        result,
        colossalai::checkpoint_io::SaveModelOptions()
            .shard(true)
            .use_safetensors(true));
  }
  if (distributed) {
    cd::barrier(*cd::world_group()).wait();
  }
  if (rank != 0) {
    return 0;
  }
  std::printf("\n");
  if (!lora) {
    models::save_pretrained_config(config, result);
  }
  tok.save_pretrained(result);
  if (chat_template) {
    // transformers (4.43 on) reads the template from this file.
    std::ofstream(result + "/chat_template.jinja", std::ios::binary)
        << chat_template->source();
  }

  if (!losses.empty()) {
    finetune_lm::write_line_plot(
        a.out + "/loss.png",
        "finetune_lm: training loss",
        "step",
        "loss",
        eval_x.empty()
            ? std::vector<finetune_lm::Series>{{"loss", steps_x, losses}}
            : std::vector<finetune_lm::Series>{
                  {"loss", steps_x, losses},
                  {"eval loss", eval_x, eval_losses}});
  }
  auto mean = [](const std::vector<double>& v, size_t from, size_t to) {
    to = std::min(to, v.size());
    from = std::min(from, to);
    return to > from ? std::accumulate(v.begin() + from, v.begin() + to, 0.0) /
            static_cast<double>(to - from)
                     : 0.0;
  };
  const size_t k = std::max<size_t>(1, losses.size() / 10);
  std::printf(
      "\n| steps | loss (first %zu) | loss (last %zu) | tokens/s | time |\n"
      "|---|---|---|---|---|\n| %lld-%lld | %.4f | %.4f | %.0f | %s |\n\n",
      k,
      k,
      static_cast<long long>(steps_x.empty() ? first + 1 : steps_x.front()),
      static_cast<long long>(a.steps),
      mean(losses, 0, k),
      mean(losses, losses.size() - std::min(k, losses.size()), losses.size()),
      tokens / std::max(seconds, 1e-9),
      hms(seconds).c_str());
  std::printf(
      "loss curve: %s/loss.png; losses: %s/losses.csv\n",
      a.out.c_str(),
      a.out.c_str());
  std::printf(
      "saved: %s (%s)\n",
      result.c_str(),
      lora ? "PEFT adapter" : "transformers model");

  // Samples from the saved result, in this process.
  if (a.samples > 0) {
    M fresh =
        lora ? build_model<M>(a, tok) : models::from_pretrained<M>(result);
    if (lora) {
      auto l =
          colossalai::lora::LoraModel::from_pretrained(fresh.ptr(), result);
      if (a.qlora) {
        colossalai::quantization::quantize_model(*fresh, qlora_config());
      }
      l->refresh();
    }
    for (const auto& prompt : a.prompts) {
      std::printf("\nsamples of \"%s\":\n", prompt.c_str());
      for (const auto& s : sample(
               fresh,
               tok,
               prompt,
               a.samples,
               40,
               a.seq_len,
               a.temperature,
               a.seed,
               a.model_dir,
               chat_template.get())) {
        std::printf("--- %s\n", s.c_str());
      }
    }
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  // An error ends the process with 1, and under torchrun reaches its summary.
  return colossalai::record([&] {
    Args a = parse(argc, argv);
    if (a.plugin != "none" && !colossalai::launcher::launched_by_launcher()) {
      return colossalai::launcher::run_self(a.nproc, argc, argv);
    }
    const std::string type = a.model_dir.empty()
        ? (a.config == "gpt2-tiny" ? "gpt2" : "llama")
        : models::pretrained_model_type(a.model_dir);
    if (type == "gpt2") {
      return train<models::GPT2LMHeadModel>(a);
    }
    TORCH_CHECK(
        type == "llama" || type == "mistral" || type == "qwen2" ||
            type == "qwen3" || type == "mixtral" || type == "qwen2_moe" ||
            type == "qwen3_moe",
        "finetune_lm trains GPT-2 and the LLaMA family (llama, mistral, "
        "qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe); '",
        a.model_dir,
        "' holds a ",
        type);
    return train<models::LlamaForCausalLM>(a);
  });
}
