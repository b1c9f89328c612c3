#pragma once

// Helpers shared by the files of the safetensors reader and writer
// (internal).

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

namespace colossalai {
namespace checkpoint_io {
namespace safetensors {
namespace detail {

using Json = nlohmann::ordered_json;

/// The safetensors name of `dtype` (F64 ... BOOL), or nullptr for a dtype
/// that safetensors files here do not hold.
const char* dtype_name(at::ScalarType dtype);

} // namespace detail
} // namespace safetensors
} // namespace checkpoint_io
} // namespace colossalai
