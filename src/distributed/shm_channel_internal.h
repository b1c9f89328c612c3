#pragma once

// Helpers shared by the shared-memory channel's collectives (internal):
// shard offsets and piece lengths. See NOTE [Shared-memory collectives].

#include <algorithm>
#include <cstdint>
#include <vector>

namespace colossalai {
namespace distributed {
namespace detail {

// Where each rank's shard starts in the whole tensor (prefix sums).
inline std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offset(sizes.size() + 1, 0);
  for (size_t q = 0; q < sizes.size(); ++q) {
    offset[q + 1] = offset[q] + sizes[q];
  }
  return offset;
}

inline int64_t clamp_len(int64_t size, int64_t at, int64_t piece) {
  return std::clamp<int64_t>(size - at, 0, piece);
}

} // namespace detail
} // namespace distributed
} // namespace colossalai
