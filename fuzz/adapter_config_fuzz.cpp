// libFuzzer target for LoRA's reader of adapter_config.json and the
// target_modules matcher (build and run with fuzz/run.sh adapter_config).
// Each input is an adapter_config.json: it must parse or throw an exception
// derived from std::exception (c10::Error); a config that parses is
// injected into a small model (linear layers and an embedding under nested
// names), which must work or be refused the same way. Anything else (a
// crash, a sanitizer report, a hang, another exception type) is a finding.

#include <colossalai/lora/lora_config.h>
#include <colossalai/lora/lora_model.h>

#include <ATen/Parallel.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <exception>
#include <string>

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  at::set_num_threads(1);
  // LibTorch initialises lazily on first use; do it before the leak checker
  // starts watching single inputs.
  at::ones({2}).sum().item<double>();
  return 0;
}

namespace {

std::shared_ptr<torch::nn::Module> model() {
  auto inner = torch::nn::Sequential(
      torch::nn::Linear(8, 16), torch::nn::Linear(16, 4));
  auto m = std::make_shared<torch::nn::Module>("Model");
  m->register_module("embed", torch::nn::Embedding(10, 8));
  m->register_module("c_attn", torch::nn::Linear(8, 24));
  m->register_module("layers", inner.ptr());
  return m;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto config =
        colossalai::lora::LoraConfig::from_json(text, "adapter_config.json");
    colossalai::lora::LoraModel lora(model(), config);
    lora.merge();
    lora.unmerge();
  } catch (const std::exception&) {
    // Refused with a message: expected.
  }
  return 0;
}
