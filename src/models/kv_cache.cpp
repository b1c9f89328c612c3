#include <colossalai/models/kv_cache.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace colossalai {
namespace models {

KVCache& KVCache::reserve(int64_t tokens) {
  TORCH_CHECK(
      tokens >= 0, "KVCache::reserve: tokens must be >= 0, got ", tokens);
  reserve_ = tokens;
  return *this;
}

void KVCache::reset() {
  layers_.clear();
  length_ = 0;
  kept_ = 0;
  step_ = -1;
  window_ = -1;
}

at::Tensor KVCache::begin_step(
    int64_t t_new,
    const at::Tensor& attention_mask,
    int64_t sliding_window,
    const c10::Device& device) {
  // A step begun and never ended (its forward threw) wrote only past
  // kept_: starting over discards it.
  TORCH_CHECK(t_new > 0, "KVCache: a step needs at least one token");
  const int64_t window = std::max<int64_t>(sliding_window, 0);
  TORCH_CHECK(
      window_ < 0 || window == window_,
      "KVCache: this cache was filled by a model with sliding window ",
      window_,
      ", now one with ",
      window,
      ": use one cache per model");
  window_ = window;
  const int64_t total = length_ + t_new;
  if (attention_mask.defined()) {
    TORCH_CHECK(
        attention_mask.dim() == 2 && attention_mask.size(1) == total,
        "forward_cached: attention_mask must be [B, past + new tokens] = [B, ",
        total,
        "] (the cache holds ",
        length_,
        " positions), got ",
        attention_mask.sizes());
  }
  step_ = t_new;
  for (auto& l : layers_) {
    l.written = false;
  }
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  const int64_t keys = kept_ + t_new;
  auto q = (at::arange(t_new, opts) + length_).unsqueeze(1); // absolute
  auto k = (at::arange(keys, opts) + (length_ - kept_)).unsqueeze(0);
  auto keep = k.le(q); // [t_new, keys]
  if (window > 0) {
    keep = keep.logical_and((q - k).lt(window));
  }
  keep = keep.view({1, 1, t_new, keys});
  if (attention_mask.defined()) {
    auto real = attention_mask.to(device)
                    .narrow(1, length_ - kept_, keys)
                    .ne(0)
                    .view({attention_mask.size(0), 1, 1, keys});
    keep = keep.logical_and(real);
  }
  return keep;
}

std::pair<at::Tensor, at::Tensor> KVCache::update(
    int64_t layer,
    const at::Tensor& k,
    const at::Tensor& v) {
  TORCH_CHECK(
      step_ > 0, "KVCache::update outside a step (begin_step comes first)");
  TORCH_CHECK(layer >= 0, "KVCache::update: layer must be >= 0");
  TORCH_CHECK(
      k.dim() == 4 && k.size(2) == step_ && v.dim() == 4 &&
          v.size(2) == step_ && k.size(0) == v.size(0) &&
          k.size(1) == v.size(1),
      "KVCache::update: keys and values must be [B, H, ",
      step_,
      ", D], got ",
      k.sizes(),
      " and ",
      v.sizes());
  if (static_cast<size_t>(layer) >= layers_.size()) {
    layers_.resize(layer + 1);
  }
  auto& l = layers_[layer];
  TORCH_CHECK(
      !l.written,
      "KVCache::update: layer ",
      layer,
      " was updated twice in one step");
  const int64_t need = kept_ + step_;
  if (l.k.defined()) {
    TORCH_CHECK(
        l.k.size(0) == k.size(0) && l.k.size(1) == k.size(1) &&
            l.k.size(3) == k.size(3) && l.v.size(3) == v.size(3),
        "KVCache: layer ",
        layer,
        " holds [B, H, *, D] = ",
        l.k.sizes(),
        ", this step brings ",
        k.sizes(),
        " (another batch needs reset())");
  }
  if (!l.k.defined() || l.k.size(2) < need) {
    const int64_t old = l.k.defined() ? l.k.size(2) : 0;
    const int64_t capacity = std::max({need, 2 * old, reserve_});
    auto grow = [&](const at::Tensor& buf, const at::Tensor& like) {
      auto fresh = at::empty(
          {like.size(0), like.size(1), capacity, like.size(3)}, like.options());
      if (kept_ > 0) {
        fresh.narrow(2, 0, kept_).copy_(buf.narrow(2, 0, kept_));
      }
      return fresh;
    };
    l.k = grow(l.k, k);
    l.v = grow(l.v, v);
  }
  l.k.narrow(2, kept_, step_).copy_(k);
  l.v.narrow(2, kept_, step_).copy_(v);
  l.written = true;
  return {l.k.narrow(2, 0, need), l.v.narrow(2, 0, need)};
}

void KVCache::end_step() {
  TORCH_CHECK(step_ > 0, "KVCache::end_step without a step in progress");
  for (size_t i = 0; i < layers_.size(); ++i) {
    TORCH_CHECK(
        layers_[i].written,
        "KVCache::end_step: layer ",
        i,
        " was not updated in this step (every layer's attention updates it)");
  }
  length_ += step_;
  kept_ += step_;
  step_ = -1;
  // The next query is at position length_; it sees keys down to
  // length_ - window + 1, so window - 1 of the past are enough.
  if (window_ > 0 && kept_ > window_ - 1) {
    const int64_t keep = window_ - 1;
    for (auto& l : layers_) {
      if (l.k.defined() && keep > 0) {
        // Overlapping ranges: through a copy.
        l.k.narrow(2, 0, keep).copy_(l.k.narrow(2, kept_ - keep, keep).clone());
        l.v.narrow(2, 0, keep).copy_(l.v.narrow(2, kept_ - keep, keep).clone());
      }
    }
    kept_ = keep;
  }
}

} // namespace models
} // namespace colossalai
