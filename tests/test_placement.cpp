// The placement table (NOTE [Placement table]): its rules, its errors, and
// the gradient operations that read it against the whole model's gradient.

#include <colossalai/distributed/process_group.h>
#include <colossalai/placement/gradients.h>
#include <colossalai/placement/placement.h>

#include <harness/multiprocess.h>
#include <harness/test_util.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>

namespace cd = colossalai::distributed;
namespace pl = colossalai::placement;
using colossalai::testing::error_of;
using colossalai::testing::run_distributed;

namespace {

TEST(Placement, SpelledAsDTensor) {
  EXPECT_EQ(pl::Placement::replicate().str(), "Replicate()");
  EXPECT_EQ(pl::Placement::shard(1).str(), "Shard(1)");
  EXPECT_EQ(pl::Placement::partial().str(), "Partial()");
  pl::ParamPlacement p;
  p.axes["tp"] = pl::Placement::shard(0);
  EXPECT_TRUE(p.on("tp").is_shard());
  EXPECT_TRUE(p.on("sp").is_replicate()); // an axis not named
  EXPECT_NE(
      error_of([] { pl::Placement::shard(-1); }).find("dim"),
      std::string::npos);
}

TEST(Placement, BadRecordsNameTheParameterAndTheAxis) {
  run_distributed(1, [](int, int) {
    pl::PlacementTable table;
    auto w = at::zeros({4, 3});
    auto msg = error_of([&] {
      pl::ParamPlacement p{"fc.weight", {{"tp", pl::Placement::shard(0)}}};
      table.add(w, p);
    });
    EXPECT_NE(msg.find("fc.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'tp'"), std::string::npos) << msg;

    table.add_axis("tp", cd::world_group());
    msg = error_of([&] { table.add_axis("tp", cd::world_group()); });
    EXPECT_NE(msg.find("twice"), std::string::npos) << msg;
    msg = error_of([&] {
      table.add(w, {"fc.weight", {{"tp", pl::Placement::shard(2)}}});
    });
    EXPECT_NE(msg.find("dim 2"), std::string::npos) << msg;
    msg = error_of([&] {
      pl::ParamPlacement tied{"wte.weight"};
      tied.tie_owner_stage = 0;
      table.add(w, tied);
    });
    EXPECT_NE(msg.find("no pipeline"), std::string::npos) << msg;

    table.add(w, {"fc.weight", {{"tp", pl::Placement::shard(0)}}});
    msg = error_of([&] { table.add(w, {"fc.weight"}); });
    EXPECT_NE(msg.find("twice"), std::string::npos) << msg;
    msg = error_of([&] { table.at(at::zeros({2})); });
    EXPECT_NE(msg.find("no placement"), std::string::npos) << msg;
    EXPECT_EQ(table.at(w).name, "fc.weight");
    EXPECT_EQ(table.size(), 1u);
    EXPECT_FALSE(table.has_partial());
    msg = error_of([&] { table.add(at::zeros({4}), {"fc.weight"}); });
    EXPECT_NE(
        msg.find("two parameters are named 'fc.weight'"), std::string::npos)
        << msg;
    msg = error_of([&] {
      table.add(
          at::zeros({5, 3}),
          {"lm_head.weight",
           {{"tp", pl::Placement::shard(0).with_padding(8)}}});
    });
    EXPECT_NE(msg.find("global_shape"), std::string::npos) << msg;
    EXPECT_NE(
        error_of([] {
          pl::Placement::shard(0).with_padding(8).with_sections(3);
        }).find("sections"),
        std::string::npos);
  });
}

// What checkpoint IO reads: the whole tensor's shape (an even split's from
// the axis's size; a padded split's as given) and the split's layout, by
// name, in the order of the record.
TEST(Placement, RecordsWholeShapesAndSplitLayoutsByName) {
  run_distributed(2, [](int, int) {
    pl::PlacementTable table;
    table.add_axis("tp", cd::world_group());
    auto qkv = at::zeros({6, 4}), head = at::zeros({4, 4}), b = at::zeros({4});
    table.add(
        qkv,
        {"attn.c_attn.weight",
         {{"tp", pl::Placement::shard(0).with_sections(3)}}});
    pl::ParamPlacement padded{
        "lm_head.weight", {{"tp", pl::Placement::shard(0).with_padding(8)}}};
    padded.global_shape = {7, 4}; // 7 rows, padded to 8, 4 a rank
    table.add(head, padded);
    table.add(b, {"ln.bias"});
    EXPECT_EQ(
        table.find("attn.c_attn.weight")->global_shape,
        (std::vector<int64_t>{12, 4}));
    EXPECT_EQ(table.find("attn.c_attn.weight")->on("tp").sections, 3);
    EXPECT_EQ(
        table.find("lm_head.weight")->global_shape,
        (std::vector<int64_t>{7, 4}));
    EXPECT_EQ(table.find("lm_head.weight")->on("tp").padded, 8);
    EXPECT_EQ(table.find("ln.bias")->global_shape, (std::vector<int64_t>{4}));
    EXPECT_EQ(table.find("nope"), nullptr);
    ASSERT_EQ(table.entries().size(), 3u);
    EXPECT_EQ(table.entries()[0]->name, "attn.c_attn.weight");
    EXPECT_EQ(table.entries()[2]->name, "ln.bias");
    const auto copy = table; // a copy answers from its own records
    table = pl::PlacementTable();
    EXPECT_EQ(copy.find("lm_head.weight")->on("tp").padded, 8);
    EXPECT_EQ(copy.entries()[1], copy.find(head));
  });
}

// tp 2 x pp 2. Every stage holds a split weight W (rows over tp), a
// replicated bias b, a norm weight n whose gradient is partial over tp,
// and a tied embedding E whose copy on stage 1 is owned by stage 0. The
// global norm equals the norm of the whole model's gradient (each weight
// once); the partial gradients sum to the whole.
TEST(Placement, GlobalNormCountsEachWeightOnceOverTheMesh) {
  run_distributed(4, [](int rank, int) {
    const int stage = rank / 2, t = rank % 2;
    auto tp = cd::new_group({2 * stage, 2 * stage + 1}, "tp");
    auto pp = cd::new_group({t, t + 2}, "pp");
    auto table = std::make_shared<pl::PlacementTable>();
    table->add_axis("tp", tp).set_pipeline(pp, stage);

    auto full_w = [](int s) {
      return at::arange(12, at::kFloat).view({4, 3}) + 100.0 * s;
    };
    auto w = full_w(stage).narrow(0, 2 * t, 2).clone();
    auto b = at::full({3}, stage + 1.0);
    auto n = at::full({2}, t + 1.0); // partial: 1 + 2 = 3 over tp
    auto e = at::full({5}, 2.0);
    const std::vector<at::Tensor> params{
        at::empty({2, 3}), at::empty({3}), at::empty({2}), at::empty({5})};
    table->add(params[0], {"w", {{"tp", pl::Placement::shard(0)}}});
    table->add(params[1], {"b"});
    table->add(params[2], {"n", {{"tp", pl::Placement::partial()}}});
    pl::ParamPlacement tied{"e"};
    tied.tie_owner_stage = 0;
    table->add(params[3], tied);
    EXPECT_TRUE(table->has_partial());
    EXPECT_EQ(table->at(params[0]).stage, stage); // the table's stage

    const std::vector<at::Tensor> grads{w, b, n, e};
    pl::sum_partial_grads(*table, params, grads);
    EXPECT_TRUE(at::equal(n, at::full({2}, 3.0)));

    EXPECT_TRUE(table->counts_once(params[0]));
    EXPECT_EQ(table->counts_once(params[1]), t == 0);
    EXPECT_EQ(table->counts_once(params[3]), t == 0 && stage == 0);
    double want = 0;
    for (int s = 0; s < 2; ++s) {
      want += full_w(s).pow(2).sum().item<double>() +
          3 * (s + 1.0) * (s + 1.0) + 2 * 9.0;
    }
    want += 5 * 4.0;
    const double got2 = pl::global_grad_norm(*table, params, grads, 2.0);
    // Each tensor's norm is taken in float32, as torch.nn.utils does: at
    // most 12 terms, so a relative error below 16 float32 epsilons.
    EXPECT_NEAR(got2, std::sqrt(want), 16 * FLT_EPSILON * std::sqrt(want));
    // The max norm: the largest element anywhere (stage 1's W).
    const double inf = pl::global_grad_norm(*table, params, grads, INFINITY);
    EXPECT_EQ(inf, 111.0);
    EXPECT_EQ(table->reduction_groups().size(), 2u);
  });
}

} // namespace
