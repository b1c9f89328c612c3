// HybridAdam (CPU) step throughput against torch::optim::AdamW and against
// the memory bandwidth of a plain copy measured in the same run.
//
//   bench_hybrid_adam [--sizes 1,10,30,100] [--threads 2] [--reps 7]
//                     [--isa auto|scalar|avx2|avx512] [--out FILE.json]
//
// Sizes are in millions of fp32 parameters, one flat tensor each (as a ZeRO
// shard is). Optimizer traffic is 28 bytes per parameter: p, g, m, v read and
// p, m, v written. The copy moves 2 x its buffer (read + written) per copy,
// counted the same way (the faster of Tensor::copy_ and a threaded memcpy);
// neither counts the extra read a cache-missing store causes. Reported
// times are medians over --reps steps after two warm-ups.

#include <colossalai/nn/optimizer/hybrid_adam.h>

#include "bench_util.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace opt = colossalai::nn::optimizer;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double time_median(int reps, F&& f) {
  f();
  f(); // warm-ups: first-touch page faults, state allocation
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count());
  }
  return median(t);
}

std::vector<double> parse_list(const std::string& s) {
  std::vector<double> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    out.push_back(std::stod(item));
  }
  return out;
}

struct Result {
  int64_t n;
  double ours_s, ours_bf16_s, torch_s;
};

} // namespace

int main(int argc, char** argv) {
  std::vector<double> sizes = {1, 10, 30, 100};
  int threads = 2;
  int reps = 7;
  std::string isa = "auto";
  std::string out;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--sizes") {
      sizes = parse_list(v);
    } else if (k == "--threads") {
      threads = std::stoi(v);
    } else if (k == "--reps") {
      reps = std::stoi(v);
    } else if (k == "--isa") {
      isa = v;
    } else if (k == "--out") {
      out = v;
    } else {
      TORCH_CHECK(false, "unknown option ", k);
    }
  }
  at::set_num_threads(threads);
  if (isa == "scalar") {
    opt::set_cpu_adam_isa(opt::CpuAdamIsa::kScalar);
  } else if (isa == "avx2") {
    opt::set_cpu_adam_isa(opt::CpuAdamIsa::kAvx2);
  } else if (isa == "avx512") {
    opt::set_cpu_adam_isa(opt::CpuAdamIsa::kAvx512);
  } else {
    TORCH_CHECK(isa == "auto", "--isa must be auto, scalar, avx2 or avx512");
  }
  torch::NoGradGuard no_grad;

  // Copy bandwidth on a buffer well beyond the caches (the largest case's
  // parameter tensor, at least 256 MB): Tensor::copy_ and a memcpy split
  // over the same threads; the faster one is the reference.
  const int64_t max_n =
      static_cast<int64_t>(*std::max_element(sizes.begin(), sizes.end()) * 1e6);
  double tensor_copy_GBps = 0;
  double memcpy_GBps = 0;
  {
    const int64_t n = std::max<int64_t>(max_n, 64 << 20);
    auto src = torch::rand({n});
    auto dst = torch::empty({n});
    const double t = time_median(reps, [&] { dst.copy_(src); });
    tensor_copy_GBps = 2.0 * n * 4 / t / 1e9;
    const char* from = static_cast<const char*>(src.data_ptr());
    char* to = static_cast<char*>(dst.data_ptr());
    const double t2 = time_median(reps, [&] {
      at::parallel_for(0, n * 4, 1 << 20, [&](int64_t b, int64_t e) {
        std::memcpy(to + b, from + b, e - b);
      });
    });
    memcpy_GBps = 2.0 * n * 4 / t2 / 1e9;
    std::fprintf(
        stderr,
        "copy of %.1f MB: Tensor::copy_ %.1f GB/s, memcpy %.1f GB/s\n",
        n * 4 / 1e6,
        tensor_copy_GBps,
        memcpy_GBps);
  }
  const double copy_GBps = std::max(tensor_copy_GBps, memcpy_GBps);

  // The limit of an in-place update: a read-modify-write stream with the
  // optimizer's traffic (p, g, m, v read; p, m, v written back in place, 28
  // bytes a parameter) and almost no arithmetic. A copy into a separate
  // buffer is not the limit: its stores miss and pay a read for ownership
  // that in-place stores do not, so an in-place optimizer can beat "copy".
  double rmw_GBps = 0;
  {
    const int64_t n = std::max<int64_t>(max_n, 16 << 20);
    auto p = torch::rand({n}), g = torch::rand({n}), m = torch::rand({n}),
         v = torch::rand({n});
    // __restrict: the four streams never alias, so the loop vectorizes.
    float* __restrict pp = p.data_ptr<float>();
    const float* __restrict gp = g.data_ptr<float>();
    float* __restrict mp = m.data_ptr<float>();
    float* __restrict vp = v.data_ptr<float>();
    const double t = time_median(reps, [&] {
      at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const float gi = gp[i];
          const float mi = 0.9f * mp[i] + gi;
          const float vi = 0.999f * vp[i] + gi;
          mp[i] = mi;
          vp[i] = vi;
          pp[i] = pp[i] - 1e-3f * mi + 1e-3f * vi;
        }
      });
    });
    rmw_GBps = 28.0 * n / t / 1e9;
    std::fprintf(
        stderr,
        "in-place read-modify-write stream of %.1f M params: %.1f GB/s\n",
        n / 1e6,
        rmw_GBps);
  }

  std::vector<Result> results;
  for (double m : sizes) {
    Result r{static_cast<int64_t>(m * 1e6), 0, 0, 0};
    torch::manual_seed(0);
    {
      auto p = torch::randn({r.n});
      p.mutable_grad() = torch::randn({r.n});
      opt::HybridAdam ours(
          {p}, opt::HybridAdamOptions(1e-3).weight_decay(0.01));
      r.ours_s = time_median(reps, [&] { ours.step(); });
      // The ZeRO layout: bf16 working copy written in the same pass.
      auto working = torch::empty({r.n}, torch::kBFloat16);
      ours.set_working_copy(p, working);
      r.ours_bf16_s = time_median(reps, [&] { ours.step(); });
    }
    {
      auto p = torch::randn({r.n});
      p.mutable_grad() = torch::randn({r.n});
      torch::optim::AdamW theirs({p}, torch::optim::AdamWOptions(1e-3));
      r.torch_s = time_median(reps, [&] { theirs.step(); });
    }
    std::fprintf(
        stderr,
        "%.0fM: ours %.2f ms, +bf16 copy %.2f ms, AdamW %.2f ms\n",
        m,
        r.ours_s * 1e3,
        r.ours_bf16_s * 1e3,
        r.torch_s * 1e3);
    results.push_back(r);
  }

  std::ostringstream json;
  json << "{\n  \"benchmark\": \"hybrid_adam\",\n  \"machine\": "
       << colossalai::bench::machine_json()
       << ",\n  \"peak_rss_bytes\": " << colossalai::bench::peak_rss_bytes()
       << ",\n  \"threads\": " << threads << ",\n  \"isa\": \""
       << opt::to_string(opt::cpu_adam_isa()) << "\",\n  \"reps\": " << reps
       << ",\n  \"bytes_per_param\": 28"
       << ",\n  \"tensor_copy_GBps\": " << tensor_copy_GBps
       << ",\n  \"memcpy_GBps\": " << memcpy_GBps
       << ",\n  \"copy_GBps\": " << copy_GBps
       << ",\n  \"rmw_GBps\": " << rmw_GBps << ",\n  \"cases\": [";
  std::printf(
      "| params | HybridAdam ms | params/s | GB/s | of in-place stream | of "
      "copy | +bf16 copy ms | AdamW ms | AdamW GB/s | speedup |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const double ours_GBps = 28.0 * r.n / r.ours_s / 1e9;
    const double bf16_GBps = 30.0 * r.n / r.ours_bf16_s / 1e9;
    const double torch_GBps = 28.0 * r.n / r.torch_s / 1e9;
    json << (i ? "," : "") << "\n    {\"params\": " << r.n
         << ", \"hybrid_adam_s\": " << r.ours_s
         << ", \"hybrid_adam_params_per_s\": " << r.n / r.ours_s
         << ", \"hybrid_adam_GBps\": " << ours_GBps
         << ", \"fraction_of_copy\": " << ours_GBps / copy_GBps
         << ", \"fraction_of_rmw\": " << ours_GBps / rmw_GBps
         << ", \"hybrid_adam_bf16_copy_s\": " << r.ours_bf16_s
         << ", \"hybrid_adam_bf16_copy_GBps\": " << bf16_GBps
         << ", \"torch_adamw_s\": " << r.torch_s
         << ", \"torch_adamw_GBps\": " << torch_GBps
         << ", \"speedup_vs_torch\": " << r.torch_s / r.ours_s << "}";
    std::printf(
        "| %.0fM | %.2f | %.3g | %.1f | %.0f%% | %.0f%% | %.2f | %.2f | %.1f | "
        "%.2fx |\n",
        r.n / 1e6,
        r.ours_s * 1e3,
        r.n / r.ours_s,
        ours_GBps,
        100 * ours_GBps / rmw_GBps,
        100 * ours_GBps / copy_GBps,
        r.ours_bf16_s * 1e3,
        r.torch_s * 1e3,
        torch_GBps,
        r.torch_s / r.ours_s);
  }
  std::printf(
      "| in-place stream | | | %.1f | 100%% | | | | | |\n"
      "| copy | | | %.1f | | 100%% | | | | |\n",
      rmw_GBps,
      copy_GBps);
  json << "\n  ]\n}\n";
  std::cout << json.str();
  if (!out.empty()) {
    std::ofstream(out) << json.str();
  }
  return 0;
}
