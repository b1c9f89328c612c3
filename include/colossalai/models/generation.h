#pragma once

/// Text generation for the causal families (GPT-2, OPT, BLOOM, LLaMA and
/// the models that are LlamaForCausalLM: Mistral, Qwen2, Qwen3, the
/// mixtures of experts), as transformers' `generate`: a KVCache, greedy
/// decoding or sampling (repetition penalty, min_new_tokens, temperature,
/// top-k, top-p, in transformers' order), stop tokens, and batched prompts
/// with left padding.
///
/// NOTE [Generation]
/// The prompt runs once through `forward_cached` (the prefill); each later
/// step feeds the tokens just chosen, one per row. Positions count only the
/// real tokens of each row (`attention_mask`'s cumulative sum - 1, as
/// transformers derives them), so a left-padded prompt continues as it
/// would alone. A row that has produced a stop token is finished: it gets
/// `pad_token_id` from then on, and generation ends when every row is
/// finished or after `max_new_tokens`. Greedy decoding takes the first
/// largest logit, as torch.argmax. Sampling draws on the CPU from a
/// generator seeded with `seed` (the probabilities are copied there: one
/// [B, vocab] copy per step), so the same seed, model and prompts draw the
/// same tokens; with LibTorch the same version as Python's torch it draws
/// what transformers draws after `torch.manual_seed(seed)` on the CPU. Under
/// tensor parallelism every rank runs the same steps on its heads and
/// gathers the logits, and all ranks choose the same tokens (greedy; and
/// sampling, since every rank's generator has the same seed). Sequence and
/// pipeline parallelism are not supported here.
///
/// Example:
/// \code
///   auto model = colossalai::models::from_pretrained<
///       colossalai::models::LlamaForCausalLM>(dir);
///   model->eval();
///   // Two prompts left-padded to one length (0 in the mask: padding).
///   at::Tensor out = colossalai::models::generate(
///       model, ids, attention_mask,
///       colossalai::models::GenerationConfig::from_pretrained(dir)
///           .max_new_tokens(32));  // [2, T + up to 32]
/// \endcode

#include <colossalai/models/kv_cache.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace colossalai {
namespace models {

/// transformers' GenerationConfig fields that decoding uses (its defaults).
struct GenerationConfig {
  /// generation_config.json in `dir` when there is one, else config.json's
  /// token ids (bos, eos, pad), as transformers builds a model's
  /// generation_config. A list of eos ids is a list of stop tokens.
  static GenerationConfig from_pretrained(const std::string& dir);

  /// Tokens to add at most to each row.
  TORCH_ARG(int64_t, max_new_tokens) = 20;
  /// Sample from the processed distribution; false: greedy.
  TORCH_ARG(bool, do_sample) = false;
  /// Logits divided by this before top-k and top-p (sampling only; > 0).
  TORCH_ARG(double, temperature) = 1.0;
  /// Only the k largest logits stay candidates (sampling only; 0: all).
  TORCH_ARG(int64_t, top_k) = 50;
  /// Only the smallest set of largest-probability tokens whose mass reaches
  /// top_p stays (sampling only; 1: all).
  TORCH_ARG(double, top_p) = 1.0;
  /// CTRL's penalty on every token already in the row (its real prompt
  /// tokens and those generated): a logit above 0 is divided by it, one
  /// below multiplied (greedy and sampling; 1: none).
  TORCH_ARG(double, repetition_penalty) = 1.0;
  /// The stop tokens are ruled out until this many new tokens are made.
  TORCH_ARG(int64_t, min_new_tokens) = 0;
  /// Stop tokens: a row is finished once it produces one of them.
  TORCH_ARG(std::vector<int64_t>, eos_token_id) = {};
  /// What finished rows get (-1: the first eos token, as transformers
  /// falls back; with neither, every row runs to max_new_tokens).
  TORCH_ARG(int64_t, pad_token_id) = -1;
  /// The sampling generator's seed.
  TORCH_ARG(uint64_t, seed) = 0;
  /// false: every step runs the whole sequence again without a cache (the
  /// reference the cached path is checked against; slow).
  TORCH_ARG(bool, use_cache) = true;
};

/// One model step as `generate` calls it: logits [B, T_new, vocab] (the
/// whole vocabulary, on every tensor rank) of `ids` [B, T_new] at
/// `position_ids` [B, T_new], with `attention_mask` [B, T_past + T_new];
/// `cache` is the step's KVCache, or null for a forward of the whole
/// sequence (T_past 0). Only the last position's logits are read.
using CausalLMStep = std::function<at::Tensor(
    const at::Tensor& ids,
    const at::Tensor& attention_mask,
    const at::Tensor& position_ids,
    KVCache* cache)>;

/// Generation with any model step (NOTE [Generation]): `input_ids` [B, T]
/// int64, `attention_mask` [B, T] (1: a real token; undefined: all real;
/// padding must be on the left) -> [B, T + n] int64, the prompts followed
/// by n <= max_new_tokens new tokens per row. Runs without gradients.
at::Tensor generate_with(
    const CausalLMStep& step,
    const at::Tensor& input_ids,
    const at::Tensor& attention_mask,
    const GenerationConfig& config);

/// `generate_with` for a causal family's module (GPT2LMHeadModel,
/// OPTForCausalLM, BloomForCausalLM, LlamaForCausalLM, ...) through its
/// `forward_cached`.
template <class ModuleHolder>
at::Tensor generate(
    ModuleHolder& model,
    const at::Tensor& input_ids,
    const at::Tensor& attention_mask = at::Tensor(),
    const GenerationConfig& config = GenerationConfig()) {
  auto* m = model.get();
  return generate_with(
      [m](const at::Tensor& ids,
          const at::Tensor& mask,
          const at::Tensor& pos,
          KVCache* cache) {
        if (cache != nullptr) {
          return m->forward_cached(ids, *cache, mask, pos, /*logits_to_keep=*/1);
        }
        KVCache whole;
        return m->forward_cached(ids, whole, mask, pos, /*logits_to_keep=*/1);
      },
      input_ids,
      attention_mask,
      config);
}

/// transformers' logits warpers for sampling, in its order: temperature,
/// top-k, top-p; `scores` [B, V] float -> the same with the removed
/// candidates at -inf (at least one stays per row).
at::Tensor process_logits(
    const at::Tensor& scores,
    const GenerationConfig& config);

} // namespace models
} // namespace colossalai
