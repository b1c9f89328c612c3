#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <string>
#include <vector>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

/// Base of the learning-rate schedulers (`colossalai.nn.lr_scheduler`), with
/// the semantics of PyTorch's `torch.optim.lr_scheduler._LRScheduler`:
///
///  - construction records `base_lrs()` (each parameter group's lr at that
///    moment) and takes the initial step, so `last_epoch() == 0` and every
///    group's lr is the schedule's value at step 0;
///  - `step()` advances one step and writes the new lr into the groups.
///
/// The scheduler keeps a reference to the optimizer, which must outlive it
/// (as with LibTorch's own `torch::optim::LRScheduler`). With a boosted
/// optimizer pass `boosted.optimizer->unwrap()`.
///
/// Recursive ("chainable") schedules such as `CosineAnnealingLR` or
/// `ExponentialLR` derive the next lr from the groups' current lr, exactly as
/// PyTorch does, so a change made to a group's lr between steps carries on.
///
/// `save` / `load` store the scheduler's state in a LibTorch archive; a fresh
/// scheduler of the same kind and options, built on a fresh optimizer, that
/// loads it continues the schedule as if it had never stopped. `load` also
/// writes the restored lr (and momentum, for `OneCycleLR`) into the groups.
/// Instead of `last_epoch` constructor arguments (which in PyTorch need an
/// `initial_lr` entry in each group), resume with `load`.
///
/// `state_dict` / `load_state_dict` give and take the same state as the dict
/// Python's `scheduler.state_dict()` returns (the checkpoint files of
/// `CheckpointIO::save_lr_scheduler` are that dict, pickled as `torch.save`
/// writes it), so a schedule can move between Python and C++ either way.
///
/// Example:
/// \code
///   auto optimizer = std::make_shared<torch::optim::SGD>(
///       model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
///   namespace sched = colossalai::nn::lr_scheduler;
///   sched::CosineAnnealingWarmupLR scheduler(
///       *optimizer,
///       sched::CosineAnnealingWarmupLROptions(1000).warmup_steps(50));
///   for (int64_t i = 0; i < 1000; ++i) {
///     train_step();
///     optimizer->step();
///     scheduler.step();
///   }
/// \endcode
///
/// To write a scheduler, derive from `LRScheduler`, implement `get_lr()` and
/// `name()`, and call `initial_step()` at the end of the constructor (virtual
/// calls do not reach a derived class from the base constructor).
class LRScheduler {
 public:
  explicit LRScheduler(torch::optim::Optimizer& optimizer);
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  /// Advances the schedule by one step.
  virtual void step();

  /// The learning rates the last step set, one per parameter group.
  const std::vector<double>& get_last_lr() const {
    return last_lrs_;
  }
  /// Steps taken since construction (0 right after it).
  int64_t last_epoch() const {
    return last_epoch_;
  }
  /// Each group's lr when the schedule started (its peak for most schedules).
  const std::vector<double>& base_lrs() const {
    return base_lrs_;
  }
  torch::optim::Optimizer& optimizer() const {
    return optimizer_;
  }
  /// The class name, stored by `save` and checked by `load`.
  virtual std::string name() const = 0;

  void save(torch::serialize::OutputArchive& archive) const;
  /// Restores a state written by `save` of a scheduler of the same kind, and
  /// sets the optimizer's groups to the restored learning rates.
  void load(torch::serialize::InputArchive& archive);

  /// The state as Python's `scheduler.state_dict()` holds it: a dict with
  /// string keys of the attributes PyTorch's / ColossalAI's class of the same
  /// name keeps (`last_epoch`, `base_lrs`, `_last_lr`, `_step_count`, ...,
  /// then the class's own, e.g. `T_max` and `eta_min` for
  /// `CosineAnnealingLR`). Two-stage schedulers hold their second stage's
  /// dict under `after_scheduler_dict`, as ColossalAI's do. Lists hold no
  /// LibTorch type tags, so `checkpoint_io::pickle_archive` writes a file
  /// that Python's `torch.load(path, weights_only=True)` (PyTorch 2) reads
  /// and `scheduler.load_state_dict` takes.
  ///
  /// Example:
  /// \code
  ///   namespace ck = colossalai::checkpoint_io;
  ///   auto bytes = ck::pickle_archive(scheduler.state_dict());
  ///   // Python: s.load_state_dict(torch.load(path, weights_only=True))
  /// \endcode
  c10::impl::GenericDict state_dict() const;
  /// Restores a state given by `state_dict` or by Python's
  /// `scheduler.state_dict()` (numbers may be ints or floats) into a
  /// scheduler of the same kind and options, then sets the optimizer's groups
  /// to the restored learning rates (and momenta, for `OneCycleLR`). Needs
  /// `last_epoch`, `base_lrs` and `_last_lr` (one entry per parameter group)
  /// and, for two-stage schedulers, `finished`; keys it does not model are
  /// ignored, and so are the dict's copies of the options (`gamma`,
  /// `T_max`, ...): those come from the constructor. Refuses, naming the
  /// scheduler and the key, a state it cannot apply.
  ///
  /// Example:
  /// \code
  ///   resumed.load_state_dict(scheduler.state_dict());
  ///   // A file of Python's torch.save(scheduler.state_dict(), "sched.pt"):
  ///   booster.load_lr_scheduler(resumed, "sched.pt");
  /// \endcode
  void load_state_dict(const c10::impl::GenericDict& state);

 protected:
  /// The learning rates for step `last_epoch_`, one per group (PyTorch's
  /// chainable `get_lr`).
  virtual std::vector<double> get_lr() = 0;
  /// Takes the step to 0; call at the end of the most derived constructor.
  void initial_step();

  /// Extra state of a subclass; `load_state` runs before the groups get the
  /// restored learning rates.
  virtual void save_state(torch::serialize::OutputArchive& archive) const {}
  virtual void load_state(torch::serialize::InputArchive& archive) {}

  /// A subclass's entries of `state_dict`, under Python's attribute names.
  virtual void state_dict_extra(c10::impl::GenericDict& state) const {}
  /// Applies a subclass's part of `load_state_dict`. Runs after the common
  /// fields (`last_epoch_`, `base_lrs_`, `last_lrs_`) took the state's
  /// values and before the groups get the restored learning rates; if it
  /// throws, the common fields are put back.
  virtual void load_state_dict_extra(const c10::impl::GenericDict& state) {}
  /// The `last_epoch` Python's scheduler holds at this point (`_step_count`
  /// is one more): ours, except that ColossalAI's two-stage schedulers stop
  /// counting when their second stage starts.
  virtual int64_t python_last_epoch() const {
    return last_epoch_;
  }
  /// Whether this scheduler takes a two-stage scheduler's state (one with
  /// `after_scheduler_dict`); the others refuse it.
  virtual bool two_stage() const {
    return false;
  }

  /// The groups' current learning rates.
  std::vector<double> group_lrs() const;
  void set_group_lrs(const std::vector<double>& lrs);
  size_t num_groups() const {
    return optimizer_.param_groups().size();
  }

  /// Lets two-stage schedulers drive the scheduler they hand over to.
  static std::vector<double> get_lr_of(LRScheduler& scheduler) {
    return scheduler.get_lr();
  }
  static void set_base_lrs_of(
      LRScheduler& scheduler,
      const std::vector<double>& base_lrs) {
    scheduler.base_lrs_ = base_lrs;
  }

  torch::optim::Optimizer& optimizer_;
  int64_t last_epoch_ = -1;
  std::vector<double> base_lrs_;
  std::vector<double> last_lrs_;
};

namespace detail {
/// Archive helpers shared by the schedulers' `save_state` / `load_state`.
void write_doubles(
    torch::serialize::OutputArchive& archive,
    const std::string& key,
    const std::vector<double>& values);
std::vector<double> read_doubles(
    torch::serialize::InputArchive& archive,
    const std::string& key);
double read_double(
    torch::serialize::InputArchive& archive,
    const std::string& key);
int64_t read_int(
    torch::serialize::InputArchive& archive,
    const std::string& key);
bool read_bool(torch::serialize::InputArchive& archive, const std::string& key);

/// Helpers shared by the schedulers' `state_dict` / `load_state_dict`.
/// An empty dict with string keys, as Python's state dicts have.
c10::impl::GenericDict new_state_dict();
/// A plain list of floats (no LibTorch type tag, which Python's
/// weights_only load refuses).
c10::IValue float_list(const std::vector<double>& values);
/// The entry `key` of `state`, or nullptr.
const c10::IValue* find_entry(
    const c10::impl::GenericDict& state,
    const std::string& key);
/// The entry `key`; throws naming `who` and the key when it is missing.
const c10::IValue& require_entry(
    const c10::impl::GenericDict& state,
    const std::string& who,
    const std::string& key);
/// Typed reads of an entry; throw naming `who`, the key and what it holds.
int64_t int_entry(
    const c10::IValue& value,
    const std::string& who,
    const std::string& key);
bool bool_entry(
    const c10::IValue& value,
    const std::string& who,
    const std::string& key);
/// A float or an int (Python pickles an integral lr as an int).
double number_entry(
    const c10::IValue& value,
    const std::string& who,
    const std::string& key);
std::vector<double> numbers_entry(
    const c10::IValue& value,
    const std::string& who,
    const std::string& key);
} // namespace detail

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
