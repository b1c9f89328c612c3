#include <colossalai/utils/compat.h>

#include <ATen/autocast_mode.h>

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef COLOSSALAI_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace colossalai {
namespace compat {

void free_storage(const at::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(static_cast<size_t>(0));
}

void allocate_storage(const at::Tensor& t, size_t nbytes) {
  auto* s = t.storage().unsafeGetStorageImpl();
  TORCH_INTERNAL_ASSERT(s->allocator() != nullptr);
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

size_t storage_nbytes(const at::Tensor& t) {
  return t.storage().nbytes();
}

int64_t memory_allocated(at::Device device) {
#ifdef COLOSSALAI_WITH_CUDA
  if (device.is_cuda()) {
    const auto index =
        device.has_index() ? device.index() : c10::cuda::current_device();
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
    return stats.allocated_bytes[0].current; // StatType::AGGREGATE
  }
#endif
  TORCH_CHECK(device.is_cpu(), "memory_allocated: unsupported device ", device);
#if defined(__GLIBC__) && \
    (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const auto info = mallinfo2(); // sums every arena
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
#else
  // Without glibc's mallinfo2: the resident set, a coarser figure.
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) {
      resident = 0;
    }
    std::fclose(f);
  }
  return static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE);
#endif
}

int64_t device_memory_capacity(at::Device device) {
#ifdef COLOSSALAI_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(
        device.has_index() ? device.index() : c10::cuda::current_device());
    size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<int64_t>(total);
  }
#endif
  return 0;
}

bool has_fused_adam(at::Device device) {
  if (device.is_cuda()) {
    return COLOSSALAI_TORCH_AT_LEAST(2, 1);
  }
  return device.is_cpu() && COLOSSALAI_TORCH_AT_LEAST(2, 4);
}

bool has_grouped_mm(at::Device device, at::ScalarType dtype) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 10)
  if (device.is_cpu()) {
    return dtype == at::kFloat || dtype == at::kBFloat16 ||
        dtype == at::kHalf;
  }
#ifdef COLOSSALAI_WITH_CUDA
  if (device.is_cuda() && dtype == at::kBFloat16) {
    // Every device's compute capability, read once: a sparse layer asks on
    // every forward.
    static const std::vector<int> majors = [] {
      std::vector<int> m(static_cast<size_t>(c10::cuda::device_count()), 0);
      for (size_t i = 0; i < m.size(); ++i) {
        C10_CUDA_CHECK(cudaDeviceGetAttribute(
            &m[i], cudaDevAttrComputeCapabilityMajor, static_cast<int>(i)));
      }
      return m;
    }();
    const auto index = static_cast<size_t>(
        device.has_index() ? device.index() : c10::cuda::current_device());
    return index < majors.size() &&
        (majors[index] == 9 || majors[index] == 10);
  }
#endif
#endif
  (void)device;
  (void)dtype;
  return false;
}

at::Tensor grouped_mm(
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& offs) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 10)
  return at::_grouped_mm(a, b, offs);
#else
  (void)b;
  (void)offs;
  TORCH_CHECK(
      false,
      "grouped_mm needs LibTorch 2.10 or later (at::_grouped_mm); this is ",
      TORCH_VERSION,
      " on ",
      a.device());
#endif
}

bool has_fused_adam_tensor_lr(at::Device device) {
  return COLOSSALAI_TORCH_AT_LEAST(2, 2) && has_fused_adam(device);
}

std::vector<at::Tensor> foreach_norms_float(
    at::TensorList tensors,
    double ord) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 6)
  return at::_foreach_norm(tensors, ord, at::kFloat);
#else
  (void)tensors;
  (void)ord;
  return {};
#endif
}

void foreach_mul_(at::TensorList tensors, const at::Tensor& scale) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 1)
  at::_foreach_mul_(tensors, scale);
#else
  for (const auto& t : tensors) {
    t.mul_(scale);
  }
#endif
}

bool has_float8() {
  return COLOSSALAI_TORCH_AT_LEAST(2, 1);
}

at::ScalarType float8_type(bool e4m3) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 1)
  return e4m3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
#else
  (void)e4m3;
  TORCH_CHECK(false, "float8 needs LibTorch 2.1 or later");
#endif
}

at::Tensor float8_view(const at::Tensor& bytes, bool e4m3) {
  TORCH_INTERNAL_ASSERT(bytes.scalar_type() == at::kByte);
#if COLOSSALAI_TORCH_AT_LEAST(2, 1)
  return bytes.view(e4m3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2);
#else
  (void)e4m3;
  TORCH_CHECK(false, "float8 needs LibTorch 2.1 or later");
#endif
}

bool has_scaled_mm(at::Device device) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 4)
#ifdef COLOSSALAI_WITH_CUDA
  if (device.is_cuda()) {
    // Every device's compute capability, read once.
    static const std::vector<int> capability = [] {
      std::vector<int> c(static_cast<size_t>(c10::cuda::device_count()), 0);
      for (size_t i = 0; i < c.size(); ++i) {
        int major = 0;
        int minor = 0;
        C10_CUDA_CHECK(cudaDeviceGetAttribute(
            &major, cudaDevAttrComputeCapabilityMajor, static_cast<int>(i)));
        C10_CUDA_CHECK(cudaDeviceGetAttribute(
            &minor, cudaDevAttrComputeCapabilityMinor, static_cast<int>(i)));
        c[i] = 10 * major + minor;
      }
      return c;
    }();
    const auto index = static_cast<size_t>(
        device.has_index() ? device.index() : c10::cuda::current_device());
    return index < capability.size() && capability[index] >= 89;
  }
#endif
#endif
  (void)device;
  return false;
}

at::Tensor scaled_mm(
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& scale_a,
    const at::Tensor& scale_b,
    const at::Tensor& bias,
    at::ScalarType out_dtype,
    bool fast_accum) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 4)
  TORCH_INTERNAL_ASSERT(has_scaled_mm(a.device()));
  return at::_scaled_mm(
      a,
      b,
      scale_a,
      scale_b,
      bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt,
      /*scale_result=*/c10::nullopt,
      out_dtype,
      fast_accum);
#else
  (void)a;
  (void)b;
  (void)scale_a;
  (void)scale_b;
  (void)bias;
  (void)out_dtype;
  (void)fast_accum;
  TORCH_INTERNAL_ASSERT(false, "scaled_mm needs LibTorch 2.4 or later");
#endif
}

at::Tensor int8_mm(const at::Tensor& a, const at::Tensor& b) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 1)
  const bool takes = a.is_cuda() && b.device() == a.device() &&
      a.scalar_type() == at::kChar && b.scalar_type() == at::kChar &&
      a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) &&
      a.size(0) > 16 && a.size(1) > 0 && a.size(1) % 8 == 0 &&
      b.size(1) > 0 && b.size(1) % 8 == 0;
  if (takes) {
    return at::_int_mm(a.contiguous(), b);
  }
#else
  (void)a;
  (void)b;
#endif
  return at::Tensor();
}

namespace {

// Either overload of ATen's fused Adam / AdamW: `lr` a double or (2.2+) a
// tensor on the parameters' device.
template <class Lr>
void fused_adam_any(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList max_exp_avg_sqs,
    at::TensorList state_steps,
    const Lr& lr,
    double beta1,
    double beta2,
    double weight_decay,
    double eps,
    bool amsgrad,
    bool decoupled,
    const c10::optional<at::Tensor>& found_inf) {
  constexpr bool tensor_lr = std::is_same_v<Lr, at::Tensor>;
#if COLOSSALAI_TORCH_AT_LEAST(2, 1)
  // The tensor overload came in 2.2 (a discarded branch is not compiled).
  if constexpr (!tensor_lr || COLOSSALAI_TORCH_AT_LEAST(2, 2)) {
    if (decoupled) {
      at::_fused_adamw_(
          params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
          lr, beta1, beta2, weight_decay, eps, amsgrad, /*maximize=*/false,
          /*grad_scale=*/c10::nullopt, found_inf);
    } else {
      at::_fused_adam_(
          params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
          lr, beta1, beta2, weight_decay, eps, amsgrad, /*maximize=*/false,
          /*grad_scale=*/c10::nullopt, found_inf);
    }
    return;
  }
#endif
  (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs;
  (void)max_exp_avg_sqs, (void)state_steps, (void)lr, (void)beta1;
  (void)beta2, (void)weight_decay, (void)eps, (void)amsgrad, (void)decoupled;
  (void)found_inf;
  TORCH_CHECK(
      false,
      "fused_adam_: this LibTorch has no fused Adam",
      tensor_lr ? " taking a tensor learning rate (2.2+)" : "");
}

} // namespace

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
    const c10::optional<at::Tensor>& found_inf) {
  fused_adam_any(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                 state_steps, lr, beta1, beta2, weight_decay, eps, amsgrad,
                 decoupled, found_inf);
}

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
    const c10::optional<at::Tensor>& found_inf) {
  fused_adam_any(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                 state_steps, lr, beta1, beta2, weight_decay, eps, amsgrad,
                 decoupled, found_inf);
}

at::Tensor layer_norm(
    const at::Tensor& x,
    at::IntArrayRef normalized_shape,
    const at::Tensor& weight,
    const at::Tensor& bias,
    double eps) {
#if !COLOSSALAI_TORCH_AT_LEAST(2, 1)
  if (x.is_cpu() && weight.defined() &&
      x.scalar_type() != weight.scalar_type()) {
    return at::layer_norm(
               x.to(weight.scalar_type()), normalized_shape, weight, bias, eps)
        .to(x.scalar_type());
  }
#endif
  return at::layer_norm(x, normalized_shape, weight, bias, eps);
}

bool stream_capturing(at::Device device) {
#ifdef COLOSSALAI_WITH_CUDA
  if (!device.is_cuda()) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(
      c10::cuda::getCurrentCUDAStream().stream(), &status));
  return status != cudaStreamCaptureStatusNone;
#else
  (void)device;
  return false;
#endif
}

#if COLOSSALAI_TORCH_AT_LEAST(2, 4)
c10::optional<at::ScalarType> autocast_dtype(at::DeviceType device) {
  if (!at::autocast::is_autocast_enabled(device)) {
    return c10::nullopt;
  }
  return at::autocast::get_autocast_dtype(device);
}

AutocastGuard::AutocastGuard(at::DeviceType device, at::ScalarType dtype)
    : device_(device),
      prev_enabled_(at::autocast::is_autocast_enabled(device)),
      prev_dtype_(at::autocast::get_autocast_dtype(device)) {
  at::autocast::set_autocast_enabled(device, true);
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
}
#else
c10::optional<at::ScalarType> autocast_dtype(at::DeviceType device) {
  const bool cpu = device == at::kCPU;
  if (!(cpu ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled())) {
    return c10::nullopt;
  }
  return cpu ? at::autocast::get_autocast_cpu_dtype()
             : at::autocast::get_autocast_gpu_dtype();
}

AutocastGuard::AutocastGuard(at::DeviceType device, at::ScalarType dtype)
    : device_(device) {
  if (device == at::kCPU) {
    prev_enabled_ = at::autocast::is_cpu_enabled();
    prev_dtype_ = at::autocast::get_autocast_cpu_dtype();
    at::autocast::set_cpu_enabled(true);
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    prev_enabled_ = at::autocast::is_enabled();
    prev_dtype_ = at::autocast::get_autocast_gpu_dtype();
    at::autocast::set_enabled(true);
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  if (device_ == at::kCPU) {
    at::autocast::set_cpu_enabled(prev_enabled_);
    at::autocast::set_autocast_cpu_dtype(prev_dtype_);
  } else {
    at::autocast::set_enabled(prev_enabled_);
    at::autocast::set_autocast_gpu_dtype(prev_dtype_);
  }
}
#endif

namespace {

// The mask of `scaled_dot_product_attention` combined with the causal one
// (true = attend), or undefined where there is neither.
at::Tensor attention_mask(
    const at::Tensor& q,
    const at::Tensor& k,
    const c10::optional<at::Tensor>& mask,
    bool is_causal) {
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(
        mask->scalar_type() == at::kBool,
        "scaled_dot_product_attention: the mask must be boolean (true = "
        "attend), got ",
        mask->scalar_type());
    m = *mask;
  }
  if (is_causal) {
    const int64_t tq = q.size(-2), tk = k.size(-2);
    auto causal = at::ones({tq, tk}, q.options().dtype(at::kBool))
                      .tril(/*diagonal=*/tk - tq);
    m = m.defined() ? at::logical_and(m, causal) : causal;
  }
  return m;
}

} // namespace

namespace {

// How many query heads each key/value head of `kv` serves (grouped-query
// attention when above 1).
int64_t query_heads_per_kv(const at::Tensor& q, const at::Tensor& kv) {
  const int64_t h = q.size(-3), h_kv = kv.size(-3);
  TORCH_CHECK(
      h_kv > 0 && h % h_kv == 0,
      "scaled_dot_product_attention: ",
      h,
      " query heads are not a multiple of ",
      h_kv,
      " key/value heads");
  return h / h_kv;
}

// The key/value heads repeated to the query heads' count (transformers'
// repeat_kv: an expanded view made whole; LibTorch 1.13's repeat_interleave
// reads its output's length back to the host).
at::Tensor repeat_heads(const at::Tensor& kv, const at::Tensor& q) {
  const int64_t n = query_heads_per_kv(q, kv);
  if (n == 1) {
    return kv;
  }
  auto sizes = kv.sizes().vec();
  sizes.insert(sizes.end() - 2, n); // [..., H_kv, n, T, D]
  auto whole = sizes;
  whole.erase(whole.end() - 3);
  whole[whole.size() - 3] *= n; // [..., H_kv * n, T, D]
  return kv.unsqueeze(-3).expand(sizes).reshape(whole);
}

} // namespace

at::Tensor explicit_attention(
    const at::Tensor& q,
    const at::Tensor& k_in,
    const at::Tensor& v_in,
    const c10::optional<at::Tensor>& mask,
    bool is_causal) {
  const auto k = repeat_heads(k_in, q), v = repeat_heads(v_in, q);
  auto att = at::matmul(q, k.transpose(-2, -1)) *
      (1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  auto m = attention_mask(q, k, mask, is_causal);
  if (m.defined()) {
    att = att.masked_fill(
        m.logical_not(), -std::numeric_limits<double>::infinity());
  }
  return at::matmul(at::softmax(att, -1), v);
}

#if COLOSSALAI_TORCH_AT_LEAST(2, 0)
namespace {

// What scaled_dot_product_attention hands at::scaled_dot_product_attention:
// the mask (an explicit one may not be combined with is_causal, so it takes
// the causal one folded in; the kernels' causal mask is aligned top-left,
// so a shorter query block takes the explicit one too), the causal flag,
// and from 2.5 grouped-query attention read in place (no repeated copy of
// k and v: a decoding step would copy the whole cache).
struct SdpaArgs {
  at::Tensor k, v;
  c10::optional<at::Tensor> mask;
  bool causal = false;
  bool gqa = false;
};

SdpaArgs sdpa_args(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const c10::optional<at::Tensor>& mask,
    bool is_causal) {
  SdpaArgs a;
  const bool masked = mask.has_value() && mask->defined();
  const bool own_causal = !masked && (!is_causal || q.size(-2) == k.size(-2));
  if (!own_causal) {
    a.mask = attention_mask(q, k, mask, is_causal);
  }
  a.causal = own_causal && is_causal;
#if COLOSSALAI_TORCH_AT_LEAST(2, 5)
  a.gqa = query_heads_per_kv(q, k) > 1;
  a.k = k;
  a.v = v;
#else
  a.k = repeat_heads(k, q);
  a.v = repeat_heads(v, q);
#endif
  return a;
}

} // namespace
#endif

at::Tensor scaled_dot_product_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const c10::optional<at::Tensor>& mask,
    bool is_causal) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 5)
  const auto a = sdpa_args(q, k, v, mask, is_causal);
  return at::scaled_dot_product_attention(
      q, a.k, a.v, a.mask, 0.0, a.causal, c10::nullopt, a.gqa);
#elif COLOSSALAI_TORCH_AT_LEAST(2, 0)
  const auto a = sdpa_args(q, k, v, mask, is_causal);
  return at::scaled_dot_product_attention(q, a.k, a.v, a.mask, 0.0, a.causal);
#else
  return explicit_attention(q, k, v, mask, is_causal);
#endif
}

std::string sdpa_backend(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const c10::optional<at::Tensor>& mask,
    bool is_causal) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 0)
  const auto a = sdpa_args(q, k, v, mask, is_causal);
#if COLOSSALAI_TORCH_AT_LEAST(2, 5)
  const int64_t choice = at::_fused_sdp_choice(
      q, a.k, a.v, a.mask, 0.0, a.causal, c10::nullopt, a.gqa);
#else
  const int64_t choice =
      at::_fused_sdp_choice(q, a.k, a.v, a.mask, 0.0, a.causal);
#endif
  // at::SDPBackend's values.
  switch (choice) {
    case 0:
      return "math";
    case 1:
      return "flash";
    case 2:
      return "efficient";
    case 3:
      return "cudnn";
    case 4:
      return "overrideable";
    default:
      return "unknown (" + std::to_string(choice) + ")";
  }
#else
  (void)q;
  (void)k;
  (void)v;
  (void)mask;
  (void)is_causal;
  return "explicit";
#endif
}

#if COLOSSALAI_TORCH_AT_LEAST(2, 5)
namespace {

bool sdpa_enabled(SdpaBackend b) {
  auto& c = at::globalContext();
  switch (b) {
    case SdpaBackend::math:
      return c.userEnabledMathSDP();
    case SdpaBackend::flash:
      return c.userEnabledFlashSDP();
    case SdpaBackend::efficient:
      return c.userEnabledMemEfficientSDP();
    case SdpaBackend::cudnn:
      return c.userEnabledCuDNNSDP();
  }
  return false;
}

void set_sdpa_enabled(SdpaBackend b, bool on) {
  auto& c = at::globalContext();
  switch (b) {
    case SdpaBackend::math:
      c.setSDPUseMath(on);
      break;
    case SdpaBackend::flash:
      c.setSDPUseFlash(on);
      break;
    case SdpaBackend::efficient:
      c.setSDPUseMemEfficient(on);
      break;
    case SdpaBackend::cudnn:
      c.setSDPUseCuDNN(on);
      break;
  }
}

constexpr SdpaBackend kSdpaBackends[] = {
    SdpaBackend::math,
    SdpaBackend::flash,
    SdpaBackend::efficient,
    SdpaBackend::cudnn};

} // namespace
#endif

SdpaKernelGuard::SdpaKernelGuard(const std::vector<SdpaBackend>& allowed) {
#if COLOSSALAI_TORCH_AT_LEAST(2, 5)
  TORCH_CHECK(
      !allowed.empty(),
      "SdpaKernelGuard: allow at least one attention kernel");
  for (const auto b : kSdpaBackends) {
    before_[static_cast<int>(b)] = sdpa_enabled(b);
  }
  for (const auto b : kSdpaBackends) {
    set_sdpa_enabled(
        b, std::find(allowed.begin(), allowed.end(), b) != allowed.end());
  }
#else
  (void)allowed;
  TORCH_CHECK(
      false,
      "SdpaKernelGuard: choosing scaled_dot_product_attention's kernels "
      "needs LibTorch 2.5 or later; this is ",
      TORCH_VERSION);
#endif
}

SdpaKernelGuard::~SdpaKernelGuard() {
#if COLOSSALAI_TORCH_AT_LEAST(2, 5)
  for (const auto b : kSdpaBackends) {
    set_sdpa_enabled(b, before_[static_cast<int>(b)]);
  }
#endif
}

} // namespace compat
} // namespace colossalai
