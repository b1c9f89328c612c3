#include <colossalai/nn/lr_scheduler/onecycle.h>

#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <tuple>

#include "pi.h"

namespace colossalai {
namespace nn {
namespace lr_scheduler {

namespace {
using detail::kPi;

// PyTorch cycles `momentum` where the optimizer has one and beta1 where it
// has `betas`; LibTorch's options are typed, so look at the concrete type.
template <class Options>
bool set_beta1(torch::optim::OptimizerOptions& options, double value) {
  auto* o = dynamic_cast<Options*>(&options);
  if (o == nullptr) {
    return false;
  }
  o->betas(std::make_tuple(value, std::get<1>(o->betas())));
  return true;
}

template <class Options>
bool set_momentum_of(torch::optim::OptimizerOptions& options, double value) {
  auto* o = dynamic_cast<Options*>(&options);
  if (o == nullptr) {
    return false;
  }
  o->momentum(value);
  return true;
}

bool set_momentum(torch::optim::OptimizerOptions& options, double value) {
  return set_momentum_of<torch::optim::SGDOptions>(options, value) ||
      set_momentum_of<torch::optim::RMSpropOptions>(options, value) ||
      set_beta1<torch::optim::AdamOptions>(options, value) ||
      set_beta1<torch::optim::AdamWOptions>(options, value);
}

// PyTorch's `use_beta1`: whether the optimizer's momentum is beta1, i.e.
// whether set_momentum above writes `betas`.
bool uses_beta1(const torch::optim::OptimizerOptions& options) {
  return dynamic_cast<const torch::optim::AdamOptions*>(&options) != nullptr ||
      dynamic_cast<const torch::optim::AdamWOptions*>(&options) != nullptr;
}
} // namespace

OneCycleLR::OneCycleLR(
    torch::optim::Optimizer& optimizer,
    const OneCycleLROptions& options)
    : LRScheduler(optimizer), options_(options) {
  const auto& o = options_;
  TORCH_CHECK(
      o.total_steps() > 0,
      "OneCycleLR: total_steps must be > 0, got ",
      o.total_steps());
  TORCH_CHECK(
      o.pct_start() >= 0 && o.pct_start() <= 1,
      "OneCycleLR: pct_start must be in [0, 1], got ",
      o.pct_start());
  TORCH_CHECK(
      o.anneal_strategy() == "cos" || o.anneal_strategy() == "linear",
      "OneCycleLR: anneal_strategy must be 'cos' or 'linear', got '",
      o.anneal_strategy(),
      "'");

  const auto total = static_cast<double>(o.total_steps());
  if (o.three_phase()) {
    phases_ = {
        {o.pct_start() * total - 1,
         &Group::initial_lr,
         &Group::max_lr,
         &Group::max_momentum,
         &Group::base_momentum},
        {2 * o.pct_start() * total - 2,
         &Group::max_lr,
         &Group::initial_lr,
         &Group::base_momentum,
         &Group::max_momentum},
        {total - 1,
         &Group::initial_lr,
         &Group::min_lr,
         &Group::max_momentum,
         &Group::max_momentum},
    };
  } else {
    phases_ = {
        {o.pct_start() * total - 1,
         &Group::initial_lr,
         &Group::max_lr,
         &Group::max_momentum,
         &Group::base_momentum},
        {total - 1,
         &Group::max_lr,
         &Group::min_lr,
         &Group::base_momentum,
         &Group::max_momentum},
    };
  }

  // ColossalAI's max_lr is each group's lr at construction.
  for (double max_lr : group_lrs()) {
    Group g{};
    g.max_lr = max_lr;
    g.initial_lr = max_lr / o.div_factor();
    g.min_lr = g.initial_lr / o.final_div_factor();
    g.max_momentum = o.max_momentum();
    g.base_momentum = o.base_momentum();
    groups_.push_back(g);
  }
  if (o.cycle_momentum()) {
    for (auto& group : optimizer.param_groups()) {
      TORCH_CHECK(
          set_momentum(group.options(), o.max_momentum()),
          "OneCycleLR: cycle_momentum=true needs an optimizer with momentum "
          "(SGD, RMSprop) or betas (Adam, AdamW); use cycle_momentum(false) "
          "for others");
    }
  }
  for (size_t i = 0; i < groups_.size(); ++i) {
    base_lrs_[i] = groups_[i].initial_lr;
  }
  initial_step();
}

double OneCycleLR::anneal(double start, double end, double pct) const {
  if (options_.anneal_strategy() == "cos") {
    const double cos_out = std::cos(kPi * pct) + 1;
    return end + (start - end) / 2.0 * cos_out;
  }
  return (end - start) * pct + start;
}

std::vector<double> OneCycleLR::get_lr() {
  TORCH_CHECK(
      last_epoch_ <= options_.total_steps(),
      "OneCycleLR: tried to step ",
      last_epoch_ + 1,
      " times; total_steps is ",
      options_.total_steps());
  const auto step = static_cast<double>(last_epoch_);
  std::vector<double> lrs;
  std::vector<double> momenta;
  for (const Group& g : groups_) {
    double start_step = 0;
    for (size_t i = 0; i < phases_.size(); ++i) {
      const Phase& phase = phases_[i];
      if (step <= phase.end_step || i + 1 == phases_.size()) {
        const double pct = (step - start_step) / (phase.end_step - start_step);
        lrs.push_back(anneal(g.*phase.start_lr, g.*phase.end_lr, pct));
        momenta.push_back(
            anneal(g.*phase.start_momentum, g.*phase.end_momentum, pct));
        break;
      }
      start_step = phase.end_step;
    }
  }
  if (options_.cycle_momentum()) {
    auto& groups = optimizer_.param_groups();
    for (size_t i = 0; i < groups.size(); ++i) {
      set_momentum(groups[i].options(), momenta[i]);
    }
    last_momenta_ = std::move(momenta);
  }
  return lrs;
}

void OneCycleLR::save_state(torch::serialize::OutputArchive& archive) const {
  std::vector<double> fields[5];
  for (const Group& g : groups_) {
    fields[0].push_back(g.initial_lr);
    fields[1].push_back(g.max_lr);
    fields[2].push_back(g.min_lr);
    fields[3].push_back(g.max_momentum);
    fields[4].push_back(g.base_momentum);
  }
  detail::write_doubles(archive, "initial_lrs", fields[0]);
  detail::write_doubles(archive, "max_lrs", fields[1]);
  detail::write_doubles(archive, "min_lrs", fields[2]);
  detail::write_doubles(archive, "max_momenta", fields[3]);
  detail::write_doubles(archive, "base_momenta", fields[4]);
  detail::write_doubles(archive, "last_momenta", last_momenta_);
}

void OneCycleLR::load_state(torch::serialize::InputArchive& archive) {
  const char* keys[5] = {
      "initial_lrs", "max_lrs", "min_lrs", "max_momenta", "base_momenta"};
  std::vector<double> fields[5];
  for (int k = 0; k < 5; ++k) {
    fields[k] = detail::read_doubles(archive, keys[k]);
    TORCH_CHECK(
        fields[k].size() == groups_.size(),
        "OneCycleLR: the saved state has ",
        fields[k].size(),
        " parameter groups, the optimizer ",
        groups_.size());
  }
  for (size_t i = 0; i < groups_.size(); ++i) {
    groups_[i] = Group{
        fields[0][i], fields[1][i], fields[2][i], fields[3][i], fields[4][i]};
  }
  auto momenta = detail::read_doubles(archive, "last_momenta");
  if (options_.cycle_momentum() && momenta.size() == groups_.size()) {
    auto& groups = optimizer_.param_groups();
    for (size_t i = 0; i < groups.size(); ++i) {
      set_momentum(groups[i].options(), momenta[i]);
    }
    last_momenta_ = std::move(momenta);
  }
}

void OneCycleLR::state_dict_extra(c10::impl::GenericDict& state) const {
  // The group fields a phase interpolates between, by the names of the
  // param-group entries Python keeps them in.
  auto field = [](double Group::*member) -> std::string {
    if (member == &Group::initial_lr) {
      return "initial_lr";
    }
    if (member == &Group::max_lr) {
      return "max_lr";
    }
    if (member == &Group::min_lr) {
      return "min_lr";
    }
    if (member == &Group::max_momentum) {
      return "max_momentum";
    }
    TORCH_INTERNAL_ASSERT(member == &Group::base_momentum);
    return "base_momentum";
  };
  c10::impl::GenericList phases(c10::AnyType::get());
  for (const Phase& phase : phases_) {
    auto d = detail::new_state_dict();
    d.insert("end_step", phase.end_step);
    d.insert("start_lr", field(phase.start_lr));
    d.insert("end_lr", field(phase.end_lr));
    d.insert("start_momentum", field(phase.start_momentum));
    d.insert("end_momentum", field(phase.end_momentum));
    phases.push_back(d);
  }
  state.insert_or_assign("total_steps", options_.total_steps());
  state.insert_or_assign("_schedule_phases", phases);
  state.insert_or_assign("_anneal_func_type", options_.anneal_strategy());
  state.insert_or_assign("cycle_momentum", options_.cycle_momentum());
  state.insert_or_assign("use_beta1", uses_beta1(optimizer_.defaults()));
}

void OneCycleLR::load_state_dict_extra(const c10::impl::GenericDict& state) {
  TORCH_CHECK(
      last_epoch_ <= options_.total_steps(),
      "OneCycleLR: the state is at step ",
      last_epoch_,
      ", past this scheduler's total_steps (",
      options_.total_steps(),
      ")");
  // Python's groups carry initial_lr / max_lr / min_lr in the optimizer's
  // checkpoint. Here they come from the constructor, which took max_lr from
  // the groups' lr; when the state's base_lrs (initial_lr) say otherwise,
  // e.g. because the optimizer's lr had been loaded before the scheduler was
  // built, they follow from base_lrs (to within rounding of max_lr).
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (groups_[i].initial_lr != base_lrs_[i]) {
      groups_[i].initial_lr = base_lrs_[i];
      groups_[i].max_lr = base_lrs_[i] * options_.div_factor();
      groups_[i].min_lr = base_lrs_[i] / options_.final_div_factor();
    }
  }
  if (options_.cycle_momentum()) {
    // get_lr writes the momentum of step last_epoch_ into the groups; the lr
    // is closed-form, and the state's _last_lr is what the groups get.
    get_lr();
  }
}

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
