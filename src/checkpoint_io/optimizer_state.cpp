#include <colossalai/checkpoint_io/optimizer_state.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/utils/compat.h>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

namespace {

using torch::optim::Optimizer;

std::vector<at::Tensor> all_params(Optimizer& o) {
  std::vector<at::Tensor> out;
  for (auto& g : o.param_groups()) {
    for (auto& p : g.params()) {
      out.push_back(p);
    }
  }
  return out;
}

// PyTorch's optimizers store `step` as a float32 scalar tensor.
at::Tensor step_tensor(int64_t step) {
  return at::scalar_tensor(static_cast<double>(step), at::kFloat);
}

// ColossalAI's HybridAdam stores it as a Python int: an int64 scalar here,
// which the pickle writer turns into one (step_as_python_int).
at::Tensor int_step_tensor(int64_t step) {
  return at::scalar_tensor(step, at::kLong);
}

int64_t step_value(const StateDict& s, const std::string& file) {
  auto* t = s.find("step");
  TORCH_CHECK(
      t != nullptr,
      "optimizer checkpoint '",
      file,
      "': a parameter's state has no 'step'");
  return static_cast<int64_t>(t->item<double>());
}

at::Tensor get(
    const StateDict& s,
    const char* key,
    const at::Tensor& like,
    const std::string& file,
    bool required = true) {
  auto* t = s.find(key);
  if (t == nullptr) {
    TORCH_CHECK(
        !required,
        "optimizer checkpoint '",
        file,
        "': a parameter's state has no '",
        key,
        "'");
    return at::Tensor();
  }
  TORCH_CHECK(
      t->sizes() == like.sizes(),
      "optimizer checkpoint '",
      file,
      "': state '",
      key,
      "' has shape ",
      t->sizes(),
      " but its parameter has shape ",
      like.sizes());
  return t->to(like.options(), /*non_blocking=*/false, /*copy=*/true);
}

template <class S>
const S* as(const torch::optim::OptimizerParamState& s) {
  return dynamic_cast<const S*>(&s);
}

std::string kind(Optimizer& o) {
  if (dynamic_cast<nn::optimizer::HybridAdam*>(&o))
    return "HybridAdam";
  if (dynamic_cast<torch::optim::AdamW*>(&o))
    return "AdamW";
  if (dynamic_cast<torch::optim::Adam*>(&o))
    return "Adam";
  if (dynamic_cast<torch::optim::SGD*>(&o))
    return "SGD";
  if (dynamic_cast<torch::optim::RMSprop*>(&o))
    return "RMSprop";
  if (dynamic_cast<torch::optim::Adagrad*>(&o))
    return "Adagrad";
  return "";
}

// Adam, AdamW and HybridAdam share their moments' and hyperparameters'
// names but not a base class.
template <class S>
void adam_state(StateDict& s, const S& a, at::Tensor step) {
  s.insert("step", std::move(step));
  s.insert("exp_avg", a.exp_avg());
  s.insert("exp_avg_sq", a.exp_avg_sq());
}

template <class O>
void adam_group(c10::impl::GenericDict& d, const O& a) {
  d.insert("lr", a.lr());
  d.insert(
      "betas",
      c10::ivalue::Tuple::create(
          c10::IValue(std::get<0>(a.betas())),
          c10::IValue(std::get<1>(a.betas()))));
  d.insert("eps", a.eps());
  d.insert("weight_decay", a.weight_decay());
}

// The keys PyTorch's optimizers keep in every param group beside their
// hyperparameters, at their defaults (LibTorch has none of these options).
// A loader that copies groups verbatim (ColossalAI's sharded and
// HybridParallel loaders) hands them to torch's step, which reads them:
// without them its next step fails (KeyError: 'differentiable').
void torch_group_flags(
    c10::impl::GenericDict& d,
    std::initializer_list<const char*> falses,
    std::initializer_list<const char*> nones) {
  for (const char* k : falses) {
    d.insert(k, false);
  }
  for (const char* k : nones) {
    d.insert(k, c10::IValue());
  }
}

void check_supported(Optimizer& o, bool fetch_offloaded = true) {
  auto* h = dynamic_cast<nn::optimizer::HybridAdam*>(&o);
  if (h != nullptr && fetch_offloaded) {
    h->fetch_offloaded_states(); // states kept in files come back first
  }
  TORCH_CHECK(
      !kind(o).empty(),
      "optimizer checkpoints support SGD, Adam, "
      "AdamW, RMSprop, Adagrad and HybridAdam; this optimizer is none of "
      "them");
}

} // namespace

std::map<int64_t, StateDict> optimizer_param_states(
    Optimizer& o,
    bool fetch_offloaded) {
  check_supported(o, fetch_offloaded);
  std::map<int64_t, StateDict> out;
  auto params = all_params(o);
  auto& state = o.state();
  using Map = std::decay_t<decltype(state)>;
  for (size_t id = 0; id < params.size(); ++id) {
    auto it = state.find(compat::optimizer_state_key<Map>(params[id]));
    if (it == state.end()) {
      continue; // no step taken for this parameter yet
    }
    StateDict s;
    const auto& ps = *it->second;
    if (auto* h = as<nn::optimizer::HybridAdamParamState>(ps)) {
      adam_state(s, *h, int_step_tensor(h->step()));
    } else if (auto* a = as<torch::optim::AdamWParamState>(ps)) {
      adam_state(s, *a, step_tensor(a->step()));
      if (a->max_exp_avg_sq().defined()) {
        s.insert("max_exp_avg_sq", a->max_exp_avg_sq());
      }
    } else if (auto* a = as<torch::optim::AdamParamState>(ps)) {
      adam_state(s, *a, step_tensor(a->step()));
      if (a->max_exp_avg_sq().defined()) {
        s.insert("max_exp_avg_sq", a->max_exp_avg_sq());
      }
    } else if (auto* m = as<torch::optim::SGDParamState>(ps)) {
      s.insert("momentum_buffer", m->momentum_buffer());
    } else if (auto* r = as<torch::optim::RMSpropParamState>(ps)) {
      s.insert("step", step_tensor(r->step()));
      s.insert("square_avg", r->square_avg());
      if (r->momentum_buffer().defined()) {
        s.insert("momentum_buffer", r->momentum_buffer());
      }
      if (r->grad_avg().defined()) {
        s.insert("grad_avg", r->grad_avg());
      }
    } else if (auto* g = as<torch::optim::AdagradParamState>(ps)) {
      s.insert("step", step_tensor(g->step()));
      s.insert("sum", g->sum());
    }
    out.emplace(static_cast<int64_t>(id), std::move(s));
  }
  return out;
}

c10::impl::GenericList optimizer_param_groups(Optimizer& o) {
  check_supported(o);
  c10::impl::GenericList groups(c10::AnyType::get());
  int64_t next_id = 0;
  for (auto& g : o.param_groups()) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    auto& opts = g.options();
    if (auto* h = dynamic_cast<nn::optimizer::HybridAdamOptions*>(&opts)) {
      adam_group(d, *h);
      d.insert("bias_correction", h->bias_correction());
      d.insert("adamw_mode", h->adamw_mode());
    } else if (auto* a = dynamic_cast<torch::optim::AdamWOptions*>(&opts)) {
      adam_group(d, *a);
      d.insert("amsgrad", a->amsgrad());
      torch_group_flags(
          d, {"maximize", "capturable", "differentiable"}, {"foreach", "fused"});
      d.insert("decoupled_weight_decay", true); // PyTorch >= 2.6 writes it
    } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&opts)) {
      adam_group(d, *a);
      d.insert("amsgrad", a->amsgrad());
      torch_group_flags(
          d,
          {"maximize", "capturable", "differentiable", "decoupled_weight_decay"},
          {"foreach", "fused"});
    } else if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&opts)) {
      d.insert("lr", s->lr());
      d.insert("momentum", s->momentum());
      d.insert("dampening", s->dampening());
      d.insert("weight_decay", s->weight_decay());
      d.insert("nesterov", s->nesterov());
      torch_group_flags(d, {"maximize", "differentiable"}, {"foreach", "fused"});
    } else if (auto* r = dynamic_cast<torch::optim::RMSpropOptions*>(&opts)) {
      d.insert("lr", r->lr());
      d.insert("alpha", r->alpha());
      d.insert("eps", r->eps());
      d.insert("weight_decay", r->weight_decay());
      d.insert("momentum", r->momentum());
      d.insert("centered", r->centered());
      torch_group_flags(
          d, {"capturable", "maximize", "differentiable"}, {"foreach"});
    } else if (auto* a = dynamic_cast<torch::optim::AdagradOptions*>(&opts)) {
      d.insert("lr", a->lr());
      d.insert("lr_decay", a->lr_decay());
      d.insert("weight_decay", a->weight_decay());
      d.insert("initial_accumulator_value", a->initial_accumulator_value());
      d.insert("eps", a->eps());
      torch_group_flags(d, {"maximize", "differentiable"}, {"foreach", "fused"});
    }
    // A list of any (not List[int], which LibTorch pickles as a call of
    // torch.jit._pickle.build_intlist that Python's weights_only load
    // refuses).
    c10::impl::GenericList ids(c10::AnyType::get());
    for (size_t i = 0; i < g.params().size(); ++i) {
      ids.push_back(next_id++);
    }
    d.insert("params", ids);
    groups.push_back(d);
  }
  return groups;
}

void check_state_numel(
    const std::string& file,
    const std::string& key,
    int64_t id,
    int64_t state_numel,
    int64_t param_numel) {
  TORCH_CHECK(
      state_numel == param_numel,
      "optimizer checkpoint '",
      file,
      "': state '",
      key,
      "' of parameter ",
      id,
      " has ",
      state_numel,
      " elements, the parameter has ",
      param_numel);
}

void load_param_state(
    Optimizer& o,
    int64_t id,
    const StateDict& s,
    const std::string& file) {
  check_supported(o);
  auto params = all_params(o);
  TORCH_CHECK(
      id >= 0 && id < static_cast<int64_t>(params.size()),
      "optimizer checkpoint '",
      file,
      "' has state for parameter ",
      id,
      " but the optimizer has ",
      params.size(),
      " parameters");
  const auto& p = params[id];
  auto& state = o.state();
  using Map = std::decay_t<decltype(state)>;
  auto key = compat::optimizer_state_key<Map>(p);
  const auto k = kind(o);
  if (k == "HybridAdam") {
    auto st = std::make_unique<nn::optimizer::HybridAdamParamState>();
    st->step(step_value(s, file));
    st->exp_avg(get(s, "exp_avg", p, file));
    st->exp_avg_sq(get(s, "exp_avg_sq", p, file));
    state[key] = std::move(st);
  } else if (k == "AdamW" || k == "Adam") {
    auto fill = [&](auto st) {
      st->step(step_value(s, file));
      st->exp_avg(get(s, "exp_avg", p, file));
      st->exp_avg_sq(get(s, "exp_avg_sq", p, file));
      st->max_exp_avg_sq(get(s, "max_exp_avg_sq", p, file, false));
      state[key] = std::move(st);
    };
    if (k == "AdamW") {
      fill(std::make_unique<torch::optim::AdamWParamState>());
    } else {
      fill(std::make_unique<torch::optim::AdamParamState>());
    }
  } else if (k == "SGD") {
    auto st = std::make_unique<torch::optim::SGDParamState>();
    st->momentum_buffer(get(s, "momentum_buffer", p, file));
    state[key] = std::move(st);
  } else if (k == "RMSprop") {
    auto st = std::make_unique<torch::optim::RMSpropParamState>();
    st->step(step_value(s, file));
    st->square_avg(get(s, "square_avg", p, file));
    st->momentum_buffer(get(s, "momentum_buffer", p, file, false));
    st->grad_avg(get(s, "grad_avg", p, file, false));
    state[key] = std::move(st);
  } else {
    auto st = std::make_unique<torch::optim::AdagradParamState>();
    st->step(step_value(s, file));
    st->sum(get(s, "sum", p, file));
    state[key] = std::move(st);
  }
}

namespace {

// One param group of a checkpoint, read with errors that name the file,
// group and key. Python writes whole numbers as ints (weight_decay=0).
class GroupReader {
 public:
  GroupReader(const c10::IValue& v, const std::string& file, size_t i)
      : file_(file), i_(i) {
    check(v.isGenericDict(), "is not a dict");
    d_ = v.toGenericDict();
  }
  const c10::IValue& at(const char* key) const {
    auto it = d_.find(c10::IValue(std::string(key)));
    check(it != d_.end(), std::string("has no '") + key + "'");
    return it->value();
  }
  double num(const char* key) const {
    const auto& v = at(key);
    check(
        v.isDouble() || v.isInt() || v.isBool(),
        std::string("'") + key + "' is not a number");
    return v.isDouble() ? v.toDouble()
        : v.isInt()     ? static_cast<double>(v.toInt())
                        : static_cast<double>(v.toBool());
  }
  bool flag(const char* key) const {
    const auto& v = at(key);
    check(v.isBool() || v.isInt(), std::string("'") + key + "' is not a bool");
    return v.isBool() ? v.toBool() : v.toInt() != 0;
  }
  bool has(const char* key) const {
    return d_.find(c10::IValue(std::string(key))) != d_.end();
  }
  /// `key`'s flag, `fallback` when the group has none (another writer's
  /// spelling: ColossalAI keeps HybridAdam's adamw_mode outside groups).
  bool flag_or(const char* key, bool fallback) const {
    return has(key) ? flag(key) : fallback;
  }
  /// PyTorch's flags this library cannot honour (maximize): a group that
  /// sets one is refused rather than trained the other way.
  void refuse_set(const char* key, const char* why) const {
    if (has(key) && !at(key).isNone()) {
      check(!flag(key), std::string("sets '") + key + "' (" + why + ")");
    }
  }
  std::tuple<double, double> betas() const {
    const auto& v = at("betas");
    std::vector<c10::IValue> items;
    if (v.isTuple()) {
      items = v.toTupleRef().elements().vec();
    } else if (v.isList()) {
      items = v.toList().vec();
    }
    check(
        items.size() == 2 && items[0].isDouble() && items[1].isDouble(),
        "'betas' is not a pair of floats");
    return std::make_tuple(items[0].toDouble(), items[1].toDouble());
  }
  size_t num_params() const {
    const auto& v = at("params");
    check(v.isList(), "'params' is not a list");
    return v.toList().size();
  }

 private:
  void check(bool ok, const std::string& what) const {
    TORCH_CHECK(
        ok, "optimizer checkpoint '", file_, "': param group ", i_, " ", what);
  }
  c10::impl::GenericDict d_{c10::AnyType::get(), c10::AnyType::get()};
  const std::string& file_;
  size_t i_;
};

} // namespace

void load_param_groups(
    Optimizer& o,
    const c10::IValue& value,
    const std::string& file) {
  check_supported(o);
  TORCH_CHECK(
      value.isList(),
      "optimizer checkpoint '",
      file,
      "': param_groups is not a list");
  auto groups = value.toList();
  TORCH_CHECK(
      groups.size() == o.param_groups().size(),
      "optimizer checkpoint '",
      file,
      "' has ",
      groups.size(),
      " param groups, the optimizer has ",
      o.param_groups().size());
  for (size_t i = 0; i < groups.size(); ++i) {
    GroupReader d(groups.get(i), file, i);
    auto& g = o.param_groups()[i];
    const auto n = d.num_params();
    TORCH_CHECK(
        n == g.params().size(),
        "optimizer checkpoint '",
        file,
        "': param group ",
        i,
        " has ",
        n,
        " parameters, the optimizer's has ",
        g.params().size());
    auto& opts = g.options();
    d.refuse_set("maximize", "LibTorch's optimizers minimise only");
    if (auto* h = dynamic_cast<nn::optimizer::HybridAdamOptions*>(&opts)) {
      h->lr(d.num("lr")).betas(d.betas()).eps(d.num("eps"));
      h->weight_decay(d.num("weight_decay"));
      h->bias_correction(d.flag_or("bias_correction", h->bias_correction()));
      h->adamw_mode(d.flag_or("adamw_mode", h->adamw_mode()));
    } else if (auto* a = dynamic_cast<torch::optim::AdamWOptions*>(&opts)) {
      a->lr(d.num("lr")).betas(d.betas()).eps(d.num("eps"));
      a->weight_decay(d.num("weight_decay")).amsgrad(d.flag("amsgrad"));
    } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&opts)) {
      d.refuse_set(
          "decoupled_weight_decay",
          "Adam with decoupled weight decay is AdamW: load it into "
          "torch::optim::AdamW");
      a->lr(d.num("lr")).betas(d.betas()).eps(d.num("eps"));
      a->weight_decay(d.num("weight_decay")).amsgrad(d.flag("amsgrad"));
    } else if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&opts)) {
      s->lr(d.num("lr")).momentum(d.num("momentum"));
      s->dampening(d.num("dampening")).weight_decay(d.num("weight_decay"));
      s->nesterov(d.flag("nesterov"));
    } else if (auto* r = dynamic_cast<torch::optim::RMSpropOptions*>(&opts)) {
      r->lr(d.num("lr")).alpha(d.num("alpha")).eps(d.num("eps"));
      r->weight_decay(d.num("weight_decay")).momentum(d.num("momentum"));
      r->centered(d.flag("centered"));
    } else if (auto* a = dynamic_cast<torch::optim::AdagradOptions*>(&opts)) {
      a->lr(d.num("lr")).lr_decay(d.num("lr_decay"));
      a->weight_decay(d.num("weight_decay")).eps(d.num("eps"));
      a->initial_accumulator_value(d.num("initial_accumulator_value"));
    }
  }
}

std::map<int64_t, StateDict> param_states(
    const c10::IValue& v,
    const std::string& file) {
  TORCH_CHECK(
      v.isGenericDict(),
      "optimizer checkpoint '",
      file,
      "': expected a dict of parameter states");
  std::map<int64_t, StateDict> out;
  for (const auto& kv : v.toGenericDict()) {
    TORCH_CHECK(
        kv.key().isInt() && kv.value().isGenericDict(),
        "optimizer checkpoint '",
        file,
        "': state entries must be {int: {str: tensor}}");
    StateDict s;
    for (const auto& inner : kv.value().toGenericDict()) {
      TORCH_CHECK(
          inner.key().isString(),
          "optimizer checkpoint '",
          file,
          "': state keys must be strings");
      const auto& value = inner.value();
      if (value.isTensor()) {
        s.insert(inner.key().toStringRef(), value.toTensor());
      } else if (value.isDouble() || value.isInt()) {
        // Python's older layout stores step as a number.
        s.insert(
            inner.key().toStringRef(),
            at::scalar_tensor(value.toScalar(), at::kDouble));
      }
    }
    out.emplace(kv.key().toInt(), std::move(s));
  }
  return out;
}

void load_state_dict(
    const c10::IValue& v,
    const std::string& file,
    const std::function<void(const c10::IValue&)>& load_groups,
    const std::function<void(int64_t, const StateDict&)>& load_param) {
  TORCH_CHECK(
      v.isGenericDict(),
      "load_optimizer: '",
      file,
      "' is not an optimizer state dict");
  auto d = v.toGenericDict();
  const c10::IValue state_key(std::string("state"));
  const c10::IValue groups_key(std::string("param_groups"));
  TORCH_CHECK(
      d.contains(state_key) && d.contains(groups_key),
      "load_optimizer: '",
      file,
      "' lacks 'state' or 'param_groups'");
  load_groups(d.at(groups_key));
  for (const auto& kv : param_states(d.at(state_key), file)) {
    load_param(kv.first, kv.second);
  }
}

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
