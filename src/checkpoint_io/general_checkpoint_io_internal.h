#pragma once

// Helpers shared by the files of GeneralCheckpointIO (internal).

#include <ATen/ATen.h>

#include <functional>
#include <string>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

// A tensor that owns exactly its bytes: a view of a larger buffer would keep
// the whole buffer alive (and a pickle would write all of it).
at::Tensor compact(const at::Tensor& t);

// Runs `f` unless an error was recorded; records the error it throws.
void guarded(std::string& error, const std::function<void()>& f);

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
