#pragma once

// The cross-entropy gradient kernel's launcher (cross_entropy.cu), over
// plain pointers (NOTE [Kernels]). Returns the launch's error.

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// Per row r of `logits` (rows x cols, row r at logits + r * ld, ld >= cols;
/// in place): with
/// lse = log(sum_j exp(x_j)) in float32 and t = target[r],
///   row_loss[r] = lse - x_t, and x_j := (exp(x_j - lse) - [j == t]) * scale[0],
/// each value rounded once to the element type; a row whose target is
/// `ignore_index` gets loss 0 and a zero gradient, one whose target is
/// outside [0, cols) a NaN loss and NaN gradient.
cudaError_t cross_entropy_grad(
    Dtype dtype,
    void* logits,
    const int64_t* target,
    int64_t ignore_index,
    const float* scale,
    float* row_loss,
    int64_t rows,
    int64_t cols,
    int64_t ld,
    cudaStream_t stream);

/// A vocabulary shard's rows (logits rows x cols, ld elements apart; the
/// first `real` columns are vocabulary, the rest padding): per row r, over the
/// real columns, row_max[r] = max_j x_j, row_sum[r] = sum_j exp(x_j -
/// row_max[r]) in float32 (-inf and 0 for a row of -inf), and picked[r] =
/// x_{t - start} when this shard holds t = target[r] (t != ignore_index,
/// start <= t < start + real), 0 otherwise.
cudaError_t cross_entropy_shard_stats(
    Dtype dtype,
    const void* logits,
    const int64_t* target,
    int64_t ignore_index,
    int64_t start,
    int64_t real,
    float* row_max,
    float* row_sum,
    float* picked,
    int64_t rows,
    int64_t ld,
    cudaStream_t stream);

/// In place, from the group's log-sum-exp per row (`lse`) and each row's
/// scale (`k`: 0 for an ignored row): x_j := (exp(x_j - lse[r]) - [j + start
/// == t]) * k[r] over the real columns, 0 over the padding, rounded once.
cudaError_t cross_entropy_shard_grad(
    Dtype dtype,
    void* logits,
    const int64_t* target,
    int64_t ignore_index,
    int64_t start,
    int64_t real,
    const float* lse,
    const float* k,
    int64_t rows,
    int64_t cols,
    int64_t ld,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
