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

namespace detail {

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
