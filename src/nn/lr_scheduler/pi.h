#pragma once

namespace colossalai {
namespace nn {
namespace lr_scheduler {
namespace detail {

/// Python's math.pi, which the cosine schedules use.
constexpr double kPi = 3.141592653589793;

} // namespace detail
} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
