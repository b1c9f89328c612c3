// Hugging Face model families against transformers itself (ctest label
// `hf`): directories written by transformers' save_pretrained load through
// from_pretrained and give transformers' logits (with and without padding
// masks and position ids), loss and gradients; what save_pretrained writes,
// transformers loads and computes the same logits from; a loaded LLaMA
// trains under tensor, sequence and pipeline parallelism as in one process.
// The references come from tests/python/hf_models.py, run with the Python of
// the test set-up (transformers, pinned in scripts/requirements-hf.txt).

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/gemini_plugin.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/moe_hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/booster/plugin/torch_fsdp_plugin.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/data/distributed_sampler.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/interface/model.h>
#include <colossalai/lazy/lazy_init.h>
#include <colossalai/lora/lora_model.h>
#include <colossalai/models/generation.h>
#include <colossalai/models/pretrained.h>
#include <colossalai/pipeline/schedule.h>
#include <colossalai/pipeline/stage_manager.h>
#include <harness/multiprocess.h>
#include <harness/test_util.h>
#include <harness/zoo_util.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <type_traits>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
namespace cp = colossalai::pipeline;
namespace models = colossalai::models;
namespace st = colossalai::checkpoint_io::safetensors;
namespace fs = std::filesystem;
using HPO = cb::plugin::HybridParallelPluginOptions;
using colossalai::testing::run_distributed;

namespace {

const char* const kHfPython = COLOSSALAI_TEST_HF_PYTHON;

const std::vector<std::string> kCases = {
    "gpt2",
    "gpt2_bare_bin",
    "llama3",
    "llama_tied",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "opt",
    "opt_post_ln",
    "bloom",
    "bert"};

std::string quote(const std::string& s) {
  return "'" + s + "'";
}

fs::path script() {
  return fs::path(__FILE__).parent_path() / "python" / "hf_models.py";
}

// The cases' directories, made once per test program (in its first test;
// ranks only read them), or COLOSSALAI_HF_FIXTURES: directories made
// before by `hf_models.py make` (a machine without transformers; the tests
// that call Python then fail).
fs::path fixtures() {
  static const fs::path dir = colossalai::testing::python_fixtures(
      kHfPython, script().string(), "hf_models", "COLOSSALAI_HF_FIXTURES");
  return dir;
}

// A fresh directory, removed at the end of the test.
struct HfScratch : colossalai::testing::ScratchDir {
  HfScratch() : ScratchDir("hf_models") {}
};

class HfModels : public ::testing::Test {
 protected:
  static void TearDownTestSuite() {
    if (std::getenv("COLOSSALAI_TEST_RANK") == nullptr &&
        std::getenv("COLOSSALAI_HF_FIXTURES") == nullptr) {
      colossalai::testing::remove_scratch("hf_models");
      colossalai::testing::remove_scratch("hf_models_ep");
    }
  }
};

colossalai::checkpoint_io::StateDict reference(const std::string& name) {
  return st::load_file((fixtures() / name / "reference.safetensors").string());
}

bool is_moe(const std::string& name) {
  return name == "mixtral" || name == "qwen2_moe" || name == "qwen3_moe";
}

template <class M>
struct Family {
  using type = M;
};

// Calls f(Family<the case's model class>()).
template <class F>
void with_family(const std::string& name, F&& f) {
  auto starts = [&](const char* p) { return name.rfind(p, 0) == 0; };
  if (starts("gpt2")) {
    f(Family<models::GPT2LMHeadModel>());
  } else if (starts("opt")) {
    f(Family<models::OPTForCausalLM>());
  } else if (starts("bloom")) {
    f(Family<models::BloomForCausalLM>());
  } else if (starts("bert")) {
    f(Family<models::BertForMaskedLM>());
  } else {
    f(Family<models::LlamaForCausalLM>());
  }
}

template <class M>
constexpr bool kMaskedLM = std::is_same_v<M, models::BertForMaskedLM>;
template <class M>
constexpr bool kHasPositions = !std::is_same_v<M, models::BloomForCausalLM>;

template <class M>
at::Tensor forward_at(M& model, const at::Tensor& ids, const at::Tensor& pos) {
  if constexpr (kMaskedLM<M>) {
    return model->forward(ids, at::Tensor(), at::Tensor(), pos);
  } else if constexpr (kHasPositions<M>) {
    return model->forward(ids, at::Tensor(), pos);
  } else {
    TORCH_INTERNAL_ASSERT(false, "ALiBi takes no positions");
  }
}

// Logits bound. Both sides run the same fp32 operations in other orders
// (BLAS blocking, SDPA's kernel against transformers' call of the same op,
// rotary tables computed alike): a few ulps (6e-8 relative) per reduction of
// 32-64 terms, through 2 blocks, on logits of magnitude up to ~10 here.
// 2e-5 relative to the largest logit is about 300 ulps: room for another
// CPU's summation order, far below any wrong formula (a missed mask, rope
// scale or bias moves logits by O(0.1)).
double logits_tol(const at::Tensor& ref) {
  return 2e-5 * std::max(1.0, ref.abs().max().item<double>());
}

// Gradients: the loss is a mean over 46 tokens, the gradient of each weight
// a sum over them; the same rounding argument relative to each tensor's
// largest entry, plus an absolute floor for tensors whose exact gradient is
// (near) zero.
double grad_tol(const at::Tensor& ref) {
  return 1e-4 * ref.abs().max().item<double>() + 1e-7;
}

// `grouped_experts`: a mixture of experts' experts through grouped GEMMs
// (models::set_grouped_expert_gemm), the same products in other orders.
template <class M>
void check_against_transformers(const std::string& name, bool grouped_experts = false) {
  SCOPED_TRACE(name + (grouped_experts ? ", grouped expert GEMMs" : ""));
  auto model = models::from_pretrained<M>((fixtures() / name).string());
  if constexpr (std::is_same_v<M, models::LlamaForCausalLM>) {
    if (grouped_experts) {
      ASSERT_GT(models::set_grouped_expert_gemm(*model, true), 0);
    }
  }
  model->eval();
  auto ref = reference(name);
  const auto ids = ref["ids"];
  const auto mask = ref["attention_mask"];
  {
    torch::NoGradGuard no_grad;
    at::Tensor logits = model->forward(ids);
    ASSERT_EQ(logits.sizes(), ref["logits"].sizes());
    const double diff = (logits - ref["logits"]).abs().max().item<double>();
    std::cout << name << ": max |logits - transformers'| = " << diff
              << " (bound " << logits_tol(ref["logits"]) << ")\n";
    EXPECT_LE(diff, logits_tol(ref["logits"]));
    // Padding: compared where the token is real (a padded query's output
    // means nothing).
    at::Tensor masked = model->forward(ids, mask);
    auto real = mask.to(at::kBool).unsqueeze(-1).expand_as(masked);
    EXPECT_LE(
        (masked - ref["logits_masked"])
            .masked_select(real)
            .abs()
            .max()
            .item<double>(),
        logits_tol(ref["logits_masked"]));
    if constexpr (std::is_same_v<M, models::LlamaForCausalLM>) {
      // The balancing loss of that padded forward: padding left out. Its
      // counts are exact (routing agrees wherever the logits do, as no two
      // router logits here are within their few-ulp difference); the fp32
      // probability means over 43 real rows differ by ulps, and the value
      // is about 2: 1e-5 is about 40 ulps.
      if (ref.contains("aux_masked")) {
        EXPECT_NEAR(
            model->aux_loss().template item<double>(),
            ref["aux_masked"].item<double>(),
            1e-5);
      }
    }
    if constexpr (kHasPositions<M>) {
      at::Tensor shifted = forward_at(model, ids, ref["position_ids"]);
      EXPECT_LE(
          (shifted - ref["logits_pos"]).abs().max().item<double>(),
          logits_tol(ref["logits_pos"]));
    }
    if constexpr (kHasPositions<M> && !kMaskedLM<M>) {
      at::Tensor packed = forward_at(model, ids, ref["position_ids_packed"]);
      EXPECT_LE(
          (packed - ref["logits_packed"]).abs().max().item<double>(),
          logits_tol(ref["logits_packed"]));
    }
  }
  // transformers' loss of its labels: a causal LM shifts them (next-token
  // targets, the last position ignored), the masked LM takes them as they
  // are.
  const at::Tensor labels = ref["labels"];
  at::Tensor targets = kMaskedLM<M>
      ? labels
      : at::cat(
            {labels.narrow(1, 1, labels.size(1) - 1),
             at::full({labels.size(0), 1}, -100, labels.options())},
            1);
  model->zero_grad();
  at::Tensor loss = model->loss(model->forward(ids), targets);
  EXPECT_NEAR(loss.item<double>(), ref["loss"].item<double>(), 1e-5);
  loss.backward();
  int compared = 0;
  double worst = 0; // largest gradient error as a share of its bound
  for (const auto& kv : model->named_parameters()) {
    const auto key = "grad." + kv.key();
    ASSERT_TRUE(ref.contains(key)) << key;
    const at::Tensor want = ref[key];
    const at::Tensor grad = kv.value().grad();
    ASSERT_TRUE(grad.defined()) << kv.key();
    const double err = (grad - want).abs().max().item<double>();
    EXPECT_LE(err, grad_tol(want)) << kv.key();
    worst = std::max(worst, err / grad_tol(want));
    ++compared;
  }
  std::cout << name << ": loss " << loss.item<double>() << " vs "
            << ref["loss"].item<double>() << ", gradients within " << worst
            << " of their bounds\n";
  EXPECT_EQ(compared, static_cast<int>(model->parameters().size()));
}

TEST_F(HfModels, LogitsLossAndGradientsMatchTransformers) {
  for (const auto& name : kCases) {
    with_family(name, [&](auto family) {
      check_against_transformers<typename decltype(family)::type>(name);
    });
  }
}

TEST_F(HfModels, MoeModelsWithGroupedExpertGemmsMatchTransformers) {
  if (!colossalai::compat::has_grouped_mm(at::kCPU, at::kFloat)) {
    GTEST_SKIP() << "at::_grouped_mm needs LibTorch 2.10";
  }
  for (const auto& name : kCases) {
    if (is_moe(name)) {
      check_against_transformers<models::LlamaForCausalLM>(name, true);
    }
  }
}

TEST_F(HfModels, ConfigsReadTheFamilysFields) {
  const auto read = [](const std::string& name) {
    std::ifstream in(fixtures() / name / "config.json");
    std::stringstream s;
    s << in.rdbuf();
    return models::llama_config_from_json(s.str());
  };
  auto llama3 = read("llama3");
  EXPECT_EQ(llama3.rope_scaling().rope_type(), "llama3");
  EXPECT_EQ(llama3.rope_scaling().factor(), 8.0);
  EXPECT_EQ(llama3.rope_scaling().original_max_position_embeddings(), 16);
  EXPECT_EQ(llama3.rope_theta(), 500000.0);
  EXPECT_EQ(llama3.resolved_head_dim(), 8);
  EXPECT_EQ(llama3.num_key_value_heads(), 4);
  EXPECT_TRUE(read("llama_tied").tie_word_embeddings());
  EXPECT_EQ(read("mistral").sliding_window(), 8);
  EXPECT_TRUE(read("qwen2").qkv_bias());
  EXPECT_TRUE(read("qwen3").qk_norm());
  EXPECT_EQ(
      models::pretrained_model_type((fixtures() / "qwen3").string()), "qwen3");
  const auto mixtral = read("mixtral");
  EXPECT_EQ(mixtral.moe().num_experts(), 4);
  EXPECT_EQ(mixtral.moe().num_experts_per_tok(), 2);
  EXPECT_TRUE(mixtral.moe().norm_topk_prob());
  EXPECT_TRUE(mixtral.moe().output_router_logits());
  EXPECT_EQ(mixtral.moe().router_aux_loss_coef(), 0.05);
  EXPECT_EQ(mixtral.sliding_window(), 8);
  const auto qwen2_moe = read("qwen2_moe");
  EXPECT_TRUE(qwen2_moe.qkv_bias());
  EXPECT_EQ(qwen2_moe.moe().expert_width(64), 32);
  EXPECT_EQ(qwen2_moe.moe().shared_expert_intermediate_size(), 40);
  EXPECT_FALSE(qwen2_moe.moe().norm_topk_prob());
  EXPECT_FALSE(qwen2_moe.moe().sparse_layer(0)); // mlp_only_layers
  EXPECT_TRUE(qwen2_moe.moe().sparse_layer(1));
  const auto qwen3_moe = read("qwen3_moe");
  EXPECT_TRUE(qwen3_moe.qk_norm());
  EXPECT_EQ(qwen3_moe.moe().num_experts(), 4);
  EXPECT_TRUE(qwen3_moe.moe().norm_topk_prob());
  EXPECT_FALSE(qwen3_moe.moe().output_router_logits());
}

TEST_F(HfModels, SavePretrainedLoadsInTransformers) {
  HfScratch out;
  std::string pairs; // (case, ours) for one transformers process
  for (const auto& name : kCases) {
    SCOPED_TRACE(name);
    const auto src = (fixtures() / name).string();
    const auto dst = (fs::path(out.path) / name).string();
    with_family(name, [&](auto family) {
      using M = typename decltype(family)::type;
      auto model = models::from_pretrained<M>(src);
      // Shards and an index for one case, torch.save's format for another.
      models::save_pretrained(
          model,
          dst,
          models::SavePretrainedOptions()
              .safe_serialization(name != "gpt2_bare_bin")
              .max_shard_size(name == "llama3" ? 20000 : int64_t(1) << 30));
      // And it reads back here, unchanged.
      auto again = models::from_pretrained<M>(dst);
      auto a = again->named_parameters();
      for (const auto& kv : model->named_parameters()) {
        EXPECT_TRUE(at::equal(a[kv.key()], kv.value())) << kv.key();
      }
    });
    if (name == "llama3") {
      EXPECT_TRUE(fs::exists(fs::path(dst) / "model.safetensors.index.json"));
    }
    if (name == "llama_tied") {
      // The tied head is not written, as transformers does.
      auto file = st::MappedFile::open(dst + "/model.safetensors");
      EXPECT_FALSE(file->contains("lm_head.weight"));
    }
    pairs += " " + quote(src) + " " + quote(dst);
  }
  const auto r = colossalai::testing::run_shell(
      std::string(kHfPython) + " " + quote(script().string()) + " check" +
      pairs);
  EXPECT_EQ(r.first, 0) << r.second;
  std::cout << r.second;
}

// A save over an earlier one in another layout (shards, one file, the
// other format) leaves only the new weights: transformers would read a stale
// model.safetensors before new shards.
TEST_F(HfModels, SavePretrainedReplacesAnEarlierLayout) {
  HfScratch out;
  auto model = models::from_pretrained<models::LlamaForCausalLM>(
      (fixtures() / "llama_tied").string());
  auto weights = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(out.path)) {
      const auto name = e.path().filename().string();
      if (name != "config.json") {
        names.push_back(name);
      }
    }
    std::sort(names.begin(), names.end());
    return names;
  };
  models::save_pretrained(
      model, out.path, models::SavePretrainedOptions().max_shard_size(20000));
  EXPECT_GT(weights().size(), 2u);
  models::save_pretrained(model, out.path);
  EXPECT_EQ(weights(), std::vector<std::string>{"model.safetensors"});
  models::save_pretrained(
      model,
      out.path,
      models::SavePretrainedOptions().safe_serialization(false));
  EXPECT_EQ(weights(), std::vector<std::string>{"pytorch_model.bin"});
  auto again = models::from_pretrained<models::LlamaForCausalLM>(out.path);
  auto a = again->named_parameters();
  for (const auto& kv : model->named_parameters()) {
    EXPECT_TRUE(at::equal(a[kv.key()], kv.value())) << kv.key();
  }
}

TEST_F(
    HfModels,
    SparseBlocksGiveUnchosenExpertsZeroGradientsAndRefuseBadConfigs) {
  using colossalai::testing::error_of;
  // Top-1 with the probability as its weight (not renormalised to 1), so
  // the router has a gradient.
  auto config = models::LlamaConfig::tiny_test()
                    .model_type("qwen3_moe")
                    .moe(models::MoeConfig()
                             .num_experts(4)
                             .num_experts_per_tok(1)
                             .norm_topk_prob(false));
  models::LlamaForCausalLM model(config);
  // A router whose logits are (s, -s, 0, 0), s the sum of the token's
  // features: every token goes to expert 0 or 1, experts 2 and 3 see none.
  for (int64_t i = 0; i < config.num_hidden_layers(); ++i) {
    auto* layer = model->model->layers[i]->as<models::LlamaDecoderLayerImpl>();
    ASSERT_TRUE(layer->moe);
    ASSERT_FALSE(layer->mlp);
    torch::NoGradGuard no_grad;
    layer->moe->gate->weight.zero_();
    layer->moe->gate->weight[0].fill_(1.0);
    layer->moe->gate->weight[1].fill_(-1.0);
  }
  auto* first = model->model->layers[0]->as<models::LlamaDecoderLayerImpl>();
  const auto ids = at::randint(0, 100, {2, 8}, at::kLong);
  model->loss(model->forward(ids), ids).backward();
  int zero = 0;
  for (const auto& kv : first->moe->named_parameters()) {
    ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
    const bool is_zero = kv.value().grad().abs().sum().item<double>() == 0.0;
    const bool unchosen = kv.key().rfind("experts.2.", 0) == 0 ||
        kv.key().rfind("experts.3.", 0) == 0;
    EXPECT_EQ(is_zero, unchosen) << kv.key();
    zero += is_zero;
  }
  EXPECT_EQ(zero, 6); // 3 weights each of experts 2 and 3: zero, not missing
  EXPECT_TRUE(model->aux_loss().defined());
  // Dense models have no balancing loss; bad combinations are named.
  EXPECT_FALSE(models::LlamaForCausalLM(models::LlamaConfig::tiny_test())
                   ->aux_loss()
                   .defined());
  EXPECT_NE(
      error_of([] {
        models::LlamaForCausalLM(
            models::LlamaConfig::tiny_test().model_type("mixtral"));
      }).find("needs moe().num_experts above 0"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        models::LlamaForCausalLM(models::LlamaConfig::tiny_test().moe(
            models::MoeConfig().num_experts(4)));
      }).find("is dense"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        models::LlamaForCausalLM(
            models::LlamaConfig::tiny_test()
                .model_type("qwen3_moe")
                .moe(
                    models::MoeConfig().num_experts(2).num_experts_per_tok(3)));
      }).find("num_experts_per_tok (3) must be between 1 and num_experts (2)"),
      std::string::npos);
}

TEST_F(HfModels, BadDirectoriesAndConfigsNameTheProblem) {
  using colossalai::testing::error_of;
  HfScratch dir;
  const auto d = fs::path(dir.path);
  auto write = [&](const std::string& text) {
    std::ofstream(d / "config.json") << text;
  };
  EXPECT_NE(
      error_of([&] {
        models::from_pretrained<models::LlamaForCausalLM>(d.string());
      }).find("has no config.json"),
      std::string::npos);
  write(
      R"({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4}})");
  EXPECT_NE(
      error_of([&] {
        models::from_pretrained<models::LlamaForCausalLM>(d.string());
      }).find("field 'rope_scaling.rope_type' is \"yarn\""),
      std::string::npos);
  write(R"({"model_type": "gpt2", "activation_function": "relu"})");
  EXPECT_NE(
      error_of([&] {
        models::from_pretrained<models::GPT2LMHeadModel>(d.string());
      }).find("field 'activation_function' is \"relu\""),
      std::string::npos);
  write(R"({"model_type": "bert"})");
  EXPECT_NE(
      error_of([&] {
        models::from_pretrained<models::LlamaForCausalLM>(d.string());
      }).find("field 'model_type' is \"bert\""),
      std::string::npos);
  // A config and no weights.
  write(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2})");
  EXPECT_NE(
      error_of([&] {
        models::from_pretrained<models::LlamaForCausalLM>(d.string());
      }).find("has no weights"),
      std::string::npos);
  // Weights missing a tensor; then one of another shape.
  models::LlamaForCausalLM small(models::llama_config_from_json(
      R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2})"));
  auto state = colossalai::checkpoint_io::model_state_dict(*small);
  state.erase("model.norm.weight");
  st::save_file((d / "model.safetensors").string(), state);
  const auto missing = error_of(
      [&] { models::from_pretrained<models::LlamaForCausalLM>(d.string()); });
  EXPECT_NE(
      missing.find("lacks tensors the model needs: model.norm.weight"),
      std::string::npos)
      << missing;
  EXPECT_NO_THROW(models::from_pretrained<models::LlamaForCausalLM>(
      d.string(), models::FromPretrainedOptions().strict(false)));
  state.insert("model.norm.weight", at::ones({9}));
  st::save_file((d / "model.safetensors").string(), state);
  EXPECT_NE(
      error_of([&] {
        models::from_pretrained<models::LlamaForCausalLM>(d.string());
      }).find("'model.norm.weight' has shape [9]"),
      std::string::npos);
}

// LoRA adapters cross between PEFT and this library on a transformers
// LLaMA: a PEFT-saved adapter loads through enable_lora(pretrained_dir) and
// gives PEFT's logits; save_lora_as_pretrained's adapter loads in
// PeftModel.from_pretrained and gives ours. Bound: as logits_tol (the same
// fp32 operations; the adapter adds a rank-4 matmul per projection).
TEST_F(HfModels, LoraAdaptersRoundTripWithPeft) {
  const auto base = (fixtures() / "llama3").string();
  HfScratch dir;
  const auto peft_dir = dir.path + "/peft";
  auto r = colossalai::testing::run_shell(
      std::string(kHfPython) + " " + quote(script().string()) + " peft_make " +
      quote(base) + " " + quote(peft_dir));
  ASSERT_EQ(r.first, 0) << r.second;
  const auto ids = reference("llama3")["ids"];
  {
    auto model = models::from_pretrained<models::LlamaForCausalLM>(base);
    cb::Booster booster;
    auto lora = booster.enable_lora(model, peft_dir);
    EXPECT_EQ(lora->config().task_type(), "CAUSAL_LM");
    EXPECT_EQ(lora->config().lora_alpha(), 16);
    model->eval();
    torch::NoGradGuard no_grad;
    at::Tensor logits = model->forward(ids);
    const auto want = st::load_file(peft_dir + "/logits.safetensors")["logits"];
    EXPECT_LE((logits - want).abs().max().item<double>(), logits_tol(want));
  }
  // Ours, saved, read by PEFT.
  auto model = models::from_pretrained<models::LlamaForCausalLM>(base);
  cb::Booster booster;
  auto lora = booster.enable_lora(
      model,
      "",
      colossalai::lora::LoraConfig()
          .r(4)
          .lora_alpha(8)
          .target_modules({"q_proj", "k_proj", "o_proj"})
          .task_type("CAUSAL_LM")
          .init_lora_weights("none"));
  // A strict load of the base checkpoint into the adapted model: the
  // adapters keep their values.
  const auto before =
      lora->model()
          ->named_parameters()["model.layers.0.self_attn.q_proj.lora_B.weight"]
          .clone();
  colossalai::interface::ModelWrapper wrapped(model.ptr());
  colossalai::checkpoint_io::GeneralCheckpointIO io;
  EXPECT_NO_THROW(io.load_model(
      wrapped, base + "/model.safetensors.index.json", /*strict=*/true));
  EXPECT_TRUE(at::equal(
      before,
      model->named_parameters()
          ["model.layers.0.self_attn.q_proj.lora_B.weight"]));
  const auto adapter = dir.path + "/ours";
  lora->save_pretrained(adapter, /*use_safetensors=*/true);
  std::ifstream config_file(adapter + "/adapter_config.json");
  std::stringstream config;
  config << config_file.rdbuf();
  EXPECT_NE(config.str().find("\"lora_alpha\": 8,"), std::string::npos)
      << config.str();
  EXPECT_NE(
      config.str().find("\"task_type\": \"CAUSAL_LM\""), std::string::npos);
  model->eval();
  {
    torch::NoGradGuard no_grad;
    st::save_file(
        dir.path + "/ours.safetensors", {{"logits", model->forward(ids)}});
  }
  r = colossalai::testing::run_shell(
      std::string(kHfPython) + " " + quote(script().string()) + " peft_check " +
      quote(base) + " " + quote(adapter) + " " +
      quote(dir.path + "/ours.safetensors"));
  EXPECT_EQ(r.first, 0) << r.second;
  std::cout << r.second;
}

// prepare_dataloader's sampler draws Python's order for the same seed and
// epoch (torch.utils.data.DistributedSampler, which ColossalAI's
// prepare_dataloader uses; LibTorch's CPU generator and randperm are
// PyTorch's), so C++ and Python runs see the same batches.
TEST_F(HfModels, SamplerOrderEqualsPythons) {
  const auto r = colossalai::testing::run_shell(
      std::string(kHfPython) + " " + quote(script().string()) + " sampler");
  ASSERT_EQ(r.first, 0) << r.second;
  std::istringstream lines(r.second);
  std::string line;
  int checked = 0;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    size_t size, replicas, rank, seed;
    int shuffle, drop_last;
    int64_t epoch;
    std::string colon;
    if (!(in >> size >> replicas >> rank >> shuffle >> seed >> epoch >>
          drop_last >> colon)) {
      continue; // not an order line
    }
    std::vector<size_t> want;
    for (size_t i; in >> i;) {
      want.push_back(i);
    }
    colossalai::data::DistributedSampler sampler(
        size,
        static_cast<int>(replicas),
        static_cast<int>(rank),
        shuffle != 0,
        seed,
        drop_last != 0);
    sampler.set_epoch(epoch);
    EXPECT_EQ(sampler.indices(), want) << line;
    ++checked;
  }
  EXPECT_EQ(checked, 3 + 3 + 3 + 4);
}

// Each family, loaded from its transformers-written directory and trained
// under HybridParallel, equals one process training it: fp32, SGD, the
// bound of test_hybrid_parallel (rounding of split reductions, 2e-5).
constexpr int kSteps = 2;
constexpr int kGlobalBatch = 4;
constexpr int64_t kSeq = 16;

std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto gen = at::detail::createCPUGenerator(900 + step);
  auto tokens = at::randint(100, {kGlobalBatch, kSeq + 1}, gen);
  return {
      tokens.narrow(1, 0, kSeq).contiguous(),
      tokens.narrow(1, 1, kSeq).contiguous()};
}

// One process training on each step's batch as `dp` data-parallel ranks
// see it: the loss is the mean of the shards' losses. That is the global
// batch's loss for a token mean, but not for the balancing loss of a
// mixture of experts, a product of sums over the batch that each rank
// computes from its own tokens (as transformers' training under DDP does).
template <class M>
std::pair<std::vector<double>, std::map<std::string, at::Tensor>>
train_per_shard(M model, int dp, double max_norm) {
  auto opt = colossalai::testing::make_optimizer(model->parameters(), true);
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto b = batch(step);
    opt->zero_grad();
    const int64_t local = kGlobalBatch / dp;
    double loss = 0;
    for (int s = 0; s < dp; ++s) {
      auto l = model->loss(
                   model->forward(b.first.narrow(0, local * s, local)),
                   b.second.narrow(0, local * s, local)) /
          dp;
      l.backward();
      loss += l.template item<double>();
    }
    if (max_norm > 0) {
      torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);
    }
    opt->step();
    losses.push_back(loss);
  }
  return {
      losses,
      colossalai::testing::whole_weights(
          *model, colossalai::shardformer::ShardInfo())};
}

bool has_balancing_loss(const std::string& name) {
  return name == "mixtral" || name == "qwen2_moe";
}

// `loss_tol` and `weight_tol`: fp32's bounds unless the options train in
// another precision. `grouped_experts`: the boosted model's experts through
// grouped GEMMs (models::set_grouped_expert_gemm).
template <class M>
void check_hybrid(
    const std::string& name,
    const std::string& what,
    const HPO& options,
    double loss_tol = 1e-5,
    double weight_tol = 2e-5,
    bool grouped_experts = false) {
  SCOPED_TRACE(name + " " + what);
  const auto dir = (fixtures() / name).string();
  // ep_size > 1: experts split over data-parallel ranks.
  std::shared_ptr<cb::plugin::HybridParallelPlugin> plugin =
      options.ep_size() > 1
      ? std::make_shared<cb::plugin::MoeHybridParallelPlugin>(options)
      : std::make_shared<cb::plugin::HybridParallelPlugin>(options);
  const int dp = plugin->dp_size();
  const auto ref = has_balancing_loss(name) && dp > 1
      ? train_per_shard(models::from_pretrained<M>(dir), dp, options.max_norm())
      : colossalai::testing::train_one_process(
            models::from_pretrained<M>(dir),
            kSteps,
            /*sgd=*/true,
            options.max_norm(),
            batch);
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  auto model = models::from_pretrained<M>(dir);
  if (grouped_experts) {
    ASSERT_GT(models::set_grouped_expert_gemm(*model, true), 0);
  }
  auto boosted = booster.boost(
      model, colossalai::testing::make_optimizer(model->parameters(), true));
  const bool pipelined = options.pp_size() > 1;
  const int64_t local = kGlobalBatch / dp;
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto b = batch(step);
    auto x = b.first.narrow(0, local * plugin->dp_rank(), local);
    auto y = b.second.narrow(0, local * plugin->dp_rank(), local);
    boosted.optimizer->zero_grad();
    at::Tensor loss;
    if (pipelined) {
      auto out =
          colossalai::testing::pipeline_step(booster, boosted, model, x, y);
      loss = out.loss.defined() ? out.loss : at::zeros({});
    } else {
      loss = model->loss(boosted.model(x), y);
      booster.backward(loss, *boosted.optimizer);
    }
    if (step == 0 && options.max_norm() > 0) {
      // The global norm the clip uses (a limit that leaves the gradients
      // alone) is one process's: the parameters, experts too, count once.
      const double norm = boosted.optimizer->clip_grad_by_norm(1e9);
      auto one = models::from_pretrained<M>(dir);
      auto b0 = batch(0);
      for (int s = 0; s < dp; ++s) {
        (one->loss(
             one->forward(b0.first.narrow(0, local * s, local)),
             b0.second.narrow(0, local * s, local)) /
         dp)
            .backward();
      }
      const double want =
          torch::nn::utils::clip_grad_norm_(one->parameters(), 1e9);
      EXPECT_NEAR(norm, want, 1e-5 * want);
      EXPECT_LT(options.max_norm(), want); // the clip binds
    }
    boosted.optimizer->step();
    const bool last = !pipelined || plugin->stage_manager()->holds_last_stage();
    at::Tensor l = loss.detach().to(at::kFloat).reshape({1}).clone();
    cd::all_reduce(l, *plugin->dp_group()).wait();
    if (last) {
      EXPECT_NEAR(l.template item<double>() / dp, ref.first[step], loss_tol)
          << "step " << step;
    }
  }
  auto got = colossalai::testing::whole_weights(*model, plugin->shard_info());
  EXPECT_GT(got.size(), 0u);
  if (options.ep_size() > 1) {
    EXPECT_LT(got.size(), ref.second.size()); // other ranks' experts released
  }
  for (const auto& kv : got) {
    ASSERT_TRUE(ref.second.count(kv.first)) << kv.first;
    const at::Tensor diff = kv.second - ref.second.at(kv.first);
    EXPECT_LE(diff.abs().max().item<double>(), weight_tol) << kv.first;
  }
}

// tp 2, split_gather over it, and pp 2 for every family; GPT-2 and the
// LLaMA variants also all_to_all (Ulysses) over sp 2 (OPT, Bloom and BERT's
// policies refuse it, as ring_attn).
TEST_F(HfModels, LoadedModelsTrainUnderTpSpAndPpAsOneProcess) {
  fixtures();
  run_distributed(2, [](int, int) {
    auto base = [] { return HPO().precision("fp32"); };
    for (const auto& name : kCases) {
      with_family(name, [&](auto family) {
        using M = typename decltype(family)::type;
        check_hybrid<M>(name, "tp2", base().tp_size(2));
        if (is_moe(name)) {
          // Sparse blocks refuse sequence parallelism, and pipeline stages
          // and data parallelism the balancing loss (its product of sums
          // over the batch is not a mean of per-rank terms); qwen3_moe
          // leaves it out of its loss.
          if (name == "qwen3_moe") {
            check_hybrid<M>(name, "pp2", base().pp_size(2).num_microbatches(2));
            check_hybrid<M>(name, "dp2_zero1", base().zero_stage(1));
          }
          return;
        }
        check_hybrid<M>(
            name,
            "tp2_split_gather",
            base()
                .tp_size(2)
                .enable_sequence_parallelism(true)
                .sequence_parallelism_mode("split_gather"));
        check_hybrid<M>(name, "pp2", base().pp_size(2).num_microbatches(2));
        if constexpr (
            std::is_same_v<M, models::LlamaForCausalLM> ||
            std::is_same_v<M, models::GPT2LMHeadModel>) {
          check_hybrid<M>(
              name,
              "sp2_all_to_all",
              base()
                  .sp_size(2)
                  .enable_sequence_parallelism(true)
                  .sequence_parallelism_mode("all_to_all"));
        }
      });
    }
  });
}

// A model too large for one rank: built lazily from the directory's config,
// boosted (each rank materialises only its tensor-parallel slices and
// pipeline stage), then loaded from the transformers directory by the
// booster, which cuts each rank's slices out of the mapped files. The
// weights equal from_pretrained's, bit for bit.
TEST_F(HfModels, BoostedLazyModelLoadsATransformersDirectory) {
  fixtures();
  run_distributed(4, [](int, int) {
    const auto dir = (fixtures() / "llama_tied").string();
    const auto ref = colossalai::testing::whole_weights(
        *models::from_pretrained<models::LlamaForCausalLM>(dir),
        colossalai::shardformer::ShardInfo());
    auto plugin = std::make_shared<cb::plugin::HybridParallelPlugin>(
        HPO().precision("fp32").tp_size(2).pp_size(2).num_microbatches(2));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    models::LlamaForCausalLM model{nullptr};
    {
      colossalai::lazy::LazyInitContext lazy;
      model = models::LlamaForCausalLM(
          models::llama_config_from_json(models::pretrained_config_json(dir)));
    }
    auto boosted = booster.boost(
        model, colossalai::testing::make_optimizer(model->parameters(), true));
    booster.load_model(boosted.model, dir);
    auto got = colossalai::testing::whole_weights(*model, plugin->shard_info());
    EXPECT_GT(got.size(), 0u);
    EXPECT_LT(got.size(), ref.size()); // a stage holds part of the model
    for (const auto& kv : got) {
      ASSERT_TRUE(ref.count(kv.first)) << kv.first;
      EXPECT_TRUE(at::equal(kv.second, ref.at(kv.first))) << kv.first;
    }
  });
}

// Expert parallelism: the experts split over 2 or 4 data-parallel ranks,
// alone (its moe_dp of 2 averaging each expert's gradient) and with tensor
// parallelism, a pipeline and ZeRO, equals one process (the balancing loss
// per data-parallel rank, see train_per_shard), the global-norm clip
// counting each expert once.
TEST_F(HfModels, MoeModelsTrainUnderExpertParallelismAsOneProcess) {
  fixtures();
  run_distributed(4, [](int, int) {
    auto base = [] { return HPO().precision("fp32").ep_size(2); };
    using Q3 = models::Qwen3MoeForCausalLM;
    check_hybrid<Q3>("qwen3_moe", "ep2_dp2", base());
    check_hybrid<Q3>("qwen3_moe", "ep2_dp2_zero1", base().zero_stage(1));
    check_hybrid<Q3>("qwen3_moe", "ep2_dp2_zero2", base().zero_stage(2));
    check_hybrid<Q3>("qwen3_moe", "ep4", base().ep_size(4));
    check_hybrid<Q3>("qwen3_moe", "ep2_tp2", base().tp_size(2));
    check_hybrid<Q3>(
        "qwen3_moe", "ep2_pp2", base().pp_size(2).num_microbatches(2));
    check_hybrid<Q3>(
        "qwen3_moe",
        "ep2_pp2_zero1",
        base().pp_size(2).num_microbatches(2).zero_stage(1));
    // A clip that binds (the norms are about 1): its scale depends on
    // every expert counted once.
    check_hybrid<Q3>("qwen3_moe", "ep2_dp2_clip", base().max_norm(0.3));
    check_hybrid<Q3>(
        "qwen3_moe", "ep2_dp2_zero1_clip", base().zero_stage(1).max_norm(0.3));
    check_hybrid<models::MixtralForCausalLM>(
        "mixtral", "ep2_tp2", base().tp_size(2));
    check_hybrid<models::MixtralForCausalLM>(
        "mixtral", "ep2_dp2_zero1", base().zero_stage(1));
    check_hybrid<models::Qwen2MoeForCausalLM>(
        "qwen2_moe", "ep2_dp2_zero2", base().zero_stage(2));
    check_hybrid<models::Qwen2MoeForCausalLM>(
        "qwen2_moe", "ep4_tp1", base().ep_size(4));
    if (colossalai::compat::has_grouped_mm(at::kCPU, at::kFloat)) {
      // Each rank's experts on the rows that arrive, in grouped GEMMs.
      check_hybrid<Q3>(
          "qwen3_moe", "ep2_dp2_zero1_grouped", base().zero_stage(1), 1e-5, 2e-5, true);
    }
    // bf16 weights, rows and all-to-alls (fp32 masters under ZeRO-1), against
    // one process in fp32: bf16's rounding. Losses of about 4.6 within 0.05
    // (a few bf16 ulps of the logits' sums); weights within two bf16 ulps
    // at the largest magnitude they have (the norms' weights, near 1, where
    // an ulp is 2^-7): 1.6e-2.
    check_hybrid<Q3>(
        "qwen3_moe",
        "ep2_dp2_zero1_bf16",
        base().zero_stage(1).precision("bf16"),
        0.05,
        1.6e-2);
  });
}

// A mixture of experts trains under the data-parallel plugins too, every
// rank holding every expert (each runs on every rank, so every expert has a
// gradient to reduce, zero where no token chose it): qwen3_moe under DDP,
// ZeRO-2, FSDP and Gemini equals one process (fp32 SGD, the weights read
// back from each plugin's save).
TEST_F(HfModels, MoeModelTrainsUnderEveryDataParallelPlugin) {
  fixtures();
  run_distributed(2, [](int, int) {
    using M = models::Qwen3MoeForCausalLM;
    namespace cpl = cb::plugin;
    const auto dir = (fixtures() / "qwen3_moe").string();
    const auto ref = colossalai::testing::train_one_process(
        models::from_pretrained<M>(dir), kSteps, /*sgd=*/true, 0.0, batch);
    const fs::path out = colossalai::testing::scratch(
        colossalai::testing::test_process(), "hf_models_ep");
    std::vector<std::pair<std::string, std::shared_ptr<cpl::DPPluginBase>>>
        plugins{
            {"ddp", std::make_shared<cpl::TorchDDPPlugin>()},
            {"zero2",
             std::make_shared<cpl::LowLevelZeroPlugin>(
                 cpl::LowLevelZeroPluginOptions().stage(2).precision("fp32"))},
            {"fsdp", std::make_shared<cpl::TorchFSDPPlugin>()},
            {"gemini",
             std::make_shared<cpl::GeminiPlugin>(
                 cpl::GeminiPluginOptions().precision("fp32"))}};
    for (auto& entry : plugins) {
      SCOPED_TRACE(entry.first);
      auto& plugin = entry.second;
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = models::from_pretrained<M>(dir);
      auto boosted = booster.boost(
          model,
          colossalai::testing::make_optimizer(model->parameters(), true));
      const int dp = plugin->dp_size();
      const int64_t local = kGlobalBatch / dp;
      for (int step = 0; step < kSteps; ++step) {
        auto b = batch(step);
        auto x = b.first.narrow(0, local * plugin->dp_rank(), local);
        auto y = b.second.narrow(0, local * plugin->dp_rank(), local);
        boosted.optimizer->zero_grad();
        auto loss = model->loss(boosted.model(x), y);
        booster.backward(loss, *boosted.optimizer);
        boosted.optimizer->step();
        at::Tensor l = loss.detach().reshape({1}).clone();
        cd::all_reduce(l, *plugin->dp_group()).wait();
        EXPECT_NEAR(l.item<double>() / dp, ref.first[step], 1e-5)
            << "step " << step;
      }
      const auto saved = (out / ("plugin_" + entry.first)).string();
      booster.save_model(
          boosted.model,
          saved,
          colossalai::checkpoint_io::SaveModelOptions()
              .shard(true)
              .use_safetensors(true));
      const auto got = colossalai::testing::whole_weights(
          *models::from_pretrained<M>(saved),
          colossalai::shardformer::ShardInfo());
      EXPECT_EQ(got.size(), ref.second.size());
      for (const auto& kv : got) {
        ASSERT_TRUE(ref.second.count(kv.first)) << kv.first;
        EXPECT_LE(
            (kv.second - ref.second.at(kv.first)).abs().max().item<double>(),
            2e-5)
            << kv.first;
      }
    }
  });
}

// A checkpoint written under expert parallelism holds every expert under
// its transformers name: saved at ep 2 (x moe_dp 2, ZeRO-1, AdamW), it
// loads at ep 4 (ZeRO-2), at ep 1 (HybridParallelPlugin) and under
// LowLevelZeroPlugin, the optimizer too, and the next step lands where the
// ep 2 run's did; transformers reads
// the directory and computes the fixture's logits. Qwen2-MoE: a dense first
// layer, a shared expert and the balancing loss (every run has dp 4, so
// every rank sees the same shard of the batch in each).
TEST_F(HfModels, ExpertParallelCheckpointsLoadAtAnyLayoutAndInTransformers) {
  fixtures();
  run_distributed(4, [](int rank, int) {
    using M = models::Qwen2MoeForCausalLM;
    const auto src = (fixtures() / "qwen2_moe").string();
    const fs::path dir = colossalai::testing::scratch(
        colossalai::testing::test_process(), "hf_models_ep");
    const auto fresh = (dir / "fresh").string();
    const auto saved = (dir / "model").string();
    const auto optim = (dir / "optim").string();
    const auto after = (dir / "after").string();
    constexpr int kDp = 4;
    auto step =
        [](auto& booster, auto& plugin, auto& model, auto& boosted, int i) {
          auto b = batch(i);
          const int64_t local = kGlobalBatch / kDp;
          auto x = b.first.narrow(0, local * plugin->dp_rank(), local);
          auto y = b.second.narrow(0, local * plugin->dp_rank(), local);
          boosted.optimizer->zero_grad();
          booster.backward(
              model->loss(boosted.model(x), y), *boosted.optimizer);
          boosted.optimizer->step();
        };
    // The weights this rank holds equal `path`'s, within `tol`.
    auto expect_weights = [](M& model,
                             const colossalai::shardformer::ShardInfo& info,
                             const std::string& path,
                             double tol) {
      const auto want = colossalai::testing::whole_weights(
          *models::from_pretrained<M>(path),
          colossalai::shardformer::ShardInfo());
      const auto got = colossalai::testing::whole_weights(*model, info);
      EXPECT_GT(got.size(), 0u);
      for (const auto& kv : got) {
        ASSERT_TRUE(want.count(kv.first)) << kv.first;
        EXPECT_LE(
            (kv.second - want.at(kv.first)).abs().max().template item<double>(),
            tol)
            << path << ": " << kv.first;
      }
    };
    const auto sharded = colossalai::checkpoint_io::SaveModelOptions()
                             .shard(true)
                             .size_per_shard(1)
                             .use_safetensors(true);
    {
      auto plugin = std::make_shared<cb::plugin::MoeHybridParallelPlugin>(
          HPO().precision("fp32").ep_size(2).zero_stage(1));
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = models::from_pretrained<M>(src);
      auto boosted = booster.boost(
          model,
          colossalai::testing::make_optimizer(model->parameters(), false));
      booster.save_model(boosted.model, fresh, sharded);
      step(booster, plugin, model, boosted, 0);
      booster.save_model(boosted.model, saved, sharded);
      booster.save_optimizer(
          *boosted.optimizer,
          optim,
          colossalai::checkpoint_io::SaveOptimizerOptions().shard(true));
      step(booster, plugin, model, boosted, 1);
      booster.save_model(boosted.model, after, sharded);
      expect_weights(model, plugin->shard_info(), after, 0.0);
    }
    auto resume = [&](std::shared_ptr<cb::plugin::DPPluginBase> plugin,
                      const std::string& what) {
      SCOPED_TRACE(what);
      ASSERT_EQ(plugin->dp_size(), kDp);
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = models::from_pretrained<M>(src);
      auto boosted = booster.boost(
          model,
          colossalai::testing::make_optimizer(model->parameters(), false));
      booster.load_model(boosted.model, saved);
      booster.load_optimizer(*boosted.optimizer, optim);
      auto* hybrid =
          dynamic_cast<cb::plugin::HybridParallelPlugin*>(plugin.get());
      const auto info = hybrid != nullptr
          ? hybrid->shard_info()
          : colossalai::shardformer::ShardInfo();
      expect_weights(model, info, saved, 0.0);
      step(booster, plugin, model, boosted, 1);
      // AdamW's step from the loaded moments: the ep 2 run's, up to the
      // rounding of reductions in another order.
      expect_weights(model, info, after, 1e-5);
    };
    resume(
        std::make_shared<cb::plugin::MoeHybridParallelPlugin>(
            HPO().precision("fp32").ep_size(4).zero_stage(2)),
        "ep4_zero2");
    resume(
        std::make_shared<cb::plugin::HybridParallelPlugin>(
            HPO().precision("fp32").zero_stage(1)),
        "ep1_zero1");
    resume(
        std::make_shared<cb::plugin::LowLevelZeroPlugin>(
            cb::plugin::LowLevelZeroPluginOptions().stage(2).precision("fp32")),
        "low_level_zero2");
    if (rank == 0) {
      const auto r = colossalai::testing::run_shell(
          std::string(kHfPython) + " " + quote(script().string()) + " check " +
          quote(src) + " " + quote(fresh));
      EXPECT_EQ(r.first, 0) << r.second;
      std::cout << r.second;
    }
  });
}

// A lazily built mixture of experts under ep 2 x tp 2: each rank
// materialises its own experts' tensor-parallel slices only, then the
// booster fills them from the transformers directory, bit for bit.
TEST_F(HfModels, BoostedLazyMoeModelLoadsItsExpertsFromATransformersDirectory) {
  fixtures();
  run_distributed(4, [](int, int) {
    const auto dir = (fixtures() / "qwen2_moe").string();
    const auto ref = colossalai::testing::whole_weights(
        *models::from_pretrained<models::Qwen2MoeForCausalLM>(dir),
        colossalai::shardformer::ShardInfo());
    auto plugin = std::make_shared<cb::plugin::MoeHybridParallelPlugin>(
        HPO().precision("fp32").ep_size(2).tp_size(2));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    models::Qwen2MoeForCausalLM model{nullptr};
    {
      colossalai::lazy::LazyInitContext lazy;
      model = models::Qwen2MoeForCausalLM(
          models::llama_config_from_json(models::pretrained_config_json(dir)));
    }
    auto boosted = booster.boost(
        model, colossalai::testing::make_optimizer(model->parameters(), true));
    int64_t held_experts = 0;
    for (const auto& p : model->named_parameters()) {
      if (p.key().find(".experts.") != std::string::npos) {
        held_experts += p.value().numel() > 0 ? 1 : 0;
      }
    }
    // One sparse layer (the first of two is dense) x 2 of 4 experts x 3
    // matrices.
    EXPECT_EQ(held_experts, 2 * 3);
    booster.load_model(boosted.model, dir);
    auto got = colossalai::testing::whole_weights(*model, plugin->shard_info());
    EXPECT_LT(got.size(), ref.size());
    for (const auto& kv : got) {
      ASSERT_TRUE(ref.count(kv.first)) << kv.first;
      EXPECT_TRUE(at::equal(kv.second, ref.at(kv.first))) << kv.first;
    }
  });
}

// Packed sequences: position_ids falling back to 0 inside a row start a
// new document and attention stays inside it (transformers 5's masks read
// them so, for GPT-2 and the LLaMA family). Two documents packed in one row give each one's own logits, and
// the token-mean loss of the packed row is the unpacked pair's; without
// position_ids the second document sees the first.
template <class M>
void check_packed(const std::string& name) {
  SCOPED_TRACE(name);
  auto model = models::from_pretrained<M>((fixtures() / name).string());
  model->eval();
  at::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(7);
  const auto a = at::randint(100, {1, 6}, gen);
  const auto b = at::randint(100, {1, 9}, gen);
  auto ta = at::randint(100, {1, 6}, gen), tb = at::randint(100, {1, 9}, gen);
  ta.index_put_({0, 0}, -100); // prompts are not trained
  tb.index_put_({0, at::indexing::Slice(0, 3)}, -100);
  const auto ids = at::cat({a, b}, 1);
  const auto pos =
      at::cat({at::arange(6, at::kLong), at::arange(9, at::kLong)})
          .unsqueeze(0);
  // The same fp32 computation, with masked keys beside the document's:
  // 1e-5 allows the rounding of the longer row's matmuls.
  const at::Tensor packed = model->forward(ids, at::Tensor(), pos);
  const at::Tensor la = model->forward(a), lb = model->forward(b);
  EXPECT_LE((packed.narrow(1, 0, 6) - la).abs().max().template item<double>(), 1e-5);
  EXPECT_LE((packed.narrow(1, 6, 9) - lb).abs().max().template item<double>(), 1e-5);
  const double na = ta.ne(-100).sum().template item<double>();
  const double nb = tb.ne(-100).sum().template item<double>();
  const double unpacked = (model->loss(la, ta).template item<double>() * na +
                           model->loss(lb, tb).template item<double>() * nb) /
      (na + nb);
  EXPECT_NEAR(
      model->loss(packed, at::cat({ta, tb}, 1)).template item<double>(),
      unpacked,
      1e-5);
  // Without position_ids, or with an attention_mask beside them (as
  // transformers), one causal sequence: the second document sees the
  // first.
  EXPECT_GT(
      (model->forward(ids).narrow(1, 6, 9) - lb).abs().max().template item<double>(),
      1e-3);
  EXPECT_GT(
      (model->forward(ids, at::ones_like(ids), pos).narrow(1, 6, 9) - lb)
          .abs()
          .max()
          .template item<double>(),
      1e-3);
}

TEST_F(HfModels, PackedDocumentsEqualTheirUnpackedLogitsAndLoss) {
  check_packed<models::LlamaForCausalLM>("llama3");
  check_packed<models::LlamaForCausalLM>("qwen3");
  check_packed<models::GPT2LMHeadModel>("gpt2");
}

// generate.safetensors (hf_models.py's `generation`): transformers'
// generate on two prompts, the second left-padded.
colossalai::checkpoint_io::StateDict generation_reference(
    const std::string& name) {
  return st::load_file((fixtures() / name / "generate.safetensors").string());
}

std::vector<int64_t> to_ids(const at::Tensor& t) {
  auto c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

models::GenerationConfig generation_config(
    const colossalai::checkpoint_io::StateDict& ref,
    const std::string& run) {
  auto c = models::GenerationConfig()
               .max_new_tokens(12)
               .eos_token_id(to_ids(ref[run + "_eos"]))
               .pad_token_id(ref["gen_pad"].item<int64_t>());
  if (run == "penalized") {
    c.repetition_penalty(1.3).min_new_tokens(3);
  }
  return c;
}

// Greedy decoding of `run` ("greedy", "greedy_stop") with `model` against
// transformers': every step's logits within logits_tol of transformers'
// (all rows: finished ones still run, fed the padding token), and so the
// same tokens, since the fixture's path has no near-tie (each step's two
// largest logits differ by more than twice the bound; checked).
template <class M>
void check_greedy(
    M& model,
    const colossalai::checkpoint_io::StateDict& ref,
    const std::string& run,
    bool use_cache = true) {
  SCOPED_TRACE(run + (use_cache ? "" : " without a cache"));
  const at::Tensor want_logits = ref[run + "_logits"]; // [steps, B, V]
  std::vector<at::Tensor> logits;
  auto* m = model.get();
  auto step = [&](const at::Tensor& ids,
                  const at::Tensor& mask,
                  const at::Tensor& pos,
                  models::KVCache* cache) {
    models::KVCache whole;
    auto l = m->forward_cached(ids, cache ? *cache : whole, mask, pos, 1);
    logits.push_back(l.select(1, -1));
    return l;
  };
  const auto out = models::generate_with(
      step,
      ref["gen_ids"],
      ref["gen_mask"],
      generation_config(ref, run).use_cache(use_cache));
  const int64_t steps = want_logits.size(0);
  EXPECT_EQ(static_cast<int64_t>(logits.size()), steps);
  double worst = 0;
  for (int64_t s = 0; s < std::min<int64_t>(steps, logits.size()); ++s) {
    const auto want = want_logits[s];
    const double tol = logits_tol(want);
    // The choice is made on the processed scores (the penalty, the stop
    // tokens held back).
    const auto top = std::get<0>(ref[run + "_scores"][s].topk(2, -1));
    EXPECT_GT((top.select(1, 0) - top.select(1, 1)).min().item<double>(), 2 * tol)
        << "the fixture's step " << s << " has a near-tie";
    const double diff = (logits[s] - want).abs().max().item<double>();
    EXPECT_LE(diff, tol) << "step " << s;
    worst = std::max(worst, diff / tol);
  }
  EXPECT_TRUE(out.equal(ref[run])) << "ours\n"
                                      << out << "\ntransformers'\n"
                                      << ref[run];
  std::cout << "  " << run << (use_cache ? "" : " (no cache)") << ": "
            << steps << " steps, logits within " << worst
            << " of their bounds\n";
}

template <class M>
void check_generation(const std::string& name) {
  SCOPED_TRACE(name);
  std::cout << name << ":\n";
  auto model = models::from_pretrained<M>((fixtures() / name).string());
  model->eval();
  const auto ref = generation_reference(name);
  check_greedy(model, ref, "greedy");
  check_greedy(model, ref, "greedy_stop");
  check_greedy(model, ref, "greedy", /*use_cache=*/false);
  check_greedy(model, ref, "penalized");
  // Each prompt alone, unpadded: the batch's continuation of it (the
  // padding changes nothing but which columns are real).
  const auto ids = ref["gen_ids"], mask = ref["gen_mask"];
  const auto cfg = generation_config(ref, "greedy");
  const int64_t t = ids.size(1);
  for (int64_t row = 0; row < 2; ++row) {
    const int64_t pad = t - mask[row].sum().item<int64_t>();
    const auto alone = ids.narrow(0, row, 1).narrow(1, pad, t - pad);
    const auto out = models::generate(model, alone, at::Tensor(), cfg);
    EXPECT_TRUE(out.equal(ref["greedy"].narrow(0, row, 1).narrow(1, pad, out.size(1))))
        << "row " << row << " alone: " << out;
  }
  // Sampling: what transformers drew after torch.manual_seed(7) where this
  // LibTorch is the Python torch's version (the same multinomial draws from
  // the same generator state); the same tokens for the same seed anywhere.
  auto sample_cfg = generation_config(ref, "sampled")
                        .do_sample(true)
                        .temperature(0.8)
                        .top_k(20)
                        .top_p(0.9)
                        .seed(7);
  const auto sampled = models::generate(model, ids, mask, sample_cfg);
  EXPECT_TRUE(sampled.equal(models::generate(model, ids, mask, sample_cfg)));
  const auto v = to_ids(ref["torch_version"]);
  if (v[0] == TORCH_VERSION_MAJOR && v[1] == TORCH_VERSION_MINOR &&
      v[2] == TORCH_VERSION_PATCH) {
    EXPECT_TRUE(sampled.equal(ref["sampled"]))
        << "ours\n" << sampled << "\ntransformers'\n" << ref["sampled"];
    std::cout << "  sampled: transformers' tokens (torch " << v[0] << "."
              << v[1] << "." << v[2] << ")\n";
  }
  EXPECT_FALSE(sampled.equal(
      models::generate(model, ids, mask, sample_cfg.seed(8))));
}

// Greedy generation with a KV cache equals transformers' generate token
// for token for every causal family: batched prompts with left padding,
// stop tokens, GQA (llama3: 8 heads over 4), Mistral's and Mixtral's
// sliding window (8, shorter than prompt + new tokens: the cache drops
// what the window hides), ALiBi (bloom), OPT's learned positions; a
// repetition penalty with min_new_tokens; and sampling with transformers'
// warpers.
TEST_F(HfModels, GenerationEqualsTransformersGenerate) {
  for (const auto& name : kCases) {
    with_family(name, [&](auto family) {
      using M = typename decltype(family)::type;
      if constexpr (!kMaskedLM<M>) {
        check_generation<M>(name);
      }
    });
  }
}

// Under tensor parallelism each rank caches its share of the key/value
// heads and gathers the logits: the same tokens as transformers on both
// ranks.
TEST_F(HfModels, GenerationUnderTensorParallelismEqualsTransformers) {
  fixtures();
  run_distributed(2, [](int, int) {
    for (const char* name : {"gpt2", "llama3", "mistral", "qwen3_moe", "opt", "bloom"}) {
      with_family(name, [&](auto family) {
        using M = typename decltype(family)::type;
        if constexpr (!kMaskedLM<M>) {
          SCOPED_TRACE(std::string(name) + " tp2");
          auto plugin = std::make_shared<cb::plugin::HybridParallelPlugin>(
              HPO().tp_size(2).precision("fp32"));
          cb::Booster booster(cb::BoosterOptions().plugin(plugin));
          auto model =
              models::from_pretrained<M>((fixtures() / name).string());
          auto boosted = booster.boost(
              model,
              colossalai::testing::make_optimizer(model->parameters(), true));
          model->eval();
          ASSERT_EQ(model->parallel_state().tp_size(), 2);
          check_greedy(model, generation_reference(name), "greedy");
        }
      });
    }
  });
}

// A pipeline under a NoGradGuard runs the forwards only (ColossalAI's
// evaluation): the last stage's loss is one process's token mean, and no
// gradient appears. A micro-batch may leave the attention mask out beside
// packed position ids: the same packed loss as one process, in evaluation
// and in a training step.
TEST_F(HfModels, PipelineEvaluatesForwardOnlyAndTakesPackedMicroBatches) {
  fixtures();
  run_distributed(2, [](int rank, int) {
    for (const char* name : {"llama3", "gpt2"}) {
      with_family(name, [&](auto family) {
        using M = typename decltype(family)::type;
        if constexpr (std::is_same_v<M, models::LlamaForCausalLM> ||
                      std::is_same_v<M, models::GPT2LMHeadModel>) {
          SCOPED_TRACE(name);
          const auto dir = (fixtures() / name).string();
          auto ref = reference(name);
          const at::Tensor x = ref["ids"];
          const at::Tensor labels = ref["labels"];
          const at::Tensor y = at::cat(
              {labels.narrow(1, 1, labels.size(1) - 1),
               at::full({labels.size(0), 1}, -100, labels.options())},
              1);
          const at::Tensor pos = ref["position_ids_packed"];
          auto one = models::from_pretrained<M>(dir);
          double want = 0, want_packed = 0;
          {
            at::NoGradGuard no_grad;
            want = one->loss(one->forward(x), y).template item<double>();
            want_packed = one->loss(one->forward(x, at::Tensor(), pos), y)
                              .template item<double>();
          }
          auto plugin = std::make_shared<cb::plugin::HybridParallelPlugin>(
              HPO().pp_size(2).num_microbatches(2).precision("fp32"));
          cb::Booster booster(cb::BoosterOptions().plugin(plugin));
          auto model = models::from_pretrained<M>(dir);
          auto boosted = booster.boost(
              model,
              colossalai::testing::make_optimizer(model->parameters(), true));
          auto criterion = [&](const at::Tensor& logits, const cp::Batch& mb) {
            return model->loss(logits, mb[1]);
          };
          auto run = [&](const cp::Batch& batch, bool train) {
            return booster
                .execute_pipeline(
                    [&] { return batch; },
                    boosted.model,
                    criterion,
                    train ? boosted.optimizer.get() : nullptr)
                .loss;
          };
          at::Tensor eval, eval_packed;
          {
            at::NoGradGuard no_grad;
            eval = run({x, y}, false);
            eval_packed = run({x, y, at::Tensor(), pos}, false);
          }
          for (const auto& p : model->parameters()) {
            EXPECT_FALSE(p.grad().defined());
          }
          boosted.optimizer->zero_grad();
          const at::Tensor trained = run({x, y, at::Tensor(), pos}, true);
          ASSERT_EQ(eval.defined(), rank == 1);
          if (rank == 1) {
            // The same fp32 operations split over two stages.
            EXPECT_NEAR(eval.template item<double>(), want, 1e-5);
            EXPECT_NEAR(eval_packed.template item<double>(), want_packed, 1e-5);
            EXPECT_NEAR(trained.template item<double>(), want_packed, 1e-5);
            EXPECT_GT(std::abs(want - want_packed), 1e-3);
          }
        }
      });
    }
  });
}

// What expert parallelism cannot do is refused by name, on every rank
// before anything is communicated or sharded.
TEST_F(HfModels, ExpertParallelismRefusesWhatCannotCombineByName) {
  fixtures();
  using cb::plugin::MoeHybridParallelPlugin;
  using colossalai::testing::error_of;
  auto has = [](const std::string& text, const std::string& part) {
    EXPECT_NE(text.find(part), std::string::npos) << text;
  };
  run_distributed(4, [&](int, int) {
    const auto base = HPO().precision("fp32");
    has(error_of(
            [&] { cb::plugin::HybridParallelPlugin p(HPO(base).ep_size(2)); }),
        "ep_size 2 needs MoeHybridParallelPlugin");
    has(error_of([&] { MoeHybridParallelPlugin p(HPO(base).ep_size(3)); }),
        "ep_size 3 must divide the data-parallel size");
    has(error_of([&] {
          MoeHybridParallelPlugin p(HPO(base).ep_size(2).tp_size(4));
        }),
        "must divide the data-parallel size world / (tp_size x pp_size x "
        "sp_size) = 1");
    has(error_of([&] {
          MoeHybridParallelPlugin p(
              HPO(base)
                  .ep_size(2)
                  .sp_size(2)
                  .enable_sequence_parallelism(true)
                  .sequence_parallelism_mode("all_to_all"));
        }),
        "sequence parallelism is not supported with experts");
    // A dense model has no experts to split.
    auto plugin =
        std::make_shared<MoeHybridParallelPlugin>(HPO(base).ep_size(2));
    EXPECT_FALSE(plugin->support_lora());
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto dense = models::from_pretrained<models::LlamaForCausalLM>(
        (fixtures() / "llama3").string());
    has(error_of([&] {
          booster.boost(
              dense,
              colossalai::testing::make_optimizer(dense->parameters(), true));
        }),
        "ep_size 2 needs a model with experts");
  });
  // 4 experts do not split over 3 ranks.
  run_distributed(3, [&](int, int) {
    auto plugin = std::make_shared<MoeHybridParallelPlugin>(
        HPO().precision("fp32").ep_size(3));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto model = models::from_pretrained<models::Qwen3MoeForCausalLM>(
        (fixtures() / "qwen3_moe").string());
    has(error_of([&] {
          booster.boost(
              model,
              colossalai::testing::make_optimizer(model->parameters(), true));
        }),
        "num_experts (4) must divide by ep_size (3)");
  });
}

TEST_F(HfModels, LoadedLlamaTrainsUnderTp2Pp2AsOneProcess) {
  fixtures();
  run_distributed(4, [](int, int) {
    check_hybrid<models::LlamaForCausalLM>(
        "llama3",
        "tp2_pp2",
        HPO().precision("fp32").tp_size(2).pp_size(2).num_microbatches(2));
  });
}

} // namespace
