#include <colossalai/zero/low_level_optimizer.h>

#include "../checkpoint_io/optimizer_state.h"
#include "../utils/grad_ready_hook.h"

#include <torch/csrc/autograd/engine.h>

#include <cmath>
#include <deque>

namespace colossalai {
namespace zero {

namespace {

int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

} // namespace

struct LowLevelZeroOptimizer::Impl
    : std::enable_shared_from_this<LowLevelZeroOptimizer::Impl> {
  struct Param {
    at::Tensor working;
    int64_t numel = 0;
    int64_t shard = 0; // padded numel / N
    at::Tensor master; // fp32 slice the inner optimizer updates
    at::Tensor grad;   // fp32 slice of the averaged gradient
    // fp32 training: the padded flat storage the working parameter views and
    // the master slice aliases, so the weights exist once.
    at::Tensor flat;
    size_t bucket = 0;
    int64_t offset = 0; // within the bucket's per-rank block
  };
  struct Bucket {
    std::vector<size_t> params;
    int64_t block = 0; // elements per rank
    at::Tensor buffer; // N * block, allocated while in use
    at::Tensor out;    // block (stage 2)
    size_t pending = 0;
    distributed::Work work;
    bool launched = false;
  };

  distributed::ProcessGroupPtr group;
  LowLevelZeroOptimizerOptions o;
  torch::optim::Optimizer* inner = nullptr;
  std::vector<Param> params;
  std::vector<Bucket> buckets;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<at::Tensor> working;
  at::ScalarType comm_dtype = at::kFloat;

  bool require_sync = true;
  bool in_backward = false;
  size_t next_bucket = 0;
  std::deque<size_t> in_flight;
  std::vector<char> ready;

  // fp16 loss scaling.
  double scale = 1.0;
  int64_t growth_tracker = 0;
  int64_t hysteresis_left = 0;
  bool unscaled = false;
  bool skipped = false;

  int n() const {
    return group->size();
  }

  void build(std::shared_ptr<torch::optim::Optimizer> optimizer) {
    inner = optimizer.get();
    const int world = n();
    // cpu_offload keeps slices (and so the optimizer states created for
    // them) in host memory; without it they live with the parameters.
    // Re-point every group at fp32 slices of the parameters it held.
    for (auto& g : inner->param_groups()) {
      for (auto& p : g.params()) {
        TORCH_CHECK(
            p.is_leaf() && p.requires_grad(),
            "LowLevelZeroPlugin: optimizer parameters must be leaves "
            "that require grad");
        Param info;
        info.working = p;
        info.numel = p.numel();
        info.shard = (p.numel() + world - 1) / world;
        auto flat =
            at::zeros({info.shard * world}, p.options().dtype(at::kFloat));
        flat.narrow(0, 0, info.numel).copy_(p.detach().reshape({-1}));
        auto mine = flat.narrow(0, group->rank() * info.shard, info.shard);
        if (p.scalar_type() == at::kFloat && !o.cpu_offload()) {
          // The parameter becomes a view of the padded flat buffer and the
          // master slice is this rank's part of it: the optimizer updates
          // the weights in place, the all-gather fills in the rest.
          at::NoGradGuard no_grad;
          p.set_data(flat.narrow(0, 0, info.numel).view(p.sizes()));
          info.flat = flat;
          info.master = mine.detach().set_requires_grad(true);
        } else {
          info.master =
              mine.clone()
                  .to(o.cpu_offload() ? at::Device(at::kCPU) : p.device())
                  .set_requires_grad(true);
        }
        info.grad = at::zeros_like(info.master).detach();
        working.push_back(p);
        p = info.master; // the optimizer now steps the slice
        params.push_back(std::move(info));
      }
    }
    TORCH_CHECK(
        inner->state().empty(),
        "LowLevelZeroPlugin: boost the optimizer before its first step");
    // Buckets in reverse order (backward produces late layers first).
    const int64_t cap = std::max<int64_t>(1, o.reduce_bucket_size());
    for (size_t k = params.size(); k-- > 0;) {
      auto& p = params[k];
      if (buckets.empty() ||
          (buckets.back().block > 0 &&
           (buckets.back().block + p.shard) * world > cap)) {
        buckets.emplace_back();
      }
      auto& b = buckets.back();
      p.bucket = buckets.size() - 1;
      p.offset = b.block;
      b.block += p.shard;
      b.params.push_back(k);
    }
    for (auto& b : buckets) {
      b.pending = b.params.size();
    }
    ready.assign(params.size(), 0);
    hysteresis_left = o.hysteresis();
    scale = o.dtype() == at::kHalf ? o.initial_scale() : 1.0;
  }

  void register_hooks() {
    std::weak_ptr<Impl> weak = shared_from_this();
    for (size_t i = 0; i < params.size(); ++i) {
      accumulators.push_back(
          utils::on_grad_accumulated(params[i].working, [weak, i]() {
            if (auto self = weak.lock()) {
              self->on_ready(i);
            }
          }));
    }
  }

  void on_ready(size_t i) {
    if (!require_sync) {
      return; // stage 1 no_sync: gradients accumulate in .grad
    }
    if (!in_backward) {
      in_backward = true;
      std::weak_ptr<Impl> weak = shared_from_this();
      torch::autograd::Engine::get_default_engine().queue_callback([weak]() {
        if (auto self = weak.lock()) {
          self->finalize();
        }
      });
    }
    TORCH_INTERNAL_ASSERT(!ready[i]);
    fill(i);
    if (o.overlap_communication()) {
      launch_ready();
    }
  }

  // Copies parameter i's gradient into its bucket, slice j to rank j's block,
  // and frees the full gradient.
  void fill(size_t i) {
    auto& p = params[i];
    auto& b = buckets[p.bucket];
    if (!b.buffer.defined()) {
      b.buffer =
          at::zeros({b.block * n()}, p.working.options().dtype(comm_dtype));
    }
    auto& g = p.working.mutable_grad();
    if (g.defined()) {
      auto flat = g.reshape({-1});
      for (int j = 0; j < n(); ++j) {
        int64_t lo = j * p.shard;
        int64_t len = std::min(p.numel, lo + p.shard) - lo;
        if (len > 0) {
          b.buffer.narrow(0, j * b.block + p.offset, len)
              .copy_(flat.narrow(0, lo, len));
        }
      }
      g = at::Tensor();
    }
    ready[i] = 1;
    --b.pending;
  }

  void launch_ready() {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
      auto& b = buckets[next_bucket];
      b.buffer.div_(n()); // average; keeps fp16 sums in range
      if (o.stage() == 2) {
        b.out = at::empty({b.block}, b.buffer.options());
        b.work = distributed::reduce_scatter(b.out, b.buffer, *group);
      } else {
        b.work = distributed::all_reduce(b.buffer, *group);
      }
      b.launched = true;
      in_flight.push_back(next_bucket++);
      // Bound the gradient memory: at most two buckets in flight.
      while (in_flight.size() > 2) {
        consume(in_flight.front());
        in_flight.pop_front();
      }
    }
  }

  // Waits for a bucket, adds this rank's slices to the gradient slices and
  // releases the bucket's memory.
  void consume(size_t k) {
    auto& b = buckets[k];
    b.work.wait();
    auto mine = o.stage() == 2
        ? b.out
        : b.buffer.narrow(0, group->rank() * b.block, b.block);
    for (size_t i : b.params) {
      auto& p = params[i];
      p.grad.add_(
          mine.narrow(0, p.offset, p.shard).to(at::kFloat).to(p.grad.device()));
    }
    b.buffer = at::Tensor();
    b.out = at::Tensor();
  }

  void finalize() {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!ready[i]) {
        fill(i); // unused parameter: its slots stay zero
      }
    }
    try {
      launch_ready();
      TORCH_INTERNAL_ASSERT(next_bucket == buckets.size());
      while (!in_flight.empty()) {
        consume(in_flight.front());
        in_flight.pop_front();
      }
    } catch (...) {
      reset();
      throw;
    }
    reset();
  }

  void reset() {
    for (auto& b : buckets) {
      b.pending = b.params.size();
      b.launched = false;
      b.work = distributed::Work();
    }
    in_flight.clear();
    std::fill(ready.begin(), ready.end(), 0);
    next_bucket = 0;
    in_backward = false;
  }

  std::vector<at::Tensor> grads() const {
    std::vector<at::Tensor> out;
    for (const auto& p : params) {
      out.push_back(p.grad);
    }
    return out;
  }

  void unscale() {
    if (o.dtype() != at::kHalf || unscaled) {
      return;
    }
    unscaled = true;
    for (auto& p : params) {
      p.grad.mul_(1.0 / scale);
    }
  }

  // Whether any rank saw inf/nan: every rank skips together.
  bool overflow() {
    std::vector<at::Tensor> flags;
    for (const auto& p : params) {
      flags.push_back(p.grad.isfinite().all().logical_not());
    }
    auto any = at::stack(flags).any().to(at::kFloat).reshape({1});
    distributed::all_reduce(any, *group, distributed::ReduceOp::kMax).wait();
    return any.item<float>() > 0;
  }

  double global_norm(double norm_type) {
    // Slices are disjoint, so the global norm combines per-rank partials:
    // a max for the inf-norm, a sum of |g|^p otherwise.
    const bool inf = std::isinf(norm_type);
    at::Tensor local = at::zeros({1}, at::kDouble);
    for (const auto& p : params) {
      auto g = p.grad.to(at::kDouble).abs();
      local =
          inf ? at::maximum(local, g.max()) : local + g.pow(norm_type).sum();
    }
    distributed::all_reduce(
        local,
        *group,
        inf ? distributed::ReduceOp::kMax : distributed::ReduceOp::kSum)
        .wait();
    return inf ? local.item<double>()
               : std::pow(local.item<double>(), 1.0 / norm_type);
  }

  void update_scale(bool found_inf) {
    if (o.dtype() != at::kHalf) {
      return;
    }
    if (found_inf) {
      growth_tracker = 0;
      if (--hysteresis_left <= 0) {
        scale = std::max(scale * o.backoff_factor(), o.min_scale());
        hysteresis_left = o.hysteresis();
      }
    } else if (++growth_tracker == o.growth_interval()) {
      scale = std::min(scale * o.growth_factor(), o.max_scale());
      growth_tracker = 0;
      hysteresis_left = o.hysteresis();
    }
  }

  void step() {
    unscale();
    skipped = o.dtype() == at::kHalf && overflow();
    if (!skipped) {
      if (o.max_norm() > 0) {
        double norm = global_norm(2.0);
        double coef = o.max_norm() / (norm + 1e-6);
        if (coef < 1.0) {
          for (auto& p : params) {
            p.grad.mul_(coef);
          }
        }
      }
      for (auto& p : params) {
        p.master.mutable_grad() = p.grad;
      }
      inner->step();
      gather();
    }
    update_scale(skipped);
    unscaled = false;
    for (auto& p : params) {
      p.grad.zero_();
      p.master.mutable_grad() = at::Tensor();
    }
  }

  // All-gathers the updated slices into the working parameters.
  void gather() {
    std::vector<at::Tensor> full;
    std::vector<distributed::Work> works;
    for (auto& p : params) {
      auto dtype = p.working.scalar_type();
      full.push_back(
          p.flat.defined() ? p.flat
                           : at::empty({p.shard * n()}, p.working.options()));
      // A copy: the input must not alias the output it is gathered into.
      auto slice = p.master.detach().to(p.working.device(), dtype, false, true);
      works.push_back(distributed::all_gather(full.back(), slice, *group));
    }
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      works[i].wait();
      auto& p = params[i];
      if (!p.flat.defined()) {
        p.working.view({-1}).copy_(full[i].narrow(0, 0, p.numel));
      }
    }
  }
};

LowLevelZeroOptimizer::LowLevelZeroOptimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer,
    distributed::ProcessGroupPtr group,
    LowLevelZeroOptimizerOptions options)
    : interface::OptimizerWrapper(optimizer), impl_(std::make_shared<Impl>()) {
  TORCH_CHECK(
      options.stage() == 1 || options.stage() == 2,
      "LowLevelZeroPlugin: stage must be 1 or 2, got ",
      options.stage());
  TORCH_CHECK(
      options.reduce_bucket_size() > 0,
      "LowLevelZeroPlugin: reduce_bucket_size_in_m must be > 0");
  impl_->group = std::move(group);
  impl_->o = options;
  impl_->comm_dtype = options.communication_dtype().value_or(options.dtype());
  impl_->build(optimizer);
  impl_->register_hooks();
}

LowLevelZeroOptimizer::~LowLevelZeroOptimizer() = default;

void LowLevelZeroOptimizer::backward(const at::Tensor& loss, bool retain) {
  TORCH_CHECK(loss.numel() == 1, "backward: the loss must be a scalar");
  if (impl_->o.dtype() == at::kHalf) {
    (loss.to(at::kFloat) * impl_->scale).backward({}, retain);
  } else {
    loss.backward({}, retain);
  }
}

void LowLevelZeroOptimizer::step() {
  impl_->step();
}

void LowLevelZeroOptimizer::zero_grad(bool set_to_none) {
  for (auto& p : impl_->params) {
    p.grad.zero_();
    auto& g = p.working.mutable_grad();
    if (g.defined()) {
      g = set_to_none ? at::Tensor() : g.zero_();
    }
  }
}

double LowLevelZeroOptimizer::clip_grad_by_norm(
    double max_norm,
    double norm_type) {
  TORCH_CHECK(max_norm > 0, "clip_grad_by_norm: max_norm must be positive");
  impl_->unscale();
  double norm = impl_->global_norm(norm_type);
  double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto& p : impl_->params) {
      p.grad.mul_(coef);
    }
  }
  return norm;
}

void LowLevelZeroOptimizer::clip_grad_by_value(double clip_value) {
  impl_->unscale();
  for (auto& p : impl_->params) {
    p.grad.clamp_(-clip_value, clip_value);
  }
}

void LowLevelZeroOptimizer::set_require_sync(bool require) {
  TORCH_CHECK(
      require || impl_->o.stage() == 1,
      "LowLevelZeroPlugin: no_sync needs stage 1; stage 2 keeps only "
      "gradient slices, so there is nothing to accumulate locally");
  impl_->require_sync = require;
}

bool LowLevelZeroOptimizer::last_step_skipped() const {
  return impl_->skipped;
}

double LowLevelZeroOptimizer::loss_scale() const {
  return impl_->scale;
}

const std::vector<at::Tensor>& LowLevelZeroOptimizer::working_params() const {
  return impl_->working;
}

MemoryStats LowLevelZeroOptimizer::memory_stats() const {
  MemoryStats s;
  for (const auto& p : impl_->params) {
    s.working_params += bytes_of(p.working);
    s.gradients += bytes_of(p.grad) + bytes_of(p.working.grad());
    if (!p.flat.defined()) { // an aliased slice is the weights themselves
      s.master_weights += bytes_of(p.master);
    }
  }
  for (const auto& b : impl_->buckets) {
    s.gradients += bytes_of(b.buffer) + bytes_of(b.out);
  }
  for (const auto& kv :
       checkpoint_io::detail::optimizer_param_states(*impl_->inner)) {
    for (const auto& item : kv.second) {
      if (item.key() != "step") {
        s.optimizer_states += bytes_of(item.value());
      }
    }
  }
  return s;
}

std::map<int64_t, checkpoint_io::StateDict> LowLevelZeroOptimizer::
    full_states() {
  auto& im = *impl_;
  std::map<int64_t, checkpoint_io::StateDict> out;
  for (const auto& kv :
       checkpoint_io::detail::optimizer_param_states(*im.inner)) {
    const auto& p = im.params[kv.first];
    checkpoint_io::StateDict full;
    for (const auto& item : kv.second) {
      if (item.key() == "step") {
        full.insert(item.key(), item.value());
        continue;
      }
      auto slice = item.value().detach().contiguous();
      auto buf = at::empty({p.shard * im.n()}, slice.options());
      distributed::all_gather(buf, slice, *im.group).wait();
      full.insert(
          item.key(), buf.narrow(0, 0, p.numel).view(p.working.sizes()));
    }
    out.emplace(kv.first, std::move(full));
  }
  return out;
}

void LowLevelZeroOptimizer::load_full_state(
    int64_t id,
    const checkpoint_io::StateDict& state,
    const std::string& file) {
  auto& im = *impl_;
  TORCH_CHECK(
      id >= 0 && id < static_cast<int64_t>(im.params.size()),
      "optimizer checkpoint '",
      file,
      "' has state for parameter ",
      id,
      " but the optimizer has ",
      im.params.size());
  const auto& p = im.params[id];
  checkpoint_io::StateDict slice;
  for (const auto& item : state) {
    if (item.key() == "step") {
      slice.insert(item.key(), item.value());
      continue;
    }
    checkpoint_io::detail::check_state_numel(
        file, item.key(), id, item.value().numel(), p.numel);
    auto padded = at::zeros({p.shard * im.n()}, p.master.options());
    padded.narrow(0, 0, p.numel).copy_(item.value().reshape({-1}));
    slice.insert(
        item.key(),
        padded.narrow(0, im.group->rank() * p.shard, p.shard).clone());
  }
  checkpoint_io::detail::load_param_state(*im.inner, id, slice, file);
}

void LowLevelZeroOptimizer::sync_master_from_working() {
  auto& im = *impl_;
  at::NoGradGuard no_grad;
  for (auto& p : im.params) {
    auto padded = at::zeros({p.shard * im.n()}, p.master.options());
    padded.narrow(0, 0, p.numel).copy_(p.working.detach().reshape({-1}));
    p.master.copy_(padded.narrow(0, im.group->rank() * p.shard, p.shard));
  }
}

} // namespace zero
} // namespace colossalai
