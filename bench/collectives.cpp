// Communication microbenchmark of the collective layer, reported the way
// nccl-tests reports collectives: for each operation and message size, the
// time of one operation (the slowest rank's, median over repetitions),
// algorithm bandwidth (size / time) and bus bandwidth (algbw times the
// operation's bus factor, so that every operation reads against the same
// link speed):
//
//   all_reduce      2(n-1)/n   size = the tensor
//   all_gather       (n-1)/n   size = the gathered output
//   reduce_scatter   (n-1)/n   size = the input being reduced
//   all_to_all       (n-1)/n   size = the data each rank holds
//   broadcast            1     size = the tensor
//   send_recv            1     size = what each rank sends (rank r sends to
//                              r+1 and receives from r-1 at the same time)
//
// Each operation runs through our layer (colossalai::distributed) and, where
// c10d's own backend has it, through the backend directly; the two are timed
// in alternating blocks so that their ratio compares like with like. fp32.
//
//   bench_collectives [--nproc 2] [--quick] [--min-bytes 4096]
//                     [--max-bytes 268435456] [--factor 2] [--reps 5]
//                     [--block-ms 50] [--ops all_reduce,...] [--out FILE.json]

#include "bench_util.h"

#include <colossalai/colossalai.h>

// The raw c10d backend, to time it beside our layer.
#include "../src/distributed/backend.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>

namespace cd = colossalai::distributed;
namespace cbench = colossalai::bench;

namespace {

// `s` inside a JSON string: quotes and backslashes escaped.
std::string json_text(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
    }
    out += c;
  }
  return out;
}

} // namespace

namespace {

struct Args {
  int nproc = 2;
  int64_t min_bytes = 4096;
  int64_t max_bytes = 256LL << 20;
  int factor = 2;
  int reps = 5;
  double block_ms = 50; // target length of one timed block
  std::string ops =
      "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,send_recv";
  bool quick = false;
  std::string out;
};

Args parse(int argc, char** argv) {
  Args a;
  bool max_set = false, factor_set = false, reps_set = false, block_set = false;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k == "--quick") {
      a.quick = true;
      continue;
    }
    TORCH_CHECK(i + 1 < argc, "option ", k, " needs a value");
    std::string v = argv[++i];
    if (k == "--nproc") {
      a.nproc = std::stoi(v);
    } else if (k == "--min-bytes") {
      a.min_bytes = std::stoll(v);
    } else if (k == "--max-bytes") {
      a.max_bytes = std::stoll(v);
      max_set = true;
    } else if (k == "--factor") {
      a.factor = std::stoi(v);
      factor_set = true;
    } else if (k == "--reps") {
      a.reps = std::stoi(v);
      reps_set = true;
    } else if (k == "--block-ms") {
      a.block_ms = std::stod(v);
      block_set = true;
    } else if (k == "--ops") {
      a.ops = v;
    } else if (k == "--out") {
      a.out = v;
    } else {
      TORCH_CHECK(false, "unknown option ", k);
    }
  }
  if (a.quick) {
    // Fewer, smaller sizes and shorter blocks: the whole sweep in ~1 minute.
    if (!max_set)
      a.max_bytes = 16LL << 20;
    if (!factor_set)
      a.factor = 4;
    if (!reps_set)
      a.reps = 3;
    if (!block_set)
      a.block_ms = 15;
  }
  TORCH_CHECK(a.factor >= 2, "--factor must be at least 2");
  TORCH_CHECK(a.reps >= 1, "--reps must be positive");
  return a;
}

using colossalai::bench::split;

// One operation at one size: our call and (when c10d has it) the backend's.
struct Case {
  std::function<void()> ours;
  std::function<void()> c10d; // empty: no c10d equivalent
  std::string c10d_call;      // what the c10d side calls
  // Other operations on the same tensor, timed in the same alternating
  // blocks (reduce_scatter: the all_reduce it should beat, the all_to_all
  // that moves the same bytes), so their ratios compare like with like.
  std::vector<std::pair<std::string, std::function<void()>>> refs;
  double bus_factor = 1;
  int64_t bytes = 0; // nccl-tests "size"
};

Case make_case(
    const std::string& op,
    int64_t bytes,
    const cd::ProcessGroup& g) {
  const int n = g.size(), rank = g.rank();
  auto& backend = colossalai::distributed::detail::backend(g);
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  // Element count: a multiple of n so every rank's block is the same size.
  int64_t count = std::max<int64_t>(bytes / 4 / n, 1) * n;
  Case c;
  c.bytes = count * 4;
  const double nd = n;
  if (op == "all_reduce") {
    auto t = at::ones({count}, f32);
    c.bus_factor = 2 * (nd - 1) / nd;
    c.ours = [t, &g]() mutable { cd::all_reduce(t, g).wait(); };
    c.c10d = [t, &backend]() {
      std::vector<at::Tensor> ts{t};
      backend.allreduce(ts)->wait();
    };
    c.c10d_call = "allreduce";
  } else if (op == "all_gather") {
    auto out = at::empty({count}, f32);
    auto in = at::ones({count / n}, f32);
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int r = 0; r < n; ++r)
      outs[0].push_back(at::empty({count / n}, f32));
    c.bus_factor = (nd - 1) / nd;
    c.ours = [out, in, &g]() mutable { cd::all_gather(out, in, g).wait(); };
    c.c10d = [outs, in, &backend]() mutable {
      std::vector<at::Tensor> ins{in};
      backend.allgather(outs, ins)->wait();
    };
    c.c10d_call = "allgather (list of n outputs)";
  } else if (op == "reduce_scatter") {
    auto in = at::ones({count}, f32);
    auto out = at::empty({count / n}, f32);
    c.bus_factor = (nd - 1) / nd;
    c.ours = [out, in, &g]() mutable { cd::reduce_scatter(out, in, g).wait(); };
    // c10d's Gloo backend may not have reduce_scatter (1.13 does not): probe
    // it once; every rank throws the same way before any communication.
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> ins(1);
    for (int r = 0; r < n; ++r)
      ins[0].push_back(in.narrow(0, r * (count / n), count / n));
    auto call = [outs, ins, &backend]() mutable {
      backend.reduce_scatter(outs, ins)->wait();
    };
    try {
      call();
      c.c10d = call;
      c.c10d_call = "reduce_scatter";
    } catch (const std::exception&) {
      c.c10d_call = "none (backend lacks reduce_scatter)";
    }
    auto whole = at::ones({count}, f32);
    auto moved = at::empty({count}, f32);
    c.refs.emplace_back("all_reduce", [whole, &g]() mutable {
      cd::all_reduce(whole, g).wait();
    });
    c.refs.emplace_back("all_to_all", [in, moved, &g]() mutable {
      cd::all_to_all(moved, in, g).wait();
    });
  } else if (op == "all_to_all") {
    auto in = at::ones({count}, f32);
    auto out = at::empty({count}, f32);
    c.bus_factor = (nd - 1) / nd;
    c.ours = [out, in, &g]() mutable { cd::all_to_all(out, in, g).wait(); };
    c.c10d = [out, in, &backend]() mutable {
      std::vector<int64_t> none;
      backend.alltoall_base(out, in, none, none)->wait();
    };
    c.c10d_call = "alltoall_base";
  } else if (op == "broadcast") {
    auto t = at::ones({count}, f32);
    c.bus_factor = 1;
    c.ours = [t, &g]() mutable { cd::broadcast(t, 0, g).wait(); };
    c.c10d = [t, &backend]() {
      std::vector<at::Tensor> ts{t};
      backend.broadcast(ts)->wait();
    };
    c.c10d_call = "broadcast";
  } else if (op == "send_recv") {
    auto s = at::ones({count}, f32);
    auto r = at::empty({count}, f32);
    const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
    c.bus_factor = 1;
    c.ours = [s, r, next, prev, &g]() mutable {
      auto ws = cd::send(s, next, g);
      auto wr = cd::recv(r, prev, g);
      ws.wait();
      wr.wait();
    };
    c.c10d = [s, r, next, prev, &backend]() {
      std::vector<at::Tensor> ss{s}, rs{r};
      auto ws = backend.send(ss, next, 0);
      auto wr = backend.recv(rs, prev, 0);
      ws->wait();
      wr->wait();
    };
    c.c10d_call = "send + recv";
  } else {
    TORCH_CHECK(false, "unknown operation ", op);
  }
  return c;
}

// Element-wise maximum over the ranks (the slowest rank's time).
std::vector<double> max_over_ranks(
    const std::vector<double>& v,
    const cd::ProcessGroup& g) {
  auto t = at::tensor(v, at::kDouble);
  cd::all_reduce(t, g, cd::ReduceOp::kMax).wait();
  return std::vector<double>(
      t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now() - t0)
      .count();
}

std::string side_json(const std::vector<double>& us, double bytes, double bus) {
  const double med = cbench::median(us);
  const double algbw = bytes / (med * 1e-6) / 1e9;
  std::ostringstream os;
  os << "{\"time_us\": " << cbench::stats_json(us)
     << ", \"algbw_GBps\": " << algbw << ", \"busbw_GBps\": " << algbw * bus
     << "}";
  return os.str();
}

int run_rank(const Args& a) {
  colossalai::launch_from_env();
  at::set_num_threads(1);
  auto group = cd::world_group();
  const auto& g = *group;
  const int rank = g.rank(), n = g.size();
  if (rank == 0) {
    std::printf(
        "# %d ranks, fp32, time = slowest rank, median of %d blocks\n"
        "# %-15s %11s %6s %11s %9s %9s %11s %9s %7s\n",
        n,
        a.reps,
        "op",
        "size(B)",
        "iters",
        "ours(us)",
        "algbw",
        "busbw",
        "c10d(us)",
        "busbw",
        "ratio");
    std::fflush(stdout);
  }
  std::ostringstream results;
  bool first = true;
  for (const auto& op : split(a.ops)) {
    for (int64_t bytes = a.min_bytes; bytes <= a.max_bytes; bytes *= a.factor) {
      Case c = make_case(op, bytes, g);
      const int warmup = bytes >= (64LL << 20) ? 1 : 3;
      for (int w = 0; w < warmup; ++w) {
        c.ours();
        if (c.c10d)
          c.c10d();
      }
      // Iterations per block so a block lasts about block_ms on every rank.
      cd::barrier(g).wait();
      auto t0 = std::chrono::steady_clock::now();
      c.ours();
      double once = max_over_ranks({ms_since(t0)}, g)[0];
      const int iters = static_cast<int>(
          std::clamp(a.block_ms / std::max(once, 1e-3), 1.0, 2000.0));

      // Sides: ours, c10d's, then the references; each rep rotates which
      // goes first.
      std::vector<std::function<void()>> sides{c.ours};
      if (c.c10d)
        sides.push_back(c.c10d);
      for (const auto& ref : c.refs)
        sides.push_back(ref.second);
      std::vector<std::vector<double>> us(sides.size());
      for (auto& f : sides)
        f(); // the references warm up too
      for (int r = 0; r < a.reps; ++r) {
        for (size_t k = 0; k < sides.size(); ++k) {
          const size_t side = (k + r) % sides.size();
          cd::barrier(g).wait();
          auto s0 = std::chrono::steady_clock::now();
          for (int i = 0; i < iters; ++i)
            sides[side]();
          us[side].push_back(ms_since(s0) * 1e3 / iters);
        }
      }
      for (auto& v : us)
        v = max_over_ranks(v, g);
      std::vector<double> ours_us = us[0], c10d_us;
      if (c.c10d)
        c10d_us = us[1];
      std::ostringstream refs_json;
      const size_t first_ref = c.c10d ? 2 : 1;
      for (size_t k = 0; k < c.refs.size(); ++k) {
        const double med = cbench::median(us[first_ref + k]);
        refs_json << (k ? ", " : "") << "\"" << c.refs[k].first
                  << "\": {\"time_us\": "
                  << cbench::stats_json(us[first_ref + k])
                  << ", \"ours_over_this_time\": "
                  << cbench::median(ours_us) / med << "}";
      }
      if (rank != 0)
        continue;
      const double bytes_d = static_cast<double>(c.bytes);
      const double ours_med = cbench::median(ours_us);
      const double ours_bus = bytes_d / (ours_med * 1e-6) / 1e9 * c.bus_factor;
      results << (first ? "" : ",") << "\n    {\"op\": \"" << op
              << "\", \"bytes\": " << c.bytes << ", \"iters\": " << iters
              << ", \"same_tensor\": {" << refs_json.str() << "}"
              << ", \"bus_factor\": " << c.bus_factor << ", \"c10d_call\": \""
              << c.c10d_call << "\",\n     \"ours\": "
              << side_json(ours_us, bytes_d, c.bus_factor)
              << ",\n     \"c10d\": ";
      first = false;
      if (c10d_us.empty()) {
        results << "null}";
        std::printf(
            "  %-15s %11lld %6d %11.1f %9.3f %9.3f %11s %9s %7s\n",
            op.c_str(),
            static_cast<long long>(c.bytes),
            iters,
            ours_med,
            ours_bus / c.bus_factor,
            ours_bus,
            "-",
            "-",
            "-");
      } else {
        const double c10d_med = cbench::median(c10d_us);
        results << side_json(c10d_us, bytes_d, c.bus_factor)
                << ", \"ours_over_c10d_time\": " << ours_med / c10d_med << "}";
        std::printf(
            "  %-15s %11lld %6d %11.1f %9.3f %9.3f %11.1f %9.3f %7.2f\n",
            op.c_str(),
            static_cast<long long>(c.bytes),
            iters,
            ours_med,
            ours_bus / c.bus_factor,
            ours_bus,
            c10d_med,
            bytes_d / (c10d_med * 1e-6) / 1e9 * c.bus_factor,
            ours_med / c10d_med);
      }
      std::fflush(stdout);
    }
  }

  auto rss = at::empty({n}, at::kDouble);
  auto mine =
      at::tensor({static_cast<double>(cbench::peak_rss_bytes())}, at::kDouble);
  cd::all_gather(rss, mine, g).wait();
  if (rank != 0)
    return 0;
  std::ostringstream json;
  json << "{\n  \"benchmark\": \"collectives\",\n  \"world_size\": " << n
       << ",\n  \"config\": {\"dtype\": \"fp32\", \"reps\": " << a.reps
       << ", \"block_ms\": " << a.block_ms << ", \"min_bytes\": " << a.min_bytes
       << ", \"max_bytes\": " << a.max_bytes << ", \"factor\": " << a.factor
       << ", \"quick\": " << (a.quick ? "true" : "false")
       << ", \"backend\": \"gloo\", \"threads_per_rank\": 1"
       << ", \"shared_memory\": "
       << (g.transport().name == "shared memory" ? "true" : "false")
       << ", \"transport\": \"" << g.transport().name
       << "\", \"transport_reason\": \"" << json_text(g.transport().reason)
       << "\", \"time\": \"per operation, slowest rank, over blocks\"},"
       << "\n  \"machine\": " << cbench::machine_json()
       << ",\n  \"peak_rss_bytes_per_rank\": [";
  for (int r = 0; r < n; ++r)
    json << (r ? ", " : "") << static_cast<int64_t>(rss[r].item<double>());
  json << "],\n  \"results\": [" << results.str() << "\n  ]\n}\n";
  if (!a.out.empty()) {
    std::ofstream(a.out) << json.str();
    std::printf("# wrote %s\n", a.out.c_str());
  } else {
    std::cout << json.str();
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    Args a = parse(argc, argv);
    if (!colossalai::launcher::launched_by_launcher()) {
      return colossalai::launcher::run_self(a.nproc, argc, argv);
    }
    return run_rank(a);
  } catch (const std::exception& e) {
    std::cerr << "error: " << cd::error_text(e) << std::endl;
    return 1;
  }
}
