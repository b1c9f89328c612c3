#pragma once

// The FP8 message format the casts and collectives share (internal): rows
// of float32 values become rows of bytes, each its float32 inverse scale
// (4 bytes) followed by its values' FP8 bytes, so that one collective moves
// the values and their scales together.

#include <ATen/ATen.h>

#include <string>

namespace colossalai {
namespace quantization {
namespace detail {

/// Checks `fp8_format` ("e4m3" or "e5m2") and that LibTorch has float8,
/// naming `op`; true for e4m3.
bool fp8_is_e4m3(const std::string& fp8_format, const char* op);

/// float32 [R, L] -> uint8 [R, 4 + L], each row scaled by its own amax.
at::Tensor fp8_pack_rows(const at::Tensor& rows, bool e4m3);

/// uint8 [R, 4 + L] -> float32 [R, L].
at::Tensor fp8_unpack_rows(const at::Tensor& packed, bool e4m3);

} // namespace detail
} // namespace quantization
} // namespace colossalai
