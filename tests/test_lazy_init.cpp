// LazyInitContext: modules built lazily hold no memory, and materialize (or
// boost) gives exactly the values of eager construction under the same seed.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/gemini_plugin.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/torch_fsdp_plugin.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/lazy/lazy_init.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/models/pretrained.h>
#include <harness/multiprocess.h>
#include <harness/test_util.h>
#include <zoo/gpt.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

namespace {

namespace zoo = colossalai::zoo;
namespace models = colossalai::models;
namespace lz = colossalai::lazy;

template <class Make>
void expect_equal_to_eager(const Make& make) {
  torch::manual_seed(42);
  auto eager = make();
  torch::manual_seed(42);
  decltype(make()) lazy{nullptr};
  {
    lz::LazyInitContext ctx;
    lazy = make();
  }
  EXPECT_TRUE(lz::is_lazy(*lazy));
  for (const auto& p : lazy->parameters()) {
    EXPECT_TRUE(p.is_meta());
  }
  lz::materialize(*lazy);
  EXPECT_FALSE(lz::is_lazy(*lazy));
  auto want = eager->named_parameters();
  for (const auto& item : lazy->named_parameters()) {
    const at::Tensor got = item.value();
    const at::Tensor expect = want[item.key()];
    EXPECT_FALSE(got.is_meta()) << item.key();
    EXPECT_TRUE(got.requires_grad()) << item.key();
    EXPECT_TRUE(at::equal(got, expect)) << item.key();
  }
  auto want_buffers = eager->named_buffers();
  for (const auto& item : lazy->named_buffers()) {
    const at::Tensor got = item.value();
    EXPECT_TRUE(at::equal(got, want_buffers[item.key()])) << item.key();
  }
}

TEST(LazyInit, MaterializeEqualsEagerConstruction) {
  expect_equal_to_eager([] { return zoo::GPT(zoo::GPTConfig::tiny_test()); });
  expect_equal_to_eager(
      [] { return models::GPT2LMHeadModel(models::GPT2Config::tiny_test()); });
  expect_equal_to_eager([] {
    return models::LlamaForCausalLM(models::LlamaConfig::tiny_test());
  });
  expect_equal_to_eager([] {
    return torch::nn::Sequential(
        torch::nn::Linear(8, 16),
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})),
        torch::nn::Embedding(10, 4));
  });
}

// The forward of a materialised model is the eager model's, and the
// module's own members (not only its parameter list) see the values.
TEST(LazyInit, BoostMaterializesAndTrains) {
  torch::manual_seed(7);
  zoo::GPT eager(zoo::GPTConfig::tiny_test());
  torch::manual_seed(7);
  zoo::GPT model{nullptr};
  {
    lz::LazyInitContext ctx;
    model = zoo::GPT(zoo::GPTConfig::tiny_test());
  }
  colossalai::booster::Booster booster;
  auto opt = std::make_shared<torch::optim::SGD>(
      model->parameters(), torch::optim::SGDOptions(0.1));
  auto boosted = booster.boost(model, opt);
  auto ids = at::randint(96, {2, 8});
  EXPECT_TRUE(at::equal(boosted.model(ids), eager->forward(ids)));
  at::Tensor loss = boosted.model(ids).sum();
  booster.backward(loss, *boosted.optimizer);
  boosted.optimizer->step();
  EXPECT_FALSE(at::equal(boosted.model(ids), eager->forward(ids)));
}

// What a constructor keeps outside its parameters and buffers is real
// (LLaMA's rotary frequencies, Llama 3 scaling included): a materialised
// LLaMA gives the eager one's logits.
TEST(LazyInit, MaterializedLlamaForwardsAsEager) {
  const auto config = models::LlamaConfig::tiny_test().rope_scaling(
      models::RopeScaling().rope_type("llama3").factor(8.0));
  torch::manual_seed(3);
  models::LlamaForCausalLM eager(config);
  torch::manual_seed(3);
  models::LlamaForCausalLM lazy{nullptr};
  {
    lz::LazyInitContext ctx;
    lazy = models::LlamaForCausalLM(config);
  }
  lz::materialize(*lazy);
  const auto ids = at::randint(config.vocab_size(), {2, 8});
  EXPECT_TRUE(at::equal(lazy->forward(ids), eager->forward(ids)));
}

// No parameter memory while lazy: a model of 406 M parameters (1.6 GB in
// fp32) is built within a few MB.
TEST(LazyInit, LazyModelsHoldNoParameterMemory) {
  const auto config = zoo::GPTConfig::gpt2_medium();
  zoo::GPT model{nullptr};
  {
    lz::LazyInitContext ctx;
    model = zoo::GPT(config);
  }
  int64_t bytes = 0;
  for (const auto& p : model->parameters()) {
    EXPECT_TRUE(p.is_meta());
    bytes += p.numel() * p.element_size();
  }
  EXPECT_EQ(bytes, config.num_parameters() * 4);
}

// Two modules built in one context materialise separately, each equal to
// eager construction (the replay is of the whole recording, so the second
// does not depend on the first having been materialised).
TEST(LazyInit, ModulesOfOneContextMaterializeSeparately) {
  torch::manual_seed(3);
  torch::nn::Linear a0(6, 5), b0(5, 4);
  torch::manual_seed(3);
  torch::nn::Linear a{nullptr}, b{nullptr};
  {
    lz::LazyInitContext ctx;
    a = torch::nn::Linear(6, 5);
    b = torch::nn::Linear(5, 4);
  }
  lz::materialize(*b);
  EXPECT_TRUE(lz::is_lazy(*a));
  EXPECT_TRUE(at::equal(b->weight, b0->weight));
  lz::materialize(*a);
  EXPECT_TRUE(at::equal(a->weight, a0->weight));
  EXPECT_TRUE(at::equal(b->weight, b0->weight));
}

// from_pretrained builds the model lazily and reads each tensor in the dtype
// it loads: a LLaMA of 220 M parameters saved in bf16 (440 MB) loads at a
// peak of its bf16 bytes plus little (pread into each tensor), not at its
// float32 size (twice the file) that building it eagerly first would take.
// Loaded in float32, the peak is that model plus about one tensor, not the
// model plus the file's mapped pages. Measured in fresh rank processes,
// above their baseline (a CUDA-linked LibTorch starts higher). Measured
// here: 454 MB for the 439 MB file (958 MB when built eagerly first).
TEST(LazyInit, FromPretrainedPeaksNearItsFileSize) {
  // Shared with the rank, which runs this test's body again up to
  // run_distributed: only the test process writes the directory.
  const auto dir = std::filesystem::temp_directory_path() /
      ("colossalai_pretrained_rss_" +
       std::to_string(colossalai::testing::test_process()));
  const bool rank = std::getenv("COLOSSALAI_TEST_RANK") != nullptr;
  if (!rank) {
    const auto config = models::LlamaConfig()
                            .vocab_size(32000)
                            .hidden_size(1024)
                            .intermediate_size(2816)
                            .num_hidden_layers(12)
                            .num_attention_heads(16)
                            .num_key_value_heads(16);
    torch::manual_seed(3);
    models::LlamaForCausalLM model{nullptr};
    {
      lz::LazyInitContext ctx;
      model = models::LlamaForCausalLM(config);
    }
    lz::materialize(*model, [](const std::string&, const at::Tensor& t) {
      return t.to(at::kBFloat16);
    });
    models::save_pretrained(model, dir.string());
  }
  struct Remove {
    std::filesystem::path dir;
    bool owner;
    ~Remove() {
      if (owner) {
        std::filesystem::remove_all(dir);
      }
    }
  } remove{dir, !rank};
  const auto file = static_cast<int64_t>(
      std::filesystem::file_size(dir / "model.safetensors"));
  ASSERT_GT(file, 400 * 1000 * 1000);
  colossalai::testing::run_distributed(1, [&](int, int) {
    const int64_t baseline = colossalai::testing::rss_bytes();
    auto model = models::from_pretrained<models::LlamaForCausalLM>(dir);
    const int64_t peak = colossalai::testing::peak_rss_bytes() - baseline;
    EXPECT_LT(peak, file * 13 / 10)
        << "from_pretrained peaked at " << peak / 1e6 << " MB above its "
        << baseline / 1e6 << " MB baseline; the file holds " << file / 1e6
        << " MB";
    // The values are the file's, bit for bit.
    const auto saved = colossalai::checkpoint_io::safetensors::load_file(
        (dir / "model.safetensors").string());
    for (const auto& kv : model->named_parameters()) {
      const at::Tensor* t = saved.find(kv.key());
      ASSERT_NE(t, nullptr) << kv.key();
      EXPECT_EQ(kv.value().scalar_type(), at::kBFloat16) << kv.key();
      EXPECT_TRUE(at::equal(kv.value(), *t)) << kv.key();
    }
  });
  // Converting (bf16 file, float32 model): the copy goes through the
  // mapping, whose pages are let go tensor by tensor, so the peak is the
  // float32 model (twice the file) plus about one tensor, not the model
  // plus the whole file.
  colossalai::testing::run_distributed(1, [&](int, int) {
    const int64_t baseline = colossalai::testing::rss_bytes();
    auto model = models::from_pretrained<models::LlamaForCausalLM>(
        dir, models::FromPretrainedOptions().dtype(at::kFloat));
    const int64_t peak = colossalai::testing::peak_rss_bytes() - baseline;
    EXPECT_LT(peak, file * 23 / 10)
        << "from_pretrained in float32 peaked at " << peak / 1e6
        << " MB above its " << baseline / 1e6 << " MB baseline; the file holds "
        << file / 1e6 << " MB of bf16";
    EXPECT_EQ(model->parameters()[0].scalar_type(), at::kFloat);
  });
}

// `keep` installs what a rank keeps (here a quarter of every tensor, as a
// 4-rank shard): materialising gpt2-medium (406 M parameters, 1.63 GB in
// fp32) raises the peak RSS by the kept quarter plus the tensors in flight
// (the largest, wte, is 206 MB), far below the whole model.
TEST(LazyInit, KeepingShardsBoundsThePeak) {
  const auto config = zoo::GPTConfig::gpt2_medium();
  zoo::GPT model{nullptr};
  {
    lz::LazyInitContext ctx;
    model = zoo::GPT(config);
  }
  const int64_t before = colossalai::testing::peak_rss_bytes();
  int64_t kept = 0;
  lz::materialize(*model, [&](const std::string&, const at::Tensor& full) {
    auto flat = full.reshape({-1});
    auto mine = flat.narrow(0, 0, (flat.numel() + 3) / 4).clone();
    kept += mine.numel() * mine.element_size();
    return mine;
  });
  const int64_t whole = config.num_parameters() * 4;
  const int64_t grown = colossalai::testing::peak_rss_bytes() - before;
  EXPECT_NEAR(kept, whole / 4, whole / 100);
  // Kept quarter + one wte-sized tensor in flight + its flat copy + slack.
  EXPECT_LT(grown, whole / 4 + 3 * 206 * 1000 * 1000)
      << "peak grew by " << grown / 1e6 << " MB";
  EXPECT_LT(grown, whole / 2);
}

// Loading a checkpoint into a lazy model installs the file's tensors
// directly (no random initialisation first): the same weights as an eager
// load, for single-file and sharded checkpoints; boost then has nothing
// left to materialise.
TEST(LazyInit, LoadIntoALazyModelEqualsEagerLoad) {
  namespace cio = colossalai::checkpoint_io;
  const auto dir = colossalai::testing::temp_dir("lazy_load");
  torch::manual_seed(1);
  models::GPT2LMHeadModel source(models::GPT2Config::tiny_test());
  cio::GeneralCheckpointIO io;
  colossalai::interface::ModelWrapper src(source.ptr());
  io.save_model(
      src,
      dir + "/model.safetensors",
      cio::SaveModelOptions().use_safetensors(true));
  io.save_model(
      src,
      dir + "/sharded",
      cio::SaveModelOptions().shard(true).size_per_shard(1));
  for (const auto* path : {"/model.safetensors", "/sharded"}) {
    models::GPT2LMHeadModel model{nullptr};
    {
      lz::LazyInitContext ctx;
      model = models::GPT2LMHeadModel(models::GPT2Config::tiny_test());
    }
    colossalai::interface::ModelWrapper w(model.ptr());
    io.load_model(w, dir + path);
    EXPECT_FALSE(lz::is_lazy(*model)) << path;
    auto want = source->named_parameters();
    for (const auto& item : model->named_parameters()) {
      const at::Tensor got = item.value();
      EXPECT_TRUE(got.requires_grad()) << item.key();
      EXPECT_TRUE(at::equal(got, want[item.key()])) << path << item.key();
    }
    colossalai::booster::Booster booster;
    auto boosted = booster.boost(model);
    auto ids = at::randint(100, {2, 8});
    EXPECT_TRUE(at::equal(boosted.model(ids), source->forward(ids)));
  }
  std::filesystem::remove_all(dir);
}

// Under FSDP each rank materialises only its pieces of every unit (one
// replay of the construction); the sharded model computes and trains as
// the eagerly built one does (the same seed on every rank, as ColossalAI
// requires for lazy models), for FULL_SHARD per block and Gemini chunks.
TEST(LazyInit, FsdpShardsALazyModelAsItMaterialises) {
  colossalai::testing::run_distributed(2, [](int rank, int) {
    namespace cb = colossalai::booster;
    auto run = [&](bool lazy, std::shared_ptr<cb::plugin::Plugin> plugin) {
      torch::manual_seed(5);
      zoo::GPT model{nullptr};
      if (lazy) {
        lz::LazyInitContext ctx;
        model = zoo::GPT(zoo::GPTConfig::tiny_test());
      } else {
        model = zoo::GPT(zoo::GPTConfig::tiny_test());
      }
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto opt = std::make_shared<torch::optim::SGD>(
          model->parameters(), torch::optim::SGDOptions(0.1));
      auto boosted = booster.boost(model, opt);
      EXPECT_FALSE(lz::is_lazy(*model));
      auto ids = at::randint(96, {2, 8}, at::detail::createCPUGenerator(9));
      std::vector<at::Tensor> outs;
      at::Tensor loss = boosted.model(ids).sum();
      outs.push_back(loss.detach().clone());
      booster.backward(loss, *boosted.optimizer);
      boosted.optimizer->step();
      outs.push_back(boosted.model(ids).detach().clone());
      return outs;
    };
    const auto block_policy =
        colossalai::zero::module_type_wrap_policy<zoo::BlockImpl>();
    std::vector<std::function<std::shared_ptr<cb::plugin::Plugin>()>> plugins{
        [&] {
          return std::make_shared<cb::plugin::TorchFSDPPlugin>(
              cb::plugin::TorchFSDPPluginOptions().auto_wrap_policy(
                  block_policy));
        },
        [] {
          return std::make_shared<cb::plugin::GeminiPlugin>(
              cb::plugin::GeminiPluginOptions().precision("fp32"));
        }};
    for (const auto& make : plugins) {
      auto eager = run(false, make());
      auto lazy = run(true, make());
      for (size_t i = 0; i < eager.size(); ++i) {
        EXPECT_TRUE(at::equal(eager[i], lazy[i]))
            << "rank " << rank << " " << i;
      }
    }
  });
}

// Under HybridParallelPlugin each tensor rank cuts its shard as the
// parameter is materialised (never whole), and each pipeline stage keeps
// only its layers' parameters: tp 2 and pp 2 on GPT-2 compute and train as
// the eagerly built, then sharded, model does.
TEST(LazyInit, HybridParallelShardsALazyModelAsItMaterialises) {
  colossalai::testing::run_distributed(2, [](int rank, int) {
    namespace cb = colossalai::booster;
    using HPO = cb::plugin::HybridParallelPluginOptions;
    auto run = [&](bool lazy, const HPO& options) {
      torch::manual_seed(6);
      models::GPT2LMHeadModel model{nullptr};
      if (lazy) {
        lz::LazyInitContext ctx;
        model = models::GPT2LMHeadModel(models::GPT2Config::tiny_test());
      } else {
        model = models::GPT2LMHeadModel(models::GPT2Config::tiny_test());
      }
      auto plugin = std::make_shared<cb::plugin::HybridParallelPlugin>(options);
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto opt = std::make_shared<torch::optim::SGD>(
          model->parameters(), torch::optim::SGDOptions(0.1));
      auto boosted = booster.boost(model, opt);
      EXPECT_FALSE(lz::is_lazy(*model));
      auto ids = at::randint(100, {2, 8}, at::detail::createCPUGenerator(9));
      std::vector<at::Tensor> outs;
      auto step = [&] {
        if (options.pp_size() == 1) {
          return model->loss(boosted.model(ids), ids);
        }
        auto out = booster.execute_pipeline(
            [&] { return std::vector<at::Tensor>{ids}; },
            boosted.model,
            [&](const at::Tensor& logits, const std::vector<at::Tensor>& mb) {
              return model->loss(logits, mb[0]);
            },
            boosted.optimizer.get());
        return out.loss.defined() ? out.loss : at::zeros({});
      };
      at::Tensor loss = step();
      outs.push_back(loss.detach().clone());
      if (options.pp_size() == 1) {
        booster.backward(loss, *boosted.optimizer);
      }
      boosted.optimizer->step();
      boosted.optimizer->zero_grad();
      outs.push_back(step().detach().clone());
      for (const auto& p : model->parameters()) {
        outs.push_back(p.detach().clone()); // this rank's shards
      }
      return outs;
    };
    for (const auto& options :
         {HPO().tp_size(2).precision("fp32"),
          HPO().pp_size(2).num_microbatches(2).precision("fp32")}) {
      auto eager = run(false, options);
      auto lazy = run(true, options);
      ASSERT_EQ(eager.size(), lazy.size());
      int64_t held = 0;
      for (size_t i = 0; i < eager.size(); ++i) {
        EXPECT_TRUE(at::equal(eager[i], lazy[i]))
            << "rank " << rank << " " << i;
        held += lazy[i].numel();
      }
      int64_t whole = 0;
      for (const auto& p :
           models::GPT2LMHeadModel(models::GPT2Config::tiny_test())
               ->parameters()) {
        whole += p.numel();
      }
      EXPECT_LT(held, whole) << "rank " << rank << " holds the whole model";
    }
  });
}

// A model over a per-process budget, built lazily and sharded over 4 ranks
// by each sharding plugin: no rank's peak RSS (the process's 170 MB of
// code and libraries included) reaches the whole model's fp32 bytes (the
// budget). GPT-2 with 16 blocks of width 1024 (210 M parameters, 840 MB):
// FSDP (a unit per block) and Gemini hold a quarter of the weights and of
// the gradients, tensor parallelism a quarter of each matrix, a pipeline
// stage 4 blocks (and the tied embedding on the first and last stage), plus
// one tensor in flight while materialising. Built eagerly, every rank would
// first hold it all. Gemini's chunks are set to 4 M elements: the searched
// size (32 to 64 M elements, ColossalAI's defaults) is a quarter of this
// model, and building a chunk gathers it whole (twice under Gloo, whose
// all-gather stages through a flat buffer).
TEST(LazyInit, ShardingPluginsBuildAModelLargerThanEachRanksBudget) {
  const auto config = models::GPT2Config()
                          .vocab_size(8192)
                          .n_positions(256)
                          .n_embd(1024)
                          .n_head(16)
                          .n_layer(16);
  namespace cb = colossalai::booster;
  using HPO = cb::plugin::HybridParallelPluginOptions;
  std::vector<std::pair<
      std::string,
      std::function<std::shared_ptr<cb::plugin::Plugin>()>>>
      plugins{
          {"TorchFSDP",
           [] {
             return std::make_shared<cb::plugin::TorchFSDPPlugin>(
                 cb::plugin::TorchFSDPPluginOptions().auto_wrap_policy(
                     colossalai::zero::module_type_wrap_policy<
                         models::GPT2BlockImpl>()));
           }},
          {"Gemini",
           [] {
             return std::make_shared<cb::plugin::GeminiPlugin>(
                 cb::plugin::GeminiPluginOptions().precision("fp32").chunk_size(
                     4 << 20));
           }},
          {"HybridParallel tp 4",
           [] {
             return std::make_shared<cb::plugin::HybridParallelPlugin>(
                 HPO().tp_size(4).precision("fp32"));
           }},
          {"HybridParallel pp 4", [] {
             return std::make_shared<cb::plugin::HybridParallelPlugin>(
                 HPO().pp_size(4).num_microbatches(4).precision("fp32"));
           }}};
  for (const auto& named : plugins) {
    SCOPED_TRACE(named.first);
    int64_t whole = 0;
    {
      lz::LazyInitContext ctx;
      for (const auto& p : models::GPT2LMHeadModel(config)->parameters()) {
        whole += p.numel() * 4;
      }
    }
    colossalai::testing::run_distributed(4, [&](int rank, int) {
      // What the process holds before the model: the libraries and the
      // process group (a CUDA-linked LibTorch alone adds ~200 MB).
      const int64_t baseline = colossalai::testing::rss_bytes();
      torch::manual_seed(5);
      models::GPT2LMHeadModel model{nullptr};
      {
        lz::LazyInitContext ctx;
        model = models::GPT2LMHeadModel(config);
      }
      cb::Booster booster(cb::BoosterOptions().plugin(named.second()));
      auto opt = std::make_shared<torch::optim::SGD>(
          model->parameters(), torch::optim::SGDOptions(0.1));
      auto boosted = booster.boost(model, opt);
      EXPECT_FALSE(lz::is_lazy(*model));
      const int64_t peak = colossalai::testing::peak_rss_bytes() - baseline;
      EXPECT_LT(peak, whole)
          << named.first << ": rank " << rank << " peaked at " << peak / 1e6
          << " MB above its " << baseline / 1e6
          << " MB baseline; the whole model is " << whole / 1e6 << " MB";
    });
  }
}

TEST(LazyInit, ValueReadsInTheContextNameTheProblem) {
  lz::LazyInitContext ctx;
  auto t = torch::ones({2});
  const auto e = colossalai::testing::error_of([&] { t.sum().item<float>(); });
  EXPECT_NE(e.find("LazyInitContext"), std::string::npos) << e;
}

} // namespace
