// Ring attention alone: one ring against double rings (inner_ring_size) on
// the same sequence-parallel ranks, forward and backward of causal attention
// of B x H x T tokens (fp32, 1 thread per rank). Meant across hosts
// (bench/netns_link.sh with NPROC_PER_NODE ranks per node), where the
// double ring keeps each inner ring on a host.
//
// Per setup: time of one forward + backward (rank 0, from a barrier to a
// barrier: every rank waits for the ring's slowest hop), median and p10 /
// p90 over every timed iteration, ratio to the one ring; bytes each rank
// sends per iteration on the inner ring and across (the inter ring, or the
// whole ring for one ring). Setups alternate round by round, so their
// ratio compares like with like on a noisy machine.
//
//   bench_ring_attention [--nproc 4] [--batch 4] [--heads 8] [--seq 1024]
//                        [--dim 64] [--inner 0,2] [--rounds 5] [--iters 3]
//                        [--out FILE.json]
//
// --inner: the inner ring sizes to compare (0: one ring); each must divide
// the world size.

#include "bench_launch.h"
#include "bench_util.h"

#include <colossalai/colossalai.h>
#include <colossalai/shardformer/layer/ring_attention.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

namespace cd = colossalai::distributed;
namespace sl = colossalai::shardformer::layer;
using colossalai::bench::median;
using colossalai::bench::percentile;

namespace {

struct Options {
  int64_t batch = 4, heads = 8, seq = 1024, dim = 64;
  std::string inner = "0,2";
  int rounds = 5, iters = 3;
  std::string out;
};

struct Setup {
  int inner = 0;
  sl::DoubleRing rings;
  std::vector<double> ms;
  int64_t inner_bytes = 0, across_bytes = 0; // per iteration, this rank
};

int64_t bytes_of(const cd::ProcessGroupPtr& g) {
  return g == nullptr ? 0 : g->bytes_communicated();
}

int run_rank(const Options& o) {
  colossalai::launch_from_env();
  at::set_num_threads(1);
  auto sp = cd::world_group();
  const int n = sp->size(), r = sp->rank();
  TORCH_CHECK(
      o.seq % (2 * n) == 0,
      "--seq ",
      o.seq,
      " must divide by 2 x the ranks (",
      2 * n,
      ")");
  const auto pos = sl::zigzag_positions(o.seq, n);
  const int64_t local = o.seq / n;
  auto gen = at::detail::createCPUGenerator(1000 + r);
  auto make = [&]() {
    return at::randn({o.batch, o.heads, local, o.dim}, gen);
  };
  auto q = make().requires_grad_(), k = make().requires_grad_(),
       v = make().requires_grad_();
  const auto w = make();

  std::vector<Setup> setups;
  for (const auto& s : colossalai::bench::split(o.inner)) {
    Setup setup;
    setup.inner = std::stoi(s);
    setup.rings = sl::get_double_ring_groups(sp, setup.inner);
    setups.push_back(std::move(setup));
  }
  auto pass = [&](Setup& s) {
    q.mutable_grad().reset();
    k.mutable_grad().reset();
    v.mutable_grad().reset();
    auto y = sl::ring_attention(q, k, v, pos, sp, s.rings);
    (y * w).sum().backward();
  };
  for (auto& s : setups) {
    pass(s); // warm-up: connections, allocator
  }
  for (int round = 0; round < o.rounds; ++round) {
    for (auto& s : setups) {
      const int64_t sp0 = bytes_of(sp), in0 = bytes_of(s.rings.inner),
                    out0 = bytes_of(s.rings.inter);
      for (int i = 0; i < o.iters; ++i) {
        cd::barrier(*sp).wait();
        const auto t0 = std::chrono::steady_clock::now();
        pass(s);
        cd::barrier(*sp).wait();
        s.ms.push_back(std::chrono::duration<double, std::milli>(
                           std::chrono::steady_clock::now() - t0)
                           .count());
      }
      // The barriers' own bytes (a few per iteration) are not subtracted:
      // they are 4 bytes against megabytes.
      const int64_t in = s.rings.defined() ? bytes_of(s.rings.inner) - in0 : 0,
                    across = s.rings.defined() ? bytes_of(s.rings.inter) - out0
                                               : bytes_of(sp) - sp0;
      s.inner_bytes = in / o.iters;
      s.across_bytes = across / o.iters;
    }
    if (r == 0) {
      std::fprintf(stderr, "round %d/%d done\n", round + 1, o.rounds);
    }
  }
  if (r != 0) {
    return 0;
  }
  const double base = median(setups[0].ms);
  std::printf(
      "ring attention, %d ranks, B %lld x H %lld x T %lld x D %lld (chunk %lld "
      "tokens per rank), fp32\n",
      n,
      static_cast<long long>(o.batch),
      static_cast<long long>(o.heads),
      static_cast<long long>(o.seq),
      static_cast<long long>(o.dim),
      static_cast<long long>(local));
  std::printf(
      "| inner_ring_size | fwd+bwd ms (median) | p10 | p90 | vs first | "
      "bytes/iter inner ring | bytes/iter across |\n"
      "|---|---|---|---|---|---|---|\n");
  std::ostringstream json;
  json << "{\n  \"bench\": \"ring_attention\", \"ranks\": " << n
       << ", \"batch\": " << o.batch << ", \"heads\": " << o.heads
       << ", \"seq\": " << o.seq << ", \"dim\": " << o.dim
       << ",\n  \"machine\": " << colossalai::bench::machine_json()
       << ",\n  \"setups\": [";
  for (size_t i = 0; i < setups.size(); ++i) {
    const auto& s = setups[i];
    const double m = median(s.ms);
    std::printf(
        "| %s | %.1f | %.1f | %.1f | %.2fx | %lld | %lld |\n",
        s.rings.defined() ? std::to_string(s.inner).c_str() : "one ring",
        m,
        percentile(s.ms, 0.1),
        percentile(s.ms, 0.9),
        m / base,
        static_cast<long long>(s.inner_bytes),
        static_cast<long long>(s.across_bytes));
    json << (i ? ",\n" : "\n") << "    {\"inner_ring_size\": " << s.inner
         << ", \"double_ring\": " << (s.rings.defined() ? "true" : "false")
         << ", \"ms\": " << colossalai::bench::stats_json(s.ms)
         << ", \"vs_first\": " << m / base
         << ", \"inner_bytes_per_iter\": " << s.inner_bytes
         << ", \"across_bytes_per_iter\": " << s.across_bytes << "}";
  }
  json << "\n  ]\n}\n";
  if (!o.out.empty()) {
    std::ofstream(o.out) << json.str();
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  int nproc = 4;
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--nproc")
      nproc = std::stoi(v);
    else if (k == "--batch")
      o.batch = std::stoll(v);
    else if (k == "--heads")
      o.heads = std::stoll(v);
    else if (k == "--seq")
      o.seq = std::stoll(v);
    else if (k == "--dim")
      o.dim = std::stoll(v);
    else if (k == "--inner")
      o.inner = v;
    else if (k == "--rounds")
      o.rounds = std::stoi(v);
    else if (k == "--iters")
      o.iters = std::stoi(v);
    else if (k == "--out")
      o.out = v;
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  return colossalai::bench::launch_ranks(
      nproc, argc, argv, [&] { return run_rank(o); });
}
