#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <c10/util/Exception.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

LRScheduler::LRScheduler(torch::optim::Optimizer& optimizer)
    : optimizer_(optimizer) {
  TORCH_CHECK(
      !optimizer_.param_groups().empty(),
      "LRScheduler: the optimizer has no parameter groups");
  base_lrs_ = group_lrs();
}

void LRScheduler::initial_step() {
  last_epoch_ = -1;
  step();
}

void LRScheduler::step() {
  ++last_epoch_;
  auto lrs = get_lr();
  TORCH_INTERNAL_ASSERT(lrs.size() == num_groups());
  set_group_lrs(lrs);
  last_lrs_ = group_lrs();
}

std::vector<double> LRScheduler::group_lrs() const {
  std::vector<double> lrs;
  lrs.reserve(num_groups());
  for (const auto& group : optimizer_.param_groups()) {
    lrs.push_back(group.options().get_lr());
  }
  return lrs;
}

void LRScheduler::set_group_lrs(const std::vector<double>& lrs) {
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    groups[i].options().set_lr(lrs[i]);
  }
}

void LRScheduler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("type", c10::IValue(name()));
  archive.write("last_epoch", c10::IValue(last_epoch_));
  detail::write_doubles(archive, "base_lrs", base_lrs_);
  detail::write_doubles(archive, "last_lrs", last_lrs_);
  save_state(archive);
}

void LRScheduler::load(torch::serialize::InputArchive& archive) {
  c10::IValue type;
  archive.read("type", type);
  TORCH_CHECK(
      type.isString() && type.toStringRef() == name(),
      name(),
      ": cannot load the state of a ",
      type.isString() ? type.toStringRef() : std::string("non-scheduler"));
  auto base_lrs = detail::read_doubles(archive, "base_lrs");
  auto last_lrs = detail::read_doubles(archive, "last_lrs");
  TORCH_CHECK(
      base_lrs.size() == num_groups() && last_lrs.size() == num_groups(),
      name(),
      ": the saved state has ",
      base_lrs.size(),
      " parameter groups, the optimizer ",
      num_groups());
  last_epoch_ = detail::read_int(archive, "last_epoch");
  base_lrs_ = std::move(base_lrs);
  last_lrs_ = std::move(last_lrs);
  load_state(archive);
  // Recursive schedules continue from the groups' lr, so restore it even
  // when the optimizer's own state is not loaded.
  set_group_lrs(last_lrs_);
}

c10::impl::GenericDict LRScheduler::state_dict() const {
  auto state = detail::new_state_dict();
  // Python's __dict__ order: a class's own attributes come first (set
  // before the base constructor runs), then the base's.
  state_dict_extra(state);
  state.insert_or_assign("base_lrs", detail::float_list(base_lrs_));
  state.insert_or_assign("last_epoch", python_last_epoch());
  // Python counts the initial step too.
  state.insert_or_assign("_step_count", python_last_epoch() + 1);
  state.insert_or_assign("verbose", false);
  state.insert_or_assign("_get_lr_called_within_step", false);
  state.insert_or_assign("_last_lr", detail::float_list(last_lrs_));
  return state;
}

void LRScheduler::load_state_dict(const c10::impl::GenericDict& state) {
  const std::string who = name();
  if (!two_stage()) {
    const c10::IValue* type = detail::find_entry(state, "after_scheduler_type");
    TORCH_CHECK(
        detail::find_entry(state, "after_scheduler_dict") == nullptr,
        who,
        ": cannot load a two-stage scheduler's state (it has "
        "'after_scheduler_dict'",
        type != nullptr && type->isString()
            ? ", second stage " + type->toStringRef()
            : std::string(),
        ")");
  }
  // Everything is read and checked before anything changes.
  const int64_t last_epoch = detail::int_entry(
      detail::require_entry(state, who, "last_epoch"), who, "last_epoch");
  TORCH_CHECK(
      last_epoch >= 0,
      who,
      ": 'last_epoch' must be >= 0 (the state of a constructed scheduler), "
      "got ",
      last_epoch);
  auto base_lrs = detail::numbers_entry(
      detail::require_entry(state, who, "base_lrs"), who, "base_lrs");
  auto last_lrs = detail::numbers_entry(
      detail::require_entry(state, who, "_last_lr"), who, "_last_lr");
  for (const auto* entry : {&base_lrs, &last_lrs}) {
    TORCH_CHECK(
        entry->size() == num_groups(),
        who,
        ": '",
        entry == &base_lrs ? "base_lrs" : "_last_lr",
        "' has ",
        entry->size(),
        " entries (parameter groups), the optimizer has ",
        num_groups(),
        " parameter groups");
  }

  auto old_last_epoch = last_epoch_;
  auto old_base_lrs = std::move(base_lrs_);
  auto old_last_lrs = std::move(last_lrs_);
  last_epoch_ = last_epoch;
  base_lrs_ = std::move(base_lrs);
  last_lrs_ = std::move(last_lrs);
  try {
    load_state_dict_extra(state);
  } catch (...) {
    last_epoch_ = old_last_epoch;
    base_lrs_ = std::move(old_base_lrs);
    last_lrs_ = std::move(old_last_lrs);
    throw;
  }
  // As in `load`: recursive schedules continue from the groups' lr.
  set_group_lrs(last_lrs_);
}

namespace detail {

c10::impl::GenericDict new_state_dict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

c10::IValue float_list(const std::vector<double>& values) {
  c10::impl::GenericList list(c10::AnyType::get());
  list.reserve(values.size());
  for (double v : values) {
    list.push_back(c10::IValue(v));
  }
  return list;
}

const c10::IValue* find_entry(
    const c10::impl::GenericDict& state,
    const std::string& key) {
  auto it = state.find(c10::IValue(key));
  return it == state.end() ? nullptr : &it->value();
}

const c10::IValue& require_entry(
    const c10::impl::GenericDict& state,
    const std::string& who,
    const std::string& key) {
  const c10::IValue* value = find_entry(state, key);
  TORCH_CHECK(
      value != nullptr,
      who,
      ": the scheduler state has no '",
      key,
      "' (not a state_dict() of this scheduler?)");
  return *value;
}

int64_t int_entry(
    const c10::IValue& value,
    const std::string& who,
    const std::string& key) {
  TORCH_CHECK(
      value.isInt(),
      who,
      ": '",
      key,
      "' in the scheduler state is a ",
      value.tagKind(),
      ", not an int");
  return value.toInt();
}

bool bool_entry(
    const c10::IValue& value,
    const std::string& who,
    const std::string& key) {
  TORCH_CHECK(
      value.isBool(),
      who,
      ": '",
      key,
      "' in the scheduler state is a ",
      value.tagKind(),
      ", not a bool");
  return value.toBool();
}

double number_entry(
    const c10::IValue& value,
    const std::string& who,
    const std::string& key) {
  if (value.isInt()) {
    return static_cast<double>(value.toInt());
  }
  TORCH_CHECK(
      value.isDouble(),
      who,
      ": '",
      key,
      "' in the scheduler state holds a ",
      value.tagKind(),
      ", not a number");
  return value.toDouble();
}

std::vector<double> numbers_entry(
    const c10::IValue& value,
    const std::string& who,
    const std::string& key) {
  TORCH_CHECK(
      value.isList(),
      who,
      ": '",
      key,
      "' in the scheduler state is a ",
      value.tagKind(),
      ", not a list of numbers");
  std::vector<double> out;
  for (const c10::IValue& item : value.toListRef()) {
    out.push_back(number_entry(item, who, key));
  }
  return out;
}

void write_doubles(
    torch::serialize::OutputArchive& archive,
    const std::string& key,
    const std::vector<double>& values) {
  archive.write(key, c10::IValue(values));
}

std::vector<double> read_doubles(
    torch::serialize::InputArchive& archive,
    const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  TORCH_CHECK(
      value.isDoubleList(), "lr scheduler state: '", key, "' is not a list");
  return value.toDoubleVector();
}

double read_double(
    torch::serialize::InputArchive& archive,
    const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  TORCH_CHECK(
      value.isDouble(), "lr scheduler state: '", key, "' is not a float");
  return value.toDouble();
}

int64_t read_int(
    torch::serialize::InputArchive& archive,
    const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  TORCH_CHECK(value.isInt(), "lr scheduler state: '", key, "' is not an int");
  return value.toInt();
}

bool read_bool(
    torch::serialize::InputArchive& archive,
    const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  TORCH_CHECK(value.isBool(), "lr scheduler state: '", key, "' is not a bool");
  return value.toBool();
}

} // namespace detail

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
