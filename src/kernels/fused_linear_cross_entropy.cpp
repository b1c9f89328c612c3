// Fused linear + cross-entropy (NOTE [Kernels]): chunked over the tokens,
// gradients taken in the forward, so the [tokens x vocab] logits exist one
// chunk at a time. Each chunk's loss and logits gradient come from
// cross_entropy.cu's kernel on a GPU (in place, in the compute dtype), from
// the same computation in ATen elsewhere.

#include <colossalai/kernels/fused_linear_cross_entropy.h>
#include <colossalai/utils/compat.h>

#include "linear_dtype.h"
#include "target_check.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <limits>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "cross_entropy_cuda.h"
#include "cuda_launch.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace colossalai {
namespace kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A chunk's logits take at most this (or half the weight gradient's bytes).
constexpr int64_t kChunkLogitBytes = int64_t{256} << 20;

// Whether cross_entropy_grad_ runs the CUDA kernel on logits of type t.
bool kernel_applies(const at::Tensor& logits_like, at::ScalarType t) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  return logits_like.is_cuda() &&
      (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
#else
  (void)logits_like;
  (void)t;
  return false;
#endif
}

// The largest power of two whose chunk's logits take at most the budget in
// `bytes_per_logit` per logit (the kernel's logits in the compute dtype;
// the ATen path's float32 copy, beside the logits). The budget is
// kChunkLogitBytes, or half of `gradient_bytes` where more: every chunk
// reads and writes the whole float32 weight gradient it adds to (and in
// 16-bit compute first writes and reads its product), so with a large
// vocabulary and width fewer, larger chunks save more memory traffic than
// their logits cost memory. Llama 3's head (128256 x 2048, 1 GiB of
// gradient) takes bf16 chunks of 2048 tokens instead of 1024: 12.6 GB
// less traffic per 8192 tokens for 263 MB more logits; GPT-2's (206 MB)
// keeps 2048.
int64_t chunk_tokens(
    int64_t requested,
    int64_t tokens,
    int64_t vocab,
    int64_t bytes_per_logit,
    int64_t gradient_bytes) {
  if (requested > 0) {
    return std::max<int64_t>(1, std::min(requested, tokens));
  }
  const int64_t budget = std::max(kChunkLogitBytes, gradient_bytes / 2);
  const int64_t row = vocab * bytes_per_logit; // check_inputs: vocab > 0
  int64_t c = 1;
  while (c < tokens && 2 * c * row <= budget) {
    c *= 2;
  }
  return std::max<int64_t>(1, std::min(c, tokens));
}

// Elements between the starts of a chunk's logits rows: on a GPU the
// vocabulary rounded up to 16 bytes. A row stride that is not a multiple of
// 16 bytes (GPT-2's 50257 columns) keeps cuBLAS from its fastest Hopper
// kernels, whose tiles are loaded by the tensor memory accelerator, for all
// three matmuls of a chunk, and the cross-entropy kernel from reading
// aligned 16-byte packs. On the CPU the vocabulary itself: LibTorch 1.13's
// bf16 matmul into padded rows took 1.25x as long (2.15's the same time).
int64_t padded_row(int64_t vocab, at::ScalarType t, const at::Device& device) {
  if (!device.is_cuda()) {
    return vocab;
  }
  const int64_t per =
      std::max<int64_t>(1, 16 / static_cast<int64_t>(c10::elementSize(t)));
  return (vocab + per - 1) / per * per;
}

// Whether each row of `t` [N, V] is contiguous, rows at least V elements
// apart (a contiguous tensor, or a narrowed view of padded rows).
bool rows_contiguous(const at::Tensor& t) {
  return t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1) &&
      (t.size(0) <= 1 || t.stride(0) >= t.size(1));
}

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
// Elements between the starts of the rows of `t` (rows_contiguous).
int64_t row_stride(const at::Tensor& t) {
  return t.size(0) > 1 ? t.stride(0) : t.size(1);
}
#endif

void check_inputs(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const at::Tensor& bias,
    const at::Tensor& target) {
  TORCH_CHECK(
      hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
      "fused_linear_cross_entropy: expected hidden [N, H] and weight [V, H], "
      "got ",
      hidden.sizes(),
      " and ",
      weight.sizes());
  TORCH_CHECK(
      weight.size(0) > 0,
      "fused_linear_cross_entropy: the weight has no rows (an empty "
      "vocabulary)");
  TORCH_CHECK(
      !bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)),
      "fused_linear_cross_entropy: bias must be [V] = [",
      weight.size(0),
      "], got ",
      bias.sizes());
  TORCH_CHECK(
      target.dim() == 1 && target.size(0) == hidden.size(0),
      "fused_linear_cross_entropy: target must be [N] = [",
      hidden.size(0),
      "], got ",
      target.sizes());
  TORCH_CHECK(
      target.scalar_type() == at::kLong,
      "fused_linear_cross_entropy: target must be int64, got ",
      target.scalar_type());
  TORCH_CHECK(
      weight.device() == hidden.device() &&
          (!bias.defined() || bias.device() == hidden.device()),
      "fused_linear_cross_entropy: hidden, weight and bias must be on one "
      "device");
}

struct FusedLinearCrossEntropy
    : public torch::autograd::Function<FusedLinearCrossEntropy> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& hidden,
      const at::Tensor& weight,
      const at::Tensor& bias_or_empty,
      const at::Tensor& target,
      int64_t ignore_index,
      int64_t chunk_size,
      bool mean,
      const VocabShard* shard) {
    const at::Tensor bias = detail::bias_of(bias_or_empty);
    const auto compute = detail::linear_compute_dtype(
        "fused_linear_cross_entropy", hidden, weight, bias);
    const auto h = hidden.to(compute);
    const auto w = weight.to(compute);
    const auto b = bias.defined() ? bias.to(compute) : at::Tensor();
    const int64_t n = h.size(0);
    const int64_t vocab = w.size(0);
    // Softmax and loss in float32 (float64 for float64 inputs).
    const auto acc = at::promote_types(compute, at::kFloat);
    const auto acc_opts = h.options().dtype(acc);

    // NOTE [Deferred target check]: on a GPU the previous call's check
    // raises here, this call's at the next one; none inside a capture.
    detail::check_targets(
        "fused_linear_cross_entropy",
        target,
        h.device(),
        shard ? shard->vocab_size : vocab,
        ignore_index);
    const auto tgt = target.to(h.device());
    const auto valid = tgt.ne(ignore_index);
    // The scale stays on the device: no synchronisation for the count.
    const auto scale =
        mean ? valid.sum().to(acc).reciprocal() : at::ones({}, acc_opts);

    const bool need_h = hidden.requires_grad();
    const bool need_w = weight.requires_grad();
    const bool need_b = bias.defined() && bias.requires_grad();
    auto loss = at::zeros({}, acc_opts);
    auto gh = need_h ? at::empty({n, h.size(1)}, h.options()) : at::Tensor();
    const bool kernel = kernel_applies(h, compute);
    const int64_t step = chunk_tokens(
        chunk_size,
        n,
        vocab,
        kernel ? c10::elementSize(compute) : c10::elementSize(acc),
        need_w ? vocab * w.size(1) * static_cast<int64_t>(c10::elementSize(acc))
               : 0);
    // The weight's gradient summed over the chunks in float32 (float64):
    // where the matmuls already run in that dtype each chunk's product adds
    // in place (the first one written, not added to zeros). One chunk's
    // product is the gradient itself, in the compute dtype as the
    // reference's (a mixed-dtype sum into float32 costs more than the
    // product on some CPUs).
    const bool one_chunk = step >= n;
    const bool gw_in_place = compute == acc;
    auto gw = need_w && !one_chunk ? at::empty({vocab, w.size(1)}, acc_opts)
                                   : at::Tensor();
    auto gb = need_b ? at::zeros({vocab}, acc_opts) : at::Tensor();
    // One buffer for every chunk's logits (on a GPU rows padded to 16 bytes).
    const auto chunk_rows = at::empty(
        {std::min(step, n), padded_row(vocab, compute, h.device())},
        h.options());

    for (int64_t s = 0; s < n; s += step) {
      const int64_t c = std::min(step, n - s);
      const auto hc = h.narrow(0, s, c);
      const auto tc = tgt.narrow(0, s, c);
      auto logits = chunk_rows.narrow(0, 0, c).narrow(1, 0, vocab);
      if (b.defined()) {
        at::addmm_out(logits, b, hc, w.t());
      } else {
        at::mm_out(logits, hc, w.t());
      }
      // logits := d(loss)/d(logits), in the compute dtype.
      loss.add_(
          (shard ? detail::sharded_cross_entropy_grad_(logits, tc, ignore_index, scale, *shard)
                 : detail::cross_entropy_grad_(logits, tc, ignore_index, scale))
              .sum()
              .to(acc));
      if (need_b) {
        gb.add_(logits.sum(0, false, acc));
      }
      if (need_h) {
        auto rows = gh.narrow(0, s, c);
        at::mm_out(rows, logits, w);
      }
      if (need_w) {
        if (one_chunk) {
          gw = at::mm(logits.t(), hc);
        } else if (!gw_in_place) {
          // The first product is written, the rest added to it.
          const auto product = at::mm(logits.t(), hc);
          if (s == 0) {
            gw.copy_(product);
          } else {
            gw.add_(product);
          }
        } else if (s == 0) {
          at::mm_out(gw, logits.t(), hc);
        } else {
          gw.addmm_(logits.t(), hc);
        }
      }
    }
    if (mean) {
      loss.mul_(scale); // no tokens: NaN, as PyTorch's mean
    }
    if (need_w && !gw.defined()) { // no tokens
      gw = at::zeros({vocab, w.size(1)}, w.options());
    }
    ctx->saved_data["gh"] = need_h ? gh.to(hidden.scalar_type()) : at::Tensor();
    ctx->saved_data["gw"] = need_w ? gw.to(weight.scalar_type()) : at::Tensor();
    ctx->saved_data["gb"] = need_b ? gb.to(bias.scalar_type()) : at::Tensor();
    return loss;
  }

  // The gradients taken in the forward, scaled by the loss's incoming
  // gradient; only those this backward asks for. Without retain_graph this
  // node never runs again: each is scaled in place and handed on (the
  // parameter's AccumulateGrad keeps that very tensor), so the start of
  // the backward, where every activation is alive and the step peaks,
  // holds no second copy of the weight's gradient (1 GiB in float32 for
  // Llama 3's head at 2048 width). A kept graph (retain_graph; a pipeline's
  // split input pass, before its weight pass) scales copies.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& go = grads[0];
    // The saved gradients are kept in saved_data, which autograd does not
    // check for a freed graph: this flag does.
    TORCH_CHECK(
        !ctx->saved_data.count("handed_on"),
        "fused_linear_cross_entropy: backward through this loss ran once "
        "already and handed its gradients on; to run backward through it "
        "again, pass retain_graph=true to the first backward");
    const bool last_run = !torch::autograd::get_current_graph_task_keep_graph();
    if (last_run) {
      ctx->saved_data["handed_on"] = true;
    }
    auto scaled = [&](const char* name, size_t input) {
      if (!ctx->needs_input_grad(input)) {
        return at::Tensor();
      }
      auto& saved = ctx->saved_data[name];
      auto g = saved.toTensor();
      if (!g.defined()) {
        return g;
      }
      const auto k = go.to(g.scalar_type());
      if (!last_run) {
        return g * k;
      }
      saved = at::Tensor();
      return g.mul_(k);
    };
    return {
        scaled("gh", 0),
        scaled("gw", 1),
        scaled("gb", 2),
        at::Tensor(),
        at::Tensor(),
        at::Tensor(),
        at::Tensor(),
        at::Tensor()};
  }
};

} // namespace

namespace detail {

at::Tensor sharded_cross_entropy_grad_(
    at::Tensor& logits,
    const at::Tensor& target,
    int64_t ignore_index,
    const at::Tensor& scale,
    const VocabShard& shard,
    bool allow_kernel) {
  const int64_t cols = logits.size(1);
  const int64_t real = std::max<int64_t>(0, std::min(cols, shard.vocab_size - shard.start));
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (allow_kernel && kernel_applies(logits, logits.scalar_type()) &&
      rows_contiguous(logits)) {
    // The shard's statistics in one kernel, the group's reductions of
    // them, then the gradient in a second kernel: the logits are read
    // twice and written once, never copied to float32.
    const c10::cuda::CUDAGuard guard(logits.device());
    const int64_t rows = logits.size(0);
    const auto f32 = logits.options().dtype(at::kFloat);
    auto row_max = at::empty({rows}, f32), row_sum = at::empty({rows}, f32),
         picked = at::empty({rows}, f32);
    const auto t = target.contiguous();
    const auto stream = c10::cuda::getCurrentCUDAStream().stream();
    const auto type = cuda::dtype_of(logits.scalar_type(), "cross_entropy_grad_");
    cuda::check_launch(
        cuda::cross_entropy_shard_stats(
            type, logits.data_ptr(), t.data_ptr<int64_t>(), ignore_index,
            shard.start, real, row_max.data_ptr<float>(),
            row_sum.data_ptr<float>(), picked.data_ptr<float>(), rows,
            row_stride(logits), stream),
        "cross_entropy_grad_", "the shard statistics kernel");
    auto global_max = row_max.clone();
    shard.all_reduce_max(global_max);
    auto stats = at::stack({row_sum * (row_max - global_max).exp(), picked});
    shard.all_reduce_sum(stats);
    const auto vf = t.ne(ignore_index).to(at::kFloat);
    const auto lse = (global_max + stats[0].log()).contiguous();
    const auto k = (vf * scale.to(at::kFloat)).contiguous();
    cuda::check_launch(
        cuda::cross_entropy_shard_grad(
            type, logits.data_ptr(), t.data_ptr<int64_t>(), ignore_index,
            shard.start, real, lse.data_ptr<float>(), k.data_ptr<float>(),
            rows, cols, row_stride(logits), stream),
        "cross_entropy_grad_", "the shard gradient kernel");
    return (lse - stats[1]) * vf;
  }
#endif
  (void)allow_kernel;
  const auto acc = at::promote_types(logits.scalar_type(), at::kFloat);
  auto p = logits.to(acc); // may alias `logits`
  if (real < cols) { // padding rows of the head take no probability
    p.narrow(1, real, cols - real).fill_(-std::numeric_limits<double>::infinity());
  }
  auto row_max = std::get<0>(p.max(1));
  shard.all_reduce_max(row_max);
  const auto valid = target.ne(ignore_index);
  const auto mine = valid.logical_and(target.ge(shard.start))
                        .logical_and(target.lt(shard.start + cols));
  const auto local = (target - shard.start).masked_fill(mine.logical_not(), 0).unsqueeze(1);
  const auto picked = p.gather(1, local).squeeze(1).masked_fill(mine.logical_not(), 0);
  p.sub_(row_max.unsqueeze(1)).exp_();
  auto stats = at::stack({p.sum(1), picked});
  shard.all_reduce_sum(stats);
  const auto vf = valid.to(acc);
  auto row_loss = (row_max + stats[0].log() - stats[1]) * vf;
  p.div_(stats[0].unsqueeze(1));
  p.scatter_add_(1, local, mine.to(acc).neg().unsqueeze(1));
  p.mul_((vf * scale.to(acc)).unsqueeze(1));
  if (!p.is_same(logits)) {
    logits.copy_(p);
  }
  return row_loss;
}

at::Tensor cross_entropy_grad_(
    at::Tensor& logits,
    const at::Tensor& target,
    int64_t ignore_index,
    const at::Tensor& scale) {
  TORCH_CHECK(
      rows_contiguous(logits) && at::isFloatingType(logits.scalar_type()),
      "cross_entropy_grad_: logits must be floating [N, V] with contiguous "
      "rows, got ",
      logits.sizes(),
      " strides ",
      logits.strides(),
      " ",
      logits.scalar_type());
  TORCH_CHECK(
      target.dim() == 1 && target.size(0) == logits.size(0) &&
          target.scalar_type() == at::kLong &&
          target.device() == logits.device(),
      "cross_entropy_grad_: target must be int64 [",
      logits.size(0),
      "] on the logits' device");
  TORCH_CHECK(
      scale.numel() == 1 && scale.device() == logits.device(),
      "cross_entropy_grad_: scale must be one value on the logits' device");
  const int64_t rows = logits.size(0);
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (kernel_applies(logits, logits.scalar_type())) {
    const c10::cuda::CUDAGuard guard(logits.device());
    auto row_loss = at::empty({rows}, logits.options().dtype(at::kFloat));
    const auto t = target.contiguous();
    const auto k = scale.to(at::kFloat).contiguous();
    cuda::check_launch(
        cuda::cross_entropy_grad(
            cuda::dtype_of(logits.scalar_type(), "cross_entropy_grad_"),
            logits.data_ptr(),
            t.data_ptr<int64_t>(),
            ignore_index,
            k.data_ptr<float>(),
            row_loss.data_ptr<float>(),
            rows,
            logits.size(1),
            row_stride(logits),
            c10::cuda::getCurrentCUDAStream().stream()),
        "cross_entropy_grad_",
        "the kernel");
    return row_loss;
  }
#endif
  // The kernel's computation in ATen: float32 (float64 for float64 logits).
  // A target outside [0, V) that is not ignored gives its row NaN, as
  // the kernel does, and indexes nothing.
  const auto acc = at::promote_types(logits.scalar_type(), at::kFloat);
  const auto valid = target.ne(ignore_index);
  const auto stray = valid.logical_and(
      target.lt(0).logical_or_(target.ge(logits.size(1))));
  const auto t = target.masked_fill(valid.logical_not().logical_or_(stray), 0)
                     .unsqueeze(1);
  const auto nan = std::numeric_limits<double>::quiet_NaN();
  const auto vf = valid.to(acc);
  auto p = logits.to(acc); // may alias `logits`
  const auto lse = at::logsumexp(p, 1);
  auto row_loss =
      (lse - p.gather(1, t).squeeze(1).masked_fill(stray, nan)) * vf;
  p.sub_(lse.unsqueeze(1)).exp_();
  p.scatter_add_(1, t, at::full({rows, 1}, -1.0, p.options()));
  p.mul_((vf * scale.to(acc)).masked_fill(stray, nan).unsqueeze(1));
  if (!p.is_same(logits)) {
    logits.copy_(p);
  }
  return row_loss;
}

} // namespace detail

at::Tensor fused_linear_cross_entropy(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const c10::optional<at::Tensor>& bias,
    const at::Tensor& target,
    const FusedLinearCrossEntropyOptions& options) {
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  check_inputs(hidden, weight, b, target);
  const VocabShard* shard =
      options.vocab_shard().has_value() ? &*options.vocab_shard() : nullptr;
  TORCH_CHECK(
      shard == nullptr ||
          (shard->all_reduce_max && shard->all_reduce_sum && shard->start >= 0 &&
           shard->vocab_size > 0 && !b.defined()),
      "fused_linear_cross_entropy: vocab_shard needs both reductions, start >= 0, "
      "vocab_size > 0 and no bias");
  TORCH_CHECK(
      options.chunk_size() >= 0,
      "fused_linear_cross_entropy: chunk_size must be >= 0 (0: automatic), "
      "got ",
      options.chunk_size());
  return FusedLinearCrossEntropy::apply(
      hidden,
      weight,
      detail::bias_slot(b, hidden),
      target,
      options.ignore_index(),
      options.chunk_size(),
      options.mean(),
      shard);
}

at::Tensor linear_cross_entropy_reference(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const c10::optional<at::Tensor>& bias,
    const at::Tensor& target,
    const FusedLinearCrossEntropyOptions& options) {
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  check_inputs(hidden, weight, b, target);
  const auto logits = at::linear(hidden, weight, b);
  return at::cross_entropy_loss(
      logits.to(at::promote_types(logits.scalar_type(), at::kFloat)),
      target.to(hidden.device()),
      {},
      options.mean() ? at::Reduction::Mean : at::Reduction::Sum,
      options.ignore_index(),
      0.0);
}

} // namespace kernels
} // namespace colossalai
