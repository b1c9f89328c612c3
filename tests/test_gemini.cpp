// Gemini's chunk plan: the chunk-size search (ColossalAI's rule) and the
// packing of parameters into chunks in execution order.

#include <src/zero/gemini/chunk_plan.h>

#include <harness/test_util.h>

#include <gtest/gtest.h>

namespace gm = colossalai::zero::gemini;
using colossalai::testing::error_of;

namespace {

constexpr double kElements = 1.0 / (1 << 20); // one element, in "_m" units

} // namespace

TEST(GeminiChunks, UnusedElementsFollowAppendOrder) {
  // [3 | 2 unused] [3 | 2] [3 | 2]
  EXPECT_EQ(gm::unused_elements({3, 3, 3}, 5), 6);
  // [2 3] [4 | 1]
  EXPECT_EQ(gm::unused_elements({2, 3, 4}, 5), 1);
  EXPECT_EQ(gm::unused_elements({}, 5), 0); // no parameter, no chunk
}

TEST(GeminiChunks, SearchPicksTheLeastWastefulSizeOnTheInterval) {
  gm::ChunkSearchOptions o;
  o.search_interval = 1000;
  o.search_range_m = 4000 * kElements;
  o.min_chunk_size_m = 0;
  o.filter_exlarge_params = false;
  // Candidates 3000..7000: 3000 wastes 4000 elements, 4000 wastes none.
  auto r = gm::search_chunk_size({1000, 3000, 1000, 3000}, 1, o);
  EXPECT_EQ(r.chunk_size, 4000);
  EXPECT_EQ(r.waste, 0);
  EXPECT_EQ(r.total_numel, 8000);
  EXPECT_FALSE(r.keep_gathered);
  // Rounded up to a multiple of the data-parallel size.
  EXPECT_EQ(
      gm::search_chunk_size({1000, 3000, 1000, 3000}, 3, o).chunk_size, 4002);
}

TEST(GeminiChunks, SmallModelsStayGatheredAndHugeParamsAreFiltered) {
  gm::ChunkSearchOptions o; // min_chunk_size_m 32: 32 Mi elements
  auto small = gm::search_chunk_size({1000, 2000}, 2, o);
  EXPECT_TRUE(small.keep_gathered);
  EXPECT_EQ(small.chunk_size, 3000);

  o.min_chunk_size_m = 0;
  o.search_interval = 100;
  o.search_range_m = 1000 * kElements;
  std::vector<int64_t> numels(20, 500);
  numels.push_back(1000000); // above mean + 3 std of the rest
  auto r = gm::search_chunk_size(numels, 1, o);
  EXPECT_LE(r.chunk_size, 1500); // searched on the 500s alone
  o.filter_exlarge_params = false;
  EXPECT_EQ(gm::search_chunk_size(numels, 1, o).chunk_size, 1000000);
  // The huge parameter still gets a chunk, of its own size.
  auto chunks = gm::pack_chunks(numels, r.chunk_size, 4);
  EXPECT_EQ(chunks.back().params, std::vector<size_t>{20});
  EXPECT_EQ(chunks.back().capacity, 1000000);
}

TEST(GeminiChunks, PackingKeepsOrderAndCapacity) {
  const std::vector<int64_t> numels = {7, 2, 9, 1, 1, 30, 4};
  auto chunks = gm::pack_chunks(numels, 10, 4);
  size_t next = 0;
  for (const auto& c : chunks) {
    EXPECT_EQ(c.capacity % 4, 0);
    EXPECT_LE(c.used, c.capacity);
    int64_t used = 0;
    for (size_t i : c.params) {
      EXPECT_EQ(i, next++); // every parameter once, in order
      used += numels[i];
    }
    EXPECT_EQ(used, c.used);
  }
  EXPECT_EQ(next, numels.size());
  // [7 2] [9 1 1] [30] [4]: capacity 12 (10 rounded up to 4); 30 alone.
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[0].params, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(chunks[1].params, (std::vector<size_t>{2, 3, 4}));
  EXPECT_EQ(chunks[2].params, std::vector<size_t>{5});
  EXPECT_EQ(chunks[2].capacity, 32);
  EXPECT_EQ(chunks[3].params, std::vector<size_t>{6});
}

TEST(GeminiChunks, BadOptionsNameTheOption) {
  gm::ChunkSearchOptions o;
  o.search_interval = 0;
  auto msg = error_of([&] { gm::search_chunk_size({1}, 1, o); });
  EXPECT_NE(msg.find("search_interval (hidden_dim)"), std::string::npos) << msg;
  msg = error_of([] { gm::pack_chunks({1}, 0, 1); });
  EXPECT_NE(msg.find("chunk_size"), std::string::npos) << msg;
}
