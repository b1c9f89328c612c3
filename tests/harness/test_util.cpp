#include "test_util.h"
#include "multiprocess.h"

#include <colossalai/distributed/error.h>
#include <colossalai/initialize.h>

#include <ATen/Context.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>

namespace colossalai {
namespace testing {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return distributed::error_text(e);
  }
  return "";
}

std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  out.reserve(params.size());
  for (const auto& p : params) {
    out.push_back(p.detach().cpu().clone());
  }
  return out;
}

std::vector<size_t> differing(
    const std::vector<at::Tensor>& want,
    const std::vector<at::Tensor>& got) {
  std::vector<size_t> out;
  const size_t n = std::min(want.size(), got.size());
  for (size_t i = 0; i < n; ++i) {
    if (want[i].sizes() != got[i].sizes() ||
        want[i].scalar_type() != got[i].scalar_type() ||
        !at::equal(host(want[i]), host(got[i]))) {
      out.push_back(i);
    }
  }
  if (want.size() != got.size()) {
    out.push_back(n);
  }
  return out;
}

std::string temp_dir(const std::string& prefix) {
  namespace fs = std::filesystem;
  auto dir = fs::temp_directory_path() /
      (prefix + "_" + std::to_string(::getpid()) + "_" +
       std::to_string(
           std::chrono::steady_clock::now().time_since_epoch().count()));
  fs::create_directories(dir);
  return dir.string();
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::string scratch(int parent, const std::string& what) {
  return (std::filesystem::temp_directory_path() /
          ("colossalai_" + what + "_" + std::to_string(parent)))
      .string();
}

void remove_scratch(const std::string& what) {
  if (std::getenv("COLOSSALAI_TEST_CHILD") == nullptr) {
    std::filesystem::remove_all(scratch(test_process(), what));
  }
}

std::pair<int, std::string> run_shell(const std::string& command) {
  std::string output;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) {
    return {-1, "popen failed"};
  }
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) {
    output.append(buf, n);
  }
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

std::string python_fixtures(
    const std::string& python,
    const std::string& script,
    const std::string& what,
    const char* env) {
  if (const char* made = std::getenv(env)) {
    return made;
  }
  const std::string d = scratch(test_process(), what);
  const std::string done = d + "/done";
  if (std::getenv("COLOSSALAI_TEST_RANK") != nullptr ||
      access(done.c_str(), F_OK) == 0) {
    return d;
  }
  const auto r =
      run_shell(python + " '" + script + "' make '" + d + "'");
  if (r.first != 0) {
    ADD_FAILURE() << script << " make failed (" << python
                  << "; ./scripts/setup.sh --tests installs the Python "
                     "references):\n"
                  << r.second;
    return d;
  }
  std::FILE* f = std::fopen(done.c_str(), "w");
  if (f != nullptr) {
    std::fputs(r.second.c_str(), f);
    std::fclose(f);
  }
  return d;
}

bool python_has_torch() {
  return ::access(kPython, X_OK) == 0 &&
      run_shell(std::string(kPython) + " -c 'import torch'").first == 0;
}

namespace {

int64_t status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) {
      return std::stoll(line.substr(field.size())) * 1024;
    }
  }
  return -1;
}

} // namespace

int64_t peak_rss_bytes() {
  return status_bytes("VmHWM:");
}

int64_t rss_bytes() {
  return status_bytes("VmRSS:");
}

bool anonymous_shared_memory() {
  const int fd = ::memfd_create("colossalai.probe", MFD_CLOEXEC);
  if (fd < 0) {
    return false;
  }
  ::close(fd);
  return true;
}

void deterministic_on_gpu() {
  if (colossalai::current_device().is_cpu()) {
    return;
  }
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
}

namespace {

// Whether `f`'s first tensor argument (or first tensor of a list) is on
// the CPU.
bool runs_on_cpu(const at::RecordFunction& f) {
  for (const auto& v : f.inputs()) {
    if (v.isTensor()) {
      return v.toTensor().device().is_cpu();
    }
    if (v.isTensorList() && !v.toTensorList().empty()) {
      return v.toTensorList().get(0).device().is_cpu();
    }
  }
  return true;
}

// Operators whose CPU kernels read back inside themselves where the CUDA
// ones do not: ATen's fused Adam / AdamW read each tensor's step count with
// item() (their CUDA kernels read them on the device), its grouped GEMM
// reads the groups' offsets to loop over them (its CUDA kernel takes them
// on the device).
bool cpu_kernel_scope(const at::RecordFunction& f) {
  const char* name = f.name();
  return (std::strcmp(name, "aten::_fused_adamw_") == 0 ||
          std::strcmp(name, "aten::_fused_adam_") == 0 ||
          std::strcmp(name, "aten::_grouped_mm") == 0) &&
      runs_on_cpu(f);
}

// What op_calls' start callback hands its end callback for a call that
// opened a cpu_kernel_scope.
struct ScopeOpened : at::ObserverContext {};

// What op_calls counts into: one tally for every thread running `fn`'s
// operators (the callback travels with the thread-local state to
// autograd's device threads, where a GPU's backward runs); the scope of a
// cpu_kernel_scope operator is per thread.
struct OpTally {
  std::mutex mu;
  std::map<std::string, int> calls;
};
std::atomic<OpTally*> g_op_tally{nullptr};
thread_local std::string t_scope; // the outermost cpu_kernel_scope running
thread_local int t_depth = 0;

// Whether `f` copies from a device to the host and the host waits for it:
// aten::copy_ into a CPU tensor from another device, blocking, or into
// pageable memory (where CUDA copies synchronously even when asked not to).
bool blocking_copy_to_host(const at::RecordFunction& f) {
  if (std::strcmp(f.name(), "aten::copy_") != 0) {
    return false;
  }
  const auto in = f.inputs();
  if (in.size() < 2 || !in[0].isTensor() || !in[1].isTensor()) {
    return false;
  }
  const auto& self = in[0].toTensor();
  const auto& src = in[1].toTensor();
  const bool non_blocking = in.size() > 2 && in[2].isBool() && in[2].toBool();
  return self.device().is_cpu() && !src.device().is_cpu() &&
      (!non_blocking || !self.is_pinned());
}

} // namespace

std::map<std::string, int> op_calls(const std::function<void()>& fn) {
  OpTally tally;
  OpTally* expected = nullptr;
  TORCH_CHECK(
      g_op_tally.compare_exchange_strong(expected, &tally),
      "op_calls: already counting");
  // Inputs: to tell a copy to the host from other copies, and where a
  // kernel runs.
  auto callback = at::RecordFunctionCallback(
      [](const at::RecordFunction& f) -> std::unique_ptr<at::ObserverContext> {
        auto* t = g_op_tally.load();
        if (t == nullptr) {
          return nullptr;
        }
        const std::string name =
            t_depth > 0 ? t_scope + " > " + f.name() : f.name();
        // Inputs are valid here only: the end callback learns from the
        // context whether this call opened a scope.
        std::unique_ptr<at::ObserverContext> scope;
        if (cpu_kernel_scope(f)) {
          if (t_depth++ == 0) {
            t_scope = f.name();
          }
          scope = std::make_unique<ScopeOpened>();
        }
        const bool to_host = blocking_copy_to_host(f);
        std::lock_guard<std::mutex> lock(t->mu);
        ++t->calls[name];
        if (to_host) {
          ++t->calls[kCopyToHost];
        }
        return scope;
      },
      [](const at::RecordFunction&, at::ObserverContext* scope) {
        if (scope != nullptr) {
          --t_depth;
        }
      });
  const auto handle = at::addThreadLocalCallback(callback.needsInputs(true));
  struct Remove {
    at::CallbackHandle handle;
    ~Remove() {
      at::removeCallback(handle);
      g_op_tally.store(nullptr);
    }
  } remove{handle};
  fn();
  std::lock_guard<std::mutex> lock(tally.mu);
  return tally.calls;
}

std::map<std::string, int> host_syncs(const std::map<std::string, int>& calls) {
  static const std::array<const char*, 11> kSyncing = {
      kCopyToHost,
      "aten::_local_scalar_dense",
      "aten::equal",
      "aten::nonzero",
      "aten::masked_select",
      "aten::bincount",
      "aten::_unique",
      "aten::_unique2",
      "aten::unique_dim",
      "aten::unique_consecutive",
      "aten::unique_dim_consecutive"};
  std::map<std::string, int> out;
  for (const char* name : kSyncing) {
    const auto it = calls.find(name);
    if (it != calls.end()) {
      out.insert(*it);
    }
  }
  return out;
}

} // namespace testing
} // namespace colossalai
