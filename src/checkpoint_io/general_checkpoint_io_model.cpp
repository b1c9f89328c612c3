// GeneralCheckpointIO: saving and loading models (safetensors or .bin,
// unsharded or sharded), and copying a state dict into a module.

#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/mapped_reads.h>
#include <colossalai/checkpoint_io/model_state_hooks.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>

#include "general_checkpoint_io_internal.h"
#include "sharded_commit.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

namespace colossalai {
namespace checkpoint_io {

namespace {

constexpr const char* kSafetensorsName = "model.safetensors";
constexpr const char* kBinName = "pytorch_model.bin";

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

// The format is told by the content, not the name: an 8-byte length
// followed by '{' is safetensors, a zip archive (or a legacy pickle, refused
// with its own message) is a .bin.
StateDict read_tensors(const std::string& path) {
  const int fd = detail::open_regular(path); // never blocks on a FIFO
  unsigned char head[9] = {0};
  const ssize_t got = ::pread(fd, head, sizeof(head), 0);
  ::close(fd);
  TORCH_CHECK(
      got > 0,
      "'",
      path,
      "' is empty: a model checkpoint (.bin zip archive or safetensors) was "
      "expected");
  const bool safetensors_like = got == 9 && head[8] == '{';
  // (A safetensors header length may start with any byte, 0x80 included.)
  if ((got >= 2 && head[0] == 'P' && head[1] == 'K') ||
      (head[0] == 0x80 && !safetensors_like)) {
    return load_bin(path);
  }
  const auto ends_with = [&](const char* ext) {
    const std::string e(ext);
    return path.size() >= e.size() &&
        path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  TORCH_CHECK(
      safetensors_like || ends_with(".safetensors"),
      "'",
      path,
      "' is neither a PyTorch .bin checkpoint (a zip archive from torch.save)"
      " nor a safetensors file; ",
      ends_with(".bin") || ends_with(".pt") || ends_with(".pth")
          ? "its name says .bin, but it does not start like a zip archive"
          : "it starts with neither a zip signature nor a safetensors header");
  return safetensors::load_file(path);
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

// A key a strict load may find missing (a feature's hook says so: LoRA's
// adapters are not in a base model's checkpoint).
bool optional_key(
    const std::vector<ModelStateHooks>& hooks,
    const std::string& key) {
  for (const auto& h : hooks) {
    if (h.optional_key && h.optional_key(key)) {
      return true;
    }
  }
  return false;
}

void check_fits(
    const std::string& file,
    const std::string& key,
    const at::Tensor& src,
    const at::Tensor& target) {
  TORCH_CHECK(
      src.sizes() == target.sizes(),
      "load_model: '",
      file,
      "': key '",
      key,
      "' has shape ",
      src.sizes(),
      " but the model's tensor has shape ",
      target.sizes());
  TORCH_CHECK(
      same_kind(src.scalar_type(), target.scalar_type()),
      "load_model: '",
      file,
      "': key '",
      key,
      "' has dtype ",
      src.scalar_type(),
      " but the model's tensor has dtype ",
      target.scalar_type());
}

// Everything a model load refuses, found before it copies anything, so a
// refused load leaves the model as it was: shapes and dtypes, a tied name
// holding other values than its source (a model trained untied), and for
// strict loads keys the model does not have and keys it has that the
// checkpoint lacks. Files are added one by one (the shards of an index);
// `finish` checks what needs all of them. With a plugin's loader (tensor
// parallel slices, pipeline stages) shapes are the loader's to check as it
// reads: its tensors are whole, the model's are slices.
class LoadCheck {
 public:
  LoadCheck(torch::nn::Module& module, bool has_loader)
      : targets_(model_state_dict(module)),
        tied_(detail::tied_keys(module)),
        has_loader_(has_loader) {
    for (const auto& h : detail::model_state_hooks()) {
      if (h.loaders) {
        for (const auto& kv : h.loaders(module)) {
          own_.insert(kv.first);
        }
      }
    }
    for (const auto& kv : tied_) {
      tie_sources_.insert(kv.second);
    }
  }

  void add(const StateDict& state, const std::string& file) {
    for (const auto& item : state) {
      const auto& key = item.key();
      keys_.insert(key);
      if (own_.count(key)) {
        continue;
      }
      if (const auto* target = targets_.find(key)) {
        if (!has_loader_) {
          check_fits(file, key, item.value(), *target);
        }
        if (tie_sources_.count(key)) {
          ties_.emplace(key, item.value());
        }
      } else if (tied_.count(key)) {
        ties_.emplace(key, item.value());
        tie_files_.emplace(key, file);
      } else {
        if (unexpected_.empty()) {
          unexpected_file_ = file;
        }
        unexpected_.push_back(key);
      }
    }
  }

  /// `what` names the checkpoint (its file, or its index).
  void finish(
      const std::string& what,
      bool strict_unexpected,
      bool strict_missing) {
    for (const auto& kv : tied_) {
      const auto alias = ties_.find(kv.first);
      const auto source = ties_.find(kv.second);
      if (alias == ties_.end() || source == ties_.end()) {
        continue;
      }
      TORCH_CHECK(
          source->second.sizes() == alias->second.sizes() &&
              at::equal(source->second, alias->second),
          "load_model: '",
          tie_files_.at(kv.first),
          "': '",
          kv.first,
          "' is tied to '",
          kv.second,
          "' in this model, but the checkpoint holds other values under it "
          "(a model trained with untied weights)");
    }
    TORCH_CHECK(
        !strict_unexpected || unexpected_.empty(),
        "load_model: '",
        unexpected_file_,
        "' has keys the model does not (strict): ",
        list(unexpected_));
    if (!strict_missing) {
      return;
    }
    // Keys a feature makes optional aside (LoRA's adapters are not in a
    // base model's checkpoint).
    const auto hooks = detail::model_state_hooks();
    std::vector<std::string> missing;
    for (const auto& item : targets_) {
      if (!keys_.count(item.key()) && !optional_key(hooks, item.key())) {
        missing.push_back(item.key());
      }
    }
    TORCH_CHECK(
        missing.empty(),
        "load_model: '",
        what,
        "' lacks keys the model has (strict): ",
        list(missing));
  }

 private:
  StateDict targets_;
  std::map<std::string, std::string> tied_; // alias -> the model's key
  std::set<std::string> tie_sources_;
  std::set<std::string> own_;
  bool has_loader_;
  std::set<std::string> keys_;
  std::map<std::string, at::Tensor> ties_; // both names' values
  std::map<std::string, std::string> tie_files_;
  std::vector<std::string> unexpected_;
  std::string unexpected_file_;
};

// Model tensors into a commit's shard files as they arrive.
class ModelShards {
 public:
  ModelShards(detail::ShardedCommit& commit, bool safetensors)
      : commit_(commit), safetensors_(safetensors) {}
  void add(const std::string& k, const at::Tensor& t) {
    const int64_t bytes = detail::nbytes(t);
    if (commit_.full(bytes)) {
      flush();
    }
    shard_.insert(k, detail::compact(t));
    commit_.add(k, bytes);
  }
  void finish() {
    if (commit_.pending()) {
      flush();
    }
  }

 private:
  void flush() {
    write_tensors(commit_.seal(), shard_, safetensors_);
    shard_ = StateDict();
  }
  detail::ShardedCommit& commit_;
  bool safetensors_;
  StateDict shard_;
};

// A .bin save writes a tied tensor under each of its names, as Python's
// torch.save(model.state_dict()) does (one storage in the file), so strict
// loads there find every key; safetensors files hold it once, as
// transformers writes them. Each alias follows its source into the same
// shard.
TensorSink with_tied_aliases(
    torch::nn::Module& module,
    bool safetensors,
    TensorSink sink) {
  if (safetensors) {
    return sink;
  }
  std::multimap<std::string, std::string> aliases; // model key -> alias
  for (const auto& kv : detail::tied_keys(module)) {
    aliases.emplace(kv.second, kv.first);
  }
  if (aliases.empty()) {
    return sink;
  }
  return [aliases = std::move(aliases), sink = std::move(sink)](
             const std::string& k, const at::Tensor& t) {
    sink(k, t);
    const auto range = aliases.equal_range(k);
    for (auto it = range.first; it != range.second; ++it) {
      sink(it->second, t);
    }
  };
}

// The model's config files (NOTE [Model state hooks]) beside a sharded
// save's shards, before its index is committed: a directory whose index is
// live has them.
void write_config_files(
    const std::string& dir,
    const std::map<std::string, std::string>& files) {
  for (const auto& kv : files) {
    const std::vector<char> bytes(kv.second.begin(), kv.second.end());
    detail::atomic_write_file(
        detail::join(dir, kv.first),
        [&](const std::string& tmp) { detail::write_bytes(tmp, bytes); });
  }
}

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

namespace {

// Copies a checked `state` (LoadCheck) into the module's tensors.
void copy_model_state(
    torch::nn::Module& module,
    const StateDict& state,
    const std::string& file,
    std::set<std::string>* seen,
    const TensorLoader& loader) {
  auto targets = model_state_dict(module);
  // Tensors the features above take in their own way (QLoRA quantizes a
  // full-precision weight into its layer; lazy init assigns).
  const auto hooks = detail::model_state_hooks();
  std::map<std::string, ModelStateHooks::Loader> own;
  for (const auto& h : hooks) {
    if (h.loaders) {
      own.merge(h.loaders(module));
    }
  }
  auto assigned = [&](const at::Tensor& target, const at::Tensor& value) {
    for (const auto& h : hooks) {
      if (h.assign && h.assign(target, value)) {
        return true;
      }
    }
    return false;
  };
  at::NoGradGuard no_grad;
  for (const auto& item : state) {
    const auto& key = item.key();
    const auto& src = item.value();
    auto q = own.find(key);
    auto* target = targets.find(key);
    if (q != own.end()) {
      detail::populate(src);
      q->second(src);
    } else if (loader && loader(key, src, file)) {
      // the plugin's: a slice of the whole tensor, or another stage's
    } else if (target != nullptr) {
      // (checked already, unless a plugin's loader declined the key)
      check_fits(file, key, src, *target);
      // lazy: no random init first; else a view into a mapped file is read
      // straight into the target
      if (!assigned(*target, src) && !detail::read_mapped_into(*target, src)) {
        detail::populate(src);
        target->copy_(src);
      }
    } else {
      // A second name of a tied tensor (GPT-2's lm_head.weight), taken
      // through its source, or a key a non-strict load skips.
      continue;
    }
    if (seen) {
      seen->insert(key);
    }
  }
}

} // namespace

void load_model_state(
    torch::nn::Module& module,
    const StateDict& state,
    const std::string& file,
    std::set<std::string>* seen,
    bool strict_unexpected,
    const TensorLoader& loader) {
  LoadCheck check(module, loader != nullptr);
  check.add(state, file);
  check.finish(file, strict_unexpected, /*strict_missing=*/false);
  copy_model_state(module, state, file, seen, loader);
  if (seen) {
    // The tied names are accounted for, as the index lists them.
    for (const auto& kv : detail::tied_keys(module)) {
      if (state.find(kv.first) != nullptr) {
        seen->insert(kv.first);
      }
    }
  }
}

void GeneralCheckpointIO::save_unsharded_model(
    interface::ModelWrapper& model,
    const std::string& checkpoint,
    const SaveModelOptions& o) {
  // One file: the writer collects the whole state (owned copies for a
  // background save); other ranks only take part in the collectives.
  const bool async = o.use_async();
  const bool writer = is_writer();
  const bool st = o.use_safetensors();
  StateDict state;
  stream_model_state(
      model,
      with_tied_aliases(
          *model.unwrap(), st, [&](const std::string& k, const at::Tensor& t) {
            if (writer) {
              state.insert(k, async ? snapshot(t) : t.detach());
            }
          }));
  if (!writer) {
    return;
  }
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
  const auto configs = writer ? detail::config_files(*model.unwrap())
                              : std::map<std::string, std::string>();
  if (num_parts() > 1 && !o.use_async()) {
    save_in_parts(
        checkpoint,
        weights + ".index.json",
        weights,
        max_bytes,
        [&](detail::ShardedCommit* part, std::string& error) {
          std::unique_ptr<ModelShards> shards;
          if (part != nullptr) {
            shards = std::make_unique<ModelShards>(*part, st);
          }
          stream_model_part(
              model,
              with_tied_aliases(
                  *model.unwrap(),
                  st,
                  [&](const std::string& k, const at::Tensor& t) {
                    detail::guarded(error, [&] {
                      if (shards) {
                        shards->add(k, t);
                      }
                    });
                  }));
          detail::guarded(error, [&] {
            if (shards) {
              shards->finish();
            }
          });
        },
        [&](detail::ShardedCommit& commit) {
          write_config_files(checkpoint, configs);
          commit.commit(detail::Index(), weights);
        });
    return;
  }
  // Writes the shards of whatever `feed` hands over and commits them.
  auto write = [=](const std::function<void(const TensorSink&)>& feed) {
    detail::ShardedCommit commit(
        checkpoint, weights + ".index.json", weights, max_bytes);
    ModelShards shards(commit, st);
    feed([&](const std::string& k, const at::Tensor& t) { shards.add(k, t); });
    shards.finish();
    write_config_files(checkpoint, configs);
    commit.commit(detail::Index(), weights);
  };
  if (!o.use_async()) {
    if (writer) {
      write([&](const TensorSink& sink) {
        stream_model_state(model, with_tied_aliases(*model.unwrap(), st, sink));
      });
    } else {
      stream_model_state(model, [](const std::string&, const at::Tensor&) {});
    }
    return;
  }
  // A background save needs an owned copy of everything anyway (and goes
  // through the one writer, in parts or not).
  StateDict state;
  stream_model_state(
      model,
      with_tied_aliases(
          *model.unwrap(), st, [&](const std::string& k, const at::Tensor& t) {
            if (writer) {
              state.insert(k, snapshot(t));
            }
          }));
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
  LoadCheck check(*model.unwrap(), tensor_loader_ != nullptr);
  check.add(state, checkpoint);
  check.finish(checkpoint, strict, strict);
  copy_model_state(*model.unwrap(), state, checkpoint, nullptr, tensor_loader_);
}

void GeneralCheckpointIO::load_sharded_model(
    interface::ModelWrapper& model,
    const std::string& index_file,
    bool strict) {
  auto index = detail::read_index(index_file);
  auto dir = std::filesystem::path(index_file).parent_path().string();
  std::vector<std::string> files;
  std::map<std::string, std::set<std::string>> keys_of; // shard -> its keys
  for (const auto& kv : index.weight_map) {
    if (std::find(files.begin(), files.end(), kv.second) == files.end()) {
      files.push_back(kv.second);
    }
    keys_of[kv.second].insert(kv.first);
  }
  // Every shard is read (its header, not its data) and checked before
  // anything is copied; a tensor comes from the shard the index names for
  // it, whatever another shard also holds.
  auto read_shard = [&](const std::string& f) {
    auto path = detail::join(dir, f);
    TORCH_CHECK(
        detail::exists(path),
        "load_model: shard '",
        path,
        "' named by index '",
        index_file,
        "' is missing");
    StateDict state;
    for (const auto& kv : read_tensors(path)) {
      if (keys_of[f].count(kv.key())) {
        state.insert(kv.key(), kv.value());
      }
    }
    return std::make_pair(path, state);
  };
  LoadCheck check(*model.unwrap(), tensor_loader_ != nullptr);
  for (const auto& f : files) {
    const auto shard = read_shard(f);
    for (const auto& key : keys_of[f]) {
      TORCH_CHECK(
          shard.second.find(key) != nullptr || !strict,
          "load_model: index '",
          index_file,
          "' lists key '",
          key,
          "' that its shard does not hold");
    }
    check.add(shard.second, shard.first);
  }
  check.finish(index_file, strict, strict);
  for (const auto& f : files) {
    const auto shard = read_shard(f);
    copy_model_state(
        *model.unwrap(), shard.second, shard.first, nullptr, tensor_loader_);
  }
}

} // namespace checkpoint_io
} // namespace colossalai
