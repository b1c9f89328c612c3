#pragma once

/// The keys and values a causal LM keeps between decoding steps
/// (transformers' `DynamicCache`, and its sliding-window layers for
/// Mistral): each family's `forward_cached` appends a step's keys and
/// values to it and attends to what it holds, so a step costs its own
/// tokens, not the whole sequence again.
///
/// Each layer's keys and values are this rank's heads after the rotary
/// embedding ([B, H_kv / tp, T, D]: grouped-query attention keeps its fewer
/// key/value heads, tensor parallelism its share of them). They live in
/// buffers that grow by doubling (or at once to `reserve`), so a step writes
/// its tokens in place instead of copying the past. With a sliding window
/// only the last window - 1 keys are kept: no later query can see older
/// ones.
///
/// Example:
/// \code
///   colossalai::models::KVCache cache;
///   auto logits = model->forward_cached(prompt, cache);  // [B, T, vocab]
///   auto next = logits.select(1, -1).argmax(-1, true);   // [B, 1]
///   logits = model->forward_cached(next, cache);         // one new token
/// \endcode

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace colossalai {
namespace models {

class KVCache {
 public:
  KVCache() = default;

  /// Positions consumed so far (prompt and generated tokens, padding
  /// included): the next token's index in the attention mask.
  int64_t length() const {
    return length_;
  }
  /// Keys held per layer (length(), or fewer under a sliding window).
  int64_t kept() const {
    return kept_;
  }
  /// Room for `tokens` keys per layer at the first step (a hint: the
  /// buffers still grow past it).
  KVCache& reserve(int64_t tokens);
  /// Empties the cache for a new batch (the buffers are released).
  void reset();

  /// Starts a step of `t_new` tokens of a model whose attention sees the
  /// last `sliding_window` positions (<= 0: all; fixed for the cache's
  /// life) and returns which keys each new query sees, boolean [B, 1,
  /// t_new, kept() + t_new]: causal, inside the window, and not padding
  /// (`attention_mask` [B, length() + t_new], Hugging Face's: 1 for a real
  /// token; undefined: every token real).
  at::Tensor begin_step(
      int64_t t_new,
      const at::Tensor& attention_mask,
      int64_t sliding_window,
      const c10::Device& device);
  /// The step's keys and values of layer `layer`, [B, H, t_new, D], after
  /// those the layer holds: the keys and values [B, H, kept() + t_new, D]
  /// the step's queries attend to (views of the cache's buffers).
  std::pair<at::Tensor, at::Tensor> update(
      int64_t layer,
      const at::Tensor& k,
      const at::Tensor& v);
  /// Ends the step begun last: its tokens count as consumed, and keys no
  /// later query can see are dropped.
  void end_step();

 private:
  struct Layer {
    at::Tensor k, v; // [B, H, capacity, D]
    bool written = false; // in the current step
  };
  std::vector<Layer> layers_;
  int64_t length_ = 0;
  int64_t kept_ = 0;
  int64_t step_ = -1; // tokens of the step in progress; -1: none
  int64_t window_ = -1; // the model's sliding window; -1: no step yet
  int64_t reserve_ = 0;
};

} // namespace models
} // namespace colossalai
