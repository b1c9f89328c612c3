#pragma once

// Helpers shared by the benchmark programs: order statistics, peak RSS and
// the "machine" block every benchmark JSON carries.

#include <ATen/core/Tensor.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstdio>
#include <stdexcept>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace colossalai {
namespace bench {

inline double median(std::vector<double> v) {
  if (v.empty()) {
    return 0;
  }
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Nearest-rank percentile, p in [0, 1].
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) {
    return 0;
  }
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * (v.size() - 1) + 0.5)];
}

/// {"median": m, "p10": a, "p90": b, "n": k} of `v`.
inline std::string stats_json(const std::vector<double>& v) {
  std::ostringstream os;
  os << "{\"median\": " << median(v) << ", \"p10\": " << percentile(v, 0.1)
     << ", \"p90\": " << percentile(v, 0.9) << ", \"n\": " << v.size() << "}";
  return os.str();
}

/// Value of a "Key:   123 kB" line of a /proc file, in bytes (-1 if absent).
inline int64_t proc_kb(const char* file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) {
      return std::stoll(line.substr(key.size())) * 1024;
    }
  }
  return -1;
}

/// The largest value `read` gives while it lives, read every `every` on a
/// thread of its own (and once more at each peak()).
class PeakSampler {
 public:
  PeakSampler(std::function<int64_t()> read, std::chrono::microseconds every)
      : read_(std::move(read)), every_(every), peak_(read_()), thread_([this] { run(); }) {}
  ~PeakSampler() {
    stop_ = true;
    thread_.join();
  }
  int64_t peak() const {
    return std::max<int64_t>(peak_, read_());
  }

 private:
  void run() {
    while (!stop_) {
      peak_ = std::max<int64_t>(peak_, read_());
      std::this_thread::sleep_for(every_);
    }
  }
  std::function<int64_t()> read_;
  std::chrono::microseconds every_;
  std::atomic<int64_t> peak_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// Waits for the device's queued work (CUDA); nothing on the CPU.
inline void sync(const at::Device& d) {
  if (d.is_cuda()) {
    torch::cuda::synchronize();
  }
}

/// Peak resident set size of this process.
inline int64_t peak_rss_bytes() {
  return proc_kb("/proc/self/status", "VmHWM:");
}

/// Bytes of the defined tensors' elements.
inline int64_t tensor_bytes(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) {
    if (t.defined()) {
      n += t.numel() * t.element_size();
    }
  }
  return n;
}

/// "a,b,,c" -> {"a", "b", "c"}: the comma-separated lists of the options.
inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) {
      out.push_back(item);
    }
  }
  return out;
}

inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      return line.substr(line.find(':') + 2);
    }
  }
  return "unknown";
}

/// {"cpu": ..., "cores": ..., "memory_bytes": ..., "torch": ...}
inline std::string machine_json() {
  std::ostringstream os;
  std::string cpu = cpu_model();
  std::replace(cpu.begin(), cpu.end(), '"', '\'');
  os << "{\"cpu\": \"" << cpu
     << "\", \"cores\": " << std::thread::hardware_concurrency()
     << ", \"memory_bytes\": " << proc_kb("/proc/meminfo", "MemTotal:")
     << ", \"torch\": \"" << TORCH_VERSION << "\"}";
  return os.str();
}

/// `command`'s standard output (run through the shell); throws with the
/// output when it fails (a benchmark's Python peer).
inline std::string run_command(const std::string& command) {
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) {
    throw std::runtime_error("cannot run: " + command);
  }
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) {
    out.append(buf, n);
  }
  if (pclose(p) != 0) {
    throw std::runtime_error("failed: " + command + "\n" + out);
  }
  return out;
}

/// FNV-1a 64 of `n` int64 ids as little-endian bytes (what the Python
/// peers compute to compare ids without printing them).
inline uint64_t fnv1a_ids(const int64_t* ids, size_t n) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (size_t i = 0; i < n; ++i) {
    for (int b = 0; b < 8; ++b) {
      h = (h ^ ((static_cast<uint64_t>(ids[i]) >> (8 * b)) & 0xFF)) *
          0x100000001B3ull;
    }
  }
  return h;
}

/// `s` in single quotes for the shell (paths without quotes in them).
inline std::string shell_quote(const std::string& s) {
  return "'" + s + "'";
}

} // namespace bench
} // namespace colossalai
