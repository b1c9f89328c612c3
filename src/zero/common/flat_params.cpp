#include "flat_params.h"

#include <colossalai/nn/optimizer/hybrid_adam.h>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

namespace colossalai {
namespace zero {
namespace detail {

bool steps_from_low_precision_grads(const torch::optim::Optimizer& optimizer) {
  // FusedAdam / FusedAdamW derive from Adam / AdamW.
  return dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr ||
      dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr ||
      dynamic_cast<const nn::optimizer::HybridAdam*>(&optimizer) != nullptr;
}

FlatShardLayout FlatShardLayout::of(
    const std::vector<at::Tensor>& params,
    int world,
    int rank) {
  TORCH_INTERNAL_ASSERT(world >= 1 && rank >= 0 && rank < world);
  FlatShardLayout l;
  l.world = world;
  l.rank = rank;
  for (const auto& p : params) {
    l.offsets.push_back(l.numel);
    l.numels.push_back(p.numel());
    l.numel += p.numel();
  }
  l.shard = (l.numel + world - 1) / world;
  const int64_t lo_shard = rank * l.shard;
  const int64_t hi_shard = lo_shard + l.shard;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t lo = std::max(l.offsets[i], lo_shard);
    const int64_t hi = std::min(l.offsets[i] + l.numels[i], hi_shard);
    PieceRange r;
    if (hi > lo) {
      r = {lo - lo_shard, lo - l.offsets[i], hi - lo};
    }
    l.ranges.push_back(r);
  }
  return l;
}

at::Tensor FlatShardLayout::empty_flat(const at::TensorOptions& options) const {
  auto flat = at::empty({padded()}, options);
  if (padded() > numel) {
    flat.narrow(0, numel, padded() - numel).zero_();
  }
  return flat;
}

at::Tensor FlatShardLayout::flatten(
    const std::vector<at::Tensor>& tensors,
    const at::TensorOptions& options) const {
  TORCH_INTERNAL_ASSERT(tensors.size() == offsets.size());
  auto flat = empty_flat(options);
  for (size_t i = 0; i < tensors.size(); ++i) {
    copy_into(flat, i, tensors[i]);
  }
  return flat;
}

void FlatShardLayout::copy_into(
    at::Tensor& flat,
    size_t i,
    const at::Tensor& tensor) const {
  auto dst = flat.narrow(0, offsets[i], numels[i]);
  if (tensor.defined()) {
    dst.copy_(tensor.detach().reshape({-1}));
  } else {
    dst.zero_();
  }
}

at::Tensor FlatShardLayout::view(
    const at::Tensor& flat,
    size_t i,
    at::IntArrayRef sizes) const {
  return flat.narrow(0, offsets[i], numels[i]).view(sizes);
}

void FlatParams::make_pieces() {
  pieces.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    auto piece = layout.piece(shard_data, i).detach();
    piece.set_requires_grad(params[i].requires_grad());
    if (params[i].requires_grad()) {
      piece.mutable_grad() = layout.piece(shard_grad, i);
    }
    pieces.push_back(piece);
  }
}

void accumulate_grad(
    FlatParams& g,
    const at::Tensor& reduced,
    utils::HostCopies& copies) {
  auto& dst = g.shard_grad;
  if (g.grad_is_zero) { // a copy, overlapped where it crosses to the host
    copies.copy(dst, reduced);
  } else if (reduced.device() == dst.device()) {
    dst.add_(reduced); // reads the reduced dtype as it goes
  } else {
    copies.wait(); // a copy into this shard may still be landing
    dst.add_(reduced.to(dst.device(), dst.scalar_type()));
  }
  g.grad_is_zero = false;
}

bool step_group_ahead(
    nn::optimizer::HybridAdam& optimizer,
    const FlatParams& g,
    size_t k,
    const utils::HostCopies& copies,
    at::Tensor dst,
    const at::Device& device,
    const std::shared_ptr<StepsAhead>& ahead) {
  std::vector<at::Tensor> pieces;
  for (const auto& piece : g.pieces) {
    if (piece.grad().defined()) {
      pieces.push_back(piece);
    }
  }
  const auto landed = copies.landed();
  const auto after = utils::StreamPoint::now(device);
  std::function<void()> upload;
  if (dst.defined()) {
    upload = [ahead, k, after, dst, src = g.shard_data] {
      ahead->add_upload(k, utils::upload_after(after, dst, src));
    };
  }
  const bool taken =
      optimizer.step_ahead(
          pieces, [landed] { landed.synchronize(); }, std::move(upload)) > 0;
  if (taken) {
    ahead->note_taken(k);
  }
  return taken;
}

distributed::Work all_gather_flat(
    at::Tensor& full,
    const at::Tensor& shard,
    const FlatShardLayout& layout,
    const distributed::ProcessGroup* group) {
  if (layout.world == 1 || group == nullptr) {
    full.copy_(shard);
    return distributed::Work();
  }
  return distributed::all_gather(full, shard, *group);
}

} // namespace detail
} // namespace zero
} // namespace colossalai
