#include "cpu_adam_kernel.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#if defined(__x86_64__) || defined(__i386__)
// GCC 12 reports the intrinsics' own deliberately undefined vectors
// (_mm512_undefined_*) as maybe-uninitialized once they are inlined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define COLOSSALAI_CPU_ADAM_X86 1
#endif

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

namespace colossalai {
namespace nn {
namespace optimizer {

namespace detail {
namespace {

// Stands for "no copy" in the kernels' template arguments.
struct NoCopy {};

// Hides a product from the compiler so it cannot fuse it with the following
// add into an FMA: LibTorch's reference ops round after each multiply, and
// fusing only where the target happens to have FMA would make the ISAs
// disagree.
template <typename T>
inline __attribute__((always_inline)) T opaque(T x) {
#ifdef COLOSSALAI_CPU_ADAM_X86
  asm("" : "+x"(x));
#else
  asm("" : "+r"(x));
#endif
  return x;
}

// ---------------------------------------------------------------- scalar ---

inline float load_grad(const float* g) {
  return *g;
}
inline float load_grad(const c10::BFloat16* g) {
  return static_cast<float>(*g);
}
inline float load_grad(const c10::Half* g) {
  return static_cast<float>(*g);
}
inline void store_copy(NoCopy*, float) {}
inline void store_copy(float* o, float x) {
  *o = x;
}
// c10's constructors round to nearest even, exactly as Tensor::to() does.
inline void store_copy(c10::BFloat16* o, float x) {
  *o = c10::BFloat16(x);
}
inline void store_copy(c10::Half* o, float x) {
  *o = c10::Half(x);
}

template <typename G, typename O, bool kL2>
void scalar_kernel(
    const AdamBuffers& b,
    const AdamScalars& s,
    int64_t begin,
    int64_t end) {
  float* param = b.param;
  const G* grad = static_cast<const G*>(b.grad);
  float* exp_avg = b.exp_avg;
  float* exp_avg_sq = b.exp_avg_sq;
  O* copy = static_cast<O*>(b.copy);
  for (int64_t i = begin; i < end; ++i) {
    float p = param[i];
    float g = load_grad(grad + i);
    if (kL2) {
      g = g + opaque(s.l2 * p);
    }
    p = opaque(p * s.decay);
    const float m =
        opaque(exp_avg[i] * s.beta1) + opaque(s.one_minus_beta1 * g);
    const float v =
        opaque(exp_avg_sq[i] * s.beta2) + opaque((s.one_minus_beta2 * g) * g);
    const float denom = std::sqrt(v) / s.sqrt_bias_correction2 + s.eps;
    p = p + opaque(s.neg_step_size * m) / denom;
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (!std::is_same_v<O, NoCopy>) {
      store_copy(copy + i, p);
    }
  }
}

#ifdef COLOSSALAI_CPU_ADAM_X86

// ----------------------------------------------------------------- AVX2 ---

#define COLOSSALAI_AVX2 __attribute__((target("avx2,f16c"), always_inline))

COLOSSALAI_AVX2 inline __m256 opaque256(__m256 x) {
  asm("" : "+x"(x));
  return x;
}

struct Avx2Consts {
  __m256 beta1, one_minus_beta1, beta2, one_minus_beta2, eps, sqrt_bc2,
      neg_step, decay, l2;
};

COLOSSALAI_AVX2 inline __m256 avx2_load_grad(const float* g) {
  return _mm256_loadu_ps(g);
}
COLOSSALAI_AVX2 inline __m256 avx2_load_grad(const c10::BFloat16* g) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
COLOSSALAI_AVX2 inline __m256 avx2_load_grad(const c10::Half* g) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
}
COLOSSALAI_AVX2 inline void avx2_store_copy(NoCopy*, __m256) {}
COLOSSALAI_AVX2 inline void avx2_store_copy(float* o, __m256 x) {
  _mm256_storeu_ps(o, x);
}
COLOSSALAI_AVX2 inline void avx2_store_copy(c10::BFloat16* o, __m256 x) {
  // Round to nearest even as c10::BFloat16 does; NaN becomes 0x7FC0.
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb =
      _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  r = _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(r),
      _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)),
      nan));
  // Pack 8 x 32-bit (all <= 0xFFFF) to 8 x 16-bit.
  const __m256i packed = _mm256_packus_epi32(r, r);
  const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);
  _mm_storeu_si128(
      reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(ordered));
}
COLOSSALAI_AVX2 inline void avx2_store_copy(c10::Half* o, __m256 x) {
  _mm_storeu_si128(
      reinterpret_cast<__m128i*>(o),
      _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

template <typename G, typename O, bool kL2>
COLOSSALAI_AVX2 inline void avx2_block(
    const Avx2Consts& c,
    float* param,
    const G* grad,
    float* exp_avg,
    float* exp_avg_sq,
    O* copy) {
  __m256 p = _mm256_loadu_ps(param);
  __m256 g = avx2_load_grad(grad);
  if (kL2) {
    g = _mm256_add_ps(g, opaque256(_mm256_mul_ps(c.l2, p)));
  }
  p = opaque256(_mm256_mul_ps(p, c.decay));
  const __m256 m = _mm256_add_ps(
      opaque256(_mm256_mul_ps(_mm256_loadu_ps(exp_avg), c.beta1)),
      opaque256(_mm256_mul_ps(c.one_minus_beta1, g)));
  const __m256 v = _mm256_add_ps(
      opaque256(_mm256_mul_ps(_mm256_loadu_ps(exp_avg_sq), c.beta2)),
      opaque256(_mm256_mul_ps(_mm256_mul_ps(c.one_minus_beta2, g), g)));
  const __m256 denom =
      _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.sqrt_bc2), c.eps);
  p = _mm256_add_ps(
      p, _mm256_div_ps(opaque256(_mm256_mul_ps(c.neg_step, m)), denom));
  _mm256_storeu_ps(param, p);
  _mm256_storeu_ps(exp_avg, m);
  _mm256_storeu_ps(exp_avg_sq, v);
  avx2_store_copy(copy, p);
}

template <typename G, typename O, bool kL2>
__attribute__((target("avx2,f16c"))) void avx2_kernel(
    const AdamBuffers& b,
    const AdamScalars& s,
    int64_t begin,
    int64_t end) {
  const Avx2Consts c{
      _mm256_set1_ps(s.beta1),
      _mm256_set1_ps(s.one_minus_beta1),
      _mm256_set1_ps(s.beta2),
      _mm256_set1_ps(s.one_minus_beta2),
      _mm256_set1_ps(s.eps),
      _mm256_set1_ps(s.sqrt_bias_correction2),
      _mm256_set1_ps(s.neg_step_size),
      _mm256_set1_ps(s.decay),
      _mm256_set1_ps(s.l2)};
  const G* grad = static_cast<const G*>(b.grad);
  O* copy = static_cast<O*>(b.copy);
  constexpr int64_t W = 8;
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    avx2_block<G, O, kL2>(
        c,
        b.param + i,
        grad + i,
        b.exp_avg + i,
        b.exp_avg_sq + i,
        copy + (std::is_same_v<O, NoCopy> ? 0 : i));
  }
  if (i < end) {
    // The tail goes through the same vector code on padded copies, so an
    // element's result does not depend on where a chunk boundary falls.
    const int64_t r = end - i;
    float p[W] = {}, m[W] = {}, v[W] = {};
    G g[W] = {};
    O o[W] = {};
    std::memcpy(p, b.param + i, r * sizeof(float));
    std::memcpy(g, grad + i, r * sizeof(G));
    std::memcpy(m, b.exp_avg + i, r * sizeof(float));
    std::memcpy(v, b.exp_avg_sq + i, r * sizeof(float));
    avx2_block<G, O, kL2>(c, p, g, m, v, o);
    std::memcpy(b.param + i, p, r * sizeof(float));
    std::memcpy(b.exp_avg + i, m, r * sizeof(float));
    std::memcpy(b.exp_avg_sq + i, v, r * sizeof(float));
    if constexpr (!std::is_same_v<O, NoCopy>) {
      std::memcpy(copy + i, o, r * sizeof(O));
    }
  }
}

// -------------------------------------------------------------- AVX-512 ---

#define COLOSSALAI_AVX512 __attribute__((target("avx512f"), always_inline))

COLOSSALAI_AVX512 inline __m512 opaque512(__m512 x) {
  asm("" : "+v"(x));
  return x;
}

struct Avx512Consts {
  __m512 beta1, one_minus_beta1, beta2, one_minus_beta2, eps, sqrt_bc2,
      neg_step, decay, l2;
};

COLOSSALAI_AVX512 inline __m512 avx512_load_grad(const float* g) {
  return _mm512_loadu_ps(g);
}
COLOSSALAI_AVX512 inline __m512 avx512_load_grad(const c10::BFloat16* g) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
COLOSSALAI_AVX512 inline __m512 avx512_load_grad(const c10::Half* g) {
  return _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
}
COLOSSALAI_AVX512 inline void avx512_store_copy(NoCopy*, __m512) {}
COLOSSALAI_AVX512 inline void avx512_store_copy(float* o, __m512 x) {
  _mm512_storeu_ps(o, x);
}
COLOSSALAI_AVX512 inline void avx512_store_copy(c10::BFloat16* o, __m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb =
      _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
}
COLOSSALAI_AVX512 inline void avx512_store_copy(c10::Half* o, __m512 x) {
  _mm256_storeu_si256(
      reinterpret_cast<__m256i*>(o),
      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename G, typename O, bool kL2>
COLOSSALAI_AVX512 inline void avx512_block(
    const Avx512Consts& c,
    float* param,
    const G* grad,
    float* exp_avg,
    float* exp_avg_sq,
    O* copy) {
  __m512 p = _mm512_loadu_ps(param);
  __m512 g = avx512_load_grad(grad);
  if (kL2) {
    g = _mm512_add_ps(g, opaque512(_mm512_mul_ps(c.l2, p)));
  }
  p = opaque512(_mm512_mul_ps(p, c.decay));
  const __m512 m = _mm512_add_ps(
      opaque512(_mm512_mul_ps(_mm512_loadu_ps(exp_avg), c.beta1)),
      opaque512(_mm512_mul_ps(c.one_minus_beta1, g)));
  const __m512 v = _mm512_add_ps(
      opaque512(_mm512_mul_ps(_mm512_loadu_ps(exp_avg_sq), c.beta2)),
      opaque512(_mm512_mul_ps(_mm512_mul_ps(c.one_minus_beta2, g), g)));
  const __m512 denom =
      _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.sqrt_bc2), c.eps);
  p = _mm512_add_ps(
      p, _mm512_div_ps(opaque512(_mm512_mul_ps(c.neg_step, m)), denom));
  _mm512_storeu_ps(param, p);
  _mm512_storeu_ps(exp_avg, m);
  _mm512_storeu_ps(exp_avg_sq, v);
  avx512_store_copy(copy, p);
}

template <typename G, typename O, bool kL2>
__attribute__((target("avx512f"))) void avx512_kernel(
    const AdamBuffers& b,
    const AdamScalars& s,
    int64_t begin,
    int64_t end) {
  const Avx512Consts c{
      _mm512_set1_ps(s.beta1),
      _mm512_set1_ps(s.one_minus_beta1),
      _mm512_set1_ps(s.beta2),
      _mm512_set1_ps(s.one_minus_beta2),
      _mm512_set1_ps(s.eps),
      _mm512_set1_ps(s.sqrt_bias_correction2),
      _mm512_set1_ps(s.neg_step_size),
      _mm512_set1_ps(s.decay),
      _mm512_set1_ps(s.l2)};
  const G* grad = static_cast<const G*>(b.grad);
  O* copy = static_cast<O*>(b.copy);
  constexpr int64_t W = 16;
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    avx512_block<G, O, kL2>(
        c,
        b.param + i,
        grad + i,
        b.exp_avg + i,
        b.exp_avg_sq + i,
        copy + (std::is_same_v<O, NoCopy> ? 0 : i));
  }
  if (i < end) {
    const int64_t r = end - i;
    float p[W] = {}, m[W] = {}, v[W] = {};
    G g[W] = {};
    O o[W] = {};
    std::memcpy(p, b.param + i, r * sizeof(float));
    std::memcpy(g, grad + i, r * sizeof(G));
    std::memcpy(m, b.exp_avg + i, r * sizeof(float));
    std::memcpy(v, b.exp_avg_sq + i, r * sizeof(float));
    avx512_block<G, O, kL2>(c, p, g, m, v, o);
    std::memcpy(b.param + i, p, r * sizeof(float));
    std::memcpy(b.exp_avg + i, m, r * sizeof(float));
    std::memcpy(b.exp_avg_sq + i, v, r * sizeof(float));
    if constexpr (!std::is_same_v<O, NoCopy>) {
      std::memcpy(copy + i, o, r * sizeof(O));
    }
  }
}

#endif // COLOSSALAI_CPU_ADAM_X86

// ------------------------------------------------------------- dispatch ---

template <typename G, typename O, bool kL2>
void run(
    const AdamBuffers& b,
    const AdamScalars& s,
    int64_t begin,
    int64_t end,
    CpuAdamIsa isa) {
  switch (isa) {
#ifdef COLOSSALAI_CPU_ADAM_X86
    case CpuAdamIsa::kAvx512:
      avx512_kernel<G, O, kL2>(b, s, begin, end);
      return;
    case CpuAdamIsa::kAvx2:
      avx2_kernel<G, O, kL2>(b, s, begin, end);
      return;
#endif
    default:
      scalar_kernel<G, O, kL2>(b, s, begin, end);
  }
}

template <typename G, typename O>
void run_l2(
    const AdamBuffers& b,
    const AdamScalars& s,
    int64_t begin,
    int64_t end,
    CpuAdamIsa isa) {
  // A multiply by an L2 factor of 0 is not a no-op (0 * inf is NaN), so the
  // L2 term is compiled out unless it is used, as LibTorch skips it.
  if (s.l2 != 0.f) {
    run<G, O, true>(b, s, begin, end, isa);
  } else {
    run<G, O, false>(b, s, begin, end, isa);
  }
}

template <typename G>
void run_copy(
    const AdamBuffers& b,
    const AdamScalars& s,
    int64_t begin,
    int64_t end,
    CpuAdamIsa isa) {
  if (b.copy == nullptr) {
    run_l2<G, NoCopy>(b, s, begin, end, isa);
    return;
  }
  switch (b.copy_dtype) {
    case at::kFloat:
      run_l2<G, float>(b, s, begin, end, isa);
      break;
    case at::kBFloat16:
      run_l2<G, c10::BFloat16>(b, s, begin, end, isa);
      break;
    case at::kHalf:
      run_l2<G, c10::Half>(b, s, begin, end, isa);
      break;
    default:
      TORCH_CHECK(false, "HybridAdam: unsupported copy dtype ", b.copy_dtype);
  }
}

bool cpu_supports(CpuAdamIsa isa) {
  switch (isa) {
    case CpuAdamIsa::kAuto:
    case CpuAdamIsa::kScalar:
      return true;
#ifdef COLOSSALAI_CPU_ADAM_X86
    case CpuAdamIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case CpuAdamIsa::kAvx512:
      return __builtin_cpu_supports("avx512f");
#endif
    default:
      return false;
  }
}

CpuAdamIsa best_isa() {
  if (cpu_supports(CpuAdamIsa::kAvx512)) {
    return CpuAdamIsa::kAvx512;
  }
  if (cpu_supports(CpuAdamIsa::kAvx2)) {
    return CpuAdamIsa::kAvx2;
  }
  return CpuAdamIsa::kScalar;
}

CpuAdamIsa parse_isa(const std::string& s) {
  if (s == "auto") {
    return CpuAdamIsa::kAuto;
  }
  if (s == "scalar") {
    return CpuAdamIsa::kScalar;
  }
  if (s == "avx2") {
    return CpuAdamIsa::kAvx2;
  }
  if (s == "avx512") {
    return CpuAdamIsa::kAvx512;
  }
  TORCH_CHECK(
      false,
      "COLOSSALAI_CPU_ADAM_ISA must be auto, scalar, avx2 or avx512, got '",
      s,
      "'");
}

CpuAdamIsa resolve(CpuAdamIsa isa, const char* source) {
  TORCH_CHECK(
      cpu_supports(isa),
      source,
      ": this CPU does not support ",
      to_string(isa));
  return isa == CpuAdamIsa::kAuto ? best_isa() : isa;
}

// -1 until first use; then the resolved ISA.
std::atomic<int> g_isa{-1};

} // namespace

void adam_update_range(
    const AdamBuffers& b,
    const AdamScalars& s,
    int64_t begin,
    int64_t end,
    CpuAdamIsa isa) {
  switch (b.grad_dtype) {
    case at::kFloat:
      run_copy<float>(b, s, begin, end, isa);
      break;
    case at::kBFloat16:
      run_copy<c10::BFloat16>(b, s, begin, end, isa);
      break;
    case at::kHalf:
      run_copy<c10::Half>(b, s, begin, end, isa);
      break;
    default:
      TORCH_CHECK(false, "HybridAdam: unsupported grad dtype ", b.grad_dtype);
  }
}

void adam_update(const AdamBuffers& b, const AdamScalars& s) {
  const CpuAdamIsa isa = cpu_adam_isa();
  // 32K elements (~900 KB of traffic) per task keeps the fork/join cost
  // small next to the work; smaller parameters run on the calling thread.
  constexpr int64_t kGrain = 1 << 15;
  at::parallel_for(0, b.numel, kGrain, [&](int64_t begin, int64_t end) {
    adam_update_range(b, s, begin, end, isa);
  });
}

} // namespace detail

const char* to_string(CpuAdamIsa isa) {
  switch (isa) {
    case CpuAdamIsa::kAuto:
      return "auto";
    case CpuAdamIsa::kScalar:
      return "scalar";
    case CpuAdamIsa::kAvx2:
      return "avx2";
    case CpuAdamIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool cpu_adam_isa_supported(CpuAdamIsa isa) {
  return detail::cpu_supports(isa);
}

void set_cpu_adam_isa(CpuAdamIsa isa) {
  detail::g_isa.store(
      static_cast<int>(detail::resolve(isa, "set_cpu_adam_isa")));
}

CpuAdamIsa cpu_adam_isa() {
  int isa = detail::g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    const char* env = std::getenv("COLOSSALAI_CPU_ADAM_ISA");
    const CpuAdamIsa wanted = env != nullptr && *env != '\0'
        ? detail::parse_isa(env)
        : CpuAdamIsa::kAuto;
    isa = static_cast<int>(detail::resolve(wanted, "COLOSSALAI_CPU_ADAM_ISA"));
    int expected = -1;
    // A concurrent set_cpu_adam_isa() wins over the environment.
    if (!detail::g_isa.compare_exchange_strong(expected, isa)) {
      isa = expected;
    }
  }
  return static_cast<CpuAdamIsa>(isa);
}

} // namespace optimizer
} // namespace nn
} // namespace colossalai
