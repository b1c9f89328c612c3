#pragma once

// The LLaMA shapes of the shared workloads (BENCH_MODELS.md), for the
// benchmarks that build them.

#include <colossalai/models/llama.h>

#include <string>

namespace colossalai {
namespace bench {

/// llama-1b (Llama 3.2 1B: GQA 32 / 8 heads, tied embeddings, vocab
/// 128256, without its RoPE scaling, which the peers leave out too),
/// llama2-7b, llama3-8b, or llama-small-cpu (LlamaConfig::small_cpu).
inline models::LlamaConfig llama_workload(const std::string& name) {
  if (name == "llama-small-cpu") {
    return models::LlamaConfig::small_cpu();
  }
  if (name == "llama-1b") {
    return models::LlamaConfig()
        .vocab_size(128256)
        .hidden_size(2048)
        .intermediate_size(8192)
        .num_hidden_layers(16)
        .num_attention_heads(32)
        .num_key_value_heads(8)
        .rms_norm_eps(1e-5)
        .rope_theta(500000.0)
        .tie_word_embeddings(true);
  }
  if (name == "llama2-7b") {
    return models::LlamaConfig()
        .vocab_size(32000)
        .hidden_size(4096)
        .intermediate_size(11008)
        .num_hidden_layers(32)
        .num_attention_heads(32)
        .num_key_value_heads(32)
        .rms_norm_eps(1e-5);
  }
  TORCH_CHECK(
      name == "llama3-8b",
      "the LLaMA workload must be llama-1b, llama2-7b, llama3-8b or llama-small-cpu, got ",
      name);
  return models::LlamaConfig()
      .vocab_size(128256)
      .hidden_size(4096)
      .intermediate_size(14336)
      .num_hidden_layers(32)
      .num_attention_heads(32)
      .num_key_value_heads(8)
      .rms_norm_eps(1e-5)
      .rope_theta(500000.0);
}

} // namespace bench
} // namespace colossalai
