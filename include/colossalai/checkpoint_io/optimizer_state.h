#pragma once

/// torch::optim state <-> the PyTorch state_dict layout:
/// state: {param_id: {"step": t, "exp_avg": t, ...}}, param_groups: [{"lr":
/// ..., "params": [ids]}], ids numbering parameters across groups in order.
/// For the optimizers and plugins that save and load through checkpoint IO
/// (ZeRO, FSDP, hybrid); not part of the Booster API.

#include <colossalai/checkpoint_io/state_dict.h>

#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

/// Per-parameter state by id, tensors as stored (not copied). HybridAdam's
/// states kept in files are read back first, unless `fetch_offloaded` is
/// false: they are then undefined tensors (for memory accounting).
std::map<int64_t, StateDict> optimizer_param_states(
    torch::optim::Optimizer& optimizer,
    bool fetch_offloaded = true);

/// The groups' hyperparameters and parameter ids.
c10::impl::GenericList optimizer_param_groups(torch::optim::Optimizer& o);

/// Checks that a full state tensor `key` of parameter `id` has the
/// parameter's element count (sharding plugins slice it afterwards).
void check_state_numel(
    const std::string& file,
    const std::string& key,
    int64_t id,
    int64_t state_numel,
    int64_t param_numel);

/// Restores one parameter's state (copied to the parameter's device).
void load_param_state(
    torch::optim::Optimizer& optimizer,
    int64_t id,
    const StateDict& state,
    const std::string& file);

/// Restores hyperparameters; checks the groups match in number and size.
void load_param_groups(
    torch::optim::Optimizer& optimizer,
    const c10::IValue& groups,
    const std::string& file);

/// The per-parameter states of a checkpoint's `state` entry:
/// {int: {str: tensor or number}}.
std::map<int64_t, StateDict> param_states(
    const c10::IValue& state,
    const std::string& file);

/// Restores a whole optimizer state dict {"state", "param_groups"}: the
/// groups through `load_groups`, each parameter's state through
/// `load_param`.
void load_state_dict(
    const c10::IValue& state_dict,
    const std::string& file,
    const std::function<void(const c10::IValue&)>& load_groups,
    const std::function<void(int64_t, const StateDict&)>& load_param);

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
