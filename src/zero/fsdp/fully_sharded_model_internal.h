#pragma once

// Helpers shared by the FullyShardedModel sources: process groups and the
// building of units (defined in fully_sharded_model_units.cpp).

#include "state.h"

#include <vector>

namespace colossalai {
namespace zero {
namespace detail {

void make_groups(FsdpState& st, const distributed::ProcessGroupPtr& dp);

void prepare_module(
    FsdpState& st,
    torch::nn::Module& module,
    at::ScalarType buffer_dtype,
    const distributed::ProcessGroup& dp,
    bool params);

void lay_out_unit(FsdpState& st, Unit& u);

void build_unit(
    FsdpState& st,
    Unit& u,
    at::Tensor shard32 = at::Tensor(),
    const std::vector<std::vector<int64_t>>* sizes = nullptr);

} // namespace detail
} // namespace zero
} // namespace colossalai
