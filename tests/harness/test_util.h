#pragma once

// Small helpers shared by the tests.

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace colossalai {
namespace testing {

/// The message `fn` throws (error_text of the exception), or "" if it
/// returns.
std::string error_of(const std::function<void()>& fn);

/// A fresh directory under the system's temporary directory, named after
/// `prefix`, this process and the time.
std::string temp_dir(const std::string& prefix);

/// temp_dir(prefix), removed with its contents when this goes out of scope.
struct ScratchDir {
  explicit ScratchDir(const std::string& prefix) : path(temp_dir(prefix)) {}
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string path;
};

/// The ranks' shared scratch directory of a multi-process test, named after
/// `what` and the test program (pass test_process() there);
/// `remove_scratch` in the test program removes it.
std::string scratch(int parent, const std::string& what);
void remove_scratch(const std::string& what);

/// Runs `command` through the shell: its exit status and its output
/// (stdout and stderr).
std::pair<int, std::string> run_shell(const std::string& command);

/// References a Python script makes for a test program: the directory
/// named by the environment variable `env` when it is set (made before by
/// `python script make DIR`), else scratch(`what`), made once per test
/// program by that command (the ranks only read it). A failing script is a
/// test failure that shows its output. `remove_scratch(what)` removes it.
std::string python_fixtures(
    const std::string& python,
    const std::string& script,
    const std::string& what,
    const char* env);

/// The Python whose torch matches the linked LibTorch, which interop tests
/// run: Debian's (python3-torch) for Debian's LibTorch, the venv's for the
/// PyPI build (CMake's COLOSSALAI_PYTHON).
constexpr const char* kPython = COLOSSALAI_TEST_PYTHON;
/// Whether kPython exists and imports torch.
bool python_has_torch();

/// Whether this process can make an anonymous shared memory file
/// (memfd_create), which shared-memory collectives need; where it cannot,
/// groups stay on Gloo and say so.
bool anonymous_shared_memory();

/// This process's peak resident set size (VmHWM), in bytes.
int64_t peak_rss_bytes();
/// This process's resident set size now (VmRSS), in bytes: the baseline
/// memory bounds measure above (a CUDA-linked LibTorch starts ~200 MB
/// higher).
int64_t rss_bytes();

/// `t` on the host: what a rank computed on its device (COLOSSALAI_DEVICE=
/// cuda) compares with a reference computed on the CPU.
inline at::Tensor host(const at::Tensor& t) {
  return t.defined() && !t.is_cpu() ? t.cpu() : t;
}
inline std::vector<at::Tensor> host(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) {
    out.push_back(host(t));
  }
  return out;
}

/// Detached copies of `params` on the host: one run's weights, to compare
/// with another's.
std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& params);
/// The positions at which `got` differs from `want` in any bit (shape,
/// dtype or value), with one past the shorter where the counts differ:
/// EXPECT_EQ(differing(a, b), std::vector<size_t>{}).
std::vector<size_t> differing(
    const std::vector<at::Tensor>& want,
    const std::vector<at::Tensor>& got);

/// Mean squared error whose target follows the output to its device, as the
/// boosted criterion's does: a test's CPU batch against a boosted model's
/// output on the rank's device.
inline at::Tensor mse_loss(const at::Tensor& out, const at::Tensor& target) {
  return at::mse_loss(out, target.to(out.device()));
}

/// Whether weights that AdamW (learning rate `lr`, ColossalAI's betas)
/// stepped `steps` times are the same in two runs that step some chunk's
/// AdamW on different tiers (a placement that offloads the optimizer), given
/// `bitwise`: whether the caller expects bit-identical weights (both runs on
/// the CPU, or on one tier). On the CPU the tiers are bit-identical. On a
/// GPU they are not: LibTorch's CUDA kernels divide by a scalar as a
/// multiplication by its reciprocal (tests/gpu/adamw_host_vs_device.py
/// measures it), so AdamW's denominator differs in the last bits, and an
/// element whose gradient is rounding noise (a key bias: its exact gradient
/// is zero) may then take the opposite update in the next step. Each update
/// is at most lr (1 - b1) / sqrt(1 - b2) = 3.2 lr, so two runs differ by at
/// most twice that a step. `max_diff` reports the largest difference.
inline bool same_across_tiers(
    const at::Tensor& got,
    const at::Tensor& want,
    int steps,
    double lr,
    bool bitwise,
    double* max_diff = nullptr) {
  const auto a = host(got), b = host(want);
  if (max_diff != nullptr) {
    *max_diff = (a - b).abs().max().item<double>();
  }
  if (bitwise) {
    return at::equal(a, b);
  }
  return at::allclose(a, b, 0.0, 2 * steps * 3.2 * lr);
}

/// What op_calls counts a copy from a device to the host under that the
/// host waits for (blocking, or into pageable memory).
constexpr const char* kCopyToHost = "copy to the host";

/// How often `fn` runs each operator (on this thread, where LibTorch also
/// runs a CPU backward): name -> calls. Operators that ATen's CPU fused
/// Adam / AdamW and grouped GEMM kernels run inside themselves count as
/// "outer > inner" (their CUDA kernels read nothing back); copies to the
/// host the host waits for count once more as kCopyToHost.
std::map<std::string, int> op_calls(const std::function<void()>& fn);

/// The calls in `calls` (op_calls) of operators after which a GPU's host
/// waits for the device: a value read back (item() and a tensor's truth,
/// aten::_local_scalar_dense; equal), an output sized by the data
/// (nonzero and what indexes by a mask, masked_select, bincount, unique),
/// or a copy to the host (kCopyToHost). The first two run on the CPU as
/// well, so a CPU test shows a step free of them; a copy to the host is
/// seen only where there is a device (on the CPU `.cpu()` copies nothing).
std::map<std::string, int> host_syncs(const std::map<std::string, int>& calls);

/// Makes a GPU run repeat bit for bit, for tests that compare runs bitwise:
/// LibTorch's deterministic algorithms (strict: its memory-efficient
/// attention backward otherwise splits keys and adds with atomics) and the
/// cuBLAS workspace setting they need, set before this process's first
/// matrix product. Does nothing on the CPU.
void deterministic_on_gpu();

} // namespace testing
} // namespace colossalai
