// Products with quantized weights: the few-row ones (NOTE [Few-row
// products on quantized weights] in bnb.h; a loop over the packed bytes on
// the CPU, the kernels of src/kernels/quantized_gemv.cu on a GPU) and
// LLM.int8's forward, which takes the int8 one for a few rows.

#include <colossalai/quantization/bnb.h>

#include <colossalai/utils/compat.h>

#include "block_scales.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "../kernels/cuda_launch.h"
#include "../kernels/quantized_gemv_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <atomic>

namespace colossalai {
namespace quantization {

namespace {

// The kernels' row limit (quantized_gemv_cuda.h's kGemvMaxRows): longer
// inputs go through in slices of this many rows.
constexpr int64_t kMaxRows = 8;

// bnb.h's default (see there).
std::atomic<int64_t> g_gemv_max_rows{4};

// Weight rows decoded side by side, and the columns of each pass: the
// rows stream in order (8 sequential reads), and x's 8 rows x 256 columns
// (8 KiB of fp32) stay in L1 while the 8 features take their products.
constexpr int64_t kGroup = 8;
constexpr int64_t kCols = 256;

// a . b in fp32, eight partial sums (the compiler's vector lanes).
inline float dot(const float* a, const float* b, int64_t n) {
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int l = 0; l < 8; ++l) {
      s[l] += a[j + l] * b[j + l];
    }
  }
  float t = 0.f;
  for (; j < n; ++j) {
    t += a[j] * b[j];
  }
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + t;
}

// out [m, n] from x [m, k] (fp32) and a weight [n, k] that `decode(f, c0,
// len, buf)` writes as fp32, len values of feature f from column c0. A
// thread takes its features kGroup at a time and their columns kCols at a
// time: each group's block is decoded once and multiplied with every row
// of x. Each block's dot product becomes Acc before it is added (int32 for
// int8: exact, see int8_linear_matmul); `store(r, f, acc)` writes the
// results.
template <typename Acc, typename Decode, typename Store>
void few_rows_cpu(
    const float* x,
    int64_t m,
    int64_t k,
    int64_t n,
    const Decode& decode,
    const Store& store) {
  const int64_t groups = (n + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    float buf[kGroup][kCols];
    Acc acc[kGroup][kMaxRows];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t f0 = g * kGroup;
      const int64_t fs = std::min(kGroup, n - f0);
      for (int64_t f = 0; f < fs; ++f) {
        std::fill(acc[f], acc[f] + m, Acc(0));
      }
      for (int64_t c0 = 0; c0 < k; c0 += kCols) {
        const int64_t len = std::min(kCols, k - c0);
        for (int64_t f = 0; f < fs; ++f) {
          decode(f0 + f, c0, len, buf[f]);
        }
        for (int64_t r = 0; r < m; ++r) {
          const float* xr = x + r * k + c0;
          for (int64_t f = 0; f < fs; ++f) {
            acc[f][r] += static_cast<Acc>(dot(buf[f], xr, len));
          }
        }
      }
      for (int64_t f = 0; f < fs; ++f) {
        for (int64_t r = 0; r < m; ++r) {
          store(r, f0 + f, acc[f][r]);
        }
      }
    }
  });
}

// Feature f's values from column c0 of the 4-bit weight [n, k], each its
// code times its block's scale rounded to T (as the dequantizer rounds it),
// through a 16-entry table per block.
template <typename T>
struct Decode4bit {
  const uint8_t* packed;
  const detail::CpuScales* scale;
  const float* code;
  int64_t blocksize, k;

  void operator()(int64_t f, int64_t c0, int64_t len, float* buf) const {
    int64_t i = f * k + c0;
    const int64_t end = i + len;
    float table[16];
    // One division per call: a 64-bit divide per block costs about as much
    // as decoding the block.
    for (int64_t b = i / blocksize; i < end; ++b) {
      detail::block_table<T>(code, (*scale)(b), table);
      const int64_t stop = std::min(end, (b + 1) * blocksize);
      if (i % 2 != 0) { // starts at a low nibble
        *buf++ = table[packed[i / 2] & 15];
        ++i;
      }
      for (; i + 1 < stop; i += 2) {
        const uint8_t byte = packed[i / 2];
        *buf++ = table[byte >> 4];
        *buf++ = table[byte & 15];
      }
      if (i < stop) {
        *buf++ = table[packed[i / 2] >> 4];
        ++i;
      }
    }
  }
};

bool kernel_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// The fused product's device: the CPU, or a GPU with the kernels built.
bool fused_device(const at::Device& d) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (d.is_cuda()) {
    return true;
  }
#endif
  return d.is_cpu();
}

// a b^T exactly in int32 without the row-by-row pass: cuBLASLt where it
// takes the shapes, else fp32 (exact while k * 127^2 < 2^24, as
// bitsandbytes' CPU fallback; beyond, fp32 accumulation's rounding).
at::Tensor int8_mm_or_fp32(const at::Tensor& a, const at::Tensor& b) {
  auto acc = compat::int8_mm(a, b.t());
  if (!acc.defined()) {
    acc = at::matmul(a.to(at::kFloat), b.to(at::kFloat).t()).to(at::kInt);
  }
  return acc;
}

} // namespace

int64_t gemv_max_rows() {
  return g_gemv_max_rows.load();
}

void set_gemv_max_rows(int64_t rows) {
  TORCH_CHECK(
      rows >= 0 && rows <= kMaxRows,
      "set_gemv_max_rows: rows must be in [0, ",
      kMaxRows,
      "] (0 turns the fused few-row products off), got ",
      rows);
  g_gemv_max_rows.store(rows);
}

at::Tensor gemv_4bit(
    const at::Tensor& x,
    const at::Tensor& packed,
    const QuantState4bit& st) {
  TORCH_CHECK(
      st.shape.size() == 2,
      "gemv_4bit: the quantized tensor must be a 2-d weight [out, in], got "
      "shape ",
      at::IntArrayRef(st.shape));
  const int64_t n = st.shape[0], k = st.shape[1];
  TORCH_CHECK(
      x.defined() && x.dim() >= 1 && at::isFloatingType(x.scalar_type()) &&
          x.size(-1) == k,
      "gemv_4bit: x must be floating with ",
      k,
      " features (the weight is [",
      n,
      ", ",
      k,
      "]), got ",
      x.defined() ? x.sizes() : at::IntArrayRef());
  TORCH_CHECK(
      packed.scalar_type() == at::kByte && packed.numel() == (n * k + 1) / 2,
      "gemv_4bit: ",
      (n * k + 1) / 2,
      " packed uint8 bytes expected for [",
      n,
      ", ",
      k,
      "], got ",
      packed.numel(),
      " ",
      packed.scalar_type());
  TORCH_CHECK(
      packed.device() == x.device(),
      "gemv_4bit: x on ",
      x.device(),
      ", the packed weight on ",
      packed.device());
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  const auto device = x.device();
  if (!fused_device(device) || !kernel_dtype(x.scalar_type())) {
    return at::linear(x, dequantize_4bit(packed, st, x.scalar_type()));
  }
  const int64_t blocksize = st.blocksize;
  TORCH_CHECK(
      blocksize > 0 && st.code.defined() && st.code.numel() == 16,
      "gemv_4bit: a corrupt quantization state (blocksize ",
      blocksize,
      ", ",
      st.code.defined() ? st.code.numel() : 0,
      " code values; 16 expected)");
  const detail::ScaleTensors scales(
      st, detail::ceil_div(n * k, blocksize), device, "gemv_4bit");
  auto code = st.code.to(device, at::kFloat).contiguous();
  const auto bytes = packed.contiguous();
  const auto xs =
      x.reshape({x.numel() / std::max<int64_t>(k, 1), k}).contiguous();
  const int64_t m = xs.size(0);
  auto out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) {
    return out.reshape(out_shape);
  }
  if (k == 0) {
    return out.zero_().reshape(out_shape);
  }
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    const auto block_scales = scales.cuda();
    const auto dtype = kernels::cuda::dtype_of(x.scalar_type(), "gemv_4bit");
    const auto stream = c10::cuda::getCurrentCUDAStream().stream();
    for (int64_t r = 0; r < m; r += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, m - r);
      kernels::cuda::check_launch(
          kernels::cuda::gemv_4bit(
              dtype,
              static_cast<const char*>(xs.data_ptr()) +
                  r * k * xs.element_size(),
              rows,
              k,
              bytes.data_ptr<uint8_t>(),
              block_scales,
              code.data_ptr<float>(),
              blocksize,
              detail::exact_log2(blocksize),
              n,
              static_cast<char*>(out.data_ptr()) + r * n * out.element_size(),
              stream),
          "gemv_4bit",
          "the kernel's launch");
    }
    return out.reshape(out_shape);
  }
#endif
  const auto cpu_scales = scales.cpu();
  const auto xf = xs.to(at::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "gemv_4bit", [&] {
        const Decode4bit<scalar_t> decode{
            bytes.data_ptr<uint8_t>(),
            &cpu_scales,
            code.data_ptr<float>(),
            blocksize,
            k};
        for (int64_t r = 0; r < m; r += kMaxRows) {
          auto* y = out.data_ptr<scalar_t>() + r * n;
          few_rows_cpu<float>(
              xf.data_ptr<float>() + r * k,
              std::min(kMaxRows, m - r),
              k,
              n,
              decode,
              [&](int64_t row, int64_t f, float v) {
                y[row * n + f] = static_cast<scalar_t>(v);
              });
        }
      });
  return out.reshape(out_shape);
}

at::Tensor int8_linear_matmul(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(
      a.defined() && b.defined() && a.scalar_type() == at::kChar &&
          b.scalar_type() == at::kChar && a.dim() == 2 && b.dim() == 2 &&
          a.size(1) == b.size(1),
      "int8_linear_matmul: int8 a [m, k] and b [n, k] expected, got ",
      a.defined() ? a.sizes() : at::IntArrayRef(),
      " and ",
      b.defined() ? b.sizes() : at::IntArrayRef());
  TORCH_CHECK(
      a.device() == b.device(),
      "int8_linear_matmul: a on ",
      a.device(),
      ", b on ",
      b.device());
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  // The pass's int32 sums of fewer than 2^17 products of magnitude <= 2^14
  // (-128 * -128) cannot overflow.
  if (m > kMaxRows || k >= (int64_t(1) << 17) || !fused_device(a.device())) {
    return int8_mm_or_fp32(a, b);
  }
  const auto as = a.contiguous();
  const auto bs = b.contiguous();
  auto out = at::zeros({m, n}, a.options().dtype(at::kInt));
  if (m == 0 || n == 0 || k == 0) {
    return out;
  }
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (a.is_cuda()) {
    const c10::cuda::CUDAGuard guard(a.device());
    kernels::cuda::check_launch(
        kernels::cuda::int8_gemv(
            as.data_ptr<int8_t>(),
            m,
            k,
            bs.data_ptr<int8_t>(),
            n,
            out.data_ptr<int32_t>(),
            c10::cuda::getCurrentCUDAStream().stream()),
        "int8_linear_matmul",
        "the kernel's launch");
    return out;
  }
#endif
  // In fp32, exactly: int8 products and the sums of up to kCols of them
  // (256 * 127^2 < 2^24) are integers fp32 holds; the blocks' sums are then
  // added in int32.
  const auto af = as.to(at::kFloat);
  const int8_t* w = bs.data_ptr<int8_t>();
  int32_t* y = out.data_ptr<int32_t>();
  few_rows_cpu<int32_t>(
      af.data_ptr<float>(),
      m,
      k,
      n,
      [&](int64_t f, int64_t c0, int64_t len, float* buf) {
        const int8_t* v = w + f * k + c0;
        for (int64_t j = 0; j < len; ++j) {
          buf[j] = v[j];
        }
      },
      [&](int64_t row, int64_t f, int32_t v) { y[row * n + f] = v; });
  return out;
}

at::Tensor int8_linear(
    const at::Tensor& x,
    const at::Tensor& cb,
    const at::Tensor& scb,
    const at::Tensor& bias,
    double threshold) {
  TORCH_CHECK(
      cb.scalar_type() == at::kChar && cb.dim() == 2,
      "int8_linear: the weight must be 2-d int8, got ",
      cb.scalar_type(),
      " of shape ",
      cb.sizes());
  TORCH_CHECK(
      x.size(-1) == cb.size(1),
      "int8_linear: the input has ",
      x.size(-1),
      " features, the weight ",
      cb.size(1));
  auto a = x.reshape({-1, x.size(-1)});
  auto rows = int8_vectorwise_quant(a, threshold);
  // A few rows: one pass over the weight's bytes, exact. More: cuBLASLt
  // in int32 on a GPU, exact (bitsandbytes' CUDA path), else fp32
  // (bitsandbytes' CPU fallback; see int8_mm_or_fp32).
  const auto acc = rows.data.size(0) <= gemv_max_rows()
      ? int8_linear_matmul(rows.data, cb)
      : int8_mm_or_fp32(rows.data, cb);
  auto out = acc *
      (rows.stats.unsqueeze(-1) * scb.to(at::kFloat).unsqueeze(0)) *
      6.200124e-05;
  if (bias.defined()) {
    out = out + bias.to(at::kFloat);
  }
  out = out.to(x.scalar_type());
  if (rows.outlier_cols.numel() > 0) {
    // Outlier columns in the input's precision, with their weight columns
    // dequantized.
    auto sub_a = a.index_select(1, rows.outlier_cols);
    auto sub_b =
        int8_vectorwise_dequant(cb.index_select(1, rows.outlier_cols), scb)
            .to(x.scalar_type())
            .t();
    out = out.addmm(sub_a, sub_b);
  }
  auto shape = x.sizes().vec();
  shape.back() = cb.size(0);
  return out.reshape(shape);
}

} // namespace quantization
} // namespace colossalai
