#pragma once

/// Every difference between the LibTorch versions we build against (1.13 and
/// 2.x) lives in this header, so the rest of the library is version-free.
///
/// NOTE [c10d backends across versions]
/// On 1.13 `ProcessGroupGloo` derives from `c10d::ProcessGroup`, whose
/// collectives are virtual. On 2.x it derives from `c10d::Backend` and
/// `ProcessGroup` became a front end that dispatches to backends. Both expose
/// the same collective signatures on the concrete class, so we hold the
/// concrete backend through `compat::Backend` and call it directly.

#include <ATen/ATen.h>
#include <torch/version.h>

#include <sstream>
#include <string>
#include <type_traits>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#define COLOSSALAI_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||             \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

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

/// Key of a parameter in `torch::optim::Optimizer::state()`: the TensorImpl
/// address as a string on 1.13, the address itself on later versions.
template <class StateMap>
typename StateMap::key_type optimizer_state_key(const at::Tensor& param) {
  if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
    std::ostringstream os;
    os << param.unsafeGetTensorImpl();
    return os.str();
  } else {
    return param.unsafeGetTensorImpl();
  }
}

/// Releases the memory of `t`'s storage in place: every tensor viewing it
/// (autograd's saved copies of a parameter included) stays valid and sees the
/// data again once `allocate_storage` re-creates it.
void free_storage(const at::Tensor& t);
/// Re-allocates `t`'s storage in place with `nbytes` (uninitialised).
void allocate_storage(const at::Tensor& t, size_t nbytes);
/// Bytes `t`'s storage currently holds (0 once freed).
size_t storage_nbytes(const at::Tensor& t);

/// RAII autocast region on one device type (CPU or CUDA).
class AutocastGuard {
 public:
  AutocastGuard(at::DeviceType device, at::ScalarType dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  at::DeviceType device_;
  bool prev_enabled_;
  at::ScalarType prev_dtype_;
};

} // namespace compat
} // namespace colossalai
