// HybridParallelPlugin: tensor, sequence and data parallelism on the zoo's
// Hugging Face-layout GPT-2 and LLaMA, checked against one process training
// the whole model on the same global batch.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/shardformer/layer/linear.h>
#include <colossalai/shardformer/policy.h>
#include <colossalai/utils/compat.h>
#include <harness/multiprocess.h>
#include <harness/test_util.h>
#include <harness/zoo_util.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <unistd.h>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
namespace sf = colossalai::shardformer;
namespace models = colossalai::models;
using cb::plugin::HybridParallelPlugin;
using HPO = cb::plugin::HybridParallelPluginOptions;
using colossalai::testing::run_distributed;

namespace {

constexpr int kSteps = 3;
constexpr int kGlobalBatch = 4;
constexpr int64_t kSeq = 16;

// fp32 bounds against one process. Tensor parallelism splits each matmul's
// reduction (row-parallel partial sums) and data parallelism the batch
// mean, so results differ from one process by rounding alone: a few fp32
// ulps per operation (6e-8 relative), grown through 2 blocks and 3 steps.
// The weights are O(0.1) and SGD's updates lr x grad ~1e-3, so rounding of
// the updates stays below 1e-6; 2e-5 leaves a factor 20 for other CPUs'
// BLAS summation orders. AdamW divides by sqrt(v): where v is tiny, rounding
// of g reaches the update at full size, at most lr (1 - b1) / sqrt(1 - b2)
// = 3.2 lr per step (the same argument as test_strategies).
constexpr double kSgdAtol = 2e-5;
constexpr double kLossTol = 1e-5;

struct Setup {
  std::string name;
  HPO options;
};

std::vector<Setup> setups(int world, bool llama) {
  auto base = []() { return HPO().precision("fp32"); };
  std::vector<Setup> s;
  if (world == 2) {
    s.push_back({"tp2", base().tp_size(2)});
    s.push_back(
        {"tp2_split_gather",
         base()
             .tp_size(2)
             .enable_sequence_parallelism(true)
             .sequence_parallelism_mode("split_gather")});
    s.push_back(
        {"tp2_split_gather_overlap",
         base()
             .tp_size(2)
             .enable_sequence_parallelism(true)
             .sequence_parallelism_mode("split_gather")
             .enable_sequence_overlap(true)});
    s.push_back(
        {"tp2_ring",
         base()
             .tp_size(2)
             .enable_sequence_parallelism(true)
             .sequence_parallelism_mode("ring")});
    s.push_back(
        {"sp2_ring_attn",
         base()
             .sp_size(2)
             .enable_sequence_parallelism(true)
             .sequence_parallelism_mode("ring_attn")});
    return s;
  }
  s.push_back({"tp4", base().tp_size(4).zero_stage(0)});
  s.push_back({"tp2_dp2", base().tp_size(2)});
  s.push_back({"tp2_zero1", base().tp_size(2).zero_stage(1)});
  s.push_back({"tp2_zero2", base().tp_size(2).zero_stage(2)});
  // NOTE [All-gathers overlap the next forward]: the blocks wait for their
  // parameters; recomputed ones run their forward again in backward.
  s.push_back(
      {"tp2_zero1_overlap_allgather",
       base().tp_size(2).zero_stage(1).overlap_allgather(true)});
  s.push_back(
      {"tp2_zero2_overlap_allgather_checkpoint_all",
       base()
           .tp_size(2)
           .zero_stage(2)
           .overlap_allgather(true)
           .gradient_checkpointing_ratio(1.0)});
  s.push_back(
      {"tp4_ring",
       base()
           .tp_size(4)
           .enable_sequence_parallelism(true)
           .sequence_parallelism_mode("ring")});
  s.push_back(
      {"tp2_dp2_split_gather",
       base()
           .tp_size(2)
           .zero_stage(1)
           .enable_sequence_parallelism(true)
           .sequence_parallelism_mode("split_gather")});
  s.push_back(
      {"tp2_dp2_zero2_split_gather_overlap",
       base()
           .tp_size(2)
           .zero_stage(2)
           .enable_sequence_parallelism(true)
           .sequence_parallelism_mode("split_gather")
           .enable_sequence_overlap(true)});
  if (llama) {
    // Four ring hops: the zigzag chunks are 2 tokens of 16.
    s.push_back(
        {"sp4_zero1_ring_attn",
         base()
             .sp_size(4)
             .zero_stage(1)
             .enable_sequence_parallelism(true)
             .sequence_parallelism_mode("ring_attn")});
  } else {
    // Logits gathered over sp (and tp): the loss on the whole sequence.
    s.push_back(
        {"tp2_sp2_all_to_all_gathered_output",
         base()
             .tp_size(2)
             .sp_size(2)
             .parallel_output(false)
             .enable_sequence_parallelism(true)
             .sequence_parallelism_mode("all_to_all")});
    s.push_back(
        {"tp2_sp2_ring_attn",
         base()
             .tp_size(2)
             .sp_size(2)
             .enable_sequence_parallelism(true)
             .sequence_parallelism_mode("ring_attn")});
    // Double ring: two inner rings of 2 joined by two inter rings.
    s.push_back(
        {"sp4_ring_attn_double_ring",
         base()
             .sp_size(4)
             .enable_sequence_parallelism(true)
             .sequence_parallelism_mode("ring_attn")
             .inner_ring_size(2)});
  }
  if (llama) {
    // Four key/value heads: all_to_all over 2 ranks beside tp 2 would
    // leave one per rank; run it at tp 1.
    s.push_back(
        {"sp2_dp2_all_to_all",
         base()
             .sp_size(2)
             .zero_stage(1)
             .enable_sequence_parallelism(true)
             .sequence_parallelism_mode("all_to_all")});
  } else {
    s.push_back(
        {"tp2_sp2_all_to_all",
         base()
             .tp_size(2)
             .sp_size(2)
             .enable_sequence_parallelism(true)
             .sequence_parallelism_mode("all_to_all")});
  }
  // Recomputed blocks run their collectives again inside backward.
  s.push_back(
      {"tp2_dp2_checkpoint_all",
       base().tp_size(2).gradient_checkpointing_ratio(1.0)});
  s.push_back(
      {"tp2_zero2_split_gather_checkpoint_half",
       base()
           .tp_size(2)
           .zero_stage(2)
           .enable_sequence_parallelism(true)
           .sequence_parallelism_mode("split_gather")
           .gradient_checkpointing_ratio(0.5)});
  s.push_back({"tp2_dp2_clip", base().tp_size(2).zero_stage(2).max_norm(0.05)});
  s.push_back({"tp2_dp2_clip_ddp", base().tp_size(2).max_norm(0.05)});
  return s;
}

std::pair<at::Tensor, at::Tensor> batch(int step, int64_t vocab) {
  auto gen = at::detail::createCPUGenerator(500 + step);
  auto tokens = at::randint(vocab, {kGlobalBatch, kSeq + 1}, gen);
  return {
      tokens.narrow(1, 0, kSeq).contiguous(),
      tokens.narrow(1, 1, kSeq).contiguous()};
}

template <class Model>
Model make(bool) {
  torch::manual_seed(7);
  if constexpr (std::is_same_v<Model, models::GPT2LMHeadModel>) {
    return models::GPT2LMHeadModel(models::GPT2Config::tiny_test());
  } else {
    return models::LlamaForCausalLM(models::LlamaConfig::tiny_test());
  }
}

std::shared_ptr<torch::optim::Optimizer> make_opt(
    const std::vector<at::Tensor>& params,
    bool sgd) {
  return colossalai::testing::make_optimizer(params, sgd);
}

using colossalai::testing::whole_weights;

// One process training the whole model on the global batch; `max_norm` > 0
// clips as torch.nn.utils.clip_grad_norm_.
template <class Model>
std::pair<std::vector<double>, std::map<std::string, at::Tensor>> reference(
    bool sgd,
    double max_norm = 0) {
  auto model = make<Model>(sgd);
  const int64_t vocab = model->config().vocab_size();
  return colossalai::testing::train_one_process(
      model, kSteps, sgd, max_norm, [vocab](int step) {
        return batch(step, vocab);
      });
}

template <class Model>
void check_setups(int world, bool sgd) {
  constexpr bool llama = std::is_same_v<Model, models::LlamaForCausalLM>;
  const auto ref = reference<Model>(sgd);
  // Every other setup trains through forward_loss (NOTE [Fused causal-LM
  // loss]: vocabulary-parallel chunks under tp, loss(logits) under a
  // sequence split), the rest through loss(logits).
  bool fused = false;
  for (const auto& s : setups(world, llama)) {
    fused = !fused;
    SCOPED_TRACE(
        s.name + (sgd ? ", SGD" : ", AdamW") + (fused ? ", forward_loss" : ""));
    auto plugin = std::make_shared<HybridParallelPlugin>(s.options);
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make<Model>(sgd);
    auto boosted = booster.boost(model, make_opt(model->parameters(), sgd));
    if (s.options.enable_sequence_overlap()) {
      // Every column layer takes the overlapped path (NOTE [Sequence
      // overlap]).
      int columns = 0;
      for (const auto& m : model->modules()) {
        if (auto* col = m->template as<
                        colossalai::shardformer::layer::Linear1D_Col>()) {
          EXPECT_TRUE(col->overlaps()) << m->name();
          ++columns;
        }
      }
      EXPECT_GT(columns, 0);
    }
    // Double ring: the attention's chunks cross on the inter rings.
    const auto& rings = model->parallel_state().rings;
    ASSERT_EQ(rings.defined(), s.options.inner_ring_size() > 0);
    const int64_t inter_bytes =
        rings.defined() ? rings.inter->bytes_communicated() : 0;
    const int dp = plugin->dp_size();
    ASSERT_EQ(kGlobalBatch % dp, 0);
    const int64_t micro = kGlobalBatch / dp;
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto b = batch(step, model->config().vocab_size());
      auto x = b.first.narrow(0, micro * plugin->dp_rank(), micro);
      auto y = b.second.narrow(0, micro * plugin->dp_rank(), micro);
      boosted.optimizer->zero_grad();
      at::Tensor loss = fused ? boosted.model.forward_loss(x, y)
                              : model->loss(boosted.model(x), y);
      booster.backward(loss, *boosted.optimizer);
      boosted.optimizer->step();
      // The global loss: the mean over the data-parallel ranks' batches.
      at::Tensor l = loss.detach().to(at::kFloat).reshape({1}).clone();
      cd::all_reduce(l, *plugin->dp_group()).wait();
      losses.push_back(l.item<double>() / dp);
    }
    if (rings.defined()) {
      EXPECT_GT(rings.inter->bytes_communicated(), inter_bytes);
    }
    const bool clip = s.options.max_norm() > 0;
    const auto expect =
        clip ? reference<Model>(sgd, s.options.max_norm()) : ref;
    for (int step = 0; step < kSteps; ++step) {
      EXPECT_NEAR(losses[step], expect.first[step], kLossTol)
          << "step " << step;
    }
    boosted.model.wrapper()->synchronize_weights(); // overlap_allgather
    auto got = whole_weights(*model, plugin->shard_info());
    ASSERT_EQ(got.size(), expect.second.size());
    const double atol = sgd ? kSgdAtol : 2 * kSteps * 3.2e-3;
    for (const auto& kv : expect.second) {
      ASSERT_TRUE(got.count(kv.first)) << kv.first;
      const at::Tensor& g = got.at(kv.first);
      ASSERT_EQ(g.sizes(), kv.second.sizes()) << kv.first;
      const at::Tensor diff = g - kv.second;
      EXPECT_LE(diff.abs().max().item<double>(), atol) << kv.first;
    }
  }
}

// NOTE [A backward that raised]: a backward raised halfway on every rank
// alike (a hook on a parameter in the middle of the model, after the later
// blocks' tensor-, sequence- and data-parallel collectives ran) is dropped
// under HybridParallel too: zero_grad and the step again give the weights
// of training without the raise, bit for bit. NOTE [A step that raised]:
// so is a step whose optimizer raised on every rank, after the step's
// gradient sums and clipping: as a step not taken.
enum class Raising { kNone, kBackward, kStep, kSkipStep };

std::map<std::string, at::Tensor> train_raising(
    const HPO& options,
    Raising raise) {
  auto plugin = std::make_shared<HybridParallelPlugin>(options);
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  auto model = make<models::GPT2LMHeadModel>(false);
  bool raising_step = false;
  auto boosted = booster.boost(
      model,
      colossalai::testing::make_optimizer(
          model->parameters(), false, &raising_step));
  bool raising = false;
  const auto params = model->parameters();
  params[params.size() / 2].register_hook([&raising](const at::Tensor& g) {
    TORCH_CHECK(!raising, "a hook raised");
    return g;
  });
  const int64_t micro = kGlobalBatch / plugin->dp_size();
  for (int step = 0; step < kSteps; ++step) {
    auto b = batch(step, model->config().vocab_size());
    auto x = b.first.narrow(0, micro * plugin->dp_rank(), micro);
    auto y = b.second.narrow(0, micro * plugin->dp_rank(), micro);
    boosted.optimizer->zero_grad();
    if (raise == Raising::kBackward && step == 1) {
      raising = true;
      const auto msg = colossalai::testing::error_of([&] {
        booster.backward(model->loss(boosted.model(x), y), *boosted.optimizer);
      });
      raising = false;
      EXPECT_NE(msg.find("a hook raised"), std::string::npos) << msg;
      boosted.optimizer->zero_grad();
    }
    booster.backward(model->loss(boosted.model(x), y), *boosted.optimizer);
    if (step == 1 && raise == Raising::kSkipStep) {
      continue;
    }
    raising_step = step == 1 && raise == Raising::kStep;
    const auto msg =
        colossalai::testing::error_of([&] { boosted.optimizer->step(); });
    // The optimizer's own error (the ranks agreed), not a DistributedError.
    EXPECT_EQ(msg.rfind("a step raised", 0), raising_step ? 0 : msg.npos)
        << msg;
    raising_step = false;
  }
  boosted.model.wrapper()->synchronize_weights(); // overlap_allgather
  return whole_weights(*model, plugin->shard_info());
}

void raised_pass_or_step_dropped(int world) {
  run_distributed(world, [world](int, int) {
    for (const auto& s : setups(world, false)) {
      SCOPED_TRACE(s.name);
      for (auto raise : {Raising::kBackward, Raising::kStep}) {
        const auto want = train_raising(
            s.options,
            raise == Raising::kStep ? Raising::kSkipStep : Raising::kNone);
        const auto got = train_raising(s.options, raise);
        ASSERT_EQ(got.size(), want.size());
        for (const auto& kv : want) {
          EXPECT_TRUE(at::equal(got.at(kv.first), kv.second))
              << kv.first << (raise == Raising::kStep ? ", step" : "");
        }
      }
    }
  });
}

TEST(HybridParallel, ARaisedBackwardOrStepIsDroppedOnTwoRanks) {
  raised_pass_or_step_dropped(2);
}

TEST(HybridParallel, ARaisedBackwardOrStepIsDroppedOnFourRanks) {
  raised_pass_or_step_dropped(4);
}

TEST(HybridParallel, Gpt2MatchesOneProcessOnTwoRanks) {
  run_distributed(2, [](int, int world) {
    check_setups<models::GPT2LMHeadModel>(world, true);
  });
}

TEST(HybridParallel, Gpt2MatchesOneProcessOnFourRanks) {
  run_distributed(4, [](int, int world) {
    check_setups<models::GPT2LMHeadModel>(world, true);
    check_setups<models::GPT2LMHeadModel>(world, false);
  });
}

TEST(HybridParallel, LlamaMatchesOneProcessOnFourRanks) {
  run_distributed(4, [](int, int world) {
    check_setups<models::LlamaForCausalLM>(world, true);
    check_setups<models::LlamaForCausalLM>(world, false);
  });
}

TEST(HybridParallel, WholeModelIsAPlainHuggingFaceLayout) {
  models::GPT2LMHeadModel gpt2(models::GPT2Config::tiny_test());
  auto p = gpt2->named_parameters();
  ASSERT_TRUE(p.contains("transformer.h.0.attn.c_attn.weight"));
  EXPECT_EQ(
      p["transformer.h.0.attn.c_attn.weight"].sizes(),
      at::IntArrayRef({32, 96})); // Conv1D: [in, out]
  EXPECT_EQ(p["transformer.wte.weight"].sizes(), at::IntArrayRef({100, 32}));
  EXPECT_FALSE(p.contains("lm_head.weight")); // tied to wte
  models::LlamaForCausalLM llama(models::LlamaConfig::tiny_test());
  auto q = llama->named_parameters();
  EXPECT_EQ(
      q["model.layers.1.self_attn.k_proj.weight"].sizes(),
      at::IntArrayRef({16, 32})); // 4 key/value heads x 4
  EXPECT_EQ(q["lm_head.weight"].sizes(), at::IntArrayRef({100, 32}));
  EXPECT_TRUE(q.contains("model.layers.0.post_attention_layernorm.weight"));
}

using colossalai::testing::remove_scratch;
using colossalai::testing::scratch;

// Saved at tp 2 x dp 2, the checkpoint holds whole Hugging Face-layout
// tensors: a plain model, a tp 4 model and a DDP model load it and hold the
// same weights.
TEST(HybridParallel, CheckpointFromTp2LoadsAtTp1Tp4AndUnderDdp) {
  run_distributed(4, [](int rank, int) {
    const auto dir = scratch(colossalai::testing::test_process(), "ckpt");
    std::map<std::string, at::Tensor> saved;
    {
      auto plugin = std::make_shared<HybridParallelPlugin>(
          HPO().precision("fp32").tp_size(2).zero_stage(1));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = make<models::GPT2LMHeadModel>(true);
      auto boosted = booster.boost(model, make_opt(model->parameters(), false));
      auto b = batch(0, 100);
      auto loss = model->loss(boosted.model(b.first), b.second);
      booster.backward(loss, *boosted.optimizer);
      boosted.optimizer->step();
      saved = whole_weights(*model, plugin->shard_info());
      booster.save_model(
          boosted.model,
          dir + "/model.safetensors",
          colossalai::checkpoint_io::SaveModelOptions().use_safetensors(true));
      booster.save_model(
          boosted.model,
          dir + "/sharded",
          colossalai::checkpoint_io::SaveModelOptions()
              .shard(true)
              .size_per_shard(1));
      booster.save_optimizer(*boosted.optimizer, dir + "/optim.bin");
    }
    auto expect_equal = [&](const std::map<std::string, at::Tensor>& got,
                            const std::string& what) {
      ASSERT_EQ(got.size(), saved.size()) << what;
      for (const auto& kv : saved) {
        EXPECT_TRUE(at::equal(got.at(kv.first), kv.second))
            << what << ": " << kv.first;
      }
    };
    {
      // tp 1: a plain model, no plugin.
      torch::manual_seed(99 + rank);
      models::GPT2LMHeadModel plain(models::GPT2Config::tiny_test());
      colossalai::checkpoint_io::GeneralCheckpointIO io;
      colossalai::interface::ModelWrapper wrapped(plain.ptr());
      io.load_model(wrapped, dir + "/model.safetensors");
      expect_equal(whole_weights(*plain, sf::ShardInfo()), "tp 1");
    }
    {
      auto plugin = std::make_shared<HybridParallelPlugin>(
          HPO().precision("fp32").tp_size(4).zero_stage(2));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      torch::manual_seed(5);
      models::GPT2LMHeadModel m(models::GPT2Config::tiny_test());
      auto boosted = booster.boost(m, make_opt(m->parameters(), false));
      // Streamed: each rank cuts its shards from the file's whole tensors;
      // nothing crosses the tensor group (no rank holds the whole model).
      const int64_t tp_bytes = plugin->tp_group()->bytes_communicated();
      booster.load_model(boosted.model, dir + "/sharded");
      EXPECT_EQ(plugin->tp_group()->bytes_communicated(), tp_bytes);
      expect_equal(whole_weights(*m, plugin->shard_info()), "tp 4");
      booster.load_optimizer(*boosted.optimizer, dir + "/optim.bin");
      // One more step from the loaded state runs.
      auto b = batch(1, 100);
      auto loss = m->loss(boosted.model(b.first), b.second);
      booster.backward(loss, *boosted.optimizer);
      boosted.optimizer->step();
      EXPECT_TRUE(std::isfinite(loss.item<double>()));
    }
    {
      cb::Booster booster(cb::BoosterOptions().plugin(
          std::make_shared<cb::plugin::TorchDDPPlugin>()));
      torch::manual_seed(6);
      models::GPT2LMHeadModel m(models::GPT2Config::tiny_test());
      auto boosted = booster.boost(m, make_opt(m->parameters(), false));
      booster.load_model(boosted.model, dir + "/model.safetensors");
      expect_equal(whole_weights(*m, sf::ShardInfo()), "DDP");
    }
  });
  remove_scratch("ckpt");
}

// The optimizer states saved at tp 2 and loaded at tp 4 continue training
// exactly as the run that saved them.
// A load reads each contiguous shard of a mapped file straight into its
// parameter (NOTE [Loads read into the parameters]). Only tensors of 64 KiB
// and more take that path, so this GPT-2 is wider than tiny_test's: the
// row-parallel MLP projection's shards (256 x 128 floats each) are read that
// way, the column-parallel ones (strided) and the small ones copied.
TEST(HybridParallel, WideCheckpointLoadsIntoTensorParallelShards) {
  run_distributed(2, [](int, int) {
    const auto dir = scratch(colossalai::testing::test_process(), "wide");
    const auto config = models::GPT2Config::tiny_test().n_embd(128).n_head(4);
    // A fresh tp 2 model drawn from `seed` and boosted, handed to `body`.
    auto with_tp2 = [&](int seed, auto&& body) {
      auto plugin = std::make_shared<HybridParallelPlugin>(
          HPO().precision("fp32").tp_size(2));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      torch::manual_seed(seed);
      models::GPT2LMHeadModel m(config);
      auto boosted = booster.boost(m, make_opt(m->parameters(), false));
      body(booster, boosted.model, m, *plugin);
    };
    std::map<std::string, at::Tensor> saved, got;
    with_tp2(1, [&](auto& booster, auto& model, auto& m, auto& plugin) {
      saved = whole_weights(*m, plugin.shard_info());
      booster.save_model(
          model,
          dir + "/model.safetensors",
          colossalai::checkpoint_io::SaveModelOptions().use_safetensors(true));
    });
    with_tp2(2, [&](auto& booster, auto& model, auto& m, auto& plugin) {
      booster.load_model(model, dir + "/model.safetensors");
      got = whole_weights(*m, plugin.shard_info());
    });
    ASSERT_EQ(got.size(), saved.size());
    for (const auto& kv : saved) {
      EXPECT_TRUE(at::equal(got.at(kv.first), kv.second)) << kv.first;
    }
  });
  remove_scratch("wide");
}

TEST(HybridParallel, OptimizerStatesResumeAtAnotherTpSize) {
  run_distributed(4, [](int, int) {
    const auto dir = scratch(colossalai::testing::test_process(), "optim");
    auto run = [&](int tp, int stage, bool save, bool load) {
      auto plugin = std::make_shared<HybridParallelPlugin>(
          HPO().precision("fp32").tp_size(tp).zero_stage(stage));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = make<models::GPT2LMHeadModel>(false);
      auto boosted = booster.boost(model, make_opt(model->parameters(), false));
      const int dp = plugin->dp_size();
      const int64_t micro = kGlobalBatch / dp;
      if (load) {
        booster.load_model(boosted.model, dir + "/model");
        booster.load_optimizer(*boosted.optimizer, dir + "/optim");
      }
      for (int step = load ? 2 : 0; step < (save ? 2 : kSteps); ++step) {
        auto b = batch(step, 100);
        auto x = b.first.narrow(0, micro * plugin->dp_rank(), micro);
        auto y = b.second.narrow(0, micro * plugin->dp_rank(), micro);
        boosted.optimizer->zero_grad();
        booster.backward(model->loss(boosted.model(x), y), *boosted.optimizer);
        boosted.optimizer->step();
      }
      if (save) {
        booster.save_model(
            boosted.model,
            dir + "/model",
            colossalai::checkpoint_io::SaveModelOptions().shard(true));
        booster.save_optimizer(
            *boosted.optimizer,
            dir + "/optim",
            colossalai::checkpoint_io::SaveOptimizerOptions().shard(true));
      }
      return whole_weights(*model, plugin->shard_info());
    };
    auto straight = run(2, 1, false, false);
    run(2, 1, true, false);
    auto resumed = run(4, 0, false, true);
    for (const auto& kv : straight) {
      // Three AdamW steps whose third runs at another tp size: rounding
      // only (see kSgdAtol's note; AdamW's bound is 3.2 lr per step).
      EXPECT_LE(
          (resumed.at(kv.first) - kv.second).abs().max().item<double>(),
          2 * 3.2e-3)
          << kv.first;
    }
  });
  remove_scratch("optim");
}

// Gradient accumulation: two micro-batches per data-parallel rank, the first
// under booster.no_sync (no data-parallel reduction), the second synced,
// equal one process on the whole batch (the loss halved per micro-batch,
// as in PyTorch). Stage 2 refuses no_sync by name.
TEST(HybridParallel, NoSyncAccumulatesLikeOneBigBatch) {
  run_distributed(4, [](int, int) {
    const auto ref = reference<models::GPT2LMHeadModel>(true);
    for (int stage : {0, 1}) {
      SCOPED_TRACE("zero_stage " + std::to_string(stage));
      auto plugin = std::make_shared<HybridParallelPlugin>(
          HPO().precision("fp32").tp_size(2).zero_stage(stage));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = make<models::GPT2LMHeadModel>(true);
      auto boosted = booster.boost(model, make_opt(model->parameters(), true));
      const int64_t micro = kGlobalBatch / plugin->dp_size() / 2;
      for (int step = 0; step < kSteps; ++step) {
        auto b = batch(step, model->config().vocab_size());
        boosted.optimizer->zero_grad();
        for (int m = 0; m < 2; ++m) {
          const int64_t off = (2 * plugin->dp_rank() + m) * micro;
          auto x = b.first.narrow(0, off, micro);
          auto y = b.second.narrow(0, off, micro);
          auto run = [&]() {
            at::Tensor loss = model->loss(boosted.model(x), y) / 2;
            booster.backward(loss, *boosted.optimizer);
          };
          if (m == 0) {
            auto guard =
                booster.no_sync(boosted.model, boosted.optimizer.get());
            const auto& dp = *plugin->mixed_dp_group();
            const int64_t before = dp.bytes_communicated();
            run();
            EXPECT_EQ(dp.bytes_communicated(), before) << "no_sync reduced";
          } else {
            run();
          }
        }
        boosted.optimizer->step();
      }
      auto got = whole_weights(*model, plugin->shard_info());
      for (const auto& kv : ref.second) {
        EXPECT_LE(
            (got.at(kv.first) - kv.second).abs().max().item<double>(), kSgdAtol)
            << kv.first;
      }
    }
    auto plugin = std::make_shared<HybridParallelPlugin>(
        HPO().precision("fp32").tp_size(2).zero_stage(2));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = make<models::GPT2LMHeadModel>(true);
    auto boosted = booster.boost(model, make_opt(model->parameters(), true));
    EXPECT_NE(
        colossalai::testing::error_of([&]() {
          booster.no_sync(boosted.model, boosted.optimizer.get());
        }).find("no_sync"),
        std::string::npos);
  });
}

// Gradient checkpointing in one process: with dropout on, recomputing every
// block replays its masks (the layers' own streams and the default
// generator), so gradients equal the stored-activation run bit for bit; and
// the forward keeps only each block's input. The memory bound compares heap
// bytes in use, which depend on shapes, not on the CPU: stored, a GPT-2
// block of width 256 keeps ~20 [B, T, C] tensors and the attention
// probabilities (over 5 MB at B 2, T 128, 4 heads), checkpointed one [B, T, C]
// input (0.26 MB); the logits (4 MB) are kept either way, so a half is far
// from both.
TEST(HybridParallel, GradientCheckpointingReplaysDropoutAndSavesMemory) {
  auto run = [](double ratio, int64_t* activation_bytes) {
    torch::manual_seed(3);
    models::GPT2LMHeadModel model(models::GPT2Config::small_cpu()
                                      .embd_pdrop(0.1)
                                      .attn_pdrop(0.1)
                                      .resid_pdrop(0.1));
    sf::shard_model(
        *model, sf::ShardConfig().gradient_checkpointing_ratio(ratio));
    auto gen = at::detail::createCPUGenerator(11);
    auto tokens = at::randint(4096, {2, 129}, gen);
    auto x = tokens.narrow(1, 0, 128).contiguous();
    auto y = tokens.narrow(1, 1, 128).contiguous();
    torch::manual_seed(5); // the default generator draws too (embd dropout)
    const auto cpu = at::Device(at::kCPU);
    const int64_t before = colossalai::compat::memory_allocated(cpu);
    at::Tensor logits = model->forward(x);
    *activation_bytes = colossalai::compat::memory_allocated(cpu) - before;
    model->loss(logits, y).backward();
    std::map<std::string, at::Tensor> grads;
    for (const auto& p : model->named_parameters()) {
      EXPECT_TRUE(p.value().grad().defined()) << ratio << " " << p.key();
      grads[p.key()] = p.value().grad().defined() ? p.value().grad().clone()
                                                  : at::zeros({1});
    }
    return grads;
  };
  int64_t stored = 0, recomputed = 0, half = 0;
  const auto a = run(0.0, &stored);
  const auto b = run(1.0, &recomputed);
  const auto c = run(0.5, &half);
  for (const auto& kv : a) {
    EXPECT_TRUE(at::equal(kv.second, b.at(kv.first))) << kv.first;
    EXPECT_TRUE(at::equal(kv.second, c.at(kv.first))) << kv.first;
  }
  EXPECT_LT(recomputed, stored / 2) << stored << " vs " << recomputed;
  EXPECT_LT(recomputed, half);
  EXPECT_LT(half, stored);
  EXPECT_NE(
      colossalai::testing::error_of([]() {
        models::GPT2LMHeadModel m(models::GPT2Config::tiny_test());
        sf::shard_model(*m, sf::ShardConfig().gradient_checkpointing_ratio(2));
      }).find("gradient_checkpointing_ratio"),
      std::string::npos);
}

// Megatron's count for tensor parallelism without sequence parallelism: per
// block, one all-reduce of the [B, T, C] activations after each row-parallel
// layer in forward and one of their gradients before each column-parallel
// layer in backward, 4 in all (LLaMA's q, k, v and gate, up share one input
// and so one gradient sum); plus the vocabulary-parallel embedding's
// (forward) and the LM head's input gradient (backward), and the parallel
// cross entropy's three [B x T] fp32 reductions (row maximum, target logit,
// sum of exponentials). The bytes the tensor group carried equal it exactly,
// and nothing else was sent.
template <class Model>
void check_megatron_bytes() {
  auto plugin = std::make_shared<HybridParallelPlugin>(
      HPO().precision("fp32").tp_size(2));
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  auto model = make<Model>(true);
  auto boosted = booster.boost(model, make_opt(model->parameters(), true));
  const auto& c = model->config();
  auto b = batch(0, c.vocab_size());
  int64_t width = 0, layers = 0;
  if constexpr (std::is_same_v<Model, models::GPT2LMHeadModel>) {
    width = c.n_embd();
    layers = c.n_layer();
  } else {
    width = c.hidden_size();
    layers = c.num_hidden_layers();
  }
  const int64_t bsc = b.first.numel() * width * 4;
  const int64_t expect = (4 * layers + 2) * bsc + 3 * b.first.numel() * 4;
  const int64_t before = cd::bytes_communicated(),
                tp_before = plugin->tp_group()->bytes_communicated();
  booster.backward(
      model->loss(boosted.model(b.first), b.second), *boosted.optimizer);
  EXPECT_EQ(plugin->tp_group()->bytes_communicated() - tp_before, expect);
  EXPECT_EQ(cd::bytes_communicated() - before, expect);
}

TEST(HybridParallel, TensorParallelBytesEqualMegatronsCount) {
  run_distributed(2, [](int, int) {
    check_megatron_bytes<models::GPT2LMHeadModel>();
    check_megatron_bytes<models::LlamaForCausalLM>();
  });
}

TEST(HybridParallel, InvalidOptionsNameTheOption) {
  run_distributed(4, [](int, int) {
    using colossalai::testing::error_of;
    auto make_plugin = [](HPO o) {
      return error_of([o]() { HybridParallelPlugin p(o); });
    };
    EXPECT_NE(
        make_plugin(HPO().precision("fp32").pp_size(2)).find("pp_size"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(HPO().precision("fp32").gradient_checkpointing_ratio(1.5))
            .find("gradient_checkpointing_ratio"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(HPO().precision("fp32").tp_size(3)).find("tp_size"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(HPO().precision("fp16")).find("fp16"), std::string::npos);
    EXPECT_NE(
        make_plugin(HPO().precision("fp32").tp_size(2).overlap_allgather(true))
            .find("overlap_allgather needs zero_stage"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(HPO()
                        .precision("fp32")
                        .enable_sequence_parallelism(true)
                        .sequence_parallelism_mode("split_gather"))
            .find("tp_size > 1"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(HPO()
                        .precision("fp32")
                        .enable_sequence_parallelism(true)
                        .sequence_parallelism_mode("ring"))
            .find("tp_size > 1"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(HPO().precision("fp32").sp_size(2)).find("sp_size"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(
            HPO().precision("fp32").tp_size(2).enable_sequence_overlap(true))
            .find("enable_sequence_overlap needs enable_sequence_parallelism"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(HPO()
                        .precision("fp32")
                        .sp_size(2)
                        .enable_sequence_parallelism(true)
                        .sequence_parallelism_mode("all_to_all")
                        .enable_sequence_overlap(true))
            .find("'all_to_all' has none to overlap"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(HPO().precision("fp32").tp_size(2).inner_ring_size(2))
            .find("inner_ring_size sizes the inner rings of "
                  "sequence_parallelism_mode 'ring_attn'"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(HPO()
                        .precision("fp32")
                        .sp_size(4)
                        .enable_sequence_parallelism(true)
                        .sequence_parallelism_mode("ring_attn")
                        .inner_ring_size(3))
            .find("inner_ring_size 3 must divide sp_size 4"),
        std::string::npos);
    EXPECT_NE(
        make_plugin(HPO().precision("fp32").zero_stage(3)).find("zero_stage"),
        std::string::npos);
    // No option accepted and ignored: the JIT fusion LibTorch lacks.
    EXPECT_NE(
        make_plugin(HPO().precision("fp32").enable_jit_fused(true))
            .find("enable_jit_fused"),
        std::string::npos);
    // A model whose heads do not split over the tensor group.
    auto plugin = std::make_shared<HybridParallelPlugin>(
        HPO().precision("fp32").tp_size(4));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    torch::manual_seed(1);
    models::GPT2LMHeadModel m(models::GPT2Config::tiny_test().n_head(2));
    auto err =
        error_of([&]() { booster.boost(m, make_opt(m->parameters(), true)); });
    EXPECT_NE(err.find("n_head"), std::string::npos) << err;
  });
}

} // namespace
