#pragma once

/// Ring attention (ColossalAI's `RingAttention`, sequence_parallelism_mode
/// "ring_attn"): causal softmax attention with the sequence split over a
/// sequence-parallel group. Each rank keeps its queries; the key / value
/// chunks travel around the ring (send to the next rank, receive from the
/// previous one, overlapped with the current chunk's block) and the blocks
/// are merged with an online softmax, so no rank ever holds the whole
/// sequence's keys and values nor a [T, T] score matrix. Backward recomputes
/// each block from the saved log-sum-exp (FlashAttention's backward) and
/// sends the key / value gradients around the ring with their chunk, back
/// to its owner.
///
/// Tokens are split zigzag (rank r holds chunks r and 2 sp - 1 - r of 2 sp),
/// so every rank has the same causal work; the causal mask compares global
/// positions, so any split works.
///
/// Double ring (ColossalAI's 2D ring, `inner_ring_size`): the sp ranks form
/// inner rings of consecutive ranks (one host's, ideally) joined by inter
/// rings. The chunks go round the inner ring; meanwhile each rank sends the
/// chunk it began the round with to the next inner ring, so every rank
/// crosses hosts once per inner round, with a whole round of blocks to hide
/// it, instead of a few ranks at the host boundaries crossing at every step.
///
/// Example:
/// \code
///   auto pos = zigzag_positions(T, sp->size());     // [sp, T / sp]
///   // q, k, v: [B, H, T / sp, D], this rank's tokens pos[sp->rank()]
///   auto y = ring_attention(q, k, v, pos, sp);       // [B, H, T / sp, D]
///   // Two inner rings of 4 over 8 ranks (two hosts of 4):
///   auto rings = get_double_ring_groups(sp, 4);      // every sp rank calls
///   auto z = ring_attention(q, k, v, pos, sp, rings);
/// \endcode

#include <colossalai/distributed/process_group.h>

#include <ATen/core/Tensor.h>

namespace colossalai {
namespace shardformer {
namespace layer {

/// The global positions of every rank's tokens under the zigzag split of a
/// sequence of `seq_len` over `sp_size` ranks: [sp_size, seq_len / sp_size]
/// int64, rank r's row holding chunks r and 2 sp_size - 1 - r of 2 sp_size.
/// seq_len must divide by 2 sp_size (one rank: 0 .. seq_len - 1).
at::Tensor zigzag_positions(int64_t seq_len, int sp_size);

/// The rings of double ring attention. `inner`: the ranks sp_rank /
/// inner_size x inner_size + 0 .. inner_size - 1 of sp; `inter`: the sp
/// ranks at this rank's place in every inner ring, in ring order. Empty
/// (null groups): one ring over sp.
struct DoubleRing {
  distributed::ProcessGroupPtr inner, inter;
  bool defined() const {
    return inner != nullptr;
  }
};

/// Creates this rank's inner and inter rings for inner rings of
/// `inner_ring_size` ranks (collective: every member of sp calls it, as
/// ColossalAI's `RingAttention.get_double_ring_groups`). inner_ring_size
/// must divide sp's size; 0 or sp's size give the empty DoubleRing (one
/// ring).
DoubleRing get_double_ring_groups(
    const distributed::ProcessGroupPtr& sp,
    int inner_ring_size);

/// Causal attention of this rank's q [B, H, T_l, D] over every rank's k, v
/// [B, H, T_l, D] (as many heads as q: repeat grouped key / value heads
/// first). `positions` [sp, T_l]: the global positions of each rank's
/// tokens (row r: rank r's), best on the host: which blocks the causal
/// mask empties, fills or cuts is decided there (device positions are
/// copied back once per call). Scores and the softmax run in fp32; the
/// output has q's dtype. A null or one-rank `sp` is plain causal attention.
/// `rings`: the double ring of sp (get_double_ring_groups), empty for one
/// ring.
at::Tensor ring_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& positions,
    const distributed::ProcessGroupPtr& sp,
    const DoubleRing& rings = {});

} // namespace layer
} // namespace shardformer
} // namespace colossalai
