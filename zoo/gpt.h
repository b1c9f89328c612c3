#pragma once

/// A small GPT-2 style decoder-only transformer for tests, examples and
/// benchmarks.
///
/// The layout is fixed on purpose: tests assert the exact parameter names
/// and count, and the parallel plugins treat each `Block` as one unit
/// (pipeline stages, activation checkpointing, tensor-parallel sharding of
/// `qkv`/`proj`/`fc`/`out`).
///
/// Example:
/// \code
///   torch::manual_seed(0);
///   colossalai::zoo::GPT model(colossalai::zoo::GPTConfig::small_cpu());
///   auto batch = colossalai::zoo::random_tokens(8, model->config(), 42);
///   auto loss = colossalai::zoo::gpt_loss(model->forward(batch.first),
///                                         batch.second);
/// \endcode

#include <colossalai/nn/hookable_module.h>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <utility>

namespace colossalai {
namespace zoo {

/// Hyper-parameters of `GPT`. The defaults are "gpt-small-cpu": 5,289,472
/// parameters, small enough to train a few steps on a laptop CPU.
struct GPTConfig {
  /// The defaults: vocab 4096, context 128, width 256, 4 heads, 4 blocks.
  static GPTConfig small_cpu();
  /// vocab 96, context 16, width 32, 2 heads, 2 blocks (under 30,000
  /// parameters): trains in milliseconds, for tests.
  static GPTConfig tiny_test();
  /// GPT-2 medium shape with the vocabulary padded to a multiple of 64:
  /// vocab 50304, context 1024, width 1024, 16 heads, 24 blocks
  /// (406,382,592 parameters).
  static GPTConfig gpt2_medium();

  /// Parameter count of a `GPT` built from this config, computed without
  /// allocating it (for sizing benchmarks and memory estimates).
  int64_t num_parameters() const;

  // TORCH_ARG leaves the access at private; keep it last.
  /// Token vocabulary size (rows of `wte`, columns of `head`).
  TORCH_ARG(int64_t, vocab_size) = 4096;
  /// Longest sequence `forward` accepts (rows of `wpe`).
  TORCH_ARG(int64_t, block_size) = 128;
  /// Model width.
  TORCH_ARG(int64_t, n_embd) = 256;
  /// Attention heads; must divide `n_embd`.
  TORCH_ARG(int64_t, n_head) = 4;
  /// Number of transformer blocks.
  TORCH_ARG(int64_t, n_layer) = 4;
  /// Each block's MLP forms gelu(fc(x)) again in backward instead of
  /// keeping it (kernels::gelu_linear): a [B, T, 4 * n_embd] tensor less per
  /// block, for one elementwise pass more. Off by default, until a GPU
  /// benchmark shows what it costs.
  TORCH_ARG(bool, recompute_gelu) = false;
};

/// Causal multi-head attention of a fused projection qkv: [B, T, 3C] (q, k,
/// v in that order, each C = n_head x head size wide) -> [B, T, C]. A
/// tensor-parallel block calls it on its own heads.
at::Tensor causal_attention(const at::Tensor& qkv, int64_t n_head);

/// One pre-LayerNorm transformer block:
///   x = x + proj(causal_self_attention(ln1(x)))
///   x = x + out(gelu(fc(ln2(x))))   (GPTConfig::recompute_gelu: see there)
/// Its forward opens a `ForwardScope`, so sharding strategies can make each
/// block a unit (e.g. TorchFSDPPlugin's per-block wrapping).
class BlockImpl : public torch::nn::Module,
                  public colossalai::nn::HookableModule {
 public:
  explicit BlockImpl(const GPTConfig& config);

  /// x: [B, T, n_embd] -> [B, T, n_embd].
  at::Tensor forward(const at::Tensor& x);

  /// Resets Linear weights to N(0, 0.02) and biases to zero.
  void reset_parameters();

  const GPTConfig& config() const {
    return config_;
  }

  // Registered in this order so named_parameters() lists them in it.
  torch::nn::LayerNorm ln1{nullptr};
  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear proj{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  torch::nn::Linear fc{nullptr};
  torch::nn::Linear out{nullptr};

 private:
  at::Tensor causal_self_attention(const at::Tensor& x);

  GPTConfig config_;
};
TORCH_MODULE(Block);

/// Decoder-only transformer: token embedding `wte` + learned position
/// embedding `wpe`, `n_layer` `Block`s in the ModuleList `blocks`, final
/// LayerNorm `lnf` and a bias-free output projection `head` (not tied to
/// `wte`, so every parameter has exactly one owner when sharded).
class GPTImpl : public torch::nn::Module {
 public:
  explicit GPTImpl(const GPTConfig& config = GPTConfig());

  /// idx: [B, T] int64 token ids with T <= block_size.
  /// Returns logits [B, T, vocab_size]; with targets ([B, T] int64, -100
  /// ignored) the mean token cross-entropy instead, as
  /// gpt_loss(forward(idx), targets), through
  /// kernels::fused_linear_cross_entropy, so the [B * T, vocab] logits are
  /// never held whole (the head must hold the whole vocabulary, not a
  /// vocab-parallel shard). One function with a default argument, not two
  /// overloads: ModuleHolder's operator() needs a single `forward`.
  at::Tensor forward(
      const at::Tensor& idx,
      const at::Tensor& targets = at::Tensor());
  /// The final LayerNorm's output [B, T, n_embd], before the head.
  at::Tensor hidden_states(const at::Tensor& idx);

  /// Re-draws all weights: N(0, 0.02) for Linear and Embedding weights,
  /// zeros for biases, LayerNorm at (1, 0). Construction initialises the
  /// same way; both are deterministic given torch::manual_seed.
  void reset_parameters();

  const GPTConfig& config() const {
    return config_;
  }

  torch::nn::Embedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm lnf{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  void reset_own_parameters();

  GPTConfig config_;
};
TORCH_MODULE(GPT);

/// Mean token cross-entropy. logits: [B, T, V]; targets: [B, T] int64.
at::Tensor gpt_loss(const at::Tensor& logits, const at::Tensor& targets);

/// A random language-modelling batch on the CPU: draws [batch, T + 1]
/// tokens uniformly from [0, vocab_size) with T = block_size, and returns
/// (inputs, targets) = (tokens[:, :-1], tokens[:, 1:]), both [batch, T]
/// int64. The same generator state gives the same batch.
std::pair<at::Tensor, at::Tensor> random_tokens(
    int64_t batch,
    const GPTConfig& config,
    at::Generator generator);

/// As above with a fresh CPU generator seeded by `seed`, so the batch does
/// not depend on (or disturb) the global RNG.
std::pair<at::Tensor, at::Tensor> random_tokens(
    int64_t batch,
    const GPTConfig& config,
    uint64_t seed);

} // namespace zoo
} // namespace colossalai
