#pragma once

#include <colossalai/nn/optimizer/hybrid_adam.h>

namespace colossalai {
namespace nn {
namespace optimizer {

/// ColossalAI's `CPUAdam` is `HybridAdam` without the GPU path; here both are
/// one class, which updates CPU parameters with the fused CPU kernel and, in
/// CUDA builds, GPU parameters with fused ATen ops. The names are kept so
/// code ported from ColossalAI reads the same.
///
/// Example:
/// \code
///   colossalai::nn::optimizer::CPUAdam optimizer(
///       model->parameters(),
///       colossalai::nn::optimizer::CPUAdamOptions(1e-3).adamw_mode(false));
/// \endcode
using CPUAdam = HybridAdam;
using CPUAdamOptions = HybridAdamOptions;
using CPUAdamParamState = HybridAdamParamState;

} // namespace optimizer
} // namespace nn
} // namespace colossalai
