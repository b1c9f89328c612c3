#include <colossalai/lazy/lazy_init.h>
#include <colossalai/shardformer/layer/parallel_module.h>

#include <ATen/core/grad_mode.h>

namespace colossalai {
namespace shardformer {
namespace layer {

ShardSpec ShardSpec::split(
    int64_t dim,
    int64_t full_size,
    distributed::ProcessGroupPtr group) {
  TORCH_CHECK(dim >= 0, "ShardSpec::split: dim must be >= 0, got ", dim);
  ShardSpec s;
  s.dim = dim;
  s.full_size = full_size;
  s.padded_size = full_size;
  s.group = std::move(group);
  return s;
}

ShardSpec ShardSpec::with_sections(int64_t n) const {
  TORCH_CHECK(
      n >= 1 && padded_size % n == 0,
      "ShardSpec: ",
      padded_size,
      " do not form ",
      n,
      " equal sections");
  TORCH_CHECK(
      n == 1 || padded_size == full_size,
      "ShardSpec: padding and fused sections do not combine");
  ShardSpec s = *this;
  s.sections = n;
  return s;
}

ShardSpec ShardSpec::with_padding(int64_t padded) const {
  TORCH_CHECK(
      padded >= full_size && sections == 1,
      "ShardSpec: padded size ",
      padded,
      " must be >= the full size ",
      full_size,
      " and have no sections");
  ShardSpec s = *this;
  s.padded_size = padded;
  return s;
}

namespace {

// Group rank `rank`'s shard as a view where it is one plain slice of `full`
// (the split rule of shard_tensor without padding or sections); else an
// undefined tensor.
at::Tensor plain_slice(
    const at::Tensor& full,
    const ShardSpec& spec,
    int world,
    int rank) {
  if (spec.sections != 1 || spec.padded_size != spec.full_size ||
      spec.dim >= full.dim() || full.size(spec.dim) != spec.full_size ||
      spec.full_size % world != 0) {
    return at::Tensor();
  }
  const int64_t len = spec.full_size / world;
  return full.narrow(spec.dim, rank * len, len);
}

} // namespace

at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec) {
  return shard_tensor(full, spec, spec.size(), spec.rank());
}

at::Tensor shard_view(const at::Tensor& full, const ShardSpec& spec) {
  if (!spec.is_split()) {
    return full;
  }
  return plain_slice(full, spec, spec.size(), spec.rank());
}

at::Tensor shard_tensor(
    const at::Tensor& full,
    const ShardSpec& spec,
    int world,
    int rank) {
  if (!spec.is_split()) {
    return full.clone();
  }
  TORCH_CHECK(
      spec.dim < full.dim() && full.size(spec.dim) == spec.full_size,
      "shard_tensor: a tensor of shape ",
      full.sizes(),
      " does not have the full size ",
      spec.full_size,
      " along dimension ",
      spec.dim);
  TORCH_CHECK(
      spec.padded_size % (spec.sections * world) == 0,
      "shard_tensor: ",
      spec.padded_size,
      " along dimension ",
      spec.dim,
      " do not split into ",
      spec.sections,
      " section(s) over ",
      world,
      " ranks");
  at::Tensor plain = plain_slice(full, spec, world, rank);
  if (plain.defined()) {
    return plain.clone(at::MemoryFormat::Contiguous);
  }
  at::Tensor t = full;
  if (spec.padded_size > spec.full_size) {
    auto shape = full.sizes().vec();
    shape[spec.dim] = spec.padded_size - spec.full_size;
    t = at::cat({full, at::zeros(shape, full.options())}, spec.dim);
  }
  std::vector<at::Tensor> parts;
  for (const auto& section : t.chunk(spec.sections, spec.dim)) {
    parts.push_back(section.chunk(world, spec.dim)[rank]);
  }
  return at::cat(parts, spec.dim).contiguous();
}

at::Tensor unshard_tensor(
    const std::vector<at::Tensor>& shards,
    const ShardSpec& spec) {
  TORCH_CHECK(!shards.empty(), "unshard_tensor: no shards");
  if (!spec.is_split()) {
    return shards[0];
  }
  std::vector<std::vector<at::Tensor>> by_section(spec.sections);
  for (const auto& s : shards) {
    auto pieces = s.chunk(spec.sections, spec.dim);
    for (int64_t k = 0; k < spec.sections; ++k) {
      by_section[k].push_back(pieces[k]);
    }
  }
  std::vector<at::Tensor> sections;
  for (auto& parts : by_section) {
    sections.push_back(at::cat(parts, spec.dim));
  }
  auto full = at::cat(sections, spec.dim);
  return full.size(spec.dim) > spec.full_size
      ? full.narrow(spec.dim, 0, spec.full_size).contiguous()
      : full;
}

namespace detail {

void shard_param_(at::Tensor& param, const ShardSpec& spec) {
  if (!param.defined() || !spec.is_split()) {
    return;
  }
  // A lazy parameter (NOTE [Lazy initialization]) is cut when it is
  // materialised, so it is never whole.
  if (lazy::transform_lazy(param, [spec](const at::Tensor& full) {
        return shard_tensor(full, spec);
      })) {
    return;
  }
  at::NoGradGuard no_grad;
  param.set_data(shard_tensor(param.detach(), spec));
}

} // namespace detail

} // namespace layer
} // namespace shardformer
} // namespace colossalai
