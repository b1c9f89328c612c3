#include <zoo/gpt.h>

#include <colossalai/kernels/fused_linear_cross_entropy.h>
#include <colossalai/kernels/gelu_linear.h>
#include <colossalai/kernels/layer_norm.h>
#include <colossalai/quantization/fp8_linear.h>
#include <colossalai/utils/compat.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace colossalai {
namespace zoo {

namespace {

// GPT-2's initialisation: small normal weights keep the residual stream
// near unit scale at the start of training.
constexpr double kInitStd = 0.02;
constexpr double kLayerNormEps = 1e-5;

void init_linear(torch::nn::Linear& linear) {
  torch::nn::init::normal_(linear->weight, 0.0, kInitStd);
  if (linear->bias.defined()) {
    torch::nn::init::zeros_(linear->bias);
  }
}

void init_layer_norm(torch::nn::LayerNorm& ln) {
  torch::nn::init::ones_(ln->weight);
  torch::nn::init::zeros_(ln->bias);
}

torch::nn::LayerNorm make_layer_norm(int64_t width) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({width}).eps(kLayerNormEps));
}

torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// LibTorch's torch::nn::Linear runs a matmul and then `+= bias` on inputs of
// more than two dimensions, whose backward adds a reduction for the bias
// gradient and a copy; at::linear, which Python's nn.Linear calls, folds
// [B, T, C] into one addmm. On gpt-small-cpu this took the backward from
// 1.18x Python's to below it. Inside a use_fp8 forward, through FP8.
at::Tensor linear(const torch::nn::Linear& layer, const at::Tensor& x) {
  return quantization::linear(x, layer->weight, layer->bias);
}

} // namespace

GPTConfig GPTConfig::small_cpu() {
  return GPTConfig();
}

GPTConfig GPTConfig::tiny_test() {
  return GPTConfig().vocab_size(96).block_size(16).n_embd(32).n_head(2).n_layer(
      2);
}

GPTConfig GPTConfig::gpt2_medium() {
  return GPTConfig()
      .vocab_size(50304)
      .block_size(1024)
      .n_embd(1024)
      .n_head(16)
      .n_layer(24);
}

int64_t GPTConfig::num_parameters() const {
  const int64_t c = n_embd_;
  const int64_t layer_norm = 2 * c;
  const int64_t block = layer_norm + (c * 3 * c + 3 * c) + (c * c + c) +
      layer_norm + (c * 4 * c + 4 * c) + (4 * c * c + c);
  return vocab_size_ * c + block_size_ * c + n_layer_ * block + layer_norm +
      c * vocab_size_;
}

BlockImpl::BlockImpl(const GPTConfig& config) : config_(config) {
  const int64_t c = config.n_embd();
  TORCH_CHECK(
      config.n_head() > 0 && c % config.n_head() == 0,
      "GPT: n_embd (",
      c,
      ") must be a multiple of n_head (",
      config.n_head(),
      ")");
  ln1 = register_module("ln1", make_layer_norm(c));
  qkv = register_module("qkv", make_linear(c, 3 * c, true));
  proj = register_module("proj", make_linear(c, c, true));
  ln2 = register_module("ln2", make_layer_norm(c));
  fc = register_module("fc", make_linear(c, 4 * c, true));
  out = register_module("out", make_linear(4 * c, c, true));
  reset_parameters();
}

void BlockImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  init_layer_norm(ln1);
  init_linear(qkv);
  init_linear(proj);
  init_layer_norm(ln2);
  init_linear(fc);
  init_linear(out);
}

at::Tensor causal_attention(const at::Tensor& qkv, int64_t n_head) {
  const int64_t b = qkv.size(0);
  const int64_t t = qkv.size(1);
  const int64_t c = qkv.size(2) / 3;
  const int64_t h = n_head;
  const int64_t d = c / h;

  auto parts = qkv.split(c, /*dim=*/-1);
  auto q = parts[0].view({b, t, h, d}).transpose(1, 2);
  auto k = parts[1].view({b, t, h, d}).transpose(1, 2);
  auto v = parts[2].view({b, t, h, d}).transpose(1, 2);
  // LibTorch's fused kernel on 2.x, matmul / mask / softmax on 1.13.
  auto y = colossalai::compat::scaled_dot_product_attention(
      q, k, v, /*mask=*/c10::nullopt, /*is_causal=*/true); // [B, H, T, D]
  return y.transpose(1, 2).contiguous().view({b, t, c});
}

at::Tensor BlockImpl::causal_self_attention(const at::Tensor& x) {
  return causal_attention(linear(qkv, x), config_.n_head());
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  auto scope = forward_scope(); // a sharding strategy's unit boundary
  // The residual add and the norm after it in one pass (on a GPU).
  auto [normed, h] = kernels::add_layer_norm(
      x,
      linear(proj, causal_self_attention(ln1->forward(x))),
      ln2->weight,
      ln2->bias,
      ln2->options.eps());
  auto m = linear(fc, normed);
  m = config_.recompute_gelu()
      ? kernels::gelu_linear(m, out->weight, out->bias)
      : linear(out, at::gelu(m));
  return scope.exit(h + m);
}

GPTImpl::GPTImpl(const GPTConfig& config) : config_(config) {
  TORCH_CHECK(
      config.vocab_size() > 0 && config.block_size() > 0 &&
          config.n_embd() > 0 && config.n_layer() >= 0,
      "GPT: config sizes must be positive");
  wte = register_module(
      "wte", torch::nn::Embedding(config.vocab_size(), config.n_embd()));
  wpe = register_module(
      "wpe", torch::nn::Embedding(config.block_size(), config.n_embd()));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.n_layer(); ++i) {
    blocks->push_back(Block(config));
  }
  lnf = register_module("lnf", make_layer_norm(config.n_embd()));
  head = register_module(
      "head", make_linear(config.n_embd(), config.vocab_size(), false));
  // The Blocks initialised themselves; drawing them again would only cost
  // time (noticeable for gpt2_medium).
  reset_own_parameters();
}

void GPTImpl::reset_own_parameters() {
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(wte->weight, 0.0, kInitStd);
  torch::nn::init::normal_(wpe->weight, 0.0, kInitStd);
  init_layer_norm(lnf);
  init_linear(head);
}

void GPTImpl::reset_parameters() {
  for (auto& block : *blocks) {
    block->as<BlockImpl>()->reset_parameters();
  }
  reset_own_parameters();
}

at::Tensor GPTImpl::forward(const at::Tensor& idx, const at::Tensor& targets) {
  if (!targets.defined()) {
    return linear(head, hidden_states(idx));
  }
  TORCH_CHECK(
      targets.sizes() == idx.sizes(),
      "GPT: targets ",
      targets.sizes(),
      " do not match idx ",
      idx.sizes());
  TORCH_CHECK(
      head->weight.size(0) == config_.vocab_size(),
      "GPT: forward(idx, targets) needs the whole vocabulary in the head (",
      config_.vocab_size(),
      " rows, this one holds ",
      head->weight.size(0),
      "); under tensor parallelism take the logits and gpt_loss");
  const auto h = hidden_states(idx);
  return kernels::fused_linear_cross_entropy(
      h.reshape({-1, h.size(-1)}),
      head->weight,
      head->bias.defined() ? c10::optional<at::Tensor>(head->bias)
                           : c10::nullopt,
      targets.reshape({-1}));
}

at::Tensor GPTImpl::hidden_states(const at::Tensor& idx) {
  TORCH_CHECK(
      idx.dim() == 2, "GPT: expected idx of shape [B, T], got ", idx.sizes());
  TORCH_CHECK(
      idx.scalar_type() == torch::kLong,
      "GPT: expected int64 token ids, got ",
      idx.scalar_type());
  const int64_t t = idx.size(1);
  TORCH_CHECK(
      t <= config_.block_size(),
      "GPT: sequence length ",
      t,
      " exceeds block_size ",
      config_.block_size());

  auto pos = torch::arange(t, idx.options());
  auto x = wte->forward(idx) + wpe->forward(pos); // [B, T, C] + [T, C]
  for (auto& block : *blocks) {
    x = block->as<BlockImpl>()->forward(x);
  }
  return lnf->forward(x);
}

at::Tensor gpt_loss(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(
      logits.dim() == 3,
      "gpt_loss: expected logits [B, T, V], got ",
      logits.sizes());
  TORCH_CHECK(
      targets.sizes() == logits.sizes().slice(0, 2),
      "gpt_loss: targets ",
      targets.sizes(),
      " do not match logits ",
      logits.sizes());
  const int64_t v = logits.size(2);
  // Cross-entropy in fp32 even for half-precision logits: log-softmax over
  // a large vocabulary loses too much precision in fp16.
  // The targets follow the logits to their device (a CPU batch, a GPU model).
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, v}).to(torch::kFloat),
      targets.reshape({-1}).to(logits.device()));
}

std::pair<at::Tensor, at::Tensor> random_tokens(
    int64_t batch,
    const GPTConfig& config,
    at::Generator generator) {
  TORCH_CHECK(batch > 0, "random_tokens: batch must be positive");
  auto tokens = torch::randint(
      config.vocab_size(),
      {batch, config.block_size() + 1},
      generator,
      torch::TensorOptions().dtype(torch::kLong));
  using torch::indexing::Slice;
  return {
      tokens.index({Slice(), Slice(0, -1)}).contiguous(),
      tokens.index({Slice(), Slice(1, at::indexing::None)}).contiguous()};
}

std::pair<at::Tensor, at::Tensor> random_tokens(
    int64_t batch,
    const GPTConfig& config,
    uint64_t seed) {
  return random_tokens(
      batch, config, at::make_generator<at::CPUGeneratorImpl>(seed));
}

} // namespace zoo
} // namespace colossalai
