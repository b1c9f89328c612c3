// Training steps that do not make the host wait for the device. On a GPU a
// value read back (item(), a tensor's truth) or an output sized by the data
// (nonzero, bincount, ...) stops the host until the device's queue has
// drained, so the next kernels start late, and a CUDA graph cannot capture
// the step. The same operators run on the CPU, so these tests count them
// there (testing::host_syncs) for every family and plugin; on a GPU
// (tests/gpu/run.sh) they run as they are, and also count the copies to
// the host the host waits for (none exist on the CPU).
//
// The fused causal-LM loss checks its targets against the vocabulary on
// every call without a read: on a GPU the next call raises
// (kernels::synchronize_target_checks waits for the checks at once).
//
// What a step may still read, by design:
// - position_ids without an attention_mask are looked at once per forward
//   to tell packed documents from one sequence (as transformers does);
// - a pipeline counts each micro-batch's tokens on the batch as given (no
//   wait for a host batch);
// - LLM.int8's quantized layers find their outlier columns (as
//   bitsandbytes does);
// - fp16's loss scaler reads whether the gradients overflowed, to skip
//   the step (ColossalAI's does), except over FusedAdamW / FusedAdam,
//   which skip on the device (test_booster's GradScaler tests count that
//   step on the CPU, test_cuda's on a GPU; CPU LibTorch has no fp16
//   matmul, so fp16 mixed precision is not counted here);
// - MoE's expert loop copies the expert counts to the host once per sparse
//   layer to cut the rows (seen on a GPU only); grouped expert GEMMs
//   (models::set_grouped_expert_gemm) do not.

#include <harness/multiprocess.h>
#include <harness/test_util.h>

#include <colossalai/booster/booster.h>
#include <colossalai/initialize.h>
#include <colossalai/booster/plugin/gemini_plugin.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/booster/plugin/torch_fsdp_plugin.h>
#include <colossalai/lora/lora_model.h>
#include <colossalai/models/bert.h>
#include <colossalai/models/bloom.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/models/moe.h>
#include <colossalai/models/opt.h>
#include <colossalai/nn/optimizer/fused_adam.h>
#include <colossalai/quantization/bnb.h>
#include <colossalai/utils/compat.h>
#include <zoo/gpt.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

namespace cb = colossalai::booster;
namespace models = colossalai::models;
namespace zoo = colossalai::zoo;
using colossalai::testing::host_syncs;
using colossalai::testing::op_calls;

namespace {

using Syncs = std::map<std::string, int>;

struct StepSyncs {
  Syncs forward_backward; // the loss's forward and backward
  Syncs step; // the optimizer's step
};

std::string describe(const Syncs& syncs) {
  std::string s;
  for (const auto& kv : syncs) {
    s += kv.first + " x" + std::to_string(kv.second) + " ";
  }
  return s.empty() ? "none" : s;
}

// The second of two steps (the first makes the optimizer's state).
// `train(booster, boosted)` runs the loss's forward and backward.
template <class Model, class Train>
StepSyncs step_syncs(
    Model model,
    const cb::BoosterOptions& options,
    const Train& train,
    const std::function<void(cb::Booster&, Model&)>& before_boost = nullptr) {
  cb::Booster booster(options);
  if (before_boost) {
    before_boost(booster, model);
  }
  std::vector<at::Tensor> trainable;
  for (const auto& p : model->parameters()) {
    if (p.requires_grad()) {
      trainable.push_back(p);
    }
  }
  auto opt = std::make_shared<colossalai::nn::optimizer::FusedAdamW>(
      trainable, torch::optim::AdamWOptions(1e-3));
  auto boosted = booster.boost(model, opt);
  boosted.optimizer->zero_grad();
  train(booster, boosted);
  boosted.optimizer->step();
  boosted.optimizer->zero_grad();
  StepSyncs out;
  out.forward_backward = host_syncs(op_calls([&] { train(booster, boosted); }));
  out.step = host_syncs(op_calls([&] { boosted.optimizer->step(); }));
  return out;
}

const at::Tensor& batch() {
  static const at::Tensor ids = [] {
    auto gen = at::detail::createCPUGenerator(7);
    return at::randint(96, {4, 16}, gen); // ids every tiny config holds
  }();
  return ids;
}

// forward_loss(ids, ids, ...) and its backward through the booster.
template <class... Args>
auto causal_lm_step(Args... args) {
  return [=](cb::Booster& booster, auto& boosted) {
    auto loss = boosted.model.forward_loss(batch(), batch(), args...);
    booster.backward(loss, *boosted.optimizer);
  };
}

// A step whose forward and backward read `reads` values back, copy
// `copies` tensors to the host and nothing data-sized (what a test names),
// and whose optimizer step reads nothing.
void expect_reads(const StepSyncs& s, int reads, const std::string& what, int copies = 0) {
  Syncs want;
  if (reads > 0) {
    want["aten::_local_scalar_dense"] = reads;
  }
  if (copies > 0) {
    want[colossalai::testing::kCopyToHost] = copies;
  }
  EXPECT_EQ(s.forward_backward, want)
      << what << ": forward and backward read " << describe(s.forward_backward);
  EXPECT_TRUE(s.step.empty()) << what << ": the step read " << describe(s.step);
}

models::LlamaConfig moe_config(const std::string& type) {
  auto moe = models::MoeConfig().num_experts(4).num_experts_per_tok(2).output_router_logits(
      true);
  if (type == "qwen2_moe") {
    moe.shared_expert_intermediate_size(16);
  }
  return models::LlamaConfig::tiny_test().model_type(type).moe(moe);
}

// bf16 Gemini with chunks small enough to be sharded (a tiny model
// otherwise stays one chunk gathered on every rank).
cb::plugin::GeminiPluginOptions gemini() {
  return cb::plugin::GeminiPluginOptions().precision("bf16").chunk_size(1024);
}

cb::BoosterOptions hybrid(const cb::plugin::HybridParallelPluginOptions& o) {
  return cb::BoosterOptions().plugin(std::make_shared<cb::plugin::HybridParallelPlugin>(o));
}

cb::BoosterOptions zero(int stage, double max_norm = 0) {
  return cb::BoosterOptions().plugin(std::make_shared<cb::plugin::LowLevelZeroPlugin>(
      cb::plugin::LowLevelZeroPluginOptions()
          .stage(stage)
          .precision("bf16")
          .overlap_communication(true)
          .max_norm(max_norm)));
}

} // namespace

// The counter sees reads back and data-sized outputs, and leaves out what
// ATen's CPU fused AdamW reads inside itself (its CUDA kernel reads the
// step counts on the device).
TEST(HostSyncs, CountsReadsBackAndDataSizedOutputs) {
  const auto x = at::arange(6, at::kLong);
  EXPECT_EQ(host_syncs(op_calls([&] { (void)x.sum().item<int64_t>(); })),
            (Syncs{{"aten::_local_scalar_dense", 1}}));
  EXPECT_EQ(host_syncs(op_calls([&] { (void)at::bincount(x); })).count("aten::bincount"), 1u);
  EXPECT_EQ(host_syncs(op_calls([&] { (void)x.gt(2).nonzero(); })),
            (Syncs{{"aten::nonzero", 1}}));
  EXPECT_EQ(host_syncs(op_calls([&] { (void)x.index({x.gt(2)}); })),
            (Syncs{{"aten::nonzero", 1}}));
  EXPECT_TRUE(host_syncs(op_calls([&] { (void)(x * 2).cumsum(0); })).empty());
  // A copy to the host the host waits for: none on the CPU; from a GPU,
  // blocking or into pageable memory, not into pinned memory asynchronously.
  EXPECT_TRUE(host_syncs(op_calls([&] { (void)x.cpu(); })).empty());
  if (torch::cuda::is_available()) {
    const auto d = x.cuda();
    const Syncs one{{colossalai::testing::kCopyToHost, 1}};
    EXPECT_EQ(host_syncs(op_calls([&] { (void)d.cpu(); })), one);
    const auto pageable = at::empty({6}, at::kLong);
    EXPECT_EQ(host_syncs(op_calls([&] { pageable.copy_(d, /*non_blocking=*/true); })), one);
    const auto pinned = at::empty({6}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    EXPECT_TRUE(host_syncs(op_calls([&] { pinned.copy_(d, /*non_blocking=*/true); })).empty());
  }
  // FusedAdamW's step on the CPU: ATen's fused kernel, where this LibTorch
  // has one for the CPU, reads each step count inside itself.
  auto p = torch::randn({3}).requires_grad_();
  p.mutable_grad() = torch::ones({3});
  colossalai::nn::optimizer::FusedAdamW opt({p}, torch::optim::AdamWOptions(1e-3));
  const auto calls = op_calls([&] { opt.step(); });
  EXPECT_TRUE(host_syncs(calls).empty()) << describe(host_syncs(calls));
  if (calls.count("aten::_fused_adamw_") > 0) {
    EXPECT_EQ(calls.count("aten::_fused_adamw_ > aten::_local_scalar_dense"), 1u);
  }
}

// Every family at one rank, under autocast and under LowLevelZero's bf16
// weights: forward, backward and the optimizer's step read nothing back,
// the fused loss's target check, a padding mask and a mixture of experts
// included (their expert counts come from the sorted routing, not
// bincount; on a GPU the expert loop then copies them to the host once per
// sparse layer, grouped expert GEMMs do not).
TEST(HostSyncs, EveryFamilyReadsNothingAtOneRank) {
  colossalai::testing::run_distributed(1, [](int, int) {
    const auto mask = at::ones({4, 16}, at::kLong).index_put_({0, at::indexing::Slice(0, 3)}, 0);
    for (const bool zero1 : {false, true}) {
      // A plugin boosts one model: each run makes its own.
      const auto options = [zero1] {
        return zero1 ? zero(1) : cb::BoosterOptions().mixed_precision("bf16");
      };
      const std::string on = zero1 ? " zero1" : " autocast";
      expect_reads(
          step_syncs(
              zoo::GPT(zoo::GPTConfig::tiny_test()),
              options(),
              [](cb::Booster& booster, auto& boosted) {
                auto loss = boosted.model(batch(), batch());
                booster.backward(loss, *boosted.optimizer);
              }),
          0,
          "zoo GPT" + on);
      expect_reads(
          step_syncs(models::LlamaForCausalLM(models::LlamaConfig::tiny_test()), options(), causal_lm_step()),
          0,
          "LLaMA" + on);
      expect_reads(
          step_syncs(models::LlamaForCausalLM(models::LlamaConfig::tiny_test()), options(), causal_lm_step(mask)),
          0,
          "LLaMA, padding mask" + on);
      expect_reads(
          step_syncs(models::GPT2LMHeadModel(models::GPT2Config::tiny_test()), options(), causal_lm_step()),
          0,
          "GPT-2" + on);
      expect_reads(
          step_syncs(models::BloomForCausalLM(models::BloomConfig::tiny_test()), options(), causal_lm_step(mask)),
          0,
          "BLOOM" + on);
      expect_reads(
          step_syncs(models::OPTForCausalLM(models::OPTConfig::tiny_test()), options(), causal_lm_step(mask)),
          0,
          "OPT" + on);
      // The expert loop copies each sparse layer's counts to the host (seen
      // on a GPU); grouped expert GEMMs keep them on the device where they
      // apply (bf16 on a Hopper / Blackwell GPU, the CPU; LibTorch 2.10+).
      const auto device = colossalai::current_device();
      const bool grouped_applies = colossalai::compat::has_grouped_mm(device, at::kBFloat16);
      for (const std::string type : {"mixtral", "qwen2_moe"}) {
        for (const bool grouped : {false, true}) {
          const int copies = device.is_cpu() || (grouped && grouped_applies) ? 0 : 2;
          const std::string name = type + (grouped ? " grouped" : "") + on;
          auto model = [&] {
            models::LlamaForCausalLM m(moe_config(type));
            models::set_grouped_expert_gemm(*m, grouped);
            return m;
          };
          expect_reads(step_syncs(model(), options(), causal_lm_step()), 0, name, copies);
          expect_reads(step_syncs(model(), options(), causal_lm_step(mask)), 0, name + ", padding mask", copies);
        }
      }
      models::BertForMaskedLM bert(models::BertConfig::tiny_test());
      expect_reads(
          step_syncs(
              bert,
              options(),
              [&](cb::Booster& booster, auto& boosted) {
                auto loss = bert->loss(boosted.model(batch()), batch());
                booster.backward(loss, *boosted.optimizer);
              }),
          0,
          "BERT" + on);
    }
  });
}

// The sharding plugins add no reads: data parallel (DDP, FSDP, ZeRO-2 with
// overlapped reductions, Gemini), tensor parallel (with ZeRO-1, with
// split-gather sequence parallelism) and the sequence-parallel modes
// (Ulysses, ring attention: which blocks of the causal mask are empty,
// full or partial comes from the host's positions); max_norm's clipping
// over several ranks scales by a coefficient left on the device.
TEST(HostSyncs, ShardingPluginsAddNoReads) {
  colossalai::testing::run_distributed(2, [](int, int) {
    namespace cp = cb::plugin;
    using HPO = cp::HybridParallelPluginOptions;
    // A plugin boosts one model: each run makes its own.
    const std::vector<std::pair<std::string, std::function<cb::BoosterOptions()>>> plugins = {
        {"ddp", [] { return cb::BoosterOptions().plugin(std::make_shared<cp::TorchDDPPlugin>()); }},
        {"fsdp", [] { return cb::BoosterOptions().plugin(std::make_shared<cp::TorchFSDPPlugin>()); }},
        {"zero2", [] { return zero(2); }},
        {"zero2 max_norm", [] { return zero(2, 0.5); }},
        {"gemini",
         [] {
           return cb::BoosterOptions().plugin(
               std::make_shared<cp::GeminiPlugin>(gemini()));
         }},
        {"gemini max_norm",
         [] {
           return cb::BoosterOptions().plugin(std::make_shared<cp::GeminiPlugin>(
               gemini().max_norm(0.5)));
         }},
        {"tp2", [] { return hybrid(HPO().tp_size(2).precision("bf16")); }},
        {"tp2 max_norm", [] { return hybrid(HPO().tp_size(2).precision("bf16").max_norm(0.5)); }},
        {"tp2 zero1", [] { return hybrid(HPO().tp_size(2).zero_stage(1).precision("bf16")); }},
        {"tp2 zero1 max_norm",
         [] { return hybrid(HPO().tp_size(2).zero_stage(1).precision("bf16").max_norm(0.5)); }},
        {"tp2 split_gather",
         [] { return hybrid(HPO().tp_size(2).precision("bf16").enable_sequence_parallelism(true).sequence_parallelism_mode(
             "split_gather")); }},
        {"sp2 all_to_all",
         [] { return hybrid(HPO().sp_size(2).precision("bf16").enable_sequence_parallelism(true).sequence_parallelism_mode(
             "all_to_all")); }},
        {"sp2 ring_attn",
         [] { return hybrid(HPO().sp_size(2).precision("bf16").enable_sequence_parallelism(true).sequence_parallelism_mode(
             "ring_attn")); }},
    };
    for (const auto& [name, options] : plugins) {
      expect_reads(
          step_syncs(models::LlamaForCausalLM(models::LlamaConfig::tiny_test()), options(), causal_lm_step()),
          0,
          "LLaMA " + name);
      expect_reads(
          step_syncs(models::GPT2LMHeadModel(models::GPT2Config::tiny_test()), options(), causal_lm_step()),
          0,
          "GPT-2 " + name);
    }
  });
}

// Packed documents (position_ids restarting inside a row, no mask): one
// read tells them from a single sequence, as transformers' check does.
TEST(HostSyncs, PackedDocumentsAreToldApartWithOneRead) {
  colossalai::testing::run_distributed(1, [](int, int) {
    const auto pos = at::cat({at::arange(8), at::arange(8)}).repeat({4, 1});
    expect_reads(
        step_syncs(
            models::LlamaForCausalLM(models::LlamaConfig::tiny_test()),
            cb::BoosterOptions().mixed_precision("bf16"),
            causal_lm_step(at::Tensor(), pos)),
        1,
        "LLaMA, packed documents");
  });
}

// A pipeline's step counts each micro-batch's tokens where the batch is,
// before it moves (a host batch: no wait on a GPU), and reads nothing else.
TEST(HostSyncs, PipelineReadsOnlyTheHostBatchesTokenCounts) {
  colossalai::testing::run_distributed(2, [](int, int) {
    models::LlamaForCausalLM model(models::LlamaConfig::tiny_test());
    const auto s = step_syncs(
        model,
        hybrid(cb::plugin::HybridParallelPluginOptions().pp_size(2).num_microbatches(2).precision("bf16")),
        [&](cb::Booster& booster, auto& boosted) {
          booster.execute_pipeline(
              [] { return colossalai::pipeline::Batch{batch(), batch()}; },
              boosted.model,
              [&](const at::Tensor& logits, const colossalai::pipeline::Batch& mb) {
                return model->loss(logits, mb[1]);
              },
              boosted.optimizer.get());
        });
    expect_reads(s, 2, "LLaMA pp2, 2 micro-batches");
  });
}

// Adapters add no reads: LoRA under ZeRO-2, QLoRA's NF4 base. LLM.int8's
// base finds its outlier columns once per quantized layer's forward (a
// data-sized index, as bitsandbytes' does).
TEST(HostSyncs, AdaptersAddNoReads) {
  colossalai::testing::run_distributed(1, [](int, int) {
    namespace cq = colossalai::quantization;
    const auto lora = colossalai::lora::LoraConfig().r(4).lora_alpha(8).target_modules(
        {"q_proj", "v_proj"});
    using Model = models::LlamaForCausalLM;
    auto run = [&](const cb::BoosterOptions& options, const std::optional<cq::BnbQuantizationConfig>& q) {
      return step_syncs(
          Model(models::LlamaConfig::tiny_test()),
          options,
          causal_lm_step(),
          std::function<void(cb::Booster&, Model&)>([&](cb::Booster& b, Model& m) {
            b.enable_lora(m, "", lora, q, q.has_value());
          }));
    };
    expect_reads(run(zero(2), std::nullopt), 0, "LoRA, ZeRO-2");
    expect_reads(
        run(cb::BoosterOptions().mixed_precision("bf16"), cq::BnbQuantizationConfig().load_in_4bit(true)),
        0,
        "QLoRA NF4");
    const auto int8 =
        run(cb::BoosterOptions().mixed_precision("bf16"), cq::BnbQuantizationConfig().load_in_8bit(true));
    const int64_t linears = 7 * models::LlamaConfig::tiny_test().num_hidden_layers();
    EXPECT_EQ(int8.forward_backward, (Syncs{{"aten::nonzero", linears}}))
        << describe(int8.forward_backward);
    EXPECT_TRUE(int8.step.empty()) << describe(int8.step);
  });
}
