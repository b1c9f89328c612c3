#include "grad_bucketer.h"

#include "../utils/grad_ready_hook.h"
#include "raised_backward.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

namespace colossalai {
namespace distributed {

std::vector<std::vector<size_t>> plan_buckets(
    const std::vector<at::Tensor>& params,
    const BucketPlanOptions& options) {
  TORCH_CHECK(options.cap >= 0, "plan_buckets: cap must be >= 0");
  TORCH_INTERNAL_ASSERT(
      options.groups.empty() || options.groups.size() == params.size(),
      "plan_buckets: one group per parameter");
  struct Open {
    size_t bucket;
    int64_t filled = 0;
  };
  // dtype, device type, device index, group
  using Kind = std::tuple<int, int, int, int64_t>;
  std::map<Kind, Open> open;
  std::map<Kind, int> closed;
  std::vector<std::vector<size_t>> buckets;
  for (size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    const int64_t group = options.groups.empty() ? 0 : options.groups[k];
    const Kind kind = options.by_dtype_and_device
        ? Kind{static_cast<int>(p.scalar_type()),
               static_cast<int>(p.device().type()),
               p.device().index(),
               group}
        : Kind{0, 0, 0, group};
    const int64_t size =
        options.bytes ? p.numel() * p.element_size() : p.numel();
    const int64_t cap = closed[kind] == 0 && options.first_cap >= 0
        ? options.first_cap
        : options.cap;
    auto it = open.find(kind);
    if (it != open.end() && it->second.filled > 0 &&
        it->second.filled + size > cap) {
      closed[kind]++;
      open.erase(it);
      it = open.end();
    }
    if (it == open.end()) {
      it = open.emplace(kind, Open{buckets.size()}).first;
      buckets.emplace_back();
    }
    buckets[it->second.bucket].push_back(k);
    it->second.filled += size;
  }
  return buckets;
}

namespace {

// Identifies a bucketer's hooks (an address could be a dead bucketer's).
std::atomic<uint64_t> next_bucketer_id{1};

} // namespace

GradBucketer::GradBucketer(
    size_t num_params,
    std::vector<std::vector<size_t>> buckets,
    BucketHandler* handler,
    GradBucketerOptions options)
    : id_(next_bucketer_id++),
      handler_(handler),
      options_(options),
      bucket_of_(num_params, -1),
      ready_(num_params, 0) {
  TORCH_INTERNAL_ASSERT(handler_ != nullptr);
  buckets_.resize(buckets.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    TORCH_INTERNAL_ASSERT(!buckets[b].empty(), "empty gradient bucket");
    for (size_t i : buckets[b]) {
      TORCH_INTERNAL_ASSERT(i < num_params && bucket_of_[i] < 0);
      bucket_of_[i] = static_cast<int64_t>(b);
    }
    buckets_[b].params = std::move(buckets[b]);
    buckets_[b].pending = buckets_[b].params.size();
  }
}

bool GradBucketer::attach_hooks(
    const std::vector<at::Tensor>& params,
    size_t* bad) {
  TORCH_INTERNAL_ASSERT(params.size() == bucket_of_.size());
  accumulators_.clear();
  std::weak_ptr<GradBucketer> weak = shared_from_this();
  for (size_t i = 0; i < params.size(); ++i) {
    if (bucket_of_[i] < 0) {
      continue;
    }
    auto acc = utils::on_grad_accumulated(params[i], id_, [weak, i]() {
      if (auto self = weak.lock()) {
        self->ready(i);
      }
    });
    if (acc == nullptr) {
      if (bad != nullptr) {
        *bad = i;
      }
      return false;
    }
    // The parameter holds its accumulator weakly; keep it (and the hook).
    accumulators_.push_back(std::move(acc));
  }
  return true;
}

bool GradBucketer::sole_owner_of_hooks() const {
  for (const auto& acc : accumulators_) {
    if (acc.use_count() > 1) {
      return false;
    }
  }
  return true;
}

namespace {

// Finalize callbacks queued and not yet freed with their graph task.
std::atomic<int64_t> live_tokens{0};

// Bucketers whose backward raised, not yet recovered.
std::mutex raised_mutex;
std::vector<std::weak_ptr<GradBucketer>> raised_bucketers;

// Held by a backward's finalize callback: tells its bucketer when the
// engine dropped the callback unrun (NOTE [A backward that raised]).
struct FinalizeToken {
  std::function<void()> on_dropped;
  bool ran = false;
  FinalizeToken() {
    ++live_tokens;
  }
  FinalizeToken(const FinalizeToken&) = delete;
  FinalizeToken& operator=(const FinalizeToken&) = delete;
  ~FinalizeToken() {
    if (!ran) {
      on_dropped();
    }
    --live_tokens;
  }
};

} // namespace

void GradBucketer::begin_backward() {
  if (abandoned()) {
    recover_raised_backward("its error went to the caller");
  }
  if (in_backward_) {
    return;
  }
  handler_->before_backward();
  in_backward_ = true;
  issued_at_begin_ = detail::collectives_issued();
  const uint64_t number = ++backwards_;
  std::weak_ptr<GradBucketer> weak = shared_from_this();
  auto token = std::make_shared<FinalizeToken>();
  token->on_dropped = [weak, number] {
    if (auto self = weak.lock()) {
      {
        // Listed before it shows as abandoned: whoever sees that finds it.
        std::lock_guard<std::mutex> lock(raised_mutex);
        raised_bucketers.push_back(weak);
      }
      self->abandoned_.store(number);
    }
  };
  torch::autograd::Engine::get_default_engine().queue_callback(
      [weak, token]() {
        token->ran = true;
        if (auto self = weak.lock()) {
          self->finalize();
        }
      });
  handler_->on_backward_begin();
}

void GradBucketer::settle_raised_backward() {
  // The autograd thread that ran the raised backward's last task may free
  // its graph task (and the token) a moment after the caller saw the error.
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (live_tokens.load() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void GradBucketer::recover_raised_backward(
    const std::string& cause,
    bool agree) {
  std::vector<std::weak_ptr<GradBucketer>> taken;
  {
    std::lock_guard<std::mutex> lock(raised_mutex);
    taken.swap(raised_bucketers);
  }
  std::vector<std::shared_ptr<GradBucketer>> raised;
  for (const auto& weak : taken) {
    if (auto self = weak.lock()) {
      raised.push_back(std::move(self));
    }
  }
  if (raised.empty()) {
    return;
  }
  // One that raised before any collective since it began left nothing to
  // pair up (NOTE [A backward that raised on some ranks]).
  uint64_t began = detail::collectives_issued();
  for (const auto& self : raised) {
    began = std::min(began, self->issued_at_begin_);
  }
  if (agree && began != detail::collectives_issued()) {
    try {
      detail::agree_after_raise("backward", cause);
    } catch (...) {
      // Nothing dropped: they stay raised, and every later backward fails
      // here again (the broken group refuses at once).
      std::lock_guard<std::mutex> lock(raised_mutex);
      raised_bucketers.insert(
          raised_bucketers.end(), taken.begin(), taken.end());
      throw;
    }
  }
  for (const auto& self : raised) {
    if (self->abandoned()) {
      self->recover_abandoned();
    }
  }
}

void GradBucketer::recover_abandoned() {
  // Forgotten, or a flush (in_backward_ without a backward number of its
  // own) would be taken for the raised backward again.
  abandoned_.store(0);
  for (size_t b : in_flight_) {
    try {
      buckets_[b].work.wait();
    } catch (const std::exception&) {
      // Its result is dropped; a broken group fails the next collective.
    }
  }
  reset();
}

void GradBucketer::ready(size_t param, bool used) {
  if (bucket_of_[param] < 0) {
    return;
  }
  begin_backward();
  TORCH_INTERNAL_ASSERT(
      !ready_[param],
      "gradient of parameter ",
      param,
      " reported twice in one backward");
  mark(param, used);
}

void GradBucketer::flush(const std::vector<char>& used) {
  TORCH_INTERNAL_ASSERT(used.size() == ready_.size());
  if (abandoned()) {
    recover_raised_backward("its error went to the caller");
  }
  TORCH_CHECK(!in_backward_, "gradient synchronisation inside a backward");
  const bool saved = sync_;
  sync_ = true;
  in_backward_ = true;
  finalizing_ = true; // nothing overlaps: launch in finalize, in order
  try {
    handler_->on_backward_begin();
    for (size_t i = 0; i < ready_.size(); ++i) {
      if (bucket_of_[i] >= 0 && !ready_[i]) {
        mark(i, used[i] != 0);
      }
    }
    finalize();
  } catch (...) {
    sync_ = saved;
    reset();
    throw;
  }
  sync_ = saved;
}

void GradBucketer::mark(size_t param, bool used) {
  ready_[param] = 1;
  if (sync_) {
    handler_->fill(param, used);
  }
  const auto b = static_cast<size_t>(bucket_of_[param]);
  auto& bucket = buckets_[b];
  TORCH_INTERNAL_ASSERT(bucket.pending > 0);
  if (--bucket.pending > 0) {
    return;
  }
  handler_->on_bucket_ready(b);
  if (!sync_) {
    return;
  }
  if (!options_.ordered) {
    complete_order_.push_back(b);
  }
  if (options_.overlap || finalizing_) {
    launch_ready(!finalizing_);
  }
}

void GradBucketer::launch_ready(bool from_hook) {
  if (options_.ordered) {
    // Strictly in bucket order: every rank must issue the same sequence.
    while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
      launch(next_++, from_hook);
    }
  } else {
    while (!complete_order_.empty()) {
      auto b = complete_order_.front();
      complete_order_.pop_front();
      launch(b, from_hook);
    }
  }
}

void GradBucketer::launch(size_t b, bool from_hook) {
  auto& bucket = buckets_[b];
  bucket.work = handler_->launch(b);
  bucket.launched = true;
  overlapped_ += from_hook ? 1 : 0;
  if (options_.complete_local_at_once && bucket.work.is_noop() &&
      in_flight_.empty()) {
    handler_->complete(b);
    return;
  }
  in_flight_.push_back(b);
  while (options_.max_in_flight > 0 &&
         in_flight_.size() > options_.max_in_flight) {
    complete_oldest();
  }
}

void GradBucketer::complete_oldest() {
  auto b = in_flight_.front();
  in_flight_.pop_front();
  auto& bucket = buckets_[b];
  bucket.work.wait();
  bucket.work = Work();
  handler_->complete(b);
}

void GradBucketer::finalize() {
  finalizing_ = true;
  const bool synced = sync_;
  try {
    if (synced) {
      overlapped_last_ = overlapped_;
      std::vector<size_t> missing;
      for (size_t i = 0; i < ready_.size(); ++i) {
        if (bucket_of_[i] >= 0 && !ready_[i]) {
          missing.push_back(i);
        }
      }
      handler_->on_missing(missing);
      for (size_t i : missing) {
        mark(i, false);
      }
      launch_ready(false);
      for (const auto& bucket : buckets_) {
        TORCH_INTERNAL_ASSERT(bucket.launched);
      }
      handler_->before_wait();
      while (!in_flight_.empty()) {
        complete_oldest();
      }
    }
    handler_->on_finalized(synced);
  } catch (...) {
    reset();
    throw;
  }
  reset();
}

void GradBucketer::reset() {
  std::fill(ready_.begin(), ready_.end(), 0);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.launched = false;
    b.work = Work();
  }
  complete_order_.clear();
  in_flight_.clear();
  next_ = 0;
  in_backward_ = false;
  finalizing_ = false;
  overlapped_ = 0;
  handler_->on_reset();
}

} // namespace distributed
} // namespace colossalai
