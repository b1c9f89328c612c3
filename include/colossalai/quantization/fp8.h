#pragma once

/// FP8 communication (ColossalAI's `colossalai.quantization.fp8`): tensors
/// cross the network as 8-bit floats with one float32 scale per message, a
/// quarter of float32's bytes and half of bf16's.
///
/// A tensor is scaled so that its largest magnitude lands on the format's
/// largest finite value (448 for e4m3, 57344 for e5m2), cast with
/// round-to-nearest-even, and multiplied back by the inverse scale on
/// arrival. Each value then carries a relative error of at most 2^-4 (e4m3:
/// 3 mantissa bits) or 2^-3 (e5m2: 2 bits) of itself, plus float32's
/// rounding, while it stays in the format's normal range: above
/// amax * 2^-14 (e4m3) or amax * 2^-29 (e5m2); a smaller value is off by at
/// most half a subnormal step, amax * 2^-18 (e4m3) or amax * 2^-32 (e5m2).
/// An infinity turns its whole message into NaN and a NaN stays NaN, so
/// fp16's overflow check still sees them.
///
/// As in ColossalAI, e4m3 carries weights and activations (precision) and
/// e5m2 gradients (range). Needs LibTorch 2.1 or later (`fp8_supported`).
///
/// Example:
/// \code
///   namespace q = colossalai::quantization;
///   auto group = colossalai::distributed::world_group();
///   q::all_reduce_fp8(grad, *group, colossalai::distributed::ReduceOp::kAvg,
///                     "e5m2").wait();
/// \endcode

#include <colossalai/distributed/collectives.h>

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace colossalai {
namespace quantization {

/// Whether this LibTorch has the float8 dtypes (2.1 and later).
bool fp8_supported();

/// A tensor cast to FP8: its bytes (uint8, the input's shape) and the
/// float32 factor that turns them back into the input's values (shape [1]).
struct Fp8Tensor {
  at::Tensor data;
  at::Tensor scale_inv;
};

/// Casts `x` (float32, bf16 or fp16) to FP8 with one scale for the whole
/// tensor. `fp8_format`: "e4m3" or "e5m2".
Fp8Tensor cast_to_fp8(const at::Tensor& x, const std::string& fp8_format);

/// The values `q` stands for, as `dtype`.
at::Tensor cast_from_fp8(
    const Fp8Tensor& q,
    const std::string& fp8_format,
    at::ScalarType dtype);

/// distributed::all_gather with each rank's shard sent as FP8 (one scale per
/// shard). Every rank decodes every shard its own included, so all ranks
/// hold the same `output`. Default e4m3: it carries weights.
distributed::Work all_gather_fp8(
    at::Tensor& output,
    const at::Tensor& input,
    const distributed::ProcessGroup& group,
    const std::string& fp8_format = "e4m3");

/// distributed::reduce_scatter (kSum or kAvg) through FP8: the flat
/// `input` is split into one shard per rank (as `distributed::shard_range`
/// splits it), each shard cast under its own scale and sent to its owner by
/// an all-to-all; the owner adds what it receives in float32, in rank
/// order, into `output` (this rank's shard). Default e5m2: it carries
/// gradients.
distributed::Work reduce_scatter_fp8(
    at::Tensor& output,
    const at::Tensor& input,
    const distributed::ProcessGroup& group,
    distributed::ReduceOp op = distributed::ReduceOp::kSum,
    const std::string& fp8_format = "e5m2");

/// In-place all-reduce (kSum or kAvg) through FP8: a reduce_scatter_fp8
/// (each owner sums its shard in float32), then an all_gather_fp8 of the
/// sums, cast again. Every rank decodes the same bytes, so all end equal.
/// The all-to-all starts here, the all-gather when the Work is waited for
/// (is_completed() speaks of the all-to-all). Default e5m2: it carries
/// gradients.
distributed::Work all_reduce_fp8(
    at::Tensor& tensor,
    const distributed::ProcessGroup& group,
    distributed::ReduceOp op = distributed::ReduceOp::kSum,
    const std::string& fp8_format = "e5m2");

/// distributed::all_to_all (equal blocks) with each block sent as FP8 under
/// its own scale. Default e5m2.
distributed::Work all_to_all_fp8(
    at::Tensor& output,
    const at::Tensor& input,
    const distributed::ProcessGroup& group,
    const std::string& fp8_format = "e5m2");

/// distributed::all_to_all with uneven splits (rows of dim 0; the
/// dispatch and combine of expert parallelism) through FP8: the rows for
/// each rank cast under their own scale. Default e5m2.
distributed::Work all_to_all_fp8(
    at::Tensor& output,
    const at::Tensor& input,
    const distributed::ProcessGroup& group,
    const std::vector<int64_t>& output_splits,
    const std::vector<int64_t>& input_splits,
    const std::string& fp8_format = "e5m2");

/// Whether a plugin's `fp8_communication` compresses `group`'s traffic: when
/// its members span more than one node, as ColossalAI does (within a node,
/// NVLink or shared memory moves the bytes faster than the casts cost).
/// Ranks are placed on nodes as the launcher places them: LOCAL_WORLD_SIZE
/// consecutive global ranks per node. Without LOCAL_WORLD_SIZE (or
/// OpenMPI's / Slurm's equivalents) every group is compressed.
bool fp8_compresses(const distributed::ProcessGroup& group);
/// The same for a set of global ranks (e.g. two pipeline stages).
bool fp8_compresses(const std::vector<int>& global_ranks);

} // namespace quantization
} // namespace colossalai
