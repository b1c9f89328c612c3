#include <colossalai/placement/gradients.h>

#include <colossalai/distributed/collectives.h>
#include <colossalai/interface/optimizer.h>
#include <colossalai/quantization/fp8.h>

#include <ATen/ATen.h>

namespace colossalai {
namespace placement {

void sum_flat(
    const std::vector<at::Tensor>& tensors,
    const distributed::ProcessGroup& group,
    bool fp8) {
  if (tensors.empty()) {
    return;
  }
  std::vector<at::Tensor> parts;
  parts.reserve(tensors.size());
  for (const auto& t : tensors) {
    parts.push_back(t.reshape({-1}));
  }
  auto flat = at::cat(parts).to(group.device());
  (fp8 && quantization::fp8_compresses(group)
       ? quantization::all_reduce_fp8(
             flat, group, distributed::ReduceOp::kSum, "e5m2")
       : distributed::all_reduce(flat, group))
      .wait();
  int64_t offset = 0;
  for (const auto& t : tensors) {
    // The handles share the caller's tensors: the sums land there.
    at::Tensor out = t;
    out.copy_(flat.narrow(0, offset, t.numel()).view_as(t));
    offset += t.numel();
  }
}

void sum_partial_grads(
    const PlacementTable& table,
    const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads) {
  TORCH_CHECK(
      params.size() == grads.size(),
      "sum_partial_grads: ",
      params.size(),
      " parameters but ",
      grads.size(),
      " gradients");
  if (!table.has_partial()) {
    return;
  }
  for (const auto& axis : table.axes()) {
    if (axis.second->size() == 1) {
      continue;
    }
    std::vector<at::Tensor> mine;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto* p = table.find(params[i]);
      if (p == nullptr || !p->on(axis.first).is_partial()) {
        continue;
      }
      // Every rank of the axis sums the same list: a missing one is a bug.
      TORCH_INTERNAL_ASSERT(
          grads[i].defined(), "partial gradient of '", p->name, "' missing");
      if (grads[i].numel() > 0) {
        mine.push_back(grads[i]);
      }
    }
    sum_flat(mine, *axis.second);
  }
}

namespace {

using Groups = std::vector<const distributed::ProcessGroup*>;

// The gradients that count once over the mesh, and the groups their
// partials combine over: `pieces` first, even when null (the partials are
// then combined in double precision whatever the mesh), then the table's.
std::pair<std::vector<at::Tensor>, Groups> norm_inputs(
    const PlacementTable& table,
    const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads,
    const distributed::ProcessGroup* pieces) {
  TORCH_CHECK(
      params.size() == grads.size(),
      "global_grad_norm: ",
      params.size(),
      " parameters but ",
      grads.size(),
      " gradients");
  std::vector<at::Tensor> counted;
  for (size_t i = 0; i < params.size(); ++i) {
    if (table.counts_once(params[i])) {
      counted.push_back(grads[i]);
    }
  }
  Groups groups{pieces};
  for (const auto* g : table.reduction_groups()) {
    groups.push_back(g);
  }
  return {std::move(counted), std::move(groups)};
}

} // namespace

double global_grad_norm(
    const PlacementTable& table,
    const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads,
    double norm_type,
    const distributed::ProcessGroup* pieces) {
  const auto in = norm_inputs(table, params, grads, pieces);
  return interface::total_norm(in.first, norm_type, in.second);
}

at::Tensor global_grad_norm_on_device(
    const PlacementTable& table,
    const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads,
    double norm_type,
    const distributed::ProcessGroup* pieces) {
  const auto in = norm_inputs(table, params, grads, pieces);
  return interface::total_norm_on_device(in.first, norm_type, in.second);
}

} // namespace placement
} // namespace colossalai
