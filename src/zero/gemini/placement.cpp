#include "placement.h"

#include "../fsdp/state.h"

#include <colossalai/utils/compat.h>

#include "../../utils/host_memory.h"

#include <algorithm>
#include <limits>

namespace colossalai {
namespace zero {
namespace gemini {

using detail::bytes_of;

namespace {

void check_fraction(double f, const char* option) {
  TORCH_CHECK(
      f >= 0.0 && f <= 1.0, "FSDP: ", option, " must be in [0, 1], got ", f);
}

std::string mb(int64_t bytes) {
  return c10::str(static_cast<double>(bytes) / (1 << 20), " MB");
}

} // namespace

void MemoryTracer::record(int64_t non_model, bool warmup) {
  if (warmup) {
    if (index_ >= recorded_.size()) {
      recorded_.push_back(non_model);
    } else {
      recorded_[index_] = std::max(recorded_[index_], non_model);
    }
    max_ = std::max(max_, non_model);
  }
  ++index_;
}

int64_t MemoryTracer::next_period() const {
  if (index_ == 0 || index_ > recorded_.size()) {
    return max_;
  }
  int64_t v = recorded_[index_ - 1];
  if (index_ < recorded_.size()) {
    v = std::max(v, recorded_[index_]);
  }
  return v;
}

Placement::Placement(detail::FsdpState& state, PlacementOptions options)
    : st_(state), o_(std::move(options)) {
  check_fraction(o_.offload_param_fraction(), "offload_param_fraction");
  check_fraction(
      o_.warmup_non_model_data_ratio(), "warmup_non_model_data_ratio");
  check_fraction(o_.steady_cuda_cap_ratio(), "steady_cuda_cap_ratio");
  check_fraction(o_.gpu_margin_mem_ratio(), "gpu_margin_mem_ratio");
  TORCH_CHECK(
      o_.device_capacity() >= 0,
      "FSDP: device_capacity must be >= 0 (0: the device's), got ",
      o_.device_capacity());
}

void Placement::assign_tiers() {
  const bool autop = o_.policy() == PlacementPolicy::kAuto;
  const double optim_fraction =
      st_.o.cpu_offload() || autop ? 1.0 : o_.offload_optim_fraction();
  check_fraction(optim_fraction, "offload_optim_fraction");
  // PyTorch's CPU offload keeps the parameters on the host too.
  const double param_fraction =
      st_.o.cpu_offload() ? 1.0 : o_.offload_param_fraction();
  TORCH_CHECK(
      param_fraction == 0.0 || (!autop && optim_fraction == 1.0),
      "FSDP: offload_param_fraction needs static placement with every "
      "unit's fp32 shard in the host tier (offload_optim_fraction 1): a unit "
      "whose fp32 shard is on the device gathers from it");
  const double keep_fraction = o_.keep_gathered_fraction();
  check_fraction(keep_fraction, "keep_gathered_fraction");

  auto& units = st_.units;
  std::vector<int64_t> numels;
  int64_t total = 0;
  for (const auto& u : units) {
    int64_t n = 0;
    for (const auto& p : u.params) {
      n += p.numel();
    }
    numels.push_back(n);
    total += n;
  }
  // Units in order until the share is reached (the last one may pass it).
  auto mark = [&](double fraction, bool reverse, auto set) {
    int64_t done = 0;
    for (size_t i = 0; i < units.size() && fraction > 0.0; ++i) {
      const size_t k = reverse ? units.size() - 1 - i : i;
      if (done >= fraction * total) {
        break;
      }
      set(units[k]);
      done += numels[k];
    }
  };
  // With overlap_host_step the host share is the last units: the first
  // whose gradients the backward completes, so their host updates overlap
  // the backward of all the others (NOTE [Host steps overlap the
  // backward]).
  mark(optim_fraction, st_.o.overlap_host_step(), [](detail::Unit& u) {
    u.offloaded = true;
  });
  mark(
      param_fraction, false, [](detail::Unit& u) { u.param_offloaded = true; });
  // The last units are the first backward needs again.
  mark(keep_fraction, true, [](detail::Unit& u) { u.keep_gathered = true; });
}

void Placement::setup() {
  capacity_ = o_.device_capacity() > 0
      ? o_.device_capacity()
      : compat::device_memory_capacity(st_.device);
  if (o_.policy() == PlacementPolicy::kStatic) {
    for (auto& u : st_.units) {
      if (u.offloaded && !u.param_offloaded && u.numel() > 0) {
        u.param_shard =
            utils::to_device(u.shard_data, st_.device, st_.param_dtype);
        stats_.host_to_device += bytes_of(u.param_shard);
      }
    }
  }
  fixed_device_ = 0;
  for (const auto& p : st_.ignored_params) {
    fixed_device_ += bytes_of(p);
  }
  for (const auto& b : st_.scopes[0].module->buffers()) {
    fixed_device_ += bytes_of(b);
  }
  last_use_.assign(st_.units.size(), 0);
  use_positions_.assign(st_.units.size(), {});
  const int64_t model =
      device_model() + (st_.device.is_cpu() ? host_model() : 0);
  baseline_ = compat::memory_allocated(st_.device) - model;
  stats_.device_capacity = capacity_;
}

int64_t Placement::device_model() const {
  int64_t n = fixed_device_;
  for (const auto& u : st_.units) {
    if (!u.aliased && u.full.defined()) {
      n += static_cast<int64_t>(compat::storage_nbytes(u.full));
    }
    if (u.gather_src.defined() && !u.gather_src.is_same(u.param_shard) &&
        !u.gather_src.is_same(u.shard_data)) {
      n += bytes_of(u.gather_src);
    }
    n += bytes_of(u.param_shard) + bytes_of(u.flat_grad) + u.staging;
    if (u.reduced.defined() && !u.reduced.is_same(u.flat_grad)) {
      n += bytes_of(u.reduced);
    }
    for (const auto& p : u.params) {
      n += bytes_of(p.grad());
    }
    if (!u.offloaded) {
      n += bytes_of(u.shard_data) + bytes_of(u.shard_grad) + u.optim_bytes;
    }
  }
  return n;
}

int64_t Placement::host_model() const {
  int64_t n = 0;
  for (const auto& u : st_.units) {
    if (u.offloaded) {
      n += bytes_of(u.shard_data) + bytes_of(u.shard_grad) + u.optim_bytes;
    }
  }
  return n;
}

int64_t Placement::model_budget() const {
  if (capacity_ == 0) {
    return std::numeric_limits<int64_t>::max();
  }
  const auto cap = static_cast<double>(capacity_);
  if (warmup_) {
    return static_cast<int64_t>(cap * (1.0 - o_.warmup_non_model_data_ratio()));
  }
  // The recorded figure, or what is measured now if a pass uses more.
  const int64_t non_model = std::max(tracer_.next_period(), stats_.non_model);
  return static_cast<int64_t>(cap * o_.steady_cuda_cap_ratio()) - non_model;
}

int64_t Placement::next_use(size_t k) const {
  const auto& at = use_positions_[k];
  auto it = std::upper_bound(at.begin(), at.end(), position_);
  return it == at.end() ? std::numeric_limits<int64_t>::max()
                        : static_cast<int64_t>(*it);
}

bool Placement::make_room(int64_t need, size_t k) {
  int64_t avail = model_budget() - device_model();
  if (need <= avail) {
    return true;
  }
  std::vector<size_t> candidates;
  for (size_t j = 0; j < st_.units.size(); ++j) {
    const auto& u = st_.units[j];
    if (j != k && u.param_shard.defined() && !u.gathering) {
      candidates.push_back(j);
    }
  }
  if (warmup_) {
    std::sort(candidates.begin(), candidates.end(), [&](size_t a, size_t b) {
      return last_use_[a] < last_use_[b];
    });
  } else {
    std::sort(candidates.begin(), candidates.end(), [&](size_t a, size_t b) {
      return next_use(a) > next_use(b);
    });
  }
  for (size_t j : candidates) {
    if (avail >= need) {
      break;
    }
    avail += bytes_of(st_.units[j].param_shard);
    st_.units[j].param_shard = at::Tensor(); // the host shard is the master
    ++stats_.evictions;
  }
  return avail >= need;
}

at::Tensor Placement::gather_source(size_t k, bool prefetch) {
  auto& u = st_.units[k];
  const auto pd = st_.param_dtype;
  const int64_t shard_bytes =
      u.layout.shard * static_cast<int64_t>(c10::elementSize(pd));
  int64_t need = compat::storage_nbytes(u.full) == 0
      ? u.full.numel() * static_cast<int64_t>(u.full.element_size())
      : 0;
  const bool cached = u.param_shard.defined();
  // At one rank a device-tier shard is cast straight into the gathered
  // buffer (see below): no copy.
  const bool cast_in_place = !cached && !u.offloaded && st_.S == 1 &&
      u.shard_data.device() == st_.device;
  if (!cached && !cast_in_place &&
      (u.offloaded || u.shard_data.scalar_type() != pd ||
       u.shard_data.device() != st_.device)) {
    need += shard_bytes; // a copy on the device
  }
  if (st_.in_backward()) {
    // Its gradients follow while it is gathered: the flat buffer in
    // reduce_dtype (each parameter's gradient is freed once copied in), the
    // reduced shard and the reduce-scatter's workspace (FsdpState::launch).
    // Reserve them now: between decision points nothing is evicted.
    const int64_t flat =
        u.padded() * static_cast<int64_t>(c10::elementSize(st_.reduce_dtype));
    need += flat;
    if (st_.S > 1) { // with one rank the flat buffer is the reduced shard
      need += flat / st_.S +
          distributed::reduce_scatter_workspace_bytes(
                  u.padded(), st_.reduce_dtype, *st_.shard_group);
    }
  }
  if (o_.policy() == PlacementPolicy::kAuto && !make_room(need, k)) {
    if (prefetch) {
      return at::Tensor();
    }
    const int64_t budget = model_budget();
    TORCH_CHECK(
        false,
        "Gemini placement: gathering unit '",
        u.name,
        "' needs ",
        mb(need),
        " in the device tier, but the budget for model data is ",
        mb(budget),
        " (device_capacity ",
        mb(capacity_),
        warmup_ ? c10::str(
                      " times 1 - warmup_non_model_data_ratio ",
                      o_.warmup_non_model_data_ratio(),
                      " in the warm-up step")
                : c10::str(
                      " times steady_cuda_cap_ratio ",
                      o_.steady_cuda_cap_ratio(),
                      " minus the non-model data recorded at this moment"),
        ") and ",
        mb(device_model()),
        " of model data being computed on the device cannot be evicted; "
        "raise the device capacity (GeminiPlugin's device_memory_capacity), "
        "lower the batch or use smaller chunks");
  }
  if (warmup_) {
    uses_.push_back(k);
    use_positions_[k].push_back(uses_.size() - 1);
    last_use_[k] = ++clock_;
  }
  ++position_;
  if (cached) {
    return u.param_shard;
  }
  if (cast_in_place) {
    // The caller's copy into the buffer converts: one pass, no shard-sized
    // copy in param_dtype first.
    return u.shard_data;
  }
  if (!u.offloaded) {
    return u.shard_data.to(st_.device, pd); // cast on the device if needed
  }
  auto src = utils::to_device(u.shard_data, st_.device, pd);
  stats_.host_to_device += bytes_of(src);
  if (o_.policy() == PlacementPolicy::kAuto) {
    u.param_shard = src; // cached until evicted
  }
  return src;
}

void Placement::moment() {
  sample();
  tracer_.record(stats_.non_model, warmup_);
}

void Placement::sample() {
  const int64_t device = device_model();
  const int64_t model = device + (st_.device.is_cpu() ? host_model() : 0);
  stats_.non_model = std::max<int64_t>(
      0, compat::memory_allocated(st_.device) - model - baseline_);
  stats_.peak_device = std::max(stats_.peak_device, device + stats_.non_model);
  stats_.peak_non_model = std::max(stats_.peak_non_model, stats_.non_model);
}

void Placement::begin_forward() {
  tracer_.begin_pass();
  position_ = 0;
}

bool Placement::copy_param_shard(size_t k) {
  auto& u = st_.units[k];
  if (!u.param_shard.defined()) {
    return false;
  }
  u.param_shard.copy_(utils::to_device(
      u.shard_data, u.param_shard.device(), u.shard_data.scalar_type()));
  stats_.host_to_device += bytes_of(u.param_shard);
  return true;
}

void Placement::begin_step() {
  refreshed_.assign(st_.units.size(), false);
}

void Placement::refreshed_ahead(size_t k) {
  refreshed_.resize(st_.units.size(), false);
  const auto& u = st_.units[k];
  if (u.param_shard.defined()) {
    refreshed_[k] = true;
    stats_.host_to_device += bytes_of(u.param_shard);
  }
}

bool Placement::refresh_param_shard(size_t k) {
  refreshed_.resize(st_.units.size(), false);
  refreshed_[k] = copy_param_shard(k);
  return refreshed_[k];
}

void Placement::refresh_param_shards() {
  bool copied = false;
  refreshed_.resize(st_.units.size(), false);
  for (size_t k = 0; k < st_.units.size(); ++k) {
    copied = (refreshed_[k] || copy_param_shard(k)) || copied;
    refreshed_[k] = false;
  }
  // The next step may write the host shards before any backward waits.
  if (copied) {
    utils::wait_for_device(st_.device);
  }
}

int64_t Placement::device_margin() const {
  if (capacity_ == 0) {
    return std::numeric_limits<int64_t>::max() / 2; // no limit
  }
  int64_t cached = 0;
  for (const auto& u : st_.units) {
    cached += bytes_of(u.param_shard);
  }
  const auto cap = static_cast<double>(capacity_);
  const int64_t steady = static_cast<int64_t>(cap * o_.steady_cuda_cap_ratio());
  return std::max<int64_t>(
      0, steady - stats_.peak_non_model - (device_model() - cached));
}

void Placement::move_to_device(size_t k) {
  auto& u = st_.units[k];
  // set_data keeps every piece's TensorImpl: the optimizer's parameters
  // stay the same tensors (their states, created at this step, follow).
  auto data = u.shard_data.to(st_.device);
  auto grad = u.shard_grad.to(st_.device);
  for (size_t i = 0; i < u.pieces.size(); ++i) {
    auto& piece = u.pieces[i];
    piece.set_data(u.layout.piece(data, i));
    if (piece.grad().defined()) {
      piece.mutable_grad() = u.layout.piece(grad, i);
    }
  }
  stats_.host_to_device += bytes_of(data) + bytes_of(grad);
  stats_.margin_shard_bytes += bytes_of(data);
  ++stats_.margin_units;
  u.shard_data = data;
  u.shard_grad = grad;
  u.offloaded = false;
  u.param_offloaded = false;
  u.param_shard = at::Tensor(); // gathers read the device shard now
}

void Placement::before_step(const StateMover& states) {
  TORCH_INTERNAL_ASSERT(margin_pending());
  margin_used_ = true;
  st_.host_copies.wait(); // the gradient shards are complete
  const int64_t margin = device_margin();
  stats_.device_margin = capacity_ == 0 ? -1 : margin;
  auto left = static_cast<int64_t>(
      static_cast<double>(margin) * o_.gpu_margin_mem_ratio());
  for (size_t k = 0; k < st_.units.size(); ++k) {
    const auto& u = st_.units[k];
    if (!u.offloaded || u.numel() == 0 || !states.movable(u)) {
      continue;
    }
    // The fp32 shard, Adam's two moments and the gradient shard.
    const int64_t cost = 3 * bytes_of(u.shard_data) + bytes_of(u.shard_grad);
    if (cost <= left) {
      move_to_device(k);
      states.move(u, st_.device);
      left -= cost;
    }
  }
}

void Placement::after_step() {
  refresh_param_shards();
  if (warmup_) {
    warmup_ = false;
    stats_.moments = static_cast<int64_t>(tracer_.moments());
  }
}

PlacementStats Placement::stats() const {
  auto s = stats_;
  s.device_model = device_model();
  s.host_model = host_model();
  s.warmed_up = !warmup_;
  return s;
}

void Placement::reset_peak() {
  stats_.peak_device = 0;
  stats_.peak_non_model = 0;
  sample();
}

} // namespace gemini
} // namespace zero
} // namespace colossalai
