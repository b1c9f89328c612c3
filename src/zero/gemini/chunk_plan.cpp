#include "chunk_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace colossalai {
namespace zero {
namespace gemini {

namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

int64_t mebi(double m) {
  return static_cast<int64_t>(m * (int64_t(1) << 20));
}

} // namespace

int64_t unused_elements(
    const std::vector<int64_t>& numels,
    int64_t chunk_size) {
  int64_t unused = 0, left = 0;
  for (int64_t n : numels) {
    if (n > left) {
      unused += left; // the rest of the current chunk stays empty
      left = chunk_size;
    }
    left -= n;
  }
  return unused + left;
}

ChunkSearchResult search_chunk_size(
    const std::vector<int64_t>& numels,
    int dp_size,
    const ChunkSearchOptions& o) {
  TORCH_CHECK(dp_size >= 1, "chunk search: dp_size must be >= 1");
  TORCH_CHECK(
      o.search_interval >= 1,
      "search_chunk_size: search_interval (hidden_dim) must be >= 1, got ",
      o.search_interval);
  TORCH_CHECK(
      o.search_range_m >= 0 && o.min_chunk_size_m >= 0,
      "search_chunk_size: search_range_m and min_chunk_size_m must be >= 0");
  ChunkSearchResult r;
  r.total_numel = std::accumulate(numels.begin(), numels.end(), int64_t(0));
  const int64_t min_chunk = mebi(o.min_chunk_size_m);
  if (r.total_numel < min_chunk) {
    // Small models stay gathered: one chunk, nothing to shard or move.
    r.keep_gathered = true;
    r.chunk_size = r.total_numel;
    return r;
  }
  std::vector<int64_t> sizes = numels;
  if (o.filter_exlarge_params && sizes.size() > 1) {
    double mean = static_cast<double>(r.total_numel) / sizes.size();
    double var = 0;
    for (int64_t n : sizes) {
      var += (n - mean) * (n - mean);
    }
    const double limit = mean + 3 * std::sqrt(var / sizes.size());
    sizes.erase(
        std::remove_if(
            sizes.begin(),
            sizes.end(),
            [&](int64_t n) { return static_cast<double>(n) > limit; }),
        sizes.end());
  }
  int64_t largest = min_chunk;
  for (int64_t n : sizes) {
    largest = std::max(largest, n);
  }
  const int64_t start = round_up(largest, o.search_interval);
  const int64_t end = start + mebi(o.search_range_m);
  r.waste = std::numeric_limits<int64_t>::max();
  for (int64_t size = start; size <= end; size += o.search_interval) {
    const int64_t waste = unused_elements(sizes, size);
    if (waste < r.waste) {
      r.waste = waste;
      r.chunk_size = size;
    }
  }
  r.chunk_size = round_up(r.chunk_size, dp_size);
  return r;
}

std::vector<ChunkSpec> pack_chunks(
    const std::vector<int64_t>& numels,
    int64_t chunk_size,
    int dp_size) {
  TORCH_CHECK(chunk_size >= 1, "pack_chunks: chunk_size must be >= 1");
  TORCH_CHECK(dp_size >= 1, "pack_chunks: dp_size must be >= 1");
  std::vector<ChunkSpec> chunks;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t n = numels[i];
    if (!chunks.empty() && chunks.back().used + n <= chunks.back().capacity) {
      chunks.back().params.push_back(i);
      chunks.back().used += n;
      continue;
    }
    ChunkSpec c;
    c.capacity = round_up(std::max(chunk_size, n), dp_size);
    c.params.push_back(i);
    c.used = n;
    chunks.push_back(std::move(c));
  }
  return chunks;
}

} // namespace gemini
} // namespace zero
} // namespace colossalai
