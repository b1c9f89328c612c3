// Schedule generators and the unit-cost simulator (NOTE [Pipeline
// schedules]).

#include <colossalai/pipeline/schedule.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <map>
#include <sstream>
#include <tuple>

namespace colossalai {
namespace pipeline {

std::string to_string(const Action& a) {
  const char* k = a.kind == ActionKind::kForward ? "F"
      : a.kind == ActionKind::kBackward          ? "B"
      : a.kind == ActionKind::kBackwardInput     ? "BI"
                                                 : "W";
  return std::string(k) + std::to_string(a.chunk) + "." +
      std::to_string(a.micro_batch);
}

std::vector<Action> one_f_one_b(int stage, int p, int m) {
  TORCH_CHECK(p >= 1 && stage >= 0 && stage < p && m >= 1);
  const int warmup = std::min(p - stage - 1, m);
  std::vector<Action> out;
  for (int i = 0; i < warmup; ++i) {
    out.push_back({ActionKind::kForward, 0, i});
  }
  for (int i = 0; i < m - warmup; ++i) {
    out.push_back({ActionKind::kForward, 0, warmup + i});
    out.push_back({ActionKind::kBackward, 0, i});
  }
  for (int i = m - warmup; i < m; ++i) {
    out.push_back({ActionKind::kBackward, 0, i});
  }
  return out;
}

std::vector<Action> interleaved(int stage, int p, int chunks, int m) {
  TORCH_CHECK(p >= 1 && stage >= 0 && stage < p && chunks >= 1 && m >= 1);
  TORCH_CHECK(
      m % p == 0,
      "the interleaved schedule needs num_microbatches (",
      m,
      ") to be a multiple of pp_size (",
      p,
      ")");
  const int total = m * chunks;
  // Megatron's order: p micro-batches of chunk 0, then of chunk 1, ...
  auto f = [&](int k) {
    const int group = k / (p * chunks), in_group = k % (p * chunks);
    return Action{ActionKind::kForward, in_group / p, group * p + k % p};
  };
  auto b = [&](int k) {
    const int group = k / (p * chunks), in_group = k % (p * chunks);
    return Action{
        ActionKind::kBackward, chunks - 1 - in_group / p, group * p + k % p};
  };
  const int warmup =
      m == p ? total : std::min((p - stage - 1) * 2 + (chunks - 1) * p, total);
  std::vector<Action> out;
  for (int k = 0; k < warmup; ++k) {
    out.push_back(f(k));
  }
  for (int k = 0; k < total - warmup; ++k) {
    out.push_back(f(warmup + k));
    out.push_back(b(k));
  }
  for (int k = total - warmup; k < total; ++k) {
    out.push_back(b(k));
  }
  return out;
}

namespace {

void check_costs(const ScheduleCosts& c) {
  TORCH_CHECK(
      c.forward() >= 1 && c.backward() >= 1 && c.backward_input() >= 1 &&
          c.backward_weight() >= 1 && c.comm() >= 0 && c.max_in_flight() >= 0,
      "ScheduleCosts: forward, backward, backward_input and backward_weight "
      "must be >= 1, comm and max_in_flight >= 0");
}

int64_t cost_of(ActionKind kind, const ScheduleCosts& c) {
  switch (kind) {
    case ActionKind::kForward:
      return c.forward();
    case ActionKind::kBackward:
      return c.backward();
    case ActionKind::kBackwardInput:
      return c.backward_input();
    case ActionKind::kBackwardWeight:
      return c.backward_weight();
  }
  return 1;
}

// State of every (virtual stage, micro-batch): when its F and its input
// gradient (B or BI) finish; -1: not yet. A result reaches another stage
// `comm` later.
struct SimState {
  SimState(int p, int chunks, int m, bool zbv, int64_t comm)
      : p(p),
        v(p * chunks),
        m(m),
        zbv(zbv),
        comm(comm),
        f(v * m, -1),
        b(v * m, -1),
        w(v * m, -1) {}
  int p, v, m;
  bool zbv;
  int64_t comm, last = 0; // the latest finish
  std::vector<int64_t> f, b, w;
  int64_t& at(std::vector<int64_t>& x, int vs, int mb) {
    return x[vs * m + mb];
  }
  int owner(int vs) const {
    return zbv ? (vs < p ? vs : 2 * p - 1 - vs) : vs % p;
  }
  // Whether a result of virtual stage `from` that finished at `finish` is
  // at virtual stage `to` by t.
  bool arrived(int64_t finish, int from, int to, int64_t t) const {
    return finish >= 0 && finish + (owner(from) != owner(to) ? comm : 0) <= t;
  }
  // Whether `a` (on virtual stage vs) can start at time t.
  bool ready(ActionKind kind, int vs, int mb, int64_t t) {
    switch (kind) {
      case ActionKind::kForward:
        return vs == 0 || arrived(at(f, vs - 1, mb), vs - 1, vs, t);
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        return arrived(at(f, vs, mb), vs, vs, t) &&
            (vs == v - 1 || arrived(at(b, vs + 1, mb), vs + 1, vs, t));
      case ActionKind::kBackwardWeight:
        return arrived(at(b, vs, mb), vs, vs, t);
    }
    return false;
  }
  // Whether a result is still on its way between stages at t.
  bool in_transit(int64_t t) const {
    return last + comm > t;
  }
  void finish(ActionKind kind, int vs, int mb, int64_t t) {
    auto& slot = kind == ActionKind::kForward ? at(f, vs, mb)
        : kind == ActionKind::kBackwardWeight ? at(w, vs, mb)
                                              : at(b, vs, mb);
    TORCH_CHECK(slot < 0, "pipeline schedule: an action runs twice");
    slot = t;
    if (kind == ActionKind::kBackward) {
      at(w, vs, mb) = t;
    }
    last = std::max(last, t);
  }
};

} // namespace

Simulation simulate(
    const std::vector<std::vector<Action>>& schedule,
    int chunks,
    bool zbv,
    const ScheduleCosts& costs) {
  check_costs(costs);
  const int p = static_cast<int>(schedule.size());
  TORCH_CHECK(p >= 1, "simulate: no stages");
  int m = 0;
  for (const auto& list : schedule) {
    for (const auto& a : list) {
      m = std::max(m, a.micro_batch + 1);
    }
  }
  SimState st(p, chunks, m, zbv, costs.comm());
  std::vector<size_t> next(p, 0);
  std::vector<int64_t> busy_until(p, 0);
  int64_t t = 0, busy = 0, end = 0;
  size_t left = 0;
  for (const auto& list : schedule) {
    left += list.size();
  }
  while (left > 0) {
    bool started = false;
    for (int s = 0; s < p; ++s) {
      if (busy_until[s] > t || next[s] >= schedule[s].size()) {
        continue;
      }
      const auto& a = schedule[s][next[s]];
      const int vs = virtual_stage_index(s, a.chunk, p, zbv);
      if (!st.ready(a.kind, vs, a.micro_batch, t)) {
        continue;
      }
      const int64_t cost = cost_of(a.kind, costs);
      st.finish(a.kind, vs, a.micro_batch, t + cost);
      busy_until[s] = t + cost;
      end = std::max(end, t + cost);
      ++next[s];
      busy += cost;
      --left;
      started = true;
    }
    if (!started &&
        *std::max_element(busy_until.begin(), busy_until.end()) <= t &&
        !st.in_transit(t)) {
      std::ostringstream msg;
      for (int s = 0; s < p; ++s) {
        if (next[s] < schedule[s].size()) {
          msg << " stage " << s << " waits at "
              << to_string(schedule[s][next[s]]) << ";";
        }
      }
      TORCH_CHECK(false, "pipeline schedule deadlocks:", msg.str());
    }
    ++t;
  }
  const int64_t expected = int64_t(p) * chunks * m;
  for (int64_t i = 0; i < expected; ++i) {
    TORCH_CHECK(
        st.f[i] >= 0 && st.b[i] >= 0 && st.w[i] >= 0,
        "pipeline schedule: virtual stage ",
        i / m,
        " micro-batch ",
        i % m,
        " is not fully run");
  }
  Simulation out;
  out.makespan = end;
  out.bubble = 1.0 - double(busy) / double(p * end);
  return out;
}

std::vector<std::vector<Action>> zero_bubble_v(
    int p,
    int m,
    const ScheduleCosts& costs) {
  TORCH_CHECK(p >= 1 && m >= 1);
  check_costs(costs);
  const int v = 2 * p;
  const int budget = costs.max_in_flight() > 0 ? costs.max_in_flight() : p;
  SimState st(p, 2, m, true, costs.comm());
  std::vector<std::vector<Action>> out(p);
  // Per stage and chunk: next forward / input-gradient micro-batch, and
  // micro-batches holding activations (forward done, weights not yet).
  std::vector<std::array<int, 2>> next_f(p, {0, 0}), next_b(p, {0, 0}),
      held(p, {0, 0});
  std::vector<std::deque<std::pair<int, int>>> pending_w(p);
  std::vector<int64_t> busy_until(p, 0);
  const int64_t total = int64_t(3) * v * m;
  int64_t done = 0;
  for (int64_t t = 0; done < total; ++t) {
    bool started = false;
    bool relax = false;
    for (int pass = 0; pass < 2 && !started; ++pass) {
      for (int s = 0; s < p; ++s) {
        if (busy_until[s] > t) {
          continue;
        }
        auto vs = [&](int c) { return virtual_stage_index(s, c, p, true); };
        c10::optional<Action> pick;
        // 1. An input gradient someone waits for (earliest micro-batch,
        //    chunk 1 first: it is nearer the loss).
        for (int c : {1, 0}) {
          const int mb = next_b[s][c];
          if (mb < m && st.ready(ActionKind::kBackwardInput, vs(c), mb, t) &&
              (!pick || mb < pick->micro_batch)) {
            pick = Action{ActionKind::kBackwardInput, c, mb};
          }
        }
        // 2. A forward, within the activation budget (p per chunk, or
        //    max_in_flight).
        if (!pick) {
          for (int c : {1, 0}) {
            const int mb = next_f[s][c];
            if (mb < m && (held[s][c] < budget || relax) &&
                st.ready(ActionKind::kForward, vs(c), mb, t)) {
              pick = Action{ActionKind::kForward, c, mb};
              break;
            }
          }
        }
        // 3. A weight gradient fills the gap.
        if (!pick && !pending_w[s].empty()) {
          auto cm = pending_w[s].front();
          pick = Action{ActionKind::kBackwardWeight, cm.first, cm.second};
        }
        if (!pick) {
          continue;
        }
        const auto& a = *pick;
        const int64_t cost = cost_of(a.kind, costs);
        st.finish(a.kind, vs(a.chunk), a.micro_batch, t + cost);
        if (a.kind == ActionKind::kForward) {
          ++next_f[s][a.chunk];
          ++held[s][a.chunk];
        } else if (a.kind == ActionKind::kBackwardInput) {
          ++next_b[s][a.chunk];
          pending_w[s].emplace_back(a.chunk, a.micro_batch);
        } else {
          pending_w[s].pop_front();
          --held[s][a.chunk];
        }
        out[s].push_back(a);
        busy_until[s] = t + cost;
        ++done;
        started = true;
      }
      // Nothing can run, nothing is running or on its way: lift the budget
      // once.
      relax = !started &&
          *std::max_element(busy_until.begin(), busy_until.end()) <= t &&
          !st.in_transit(t);
      if (!relax) {
        break;
      }
    }
    TORCH_INTERNAL_ASSERT(
        started ||
            *std::max_element(busy_until.begin(), busy_until.end()) > t ||
            st.in_transit(t),
        "zero_bubble_v: the generator is stuck");
  }
  return out;
}

std::string p2p_order_mismatch(
    const std::vector<std::vector<Action>>& schedule,
    int chunks,
    bool zbv) {
  const int p = static_cast<int>(schedule.size());
  const int vstages = p * chunks;
  auto owner = [&](int v) { return zbv ? (v < p ? v : 2 * p - 1 - v) : v % p; };
  // Per ordered pair of stages, the messages in the sender's order and in
  // the receiver's: (receiving virtual stage, gradient?, micro-batch).
  using Msg = std::tuple<int, bool, int>;
  std::map<std::pair<int, int>, std::vector<Msg>> sent, received;
  for (int s = 0; s < p; ++s) {
    for (const auto& a : schedule[s]) {
      const int v = virtual_stage_index(s, a.chunk, p, zbv);
      const int mb = a.micro_batch;
      if (a.kind == ActionKind::kForward) {
        if (v > 0 && owner(v - 1) != s) {
          received[{owner(v - 1), s}].emplace_back(v, false, mb);
        }
        if (v < vstages - 1 && owner(v + 1) != s) {
          sent[{s, owner(v + 1)}].emplace_back(v + 1, false, mb);
        }
      } else if (a.kind != ActionKind::kBackwardWeight) {
        if (v < vstages - 1 && owner(v + 1) != s) {
          received[{owner(v + 1), s}].emplace_back(v, true, mb);
        }
        if (v > 0 && owner(v - 1) != s) {
          sent[{s, owner(v - 1)}].emplace_back(v - 1, true, mb);
        }
      }
    }
  }
  auto name = [](const Msg& m) {
    return std::string(std::get<1>(m) ? "gradient into" : "activations into") +
        " virtual stage " + std::to_string(std::get<0>(m)) + " (micro-batch " +
        std::to_string(std::get<2>(m)) + ")";
  };
  for (const auto& [pair, out] : sent) {
    const auto& in = received[pair];
    for (size_t i = 0; i < std::max(out.size(), in.size()); ++i) {
      if (i >= out.size() || i >= in.size() || out[i] != in[i]) {
        std::ostringstream msg;
        msg << "stage " << pair.first << " -> stage " << pair.second
            << ", message " << i << ": sent "
            << (i < out.size() ? name(out[i]) : "nothing") << ", received "
            << (i < in.size() ? name(in[i]) : "nothing");
        return msg.str();
      }
    }
  }
  return "";
}

int check_schedule(
    const std::vector<std::vector<Action>>& schedule,
    int p,
    int chunks,
    bool zbv,
    const std::string& who) {
  TORCH_CHECK(
      static_cast<int>(schedule.size()) == p,
      who,
      ": one list of actions per pipeline stage: got ",
      schedule.size(),
      " for pp_size ",
      p);
  int m = 0;
  for (int s = 0; s < p; ++s) {
    for (const auto& a : schedule[s]) {
      TORCH_CHECK(
          a.chunk >= 0 && a.chunk < chunks && a.micro_batch >= 0,
          who,
          ": stage ",
          s,
          " runs ",
          to_string(a),
          ", outside num_model_chunks ",
          chunks,
          " or below micro-batch 0");
      m = std::max(m, a.micro_batch + 1);
    }
  }
  TORCH_CHECK(m > 0, who, ": the schedule has no actions");
  try {
    simulate(schedule, chunks, zbv);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, who, ": ", e.what_without_backtrace());
  }
  const auto mismatch = p2p_order_mismatch(schedule, chunks, zbv);
  TORCH_CHECK(
      mismatch.empty(),
      who,
      ": two stages would receive out of send order (NCCL pairs a pair's "
      "messages by order): ",
      mismatch);
  return m;
}

std::vector<std::vector<Action>> generate(
    const std::string& style,
    int p,
    int chunks,
    int m) {
  if (style == "zbv") {
    TORCH_CHECK(chunks == 2, "pp_style 'zbv' needs num_model_chunks 2");
    return zero_bubble_v(p, m);
  }
  std::vector<std::vector<Action>> out;
  for (int s = 0; s < p; ++s) {
    if (style == "1f1b") {
      TORCH_CHECK(chunks == 1, "pp_style '1f1b' needs num_model_chunks 1");
      out.push_back(one_f_one_b(s, p, m));
    } else {
      TORCH_CHECK(
          style == "interleaved",
          "pp_style must be '1f1b', 'interleaved' or 'zbv', got '",
          style,
          "'");
      out.push_back(interleaved(s, p, chunks, m));
    }
  }
  return out;
}

} // namespace pipeline
} // namespace colossalai
