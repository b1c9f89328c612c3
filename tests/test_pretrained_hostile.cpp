// Hostile Hugging Face directories against from_pretrained: wrong-typed or
// out-of-range config fields, JSON nested 1e5 deep, a config far larger than
// its weights, FIFOs and devices in place of files, files above the JSON
// bound, indexes whose shards disagree with them. Each gives an error naming
// the file and the field (or tensor), quickly and without allocating what
// the config describes; none kills or hangs the process.

#include <colossalai/booster/booster.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/state_dict.h>
#include <colossalai/models/pretrained.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <sstream>
#include <string>
#include <thread>

namespace models = colossalai::models;
namespace st = colossalai::checkpoint_io::safetensors;
namespace fs = std::filesystem;
using colossalai::testing::error_of;

namespace {

struct Scratch : colossalai::testing::ScratchDir {
  Scratch() : ScratchDir("pretrained_hostile") {}
  std::string file(const std::string& name) const {
    return (fs::path(path) / name).string();
  }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(file(name)) << text;
  }
};

// Every family's config reader on `json`: the errors each gives ("" where it
// accepts the text).
std::vector<std::string> errors_of_every_family(const std::string& json) {
  return {
      error_of([&] { models::gpt2_config_from_json(json); }),
      error_of([&] { models::llama_config_from_json(json); }),
      error_of([&] { models::opt_config_from_json(json); }),
      error_of([&] { models::bloom_config_from_json(json); }),
      error_of([&] { models::bert_config_from_json(json); })};
}

#define EXPECT_HAS(text, part) \
  EXPECT_NE((text).find(part), std::string::npos) << (text)

// One config text and the error it must give.
struct Case {
  std::string json;
  std::string error;
};

void expect_errors(
    const std::function<void(const std::string&)>& read,
    const std::vector<Case>& cases) {
  for (const auto& c : cases) {
    const auto e = error_of([&] { read(c.json); });
    EXPECT_HAS(e, c.error) << "\n  config: " << c.json;
    // A message quotes values short, never a whole dump.
    EXPECT_LT(e.size(), 600u) << c.json;
  }
}

// An allocation cap on this process for a scope (RLIMIT_DATA: what it maps
// and allocates beyond its current data size). A model the config describes
// fails to allocate instead of taking the machine's memory, so a regression
// shows as the wrong error.
class MemoryCap {
 public:
  explicit MemoryCap(int64_t bytes) {
    ::getrlimit(RLIMIT_DATA, &saved_);
    std::ifstream status("/proc/self/status");
    std::string line;
    int64_t data_kb = 0;
    while (std::getline(status, line)) {
      if (line.rfind("VmData:", 0) == 0) {
        data_kb = std::stoll(line.substr(7));
      }
    }
    rlimit capped = saved_;
    capped.rlim_cur = static_cast<rlim_t>(data_kb * 1024 + bytes);
    if (saved_.rlim_max != RLIM_INFINITY && capped.rlim_cur > saved_.rlim_max) {
      capped.rlim_cur = saved_.rlim_max;
    }
    ::setrlimit(RLIMIT_DATA, &capped);
  }
  ~MemoryCap() {
    ::setrlimit(RLIMIT_DATA, &saved_);
  }

 private:
  rlimit saved_{};
};

// `fn`'s error, with a deadline: a call blocked opening the FIFO `fifo` is
// released (a writer opens it) and reported as a failure.
std::string error_within(
    const std::string& fifo,
    const std::function<void()>& fn) {
  auto result = std::async(std::launch::async, [&] { return error_of(fn); });
  if (result.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    ADD_FAILURE() << "still blocked after 20 s on the FIFO " << fifo;
    const int fd = ::open(fifo.c_str(), O_WRONLY); // wakes the reader
    ::close(fd);
  }
  return result.get();
}

template <class M, class Config>
void save_tiny(const Config& config, const std::string& dir) {
  torch::manual_seed(0);
  M model(config);
  models::save_pretrained(model, dir);
}

} // namespace

TEST(PretrainedHostile, ConfigFieldsAreTypeAndRangeChecked) {
  expect_errors(
      [](const std::string& j) { models::gpt2_config_from_json(j); },
      {
          {R"({"n_head": 0})",
           "config.json: field 'n_head' must be a positive integer, got 0"},
          {R"({"n_layer": 2.5})",
           "config.json: field 'n_layer' must be a positive integer, got 2.5"},
          {R"({"n_layer": 2.0})", "field 'n_layer' must be a positive integer"},
          {R"({"n_inner": -1})", "field 'n_inner' must be a positive integer"},
          {R"({"n_embd": "768"})",
           "field 'n_embd' must be a positive integer, got \"768\""},
          {R"({"vocab_size": 1000000000000})",
           "field 'vocab_size' must be at most 2147483647"},
          {R"({"vocab_size": 18446744073709551615})",
           "field 'vocab_size' must be at most"},
          {R"({"n_embd": 30, "n_head": 4})",
           "field 'n_embd' (30) must be divisible by field 'n_head' (4)"},
          {R"({"layer_norm_epsilon": 0})",
           "field 'layer_norm_epsilon' must be a finite number above 0"},
          {R"({"layer_norm_epsilon": -0.0})",
           "field 'layer_norm_epsilon' must be a finite number above 0"},
          {R"({"embd_pdrop": 1.5})",
           "field 'embd_pdrop' must be a number in [0, 1]"},
          {R"({"initializer_range": -1})", "field 'initializer_range'"},
          {R"({"scale_attn_weights": "yes"})",
           "field 'scale_attn_weights' = \"yes\" is not supported by GPT-2"},
          {R"({"activation_function": "relu"})",
           "field 'activation_function' is \"relu\", which GPT-2 does not "
           "compute"},
          {R"({"activation_function": ["gelu_new"]})",
           "field 'activation_function' must be a string, got an array of 1 "
           "entry"},
          {R"({"model_type": "llama"})",
           "field 'model_type' is \"llama\", which GPT2LMHeadModel"},
          {R"([1, 2])", "config.json: must be a JSON object"},
          {R"({"n_head": )", "config.json is not valid JSON"},
      });
  expect_errors(
      [](const std::string& j) { models::llama_config_from_json(j); },
      {
          {R"({"rope_theta": 0})",
           "field 'rope_theta' must be a finite number above 0, got 0"},
          {R"({"rope_theta": -10000})", "field 'rope_theta'"},
          {R"({"rope_parameters": {"rope_type": "default", "rope_theta": 0}})",
           "field 'rope_parameters.rope_theta' must be a finite number above "
           "0"},
          {R"({"rope_scaling": "linear"})",
           "field 'rope_scaling' must be an object, got \"linear\""},
          {R"({"rope_scaling": {"rope_type": "yarn", "factor": 4}})",
           "field 'rope_scaling.rope_type' is \"yarn\""},
          {R"({"rope_scaling": {"type": "linear", "factor": 0}})",
           "field 'rope_scaling.factor' must be a finite number above 0"},
          {R"({"rope_scaling": {"rope_type": "llama3", "factor": 8,
               "low_freq_factor": 4, "high_freq_factor": 4}})",
           "field 'rope_scaling.low_freq_factor' (4.0) must be below"},
          {R"({"head_dim": -8})",
           "field 'head_dim' must be a positive integer, got -8"},
          {R"({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 7})",
           "field 'head_dim' gives heads of 7 dimensions"},
          {R"({"hidden_size": 30, "num_attention_heads": 4})",
           "field 'hidden_size' (30) must be divisible by field "
           "'num_attention_heads' (4)"},
          {R"({"hidden_size": 24, "num_attention_heads": 8})",
           "field 'hidden_size' gives heads of 3 dimensions"},
          {R"({"num_attention_heads": 4, "num_key_value_heads": 3,
               "hidden_size": 64})",
           "field 'num_attention_heads' (4) must be divisible by field "
           "'num_key_value_heads' (3)"},
          {R"({"num_key_value_heads": 0})",
           "field 'num_key_value_heads' must be a positive integer"},
          {R"({"rms_norm_eps": -1e-6})", "field 'rms_norm_eps'"},
          {R"({"tie_word_embeddings": "true"})",
           "field 'tie_word_embeddings' must be true or false, got \"true\""},
          {R"({"attention_bias": 1})",
           "field 'attention_bias' must be true or false, got 1"},
          {R"({"hidden_act": "gelu"})", "field 'hidden_act' is \"gelu\""},
          {R"({"model_type": 5})",
           "field 'model_type' must be a string, got 5"},
          {R"({"model_type": "bert"})", "field 'model_type' is \"bert\""},
          {R"({"model_type": "mistral", "sliding_window": -1})",
           "field 'sliding_window' must be a non-negative integer"},
          {R"({"model_type": "qwen2", "use_sliding_window": "no"})",
           "field 'use_sliding_window' must be true or false"},
          {R"({"model_type": "qwen3", "use_sliding_window": true})",
           "field 'use_sliding_window' = true is not supported"},
      });
  expect_errors(
      [](const std::string& j) { models::opt_config_from_json(j); },
      {
          {R"({"num_attention_heads": 0})",
           "field 'num_attention_heads' must be a positive integer, got 0"},
          {R"({"ffn_dim": 0})", "field 'ffn_dim' must be a positive integer"},
          {R"({"word_embed_proj_dim": -1})", "field 'word_embed_proj_dim'"},
          {R"({"hidden_size": 30, "num_attention_heads": 4})",
           "field 'hidden_size' (30) must be divisible"},
          {R"({"vocab_size": 10, "pad_token_id": 10})",
           "field 'pad_token_id' (10) must be below field 'vocab_size' (10)"},
          {R"({"pad_token_id": -1})",
           "field 'pad_token_id' must be a non-negative integer"},
          {R"({"layerdrop": 0.1})",
           "field 'layerdrop' = 0.1 is not supported by OPT"},
          {R"({"enable_bias": 1})",
           "field 'enable_bias' must be true or false"},
          {R"({"dropout": -0.1})",
           "field 'dropout' must be a number in [0, 1]"},
      });
  expect_errors(
      [](const std::string& j) { models::bloom_config_from_json(j); },
      {
          {R"({"n_head": 0})", "field 'n_head' must be a positive integer"},
          {R"({"num_attention_heads": 0})",
           "field 'num_attention_heads' must be a positive integer"},
          {R"({"n_embed": 30, "n_head": 4})",
           "field 'n_embed' (30) must be divisible by field 'n_head' (4)"},
          {R"({"hidden_size": 30, "num_attention_heads": 4})",
           "field 'hidden_size' (30) must be divisible by field "
           "'num_attention_heads' (4)"},
          {R"({"n_layer": 1.5})", "field 'n_layer' must be a positive integer"},
          {R"({"slow_but_exact": "yes"})",
           "field 'slow_but_exact' must be true or false"},
          {R"({"pretraining_tp": 2, "slow_but_exact": true})",
           "field 'slow_but_exact' = true with pretraining_tp = 2"},
      });
  expect_errors(
      [](const std::string& j) { models::bert_config_from_json(j); },
      {
          {R"({"num_attention_heads": 0})",
           "field 'num_attention_heads' must be a positive integer"},
          {R"({"type_vocab_size": 0})", "field 'type_vocab_size'"},
          {R"({"pad_token_id": -1})", "field 'pad_token_id'"},
          {R"({"layer_norm_eps": -1})", "field 'layer_norm_eps'"},
          {R"({"hidden_dropout_prob": "0.1"})",
           "field 'hidden_dropout_prob' must be a number in [0, 1], got "
           "\"0.1\""},
          {R"({"position_embedding_type": "relative_key"})",
           "field 'position_embedding_type' = \"relative_key\" is not "
           "supported by BERT"},
      });
  // What save_pretrained writes reads back (no field refused by mistake).
  EXPECT_EQ(
      models::gpt2_config_from_json(
          models::config_to_json(models::GPT2Config::tiny_test()))
          .n_head(),
      models::GPT2Config::tiny_test().n_head());
}

TEST(PretrainedHostile, DeepJsonAndLongValuesAreRefusedShort) {
  const int depth = 100000;
  const std::string deep = R"({"n_head": )" + std::string(depth, '[') +
      std::string(depth, ']') + "}";
  for (const auto& e : errors_of_every_family(deep)) {
    EXPECT_HAS(e, "config.json: JSON nested deeper than 64 levels");
  }
  // Nested within the bound: refused by type, quoted by its size only.
  const std::string nested =
      R"({"n_head": )" + std::string(60, '[') + std::string(60, ']') + "}";
  EXPECT_HAS(
      error_of([&] { models::gpt2_config_from_json(nested); }),
      "field 'n_head' must be a positive integer, got an array of 1 entry");
  const std::string long_value =
      R"({"model_type": ")" + std::string(1 << 20, 'x') + "\"}";
  for (const auto& e : errors_of_every_family(long_value)) {
    EXPECT_HAS(e, "field 'model_type' is \"xxxx");
    EXPECT_LT(e.size(), 600u);
  }
  Scratch dir;
  dir.write("config.json", deep);
  EXPECT_HAS(
      error_of([&] { models::pretrained_model_type(dir.path); }),
      "config.json: JSON nested deeper than 64 levels");
  dir.write("config.json", R"({"vocab_size": 4})");
  EXPECT_HAS(
      error_of([&] { models::pretrained_model_type(dir.path); }),
      dir.file("config.json") + ": field 'model_type' is missing");
}

// The error of from_pretrained names the file's path.
TEST(PretrainedHostile, FromPretrainedNamesTheConfigFile) {
  Scratch dir;
  save_tiny<models::GPT2LMHeadModel>(models::GPT2Config::tiny_test(), dir.path);
  dir.write("config.json", R"({"model_type": "gpt2", "n_head": 0})");
  EXPECT_HAS(
      error_of(
          [&] { models::from_pretrained<models::GPT2LMHeadModel>(dir.path); }),
      "from_pretrained: " + dir.file("config.json") +
          ": field 'n_head' must be a positive integer, got 0");
  dir.write("config.json", R"({"model_type": "gpt2", "dtype": "int8"})");
  EXPECT_HAS(
      error_of(
          [&] { models::from_pretrained<models::GPT2LMHeadModel>(dir.path); }),
      dir.file("config.json") + ": field 'dtype' is \"int8\"");
  dir.write("config.json", R"({"model_type": "gpt2", "torch_dtype": 16})");
  EXPECT_HAS(
      error_of(
          [&] { models::from_pretrained<models::GPT2LMHeadModel>(dir.path); }),
      "field 'torch_dtype' must be a string, got 16");
}

// A config much larger than its weights is refused from the weights'
// headers, before the model is allocated: LLaMA's defaults are 7B
// parameters (27 GB in fp32).
TEST(PretrainedHostile, SizesAreComparedWithTheWeightsBeforeAllocating) {
  Scratch dir;
  save_tiny<models::LlamaForCausalLM>(
      models::LlamaConfig::tiny_test(), dir.path);
  dir.write("config.json", R"({"model_type": "llama"})");
  const auto start = std::chrono::steady_clock::now();
  std::string e;
  {
    MemoryCap cap(int64_t(1) << 30);
    e = error_of(
        [&] { models::from_pretrained<models::LlamaForCausalLM>(dir.path); });
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  const auto tiny = models::LlamaConfig::tiny_test();
  EXPECT_HAS(
      e,
      "model.safetensors: 'model.embed_tokens.weight' has shape [" +
          std::to_string(tiny.vocab_size()) + ", " +
          std::to_string(tiny.hidden_size()) +
          "] but the model built from config.json expects [32000, 4096]");
  EXPECT_LT(seconds, 10.0);
  // The same under strict(false): present tensors still must match.
  {
    MemoryCap cap(int64_t(1) << 30);
    EXPECT_HAS(
        error_of([&] {
          models::from_pretrained<models::LlamaForCausalLM>(
              dir.path, models::FromPretrainedOptions().strict(false));
        }),
        "expects [32000, 4096]");
  }
  // Layers beyond what the weights could hold are refused before even a
  // lazy build of them.
  auto huge = models::config_to_json(tiny);
  huge.replace(
      huge.find("\"num_hidden_layers\": 2"),
      std::string("\"num_hidden_layers\": 2").size(),
      "\"num_hidden_layers\": 2000000000");
  dir.write("config.json", huge);
  EXPECT_HAS(
      error_of(
          [&] { models::from_pretrained<models::LlamaForCausalLM>(dir.path); }),
      "field 'num_hidden_layers' (2000000000) asks for more layers than the "
      "weights hold tensors");
}

// Every family still loads what save_pretrained wrote (the lazy build that
// checks the shapes first changes nothing of the weights).
TEST(PretrainedHostile, EveryFamilyLoadsItsOwnDirectory) {
  auto check = [](auto model, auto loaded) {
    for (const auto& kv : model->named_parameters()) {
      EXPECT_TRUE(at::equal(kv.value(), loaded->named_parameters()[kv.key()]))
          << kv.key();
    }
  };
  Scratch dir;
  torch::manual_seed(0);
  models::GPT2LMHeadModel gpt2(models::GPT2Config::tiny_test());
  models::save_pretrained(gpt2, dir.path);
  check(gpt2, models::from_pretrained<models::GPT2LMHeadModel>(dir.path));
  models::LlamaForCausalLM llama(models::LlamaConfig::tiny_test());
  models::save_pretrained(llama, dir.path);
  check(llama, models::from_pretrained<models::LlamaForCausalLM>(dir.path));
  // Llama 3.1's rotary scaling (computed with ops LibTorch 1.13 has no meta
  // kernel for).
  models::LlamaForCausalLM llama3(models::LlamaConfig::tiny_test().rope_scaling(
      models::RopeScaling().rope_type("llama3").factor(8.0)));
  models::save_pretrained(llama3, dir.path);
  check(llama3, models::from_pretrained<models::LlamaForCausalLM>(dir.path));
  models::OPTForCausalLM opt(models::OPTConfig::tiny_test());
  models::save_pretrained(opt, dir.path);
  check(opt, models::from_pretrained<models::OPTForCausalLM>(dir.path));
  models::BloomForCausalLM bloom(models::BloomConfig::tiny_test());
  models::save_pretrained(bloom, dir.path);
  check(bloom, models::from_pretrained<models::BloomForCausalLM>(dir.path));
  models::BertForMaskedLM bert(models::BertConfig::tiny_test());
  models::save_pretrained(bert, dir.path);
  check(bert, models::from_pretrained<models::BertForMaskedLM>(dir.path));
}

// FIFOs and devices in place of the files are refused, not waited on; a
// file above the JSON bound is refused without being read.
TEST(PretrainedHostile, OnlyRegularFilesOfBoundedSizeAreRead) {
  Scratch dir;
  save_tiny<models::GPT2LMHeadModel>(models::GPT2Config::tiny_test(), dir.path);
  auto load = [&] {
    models::from_pretrained<models::GPT2LMHeadModel>(dir.path);
  };
  const auto config = dir.file("config.json");
  const auto saved = dir.file("config.saved");
  fs::rename(config, saved);
  ASSERT_EQ(::mkfifo(config.c_str(), 0600), 0);
  EXPECT_HAS(
      error_within(config, load),
      "cannot open '" + config + "': not a regular file");
  fs::remove(config);
  fs::create_symlink("/dev/zero", config);
  EXPECT_HAS(
      error_of(load), "cannot open '" + config + "': not a regular file");
  fs::remove(config);
  {
    // Sparse: 65 MiB that take no disk.
    std::ofstream(config) << "{}";
    fs::resize_file(config, (int64_t(65) << 20));
  }
  EXPECT_HAS(error_of(load), "above the 67108864-byte limit of a config.json");
  fs::remove(config);
  fs::rename(saved, config);

  for (const char* name : {"model.safetensors", "pytorch_model.bin"}) {
    const auto weights = dir.file(name);
    std::error_code ec;
    fs::remove(dir.file("model.safetensors"), ec);
    ASSERT_EQ(::mkfifo(weights.c_str(), 0600), 0);
    EXPECT_HAS(
        error_within(weights, load),
        "cannot open '" + weights + "': not a regular file");
    fs::remove(weights);
  }
  const auto index = dir.file("model.safetensors.index.json");
  ASSERT_EQ(::mkfifo(index.c_str(), 0600), 0);
  EXPECT_HAS(
      error_within(index, load),
      "cannot open '" + index + "': not a regular file");
}

// A sharded checkpoint's tensors come from the shard its index names; what
// the index names but no shard holds is reported.
TEST(PretrainedHostile, ShardsAreReadAsTheIndexNamesThem) {
  Scratch dir;
  torch::manual_seed(0);
  const auto config = models::LlamaConfig::tiny_test();
  models::LlamaForCausalLM model(config);
  models::save_pretrained(model, dir.path);
  auto state = colossalai::checkpoint_io::model_state_dict(*model);
  std::error_code ec;
  fs::remove(dir.file("model.safetensors"), ec);
  const std::string norm = "model.norm.weight";
  // Shard a holds everything, its norm zeros; shard b the norm the index
  // names (2s). The index lists the norm first, so a, read last, would win
  // if the last file read did.
  colossalai::checkpoint_io::StateDict a, b;
  for (const auto& kv : state) {
    a.insert(
        kv.key(), kv.key() == norm ? at::zeros_like(kv.value()) : kv.value());
  }
  b.insert(norm, at::full_like(state[norm], 2.0));
  st::save_file(dir.file("a.safetensors"), a);
  st::save_file(dir.file("b.safetensors"), b);
  auto write_index = [&](const std::string& extra) {
    std::string map = "\"" + norm + "\": \"b.safetensors\"";
    for (const auto& kv : state) {
      if (kv.key() != norm) {
        map += ", \"" + kv.key() + "\": \"a.safetensors\"";
      }
    }
    dir.write(
        "model.safetensors.index.json",
        "{\"metadata\": {\"total_size\": 1}, \"weight_map\": {" + map + extra +
            "}}");
  };
  write_index("");
  auto loaded = models::from_pretrained<models::LlamaForCausalLM>(dir.path);
  EXPECT_TRUE(at::equal(
      loaded->named_parameters()[norm], at::full_like(state[norm], 2.0)));
  // The booster reads the directory the same way.
  {
    models::LlamaForCausalLM boosted_model(config);
    colossalai::booster::Booster booster;
    auto boosted = booster.boost(
        boosted_model,
        std::make_shared<torch::optim::SGD>(
            boosted_model->parameters(), torch::optim::SGDOptions(0.1)));
    booster.load_model(boosted.model, dir.path);
    EXPECT_TRUE(at::equal(
        boosted_model->named_parameters()[norm],
        at::full_like(state[norm], 2.0)));
  }
  // A key the index names in a shard that lacks it.
  write_index(", \"model.extra.weight\": \"b.safetensors\"");
  EXPECT_HAS(
      error_of(
          [&] { models::from_pretrained<models::LlamaForCausalLM>(dir.path); }),
      "the index names tensors its shards do not hold: model.extra.weight "
      "(b.safetensors)");
  EXPECT_NO_THROW(models::from_pretrained<models::LlamaForCausalLM>(
      dir.path, models::FromPretrainedOptions().strict(false)));
  // Hostile indexes: nesting, wrong types, a shard outside the directory.
  dir.write(
      "model.safetensors.index.json",
      "{\"weight_map\": " + std::string(100000, '[') +
          std::string(100000, ']') + "}");
  EXPECT_HAS(
      error_of(
          [&] { models::from_pretrained<models::LlamaForCausalLM>(dir.path); }),
      "JSON nested deeper than 64 levels");
  dir.write(
      "model.safetensors.index.json",
      "{\"weight_map\": {\"" + norm + "\": [\"b.safetensors\"]}}");
  EXPECT_HAS(
      error_of(
          [&] { models::from_pretrained<models::LlamaForCausalLM>(dir.path); }),
      "weight_map entry '" + norm + "' must be a file name, got an array");
  dir.write(
      "model.safetensors.index.json",
      "{\"weight_map\": {\"" + norm + "\": \"..\"}}");
  EXPECT_HAS(
      error_of(
          [&] { models::from_pretrained<models::LlamaForCausalLM>(dir.path); }),
      "must be a plain file name");
}

// A safetensors header claiming more than its file holds is refused from
// the header.
TEST(PretrainedHostile, WeightHeadersAreBoundedByTheirFile) {
  Scratch dir;
  save_tiny<models::GPT2LMHeadModel>(models::GPT2Config::tiny_test(), dir.path);
  const std::string header =
      R"({"transformer.wte.weight": {"dtype": "F32", "shape": [1000000, 1000000], "data_offsets": [0, 4000000000000]}})";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  }
  dir.write("model.safetensors", bytes + header);
  EXPECT_HAS(
      error_of(
          [&] { models::from_pretrained<models::GPT2LMHeadModel>(dir.path); }),
      "beyond the data section's 0 bytes");
}
