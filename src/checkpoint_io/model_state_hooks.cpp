#include <colossalai/checkpoint_io/model_state_hooks.h>

#include <mutex>
#include <utility>

namespace colossalai {
namespace checkpoint_io {

namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::pair<std::string, ModelStateHooks>> hooks;
};

Registry& registry() {
  static Registry* r = new Registry(); // never destroyed: used at exit
  return *r;
}

} // namespace

void register_model_state_hooks(
    const std::string& name,
    ModelStateHooks hooks) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& entry : r.hooks) {
    if (entry.first == name) {
      entry.second = std::move(hooks);
      return;
    }
  }
  r.hooks.emplace_back(name, std::move(hooks));
}

namespace detail {

std::map<std::string, std::string> tied_keys(torch::nn::Module& model) {
  std::map<std::string, std::string> out;
  for (const auto& h : model_state_hooks()) {
    if (h.tied_keys) {
      out.merge(h.tied_keys(model));
    }
  }
  return out;
}

std::map<std::string, std::string> config_files(torch::nn::Module& model) {
  std::map<std::string, std::string> out;
  for (const auto& h : model_state_hooks()) {
    if (h.config_files) {
      out.merge(h.config_files(model));
    }
  }
  return out;
}

std::vector<ModelStateHooks> model_state_hooks() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<ModelStateHooks> out;
  out.reserve(r.hooks.size());
  for (const auto& entry : r.hooks) {
    out.push_back(entry.second);
  }
  return out;
}

} // namespace detail

} // namespace checkpoint_io
} // namespace colossalai
