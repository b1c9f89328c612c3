// Each fused op alone against its ATen composition, on one device: the
// cross-entropy gradient kernel on one chunk of GPT-2 logits, the fused
// linear + cross-entropy over a whole batch (GPT-2 medium's head with
// vocabularies of 50257 and 50304, Llama 3's), RMSNorm and the
// SwiGLU gate at Llama 1B's widths, the rotary embedding of its queries,
// forward and backward; GPT-2 medium's GELU + output projection with the
// GELU recomputed in backward (what keeping one tensor less costs); a
// linear layer through FP8 against bf16 (Llama 1B's MLP up projection); an
// AdamW step over GPT-2 medium's parameters that writes their bf16 copies,
// against ATen's fused AdamW and a cast; one token through an 8B-shaped NF4 and
// int8 weight, the packed bytes read directly against dequantize + matmul;
// causal attention at Llama 3.2 1B's shape with SDPA's default kernel
// against each other one allowed alone;
// a Mixtral-shaped sparse layer's experts in grouped GEMMs against one GEMM
// per expert.
// Medians over --reps timed runs
// after warm-up, with the p10-p90 spread; JSON to --out, a table on stdout.
//
//   bench_gpu_ops [--device cuda|cpu] [--dtype bf16|fp32] [--reps 20] [--out
//   FILE.json]
//
// On the CPU (no CUDA kernels) the ops run their ATen algorithms: what
// the chunking alone costs or saves there.

#include <colossalai/kernels/adamw.h>
#include <colossalai/kernels/fused_linear_cross_entropy.h>
#include <colossalai/kernels/gelu_linear.h>
#include <colossalai/kernels/grouped_swiglu.h>
#include <colossalai/kernels/layer_norm.h>
#include <colossalai/kernels/rms_norm.h>
#include <colossalai/kernels/rope.h>
#include <colossalai/kernels/silu_mul.h>
#include <colossalai/quantization/bnb.h>
#include <colossalai/quantization/fp8_linear.h>
#include <colossalai/utils/compat.h>

#include "../bench_util.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>

namespace cbench = colossalai::bench;
namespace kn = colossalai::kernels;

namespace {

using cbench::sync;

// Milliseconds of each of `reps` runs of f after 3 warm-up runs.
std::vector<double> time_ms(const at::Device& dev, int reps, const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i)
    f();
  sync(dev);
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    sync(dev);
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return ms;
}

struct Row {
  std::string op, shape;
  std::vector<double> ours, aten;
  double bytes = 0; // the fewest bytes ours must move (0: not counted)
  double flops = 0; // the matmuls' floating-point operations (0: not counted)
};

} // namespace

int main(int argc, char** argv) {
  std::string device = torch::cuda::is_available() ? "cuda" : "cpu", out, dtype = "bf16";
  int reps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--device")
      device = v;
    else if (k == "--dtype")
      dtype = v;
    else if (k == "--reps")
      reps = std::stoi(v);
    else if (k == "--out")
      out = v;
    else {
      std::cerr << "bench_gpu_ops: unknown option " << k << "\n";
      return 2;
    }
  }
  try {
    const at::Device dev(device);
    const bool gpu = dev.is_cuda();
    torch::manual_seed(0);
    if (dtype != "bf16" && dtype != "fp32") {
      std::cerr << "bench_gpu_ops: --dtype must be bf16 or fp32, got " << dtype << "\n";
      return 2;
    }
    const auto type = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
    const auto opts = at::device(dev).dtype(type);
    std::vector<Row> rows;

    // 1. One chunk's loss and logits gradient, in place (what the fused
    // op does per chunk), against the ATen composition it replaces.
    {
      const int64_t n = gpu ? 2048 : 64, v = 50257;
      const auto x0 = torch::randn({n, v}, opts).mul_(3);
      const auto t = torch::randint(v, {n}, at::device(dev).dtype(at::kLong));
      const auto scale = torch::full({}, 1.0 / n, at::device(dev).dtype(at::kFloat));
      auto x = x0.clone();
      Row r{"cross-entropy loss + logits gradient, in place", std::to_string(n) + " x 50257 " + dtype};
      // Both include the copy that restores the logits.
      r.ours = time_ms(dev, reps, [&] {
        x.copy_(x0);
        kn::detail::cross_entropy_grad_(x, t, -100, scale);
      });
      r.aten = time_ms(dev, reps, [&] {
        x.copy_(x0);
        auto p = x.to(at::kFloat);
        const auto lse = at::logsumexp(p, 1);
        const auto loss = (lse - p.gather(1, t.unsqueeze(1)).squeeze(1)).sum();
        p.sub_(lse.unsqueeze(1)).exp_();
        p.scatter_add_(1, t.unsqueeze(1), at::full({n, 1}, -1.0, p.options()));
        p.mul_(scale);
        x.copy_(p);
      });
      // Read twice and written once by the kernel, plus the copy's read
      // and write.
      r.bytes = 5.0 * n * v * x0.element_size();
      rows.push_back(r);
    }

    // 2. The whole head and loss of a batch, forward and backward: fused
    // (chunks, the kernel) against linear + cross-entropy. GPT-2 medium's
    // head with transformers' vocabulary (50257: rows not a multiple of 16
    // bytes, which the fused op pads) and the zoo GPT's padded one (50304),
    // and Llama 3's (128256 x 2048, whose 1 GiB float32 weight gradient sets
    // the chunk).
    for (const auto& [h, v] : {std::pair<int64_t, int64_t>{1024, 50257}, {1024, 50304}, {2048, 128256}}) {
      const int64_t n = gpu ? 8192 : 256;
      auto hid = torch::randn({n, h}, opts).requires_grad_(true);
      auto w = (torch::randn({v, h}, opts) * 0.02).requires_grad_(true);
      const auto t = torch::randint(v, {n}, at::device(dev).dtype(at::kLong));
      Row r{"linear + cross-entropy, forward + backward",
            std::to_string(n) + " x " + std::to_string(h) + " -> " + std::to_string(v) + " " + dtype};
      // Three matmuls: the logits, the hidden's and the weight's gradients.
      r.flops = 6.0 * n * h * v;
      auto run = [&](bool fused) {
        hid.mutable_grad() = at::Tensor();
        w.mutable_grad() = at::Tensor();
        auto loss = fused ? kn::fused_linear_cross_entropy(hid, w, c10::nullopt, t)
                          : kn::linear_cross_entropy_reference(hid, w, c10::nullopt, t);
        loss.backward();
      };
      r.ours = time_ms(dev, reps, [&] { run(true); });
      r.aten = time_ms(dev, reps, [&] { run(false); });
      rows.push_back(r);
    }

    // 3. RMSNorm at Llama 3.2 1B's width over a 4 x 2048 batch.
    {
      const int64_t n = gpu ? 8192 : 256, c = 2048;
      auto x = torch::randn({n, c}, opts).requires_grad_(true);
      auto w = (1 + 0.1 * torch::randn({c}, opts)).requires_grad_(true);
      const auto dy = torch::randn({n, c}, opts);
      Row r{"RMSNorm, forward + backward", std::to_string(n) + " x 2048 " + dtype};
      auto run = [&](bool fused) {
        x.mutable_grad() = at::Tensor();
        w.mutable_grad() = at::Tensor();
        auto y = fused ? kn::rms_norm(x, w, 1e-5) : kn::rms_norm_reference(x, w, 1e-5);
        y.backward(dy);
      };
      r.ours = time_ms(dev, reps, [&] { run(true); });
      r.aten = time_ms(dev, reps, [&] { run(false); });
      // x, dy read twice (forward, backward), y and dx written, once each.
      r.bytes = 6.0 * n * c * x.element_size();
      rows.push_back(r);
    }

    // 3b. The residual add before a decoder layer's second norm, fused with
    // it, against the add and the norm as ATen ops; 3c against the add and
    // then the RMSNorm kernels (the layer before the fusion): what fusing
    // the add itself saves.
    {
      const int64_t n = gpu ? 8192 : 256, c = 2048;
      auto x = torch::randn({n, c}, opts).requires_grad_(true);
      auto res = torch::randn({n, c}, opts).requires_grad_(true);
      auto w = (1 + 0.1 * torch::randn({c}, opts)).requires_grad_(true);
      const auto dy = torch::randn({n, c}, opts), dsum = torch::randn({n, c}, opts);
      auto run = [&](int how) {
        for (auto* t : {&x, &res, &w}) {
          t->mutable_grad() = at::Tensor();
        }
        std::pair<at::Tensor, at::Tensor> out;
        if (how == 0) {
          out = kn::add_rms_norm(x, res, w, 1e-5);
        } else if (how == 1) {
          out = kn::add_rms_norm_reference(x, res, w, 1e-5);
        } else {
          auto h = x + res;
          out = {kn::rms_norm(h, w, 1e-5), h};
        }
        torch::autograd::backward({out.first, out.second}, {dy, dsum});
      };
      // Forward: x, residual in, sum and y out; backward: dy, sum, dsum
      // in, dx out (the residual's gradient is the same tensor).
      const double bytes = 8.0 * n * c * x.element_size();
      Row r{"residual add + RMSNorm, forward + backward", std::to_string(n) + " x 2048 " + dtype};
      r.ours = time_ms(dev, reps, [&] { run(0); });
      r.aten = time_ms(dev, reps, [&] { run(1); });
      r.bytes = bytes;
      rows.push_back(r);
      Row u{"residual add + RMSNorm against add, then the RMSNorm kernels",
            std::to_string(n) + " x 2048 " + dtype};
      u.ours = r.ours;
      u.aten = time_ms(dev, reps, [&] { run(2); });
      u.bytes = bytes;
      rows.push_back(u);
    }

    // 3d. The same before a GPT-2 medium block's second LayerNorm (8 x 1024
    // tokens of width 1024), against the add and ATen's LayerNorm.
    {
      const int64_t n = gpu ? 8192 : 256, c = 1024;
      auto x = torch::randn({n, c}, opts).requires_grad_(true);
      auto res = torch::randn({n, c}, opts).requires_grad_(true);
      auto w = (1 + 0.1 * torch::randn({c}, opts)).requires_grad_(true);
      auto bias = (0.1 * torch::randn({c}, opts)).requires_grad_(true);
      const auto dy = torch::randn({n, c}, opts), dsum = torch::randn({n, c}, opts);
      auto run = [&](bool fused) {
        for (auto* t : {&x, &res, &w, &bias}) {
          t->mutable_grad() = at::Tensor();
        }
        auto out = fused ? kn::add_layer_norm(x, res, w, bias, 1e-5)
                         : kn::add_layer_norm_reference(x, res, w, bias, 1e-5);
        torch::autograd::backward({out.first, out.second}, {dy, dsum});
      };
      Row r{"residual add + LayerNorm, forward + backward", std::to_string(n) + " x 1024 " + dtype};
      r.ours = time_ms(dev, reps, [&] { run(true); });
      r.aten = time_ms(dev, reps, [&] { run(false); });
      r.bytes = 8.0 * n * c * x.element_size();
      rows.push_back(r);
    }

    // 4. SwiGLU's gate at Llama 3.2 1B's MLP width over a 4 x 2048 batch.
    {
      const int64_t n = gpu ? 8192 : 256, c = 8192;
      auto g = torch::randn({n, c}, opts).requires_grad_(true);
      auto u = torch::randn({n, c}, opts).requires_grad_(true);
      const auto dy = torch::randn({n, c}, opts);
      Row r{"silu(gate) * up, forward + backward", std::to_string(n) + " x 8192 " + dtype};
      auto run = [&](bool fused) {
        g.mutable_grad() = at::Tensor();
        u.mutable_grad() = at::Tensor();
        auto y = fused ? kn::silu_mul(g, u) : kn::silu_mul_reference(g, u);
        y.backward(dy);
      };
      r.ours = time_ms(dev, reps, [&] { run(true); });
      r.aten = time_ms(dev, reps, [&] { run(false); });
      // Forward: gate, up in, out; backward: dy, gate, up in, two out.
      r.bytes = 8.0 * n * c * g.element_size();
      rows.push_back(r);
    }

    // 5. Rotary embedding of Llama 3.2 1B's queries (32 heads of 64) over a
    // 4 x 2048 batch, tables per position shared by the batch.
    {
      const int64_t b = gpu ? 4 : 1, t = gpu ? 2048 : 256, h = 32, d = 64;
      auto x = torch::randn({b, t, h, d}, opts).requires_grad_(true);
      const auto dy = torch::randn({b, t, h, d}, opts);
      auto f = torch::arange(t, opts.dtype(at::kFloat)).unsqueeze(-1) *
          at::pow(500000.0, -at::arange(0, d, 2, opts.dtype(at::kFloat)) / static_cast<double>(d));
      const auto emb = at::cat({f, f}, -1);
      const auto c = emb.cos().to(opts.dtype()), s = emb.sin().to(opts.dtype());
      Row r{"rotary embedding, forward + backward",
            std::to_string(b) + " x " + std::to_string(t) + " x 32 x 64 " + dtype};
      auto run = [&](bool fused) {
        x.mutable_grad() = at::Tensor();
        auto y = fused ? kn::rope(x, c, s) : kn::rope_reference(x, c, s);
        y.backward(dy);
      };
      r.ours = time_ms(dev, reps, [&] { run(true); });
      r.aten = time_ms(dev, reps, [&] { run(false); });
      // x and dy read, out and dx written.
      r.bytes = 4.0 * x.numel() * x.element_size();
      rows.push_back(r);
    }

    // 5b. Causal attention at Llama 3.2 1B's shape (4 x 2048 tokens, 32
    // query heads and 8 key/value heads of 64), forward and backward: the
    // kernel SDPA picks by default (ours: what every family runs) against
    // each other kernel allowed alone (compat::SdpaKernelGuard), where it
    // takes these inputs. The "ATen / ours" column then says whether a
    // kernel other than the default is faster.
    if (colossalai::compat::has_fused_attention()) {
      const int64_t b = gpu ? 4 : 1, t = gpu ? 2048 : 256, h = 32, hk = 8, d = 64;
      auto q = torch::randn({b, h, t, d}, opts).requires_grad_(true);
      auto k = torch::randn({b, hk, t, d}, opts).requires_grad_(true);
      auto v = torch::randn({b, hk, t, d}, opts).requires_grad_(true);
      const auto dy = torch::randn({b, h, t, d}, opts);
      namespace compat = colossalai::compat;
      const auto chosen = compat::sdpa_backend(q, k, v, {}, true);
      auto run = [&] {
        for (auto* x : {&q, &k, &v})
          x->mutable_grad() = at::Tensor();
        compat::scaled_dot_product_attention(q, k, v, {}, true).backward(dy);
      };
      const auto ours = time_ms(dev, reps, run);
      const std::pair<const char*, compat::SdpaBackend> others[] = {
          {"flash", compat::SdpaBackend::flash},
          {"cudnn", compat::SdpaBackend::cudnn},
          {"efficient", compat::SdpaBackend::efficient},
          {"math", compat::SdpaBackend::math}};
      for (const auto& [name, backend] : others) {
        if (name == chosen || (gpu && std::string(name) == "math"))
          continue; // the math path at this size: 4 x 32 x 2048^2 scores
        try {
          Row r{std::string("causal attention, forward + backward: default (") + chosen +
                    ") against " + name + " alone",
                std::to_string(b) + " x " + std::to_string(t) + ", 32 / 8 heads of 64 " + dtype};
          r.ours = ours;
          const compat::SdpaKernelGuard only({backend});
          r.aten = time_ms(dev, reps, run);
          // Causal: half of the 4 (forward) + 10 (backward) b h t^2 d.
          r.flops = 7.0 * b * h * t * t * d;
          rows.push_back(r);
        } catch (const std::exception& e) {
          std::cerr << "bench_gpu_ops: attention with " << name
                    << " alone did not run: " << std::string(e.what()).substr(0, 200) << "\n";
        }
      }
    }

    // 6. GPT-2 medium's MLP output over a batch of 8 x 1024: GELU then the
    // 4096 -> 1024 projection, the GELU recomputed in backward (ours)
    // against autograd keeping it. Ours is not faster by design: the row
    // says what the saved [8192 x 4096] tensor costs in time.
    {
      const int64_t n = gpu ? 8192 : 256, c = 1024;
      auto h = torch::randn({n, 4 * c}, opts).requires_grad_(true);
      auto w = (torch::randn({c, 4 * c}, opts) * 0.02).requires_grad_(true);
      auto b = torch::zeros({c}, opts).requires_grad_(true);
      const auto dy = torch::randn({n, c}, opts);
      Row r{"GELU + linear, GELU recomputed, forward + backward",
            std::to_string(n) + " x 4096 -> 1024 " + dtype};
      auto run = [&](bool fused) {
        for (auto* t : {&h, &w, &b})
          t->mutable_grad() = at::Tensor();
        auto y = fused ? kn::gelu_linear(h, w, b) : kn::gelu_linear_reference(h, w, b);
        y.backward(dy);
      };
      r.ours = time_ms(dev, reps, [&] { run(true); });
      r.aten = time_ms(dev, reps, [&] { run(false); });
      rows.push_back(r);
    }

    // 6b. A linear layer through FP8 (use_fp8: e4m3 operands, e5m2 output
    // gradient, at::_scaled_mm), forward and backward, against the bf16
    // linear: Llama 3.2 1B's MLP up projection over 4 x 2048 tokens.
    if (type == at::kBFloat16 && colossalai::compat::has_float8() &&
        (!gpu || colossalai::compat::has_scaled_mm(dev))) {
      const int64_t n = gpu ? 8192 : 256, in = 2048, outf = 8192;
      auto x = torch::randn({n, in}, opts).requires_grad_(true);
      auto w = (torch::randn({outf, in}, opts) * 0.02).requires_grad_(true);
      const auto dy = torch::randn({n, outf}, opts);
      Row r{
          "linear in FP8 (use_fp8), forward + backward",
          std::to_string(n) + " x 2048 -> 8192 " + dtype};
      auto run = [&](bool fp8) {
        for (auto* t : {&x, &w})
          t->mutable_grad() = at::Tensor();
        auto y = fp8 ? colossalai::quantization::linear_fp8(x, w, {})
                     : at::linear(x, w);
        y.backward(dy);
      };
      r.ours = time_ms(dev, reps, [&] { run(true); });
      r.aten = time_ms(dev, reps, [&] { run(false); });
      r.flops = 3 * 2.0 * n * in * outf;
      rows.push_back(r);
    }

    // 7. AdamW over GPT-2 medium's tensors (float32 masters) writing their
    // bf16 copies: one kernel, against ATen's fused AdamW and a cast.
    if (colossalai::compat::has_fused_adam(dev)) {
      const int64_t d = gpu ? 1024 : 128, layers = gpu ? 24 : 2;
      std::vector<std::vector<int64_t>> shapes{{gpu ? 50304 : 4096, d}, {1024, d}};
      for (int64_t l = 0; l < layers; ++l) {
        for (const auto& sh : std::vector<std::vector<int64_t>>{
                 {3 * d, d}, {3 * d}, {d, d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}, {d}, {d}, {d}, {d}}) {
          shapes.push_back(sh);
        }
      }
      const auto f32 = at::TensorOptions().device(dev).dtype(at::kFloat);
      std::vector<at::Tensor> p, grad, m, v, w;
      int64_t numel = 0;
      for (const auto& sh : shapes) {
        p.push_back(torch::randn(sh, f32));
        grad.push_back(torch::randn(sh, f32).mul(1e-3));
        m.push_back(torch::zeros(sh, f32));
        v.push_back(torch::zeros(sh, f32));
        w.push_back(torch::empty(sh, f32.dtype(at::kBFloat16)));
        numel += p.back().numel();
      }
      std::vector<int64_t> steps(p.size(), 1);
      const auto o = kn::AdamWStepOptions().lr(3e-4).weight_decay(0.01);
      Row r{"AdamW with bf16 copies", std::to_string(numel / 1000000) + "M params, " +
                std::to_string(p.size()) + " tensors"};
      r.ours = time_ms(dev, reps, [&] { kn::adamw_step_(p, grad, m, v, w, steps, o); });
      std::vector<at::Tensor> step_t;
      for (size_t i = 0; i < p.size(); ++i)
        step_t.push_back(torch::ones({}, f32));
      r.aten = time_ms(dev, reps, [&] {
        colossalai::compat::fused_adam_(p, grad, m, v, {}, step_t, 3e-4, 0.9, 0.999, 0.01, 1e-8, false, true);
        for (size_t i = 0; i < p.size(); ++i)
          w[i].copy_(p[i]);
      });
      // Read p, g, m, v; write p, m, v and the copy.
      r.bytes = numel * (7.0 * 4 + 2);
      rows.push_back(r);
    }

    // 8. One generation step's token through an 8B-shaped MLP weight
    // (14336 x 4096, NF4 with double quantization, bf16): the packed bytes
    // read directly against dequantize + matmul (NOTE [Few-row products on
    // quantized weights]); and LLM.int8's int8 product of the same shape.
    {
      namespace q = colossalai::quantization;
      const int64_t n = gpu ? 14336 : 2048, k = 4096;
      const auto w = torch::randn({n, k}).mul(0.02);
      auto [packed, state] = q::quantize_4bit(w, 64, "nf4", true);
      const auto pd = packed.to(dev);
      // The state where the layers keep it: on the weight's device.
      for (auto* t : {&state.absmax, &state.code, &state.offset, &state.state2_absmax, &state.state2_code})
        *t = t->to(dev);
      const auto x = torch::randn({1, k}, opts);
      Row r{"4-bit NF4 weight x 1 token", std::to_string(n) + " x " + std::to_string(k) + " " + dtype};
      r.ours = time_ms(dev, reps, [&] { q::gemv_4bit(x, pd, state); });
      r.aten = time_ms(dev, reps, [&] { at::linear(x, q::dequantize_4bit(pd, state, type)); });
      // The packed bytes and the per-block scale codes.
      r.bytes = n * k * (0.5 + 1.0 / 64);
      rows.push_back(r);
      const auto b = torch::randint(-127, 128, {n, k}).to(at::kChar).to(dev);
      const auto a = torch::randint(-127, 128, {1, k}).to(at::kChar).to(dev);
      Row i8{"int8 weight x 1 token (int32 product)", std::to_string(n) + " x " + std::to_string(k)};
      i8.ours = time_ms(dev, reps, [&] { q::int8_linear_matmul(a, b); });
      // What the product costs without the fused pass: int8 -> fp32 both.
      i8.aten = time_ms(dev, reps, [&] { at::matmul(a.to(at::kFloat), b.to(at::kFloat).t()).to(at::kInt); });
      i8.bytes = static_cast<double>(n) * k;
      rows.push_back(i8);
    }

    // 9. A Mixtral-shaped sparse layer's experts (8 SwiGLU experts, 4096 ->
    // 14336, 4096 tokens routed top-2 at random), forward and backward:
    // one grouped GEMM per projection against one GEMM per expert after
    // the counts are read back. The weights are views of one flat buffer,
    // as LowLevelZero's bf16 weights lie, read in place by both. Not yet run
    // on a GPU: a failure is reported and the other rows kept.
    try {
      const int64_t e = 8, c = gpu ? 4096 : 256, inter = gpu ? 14336 : 512, n = gpu ? 8192 : 512;
      const auto flat = torch::randn({3 * e * c * inter}, opts).mul_(0.02);
      std::vector<at::Tensor> g, u, d;
      auto part = [&](int64_t j, int64_t k, at::IntArrayRef shape) {
        return flat.narrow(0, (3 * j + k) * c * inter, c * inter).view(shape).detach().requires_grad_();
      };
      for (int64_t j = 0; j < e; ++j) {
        g.push_back(part(j, 0, {inter, c}));
        u.push_back(part(j, 1, {inter, c}));
        d.push_back(part(j, 2, {c, inter}));
      }
      const auto counts = at::bincount(torch::randint(e, {n}), {}, e).to(dev);
      auto x = torch::randn({n, c}, opts).requires_grad_();
      const auto dy = torch::randn({n, c}, opts);
      if (kn::grouped_swiglu_applies(x, g, u, d)) {
        Row r{"MoE experts (SwiGLU, 8 experts), forward + backward",
              std::to_string(n) + " rows x " + std::to_string(c) + " -> " + std::to_string(inter) + " " + dtype};
        auto run = [&](bool grouped) {
          for (auto* ws : {&g, &u, &d})
            for (auto& w : *ws)
              w.mutable_grad() = at::Tensor();
          x.mutable_grad() = at::Tensor();
          auto y = grouped ? kn::grouped_swiglu(x, counts, g, u, d) : kn::grouped_swiglu_reference(x, counts, g, u, d);
          y.backward(dy);
        };
        r.ours = time_ms(dev, reps, [&] { run(true); });
        r.aten = time_ms(dev, reps, [&] { run(false); });
        // Three projections, forward and two products backward.
        r.flops = 18.0 * n * c * inter;
        rows.push_back(r);
      }
    } catch (const std::exception& e) {
      std::cerr << "bench_gpu_ops: the MoE experts' row failed: " << e.what() << "\n";
    }

    std::ostringstream json;
    json << "{\n  \"benchmark\": \"gpu_ops\",\n  \"device\": \"" << device
         << "\",\n  \"reps\": " << reps << ",\n  \"machine\": " << cbench::machine_json()
         << ",\n  \"ops\": [";
    std::printf(
        "| op | shape | ours ms | ATen ms | ATen / ours | ours GB/s | ours TFLOP/s |\n"
        "|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      const double o = cbench::median(r.ours), a = cbench::median(r.aten);
      json << (i ? "," : "") << "\n    {\"op\": \"" << r.op << "\", \"shape\": \"" << r.shape
           << "\", \"ours_ms\": " << cbench::stats_json(r.ours)
           << ", \"aten_ms\": " << cbench::stats_json(r.aten) << ", \"bytes\": " << r.bytes
           << ", \"flops\": " << r.flops << "}";
      std::printf(
          "| %s | %s | %.3f (p10-p90 %.3f-%.3f) | %.3f | %.2fx | %s | %s |\n",
          r.op.c_str(),
          r.shape.c_str(),
          o,
          cbench::percentile(r.ours, 0.1),
          cbench::percentile(r.ours, 0.9),
          a,
          a / o,
          r.bytes > 0 ? std::to_string(static_cast<int>(r.bytes / (o * 1e-3) / 1e9)).c_str() : "-",
          r.flops > 0 ? std::to_string(static_cast<int>(r.flops / (o * 1e-3) / 1e12)).c_str() : "-");
    }
    json << "\n  ]\n}\n";
    if (!out.empty())
      std::ofstream(out) << json.str();
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
