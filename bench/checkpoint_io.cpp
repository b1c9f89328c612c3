// Checkpoint save/load throughput on a 1 GB state dict, beside a plain copy
// of the same bytes on the same disk (the ceiling).
//
//   bench_checkpoint_io [--gb 1] [--reps 3] [--dir DIR] [--out FILE.json]
//
// Loads copy into the model's own tensors, so every byte is really read.
// Every save, and the copy, ends with fsync (atomic saves flush before the
// rename), and each starts after a sync() so no earlier writeback is billed
// to it. The page cache is warm for loads (the file was just written); the
// read baseline reads under the same conditions.

#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/interface/model.h>

#include "bench_util.h"

#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

namespace ck = colossalai::checkpoint_io;
namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A plain user-space copy with a 4 MB buffer: what any tool does.
void copy_file(const std::string& from, const std::string& to) {
  int in = ::open(from.c_str(), O_RDONLY);
  int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TORCH_CHECK(in >= 0 && out >= 0, "copy: cannot open files");
  std::vector<char> buf(4 << 20);
  ssize_t n;
  while ((n = ::read(in, buf.data(), buf.size())) > 0) {
    TORCH_CHECK(::write(out, buf.data(), n) == n, "copy: short write");
  }
  ::fsync(out);
  ::close(in);
  ::close(out);
}

// Reads the file into `dst`, memory of its size that is already resident
// (as a model's parameters are): the ceiling of a load, which must write
// every byte to DRAM; read_file's small reused buffer stays in cache.
// `dst` comes from LibTorch's allocator, as parameters do: the kernel's
// copy into a destination 1-31 bytes past its source (modulo a page) runs
// at a quarter of the speed on AMD EPYC, and a std::vector's data sits 16
// bytes past a page start.
void read_into(const std::string& path, at::Tensor& dst) {
  int in = ::open(path.c_str(), O_RDONLY);
  auto* out = static_cast<char*>(dst.data_ptr());
  const size_t size = dst.nbytes();
  size_t done = 0;
  ssize_t n;
  while (done < size && (n = ::read(in, out + done, size - done)) > 0) {
    done += static_cast<size_t>(n);
  }
  ::close(in);
}

// Reads every byte (the load-side ceiling).
void read_file(const std::string& path) {
  int in = ::open(path.c_str(), O_RDONLY);
  std::vector<char> buf(4 << 20);
  volatile char sink = 0;
  ssize_t n;
  while ((n = ::read(in, buf.data(), buf.size())) > 0) {
    sink = sink + buf[0];
  }
  ::close(in);
}

} // namespace

int main(int argc, char** argv) {
  double gb = 1.0;
  int reps = 3;
  std::string dir = fs::temp_directory_path() / "colossalai_bench_ckpt";
  std::string out;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--gb")
      gb = std::stod(v);
    else if (k == "--reps")
      reps = std::stoi(v);
    else if (k == "--dir")
      dir = v;
    else if (k == "--out")
      out = v;
    else
      TORCH_CHECK(false, "unknown option ", k);
  }
  fs::remove_all(dir);
  fs::create_directories(dir);

  // 1 GB in 16 MB weights plus small biases, like a model's layers.
  auto module = std::make_shared<torch::nn::Module>();
  torch::nn::ModuleList layers;
  const int64_t count = static_cast<int64_t>(gb * (1 << 30) / (16 << 20));
  for (int64_t i = 0; i < count; ++i) {
    layers->push_back(torch::nn::Linear(1024, 4096));
  }
  module->register_module("layers", layers);
  auto model = std::make_shared<colossalai::interface::ModelWrapper>(module);
  int64_t bytes = 0;
  for (auto& p : module->parameters()) {
    bytes += p.numel() * 4;
  }
  ck::GeneralCheckpointIO io;

  struct Case {
    std::string name;
    bool safetensors;
    bool shard;
    bool async = false;
  };
  // Async saves: `save` is the whole save (until synchronize), `blocked`
  // the time the caller waited (the snapshot).
  std::vector<Case> cases = {
      {"safetensors", true, false},
      {"safetensors_sharded", true, true},
      {"bin", false, false},
      {"bin_sharded", false, true},
      {"safetensors_async", true, false, true},
      {"safetensors_sharded_async", true, true, true}};
  std::map<std::string, std::vector<double>> save, load, blocked;
  std::vector<double> copy_t, read_t, read_into_t;
  auto resident = at::ones({bytes + (1 << 20)}, at::kByte);
  for (int r = 0; r < reps; ++r) {
    for (const auto& c : cases) {
      auto path = dir + "/" + c.name;
      ::sync(); // start each timing with no writeback pending from the last
      auto t0 = std::chrono::steady_clock::now();
      io.save_model(
          *model,
          path,
          ck::SaveModelOptions()
              .use_safetensors(c.safetensors)
              .shard(c.shard)
              .size_per_shard(256)
              .use_async(c.async));
      blocked[c.name].push_back(seconds_since(t0));
      io.synchronize();
      save[c.name].push_back(seconds_since(t0));
      t0 = std::chrono::steady_clock::now();
      io.load_model(*model, path);
      load[c.name].push_back(seconds_since(t0));
      std::fprintf(
          stderr,
          "rep %d %-26s save %.2f s (caller blocked %.2f s) load "
          "%.2f s\n",
          r + 1,
          c.name.c_str(),
          save[c.name].back(),
          blocked[c.name].back(),
          load[c.name].back());
    }
    ::sync();
    auto t0 = std::chrono::steady_clock::now();
    copy_file(dir + "/safetensors", dir + "/copy");
    copy_t.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    read_file(dir + "/copy");
    read_t.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    read_into(dir + "/copy", resident);
    read_into_t.push_back(seconds_since(t0));
  }

  const double gbytes = bytes / 1e9;
  std::ostringstream json;
  json << "{\n  \"benchmark\": \"checkpoint_io\",\n  \"machine\": "
       << colossalai::bench::machine_json()
       << ",\n  \"peak_rss_bytes\": " << colossalai::bench::peak_rss_bytes()
       << ",\n  \"bytes\": " << bytes << ",\n  \"reps\": " << reps
       << ",\n  \"copy_GBps\": " << gbytes / median(copy_t)
       << ",\n  \"read_GBps\": " << gbytes / median(read_t)
       << ",\n  \"read_into_GBps\": " << gbytes / median(read_into_t)
       << ",\n  \"cases\": {";
  std::printf(
      "| format | save GB/s | caller blocked s | save s | load GB/s | save "
      "time / copy | load time / copy | load time / read |\n"
      "|---|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& n = cases[i].name;
    double s = gbytes / median(save[n]), l = gbytes / median(load[n]);
    json << (i ? "," : "") << "\n    \"" << n << "\": {\"save_GBps\": " << s
         << ", \"load_GBps\": " << l
         << ", \"save_time_vs_copy\": " << median(save[n]) / median(copy_t)
         << ", \"load_time_vs_copy\": " << median(load[n]) / median(copy_t)
         << ", \"load_time_vs_read\": " << median(load[n]) / median(read_t)
         << ", \"load_time_vs_read_into\": "
         << median(load[n]) / median(read_into_t)
         << ", \"caller_blocked_s\": " << median(blocked[n])
         << ", \"save_s\": " << median(save[n]) << "}";
    std::printf(
        "| %s | %.2f | %.2f | %.2f | %.2f | %.2fx | %.2fx | %.2fx |\n",
        n.c_str(),
        s,
        median(blocked[n]),
        median(save[n]),
        l,
        median(save[n]) / median(copy_t),
        median(load[n]) / median(copy_t),
        median(load[n]) / median(read_t));
  }
  std::printf(
      "| plain copy / plain read | %.2f | | | %.2f | 1.00x | | 1.00x |\n",
      gbytes / median(copy_t),
      gbytes / median(read_t));
  json << "\n  }\n}\n";
  std::cout << json.str();
  if (!out.empty()) {
    std::ofstream(out) << json.str();
  }
  fs::remove_all(dir);
  return 0;
}
