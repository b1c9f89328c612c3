#pragma once

/// Every difference between the LibTorch versions we build against (1.13 and
/// 2.x) lives in this header, so the rest of the library is version-free.
///
/// The c10d part (backend and work handle types) is private, in
/// src/utils/compat_c10d.h, so that public headers do not pull c10d and
/// Gloo into every user translation unit.

#include <ATen/ATen.h>
#include <torch/version.h>

#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#define COLOSSALAI_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||             \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace colossalai {
namespace compat {

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

/// Bytes allocated on `device` now: the CUDA caching allocator's allocated
/// bytes on CUDA builds; on the host, the C heap's bytes in use (every
/// thread's arenas and mmap'd blocks), which includes more than tensors.
int64_t memory_allocated(at::Device device);
/// Total memory of `device` (CUDA); 0 when unknown (the host).
int64_t device_memory_capacity(at::Device device);

/// Whether LibTorch has a fused attention kernel
/// (at::scaled_dot_product_attention, 2.0 and later).
constexpr bool has_fused_attention() {
  return COLOSSALAI_TORCH_AT_LEAST(2, 0);
}

/// softmax(q k^T / sqrt(D) + mask) v for q [B, H, Tq, D] and k, v
/// [B, H_kv, Tk, D], H a multiple of H_kv (grouped-query attention: each
/// key/value head serves H / H_kv consecutive query heads; from 2.5 the
/// kernel reads them in place, `enable_gqa`, before that they are
/// repeated): `mask` (optional) is boolean, true where a query may
/// attend a key, broadcastable to [B, H, Tq, Tk] (a padding mask is
/// [B, 1, 1, Tk]); `is_causal` also hides the keys after each query
/// (query i sees keys 0..i + Tk - Tq). Every query must see at least one
/// key. On 2.x this is at::scaled_dot_product_attention (its fused CPU /
/// CUDA kernels); on 1.13 the explicit matmul, mask, softmax, matmul. The
/// two agree within fp32 rounding (test_zoo's Attention tests).
///
/// Example:
/// \code
///   auto pad = ids.ne(pad_id).view({b, 1, 1, t}); // true: a real token
///   auto y = compat::scaled_dot_product_attention(q, k, v, pad, true);
/// \endcode
at::Tensor scaled_dot_product_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const c10::optional<at::Tensor>& mask,
    bool is_causal);
/// The kernels at::scaled_dot_product_attention chooses among
/// (torch.nn.attention.SDPBackend's).
enum class SdpaBackend { math, flash, efficient, cudnn };

/// The kernel `scaled_dot_product_attention(q, k, v, mask, is_causal)`
/// runs for these inputs under the current settings (ATen's own choice):
/// "math", "flash", "efficient", "cudnn", "overrideable", or "explicit"
/// (LibTorch 1.13: the explicit path).
std::string sdpa_backend(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const c10::optional<at::Tensor>& mask,
    bool is_causal);

/// While alive, scaled_dot_product_attention may run only the `allowed`
/// kernels (torch.nn.attention.sdpa_kernel); the settings before come back
/// at its end. Process-wide, as ATen's settings are. Inputs that none of
/// them takes are refused by ATen (no viable kernel). LibTorch 2.5 and
/// later; refused by name before.
///
/// Example:
/// \code
///   compat::SdpaKernelGuard only({compat::SdpaBackend::cudnn});
///   auto y = compat::scaled_dot_product_attention(q, k, v, {}, true);
/// \endcode
class SdpaKernelGuard {
 public:
  explicit SdpaKernelGuard(const std::vector<SdpaBackend>& allowed);
  ~SdpaKernelGuard();
  SdpaKernelGuard(const SdpaKernelGuard&) = delete;
  SdpaKernelGuard& operator=(const SdpaKernelGuard&) = delete;

 private:
  bool before_[4] = {}; // SdpaBackend's order
};

/// The explicit path of `scaled_dot_product_attention`, on every version
/// (the reference the fused one is checked against).
at::Tensor explicit_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const c10::optional<at::Tensor>& mask,
    bool is_causal);

/// Whether LibTorch has the fused Adam/AdamW kernels (at::_fused_adam_,
/// at::_fused_adamw_: one pass over parameter, gradient and moments) for
/// `device`: CUDA from 2.1, the CPU from 2.4; never on 1.13.
bool has_fused_adam(at::Device device);

/// One fused Adam (`decoupled` false: L2 decay added to the gradient) or
/// AdamW (`decoupled` true: the parameter scaled by 1 - lr * weight_decay)
/// update over tensors of one device and dtype. `state_steps` are fp32
/// tensors on that device holding each parameter's step count after this
/// step (1 on the first); the kernel corrects the moments' bias with them.
/// `max_exp_avg_sqs` is empty unless `amsgrad`. `found_inf`: a float32
/// one-element tensor on that device that, where 1, makes the kernel change
/// nothing (read there, not on the host: a loss scaler's verdict). Requires
/// has_fused_adam.
void fused_adam_(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList max_exp_avg_sqs,
    at::TensorList state_steps,
    double lr,
    double beta1,
    double beta2,
    double weight_decay,
    double eps,
    bool amsgrad,
    bool decoupled,
    const c10::optional<at::Tensor>& found_inf = c10::nullopt);

/// Whether fused_adam_ takes a tensor learning rate on `device`: where
/// has_fused_adam holds, from LibTorch 2.2.
bool has_fused_adam_tensor_lr(at::Device device);

/// fused_adam_ with the learning rate read from `lr` (a one-element float32
/// tensor on the parameters' device) when the kernel runs: a step captured
/// in a CUDA graph follows a schedule that rewrites `lr` between replays.
/// LibTorch 2.2+ (where has_fused_adam holds).
void fused_adam_(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList max_exp_avg_sqs,
    at::TensorList state_steps,
    const at::Tensor& lr,
    double beta1,
    double beta2,
    double weight_decay,
    double eps,
    bool amsgrad,
    bool decoupled,
    const c10::optional<at::Tensor>& found_inf = c10::nullopt);

/// Whether `device` is a CUDA device whose current stream is capturing a
/// CUDA graph: work that reads a value back to the host cannot run then.
/// False for every other device and in builds without CUDA.
bool stream_capturing(at::Device device);

/// Each tensor's `ord`-norm in float32 through ATen's multi-tensor kernel
/// (_foreach_norm with an output dtype, LibTorch 2.6+): on a GPU one launch
/// per chunk of tensors instead of one per tensor, the sums in float32 as
/// linalg_vector_norm(dtype=float32) forms them. Empty where that kernel is
/// missing (LibTorch 1.13): the caller then takes one norm per tensor.
std::vector<at::Tensor> foreach_norms_float(
    at::TensorList tensors,
    double ord);

/// Every tensor *= `scale` (a 0-dim tensor on their device): one
/// multi-tensor kernel per chunk (LibTorch 2.1+), else one mul_ per tensor.
void foreach_mul_(at::TensorList tensors, const at::Tensor& scale);

/// The exact int32 product of int8 matrices a [m, k] and b [k, n] through
/// cuBLASLt's int8 path (at::_int_mm, LibTorch 2.1+, CUDA), or an undefined
/// tensor where that path does not take them: LibTorch 1.13, another
/// device, m <= 16, or k or n not a multiple of 8. `b` may be the
/// transposed view of a contiguous [n, k].
at::Tensor int8_mm(const at::Tensor& a, const at::Tensor& b);

/// Whether at::_grouped_mm (one GEMM over groups of rows, each group with
/// its own matrix) computes in `dtype` on `device` without reading its
/// offsets back to the host: from LibTorch 2.10, on the CPU in float32 /
/// bf16 / fp16 (ATen loops over the groups) and on a CUDA device of compute
/// capability 9.x or 10.x in bf16 (CUTLASS's grouped kernel; ATen's other
/// CUDA paths copy the offsets to the host).
bool has_grouped_mm(at::Device device, at::ScalarType dtype);

/// at::_grouped_mm(a, b, offs): `a` [N, K] by `b` [G, K, M] with `offs`
/// (int32 [G], the groups' ends along N) gives [N, M]; `a` [M, N] by `b`
/// [N, K] (groups along the shared N) gives [G, M, K]. Requires
/// has_grouped_mm; rows and the stride between them 16-byte aligned.
at::Tensor grouped_mm(
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& offs);

/// Whether this LibTorch has the float8 dtypes (float8_e4m3fn,
/// float8_e5m2): 2.1 and later.
bool has_float8();

/// The float8 dtype: float8_e4m3fn when `e4m3`, else float8_e5m2.
/// Requires has_float8.
at::ScalarType float8_type(bool e4m3);

/// `bytes` (uint8, any strides) viewed as float8: e4m3fn when `e4m3`, else
/// e5m2; the same storage, shape and strides. Copying a float tensor into
/// it casts with round-to-nearest-even. Requires has_float8.
at::Tensor float8_view(const at::Tensor& bytes, bool e4m3);

/// Whether at::_scaled_mm (a product of two float8 matrices, each under a
/// float32 scale) runs at speed on `device`: a CUDA device of compute
/// capability 8.9 or later, from LibTorch 2.4 (its present signature). Not
/// the CPU: ATen's CPU kernel, where a build has one, is a reference loop.
bool has_scaled_mm(at::Device device);

/// (a * scale_a) @ (b * scale_b) (+ bias) as `out_dtype`: `a` float8 [m, k]
/// row-major, `b` float8 [k, n] column-major (a transposed view of a
/// contiguous [n, k]), the scales float32 scalars, every size a multiple of
/// 16 on a GPU. `fast_accum`: Hopper's faster, less exact accumulation.
/// Requires has_scaled_mm.
at::Tensor scaled_mm(
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& scale_a,
    const at::Tensor& scale_b,
    const at::Tensor& bias,
    at::ScalarType out_dtype,
    bool fast_accum);

/// at::layer_norm. LibTorch before 2.1 cannot take a 16-bit input beside
/// float32 weight and bias on the CPU (a bf16 activation under autocast):
/// there it normalises in the weight's dtype and rounds the result to the
/// input's, as the later kernel does.
at::Tensor layer_norm(
    const at::Tensor& x,
    at::IntArrayRef normalized_shape,
    const at::Tensor& weight,
    const at::Tensor& bias,
    double eps);

/// The dtype autocast casts to on `device` (CPU or CUDA) in this thread, or
/// nullopt where autocast is off there.
c10::optional<at::ScalarType> autocast_dtype(at::DeviceType device);

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
