#include <colossalai/quantization/fp8.h>

#include <colossalai/utils/compat.h>
#include <colossalai/utils/env.h>

#include "fp8_rows.h"

#include <algorithm>

namespace colossalai {
namespace quantization {

bool fp8_supported() {
  return compat::has_float8();
}

bool detail::fp8_is_e4m3(const std::string& fp8_format, const char* op) {
  TORCH_CHECK(
      fp8_format == "e4m3" || fp8_format == "e5m2",
      op,
      ": fp8_format must be \"e4m3\" or \"e5m2\", got \"",
      fp8_format,
      "\"");
  TORCH_CHECK(
      compat::has_float8(),
      op,
      ": FP8 needs LibTorch 2.1 or later (this is ",
      TORCH_VERSION,
      "); turn fp8_communication off");
  return fp8_format == "e4m3";
}

at::Tensor detail::fp8_pack_rows(const at::Tensor& rows, bool e4m3) {
  TORCH_INTERNAL_ASSERT(rows.dim() == 2 && rows.scalar_type() == at::kFloat);
  const double largest = e4m3 ? 448.0 : 57344.0;
  // A row of zeros keeps scale 1. A NaN leaves amax NaN, so the comparison
  // keeps 1 and only the NaN itself decodes as NaN; an infinity makes the
  // scale 0 and the whole row NaN (inf * 0), which overflow checks see.
  auto amax = rows.abs().amax({1}, /*keepdim=*/true);
  amax = at::where(amax > 0, amax, at::ones_like(amax));
  const int64_t length = rows.size(1);
  auto packed =
      at::empty({rows.size(0), 4 + length}, rows.options().dtype(at::kByte));
  packed.narrow(1, 0, 4).copy_((amax / largest).view(at::kByte));
  // Cast as it is copied into each row's place.
  compat::float8_view(packed.narrow(1, 4, length), e4m3)
      .copy_(rows * (largest / amax));
  return packed;
}

at::Tensor detail::fp8_unpack_rows(const at::Tensor& packed, bool e4m3) {
  TORCH_INTERNAL_ASSERT(packed.dim() == 2 && packed.size(1) >= 4);
  // A fresh copy: a narrowed row keeps its parent's stride.
  auto inverse = packed.narrow(1, 0, 4)
                     .clone(at::MemoryFormat::Contiguous)
                     .view(at::kFloat);
  return compat::float8_view(packed.narrow(1, 4, packed.size(1) - 4), e4m3)
             .to(at::kFloat) *
      inverse;
}

Fp8Tensor cast_to_fp8(const at::Tensor& x, const std::string& fp8_format) {
  const bool e4m3 = detail::fp8_is_e4m3(fp8_format, "cast_to_fp8");
  TORCH_CHECK(
      x.is_floating_point() && x.element_size() >= 2,
      "cast_to_fp8: takes float32, bf16 or fp16, got ",
      x.scalar_type());
  if (x.numel() == 0) {
    return {
        at::empty(x.sizes(), x.options().dtype(at::kByte)),
        at::ones({1}, x.options().dtype(at::kFloat))};
  }
  auto packed = detail::fp8_pack_rows(x.to(at::kFloat).reshape({1, -1}), e4m3);
  return {
      packed.narrow(1, 4, x.numel()).reshape(x.sizes()),
      packed.narrow(1, 0, 4)
          .clone(at::MemoryFormat::Contiguous)
          .view(at::kFloat)
          .view({1})};
}

at::Tensor cast_from_fp8(
    const Fp8Tensor& q,
    const std::string& fp8_format,
    at::ScalarType dtype) {
  const bool e4m3 = detail::fp8_is_e4m3(fp8_format, "cast_from_fp8");
  TORCH_CHECK(
      q.data.scalar_type() == at::kByte,
      "cast_from_fp8: data must hold the FP8 bytes as uint8, got ",
      q.data.scalar_type());
  return (compat::float8_view(q.data, e4m3).to(at::kFloat) * q.scale_inv)
      .to(dtype);
}

bool fp8_compresses(const distributed::ProcessGroup& group) {
  return fp8_compresses(group.ranks());
}

bool fp8_compresses(const std::vector<int>& ranks) {
  if (ranks.size() < 2) {
    return false;
  }
  // torchrun's variable is also what `colossalai run` exports; OpenMPI's
  // and Slurm's come through read_dist_env.
  auto per_node = utils::read_dist_env().local_world_size;
  if (!per_node) {
    per_node = utils::env_int("LOCAL_WORLD_SIZE");
  }
  if (!per_node || *per_node < 1) {
    return true;
  }
  const auto [lo, hi] = std::minmax_element(ranks.begin(), ranks.end());
  return *lo / *per_node != *hi / *per_node;
}

} // namespace quantization
} // namespace colossalai
