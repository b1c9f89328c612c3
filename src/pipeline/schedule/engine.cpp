// The engine that runs one stage's schedule (NOTE [Pipeline schedules]).

#include <colossalai/pipeline/schedule.h>

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <map>

namespace colossalai {
namespace pipeline {

PipelineSchedule::PipelineSchedule(
    std::shared_ptr<PipelineStageManager> stage_manager,
    std::shared_ptr<PipelineP2PCommunication> p2p,
    std::string style,
    bool overlap_p2p,
    std::vector<std::vector<Action>> custom)
    : sm_(std::move(stage_manager)),
      p2p_(std::move(p2p)),
      style_(std::move(style)),
      overlap_(overlap_p2p),
      custom_(std::move(custom)) {
  TORCH_INTERNAL_ASSERT(sm_ != nullptr && p2p_ != nullptr);
  TORCH_CHECK(
      (style_ == "zbv") == sm_->use_zbv(),
      "PipelineSchedule: pp_style 'zbv' and the V-shaped stage manager go "
      "together");
  if (!custom_.empty()) {
    custom_m_ = check_schedule(
        custom_,
        sm_->num_stages(),
        sm_->num_model_chunks(),
        sm_->use_zbv(),
        "scheduler_nodes");
  }
}

namespace {

using Key = std::pair<int, int>; // (chunk or virtual stage, micro-batch)

at::Tensor take(std::map<Key, at::Tensor>& m, const Key& k) {
  auto it = m.find(k);
  TORCH_INTERNAL_ASSERT(it != m.end(), "pipeline: local hand-off missing");
  auto t = std::move(it->second);
  m.erase(it);
  return t;
}

// A received (or handed-over) activation becomes the chunk's input leaf.
at::Tensor as_input(at::Tensor t) {
  t = t.detach();
  if (t.is_floating_point()) {
    t.requires_grad_(true);
  }
  return t;
}

} // namespace

PipelineOutput PipelineSchedule::forward_backward_step(
    const std::vector<std::vector<at::Tensor>>& micro_batches,
    const StageForward& forward,
    const std::vector<std::vector<at::Tensor>>& chunk_params,
    const PipelineCriterion& criterion,
    const std::function<at::Tensor(const at::Tensor&)>& scale_loss,
    bool return_loss,
    bool return_outputs,
    const std::vector<double>& loss_weights) {
  const int m = static_cast<int>(micro_batches.size());
  TORCH_CHECK(m >= 1, "pipeline: no micro-batches");
  TORCH_INTERNAL_ASSERT(
      loss_weights.empty() || static_cast<int>(loss_weights.size()) == m);
  const int stage = sm_->stage();
  const int vstages = sm_->num_virtual_stages();
  TORCH_INTERNAL_ASSERT(
      static_cast<int>(chunk_params.size()) == sm_->num_model_chunks());
  if (cached_m_ != m) {
    TORCH_CHECK(
        custom_.empty() || m == custom_m_,
        "pipeline: scheduler_nodes schedule ",
        custom_m_,
        " micro-batches, and this step has ",
        m,
        " (num_microbatches, or the batch over microbatch_size)");
    auto all = custom_.empty()
        ? generate(style_, sm_->num_stages(), sm_->num_model_chunks(), m)
        : custom_;
    const std::string mismatch =
        p2p_order_mismatch(all, sm_->num_model_chunks(), sm_->use_zbv());
    TORCH_INTERNAL_ASSERT(
        mismatch.empty(),
        "pipeline schedule '",
        style_,
        "' receives out of send order: ",
        mismatch);
    actions_ = std::move(all[stage]);
    cached_m_ = m;
  }

  // Without gradients: the forwards only, in the schedule's order (the
  // order every stage sends and receives activations in stays the same).
  const bool forward_only = !at::GradMode::is_enabled();
  std::vector<Action> forwards;
  if (forward_only) {
    for (const auto& a : actions_) {
      if (a.kind == ActionKind::kForward) {
        forwards.push_back(a);
      }
    }
  }
  const std::vector<Action>& actions = forward_only ? forwards : actions_;

  struct Slot {
    at::Tensor input, output, out_grad;
  };
  std::map<Key, Slot> slots; // by (chunk, micro-batch)
  // Hand-offs between chunks of this rank (the V's turn), by (receiving
  // virtual stage, micro-batch).
  std::map<Key, at::Tensor> local_act, local_grad;
  std::map<size_t, PendingRecv> posted; // by action index
  at::Tensor loss_sum;
  std::vector<at::Tensor> outputs(return_outputs ? m : 0);

  // Where action `a`'s input comes from, when another rank sends it.
  auto source = [&](const Action& a, int* src, StreamKey* key) {
    const int v = sm_->virtual_stage(a.chunk);
    int from = -1;
    if (a.kind == ActionKind::kForward && v > 0) {
      from = v - 1;
      *key = {v, false};
    } else if (
        (a.kind == ActionKind::kBackward ||
         a.kind == ActionKind::kBackwardInput) &&
        v < vstages - 1) {
      from = v + 1;
      *key = {v, true};
    }
    if (from < 0) {
      return false;
    }
    *src = sm_->locate(from).first;
    return *src != stage;
  };
  auto receive = [&](size_t i) {
    auto it = posted.find(i);
    if (it != posted.end()) {
      auto t = it->second.wait();
      posted.erase(it);
      return t;
    }
    int src = -1;
    StreamKey key;
    TORCH_INTERNAL_ASSERT(source(actions[i], &src, &key));
    return p2p_->post_recv(src, key, actions[i].micro_batch).wait();
  };
  // Sends `t` to virtual stage `to` (or hands it over on this rank).
  auto deliver = [&](const at::Tensor& t, int to, bool grad, int mb) {
    const int dst = sm_->locate(to).first;
    if (dst == stage) {
      (grad ? local_grad : local_act)[{to, mb}] = t.detach();
    } else {
      p2p_->send(t, dst, {to, grad}, mb);
    }
  };

  timeline_.clear();
  const auto t0 = std::chrono::steady_clock::now();
  auto ms = [&t0]() {
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now() - t0)
        .count();
  };
  for (size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    // Post the next action's receive now, so it arrives while this one
    // computes (its shape must be known: the metadata cache). Receives are
    // posted in action order, which is the senders' order (NOTE [Pipeline
    // p2p]): this action's own goes first.
    if (overlap_ && i + 1 < actions.size() && !posted.count(i + 1)) {
      int src = -1;
      StreamKey key;
      if (!posted.count(i) && source(a, &src, &key)) {
        posted.emplace(i, p2p_->post_recv(src, key, a.micro_batch));
      }
      if (source(actions[i + 1], &src, &key) && p2p_->can_post_early(key)) {
        posted.emplace(
            i + 1, p2p_->post_recv(src, key, actions[i + 1].micro_batch));
      }
    }
    const double start = ms();
    const int v = sm_->virtual_stage(a.chunk);
    const int mb = a.micro_batch;
    const Key slot_key{a.chunk, mb};
    if (a.kind == ActionKind::kForward) {
      at::Tensor in;
      if (v > 0) {
        int src = -1;
        StreamKey key;
        in = as_input(
            source(a, &src, &key) ? receive(i) : take(local_act, {v, mb}));
      }
      auto out = forward(a.chunk, micro_batches[mb], in);
      TORCH_CHECK(
          out.defined(),
          "pipeline: virtual stage ",
          v,
          " returned no tensor (micro-batch ",
          mb,
          ")");
      Slot scratch;
      Slot& slot = forward_only ? scratch : slots[slot_key];
      slot.input = in;
      if (v == vstages - 1) {
        auto loss = criterion(out, micro_batches[mb]);
        TORCH_CHECK(
            loss.defined() && loss.numel() == 1,
            "execute_pipeline: the criterion must return a scalar loss, got ",
            loss.defined() ? loss.sizes() : at::IntArrayRef{},
            " (micro-batch ",
            mb,
            ")");
        loss = loss_weights.empty() ? loss.reshape({}) / m
                                    : loss.reshape({}) * loss_weights[mb];
        if (return_loss) {
          auto l = loss.detach().to(at::kFloat);
          loss_sum = loss_sum.defined() ? loss_sum + l : l;
        }
        if (return_outputs) {
          outputs[mb] = out.detach();
        }
        slot.output = scale_loss ? scale_loss(loss) : loss;
      } else {
        deliver(out, v + 1, false, mb);
        slot.output = out;
      }
    } else if (
        a.kind == ActionKind::kBackward ||
        a.kind == ActionKind::kBackwardInput) {
      auto it = slots.find(slot_key);
      TORCH_INTERNAL_ASSERT(it != slots.end(), "backward before forward");
      Slot& slot = it->second;
      at::Tensor grad;
      if (v < vstages - 1) {
        int src = -1;
        StreamKey key;
        grad = source(a, &src, &key) ? receive(i) : take(local_grad, {v, mb});
      }
      const bool split = a.kind == ActionKind::kBackwardInput;
      const bool has_input = slot.input.defined() && slot.input.requires_grad();
      std::vector<at::Tensor> grads;
      if (grad.defined()) {
        grads.push_back(grad);
      }
      if (!split) {
        torch::autograd::backward({slot.output}, grads);
      } else if (has_input) {
        // Only the input's gradient; the graph stays for the weight pass.
        torch::autograd::backward(
            {slot.output}, grads, /*retain_graph=*/true, false, {slot.input});
      }
      if (v > 0 && has_input) {
        auto g = slot.input.grad();
        TORCH_CHECK(
            g.defined(),
            "pipeline: the input of virtual stage ",
            v,
            " got no gradient (micro-batch ",
            mb,
            "); every stage's output must depend on its input");
        deliver(g, v - 1, true, mb);
      }
      if (split) {
        slot.out_grad = grad;
        slot.input = at::Tensor();
      } else {
        slots.erase(it);
      }
    } else {
      auto it = slots.find(slot_key);
      TORCH_INTERNAL_ASSERT(it != slots.end(), "weight pass before backward");
      std::vector<at::Tensor> params;
      for (const auto& p : chunk_params[a.chunk]) {
        if (p.requires_grad()) {
          params.push_back(p);
        }
      }
      std::vector<at::Tensor> grads;
      if (it->second.out_grad.defined()) {
        grads.push_back(it->second.out_grad);
      }
      if (!params.empty()) {
        torch::autograd::backward(
            {it->second.output}, grads, /*retain_graph=*/false, false, params);
      }
      slots.erase(it);
    }
    timeline_.push_back({a, start, ms()});
  }
  p2p_->wait_sends();
  TORCH_INTERNAL_ASSERT(
      slots.empty() && local_act.empty() && local_grad.empty() &&
          posted.empty(),
      "pipeline: the schedule left work undone");
  PipelineOutput out;
  if (sm_->holds_last_stage()) {
    out.loss = loss_sum;
    if (return_outputs) {
      out.outputs = at::cat(outputs, 0);
    }
  }
  return out;
}

} // namespace pipeline
} // namespace colossalai
