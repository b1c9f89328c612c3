#include "forward_gather_waits.h"

#include <colossalai/nn/hookable_module.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <unordered_set>

namespace colossalai {
namespace zero {
namespace detail {

namespace {

// A hookable module's wait for the buckets of the parameters it holds.
class GatherWaitHooks : public nn::ForwardHooks {
 public:
  GatherWaitHooks(
      std::weak_ptr<LowLevelZeroOptimizer> optimizer,
      std::vector<size_t> buckets)
      : optimizer_(std::move(optimizer)), buckets_(std::move(buckets)) {}

  void pre_forward() override {
    if (auto o = optimizer_.lock()) {
      o->wait_gathers(buckets_);
    }
  }
  at::Tensor post_forward(const at::Tensor& output) override {
    return output;
  }

 private:
  std::weak_ptr<LowLevelZeroOptimizer> optimizer_;
  std::vector<size_t> buckets_;
};

// Where the forward waits: the root (0) or a hookable module.
struct WaitPoint {
  std::shared_ptr<torch::nn::Module> module; // null for the root
  std::vector<size_t> buckets;
};

} // namespace

ForwardGatherWaits::ForwardGatherWaits(
    torch::nn::Module& module,
    const std::shared_ptr<LowLevelZeroOptimizer>& optimizer,
    const std::string& who)
    : optimizer_(optimizer) {
  const size_t n = optimizer->bucket_numels().size();
  constexpr size_t kUnused = std::numeric_limits<size_t>::max();
  std::vector<size_t> first_use(n, kUnused);
  std::vector<WaitPoint> points(1);
  std::unordered_set<const torch::nn::Module*> seen{&module};

  // Pre-order, in registration order: the order a forward meets them.
  std::function<void(torch::nn::Module&, size_t, const std::string&)> visit =
      [&](torch::nn::Module& m, size_t point, const std::string& prefix) {
        for (const auto& p : m.named_parameters(/*recurse=*/false)) {
          const int64_t k = optimizer->bucket_of(p.value());
          if (k < 0) {
            continue; // frozen, or not this optimizer's
          }
          auto& mine = points[point].buckets;
          if (std::find(mine.begin(), mine.end(), static_cast<size_t>(k)) ==
              mine.end()) {
            mine.push_back(static_cast<size_t>(k));
          }
          first_use[k] = std::min(first_use[k], point);
        }
        for (const auto& child : m.named_children()) {
          if (!seen.insert(child.value().get()).second) {
            continue; // shared: its parameters have their place already
          }
          const std::string name = prefix + child.key();
          size_t next = point;
          if (auto* h =
                  dynamic_cast<nn::HookableModule*>(child.value().get())) {
            TORCH_CHECK(
                h->forward_hooks() == nullptr,
                who,
                ": overlap_allgather waits in the forward hooks of module '",
                name,
                "', which has hooks already; set overlap_allgather(false)");
            points.push_back({child.value(), {}});
            next = points.size() - 1;
          }
          visit(*child.value(), next, name + ".");
        }
      };
  visit(module, 0, "");

  // First use first; within one place, later buckets first (buckets run in
  // reverse registration order, so that is forward order).
  std::vector<size_t> order(n);
  for (size_t k = 0; k < n; ++k) {
    order[k] = n - 1 - k;
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return first_use[a] < first_use[b];
  });
  optimizer->set_gather_order(std::move(order));

  root_ = std::move(points[0].buckets);
  for (size_t i = 1; i < points.size(); ++i) {
    auto& pt = points[i];
    auto hooks =
        std::make_shared<GatherWaitHooks>(optimizer_, std::move(pt.buckets));
    hooked_.emplace_back(pt.module, hooks.get());
    dynamic_cast<nn::HookableModule*>(pt.module.get())
        ->set_forward_hooks(std::move(hooks));
  }
}

ForwardGatherWaits::~ForwardGatherWaits() {
  for (const auto& entry : hooked_) {
    if (auto m = entry.first.lock()) {
      auto* h = dynamic_cast<nn::HookableModule*>(m.get());
      if (h->forward_hooks().get() == entry.second) { // still ours
        h->set_forward_hooks(nullptr);
      }
    }
  }
}

void ForwardGatherWaits::before_forward() {
  if (auto o = optimizer_.lock()) {
    o->wait_gathers(root_);
  }
}

void ForwardGatherWaits::wait_all() {
  if (auto o = optimizer_.lock()) {
    o->wait_all_gathers();
  }
}

} // namespace detail
} // namespace zero
} // namespace colossalai
