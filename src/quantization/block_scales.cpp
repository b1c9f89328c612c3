#include "block_scales.h"

#include <ATen/ATen.h>

namespace colossalai {
namespace quantization {
namespace detail {

void check_scales(const QuantState4bit& st, int64_t blocks, const char* op) {
  TORCH_CHECK(
      st.absmax.defined() && st.absmax.numel() >= blocks,
      op,
      ": ",
      st.absmax.defined() ? st.absmax.numel() : 0,
      " absmax values for ",
      blocks,
      " blocks (a corrupt quantization state)");
  TORCH_CHECK(
      !st.nested ||
          (st.absmax.scalar_type() == at::kByte && st.state2_blocksize > 0 &&
           st.state2_code.defined() && st.state2_code.numel() == 256 &&
           st.state2_absmax.defined() &&
           st.state2_absmax.numel() >= ceil_div(blocks, st.state2_blocksize) &&
           st.offset.defined() && st.offset.numel() == 1),
      op,
      ": a corrupt nested quantization state (uint8 absmax codes, 256 code "
      "values, one second-level absmax per ",
      st.state2_blocksize,
      " blocks and one offset are expected)");
}

ScaleTensors::ScaleTensors(
    const QuantState4bit& st,
    int64_t blocks,
    const at::Device& device,
    const char* op) {
  check_scales(st, blocks, op);
  if (!st.nested) {
    absmax = st.absmax.to(device, at::kFloat).contiguous();
    return;
  }
  nested = st.absmax.to(device).contiguous();
  code2 = st.state2_code.to(device, at::kFloat).contiguous();
  absmax2 = st.state2_absmax.to(device, at::kFloat).contiguous();
  offset = st.offset.to(device, at::kFloat).reshape({1}).contiguous();
  blocksize2 = st.state2_blocksize;
}

CpuScales ScaleTensors::cpu() const {
  CpuScales s;
  if (!nested.defined()) {
    s.absmax = absmax.data_ptr<float>();
    return s;
  }
  s.nested = nested.data_ptr<uint8_t>();
  s.code2 = code2.data_ptr<float>();
  s.absmax2 = absmax2.data_ptr<float>();
  s.offset = offset.item<float>();
  s.blocksize2 = blocksize2;
  s.shift2 = exact_log2(blocksize2);
  return s;
}

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
kernels::cuda::BlockScales ScaleTensors::cuda() const {
  kernels::cuda::BlockScales s;
  if (!nested.defined()) {
    s.absmax = absmax.data_ptr<float>();
    return s;
  }
  s.nested_absmax = nested.data_ptr<uint8_t>();
  s.code2 = code2.data_ptr<float>();
  s.absmax2 = absmax2.data_ptr<float>();
  s.offset = offset.data_ptr<float>();
  s.blocksize2 = blocksize2;
  s.shift2 = exact_log2(blocksize2);
  return s;
}
#endif

} // namespace detail
} // namespace quantization
} // namespace colossalai
