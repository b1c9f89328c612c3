#include <colossalai/models/moe.h>

#include "model_init.h"

#include <algorithm>
#include <string>

namespace colossalai {
namespace models {

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
  const auto flat_chosen = chosen.reshape({-1});
  const auto order =
      std::get<1>(at::sort(flat_chosen, /*stable=*/true, 0, false));
  const auto token_of = order.div(k, "floor"); // pair i is token i / k's
  const auto slot_weight = weights.reshape({-1}).index_select(0, order);
  const auto counts =
      at::bincount(flat_chosen, {}, e).to(at::kCPU).contiguous();
  const int64_t* count = counts.data_ptr<int64_t>();

  const auto rows = flat.index_select(0, token_of); // [N * k, C]
  std::vector<at::Tensor> outputs;
  outputs.reserve(static_cast<size_t>(e));
  int64_t offset = 0;
  for (int64_t i = 0; i < e; ++i) {
    // Every expert runs, on no rows too: its gradient is then zero, not
    // missing, so data-parallel reductions see the same tensors on every
    // rank.
    outputs.push_back(experts[i]->as<MoeExpertImpl>()->forward(
        rows.narrow(0, offset, count[i])));
    offset += count[i];
  }
  auto weighted = at::cat(outputs) * slot_weight.unsqueeze(1);
  auto out = at::zeros_like(flat).index_add(
      0, token_of, weighted.to(flat.scalar_type()));
  if (shared_expert) {
    out = out +
        at::sigmoid(shared_expert_gate(flat)) * shared_expert->forward(flat);
  }
  return out.view(x.sizes());
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
      assigned =
          assigned + at::bincount(chosen, {}, num_experts).to(at::kFloat);
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
              .scatter_add(0, chosen, keep.repeat_interleave(top_k));
      prob_sum = prob_sum + (probs * keep.unsqueeze(1)).sum(0);
      rows = rows + keep.sum();
    }
  }
  return (assigned / rows * (prob_sum / rows)).sum() *
      static_cast<double>(num_experts);
}

} // namespace models
} // namespace colossalai
