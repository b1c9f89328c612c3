#include <colossalai/checkpoint_io/optimizer_state.h>
#include <colossalai/nn/optimizer/fused_adam.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/nn/optimizer/working_copies.h>
#include <colossalai/quantization/fp8.h>
#include <colossalai/zero/low_level_optimizer.h>

#include "../../distributed/grad_bucketer.h"
#include "../../distributed/raised_backward.h"
#include "../../utils/host_memory.h"
#include "../common/flat_params.h"

#include <unordered_map>

namespace colossalai {
namespace zero {

using detail::bytes_of;

namespace {

ShardedOptimizerOptions sharded_options(const LowLevelZeroOptimizerOptions& o) {
  ShardedOptimizerOptions so;
  so.max_norm(o.max_norm());
  if (o.dtype() == at::kHalf) {
    so.loss_scaler(o.loss_scaler());
  }
  return so;
}

} // namespace

struct LowLevelZeroOptimizer::Impl : distributed::BucketHandler {
  // One bucket: its parameters in the flat shard layout.
  struct Bucket : detail::FlatParams {
    distributed::ProcessGroupPtr ranks; // sharing this bucket's shards
    at::Tensor working;   // padded flat buffer the parameters view
    bool aliased = false; // shard_data is this rank's slice of `working`
    at::Tensor grads;     // padded flat gradients (comm dtype), while in use
    at::Tensor out;       // the reduced shard, while in use
    // At one rank, `working` as the optimizer's step writes it itself
    // (attach_working_copies). Undefined: gather() casts the masters.
    at::Tensor stepped;
    // Published during this step's host update (publish_stepped).
    bool published = false;
    // Gradients copied straight into the zero shard_grad by this backward
    // (direct_fill), not yet completed.
    bool filled = false;
    // overlap_allgather: the post-step all-gather, until it is waited for.
    distributed::Work gathering;
    // fp8_communication across nodes: the all-gathers (e4m3) and the
    // gradient reduce-scatters (e5m2) carry FP8.
    bool fp8 = false;
  };

  distributed::ProcessGroupPtr group;
  LowLevelZeroOptimizerOptions o;
  torch::optim::Optimizer* inner = nullptr;
  std::vector<Bucket> buckets;
  std::vector<std::pair<size_t, size_t>> where; // param -> (bucket, index)
  std::vector<at::Tensor> working;              // in optimizer order
  at::ScalarType comm_dtype = at::kFloat;
  std::shared_ptr<distributed::GradBucketer> bucketer;
  // Device-to-host gradient copies of cpu_offload (NOTE [Offload copies
  // overlap the backward]).
  utils::HostCopies host_copies;
  // overlap_host_step (NOTE [Host steps overlap the backward]): hands
  // bucket k's host update to the optimizer; the buckets handed.
  std::function<void(size_t)> step_ahead;
  std::shared_ptr<detail::StepsAhead> ahead =
      std::make_shared<detail::StepsAhead>();
  int64_t gathers = 0;
  std::vector<size_t> gather_order; // a permutation of the buckets
  std::unordered_map<const void*, size_t> bucket_by_param;

  // Parameters with a group of their own (pg_to_param_list), by identity.
  std::unordered_map<const void*, size_t> own_group;
  std::vector<distributed::ProcessGroupPtr> groups; // 0: `group`

  int n() const {
    return group->size();
  }
  // Copies of the optimizer group's shards (extra_dp_size); 1: none.
  int replicas() const {
    return o.replica_group() == nullptr ? 1 : o.replica_group()->size();
  }
  // Whether bucket b's reduced gradient is all-reduced over the copies
  // (buckets over a group of their own have none).
  bool replicated(const Bucket& b) const {
    return replicas() > 1 && b.ranks == group;
  }

  // NOTE [Gradient shards in bf16]: the reduced gradients' dtype where
  // weights and communication are bf16 and the optimizer steps from them,
  // float32 otherwise.
  at::ScalarType grad_dtype() const {
    return o.dtype() == at::kBFloat16 && comm_dtype == at::kBFloat16 &&
            detail::steps_from_low_precision_grads(*inner)
        ? at::kBFloat16
        : at::kFloat;
  }

  void build(torch::optim::Optimizer& optimizer) {
    inner = &optimizer;
    for (auto& g : optimizer.param_groups()) {
      for (auto& p : g.params()) {
        TORCH_CHECK(
            p.is_leaf() && p.requires_grad(),
            "LowLevelZeroPlugin: optimizer parameters must be leaves "
            "that require grad");
        working.push_back(p);
      }
    }
    TORCH_CHECK(
        optimizer.state().empty(),
        "LowLevelZeroPlugin: boost the optimizer before its first step");
    // Buckets of reduce_bucket_size elements in reverse order.
    distributed::BucketPlanOptions po;
    po.cap = std::max<int64_t>(1, o.reduce_bucket_size());
    po.bytes = false;
    po.by_dtype_and_device = false;
    for (const auto& p : working) {
      auto it = own_group.find(p.unsafeGetTensorImpl());
      po.groups.push_back(
          it == own_group.end() ? 0 : static_cast<int64_t>(it->second));
    }
    auto plan = distributed::plan_buckets(working, po);
    where.resize(working.size());
    buckets.resize(plan.size());
    for (size_t b = 0; b < plan.size(); ++b) {
      auto& bucket = buckets[b];
      bucket.ranks = groups.at(static_cast<size_t>(po.groups[plan[b][0]]));
      if (bucket.ranks != group) {
        bucket.group = bucket.ranks; // the sharded optimizer's view
      }
      for (size_t i = 0; i < plan[b].size(); ++i) {
        bucket.params.push_back(working[plan[b][i]]);
        where[plan[b][i]] = {b, i};
      }
      build_bucket(bucket);
      gather_order.push_back(b);
    }
    for (size_t i = 0; i < working.size(); ++i) {
      bucket_by_param.emplace(working[i].unsafeGetTensorImpl(), where[i].first);
    }
    distributed::GradBucketerOptions bo;
    bo.ordered = true;
    bo.overlap = o.overlap_communication();
    bo.max_in_flight = 2; // bounds the gradient buffers alive at once
    bo.complete_local_at_once = true; // one rank: each slice at once
    bucketer = std::make_shared<distributed::GradBucketer>(
        working.size(), std::move(plan), this, bo);
    size_t bad = 0;
    TORCH_CHECK(
        bucketer->attach_hooks(working, &bad),
        "LowLevelZeroPlugin: parameter ",
        bad,
        " is not a leaf that requires grad");
  }

  void build_bucket(Bucket& b) {
    b.layout =
        detail::FlatShardLayout::of(b.params, b.ranks->size(), b.ranks->rank());
    const auto& first = b.params.front();
    auto flat32 = b.layout.flatten(b.params, first.options().dtype(at::kFloat));
    // cpu_offload keeps the master (and so the optimizer states created for
    // its pieces) in host memory; without it they live with the weights.
    // FP8 all-gathers round the weights, so the masters must be their own.
    b.fp8 = o.fp8_communication() && quantization::fp8_compresses(*b.ranks);
    b.aliased = first.scalar_type() == at::kFloat && !o.cpu_offload() && !b.fp8;
    for (const auto& p : b.params) {
      TORCH_CHECK(
          p.scalar_type() == first.scalar_type() &&
              p.device() == first.device(),
          "LowLevelZeroPlugin: every parameter must have the working dtype ",
          "and device");
    }
    if (b.aliased) {
      b.working = flat32;
      b.shard_data = b.layout.my_shard(flat32);
    } else {
      b.working = flat32.to(first.scalar_type());
      auto shard = b.layout.my_shard(flat32).clone();
      b.shard_data = o.cpu_offload() ? utils::offload_to_host(shard)
                                     : shard.to(first.device());
    }
    b.shard_grad = utils::zeros_like_pinned(b.shard_data, grad_dtype());
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < b.params.size(); ++i) {
      auto& p = b.params[i];
      p.set_data(b.layout.view(b.working, i, p.sizes()));
    }
    b.make_pieces();
  }

  // At one rank, an optimizer that writes working copies (FusedAdamW,
  // HybridAdam: nn::optimizer::WorkingCopies) stepping masters on the
  // weights' device writes the weights in its own pass (on a GPU, one
  // kernel instead of a step and a cast over the masters; HybridAdam's CPU
  // kernel as it updates each element). Across ranks the cast stays in
  // gather(), into a buffer that lives only for the all-gather; host
  // masters (cpu_offload) keep gather()'s one flat copy per bucket.
  void attach_working_copies(torch::optim::Optimizer& optimizer) {
    auto* writer = dynamic_cast<nn::optimizer::WorkingCopies*>(&optimizer);
    if (writer == nullptr) {
      return;
    }
    for (auto& b : buckets) {
      if (b.aliased || b.ranks->size() > 1 || o.cpu_offload() ||
          b.shard_data.device() != b.working.device()) {
        continue;
      }
      b.stepped = b.layout.my_shard(b.working);
      for (size_t i = 0; i < b.params.size(); ++i) {
        if (b.pieces[i].numel() > 0) {
          writer->set_working_copy(b.pieces[i], b.layout.piece(b.stepped, i));
        }
      }
    }
  }

  // At one rank, with the gradient shard beside the weights and nothing to
  // round gradients to for communication, a gradient into a zero shard is
  // copied straight into its place there (converted to the shard's dtype
  // as it is copied): the flat buffer in the communication dtype, a pass
  // of writes and one of reads per step, is not needed. Accumulating into a
  // shard that holds gradients keeps the buffer, so that an abandoned backward
  // leaves the shard as it was (on_reset re-zeroes a direct one).
  bool direct_fill(const Bucket& b) const {
    return b.ranks->size() == 1 && !replicated(b) && b.grad_is_zero &&
        comm_dtype == b.working.scalar_type() &&
        b.shard_grad.device() == b.working.device();
  }

  // BucketHandler: see NOTE [Gradient bucketing].
  void fill(size_t param, bool /*used*/) override {
    const auto [k, i] = where[param];
    auto& b = buckets[k];
    if (direct_fill(b)) {
      auto& g = b.params[i].mutable_grad();
      b.layout.copy_into(b.shard_grad, i, g); // zeros for an unused one
      g = at::Tensor();
      b.filled = true;
      return;
    }
    if (!b.grads.defined()) {
      b.grads = b.layout.empty_flat(b.working.options().dtype(comm_dtype));
    }
    auto& g = b.params[i].mutable_grad();
    b.layout.copy_into(b.grads, i, g); // zeros for an unused parameter
    g = at::Tensor();                  // the full gradient is no longer needed
  }

  distributed::Work launch(size_t k) override {
    auto& b = buckets[k];
    const int n = b.ranks->size();
    const int r = replicated(b) ? replicas() : 1;
    if (n == 1) { // nothing to scatter
      b.out = b.grads;
      if (r == 1) {
        return distributed::Work();
      }
      b.out.div_(r);
      return distributed::all_reduce(b.out, *o.replica_group());
    }
    b.grads.div_(n * r); // average first: keeps fp16 sums in range
    // Both stages: a rank steps only its slice, so a reduce-scatter (half
    // an all-reduce's bytes) is all it needs. The stages differ in what
    // they keep between backwards (stage 1 can accumulate locally).
    b.out = at::empty({b.layout.shard}, b.grads.options());
    if (b.fp8) {
      return quantization::reduce_scatter_fp8(
          b.out, b.grads, *b.ranks, distributed::ReduceOp::kSum, "e5m2");
    }
    return distributed::reduce_scatter(b.out, b.grads, *b.ranks);
  }

  void complete(size_t k) override {
    auto& b = buckets[k];
    if (b.filled) { // the gradients are in place
      b.filled = false;
      b.grad_is_zero = false;
    } else {
      if (b.ranks->size() > 1 && replicated(b)) {
        // The copies' shards of the same slice: their average.
        distributed::all_reduce(b.out, *o.replica_group()).wait();
      }
      detail::accumulate_grad(b, b.out, host_copies);
      b.grads = at::Tensor();
      b.out = at::Tensor();
    }
    if (step_ahead) { // set with cpu_offload only
      step_ahead(k);
    }
  }

  void before_backward() override {
    TORCH_CHECK(
        !ahead->pending(),
        ahead->raised() ? detail::kRaisedBackwardAhead
                        : detail::kSecondBackwardAhead);
  }

  void on_finalized(bool /*synced*/) override {
    host_copies.wait(); // the step reads the host gradient shards next
    ahead->note_backward_end();
  }

  void on_reset() override {
    host_copies.wait();
    for (auto& b : buckets) {
      if (b.filled) { // a backward abandoned before the bucket completed
        b.shard_grad.zero_();
        b.filled = false;
      }
      b.grads = at::Tensor();
      b.out = at::Tensor();
    }
  }

  // Whether the weights must be rebuilt from the master shard after a
  // step (not when the master is the weights, or the step wrote them).
  static bool needs_gather(const Bucket& b) {
    return !(b.aliased && b.ranks->size() == 1) && !b.stepped.defined();
  }

  // The bucket's updated shard, cast to the working dtype on the weights'
  // device (from pinned host memory: asynchronously), all-gathered into
  // the weights (one rank: copied).
  static distributed::Work gather_bucket(Bucket& b, bool exact = false) {
    if (b.fp8 && !exact) { // cast once, from the float32 master
      auto src = utils::to_device(b.shard_data, b.working.device(), at::kFloat);
      return quantization::all_gather_fp8(b.working, src, *b.ranks, "e4m3");
    }
    // A copy: the input must not alias the output it is gathered into.
    auto src = utils::to_device(
        b.shard_data, b.working.device(), b.working.scalar_type());
    return detail::all_gather_flat(b.working, src, b.layout, b.ranks.get());
  }

  // NOTE [Publishing during the host step]: at one rank a bucket's
  // weights need no collective, so they are refreshed as soon as the host
  // finished its master; across ranks the all-gathers keep gather()'s
  // order (each rank would finish its buckets at other times).
  bool publish_stepped(size_t k) {
    auto& b = buckets[k];
    if (b.ranks->size() != 1 || !needs_gather(b)) {
      return false;
    }
    gather_bucket(b);
    b.published = true;
    return true;
  }

  // One all-gather per bucket of the updated shards into the weights, in
  // gather_order. With overlap_allgather those across ranks are left in
  // flight (NOTE [All-gathers overlap the next forward]).
  void gather() {
    std::vector<distributed::Work> works;
    gathers = 0;
    for (size_t k : gather_order) {
      auto& b = buckets[k];
      if (!needs_gather(b)) {
        continue;
      }
      ++gathers;
      if (b.published) {
        b.published = false;
        continue;
      }
      auto work = gather_bucket(b);
      if (o.overlap_allgather() && b.ranks->size() > 1) {
        b.gathering = std::move(work);
      } else {
        works.push_back(std::move(work));
      }
    }
    for (auto& w : works) {
      w.wait();
    }
    // Host masters (cpu_offload) crossed asynchronously; the next step may
    // write them before any backward waits. (The current stream's copies:
    // all-gathers left in flight run on.)
    if (o.cpu_offload() && !buckets.empty()) {
      utils::wait_for_device(buckets.front().working.device());
    }
  }

  // Work::wait leaves the handle empty first, so a wait that throws (a
  // broken group) is not repeated by every later one.
  void wait_gather(size_t k) {
    buckets.at(k).gathering.wait();
  }

  void wait_all() {
    for (size_t k : gather_order) {
      wait_gather(k);
    }
  }
};

LowLevelZeroOptimizer::LowLevelZeroOptimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer,
    distributed::ProcessGroupPtr group,
    LowLevelZeroOptimizerOptions options)
    : LowLevelZeroOptimizer(
          std::move(optimizer),
          std::move(group),
          options,
          {}) {}

LowLevelZeroOptimizer::LowLevelZeroOptimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer,
    distributed::ProcessGroupPtr group,
    LowLevelZeroOptimizerOptions options,
    std::vector<
        std::pair<distributed::ProcessGroupPtr, std::vector<at::Tensor>>>
        pg_to_param_list)
    : ShardedOptimizer(optimizer, sharded_options(options)),
      impl_(std::make_shared<Impl>()) {
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
  impl_->groups.push_back(impl_->group);
  for (auto& entry : pg_to_param_list) {
    TORCH_CHECK(
        entry.first != nullptr && entry.first->size() <= impl_->group->size(),
        "LowLevelZeroOptimizer: each pg_to_param_list group must lie inside "
        "the optimizer's group");
    impl_->groups.push_back(entry.first);
    for (const auto& p : entry.second) {
      TORCH_CHECK(
          impl_->own_group
              .emplace(p.unsafeGetTensorImpl(), impl_->groups.size() - 1)
              .second,
          "LowLevelZeroOptimizer: a parameter is listed under two groups of "
          "pg_to_param_list");
    }
  }
  impl_->build(*optimizer);
  std::vector<detail::FlatParams*> groups;
  for (auto& b : impl_->buckets) {
    groups.push_back(&b);
  }
  shard_param_groups(
      "LowLevelZeroPlugin",
      std::move(groups),
      impl_->n() > 1 ? impl_->group : nullptr);
  impl_->attach_working_copies(*optimizer);
  if (options.overlap_host_step()) {
    overlap_host_step();
  }
}

LowLevelZeroOptimizer::~LowLevelZeroOptimizer() = default;

void LowLevelZeroOptimizer::overlap_host_step() {
  TORCH_CHECK(
      impl_->o.cpu_offload(),
      "LowLevelZeroPlugin: overlap_host_step needs cpu_offload (without "
      "it no master slice lives on the host)");
  std::weak_ptr<nn::optimizer::HybridAdam> weak_optimizer =
      host_step_ahead_optimizer("LowLevelZeroPlugin", impl_->ahead);
  std::weak_ptr<Impl> weak_impl = impl_;
  impl_->step_ahead = [weak_optimizer, weak_impl](size_t k) {
    auto optimizer = weak_optimizer.lock();
    auto impl = weak_impl.lock();
    if (!optimizer || !impl) {
      return;
    }
    auto& b = impl->buckets[k];
    // At one rank the bucket's weights are refreshed with its update;
    // across ranks the all-gathers keep step()'s order on every rank.
    const bool upload = b.ranks->size() == 1 && Impl::needs_gather(b);
    detail::step_group_ahead(
        *optimizer,
        b,
        k,
        impl->host_copies,
        upload ? b.working : at::Tensor(),
        b.working.device(),
        impl->ahead);
  };
}

void LowLevelZeroOptimizer::step() {
  distributed::detail::guard_step([this] {
    impl_->wait_all(); // a step without a forward since the last one
    for (auto& b : impl_->buckets) {
      b.published = false; // a step that threw may have left some set
    }
    if (!impl_->buckets.empty()) {
      const auto device = impl_->buckets.front().working.device();
      for (size_t k : finish_steps_ahead(device)) {
        impl_->buckets[k].published = true; // gather() skips it
      }
    }
    ShardedOptimizer::step();
    for (auto& b : impl_->buckets) {
      b.shard_grad.zero_();
      b.grad_is_zero = true;
    }
  });
}

std::string LowLevelZeroOptimizer::graph_capture_blocker() const {
  auto why = sharded_graph_blocker("LowLevelZeroPlugin");
  if (!why.empty()) {
    return why;
  }
  if (impl_->o.cpu_offload()) {
    return "LowLevelZeroPlugin with cpu_offload steps on the host; a "
           "captured step keeps the masters on the device";
  }
  return optimizer_graph_blocker();
}

void LowLevelZeroOptimizer::prepare_graph_stream() {
  TORCH_CHECK(
      impl_->bucketer->sole_owner_of_hooks(),
      "LowLevelZeroPlugin: an autograd graph still holds the parameters' "
      "gradient accumulators (a loss kept from an earlier step?); release it "
      "before the first captured-step call, whose stream the accumulators "
      "must be made on");
  // attach_hooks drops the old accumulators first: the parameters' weak
  // references expire and new ones are made, on the current stream.
  size_t bad = 0;
  TORCH_CHECK(
      impl_->bucketer->attach_hooks(impl_->working, &bad),
      "LowLevelZeroPlugin: parameter ",
      bad,
      " is not a leaf that requires grad");
}

void LowLevelZeroOptimizer::after_step() {
  impl_->gather();
}

bool LowLevelZeroOptimizer::publishes_during_step() const {
  return impl_->o.cpu_offload();
}

bool LowLevelZeroOptimizer::group_stepped_on_host(size_t k) {
  return impl_->publish_stepped(k);
}

void LowLevelZeroOptimizer::zero_extra_grads(bool set_to_none) {
  for (auto& p : impl_->working) {
    auto& g = p.mutable_grad();
    if (g.defined()) {
      g = set_to_none ? at::Tensor() : g.zero_();
    }
  }
}

void LowLevelZeroOptimizer::set_require_sync(bool require) {
  TORCH_CHECK(
      require || impl_->o.stage() == 1,
      "LowLevelZeroPlugin: no_sync needs stage 1; stage 2 keeps only "
      "gradient slices, so there is nothing to accumulate locally");
  impl_->bucketer->set_sync(require);
}

bool LowLevelZeroOptimizer::require_sync() const {
  return impl_->bucketer->sync();
}

void LowLevelZeroOptimizer::sync_gradients() {
  std::vector<char> used;
  for (const auto& p : impl_->working) {
    used.push_back(p.grad().defined() ? 1 : 0);
  }
  impl_->bucketer->flush(used);
}

const std::vector<at::Tensor>& LowLevelZeroOptimizer::working_params() const {
  return impl_->working;
}

std::vector<int64_t> LowLevelZeroOptimizer::bucket_numels() const {
  std::vector<int64_t> out;
  for (const auto& b : impl_->buckets) {
    out.push_back(b.layout.padded());
  }
  return out;
}

int64_t LowLevelZeroOptimizer::gathers_last_step() const {
  return impl_->gathers;
}

int64_t LowLevelZeroOptimizer::bucket_of(const at::Tensor& param) const {
  auto it = impl_->bucket_by_param.find(param.unsafeGetTensorImpl());
  return it == impl_->bucket_by_param.end() ? -1
                                            : static_cast<int64_t>(it->second);
}

void LowLevelZeroOptimizer::set_gather_order(std::vector<size_t> order) {
  std::vector<char> seen(impl_->buckets.size(), 0);
  for (size_t k : order) {
    TORCH_CHECK(
        k < seen.size() && !seen[k],
        "LowLevelZeroOptimizer: the gather order must list every bucket once");
    seen[k] = 1;
  }
  TORCH_CHECK(
      order.size() == seen.size(),
      "LowLevelZeroOptimizer: the gather order must list every bucket once");
  wait_all_gathers();
  impl_->gather_order = std::move(order);
}

const std::vector<size_t>& LowLevelZeroOptimizer::gather_order() const {
  return impl_->gather_order;
}

void LowLevelZeroOptimizer::wait_gathers(const std::vector<size_t>& buckets) {
  for (size_t k : buckets) {
    impl_->wait_gather(k);
  }
}

void LowLevelZeroOptimizer::wait_all_gathers() {
  impl_->wait_all();
}

int64_t LowLevelZeroOptimizer::gathers_in_flight() const {
  int64_t n = 0;
  for (const auto& b : impl_->buckets) {
    n += b.gathering.is_noop() ? 0 : 1;
  }
  return n;
}

MemoryStats LowLevelZeroOptimizer::memory_stats() const {
  MemoryStats s;
  for (const auto& b : impl_->buckets) {
    s.working_params += bytes_of(b.working);
    s.gradients += bytes_of(b.shard_grad) + bytes_of(b.grads) + bytes_of(b.out);
    for (const auto& p : b.params) {
      s.gradients += bytes_of(p.grad());
    }
    if (!b.aliased) { // an aliased slice is the weights themselves
      s.master_weights += bytes_of(b.shard_data);
    }
  }
  // States HybridAdam keeps in files stay there (undefined here).
  for (const auto& kv : checkpoint_io::detail::optimizer_param_states(
           *impl_->inner, /*fetch_offloaded=*/false)) {
    for (const auto& item : kv.second) {
      if (item.key() != "step") {
        s.optimizer_states += bytes_of(item.value());
      }
    }
  }
  return s;
}

void LowLevelZeroOptimizer::gather_exact_weights() {
  impl_->wait_all();
  std::vector<distributed::Work> works;
  for (auto& b : impl_->buckets) {
    if (b.fp8) {
      works.push_back(Impl::gather_bucket(b, /*exact=*/true));
    }
  }
  for (auto& w : works) {
    w.wait();
  }
}

void LowLevelZeroOptimizer::sync_master_from_working() {
  impl_->wait_all();
  at::NoGradGuard no_grad;
  for (auto& b : impl_->buckets) {
    if (!b.aliased) {
      b.shard_data.copy_(b.layout.my_shard(b.working));
    }
  }
}

} // namespace zero
} // namespace colossalai
