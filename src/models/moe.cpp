#include <colossalai/models/moe.h>

#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/functional.h>
#include <colossalai/kernels/grouped_swiglu.h>
#include <colossalai/utils/compat.h>

#include "model_init.h"

#include <algorithm>
#include <string>

namespace colossalai {
namespace models {

namespace {

// How many entries of `sorted` (expert ids, ascending) name each of `e`
// experts: where each id's run ends, less where it starts. bincount would
// read the largest id back to the host, which drains a GPU's queue.
at::Tensor per_expert(const at::Tensor& sorted, int64_t e) {
  const auto ends =
      at::searchsorted(sorted, at::arange(e + 1, sorted.options()));
  return ends.narrow(0, 1, e) - ends.narrow(0, 0, e);
}

} // namespace

bool MoeConfig::sparse_layer(int64_t i) const {
  if (!enabled() ||
      std::find(mlp_only_layers_.begin(), mlp_only_layers_.end(), i) !=
          mlp_only_layers_.end()) {
    return false;
  }
  return (i + 1) % std::max<int64_t>(decoder_sparse_step_, 1) == 0;
}

MoeExpertImpl::MoeExpertImpl(
    int64_t hidden,
    int64_t width,
    double std,
    bool mixtral_names) {
  gate_proj = register_module(
      mixtral_names ? "w1" : "gate_proj",
      detail::col(hidden, width, std, /*bias=*/false));
  up_proj = register_module(
      mixtral_names ? "w3" : "up_proj",
      detail::col(hidden, width, std, /*bias=*/false));
  down_proj = register_module(
      mixtral_names ? "w2" : "down_proj",
      detail::row(width, hidden, std, /*bias=*/false));
}

at::Tensor MoeExpertImpl::forward(const at::Tensor& x) {
  return detail::swiglu(*gate_proj, *up_proj, *down_proj, x);
}

SparseMoeBlockImpl::SparseMoeBlockImpl(
    int64_t hidden,
    int64_t intermediate,
    const MoeConfig& c,
    double std,
    bool mixtral_names)
    : config_(c), mixtral_(mixtral_names) {
  const int64_t e = c.num_experts(), k = c.num_experts_per_tok();
  TORCH_CHECK(e > 0, "MoeConfig: num_experts must be positive, got ", e);
  TORCH_CHECK(
      k > 0 && k <= e,
      "MoeConfig: num_experts_per_tok (",
      k,
      ") must be between 1 and num_experts (",
      e,
      ")");
  gate = register_module(
      "gate",
      torch::nn::Linear(torch::nn::LinearOptions(hidden, e).bias(false)));
  detail::init_normal(gate->weight, std);
  num_local_ = e;
  experts = register_module("experts", torch::nn::ModuleList());
  const int64_t width = c.expert_width(intermediate);
  for (int64_t i = 0; i < e; ++i) {
    experts->push_back(MoeExpert(hidden, width, std, mixtral_names));
  }
  if (c.shared_expert_intermediate_size() > 0) {
    shared_expert = register_module(
        "shared_expert",
        MoeExpert(hidden, c.shared_expert_intermediate_size(), std, false));
    shared_expert_gate = register_module(
        "shared_expert_gate",
        torch::nn::Linear(torch::nn::LinearOptions(hidden, 1).bias(false)));
    detail::init_normal(shared_expert_gate->weight, std);
  }
}

at::Tensor SparseMoeBlockImpl::forward(const at::Tensor& x) {
  const int64_t c = x.size(-1), k = config_.num_experts_per_tok();
  const int64_t e = config_.num_experts();
  auto flat = x.reshape({-1, c});
  auto logits = gate(flat); // [N, E]
  router_logits_ = logits;
  // Probabilities in fp32, as transformers' routers.
  auto top = at::topk(at::softmax(logits, -1, at::kFloat), k, -1);
  auto weights = std::get<0>(top);
  const auto chosen = std::get<1>(top); // [N, k]
  if (config_.norm_topk_prob()) {
    weights = weights / weights.sum(-1, /*keepdim=*/true);
  }
  // Qwen's routers hand back weights in the activations' dtype; Mixtral's
  // stay fp32 and the weighted sum is taken in fp32 (identical in fp32).
  if (!mixtral_) {
    weights = weights.to(x.scalar_type());
  }

  // Each (token, slot) pair sorted by expert, stably: an expert's rows are
  // contiguous and in token order.
  const auto sorted =
      at::sort(chosen.reshape({-1}), /*stable=*/true, 0, false);
  const auto& order = std::get<1>(sorted);
  const auto token_of = order.div(k, "floor"); // pair i is token i / k's
  const auto slot_weight = weights.reshape({-1}).index_select(0, order);
  const auto counts = per_expert(std::get<0>(sorted), e);
  const auto rows = flat.index_select(0, token_of); // [N * k, C]
  auto weighted = run_experts(rows, counts) * slot_weight.unsqueeze(1);
  auto out = at::zeros_like(flat).index_add(
      0, token_of, weighted.to(flat.scalar_type()));
  if (shared_expert) {
    out = out +
        at::sigmoid(shared_expert_gate(flat)) * shared_expert->forward(flat);
  }
  return out.view(x.sizes());
}

void SparseMoeBlockImpl::set_expert_parallel(
    distributed::ProcessGroupPtr group,
    bool fp8) {
  const int64_t e = config_.num_experts();
  const int n = group == nullptr ? 1 : group->size();
  TORCH_CHECK(
      e % n == 0,
      "expert parallelism: num_experts (",
      e,
      ") must divide by ep_size (",
      n,
      ")");
  num_local_ = e / n;
  first_local_ = (group == nullptr ? 0 : group->rank()) * num_local_;
  ep_group_ = n > 1 ? std::move(group) : nullptr;
  ep_fp8_ = fp8;
}

at::Tensor SparseMoeBlockImpl::run_local(
    const at::Tensor& x,
    const at::Tensor& counts) {
  if (grouped_gemm_) {
    std::vector<at::Tensor> gate, up, down;
    bool plain = true;
    for (int64_t j = 0; plain && j < num_local_; ++j) {
      const auto& ex = *experts[first_local_ + j]->as<MoeExpertImpl>();
      plain = ex.gate_proj->plain() && ex.up_proj->plain() &&
          ex.down_proj->plain() && !ex.gate_proj->bias.defined() &&
          !ex.up_proj->bias.defined() && !ex.down_proj->bias.defined();
      gate.push_back(ex.gate_proj->weight_out_in());
      up.push_back(ex.up_proj->weight_out_in());
      down.push_back(ex.down_proj->weight_out_in());
    }
    if (plain && kernels::grouped_swiglu_applies(x, gate, up, down)) {
      return kernels::grouped_swiglu(x, counts, gate, up, down);
    }
  }
  TORCH_CHECK(
      !compat::stream_capturing(x.device()),
      "SparseMoeBlock: the expert loop reads each layer's expert counts back "
      "to the host, which a CUDA graph's capture cannot; run the experts in "
      "grouped GEMMs (models::set_grouped_expert_gemm: bf16 on a compute "
      "capability 9 / 10 GPU, LibTorch 2.10+) to capture the step");
  // Every local expert runs, on no rows too: its gradient is then zero, not
  // missing, so data-parallel reductions see the same tensors on every
  // rank.
  const auto host = counts.to(at::kCPU, at::kLong).contiguous();
  std::vector<at::Tensor> outputs;
  outputs.reserve(static_cast<size_t>(num_local_));
  int64_t offset = 0;
  for (int64_t j = 0; j < num_local_; ++j) {
    const int64_t m = host.data_ptr<int64_t>()[j];
    outputs.push_back(experts[first_local_ + j]->as<MoeExpertImpl>()->forward(
        x.narrow(0, offset, m)));
    offset += m;
  }
  return at::cat(outputs);
}

at::Tensor SparseMoeBlockImpl::run_experts(
    const at::Tensor& rows,
    const at::Tensor& counts) {
  if (ep_group_ == nullptr) {
    return run_local(rows, counts);
  }
  auto host_counts = [](const at::Tensor& t) {
    auto c = t.to(at::kCPU, at::kLong).contiguous();
    return std::vector<int64_t>(
        c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  };
  // Dispatch: rank r gets the rows of its experts. First the counts, so
  // each rank knows how many rows of each of its experts every rank sends.
  const int n = ep_group_->size();
  const int64_t local = num_local_;
  auto sent = counts.to(at::kLong).contiguous(); // [n * local]
  auto got = at::empty_like(sent);
  distributed::all_to_all(got, sent, *ep_group_).wait();
  const auto send = host_counts(sent), recv = host_counts(got);
  std::vector<int64_t> input_splits(n, 0), output_splits(n, 0);
  for (int r = 0; r < n; ++r) {
    for (int64_t j = 0; j < local; ++j) {
      input_splits[r] += send[r * local + j];
      output_splits[r] += recv[r * local + j];
    }
  }
  namespace cdf = distributed::functional;
  auto arrived = cdf::all_to_all_single(
      rows, output_splits, input_splits, ep_group_, ep_fp8_);
  // Arrived rows are by source rank, then expert; each expert's rows are
  // gathered into one run (source order kept), computed, and put back.
  std::vector<int64_t> start(n, 0);
  for (int r = 1; r < n; ++r) {
    start[r] = start[r - 1] + output_splits[r - 1];
  }
  std::vector<int64_t> perm, per_expert(local, 0);
  perm.reserve(static_cast<size_t>(arrived.size(0)));
  for (int64_t j = 0; j < local; ++j) {
    for (int r = 0; r < n; ++r) {
      int64_t at_row = start[r];
      for (int64_t i = 0; i < j; ++i) {
        at_row += recv[r * local + i];
      }
      for (int64_t i = 0; i < recv[r * local + j]; ++i) {
        perm.push_back(at_row + i);
      }
      per_expert[j] += recv[r * local + j];
    }
  }
  const auto index = at::tensor(perm, at::kLong).to(rows.device());
  // An expert's gradient sums the tokens of every expert-parallel rank,
  // each rank's loss a mean over its own batch, and is then averaged over
  // the dp / ep ranks holding the same expert: 1 / ep makes it the mean
  // over the whole data-parallel batch (ColossalAI's EPGradScalerIn/Out).
  // The routed tokens' gradients pass unscaled.
  const double ep = static_cast<double>(n);
  auto computed = cdf::scale_grad(
      run_local(
          cdf::scale_grad(arrived.index_select(0, index), ep),
          at::tensor(per_expert, at::kLong)),
      1.0 / ep);
  // Row perm[i] of `arrived` became row i: scatter back to arrival order.
  auto back = at::zeros_like(computed).index_copy(0, index, computed);
  return cdf::all_to_all_single(
      back, input_splits, output_splits, ep_group_, ep_fp8_);
}

int64_t set_grouped_expert_gemm(torch::nn::Module& model, bool on) {
  int64_t set = 0;
  for (const auto& m : model.modules()) {
    if (auto* block = dynamic_cast<SparseMoeBlockImpl*>(m.get())) {
      block->set_grouped_gemm(on);
      ++set;
    }
  }
  return set;
}

at::Tensor load_balancing_loss(
    const std::vector<at::Tensor>& router_logits,
    int64_t num_experts,
    int64_t top_k,
    const at::Tensor& attention_mask) {
  TORCH_CHECK(
      !router_logits.empty(), "load_balancing_loss: no router logits given");
  const auto device = router_logits.front().device();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  auto assigned = at::zeros({num_experts}, f32);
  auto prob_sum = at::zeros({num_experts}, f32);
  at::Tensor rows = at::zeros({}, f32);
  at::Tensor keep;
  if (attention_mask.defined()) {
    keep = attention_mask.reshape({-1}).to(f32);
  }
  for (const auto& layer_logits : router_logits) {
    TORCH_CHECK(
        layer_logits.dim() == 2 && layer_logits.size(1) == num_experts,
        "load_balancing_loss: router logits must be [tokens, ",
        num_experts,
        "], got ",
        layer_logits.sizes());
    const auto probs = at::softmax(layer_logits.to(device), -1).to(at::kFloat);
    const auto chosen = std::get<1>(at::topk(probs, top_k, -1)).reshape({-1});
    if (!keep.defined()) {
      assigned = assigned +
          per_expert(std::get<0>(at::sort(chosen)), num_experts)
              .to(at::kFloat);
      prob_sum = prob_sum + probs.sum(0);
      rows = rows + static_cast<double>(probs.size(0));
    } else {
      TORCH_CHECK(
          keep.numel() == probs.size(0),
          "load_balancing_loss: attention_mask has ",
          keep.numel(),
          " entries for ",
          probs.size(0),
          " router rows");
      assigned = assigned +
          at::zeros({num_experts}, f32)
              .scatter_add(
                  0,
                  chosen,
                  keep.unsqueeze(1).expand({-1, top_k}).reshape({-1}));
      prob_sum = prob_sum + (probs * keep.unsqueeze(1)).sum(0);
      rows = rows + keep.sum();
    }
  }
  return (assigned / rows * (prob_sum / rows)).sum() *
      static_cast<double>(num_experts);
}

} // namespace models
} // namespace colossalai
