#pragma once

// Gemini's chunks: the chunk-size search and the packing of parameters into
// chunks (internal; the GeminiPlugin is built on this).
//
// NOTE [Gemini chunks]
// Gemini packs parameters, in execution order, into fixed-size chunks; a
// chunk is the unit of all-gather, reduce-scatter, placement move and
// optimizer update, and in memory it is the flat shard layout (NOTE [Flat
// shard layout]) of its parameters padded to the chunk's capacity. The size
// is searched as ColossalAI does: candidates from the largest parameter (at
// least min_chunk_size), rounded up to the search interval (the hidden
// dimension), over search_range; the one that leaves the least unused
// capacity when parameters are appended in order wins, rounded up to a
// multiple of the data-parallel size. Parameters much larger than the rest
// (above mean + 3 std) are left out of the search (they get a chunk of their
// own). A model smaller than min_chunk_size is one chunk kept gathered.

#include <cstdint>
#include <vector>

namespace colossalai {
namespace zero {
namespace gemini {

struct ChunkSearchOptions {
  /// Width of the search, in 2^20 elements.
  double search_range_m = 32;
  /// Step between candidates; the hidden dimension is the best value.
  int64_t search_interval = 1024;
  /// Smallest chunk, in 2^20 elements.
  double min_chunk_size_m = 32;
  /// Leave parameters above mean + 3 std out of the search.
  bool filter_exlarge_params = true;
};

struct ChunkSearchResult {
  int64_t chunk_size = 0; // elements
  /// The model is smaller than min_chunk_size: one chunk, kept gathered.
  bool keep_gathered = false;
  int64_t total_numel = 0;
  /// Unused capacity of the searched packing, in elements.
  int64_t waste = 0;
};

/// Searches the chunk size for parameters of `numels` elements (execution
/// order) sharded over `dp_size` ranks.
ChunkSearchResult search_chunk_size(
    const std::vector<int64_t>& numels,
    int dp_size,
    const ChunkSearchOptions& options = {});

/// Unused capacity when `numels` are appended in order to chunks of
/// `chunk_size` (a parameter that does not fit starts a new chunk).
int64_t unused_elements(const std::vector<int64_t>& numels, int64_t chunk_size);

struct ChunkSpec {
  std::vector<size_t> params; // indices into the model's parameter order
  int64_t capacity = 0;       // elements, a multiple of dp_size
  int64_t used = 0;
};

/// Packs parameters in order: appended to the last chunk while they fit,
/// else a new chunk of `chunk_size`; a parameter larger than `chunk_size`
/// gets a chunk of its own size (rounded up to `dp_size`).
std::vector<ChunkSpec> pack_chunks(
    const std::vector<int64_t>& numels,
    int64_t chunk_size,
    int dp_size);

} // namespace gemini
} // namespace zero
} // namespace colossalai
