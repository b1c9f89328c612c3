#include <colossalai/cluster/process_group_mesh.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace colossalai {
namespace cluster {

ProcessGroupMesh::ProcessGroupMesh(std::vector<int> shape)
    : shape_(std::move(shape)), rank_(distributed::get_rank()) {
  TORCH_CHECK(!shape_.empty(), "ProcessGroupMesh: shape must not be empty");
  int64_t total = 1;
  for (int s : shape_) {
    TORCH_CHECK(s >= 1, "ProcessGroupMesh: every axis size must be >= 1");
    total *= s;
  }
  TORCH_CHECK(
      total == distributed::get_world_size(),
      "ProcessGroupMesh: the shape's ",
      "product (",
      total,
      ") must equal the world size (",
      distributed::get_world_size(),
      ")");
  coord_ = unravel(rank_);
}

int ProcessGroupMesh::size(int axis) const {
  TORCH_CHECK(
      axis >= 0 && axis < (int)shape_.size(),
      "ProcessGroupMesh: axis ",
      axis,
      " out of range for ",
      shape_.size(),
      " axes");
  return shape_[axis];
}

int ProcessGroupMesh::coordinate(int axis) const {
  size(axis);
  return coord_[axis];
}

int ProcessGroupMesh::ravel(const std::vector<int>& coord) const {
  TORCH_CHECK(
      coord.size() == shape_.size(),
      "ProcessGroupMesh::ravel: need ",
      shape_.size(),
      " coordinates");
  int r = 0;
  for (size_t i = 0; i < shape_.size(); ++i) {
    TORCH_CHECK(
        coord[i] >= 0 && coord[i] < shape_[i],
        "ProcessGroupMesh::ravel: coordinate out of range");
    r = r * shape_[i] + coord[i];
  }
  return r;
}

std::vector<int> ProcessGroupMesh::unravel(int rank) const {
  std::vector<int> c(shape_.size());
  for (size_t i = shape_.size(); i-- > 0;) {
    c[i] = rank % shape_[i];
    rank /= shape_[i];
  }
  return c;
}

std::vector<int> ProcessGroupMesh::normalize(std::vector<int> axes) const {
  TORCH_CHECK(!axes.empty(), "ProcessGroupMesh: no axes given");
  for (int a : axes) {
    size(a);
  }
  std::sort(axes.begin(), axes.end());
  axes.erase(std::unique(axes.begin(), axes.end()), axes.end());
  return axes;
}

std::vector<int> ProcessGroupMesh::ranks_along_axes(
    std::vector<int> axes) const {
  axes = normalize(std::move(axes));
  // Enumerate the coordinates of the chosen axes (row-major), keeping the
  // others fixed at this rank's.
  std::vector<int> ranks;
  std::vector<int> c = coord_;
  for (int a : axes) {
    c[a] = 0;
  }
  while (true) {
    ranks.push_back(ravel(c));
    int i = static_cast<int>(axes.size()) - 1;
    for (; i >= 0; --i) {
      if (++c[axes[i]] < shape_[axes[i]]) {
        break;
      }
      c[axes[i]] = 0;
    }
    if (i < 0) {
      break;
    }
  }
  return ranks;
}

distributed::ProcessGroupPtr ProcessGroupMesh::get_group_along_axis(int axis) {
  return get_group_along_axis(std::vector<int>{axis});
}

distributed::ProcessGroupPtr ProcessGroupMesh::get_group_along_axis(
    std::vector<int> axes) {
  axes = normalize(std::move(axes));
  auto it = groups_.find(axes);
  if (it != groups_.end()) {
    return it->second;
  }
  auto ranks = ranks_along_axes(axes);
  distributed::ProcessGroupPtr group;
  if ((int)ranks.size() == distributed::get_world_size()) {
    group = distributed::world_group();
  } else {
    std::ostringstream name;
    name << "mesh";
    for (size_t i = 0; i < shape_.size(); ++i) {
      name << (i ? "x" : "(") << shape_[i];
    }
    name << ")/axes";
    for (int a : axes) {
      name << "_" << a;
    }
    group = distributed::new_group(ranks, name.str());
  }
  groups_[axes] = group;
  return group;
}

} // namespace cluster
} // namespace colossalai
