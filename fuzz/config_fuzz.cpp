// libFuzzer target for the readers of config.json (build and run with
// fuzz/run.sh config). Each input is read as config.json
//  - by every family's *_config_from_json (GPT-2, LLaMA / Mistral / Qwen2 /
//    Qwen3, OPT, BLOOM, BERT): it is accepted or refused with a
//    std::exception (c10::Error); an accepted config of at most 4 layers
//    builds its model in a LazyInitContext (meta tensors: shapes only, no
//    memory), so the constructors' own checks see what the readers let
//    through;
//  - for its dtype, as from_pretrained reads it;
//  - from a file, by pretrained_model_type.
// Anything else (a crash, a sanitizer report, a hang, another exception) is
// a finding.

#include <colossalai/lazy/lazy_init.h>
#include <colossalai/models/pretrained.h>

#include "../src/models/pretrained_internal.h"

#include <unistd.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>

namespace models = colossalai::models;

namespace {

constexpr int64_t kMaxLazyLayers = 4;

// Builds `M` of `config` lazily, then forgets it.
template <class M, class Config>
void build_lazily(const Config& config, int64_t layers) {
  if (layers > kMaxLazyLayers) {
    return;
  }
  colossalai::lazy::LazyInitContext context;
  try {
    M model(config);
  } catch (...) {
    context.discard();
    throw;
  }
  context.discard();
}

template <class Fn>
void accepted_or_refused(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception&) {
    // Refused with a message: expected.
  }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  accepted_or_refused([&] {
    const auto c = models::gpt2_config_from_json(text);
    build_lazily<models::GPT2LMHeadModel>(c, c.n_layer());
  });
  accepted_or_refused([&] {
    const auto c = models::llama_config_from_json(text);
    build_lazily<models::LlamaForCausalLM>(c, c.num_hidden_layers());
  });
  accepted_or_refused([&] {
    const auto c = models::opt_config_from_json(text);
    build_lazily<models::OPTForCausalLM>(c, c.num_hidden_layers());
  });
  accepted_or_refused([&] {
    const auto c = models::bloom_config_from_json(text);
    build_lazily<models::BloomForCausalLM>(c, c.n_layer());
  });
  accepted_or_refused([&] {
    const auto c = models::bert_config_from_json(text);
    build_lazily<models::BertForMaskedLM>(c, c.num_hidden_layers());
  });

  accepted_or_refused([&] { models::detail::config_dtype(text); });

  static const std::string dir =
      "/tmp/colossalai_config_fuzz." + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir + "/config.json", std::ios::binary);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
  }
  accepted_or_refused([&] { models::pretrained_model_type(dir); });
  return 0;
}
