#pragma once

#include <colossalai/distributed/process_group.h>

#include <map>
#include <vector>

namespace colossalai {
namespace cluster {

/// An n-dimensional mesh of the global ranks (row-major: the last axis varies
/// fastest), e.g. dp x pp x tp. `get_group_along_axis` returns the group of
/// ranks that share this rank's coordinates on every other axis, created on
/// first use and cached.
///
/// Only the group containing this rank is created, so every rank of that group
/// must ask for it, and ask for its groups in the same order.
///
/// Example:
/// \code
///   colossalai::cluster::ProcessGroupMesh mesh({2, 2}); // dp x tp, 4 ranks
///   auto tp = mesh.get_group_along_axis(1); // {0,1} or {2,3}
///   auto dp = mesh.get_group_along_axis(0); // {0,2} or {1,3}
/// \endcode
class ProcessGroupMesh {
 public:
  explicit ProcessGroupMesh(std::vector<int> shape);

  const std::vector<int>& shape() const {
    return shape_;
  }
  int size(int axis) const;
  int rank() const {
    return rank_;
  }
  /// This rank's coordinate on every axis / on one axis.
  const std::vector<int>& coordinate() const {
    return coord_;
  }
  int coordinate(int axis) const;

  int ravel(const std::vector<int>& coord) const;
  std::vector<int> unravel(int rank) const;

  /// Global ranks of the group through this rank along `axes`.
  std::vector<int> ranks_along_axes(std::vector<int> axes) const;

  distributed::ProcessGroupPtr get_group_along_axis(int axis);
  distributed::ProcessGroupPtr get_group_along_axis(std::vector<int> axes);

 private:
  std::vector<int> normalize(std::vector<int> axes) const;

  std::vector<int> shape_;
  int rank_;
  std::vector<int> coord_;
  std::map<std::vector<int>, distributed::ProcessGroupPtr> groups_;
};

} // namespace cluster
} // namespace colossalai
