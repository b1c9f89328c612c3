// grouped_swiglu (NOTE [Kernels]): the reference loop over experts, and the
// grouped form: rows scattered into groups padded on the device, each
// projection one at::_grouped_mm forward and one per gradient backward.

#include <colossalai/kernels/grouped_swiglu.h>
#include <colossalai/kernels/silu_mul.h>
#include <colossalai/utils/compat.h>

#include "linear_dtype.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace colossalai {
namespace kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per group are a multiple of this, and at least this (16 bytes of
// bf16). ATen's grouped kernels take any group size for these layouts; an
// empty group would leave the weight gradient's product a sum of no terms,
// which their tests do not cover, and whole granules keep every group's
// rows aligned.
constexpr int64_t kGroupRows = 8;
// CUTLASS's grouped GEMM in ATen takes fewer groups than this, and int32
// extents.
constexpr int64_t kMaxGroups = 1024;

bool whole_16_bytes(int64_t elements, at::ScalarType dtype) {
  return elements * static_cast<int64_t>(c10::elementSize(dtype)) % 16 == 0;
}

bool aligned_16(const at::Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
}

// `t` contiguous from a 16-byte boundary (a copy only where it is not).
at::Tensor aligned_rows(const at::Tensor& t) {
  auto c = t.contiguous();
  return aligned_16(c) ? c : c.clone();
}

// How E weights [out, in] lie in one storage: evenly spaced with rows of
// whole 16 bytes from a 16-byte boundary, ascending (1) or descending (-1:
// ZeRO's buckets hold parameters in reverse), in `dtype`; 0 otherwise.
int weights_order(at::TensorList ws, at::ScalarType dtype) {
  const auto& w0 = ws[0];
  const int64_t e = static_cast<int64_t>(ws.size());
  if (w0.scalar_type() != dtype || w0.stride(1) != 1 ||
      !whole_16_bytes(w0.stride(0), dtype)) {
    return 0;
  }
  if (e == 1) {
    return aligned_16(w0) ? 1 : 0;
  }
  const int64_t step = ws[1].storage_offset() - w0.storage_offset();
  if (step == 0 || !whole_16_bytes(step < 0 ? -step : step, dtype)) {
    return 0;
  }
  for (int64_t i = 1; i < e; ++i) {
    const auto& w = ws[i];
    if (w.sizes() != w0.sizes() || w.strides() != w0.strides() ||
        w.scalar_type() != dtype || !w.storage().is_alias_of(w0.storage()) ||
        w.storage_offset() != w0.storage_offset() + i * step) {
      return 0;
    }
  }
  if (!aligned_16(step > 0 ? w0 : ws[e - 1])) {
    return 0;
  }
  return step > 0 ? 1 : -1;
}

// The weights as one [E, out, in] in `dtype`, group k holding expert k (or
// E - 1 - k, `reversed`): a view where they lie so in one storage, else one
// copy (which also casts).
at::Tensor stack_weights(
    at::TensorList ws,
    at::ScalarType dtype,
    bool reversed) {
  const int64_t e = static_cast<int64_t>(ws.size());
  auto group = [&](int64_t k) -> const at::Tensor& {
    return ws[static_cast<size_t>(reversed ? e - 1 - k : k)];
  };
  const auto& first = group(0);
  if (weights_order(ws, dtype) == (reversed ? -1 : 1)) {
    const int64_t step = e > 1
        ? group(1).storage_offset() - first.storage_offset()
        : first.numel();
    return first.as_strided(
        {e, first.size(0), first.size(1)},
        {step, first.stride(0), 1},
        first.storage_offset());
  }
  auto out = at::empty(
      {e, first.size(0), first.size(1)}, first.options().dtype(dtype));
  for (int64_t k = 0; k < e; ++k) {
    out.select(0, k).copy_(group(k));
  }
  return out;
}

// y rows of group k = x rows of group k times its weight^T, for x [R, in]
// in the compute dtype and `offs` (int32 [E]) the groups' ends, the last
// one R; group k is expert k, or E - 1 - k where `reversed`. Gradients:
// dx = dy W (grouped the same way), dW_k = dy_k^T x_k (grouped along the
// rows), each weight's a slice of one [E, out, in]. The weights are saved,
// not their stack: a copied stack is made again in backward rather than
// held from forward to backward (a large model's experts would hold a copy
// of every layer's).
struct GroupedLinear : public torch::autograd::Function<GroupedLinear> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& offs,
      at::TensorList weights,
      bool reversed) {
    const auto w = stack_weights(weights, x.scalar_type(), reversed);
    auto y = compat::grouped_mm(aligned_rows(x), w.transpose(1, 2), offs);
    variable_list saved{x, offs};
    bool need_w = false;
    for (const auto& wi : weights) {
      saved.push_back(wi);
      need_w = need_w || wi.requires_grad();
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["need_w"] = need_w;
    ctx->saved_data["need_x"] = x.requires_grad();
    ctx->saved_data["reversed"] = reversed;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& offs = saved[1];
    const std::vector<at::Tensor> weights(saved.begin() + 2, saved.end());
    const int64_t e = static_cast<int64_t>(weights.size());
    const bool reversed = ctx->saved_data["reversed"].toBool();
    variable_list out(static_cast<size_t>(3 + e));
    const auto dy = aligned_rows(grads[0].to(x.scalar_type()));
    if (ctx->saved_data["need_x"].toBool()) {
      out[0] = compat::grouped_mm(
          dy, stack_weights(weights, x.scalar_type(), reversed), offs);
    }
    if (ctx->saved_data["need_w"].toBool()) {
      const auto dw = compat::grouped_mm(dy.t(), aligned_rows(x), offs)
                          .to(weights[0].scalar_type());
      for (int64_t k = 0; k < e; ++k) {
        out[static_cast<size_t>(2 + (reversed ? e - 1 - k : k))] =
            dw.select(0, k);
      }
    }
    return out;
  }
};

// Every weight of `ws` [rows, cols] on `device`, of one dtype.
bool uniform(
    at::TensorList ws,
    int64_t rows,
    int64_t cols,
    const at::Device& device) {
  for (const auto& w : ws) {
    if (!w.defined() || w.dim() != 2 || w.size(0) != rows ||
        w.size(1) != cols || w.device() != device ||
        w.scalar_type() != ws[0].scalar_type()) {
      return false;
    }
  }
  return true;
}

void check_shapes(
    const char* op,
    const at::Tensor& rows,
    const at::Tensor& counts,
    at::TensorList gate,
    at::TensorList up,
    at::TensorList down) {
  const auto e = gate.size();
  TORCH_CHECK(
      e > 0 && up.size() == e && down.size() == e,
      op,
      ": gate, up and down must hold one weight per expert each, got ",
      gate.size(),
      ", ",
      up.size(),
      " and ",
      down.size());
  TORCH_CHECK(
      rows.dim() == 2 && counts.dim() == 1 &&
          counts.size(0) == static_cast<int64_t>(e),
      op,
      ": rows must be [N, C] and counts [",
      e,
      "], got ",
      rows.sizes(),
      " and ",
      counts.sizes());
  const int64_t c = rows.size(1);
  const int64_t inter = gate[0].dim() == 2 ? gate[0].size(0) : -1;
  TORCH_CHECK(
      uniform(gate, inter, c, rows.device()) &&
          uniform(up, inter, c, rows.device()) &&
          uniform(down, c, inter, rows.device()),
      op,
      ": every gate and up weight must be [I, ",
      c,
      "] and every down weight [",
      c,
      ", I], of one dtype per projection, on the rows' device (",
      rows.device(),
      ")");
}

} // namespace

bool grouped_swiglu_applies(
    const at::Tensor& rows,
    at::TensorList gate,
    at::TensorList up,
    at::TensorList down) {
  if (gate.empty() || up.size() != gate.size() ||
      down.size() != gate.size() || rows.dim() != 2 || gate[0].dim() != 2) {
    return false;
  }
  const int64_t c = rows.size(1), inter = gate[0].size(0);
  if (!uniform(gate, inter, c, rows.device()) ||
      !uniform(up, inter, c, rows.device()) ||
      !uniform(down, c, inter, rows.device())) {
    return false;
  }
  const auto autocast = compat::autocast_dtype(rows.device().type());
  const auto compute = autocast.value_or(rows.scalar_type());
  if (!autocast.has_value() &&
      (gate[0].scalar_type() != compute || up[0].scalar_type() != compute ||
       down[0].scalar_type() != compute)) {
    return false;
  }
  const int64_t e = static_cast<int64_t>(gate.size());
  const int64_t padded_rows = rows.size(0) + (kGroupRows + 1) * e;
  return compat::has_grouped_mm(rows.device(), compute) &&
      whole_16_bytes(c, compute) && whole_16_bytes(inter, compute) &&
      e < kMaxGroups && padded_rows <= std::numeric_limits<int32_t>::max();
}

at::Tensor grouped_swiglu(
    const at::Tensor& rows,
    const at::Tensor& counts,
    at::TensorList gate,
    at::TensorList up,
    at::TensorList down) {
  check_shapes("grouped_swiglu", rows, counts, gate, up, down);
  TORCH_CHECK(
      grouped_swiglu_applies(rows, gate, up, down),
      "grouped_swiglu: at::_grouped_mm does not take these (LibTorch 2.10+, "
      "bf16 on a compute capability 9 / 10 GPU or float32 / 16-bit on the "
      "CPU, widths of whole 16 bytes): check grouped_swiglu_applies first");
  const auto compute = detail::linear_compute_dtype(
      "grouped_swiglu", rows, gate[0], at::Tensor());
  const int64_t n = rows.size(0), c = rows.size(1);
  const int64_t e = static_cast<int64_t>(gate.size());
  // Group k holds expert k, or E - 1 - k where the weights lie in reverse
  // (read in place then). Each group padded to a multiple of kGroupRows (at
  // least one granule), on the device; the padded rows fit in `total` (a
  // bound the host knows), the last group taking what the others leave.
  const bool reversed = weights_order(gate, compute) == -1;
  const auto count = counts.to(rows.device(), at::kLong);
  const auto in_groups = reversed ? count.flip(0) : count;
  const auto padded =
      ((in_groups + (kGroupRows - 1)).div(kGroupRows, "floor") * kGroupRows)
          .clamp_min(kGroupRows);
  const int64_t total =
      (n + kGroupRows * e + kGroupRows - 1) / kGroupRows * kGroupRows;
  const auto ends = at::cumsum(padded, 0);
  const auto offs =
      at::cat(
          {ends.narrow(0, 0, e - 1),
           at::full({1}, total, ends.options())})
          .to(at::kInt);
  const auto group_start = ends - padded;
  const auto expert_start = reversed ? group_start.flip(0) : group_start;
  // Row i of expert g goes to g's padded start plus its rank in g.
  const auto real_ends = at::cumsum(count, 0);
  const auto i = at::arange(n, count.options());
  const auto expert = at::searchsorted(real_ends, i, false, /*right=*/true);
  const auto dest = expert_start.index_select(0, expert) + i -
      (real_ends - count).index_select(0, expert);
  const auto x = at::zeros({total, c}, rows.options().dtype(compute))
                     .index_copy(0, dest, rows.to(compute));
  const auto g = GroupedLinear::apply(x, offs, gate, reversed);
  const auto u = GroupedLinear::apply(x, offs, up, reversed);
  return GroupedLinear::apply(silu_mul(g, u), offs, down, reversed)
      .index_select(0, dest);
}

at::Tensor grouped_swiglu_reference(
    const at::Tensor& rows,
    const at::Tensor& counts,
    at::TensorList gate,
    at::TensorList up,
    at::TensorList down) {
  check_shapes("grouped_swiglu_reference", rows, counts, gate, up, down);
  const auto host = counts.to(at::kCPU, at::kLong).contiguous();
  std::vector<at::Tensor> outputs;
  int64_t offset = 0;
  for (size_t j = 0; j < gate.size(); ++j) {
    const int64_t m = host.data_ptr<int64_t>()[j];
    const auto x = rows.narrow(0, offset, m);
    outputs.push_back(at::linear(
        silu_mul(at::linear(x, gate[j]), at::linear(x, up[j])), down[j]));
    offset += m;
  }
  return at::cat(outputs);
}

} // namespace kernels
} // namespace colossalai
