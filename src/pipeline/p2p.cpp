#include <colossalai/pipeline/p2p.h>
#include <colossalai/quantization/fp8.h>

#include "../quantization/fp8_rows.h"

namespace colossalai {
namespace pipeline {

namespace {

constexpr int kMaxDims = 8;
constexpr int kMetaLen = 2 + kMaxDims; // dtype, rank, sizes
// Matching is by order (NOTE [Pipeline p2p]): one tag for everything.
constexpr int kTag = 0;

std::string sizes_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(s[i]);
  }
  return out + "]";
}

} // namespace

PipelineP2PCommunication::PipelineP2PCommunication(
    distributed::ProcessGroupPtr group,
    bool enable_metadata_cache,
    bool one_way)
    : group_(std::move(group)), cache_(enable_metadata_cache) {
  TORCH_CHECK(group_ != nullptr, "PipelineP2PCommunication: no group");
  if (!one_way && group_->size() > 1) {
    up_ = distributed::new_group(group_->ranks(), group_->name() + "/p2p-up");
  }
}

const distributed::ProcessGroup& PipelineP2PCommunication::channel(
    int peer,
    bool sending) const {
  // A message to a higher rank travels on up_, whoever asks.
  const bool up = sending ? peer > group_->rank() : peer < group_->rank();
  if (!up) {
    return *group_;
  }
  TORCH_INTERNAL_ASSERT(
      up_ != nullptr, "pipeline: a one-way channel sends only to lower ranks");
  return *up_;
}

bool PipelineP2PCommunication::fp8_with(int peer, at::ScalarType dtype) const {
  return fp8_ && at::isFloatingType(dtype) && c10::elementSize(dtype) >= 2 &&
      quantization::fp8_compresses(
             {group_->ranks()[group_->rank()], group_->ranks()[peer]});
}

void PipelineP2PCommunication::send(
    const at::Tensor& tensor,
    int dst,
    const StreamKey& key,
    int micro_batch) {
  TORCH_CHECK(
      tensor.defined(),
      "pipeline: virtual stage ",
      key.virtual_stage,
      " got no tensor to send (micro-batch ",
      micro_batch,
      ")");
  auto t = tensor.detach().contiguous();
  TORCH_CHECK(
      t.dim() <= kMaxDims,
      "pipeline: tensors between stages have at most ",
      kMaxDims,
      " dimensions, got ",
      t.dim());
  Meta meta{t.scalar_type(), t.sizes().vec()};
  auto it = sent_.find(key);
  const bool need_meta = !cache_ || it == sent_.end();
  if (cache_ && it != sent_.end()) {
    TORCH_CHECK(
        it->second.dtype == meta.dtype && it->second.sizes == meta.sizes,
        "pipeline: with enable_metadata_cache every micro-batch must send "
        "the same shape and dtype, but the ",
        key.grad ? "gradient" : "activations",
        " of virtual stage ",
        key.virtual_stage,
        " changed from ",
        sizes_str(it->second.sizes),
        " to ",
        sizes_str(meta.sizes),
        " (micro-batch ",
        micro_batch,
        "); set enable_metadata_cache(false)");
  }
  if (need_meta) {
    auto m = at::zeros({kMetaLen}, at::TensorOptions().dtype(at::kLong));
    auto* p = m.data_ptr<int64_t>();
    p[0] = static_cast<int64_t>(meta.dtype);
    p[1] = t.dim();
    for (int64_t d = 0; d < t.dim(); ++d) {
      p[2 + d] = t.size(d);
    }
    m = m.to(group_->device());
    auto w = distributed::send(m, dst, channel(dst, true), kTag);
    sends_.push_back({m, std::move(w)});
    ++metadata_sent_;
    sent_[key] = meta;
  }
  if (fp8_with(dst, t.scalar_type())) {
    // One row: the scale, then a byte per value (NOTE [FP8 messages]).
    t = quantization::detail::fp8_pack_rows(
            t.to(at::kFloat).reshape({1, -1}), /*e4m3=*/!key.grad)
            .view({-1});
  }
  auto w = distributed::send(t, dst, channel(dst, true), kTag);
  sends_.push_back({t, std::move(w)});
}

bool PipelineP2PCommunication::can_post_early(const StreamKey& key) const {
  return cache_ && received_.count(key) > 0;
}

PendingRecv PipelineP2PCommunication::post_recv(
    int src,
    const StreamKey& key,
    int micro_batch) {
  Meta meta;
  auto it = received_.find(key);
  if (cache_ && it != received_.end()) {
    meta = it->second;
  } else {
    auto m = at::empty(
        {kMetaLen},
        at::TensorOptions().dtype(at::kLong).device(group_->device()));
    distributed::recv(m, src, channel(src, false), kTag).wait();
    m = m.cpu();
    const auto* p = m.data_ptr<int64_t>();
    TORCH_CHECK(
        p[1] >= 0 && p[1] <= kMaxDims,
        "pipeline: corrupt metadata from stage ",
        src,
        " (rank ",
        p[1],
        ")");
    meta.dtype = static_cast<at::ScalarType>(p[0]);
    meta.sizes.assign(p + 2, p + 2 + p[1]);
    received_[key] = meta;
  }
  const auto options =
      at::TensorOptions().dtype(meta.dtype).device(group_->device());
  if (fp8_with(src, meta.dtype)) {
    const int64_t numel = c10::multiply_integers(meta.sizes);
    auto bytes = at::empty({4 + numel}, options.dtype(at::kByte));
    auto w = distributed::recv(bytes, src, channel(src, false), kTag);
    const bool e4m3 = !key.grad;
    return PendingRecv(
        bytes, std::move(w), [meta, e4m3](const at::Tensor& received) {
          return quantization::detail::fp8_unpack_rows(
                     received.view({1, -1}), e4m3)
              .view(meta.sizes)
              .to(meta.dtype);
        });
  }
  auto t = at::empty(meta.sizes, options);
  auto w = distributed::recv(t, src, channel(src, false), kTag);
  return PendingRecv(t, std::move(w));
}

void PipelineP2PCommunication::wait_sends() {
  for (auto& s : sends_) {
    s.work.wait();
  }
  sends_.clear();
}

} // namespace pipeline
} // namespace colossalai
