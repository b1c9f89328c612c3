#pragma once

// The private part of the compatibility layer: c10d types whose shape differs
// between LibTorch 1.13 and 2.x. Only library sources include it.
//
/// NOTE [c10d backends across versions]
/// On 1.13 `ProcessGroupGloo` derives from `c10d::ProcessGroup`, whose
/// collectives are virtual. On 2.x it derives from `c10d::Backend` and
/// `ProcessGroup` became a front end that dispatches to backends. Both expose
/// the same collective signatures on the concrete class, so we hold the
/// concrete backend through `compat::Backend` and call it directly.

#include <colossalai/utils/compat.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if COLOSSALAI_TORCH_AT_LEAST(2, 0)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace colossalai {
namespace compat {

#if COLOSSALAI_TORCH_AT_LEAST(2, 0)
using Backend = ::c10d::Backend;
#else
using Backend = ::c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<Backend>;
using WorkPtr = c10::intrusive_ptr<::c10d::Work>;

} // namespace compat
} // namespace colossalai
