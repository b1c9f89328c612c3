#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>

#include "io_utils.h"
#include "optimizer_state.h"

#include <torch/csrc/autograd/grad_mode.h>
#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace colossalai {
namespace checkpoint_io {

namespace {

constexpr const char* kSafetensorsName = "model.safetensors";
constexpr const char* kBinName = "pytorch_model.bin";
constexpr const char* kOptimName = "pytorch_optim.bin";
constexpr const char* kOptimGroupName = "pytorch_optim_group.bin";

// Owned CPU copies, so training may go on while a background thread writes.
StateDict snapshot(const StateDict& state) {
  StateDict out;
  for (const auto& item : state) {
    out.insert(item.key(), item.value().detach().to(at::kCPU, false, true));
  }
  return out;
}

StateDict detached(const StateDict& state) {
  StateDict out;
  for (const auto& item : state) {
    out.insert(item.key(), item.value().detach());
  }
  return out;
}

// A tensor that owns exactly its bytes: a view of a larger buffer would keep
// the whole buffer alive (and a pickle would write all of it).
at::Tensor compact(const at::Tensor& t) {
  auto d = t.detach();
  const auto bytes = static_cast<size_t>(d.numel()) * d.element_size();
  return d.is_contiguous() && d.storage().nbytes() == bytes ? d : d.clone();
}

void write_tensors(
    const std::string& path,
    const StateDict& state,
    bool safetensors) {
  if (safetensors) {
    safetensors::save_file(path, state, {{"format", "pt"}});
  } else {
    save_bin(path, state);
  }
}

bool looks_like_zip(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[2] = {0, 0};
  in.read(magic, 2);
  return in.gcount() == 2 && magic[0] == 'P' && magic[1] == 'K';
}

StateDict read_tensors(const std::string& path) {
  return looks_like_zip(path) ? load_bin(path) : safetensors::load_file(path);
}

bool same_kind(at::ScalarType a, at::ScalarType b) {
  return (at::isFloatingType(a) && at::isFloatingType(b)) || a == b;
}

std::string list(const std::vector<std::string>& names) {
  std::ostringstream os;
  for (size_t i = 0; i < names.size() && i < 8; ++i) {
    os << (i ? ", " : "") << names[i];
  }
  if (names.size() > 8) {
    os << ", ... (" << names.size() << " in all)";
  }
  return os.str();
}

// Pickled {id: {name: tensor}}.
c10::impl::GenericDict states_ivalue(
    const std::map<int64_t, StateDict>& states) {
  c10::impl::GenericDict d(c10::IntType::get(), c10::AnyType::get());
  for (const auto& kv : states) {
    c10::Dict<std::string, at::Tensor> inner;
    for (const auto& item : kv.second) {
      inner.insert(item.key(), item.value());
    }
    d.insert(kv.first, inner);
  }
  return d;
}

std::map<int64_t, StateDict> states_from_ivalue(
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
      if (inner.value().isTensor()) {
        s.insert(inner.key().toStringRef(), inner.value().toTensor());
      } else if (inner.value().isDouble() || inner.value().isInt()) {
        // Python's older layout stores step as a number.
        s.insert(
            inner.key().toStringRef(),
            at::scalar_tensor(inner.value().toScalar(), at::kDouble));
      }
    }
    out.emplace(kv.key().toInt(), std::move(s));
  }
  return out;
}

c10::IValue read_pickle(const std::string& path) {
  auto bytes = detail::read_bytes(path);
  try {
    return torch::pickle_load(bytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(
        false,
        "cannot read '",
        path,
        "' (truncated or not a ",
        "PyTorch checkpoint): ",
        e.what_without_backtrace());
  }
}

// Strict loading: every key of the module must have been loaded.
void check_missing(
    torch::nn::Module& module,
    const std::set<std::string>& seen,
    const std::string& file) {
  std::vector<std::string> missing;
  for (const auto& item : model_state_dict(module)) {
    if (!seen.count(item.key())) {
      missing.push_back(item.key());
    }
  }
  TORCH_CHECK(
      missing.empty(),
      "load_model: '",
      file,
      "' lacks keys the model has (strict): ",
      list(missing));
}

// NOTE [Streamed sharded saves]
// A sharded save writes each shard file as soon as it is full, so the writer
// holds at most one shard (size_per_shard, or one larger tensor) plus what
// the plugin is handing over (one bucket / unit for sharded plugins), never
// the whole model or optimizer. Shard names carry the total count
// ("-00002-of-00005"), unknown until the end: shards are written under
// provisional names inside the save's temporary directory and renamed once
// all are written, before the directory is published.
class ShardParts {
 public:
  ShardParts(std::string dir, std::string base, int64_t max_bytes)
      : dir_(std::move(dir)), base_(std::move(base)), max_bytes_(max_bytes) {}

  /// Whether the current shard must be written before `bytes` more.
  bool full(int64_t bytes) const {
    return current_ > 0 && current_ + bytes > max_bytes_;
  }
  void add(const std::string& key, int64_t bytes) {
    if (keys_.empty() || sealed_) {
      keys_.emplace_back();
      bytes_.push_back(0);
      sealed_ = false;
    }
    keys_.back().push_back(key);
    bytes_.back() += bytes;
    current_ += bytes;
  }
  /// Where to write the current shard; starts the next one.
  std::string seal() {
    sealed_ = true;
    current_ = 0;
    return provisional(keys_.size() - 1);
  }
  bool pending() const {
    return !keys_.empty() && !sealed_;
  }
  /// Renames the shards to their final names and lists them in `index`;
  /// `single` names a lone shard (empty: always numbered).
  void publish(detail::Index& index, const std::string& single) {
    const int n = static_cast<int>(keys_.size());
    for (int i = 0; i < n; ++i) {
      const auto name = n == 1 && !single.empty()
          ? single
          : detail::shard_name(base_, i + 1, n);
      std::filesystem::rename(provisional(i), detail::join(dir_, name));
      for (const auto& k : keys_[i]) {
        index.weight_map.emplace_back(k, name);
      }
      index.total_size += bytes_[i];
    }
  }

 private:
  std::string provisional(size_t i) const {
    return detail::join(dir_, base_ + ".part" + std::to_string(i));
  }
  std::string dir_, base_;
  int64_t max_bytes_;
  int64_t current_ = 0;
  bool sealed_ = false;
  std::vector<std::vector<std::string>> keys_;
  std::vector<int64_t> bytes_;
};

} // namespace

StateDict model_state_dict(torch::nn::Module& module) {
  StateDict state;
  for (const auto& item : module.named_parameters(true)) {
    state.insert(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(true)) {
    if (item.value().defined()) {
      state.insert(item.key(), item.value());
    }
  }
  return state;
}

void load_model_state(
    torch::nn::Module& module,
    const StateDict& state,
    const std::string& file,
    std::set<std::string>* seen,
    bool strict_unexpected) {
  auto targets = model_state_dict(module);
  std::vector<std::string> unexpected;
  at::NoGradGuard no_grad;
  for (const auto& item : state) {
    auto* target = targets.find(item.key());
    if (target == nullptr) {
      unexpected.push_back(item.key());
      continue;
    }
    const auto& src = item.value();
    TORCH_CHECK(
        src.sizes() == target->sizes(),
        "load_model: '",
        file,
        "': key '",
        item.key(),
        "' has shape ",
        src.sizes(),
        " but the model's tensor has shape ",
        target->sizes());
    TORCH_CHECK(
        same_kind(src.scalar_type(), target->scalar_type()),
        "load_model: '",
        file,
        "': key '",
        item.key(),
        "' has dtype ",
        src.scalar_type(),
        " but the model's tensor has dtype ",
        target->scalar_type());
    target->copy_(src);
    if (seen) {
      seen->insert(item.key());
    }
  }
  TORCH_CHECK(
      !strict_unexpected || unexpected.empty(),
      "load_model: '",
      file,
      "' has keys the model does not (strict): ",
      list(unexpected));
}

void GeneralCheckpointIO::save_unsharded_model(
    interface::ModelWrapper& model,
    const std::string& checkpoint,
    const SaveModelOptions& o) {
  // One file: the writer collects the whole state (owned copies for a
  // background save); other ranks only take part in the collectives.
  const bool async = o.use_async();
  const bool writer = is_writer();
  StateDict state;
  stream_model_state(model, [&](const std::string& k, const at::Tensor& t) {
    if (writer) {
      state.insert(
          k,
          async ? t.detach().to(at::kCPU, false, /*copy=*/true) : t.detach());
    }
  });
  if (!writer) {
    return;
  }
  const bool st = o.use_safetensors();
  run_maybe_async(async, [state, checkpoint, st]() {
    detail::atomic_write_file(checkpoint, [&](const std::string& tmp) {
      write_tensors(tmp, state, st);
    });
  });
}

void GeneralCheckpointIO::save_sharded_model(
    interface::ModelWrapper& model,
    const std::string& checkpoint,
    const SaveModelOptions& o) {
  const bool st = o.use_safetensors();
  const std::string weights =
      detail::add_prefix(st ? kSafetensorsName : kBinName, o.prefix());
  const int64_t max_bytes = o.size_per_shard() * 1024 * 1024;
  const bool writer = is_writer();
  // Writes the shards of whatever `feed` hands over, in the save's
  // temporary directory (NOTE [Streamed sharded saves]).
  auto write = [=](const std::function<void(const TensorSink&)>& feed) {
    detail::atomic_write_dir(checkpoint, [&](const std::string& dir) {
      ShardParts parts(dir, weights, max_bytes);
      StateDict shard;
      auto flush = [&]() {
        write_tensors(parts.seal(), shard, st);
        shard = StateDict();
      };
      feed([&](const std::string& k, const at::Tensor& t) {
        const int64_t bytes = detail::nbytes(t);
        if (parts.full(bytes)) {
          flush();
        }
        shard.insert(k, compact(t));
        parts.add(k, bytes);
      });
      if (parts.pending()) {
        flush();
      }
      detail::Index index;
      parts.publish(index, weights);
      detail::write_index(detail::join(dir, weights + ".index.json"), index);
    });
  };
  if (!o.use_async()) {
    if (writer) {
      write([&](const TensorSink& sink) { stream_model_state(model, sink); });
    } else {
      stream_model_state(model, [](const std::string&, const at::Tensor&) {});
    }
    return;
  }
  // A background save needs an owned copy of everything anyway.
  StateDict state;
  stream_model_state(model, [&](const std::string& k, const at::Tensor& t) {
    if (writer) {
      state.insert(k, t.detach().to(at::kCPU, false, /*copy=*/true));
    }
  });
  if (writer) {
    run_maybe_async(true, [state, write]() {
      write([&](const TensorSink& sink) {
        for (const auto& item : state) {
          sink(item.key(), item.value());
        }
      });
    });
  }
}

void GeneralCheckpointIO::load_unsharded_model(
    interface::ModelWrapper& model,
    const std::string& checkpoint,
    bool strict) {
  auto state = read_tensors(checkpoint);
  std::set<std::string> seen;
  load_model_state(*model.unwrap(), state, checkpoint, &seen, strict);
  if (strict) {
    check_missing(*model.unwrap(), seen, checkpoint);
  }
}

void GeneralCheckpointIO::load_sharded_model(
    interface::ModelWrapper& model,
    const std::string& index_file,
    bool strict) {
  auto index = detail::read_index(index_file);
  auto dir = std::filesystem::path(index_file).parent_path().string();
  std::vector<std::string> files;
  std::set<std::string> expected;
  for (const auto& kv : index.weight_map) {
    expected.insert(kv.first);
    if (std::find(files.begin(), files.end(), kv.second) == files.end()) {
      files.push_back(kv.second);
    }
  }
  std::set<std::string> seen;
  for (const auto& f : files) {
    auto path = detail::join(dir, f);
    TORCH_CHECK(
        detail::exists(path),
        "load_model: shard '",
        path,
        "' named by index '",
        index_file,
        "' is missing");
    load_model_state(*model.unwrap(), read_tensors(path), path, &seen, strict);
  }
  for (const auto& key : expected) {
    TORCH_CHECK(
        seen.count(key) || !strict,
        "load_model: index '",
        index_file,
        "' lists key '",
        key,
        "' that its shard does not hold");
  }
  if (strict) {
    check_missing(*model.unwrap(), seen, index_file);
  }
}

void GeneralCheckpointIO::save_unsharded_optimizer(
    interface::OptimizerWrapper& optimizer,
    const std::string& checkpoint,
    const SaveOptimizerOptions& o) {
  // One file: the writer collects every state (owned copies for a
  // background save); other ranks only take part in the collectives.
  const bool writer = is_writer();
  std::map<int64_t, StateDict> states;
  stream_optimizer_states(optimizer, [&](int64_t id, const StateDict& s) {
    if (writer) {
      states.emplace(id, o.use_async() ? snapshot(s) : detached(s));
    }
  });
  if (!writer) {
    return;
  }
  auto groups = detail::optimizer_param_groups(optimizer.unwrap());
  run_maybe_async(o.use_async(), [states, groups, checkpoint]() {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("state", states_ivalue(states));
    d.insert("param_groups", groups);
    auto bytes = torch::pickle_save(d);
    detail::atomic_write_file(checkpoint, [&](const std::string& tmp) {
      detail::write_bytes(tmp, bytes);
    });
  });
}

void GeneralCheckpointIO::save_sharded_optimizer(
    interface::OptimizerWrapper& optimizer,
    const std::string& checkpoint,
    const SaveOptimizerOptions& o) {
  const auto index_name = detail::add_prefix(kOptimName, o.prefix());
  const auto group_name = detail::add_prefix(kOptimGroupName, o.prefix());
  const int64_t max_bytes = o.size_per_shard() * 1024 * 1024;
  const bool writer = is_writer();
  if (!writer) {
    // Take part in the plugin's collectives; the writer writes.
    stream_optimizer_states(optimizer, [](int64_t, const StateDict&) {});
    return;
  }
  auto groups = detail::optimizer_param_groups(optimizer.unwrap());
  // Shards hold whole parameter states (NOTE [Streamed sharded saves]).
  auto write = [=](const std::function<void(const StateSink&)>& feed) {
    detail::atomic_write_dir(checkpoint, [&](const std::string& dir) {
      ShardParts parts(dir, index_name, max_bytes);
      std::map<int64_t, StateDict> shard;
      auto flush = [&]() {
        detail::write_bytes(
            parts.seal(), torch::pickle_save(states_ivalue(shard)));
        shard.clear();
      };
      feed([&](int64_t id, const StateDict& s) {
        int64_t n = 0;
        StateDict own;
        for (const auto& item : s) {
          n += detail::nbytes(item.value());
          own.insert(item.key(), compact(item.value()));
        }
        if (parts.full(n)) {
          flush();
        }
        shard.emplace(id, std::move(own));
        parts.add(std::to_string(id), n);
      });
      if (parts.pending()) {
        flush();
      }
      detail::Index index;
      index.metadata["param_groups"] = group_name;
      parts.publish(index, "");
      detail::write_bytes(
          detail::join(dir, group_name), torch::pickle_save(groups));
      detail::write_index(detail::join(dir, index_name + ".index.json"), index);
    });
  };
  if (!o.use_async()) {
    write([&](const StateSink& sink) {
      stream_optimizer_states(optimizer, sink);
    });
    return;
  }
  std::map<int64_t, StateDict> states;
  stream_optimizer_states(optimizer, [&](int64_t id, const StateDict& s) {
    states.emplace(id, snapshot(s));
  });
  run_maybe_async(true, [states, write]() {
    write([&](const StateSink& sink) {
      for (const auto& kv : states) {
        sink(kv.first, kv.second);
      }
    });
  });
}

void GeneralCheckpointIO::load_unsharded_optimizer(
    interface::OptimizerWrapper& optimizer,
    const std::string& checkpoint) {
  auto v = read_pickle(checkpoint);
  TORCH_CHECK(
      v.isGenericDict(),
      "load_optimizer: '",
      checkpoint,
      "' is not an optimizer state dict");
  auto d = v.toGenericDict();
  TORCH_CHECK(
      d.contains("state") && d.contains("param_groups"),
      "load_optimizer: '",
      checkpoint,
      "' lacks 'state' or 'param_groups'");
  auto& optim = optimizer.unwrap();
  detail::load_param_groups(optim, d.at("param_groups"), checkpoint);
  for (const auto& kv : states_from_ivalue(d.at("state"), checkpoint)) {
    load_optimizer_state(optimizer, kv.first, kv.second, checkpoint);
  }
}

void GeneralCheckpointIO::load_sharded_optimizer(
    interface::OptimizerWrapper& optimizer,
    const std::string& index_file) {
  auto index = detail::read_index(index_file);
  auto dir = std::filesystem::path(index_file).parent_path().string();
  auto groups_it = index.metadata.find("param_groups");
  TORCH_CHECK(
      groups_it != index.metadata.end(),
      "load_optimizer: index '",
      index_file,
      "' has no metadata.param_groups");
  auto& optim = optimizer.unwrap();
  auto groups_file = detail::join(dir, groups_it->second);
  detail::load_param_groups(optim, read_pickle(groups_file), groups_file);
  std::vector<std::string> files;
  for (const auto& kv : index.weight_map) {
    if (std::find(files.begin(), files.end(), kv.second) == files.end()) {
      files.push_back(kv.second);
    }
  }
  for (const auto& f : files) {
    auto path = detail::join(dir, f);
    TORCH_CHECK(
        detail::exists(path),
        "load_optimizer: shard '",
        path,
        "' named by index '",
        index_file,
        "' is missing");
    for (const auto& kv : states_from_ivalue(read_pickle(path), path)) {
      load_optimizer_state(optimizer, kv.first, kv.second, path);
    }
  }
}

void StateAccess::stream_model(
    interface::ModelWrapper& model,
    const TensorSink& sink) {
  for (const auto& item : model_state_dict(*model.unwrap())) {
    sink(item.key(), item.value());
  }
}

void StateAccess::stream_optimizer(
    interface::OptimizerWrapper& optimizer,
    const StateSink& sink) {
  for (const auto& kv : detail::optimizer_param_states(optimizer.unwrap())) {
    sink(kv.first, kv.second);
  }
}

void StateAccess::load_model(
    interface::ModelWrapper&,
    const std::function<void()>& load) {
  load();
}

void StateAccess::load_optimizer_param(
    interface::OptimizerWrapper& optimizer,
    int64_t id,
    const StateDict& state,
    const std::string& file) {
  detail::load_param_state(optimizer.unwrap(), id, state, file);
}

void GeneralCheckpointIO::stream_model_state(
    interface::ModelWrapper& model,
    const TensorSink& sink) {
  StateAccess().stream_model(model, sink);
}

void GeneralCheckpointIO::stream_optimizer_states(
    interface::OptimizerWrapper& optimizer,
    const StateSink& sink) {
  StateAccess().stream_optimizer(optimizer, sink);
}

void GeneralCheckpointIO::load_optimizer_state(
    interface::OptimizerWrapper& optimizer,
    int64_t id,
    const StateDict& state,
    const std::string& file) {
  StateAccess().load_optimizer_param(optimizer, id, state, file);
}

} // namespace checkpoint_io
} // namespace colossalai
