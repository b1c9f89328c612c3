#include "compat_c10d.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <type_traits>
#include <utility>

#include <cstdlib>

#ifdef COLOSSALAI_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace colossalai {
namespace compat {
namespace {

// Detectors for the 2.x successor names (NOTE [c10d backends across
// versions]).
template <class B, class = void>
struct has_all_gather_single : std::false_type {};
template <class B>
struct has_all_gather_single<
    B,
    std::void_t<decltype(std::declval<B&>().all_gather_single(
        std::declval<at::Tensor&>(),
        std::declval<at::Tensor&>()))>> : std::true_type {};

template <class B, class = void>
struct has_reduce_scatter_single : std::false_type {};
template <class B>
struct has_reduce_scatter_single<
    B,
    std::void_t<decltype(std::declval<B&>().reduce_scatter_single(
        std::declval<at::Tensor&>(),
        std::declval<at::Tensor&>()))>> : std::true_type {};

template <class B, class = void>
struct has_all_to_all_single : std::false_type {};
template <class B>
struct has_all_to_all_single<
    B,
    std::void_t<decltype(std::declval<B&>().all_to_all_single(
        std::declval<at::Tensor&>(),
        std::declval<at::Tensor&>(),
        std::declval<std::vector<int64_t>&>(),
        std::declval<std::vector<int64_t>&>()))>> : std::true_type {};

template <class O, class = void>
struct has_use_libuv : std::false_type {};
template <class O>
struct has_use_libuv<O, std::void_t<decltype(std::declval<O&>().useLibUV)>>
    : std::true_type {};

// The calls, templated so that the branch a version lacks is discarded.
template <class B>
WorkPtr all_gather_single_of(B& b, at::Tensor& out, at::Tensor& in) {
  if constexpr (has_all_gather_single<B>::value) {
    return b.all_gather_single(out, in);
  } else {
    return b._allgather_base(out, in);
  }
}

template <class B>
WorkPtr reduce_scatter_single_of(
    B& b,
    at::Tensor& out,
    at::Tensor& in,
    const ::c10d::ReduceScatterOptions& opts) {
  if constexpr (has_reduce_scatter_single<B>::value) {
    return b.reduce_scatter_single(out, in, opts);
  } else {
    return b._reduce_scatter_base(out, in, opts);
  }
}

template <class B>
WorkPtr all_to_all_single_of(
    B& b,
    at::Tensor& out,
    at::Tensor& in,
    std::vector<int64_t>& out_splits,
    std::vector<int64_t>& in_splits) {
  ::c10d::AllToAllOptions opts;
  if constexpr (has_all_to_all_single<B>::value) {
    return b.all_to_all_single(out, in, out_splits, in_splits, opts);
  } else {
    return b.alltoall_base(out, in, out_splits, in_splits, opts);
  }
}

template <class O>
c10::intrusive_ptr<::c10d::TCPStore> make_store(
    const std::string& host,
    O so) {
  if constexpr (has_use_libuv<O>::value) {
    try {
      return c10::make_intrusive<::c10d::TCPStore>(host, so);
    } catch (const std::exception& e) {
      if (std::string(e.what()).find("libuv") == std::string::npos ||
          !so.useLibUV) {
        throw;
      }
      so.useLibUV = false; // refused before any socket was opened
    }
  }
  return c10::make_intrusive<::c10d::TCPStore>(host, so);
}

} // namespace

WorkPtr all_gather_single(Backend& b, at::Tensor& out, at::Tensor& in) {
  return all_gather_single_of(b, out, in);
}

WorkPtr reduce_scatter_single(
    Backend& b,
    at::Tensor& out,
    at::Tensor& in,
    const ::c10d::ReduceScatterOptions& opts) {
  return reduce_scatter_single_of(b, out, in, opts);
}

WorkPtr all_to_all_single(
    Backend& b,
    at::Tensor& out,
    at::Tensor& in,
    std::vector<int64_t>& out_splits,
    std::vector<int64_t>& in_splits) {
  return all_to_all_single_of(b, out, in, out_splits, in_splits);
}

bool is_unsupported(const std::exception& e) {
  // 1.13's Gloo: "no support for _allgather_base in Gloo process group",
  // "ProcessGroupGloo does not support reduce_scatter"; 2.x's Backend:
  // "Backend gloo does not support _reduce_scatter_base".
  const std::string what = e.what();
  return what.find("does not support") != std::string::npos ||
      what.find("no support for") != std::string::npos;
}

c10::intrusive_ptr<::c10d::TCPStore> make_tcp_store(
    const std::string& host,
    std::uint16_t port,
    bool is_server,
    std::size_t num_workers,
    std::chrono::milliseconds timeout) {
  ::c10d::TCPStoreOptions so;
  so.port = port;
  so.isServer = is_server;
  so.numWorkers = num_workers;
  so.waitWorkers = false;
  so.timeout = timeout;
  return make_store(host, so);
}

void set_cuda_device(int index) {
#ifdef COLOSSALAI_WITH_CUDA
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
#else
  TORCH_CHECK(false, "set_cuda_device: this build has no CUDA");
#endif
}

void catchable_nccl_failures() {
  auto set_unless_chosen = [](const char* name, const char* old_name,
                              const char* value) {
    if (std::getenv(name) == nullptr && std::getenv(old_name) == nullptr) {
      // The TORCH_ names arrived in 2.2; later releases warn about the old.
      ::setenv(
          COLOSSALAI_TORCH_AT_LEAST(2, 2) ? name : old_name,
          value,
          /*overwrite=*/0);
    }
  };
  set_unless_chosen("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT", "1");
  // 2 = CleanUpOnly: abort the communicators, keep the process.
  set_unless_chosen(
      "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "2");
}

} // namespace compat
} // namespace colossalai
