#pragma once

// Where each parameter of a boosted model lives: per mesh axis replicated,
// split along a dimension, or replicated with a partial gradient (as
// DTensor's placements); its pipeline stage; the stage that counts a weight
// tied across stages. Plugins record it; the global gradient norm, clipping
// and the sum of partial gradients read it (NOTE [Placement table] in
// src/placement/placement_table.cpp).

#include <colossalai/distributed/process_group.h>

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colossalai {
namespace placement {

/// How a parameter lies over one mesh axis.
struct Placement {
  enum class Kind {
    kReplicate, ///< the same on every rank of the axis
    kShard,     ///< split along `dim`, rank r holding chunk r
    kPartial,   ///< replicated, but each rank's gradient is a partial sum
  };
  static Placement replicate() {
    return Placement();
  }
  static Placement shard(int64_t dim);
  static Placement partial() {
    Placement p;
    p.kind = Kind::kPartial;
    return p;
  }

  bool is_replicate() const {
    return kind == Kind::kReplicate;
  }
  bool is_shard() const {
    return kind == Kind::kShard;
  }
  bool is_partial() const {
    return kind == Kind::kPartial;
  }
  /// A split of `n` equal sections along `dim` (a fused q, k, v
  /// projection: 3), each split separately: rank r holds its chunk of each,
  /// in order.
  Placement with_sections(int64_t n) const;
  /// Zero rows appended along `dim` up to `size` before the split
  /// (vocabulary padding): the whole tensor is the unpadded one.
  Placement with_padding(int64_t size) const;

  /// "Replicate()", "Shard(0)", "Partial()" (DTensor's spelling).
  std::string str() const;

  Kind kind = Kind::kReplicate;
  int64_t dim = -1;
  /// For a shard: equal sections split separately (1: the plain split).
  int64_t sections = 1;
  /// For a shard: the padded size along `dim` before the split (0: none).
  int64_t padded = 0;
};

/// Where one parameter lives.
struct ParamPlacement {
  /// Its name in the model's `named_parameters()`.
  std::string name;
  /// By mesh axis name; an axis not named here: Replicate.
  std::map<std::string, Placement> axes;
  /// The whole tensor's shape (what a checkpoint holds); left empty, the
  /// table fills it in from the local shape (a padded split must give it).
  std::vector<int64_t> global_shape;
  /// The pipeline stage holding this copy (-1: no pipeline).
  int stage = -1;
  /// For a weight tied across stages (an embedding and the LM head): the
  /// stage whose copy counts once in global reductions; -1: not tied.
  int tie_owner_stage = -1;

  /// The placement over `axis` (Replicate when not named).
  const Placement& on(const std::string& axis) const;
};

/// The placement of every parameter a rank holds, by tensor identity, with
/// the rank's process group along each mesh axis.
///
/// \code
///   placement::PlacementTable table;
///   table.add_axis("tp", tp_group).set_pipeline(pp_group, stage);
///   table.add(w, {"fc.weight", {{"tp", placement::Placement::shard(0)}}});
///   double norm = placement::global_grad_norm(table, params, grads, 2.0);
/// \endcode
class PlacementTable {
 public:
  /// A mesh axis parameters may be split or partial over; `group` is this
  /// rank's group along it. Global reductions combine axes in the order
  /// they were added.
  PlacementTable& add_axis(
      const std::string& name,
      distributed::ProcessGroupPtr group);
  /// Pipeline stages hold disjoint parameters; `stage` is this rank's.
  PlacementTable& set_pipeline(distributed::ProcessGroupPtr group, int stage);

  /// Records where `param` lives (by identity). Every axis it names must
  /// have been added, and a tied weight needs a pipeline.
  void add(const at::Tensor& param, ParamPlacement placement);

  /// Where `param` lives, or null when the table does not hold it.
  const ParamPlacement* find(const at::Tensor& param) const;
  /// Where the parameter named `name` lives, or null.
  const ParamPlacement* find(const std::string& name) const;
  /// Every parameter's placement, in the order they were added.
  std::vector<const ParamPlacement*> entries() const;
  /// Where `param` lives; an error naming it when the table does not.
  const ParamPlacement& at(const at::Tensor& param) const;
  size_t size() const {
    return by_impl_.size();
  }
  bool empty() const {
    return by_impl_.empty();
  }

  /// The axes in order, with this rank's group along each.
  const std::vector<std::pair<std::string, distributed::ProcessGroupPtr>>& axes()
      const {
    return axes_;
  }
  /// This rank's group along `axis` (null: not an axis of the table).
  distributed::ProcessGroupPtr group(const std::string& axis) const;
  const distributed::ProcessGroupPtr& pipeline_group() const {
    return pipeline_;
  }
  int stage() const {
    return stage_;
  }

  /// Whether this rank's copy of `param`'s gradient counts in a reduction
  /// over the whole model (a global norm): a split part on every rank of
  /// its axis, a replicated (or summed partial) one on the axis's rank 0
  /// only, a tied copy on its owning stage only. A parameter the table
  /// does not hold counts (one rank's own).
  bool counts_once(const at::Tensor& param) const;
  /// Whether some parameter's gradient is partial over some axis.
  bool has_partial() const {
    return partial_;
  }
  /// The groups a reduction over the whole model combines, in order: every
  /// axis, then the pipeline (groups of one rank are left out).
  std::vector<const distributed::ProcessGroup*> reduction_groups() const;

 private:
  std::vector<std::pair<std::string, distributed::ProcessGroupPtr>> axes_;
  distributed::ProcessGroupPtr pipeline_;
  int stage_ = -1;
  std::unordered_map<const void*, ParamPlacement> by_impl_;
  // Keys of by_impl_ (not pointers into it: a copied table stays valid).
  std::unordered_map<std::string, const void*> by_name_;
  std::vector<const void*> order_;
  bool partial_ = false;
};

} // namespace placement
} // namespace colossalai
