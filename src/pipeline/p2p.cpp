#include <colossalai/pipeline/p2p.h>

namespace colossalai {
namespace pipeline {

namespace {

constexpr int kMaxDims = 8;
constexpr int kMetaLen = 2 + kMaxDims; // dtype, rank, sizes
// Tags: (stream, micro-batch, meta?) packed below Gloo's 32-bit tag.
constexpr int kMaxMicroBatches = 1 << 16;

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
    bool enable_metadata_cache)
    : group_(std::move(group)), cache_(enable_metadata_cache) {
  TORCH_CHECK(group_ != nullptr, "PipelineP2PCommunication: no group");
}

int PipelineP2PCommunication::tag(
    const StreamKey& key,
    int micro_batch,
    bool meta) const {
  TORCH_CHECK(
      micro_batch >= 0 && micro_batch < kMaxMicroBatches,
      "pipeline: at most ",
      kMaxMicroBatches,
      " micro-batches per step");
  const int stream = key.virtual_stage * 2 + (key.grad ? 1 : 0);
  // Metadata of the cached stream travels on micro-batch 0's tag.
  return ((stream * kMaxMicroBatches + micro_batch) << 1) | (meta ? 1 : 0);
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
    auto w = distributed::send(m, dst, *group_, tag(key, micro_batch, true));
    sends_.push_back({m, std::move(w)});
    ++metadata_sent_;
    sent_[key] = meta;
  }
  auto w = distributed::send(t, dst, *group_, tag(key, micro_batch, false));
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
    distributed::recv(m, src, *group_, tag(key, micro_batch, true)).wait();
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
  auto t = at::empty(
      meta.sizes,
      at::TensorOptions().dtype(meta.dtype).device(group_->device()));
  auto w = distributed::recv(t, src, *group_, tag(key, micro_batch, false));
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
