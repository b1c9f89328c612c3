#include <colossalai/placement/placement.h>

#include <c10/util/Exception.h>

namespace colossalai {
namespace placement {

// NOTE [Placement table]
// A plugin that splits or stages parameters records, for each parameter a
// rank holds, how it lies over each mesh axis (DTensor's Replicate /
// Shard(dim) / Partial), its pipeline stage and, for a weight tied across
// stages, the stage that owns it. What used to be three lists handed to
// each optimizer (replicated, partial, not counted) follows from that one
// record: a reduction over the whole model counts a split part on every
// rank, a replicated value on the axis's rank 0, a tied copy on its owning
// stage; Partial gradients are summed over their axis before anything
// reads them. The data-parallel axes stay out of the table: data-parallel
// engines (DDP, ZeRO, FSDP) average gradients over them before the
// optimizer runs, and ZeRO's disjoint pieces are combined by the caller
// (global_grad_norm's `pieces`).

Placement Placement::shard(int64_t dim) {
  TORCH_CHECK(dim >= 0, "Placement::shard: dim must be >= 0, got ", dim);
  Placement p;
  p.kind = Kind::kShard;
  p.dim = dim;
  return p;
}

std::string Placement::str() const {
  switch (kind) {
    case Kind::kShard:
      return "Shard(" + std::to_string(dim) + ")";
    case Kind::kPartial:
      return "Partial()";
    case Kind::kReplicate:
      break;
  }
  return "Replicate()";
}

const Placement& ParamPlacement::on(const std::string& axis) const {
  static const Placement kReplicate;
  auto it = axes.find(axis);
  return it == axes.end() ? kReplicate : it->second;
}

PlacementTable& PlacementTable::add_axis(
    const std::string& name,
    distributed::ProcessGroupPtr group) {
  TORCH_CHECK(!name.empty(), "PlacementTable::add_axis: empty axis name");
  TORCH_CHECK(
      group != nullptr,
      "PlacementTable::add_axis: axis '",
      name,
      "' has no process group");
  TORCH_CHECK(
      this->group(name) == nullptr,
      "PlacementTable::add_axis: axis '",
      name,
      "' added twice");
  axes_.emplace_back(name, std::move(group));
  return *this;
}

PlacementTable& PlacementTable::set_pipeline(
    distributed::ProcessGroupPtr group,
    int stage) {
  TORCH_CHECK(
      group != nullptr, "PlacementTable::set_pipeline: no process group");
  TORCH_CHECK(
      stage >= 0 && stage < group->size(),
      "PlacementTable::set_pipeline: stage ",
      stage,
      " is outside the pipeline's ",
      group->size(),
      " stages");
  pipeline_ = std::move(group);
  stage_ = stage;
  return *this;
}

void PlacementTable::add(const at::Tensor& param, ParamPlacement placement) {
  TORCH_CHECK(param.defined(), "PlacementTable::add: undefined parameter");
  for (const auto& axis : placement.axes) {
    TORCH_CHECK(
        group(axis.first) != nullptr,
        "PlacementTable::add: parameter '",
        placement.name,
        "' is placed over axis '",
        axis.first,
        "', which the table does not have");
    TORCH_CHECK(
        !axis.second.is_shard() || axis.second.dim < param.dim(),
        "PlacementTable::add: parameter '",
        placement.name,
        "' is split along dim ",
        axis.second.dim,
        " but has ",
        param.dim(),
        " dims");
    partial_ = partial_ || axis.second.is_partial();
  }
  TORCH_CHECK(
      placement.tie_owner_stage < 0 || pipeline_ != nullptr,
      "PlacementTable::add: parameter '",
      placement.name,
      "' is tied across stages, but the table has no pipeline");
  if (pipeline_ != nullptr && placement.stage < 0) {
    placement.stage = stage_;
  }
  const bool fresh =
      by_impl_.emplace(param.unsafeGetTensorImpl(), std::move(placement))
          .second;
  TORCH_CHECK(fresh, "PlacementTable::add: a parameter is recorded twice");
}

const ParamPlacement* PlacementTable::find(const at::Tensor& param) const {
  auto it = by_impl_.find(param.unsafeGetTensorImpl());
  return it == by_impl_.end() ? nullptr : &it->second;
}

const ParamPlacement& PlacementTable::at(const at::Tensor& param) const {
  const auto* p = find(param);
  TORCH_CHECK(
      p != nullptr,
      "PlacementTable: no placement for a parameter of shape ",
      param.sizes(),
      " (is it part of the boosted model?)");
  return *p;
}

distributed::ProcessGroupPtr PlacementTable::group(
    const std::string& axis) const {
  for (const auto& a : axes_) {
    if (a.first == axis) {
      return a.second;
    }
  }
  return nullptr;
}

bool PlacementTable::counts_once(const at::Tensor& param) const {
  const auto* p = find(param);
  if (p == nullptr) {
    return true;
  }
  if (p->tie_owner_stage >= 0 && p->stage != p->tie_owner_stage) {
    return false;
  }
  for (const auto& axis : axes_) {
    if (!p->on(axis.first).is_shard() && axis.second->rank() != 0) {
      return false;
    }
  }
  return true;
}

std::vector<const distributed::ProcessGroup*> PlacementTable::reduction_groups()
    const {
  std::vector<const distributed::ProcessGroup*> out;
  for (const auto& axis : axes_) {
    if (axis.second->size() > 1) {
      out.push_back(axis.second.get());
    }
  }
  if (pipeline_ != nullptr && pipeline_->size() > 1) {
    out.push_back(pipeline_.get());
  }
  return out;
}

} // namespace placement
} // namespace colossalai
