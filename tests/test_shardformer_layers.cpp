// Tensor-parallel building blocks at tp 2 and 4: the autograd collectives
// (distributed/functional.h) and the parallel layers (shardformer/layer),
// each against the unsharded computation, forward and backward.
//
// Exactness: inputs, weights and upstream gradients are small integers in
// float32, so every product and every partial sum is an integer far below
// 2^24 and exact: the sharded and the full computation must agree bit for
// bit whatever order the ranks and BLAS add in. So a wrong slice, a missing
// or doubled reduction, or a wrong adjoint shows as a difference, and no
// tolerance needs justifying. Only the cross entropy and ring attention,
// which need exp and log, use floats; their bounds are derived where they
// are checked.

#include <colossalai/booster/booster.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/functional.h>
#include <colossalai/nn/loss.h>
#include <colossalai/shardformer/layer/embedding.h>
#include <colossalai/shardformer/layer/linear.h>
#include <colossalai/shardformer/layer/normalization.h>
#include <colossalai/shardformer/layer/ring_attention.h>

#include <harness/multiprocess.h>
#include <harness/test_util.h>
#include <zoo/gpt.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace cd = colossalai::distributed;
namespace cdf = colossalai::distributed::functional;
namespace sl = colossalai::shardformer::layer;
using colossalai::testing::error_of;
using colossalai::testing::run_distributed;

namespace {

// Integer-valued floats in [-3, 3], the same on every rank.
at::Tensor ints(at::IntArrayRef shape, int64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randint(-3, 4, shape, gen, at::kFloat);
}

void expect_equal(
    const at::Tensor& got,
    const at::Tensor& want,
    const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got, want))
      << what << " differs by " << (got - want).abs().max().item<double>();
}

// Runs `fn(rank, world)` at tp 2 and tp 4.
void at_tp_2_and_4(const std::function<void(int, int)>& fn) {
  for (int world : {2, 4}) {
    run_distributed(world, fn);
  }
}

} // namespace

TEST(AutogradCollectives, ForwardAndAdjointBackward) {
  at_tp_2_and_4([](int rank, int world) {
    auto g = cd::world_group();
    const int64_t n = 4 * world;
    auto full = ints({3, n, 5}, 1);         // what every rank would hold
    auto mine = full.chunk(world, 1)[rank]; // this rank's sequence chunk
    auto up = ints({3, n, 5}, 2);
    auto up_mine = up.chunk(world, 1)[rank];
    auto per_rank = [&](int r) { return ints({3, n, 5}, 10 + r); };
    auto sum_over_ranks = [&] {
      auto s = at::zeros({3, n, 5});
      for (int r = 0; r < world; ++r) {
        s += per_rank(r);
      }
      return s;
    };

    { // copy: identity forward, the gradients summed
      auto x = full.clone().requires_grad_();
      auto y = cdf::copy_to_group(x, g);
      expect_equal(y, full, "copy_to_group forward");
      (y * per_rank(rank)).sum().backward();
      expect_equal(x.grad(), sum_over_ranks(), "copy_to_group backward");
    }
    { // reduce: the partials summed forward, the gradient passed through
      auto x = per_rank(rank).requires_grad_();
      auto y = cdf::reduce_from_group(x, g);
      expect_equal(y, sum_over_ranks(), "reduce_from_group forward");
      (y * up).sum().backward();
      expect_equal(x.grad(), up, "reduce_from_group backward");
    }
    { // split: this rank's chunk, the gradient gathered back
      auto x = full.clone().requires_grad_();
      auto y = cdf::split_along_dim(x, 1, g);
      expect_equal(y, mine, "split_along_dim forward");
      (y * up_mine).sum().backward();
      expect_equal(x.grad(), up, "split_along_dim backward");
    }
    { // gather: the chunks concatenated, the gradient split
      auto x = mine.clone().requires_grad_();
      auto y = cdf::gather_along_dim(x, 1, g);
      expect_equal(y, full, "gather_along_dim forward");
      (y * up).sum().backward();
      expect_equal(x.grad(), up_mine, "gather_along_dim backward");
    }
    { // reduce-scatter: the sum's chunk, the gradient gathered
      auto x = per_rank(rank).requires_grad_();
      auto y = cdf::reduce_scatter_along_dim(x, 1, g);
      expect_equal(
          y, sum_over_ranks().chunk(world, 1)[rank], "reduce_scatter forward");
      (y * up_mine).sum().backward();
      expect_equal(x.grad(), up, "reduce_scatter backward");
    }
    { // gather forward, reduce-scatter backward (sequence parallelism)
      auto x = mine.clone().requires_grad_();
      auto y = cdf::gather_along_dim_reduce_scatter_backward(x, 1, g);
      expect_equal(y, full, "gather/reduce-scatter forward");
      (y * per_rank(rank)).sum().backward();
      expect_equal(
          x.grad(),
          sum_over_ranks().chunk(world, 1)[rank],
          "gather/reduce-scatter backward");
    }
    { // all-to-all: sequence-sharded [B, T/p, H, D] to head-sharded
      // [B, T, H/p, D] and, in backward, back
      const int64_t heads = 2 * world;
      auto whole = ints({2, n, heads, 3}, 3);
      auto x = whole.chunk(world, 1)[rank].clone().requires_grad_();
      auto y = cdf::all_to_all_along_dims(x, 2, 1, g);
      expect_equal(y, whole.chunk(world, 2)[rank], "all_to_all forward");
      auto up_heads = ints({2, n, heads, 3}, 4);
      (y * up_heads.chunk(world, 2)[rank]).sum().backward();
      expect_equal(
          x.grad(), up_heads.chunk(world, 1)[rank], "all_to_all backward");
    }
    auto msg = error_of([&] { cdf::split_along_dim(ints({3}, 5), 0, g); });
    EXPECT_NE(msg.find("does not split evenly"), std::string::npos) << msg;
  });
}

namespace {

// A full nn::Linear with integer weights (the same on every rank).
torch::nn::Linear int_linear(int64_t in, int64_t out, int64_t seed) {
  torch::nn::Linear full(torch::nn::LinearOptions(in, out));
  torch::NoGradGuard no_grad;
  full->weight.copy_(ints({out, in}, seed));
  full->bias.copy_(ints({out}, seed + 1));
  return full;
}

} // namespace

TEST(ParallelLayers, ColumnThenRowEqualsTheFullLayers) {
  // Megatron's MLP: Linear1D_Col (no gather) into Linear1D_Row (parallel
  // input), and each layer alone with gather_output / a split input.
  at_tp_2_and_4([](int rank, int world) {
    auto g = cd::world_group();
    const int64_t in = 8, hidden = 4 * world, out = 6;
    auto fc = int_linear(in, hidden, 1);
    auto proj = int_linear(hidden, out, 3);
    auto x = ints({2, 5, in}, 5).requires_grad_();
    auto up = ints({2, 5, out}, 6);
    (proj(fc(x)) * up).sum().backward();

    auto col = sl::Linear1D_Col(sl::Linear1D_ColImpl::from_full(*fc, g));
    auto row = sl::Linear1D_Row(sl::Linear1D_RowImpl::from_full(*proj, g));
    auto xs = x.detach().clone().requires_grad_();
    auto y = row(col(xs));
    expect_equal(y, proj(fc(x)).detach(), "MLP forward");
    (y * up).sum().backward();
    expect_equal(xs.grad(), x.grad(), "input gradient");
    expect_equal(
        col->weight.grad(),
        fc->weight.grad().chunk(world, 0)[rank],
        "column weight gradient");
    expect_equal(
        col->bias.grad(),
        fc->bias.grad().chunk(world, 0)[rank],
        "column bias gradient");
    expect_equal(
        row->weight.grad(),
        proj->weight.grad().chunk(world, 1)[rank],
        "row weight gradient");
    expect_equal(row->bias.grad(), proj->bias.grad(), "row bias gradient");

    // gather_output: every rank sees the whole output.
    auto gathered =
        sl::Linear1D_Col(sl::Linear1D_ColImpl::from_full(*fc, g, true));
    expect_equal(gathered(x.detach()), fc(x).detach(), "gather_output");
    // From tensors in GPT-2's Conv1D layout ([in, out], passed transposed),
    // as a Hugging Face checkpoint holds them.
    auto conv_fc = fc->weight.detach().t().contiguous();
    auto conv_proj = proj->weight.detach().t().contiguous();
    auto col_t = sl::Linear1D_ColImpl::from_full(conv_fc.t(), fc->bias, g);
    auto row_t = sl::Linear1D_RowImpl::from_full(conv_proj.t(), proj->bias, g);
    expect_equal(
        row_t->forward(col_t->forward(x.detach())),
        proj(fc(x)).detach(),
        "from Conv1D-layout tensors");
    // A full input split by the row layer itself.
    auto split_in =
        sl::Linear1D_Row(sl::Linear1D_RowImpl::from_full(*proj, g, false));
    auto h = fc(x).detach();
    expect_equal(split_in(h), proj(h).detach(), "parallel_input(false)");

    auto msg = error_of([&] {
      sl::Linear1D_Col(sl::Linear1DOptions(4, 4 * world + 1).process_group(g));
    });
    EXPECT_NE(msg.find("out_features"), std::string::npos) << msg;
    msg = error_of([&] { row(ints({2, in}, 7)); });
    EXPECT_NE(msg.find("parallel_input"), std::string::npos) << msg;
  });
}

TEST(ParallelLayers, SequenceParallelColumnRowKeepsTheSequenceSharded) {
  // split_gather sequence parallelism: the block's input and output are
  // split along the sequence; inside, the column layer gathers it and the
  // row layer reduce-scatters back. Equal to the full layers on the whole
  // sequence, gradients included.
  at_tp_2_and_4([](int rank, int world) {
    auto g = cd::world_group();
    const int64_t in = 8, hidden = 2 * world, out = 6, seq = 2 * world;
    auto fc = int_linear(in, hidden, 11);
    auto proj = int_linear(hidden, out, 13);
    auto x = ints({3, seq, in}, 15).requires_grad_();
    auto up = ints({3, seq, out}, 16);
    auto ref = proj(fc(x));
    (ref * up).sum().backward();

    auto col = sl::Linear1D_ColImpl::from_full(*fc, g);
    auto row = sl::Linear1D_RowImpl::from_full(*proj, g);
    col->options.seq_parallel(true);
    row->options.seq_parallel(true);
    auto xs = x.detach().chunk(world, 1)[rank].clone().requires_grad_();
    auto y = row->forward(col->forward(xs));
    expect_equal(y, ref.detach().chunk(world, 1)[rank], "forward");
    (y * up.chunk(world, 1)[rank]).sum().backward();
    expect_equal(xs.grad(), x.grad().chunk(world, 1)[rank], "input gradient");
    expect_equal(
        col->weight.grad(),
        fc->weight.grad().chunk(world, 0)[rank],
        "column weight gradient");
    expect_equal(
        row->weight.grad(),
        proj->weight.grad().chunk(world, 1)[rank],
        "row weight gradient");
    // Each rank adds the bias to its part of the sequence: the full
    // gradient is the sum over ranks.
    auto bias_grad = row->bias.grad().clone();
    cd::all_reduce(bias_grad, *g).wait();
    expect_equal(bias_grad, proj->bias.grad(), "row bias gradient (summed)");
  });
}

TEST(ParallelLayers, SequenceOverlapGathersOnceAndEqualsTheFullLayers) {
  // enable_sequence_overlap (NOTE [Sequence overlap]): three column layers
  // reading one sequence-split input (q, k, v; one without bias, one in
  // GPT-2's Conv1D layout) run as one Function: one all-gather forward, one
  // reduce-scatter of the summed input gradient backward. Integer values
  // keep every sum exact, so the results equal the full layers bit for bit
  // whatever the summation order.
  at_tp_2_and_4([](int rank, int world) {
    namespace cbd = colossalai::booster::detail;
    auto g = cd::world_group();
    const int64_t in = 8, out = 2 * world, seq = 2 * world;
    std::vector<torch::nn::Linear> full;
    for (int i = 0; i < 3; ++i) {
      full.push_back(int_linear(in, out, 21 + 2 * i));
    }
    auto x = ints({3, seq, in}, 27).requires_grad_();
    at::Tensor loss = at::zeros({});
    std::vector<at::Tensor> refs;
    for (int i = 0; i < 3; ++i) {
      auto y = i == 1 ? at::linear(x, full[i]->weight) : full[i](x);
      refs.push_back(y.detach());
      loss = loss + (y * ints(y.sizes(), 30 + i)).sum();
    }
    loss.backward();

    std::vector<std::shared_ptr<sl::Linear1D_ColImpl>> cols;
    for (int i = 0; i < 3; ++i) {
      cols.push_back(
          i == 2 ? sl::Linear1D_ColImpl::from_full(
                       full[i]->weight, full[i]->bias, g)
                 : sl::Linear1D_ColImpl::from_full(*full[i], g));
      if (i == 1) {
        cols[i]->bias = at::Tensor(); // this one has no bias
      }
      cols[i]->options.seq_parallel(true).overlap(true);
      EXPECT_TRUE(cols[i]->overlaps());
    }
    auto xs = x.detach().chunk(world, 1)[rank].clone().requires_grad_();
    const auto before = cbd::collectives_issued();
    const auto ys = sl::forward_shared_input(
        {cols[0].get(), cols[1].get(), cols[2].get()}, xs);
    EXPECT_EQ(cbd::collectives_issued() - before, 1u); // one all-gather
    ASSERT_EQ(ys.size(), 3u);
    EXPECT_NE(
        ys[0].grad_fn()->name().find("OverlapGatherLinears"), std::string::npos)
        << ys[0].grad_fn()->name();
    at::Tensor mine = at::zeros({});
    for (int i = 0; i < 3; ++i) {
      expect_equal(
          ys[i], refs[i].chunk(world, 2)[rank], "output " + std::to_string(i));
      mine = mine +
          (ys[i] * ints(refs[i].sizes(), 30 + i).chunk(world, 2)[rank]).sum();
    }
    const auto before_backward = cbd::collectives_issued();
    mine.backward();
    // One reduce-scatter for the three layers' input gradient.
    EXPECT_EQ(cbd::collectives_issued() - before_backward, 1u);
    expect_equal(xs.grad(), x.grad().chunk(world, 1)[rank], "input gradient");
    for (int i = 0; i < 3; ++i) {
      expect_equal(
          cols[i]->weight.grad(),
          full[i]->weight.grad().chunk(world, 0)[rank],
          "weight gradient " + std::to_string(i));
      if (i != 1) {
        expect_equal(
            cols[i]->bias.grad(),
            full[i]->bias.grad().chunk(world, 0)[rank],
            "bias gradient " + std::to_string(i));
      }
    }
    // One layer alone overlaps the same way through forward().
    cols[0]->zero_grad();
    auto xs0 = x.detach().chunk(world, 1)[rank].clone().requires_grad_();
    auto y0 = cols[0]->forward(xs0);
    expect_equal(y0, refs[0].chunk(world, 2)[rank], "forward() output");
  });
}

TEST(ParallelLayers, RingAndDoubleRingAttentionEqualCausalAttention) {
  // ring_attn over 4 ranks as one ring and as double rings (inner rings of
  // 1 and 2), against causal attention of the whole sequence in float64.
  // Bound: the ring computes in float32 (u = 6e-8). A sum of m terms is off
  // by at most m u times the sum of their sizes; normal draws stay below 5.
  // An output row averages at most T = 32 values of v with weights that sum
  // to 1, after casts, exp, 8-term scores and one rescale per block (<= 8):
  // under 50 u x 5 = 1.5e-5. A gradient sums up to 32 products of sizes
  // <= 5 x 5 over weights <= 1: 50 u x 32 x 25 = 2.4e-3 worst case. A
  // chunk or gradient at the wrong rank, or a block missed, is off by O(1).
  run_distributed(4, [](int rank, int world) {
    auto sp = cd::world_group();
    const int64_t b = 2, h = 2, t = 32, d = 8;
    auto gen = at::detail::createCPUGenerator(41);
    auto q = at::randn({b, h, t, d}, gen, at::kDouble);
    auto k = at::randn({b, h, t, d}, gen, at::kDouble);
    auto v = at::randn({b, h, t, d}, gen, at::kDouble);
    auto w = at::randn({b, h, t, d}, gen, at::kDouble);
    auto qr = q.clone().requires_grad_(), kr = k.clone().requires_grad_(),
         vr = v.clone().requires_grad_();
    auto causal = at::ones({t, t}, at::kBool).triu(1);
    auto ref = at::matmul(
        at::softmax(
            (at::matmul(qr, kr.transpose(-2, -1)) / std::sqrt(double(d)))
                .masked_fill(causal, -INFINITY),
            -1),
        vr);
    (ref * w).sum().backward();

    const auto pos = sl::zigzag_positions(t, world);
    const auto mine = pos[rank];
    auto local = [&](const at::Tensor& x) {
      return x.index_select(2, mine).to(at::kFloat);
    };
    auto close = [&](const at::Tensor& got,
                     const at::Tensor& want,
                     double atol,
                     const std::string& what) {
      const auto diff = (got.to(at::kDouble) - want.index_select(2, mine))
                            .abs()
                            .max()
                            .item<double>();
      EXPECT_LT(diff, atol) << what;
    };
    const int64_t chunk = 2 * b * h * (t / world) * d * 4; // k and v, fp32
    auto bytes = [](const cd::ProcessGroupPtr& g) {
      return g == nullptr ? 0 : g->bytes_communicated();
    };
    for (int inner : {0, 1, 2}) {
      SCOPED_TRACE("inner_ring_size " + std::to_string(inner));
      const auto rings = sl::get_double_ring_groups(sp, inner);
      ASSERT_EQ(rings.defined(), inner != 0);
      auto ql = local(q).requires_grad_(), kl = local(k).requires_grad_(),
           vl = local(v).requires_grad_();
      const int64_t sp0 = bytes(sp), in0 = bytes(rings.inner),
                    out0 = bytes(rings.inter);
      auto y = sl::ring_attention(ql, kl, vl, pos, sp, rings);
      (y * local(w)).sum().backward();
      close(y, ref.detach(), 2e-5, "output");
      close(ql.grad(), qr.grad(), 2.5e-3, "query gradient");
      close(kl.grad(), kr.grad(), 2.5e-3, "key gradient");
      close(vl.grad(), vr.grad(), 2.5e-3, "value gradient");
      // Chunks sent: forward n - 1 hops of the keys and values, backward
      // n - 1 again and n of their gradients; a double ring of I x O sends
      // O (I - 1) of each on the inner ring per pass, the gradients I hops
      // a round there, and O - 1 chunks a pass plus O gradients across.
      if (inner == 0) {
        EXPECT_EQ(bytes(sp) - sp0, (3 * world - 2) * chunk);
      } else {
        const int i = inner, o = world / inner;
        EXPECT_EQ(bytes(sp) - sp0, 0);
        EXPECT_EQ(
            bytes(rings.inner) - in0,
            (2 * o * (i - 1) + (i > 1 ? o * i : 0)) * chunk);
        EXPECT_EQ(bytes(rings.inter) - out0, (2 * (o - 1) + o) * chunk);
      }
    }
    EXPECT_FALSE(sl::get_double_ring_groups(sp, 4).defined()); // one ring
    EXPECT_NE(
        error_of([&]() {
          sl::get_double_ring_groups(sp, 3);
        }).find("inner_ring_size 3 must divide the sequence-parallel size 4"),
        std::string::npos);
  });
}

TEST(ParallelLayers, EmbeddingsEqualTheFullEmbedding) {
  at_tp_2_and_4([](int rank, int world) {
    auto g = cd::world_group();
    const int64_t vocab = 37, dim = 2 * world; // 37: padded, uneven
    torch::nn::Embedding full(vocab, dim);
    {
      torch::NoGradGuard no_grad;
      full->weight.copy_(ints({vocab, dim}, 21));
    }
    auto gen = at::detail::createCPUGenerator(22);
    auto tokens = at::randint(0, vocab, {3, 9}, gen, at::kLong);
    auto up = ints({3, 9, dim}, 23);
    (full(tokens) * up).sum().backward();

    auto split_dim = sl::Embedding1D(sl::Embedding1DImpl::from_full(*full, g));
    auto y = split_dim(tokens);
    expect_equal(y, full(tokens).detach(), "Embedding1D forward");
    (y * up).sum().backward();
    expect_equal(
        split_dim->weight.grad(),
        full->weight.grad().chunk(world, 1)[rank],
        "Embedding1D weight gradient");

    auto vocab_split = sl::VocabParallelEmbedding1D(
        sl::VocabParallelEmbedding1DImpl::from_full(*full, g, 4));
    EXPECT_EQ(
        vocab_split->padded_num_embeddings(),
        sl::padded_vocab_size(vocab, 4, world));
    EXPECT_EQ(vocab_split->padded_num_embeddings() % (4 * world), 0);
    auto z = vocab_split(tokens);
    expect_equal(z, full(tokens).detach(), "VocabParallelEmbedding1D forward");
    (z * up).sum().backward();
    const int64_t rows = vocab_split->weight.size(0);
    const int64_t start = vocab_split->vocab_start();
    const int64_t real =
        std::max<int64_t>(0, std::min<int64_t>(rows, vocab - start));
    auto want = at::zeros({rows, dim});
    if (real > 0) {
      want.narrow(0, 0, real).copy_(full->weight.grad().narrow(0, start, real));
    }
    expect_equal(
        vocab_split->weight.grad(),
        want,
        "VocabParallelEmbedding1D weight gradient (padding rows zero)");
  });
}

TEST(ParallelLayers, VocabParallelHeadAndCrossEntropy) {
  // Logits of a tied vocabulary-parallel head and the cross entropy on the
  // sharded logits, against at::cross_entropy on the full logits: loss,
  // hidden-state gradient and weight gradient. The vocabulary (37) is
  // padded; one target is ignored. Bound: the loss and the softmax differ
  // only by where the V exponentials are summed (per rank, then across
  // ranks), each sum within V * 2^-24 relative of exact; the rest is the
  // same operations: rtol and atol 4 V 2^-24 on values of order one.
  at_tp_2_and_4([](int rank, int world) {
    auto g = cd::world_group();
    const int64_t vocab = 37, dim = 8, n = 11;
    torch::manual_seed(31); // floats: same on every rank
    torch::nn::Embedding wte(vocab, dim);
    auto hidden = torch::randn({n, dim}).requires_grad_();
    auto target = torch::randint(0, vocab, {n}, at::kLong);
    target[3] = -100;
    auto ref = at::cross_entropy_loss(
        at::linear(hidden, wte->weight), target, {}, at::Reduction::Mean, -100);
    ref.backward();

    auto shard = sl::VocabParallelEmbedding1DImpl::from_full(*wte, g, 4);
    auto h = hidden.detach().clone().requires_grad_();
    auto logits = sl::lm_head_logits(h, shard->weight, g);
    EXPECT_EQ(logits.size(1), shard->padded_num_embeddings() / world);
    auto loss = sl::vocab_parallel_cross_entropy(logits, target, g, vocab);
    loss.backward();
    const double tol = 4.0 * vocab * std::ldexp(1.0, -24);
    EXPECT_NEAR(
        loss.item<double>(),
        ref.item<double>(),
        tol * std::abs(ref.item<double>()));
    EXPECT_TRUE(at::allclose(h.grad(), hidden.grad(), tol, tol))
        << (h.grad() - hidden.grad()).abs().max().item<double>();
    const int64_t start = shard->vocab_start();
    const int64_t real = shard->real_rows();
    if (real > 0) {
      auto got = shard->weight.grad().narrow(0, 0, real);
      auto want = wte->weight.grad().narrow(0, start, real);
      EXPECT_TRUE(at::allclose(got, want, tol, tol))
          << (got - want).abs().max().item<double>();
    }
    // The gathered head (parallel_output false) gives the full logits.
    auto full_logits = sl::lm_head_logits(
        hidden.detach(), shard->weight, g, /*gather_output=*/true, vocab);
    EXPECT_TRUE(at::allclose(
        full_logits, at::linear(hidden.detach(), wte->weight), tol, tol));
    auto msg = error_of(
        [&] { sl::vocab_parallel_cross_entropy(logits, target, g, 1000); });
    EXPECT_NE(msg.find("vocab_size"), std::string::npos) << msg;
    (void)rank;
  });
}

TEST(ParallelLayers, VocabParallelFusedLinearCrossEntropy) {
  // The fused head and loss over vocabulary shards (chunks of 4 tokens, so
  // every rank reduces its statistics several times) against
  // at::cross_entropy of the whole head's logits, in float64, where both
  // are exact to its rounding (1e-12 relative; the unfused
  // vocab_parallel_cross_entropy works in float32): loss, hidden-state
  // gradient, the shard's weight gradient (padding rows zero); a target
  // past the vocabulary is refused by name on every rank.
  at_tp_2_and_4([](int rank, int world) {
    auto g = cd::world_group();
    const int64_t vocab = 37, dim = 8, n = 11;
    torch::manual_seed(32); // the same on every rank
    torch::nn::Embedding wte(vocab, dim);
    auto shard = sl::VocabParallelEmbedding1DImpl::from_full(*wte, g, 4);
    shard->to(at::kDouble);
    wte->to(at::kDouble);
    auto hidden = torch::randn({n, dim}, at::kDouble);
    auto target = torch::randint(0, vocab, {n}, at::kLong);
    target[3] = -100;
    target[7] = vocab - 1; // on the last rank, beside its padding rows
    auto href = hidden.clone().requires_grad_();
    auto ref = at::cross_entropy_loss(
        at::linear(href, wte->weight), target, {}, at::Reduction::Mean, -100);
    (ref * 0.5).backward();

    auto h = hidden.clone().requires_grad_();
    auto loss = sl::vocab_parallel_fused_linear_cross_entropy(
        h, shard->weight, target, g, vocab, -100, /*chunk_size=*/4);
    (loss * 0.5).backward();
    auto rel = [](const at::Tensor& a, const at::Tensor& b) {
      return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item<double>();
    };
    EXPECT_LT(rel(loss.detach(), ref.detach()), 1e-12);
    EXPECT_LT(rel(h.grad(), href.grad()), 1e-12);
    const int64_t real = shard->real_rows();
    const auto wg = shard->weight.grad();
    if (real > 0) {
      EXPECT_LT(
          rel(wg.narrow(0, 0, real), wte->weight.grad().narrow(0, shard->vocab_start(), real)),
          1e-12);
    }
    if (real < wg.size(0)) {
      EXPECT_EQ(wg.narrow(0, real, wg.size(0) - real).abs().max().item<double>(), 0.0);
    }
    auto bad = target.clone();
    bad[0] = vocab; // a padding row's index: not a word
    auto msg = error_of([&] {
      sl::vocab_parallel_fused_linear_cross_entropy(hidden, shard->weight, bad, g, vocab);
    });
    EXPECT_NE(msg.find("outside [0, 37)"), std::string::npos) << msg;
    (void)rank;
    (void)world;
  });
}

TEST(ParallelLayers, TokenMeanCarriesTheCountWithTheSums) {
  // Rank r holds r + 1 tokens of per-token loss x * w (w a shared weight):
  // the value is the mean over all tokens, and the gradient averaged over
  // the ranks (as DDP and the sp reduction do) is that mean's gradient,
  // not the mean of the ranks' means. Sums are exact integers; the division
  // by the count rounds once in float (2^-24 relative), the gradient's
  // scale once more and the average once more: 1e-6 relative.
  at_tp_2_and_4([](int rank, int world) {
    auto g = cd::world_group();
    auto w = torch::full({}, 2.0).requires_grad_();
    auto x = ints({rank + 1}, 90 + rank);
    auto loss = colossalai::nn::token_mean(
        (x * w).sum(), torch::tensor(rank + 1), g);
    loss.backward();
    double sum = 0, count = 0;
    for (int r = 0; r < world; ++r) {
      sum += ints({r + 1}, 90 + r).sum().item<double>();
      count += r + 1;
    }
    const double mean = sum / count;
    EXPECT_NEAR(loss.item<double>(), 2.0 * mean, 1e-6 * std::abs(mean) + 1e-6);
    auto grad = w.grad().clone();
    cd::all_reduce(grad, *g).wait();
    EXPECT_NEAR(grad.item<double>() / world, mean, 1e-6 * std::abs(mean) + 1e-6);
    // Nothing counted anywhere: zero, not NaN.
    auto none = colossalai::nn::token_mean(
        (x * w).sum() * 0, torch::tensor(0), g);
    EXPECT_EQ(none.item<double>(), 0.0);
  });
}

TEST(ParallelLayers, DropoutMasksAreSharedWhereReplicatedAndOwnWhereSharded) {
  at_tp_2_and_4([](int rank, int world) {
    auto g = cd::world_group();
    torch::manual_seed(5);
    auto expected_next = torch::rand({4});
    torch::manual_seed(5);
    sl::Dropout replicated(sl::DropoutOptions(0.5).process_group(g));
    sl::Dropout sharded(
        sl::DropoutOptions(0.5).sharded_input(true).process_group(g));
    auto ones = torch::ones({256});
    auto first = replicated(ones);
    auto second = replicated(ones);
    auto own = sharded(ones);
    expect_equal(torch::rand({4}), expected_next, "the global generator");
    // Inverted dropout: kept elements scaled by 1 / (1 - p).
    EXPECT_TRUE(((first == 0) | (first == 2)).all().item<bool>());
    EXPECT_FALSE(at::equal(first, second)) << "the state must advance";
    auto all_replicated = cdf::gather_along_dim(first.unsqueeze(0), 0, g);
    auto all_sharded = cdf::gather_along_dim(own.unsqueeze(0), 0, g);
    for (int r = 0; r < world; ++r) {
      expect_equal(all_replicated[r], first, "replicated mask of a peer");
      if (r != rank) {
        EXPECT_FALSE(at::equal(all_sharded[r], own))
            << "sharded masks of ranks " << r << " and " << rank;
      }
    }
    // Reproducible from the seed; the identity in eval mode.
    sl::Dropout again(sl::DropoutOptions(0.5).process_group(g));
    expect_equal(again(ones), first, "a layer with the same seed");
    replicated->eval();
    expect_equal(replicated(ones), ones, "eval mode");
  });
}

TEST(ParallelLayers, RMSNormMatchesItsDefinition) {
  // Against the definition in float64: the fp32 computation rounds each of
  // its few operations once (mean of 16 squares, rsqrt, two products), so
  // it is within 2^-20 relative.
  torch::manual_seed(3);
  sl::RMSNorm norm(sl::RMSNormOptions(16).eps(1e-5));
  {
    torch::NoGradGuard no_grad;
    norm->weight.uniform_(0.5, 1.5);
  }
  auto x = torch::randn({3, 5, 16});
  auto xd = x.to(at::kDouble);
  auto want = xd / (xd.pow(2).mean(-1, true) + 1e-5).sqrt() *
      norm->weight.to(at::kDouble);
  auto got = norm(x);
  EXPECT_TRUE(at::allclose(got.to(at::kDouble), want, std::ldexp(1.0, -20), 0))
      << (got.to(at::kDouble) - want).abs().max().item<double>();
  EXPECT_EQ(norm(x.to(at::kBFloat16)).scalar_type(), at::kFloat)
      << "bf16 input times the fp32 weight promotes, as in LLaMA";
}

TEST(ParallelLayers, MegatronBlockEqualsTheZooBlock) {
  // The layers compose into a tensor-parallel transformer block: the fused
  // q, k, v projection split per section (each rank its heads), attention
  // on local heads, row-parallel output projection, column / row MLP,
  // LayerNorms replicated. Forward and every gradient equal zoo::Block's.
  // Bound: the row layers add the ranks' partial sums (K <= 4E = 128 terms)
  // in another order than one dot product does; each order is within
  // K * 2^-24 of the exact sum of terms of order one, and LayerNorm and
  // softmax do not amplify that by more than a small factor: rtol and atol
  // 8 K 2^-24 (6e-5).
  at_tp_2_and_4([](int rank, int world) {
    auto g = cd::world_group();
    const auto cfg = colossalai::zoo::GPTConfig::tiny_test().n_head(4);
    const int64_t e = cfg.n_embd();
    torch::manual_seed(41);
    colossalai::zoo::Block full(cfg);
    auto x = torch::randn({2, 8, e}).requires_grad_();
    auto up = torch::randn({2, 8, e});
    (full(x) * up).sum().backward();

    auto qkv = sl::Linear1D_ColImpl::from_full(*full->qkv, g, false, 3);
    auto proj = sl::Linear1D_RowImpl::from_full(*full->proj, g);
    auto fc = sl::Linear1D_ColImpl::from_full(*full->fc, g);
    auto out = sl::Linear1D_RowImpl::from_full(*full->out, g);
    auto ln1 =
        std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(full->ln1->clone());
    auto ln2 =
        std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(full->ln2->clone());
    auto xs = x.detach().clone().requires_grad_();
    auto h = xs +
        proj->forward(colossalai::zoo::causal_attention(
            qkv->forward(ln1->forward(xs)), cfg.n_head() / world));
    auto y = h + out->forward(torch::gelu(fc->forward(ln2->forward(h))));

    const double tol = 8.0 * 4 * e * std::ldexp(1.0, -24);
    auto close = [&](const at::Tensor& got,
                     const at::Tensor& want,
                     const std::string& what) {
      ASSERT_EQ(got.sizes(), want.sizes()) << what;
      EXPECT_TRUE(at::allclose(got, want, tol, tol))
          << what << " differs by " << (got - want).abs().max().item<double>();
    };
    close(y, full(x).detach(), "output");
    (y * up).sum().backward();
    close(xs.grad(), x.grad(), "input gradient");
    std::vector<at::Tensor> sections;
    for (const auto& s : full->qkv->weight.grad().chunk(3, 0)) {
      sections.push_back(s.chunk(world, 0)[rank]);
    }
    close(qkv->weight.grad(), at::cat(sections, 0), "qkv weight gradient");
    close(
        proj->weight.grad(),
        full->proj->weight.grad().chunk(world, 1)[rank],
        "proj weight gradient");
    close(
        fc->weight.grad(),
        full->fc->weight.grad().chunk(world, 0)[rank],
        "fc weight gradient");
    close(
        out->weight.grad(),
        full->out->weight.grad().chunk(world, 1)[rank],
        "out weight gradient");
    close(out->bias.grad(), full->out->bias.grad(), "out bias gradient");
    close(ln1->weight.grad(), full->ln1->weight.grad(), "ln1 (replicated)");
    close(ln2->bias.grad(), full->ln2->bias.grad(), "ln2 (replicated)");
  });
}
