#pragma once

// The private part of the compatibility layer: c10d types and calls whose
// shape differs between LibTorch 1.13 and 2.x. Only library sources include
// it.
//
/// NOTE [c10d backends across versions]
/// On 1.13 `ProcessGroupGloo` derives from `c10d::ProcessGroup`, whose
/// collectives are virtual. On 2.x it derives from `c10d::Backend` and
/// `ProcessGroup` became a front end that dispatches to backends. Both expose
/// the same collective signatures on the concrete class, so we hold the
/// concrete backend through `compat::Backend` and call it directly.
/// The flat collectives were renamed in later 2.x releases
/// (`_allgather_base` -> `all_gather_single`, `_reduce_scatter_base` ->
/// `reduce_scatter_single`, `alltoall_base` -> `all_to_all_single`, the old
/// names kept as deprecated aliases): the wrappers below call the new name
/// where the headers declare it, found by SFINAE, not by version number.
/// Whether a backend implements one is only known at run time (1.13's Gloo
/// declares `_allgather_base` and throws "no support" from it): callers try,
/// and `is_unsupported` tells that refusal from a communication failure.

#include <colossalai/utils/compat.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if COLOSSALAI_TORCH_AT_LEAST(2, 0)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include <chrono>
#include <string>
#include <vector>

namespace c10d {
class TCPStore;
}

namespace colossalai {
namespace compat {

#if COLOSSALAI_TORCH_AT_LEAST(2, 0)
using Backend = ::c10d::Backend;
#else
using Backend = ::c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<Backend>;
using WorkPtr = c10::intrusive_ptr<::c10d::Work>;

/// Gathers every rank's `in` into the flat `out` (equal shards).
WorkPtr all_gather_single(Backend& b, at::Tensor& out, at::Tensor& in);
/// Reduces the flat `in` and leaves this rank's equal shard in `out`.
WorkPtr reduce_scatter_single(
    Backend& b,
    at::Tensor& out,
    at::Tensor& in,
    const ::c10d::ReduceScatterOptions& opts);
/// All-to-all of one flat tensor with optional split sizes.
WorkPtr all_to_all_single(
    Backend& b,
    at::Tensor& out,
    at::Tensor& in,
    std::vector<int64_t>& out_splits,
    std::vector<int64_t>& in_splits);

/// True when `e` is a backend refusing an operation it does not implement
/// (raised before anything was sent), not a failure of the operation.
bool is_unsupported(const std::exception& e);

/// Whether this LibTorch's Gloo sums bfloat16 itself (from 2.x; 1.13 only
/// moves it). Gloo's reductions are type-dispatched at run time, so a wrong
/// answer would fail inside the collective: it is a version fact, checked
/// by test_collectives on every version the suite runs on.
constexpr bool gloo_reduces_bf16() {
  return COLOSSALAI_TORCH_AT_LEAST(2, 0);
}

/// The rendezvous store. From 2.3 c10d defaults to a libuv-based server,
/// which builds without libuv (Debian's) refuse with "use_libuv was
/// requested but PyTorch was build without libuv support": there the store
/// is created with the classic server instead (detected from that refusal,
/// not assumed from the version).
c10::intrusive_ptr<::c10d::TCPStore> make_tcp_store(
    const std::string& host,
    std::uint16_t port,
    bool is_server,
    std::size_t num_workers,
    std::chrono::milliseconds timeout);

/// Makes `index` the calling thread's current CUDA device (a no-op check in
/// builds without CUDA, which never get here with a CUDA device).
void set_cuda_device(int index);

/// NOTE [NCCL failures are exceptions]
/// c10d's NCCL backend by default lets its watchdog tear the process down
/// when a collective times out or a peer fails, and wait() only orders
/// streams. We make wait() block with the group timeout and throw, and the
/// watchdog abort the communicators without ending the process: each
/// `Work::wait` then turns the failure into a DistributedError naming rank,
/// op and group. Applied before the first NCCL group is created, unless the
/// environment already chose (TORCH_NCCL_BLOCKING_WAIT,
/// TORCH_NCCL_ASYNC_ERROR_HANDLING, or their older NCCL_ names).
void catchable_nccl_failures();

} // namespace compat
} // namespace colossalai
