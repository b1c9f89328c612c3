// Loading a Hugging Face directory at scale: writes a LLaMA directory of a
// workload's shape with random weights (bf16 safetensors, 5 GB shards and
// an index, as transformers saves them), then, in fresh processes and
// alternating, times a plain read of its files (through a reused buffer,
// and into one new allocation of their size, whose page faults any loader
// pays too) and models::from_pretrained in bf16 (a lazy build, each tensor read from the mapped file into its
// bf16 parameter). Reports load time over read time and the loader's host
// peak over the model's bytes, both above what the process held before:
// VmHWM (resident pages, counting the mapped files' pages the load
// touches) and the peak of anonymous memory (what the process allocates;
// sampled every 2 ms). Each round measures with the
// files in the page cache (warm) and after posix_fadvise(DONTNEED) on them
// (cold, as far as the kernel drops them).
//
//   bench_load_pretrained [--model llama-1b|llama2-7b|llama3-8b|llama-small-cpu]
//                         [--layers N] [--dir DIR] [--rounds 3] [--keep]
//                         [--out FILE.json]
//
// --layers overrides the workload's layer count (a scaled-down model of
// the same shapes). --dir is where the directory is written (default: a
// fresh folder under the system's temporary directory, removed at the end
// unless --keep).

#include <colossalai/lazy/lazy_init.h>
#include <colossalai/models/pretrained.h>

#include "bench_util.h"
#include "llama_workloads.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

namespace cbench = colossalai::bench;
namespace models = colossalai::models;
namespace fs = std::filesystem;

namespace {

std::vector<fs::path> weight_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") {
      files.push_back(e.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Drops the files' clean pages from the page cache where the kernel lets
// an unprivileged process.
void drop_cached(const fs::path& dir) {
  for (const auto& f : weight_files(dir)) {
    const int fd = ::open(f.c_str(), O_RDONLY);
    if (fd >= 0) {
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }
}

// One measurement in this (fresh) process: prints one JSON object.
int phase(const std::string& what, const fs::path& dir) {
  const auto base_anon = cbench::proc_kb("/proc/self/status", "RssAnon:");
  const auto base_rss = cbench::proc_kb("/proc/self/status", "VmRSS:");
  cbench::PeakSampler sampler(
      [] { return cbench::proc_kb("/proc/self/status", "RssAnon:"); },
      std::chrono::milliseconds(2));
  const auto t0 = std::chrono::steady_clock::now();
  int64_t bytes = 0;
  if (what == "read" || what == "read_fresh") {
    // "read": through one reused 16 MiB buffer (the files' bytes alone);
    // "read_fresh": into one new allocation of their size, as any loader's
    // destination is (its pages are faulted in as the read fills them).
    int64_t total = 0;
    for (const auto& f : weight_files(dir)) {
      total += static_cast<int64_t>(fs::file_size(f));
    }
    const bool fresh = what == "read_fresh";
    auto dest = at::empty({fresh ? total : int64_t(16) << 20}, at::kByte);
    char* base = static_cast<char*>(dest.data_ptr());
    const size_t chunk = size_t(16) << 20;
    for (const auto& f : weight_files(dir)) {
      const int fd = ::open(f.c_str(), O_RDONLY);
      TORCH_CHECK(fd >= 0, "cannot open ", f.string());
      for (ssize_t n; (n = ::read(fd, base + (fresh ? bytes : 0), chunk)) > 0;) {
        bytes += n;
      }
      ::close(fd);
    }
  } else {
    auto model = models::from_pretrained<models::LlamaForCausalLM>(
        dir.string(), models::FromPretrainedOptions().dtype(at::kBFloat16));
    for (const auto& p : model->parameters()) {
      bytes += p.numel() * p.element_size();
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto anon = sampler.peak();
  std::cout << "{\"seconds\": " << seconds << ", \"bytes\": " << bytes
            << ", \"hwm_bytes\": " << cbench::peak_rss_bytes() - base_rss
            << ", \"anon_peak_bytes\": " << anon << ", \"anon_base_bytes\": " << base_anon
            << "}" << std::endl;
  return 0;
}

double field(const std::string& json, const std::string& key) {
  const auto at = json.find("\"" + key + "\": ");
  TORCH_CHECK(at != std::string::npos, "no ", key, " in ", json);
  return std::stod(json.substr(at + key.size() + 4));
}

} // namespace

int main(int argc, char** argv) {
  std::string model = "llama-1b", dir_arg, out;
  int64_t layers = 0;
  int rounds = 3;
  bool keep = false;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string k = argv[i];
      if (k == "--keep") {
        keep = true;
        continue;
      }
      TORCH_CHECK(i + 1 < argc, "option ", k, " needs a value");
      const std::string v = argv[++i];
      if (k == "--phase") {
        TORCH_CHECK(i + 1 < argc, "--phase needs a directory");
        return phase(v, argv[++i]);
      } else if (k == "--model") {
        model = v;
      } else if (k == "--layers") {
        layers = std::stoll(v);
      } else if (k == "--dir") {
        dir_arg = v;
      } else if (k == "--rounds") {
        rounds = std::stoi(v);
      } else if (k == "--out") {
        out = v;
      } else {
        TORCH_CHECK(false, "unknown option ", k);
      }
    }
    auto cfg = cbench::llama_workload(model);
    if (layers > 0) {
      cfg.num_hidden_layers(layers);
    }
    const fs::path dir = dir_arg.empty()
        ? fs::temp_directory_path() / ("load-pretrained-" + std::to_string(::getpid()))
        : fs::path(dir_arg);
    fs::create_directories(dir);

    std::fprintf(stderr, "writing %s (%lld layers) to %s\n", model.c_str(),
                 (long long)cfg.num_hidden_layers(), dir.c_str());
    auto t0 = std::chrono::steady_clock::now();
    int64_t params = 0;
    {
      torch::manual_seed(0);
      models::LlamaForCausalLM m{nullptr};
      {
        // Built lazily and materialised tensor by tensor in bf16: the
        // writer never holds the float32 model.
        colossalai::lazy::LazyInitContext context;
        m = models::LlamaForCausalLM(cfg);
      }
      colossalai::lazy::materialize(
          *m, [](const std::string&, const at::Tensor& t) { return t.to(at::kBFloat16); });
      m->to(at::kBFloat16);
      for (const auto& p : m->parameters()) {
        params += p.numel();
      }
      models::save_pretrained(m, dir.string());
    }
    const double write_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "%lld parameters written in %.1f s\n", (long long)params, write_s);

    const std::string self = fs::read_symlink("/proc/self/exe").string();
    auto run = [&](const char* what, bool cold) {
      if (cold) {
        drop_cached(dir);
      }
      return cbench::run_command(
          cbench::shell_quote(self) + " --phase " + what + " " + cbench::shell_quote(dir.string()));
    };
    std::map<std::string, std::vector<double>> t, hwm, anon;
    int64_t bytes = 0;
    for (int r = 0; r < rounds; ++r) {
      for (const bool cold : {false, true}) {
        for (const char* what : {"read", "read_fresh", "load"}) {
          const auto json = run(what, cold);
          const std::string key = std::string(what) + (cold ? "_cold" : "_warm");
          t[key].push_back(field(json, "seconds"));
          hwm[key].push_back(field(json, "hwm_bytes"));
          anon[key].push_back(field(json, "anon_peak_bytes") - field(json, "anon_base_bytes"));
          if (std::string(what) == "load") {
            bytes = static_cast<int64_t>(field(json, "bytes"));
          }
          std::fprintf(stderr, "round %d %s: %.2f s\n", r + 1, key.c_str(), t[key].back());
        }
      }
    }
    std::ostringstream json;
    json << "{\n  \"benchmark\": \"load_pretrained\",\n  \"model\": \"" << model
         << "\",\n  \"layers\": " << cfg.num_hidden_layers() << ",\n  \"parameters\": " << params
         << ",\n  \"model_bytes\": " << bytes << ",\n  \"rounds\": " << rounds
         << ",\n  \"write_seconds\": " << write_s << ",\n  \"machine\": " << cbench::machine_json();
    for (const auto& kv : t) {
      json << ",\n  \"" << kv.first << "\": {\"seconds\": " << cbench::stats_json(kv.second)
           << ", \"hwm_bytes\": " << cbench::median(hwm[kv.first])
           << ", \"anon_peak_bytes\": " << cbench::median(anon[kv.first]) << "}";
    }
    const double b = static_cast<double>(bytes);
    json << ",\n  \"load\": {\"time_vs_read_warm\": "
         << cbench::median(t["load_warm"]) / cbench::median(t["read_warm"])
         << ", \"time_vs_read_cold\": "
         << cbench::median(t["load_cold"]) / cbench::median(t["read_cold"])
         << ", \"time_vs_fresh_read_warm\": "
         << cbench::median(t["load_warm"]) / cbench::median(t["read_fresh_warm"])
         << ", \"time_vs_fresh_read_cold\": "
         << cbench::median(t["load_cold"]) / cbench::median(t["read_fresh_cold"])
         << ", \"host_peak_vs_bytes\": " << cbench::median(anon["load_warm"]) / b
         << ", \"hwm_vs_bytes\": " << cbench::median(hwm["load_warm"]) / b << "}\n}\n";
    std::cout << json.str();
    if (!out.empty()) {
      std::ofstream(out) << json.str();
    }
    std::printf(
        "| %s, %lld layers, %.2f GB bf16 | warm: read %.2f s, into new memory %.2f s, "
        "from_pretrained %.2f s (%.2fx, %.2fx) | cold: %.2f s, %.2f s, %.2f s (%.2fx, %.2fx) | "
        "anonymous peak %.2fx the bytes, VmHWM %.2fx |\n",
        model.c_str(),
        (long long)cfg.num_hidden_layers(),
        b / 1e9,
        cbench::median(t["read_warm"]),
        cbench::median(t["read_fresh_warm"]),
        cbench::median(t["load_warm"]),
        cbench::median(t["load_warm"]) / cbench::median(t["read_warm"]),
        cbench::median(t["load_warm"]) / cbench::median(t["read_fresh_warm"]),
        cbench::median(t["read_cold"]),
        cbench::median(t["read_fresh_cold"]),
        cbench::median(t["load_cold"]),
        cbench::median(t["load_cold"]) / cbench::median(t["read_cold"]),
        cbench::median(t["load_cold"]) / cbench::median(t["read_fresh_cold"]),
        cbench::median(anon["load_warm"]) / b,
        cbench::median(hwm["load_warm"]) / b);
    if (!keep && dir_arg.empty()) {
      fs::remove_all(dir);
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
