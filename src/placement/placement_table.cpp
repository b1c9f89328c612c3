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
// (global_grad_norm's `pieces`). With each split's layout (sections,
// padding) and the whole tensor's shape, the same record tells checkpoint
// IO who writes which slice and how a whole tensor is cut at load, at any
// mesh (HybridParallelPlugin's, src/booster/plugin/hybrid/checkpoint_io.cpp).

Placement Placement::shard(int64_t dim) {
  TORCH_CHECK(dim >= 0, "Placement::shard: dim must be >= 0, got ", dim);
  Placement p;
  p.kind = Kind::kShard;
  p.dim = dim;
  return p;
}

Placement Placement::with_sections(int64_t n) const {
  TORCH_CHECK(
      is_shard() && n >= 1 && (n == 1 || padded == 0),
      "Placement::with_sections: sections (",
      n,
      ") need a shard without padding");
  Placement p = *this;
  p.sections = n;
  return p;
}

Placement Placement::with_padding(int64_t size) const {
  TORCH_CHECK(
      is_shard() && size >= 0 && (size == 0 || sections == 1),
      "Placement::with_padding: padding (",
      size,
      ") needs a shard without sections");
  Placement p = *this;
  p.padded = size;
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
  if (placement.global_shape.empty()) {
    // An even split: the local size times the axis's ranks.
    placement.global_shape = param.sizes().vec();
    for (const auto& axis : placement.axes) {
      TORCH_CHECK(
          !axis.second.is_shard() || axis.second.padded == 0,
          "PlacementTable::add: parameter '",
          placement.name,
          "' is split with padding: give its global_shape");
      if (axis.second.is_shard()) {
        placement.global_shape[axis.second.dim] *= group(axis.first)->size();
      }
    }
  }
  TORCH_CHECK(
      static_cast<int64_t>(placement.global_shape.size()) == param.dim(),
      "PlacementTable::add: parameter '",
      placement.name,
      "' has ",
      param.dim(),
      " dims but a global shape of ",
      placement.global_shape.size());
  TORCH_CHECK(
      !by_impl_.count(param.unsafeGetTensorImpl()),
      "PlacementTable::add: a parameter is recorded twice");
  TORCH_CHECK(
      placement.name.empty() || !by_name_.count(placement.name),
      "PlacementTable::add: two parameters are named '",
      placement.name,
      "'");
  const void* key = param.unsafeGetTensorImpl();
  if (!placement.name.empty()) {
    by_name_.emplace(placement.name, key);
  }
  order_.push_back(key);
  by_impl_.emplace(key, std::move(placement));
}

const ParamPlacement* PlacementTable::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &by_impl_.at(it->second);
}

std::vector<const ParamPlacement*> PlacementTable::entries() const {
  std::vector<const ParamPlacement*> out;
  out.reserve(order_.size());
  for (const void* key : order_) {
    out.push_back(&by_impl_.at(key));
  }
  return out;
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
