#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/lazy/lazy_init.h>

#include "io_utils.h"
#include "mapped_reads.h"
#include "optimizer_state.h"
#include "pickle_reader.h"
#include "sharded_commit.h"

#include <colossalai/distributed/error.h>
#include <nlohmann/json.hpp>

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

// The format is told by the content, not the name: an 8-byte length
// followed by '{' is safetensors, a zip archive (or a legacy pickle, refused
// with its own message) is a .bin.
StateDict read_tensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot open '", path, "'");
  unsigned char head[9] = {0};
  in.read(reinterpret_cast<char*>(head), sizeof(head));
  const auto got = in.gcount();
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

c10::IValue read_pickle(const std::string& path) {
  return detail::load_pickle(path);
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

// Runs `f` unless an error was recorded; records the error it throws.
void guarded(std::string& error, const std::function<void()>& f) {
  if (!error.empty()) {
    return;
  }
  try {
    f();
  } catch (const std::exception& e) {
    error = distributed::error_text(e);
    if (error.empty()) {
      error = "unknown error";
    }
  }
}

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
    shard_.insert(k, compact(t));
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

// Whole per-parameter optimizer states into a commit's shard files.
class OptimizerShards {
 public:
  explicit OptimizerShards(detail::ShardedCommit& commit) : commit_(commit) {}
  void add(int64_t id, const StateDict& s) {
    int64_t n = 0;
    StateDict own;
    for (const auto& item : s) {
      n += detail::nbytes(item.value());
      own.insert(item.key(), compact(item.value()));
    }
    if (commit_.full(n)) {
      flush();
    }
    shard_.emplace(id, std::move(own));
    commit_.add(std::to_string(id), n);
  }
  void finish() {
    if (commit_.pending()) {
      flush();
    }
  }

 private:
  void flush() {
    detail::write_bytes(
        commit_.seal(), torch::pickle_save(states_ivalue(shard_)));
    shard_.clear();
  }
  detail::ShardedCommit& commit_;
  std::map<int64_t, StateDict> shard_;
};

// NOTE [Streamed sharded saves]
// A sharded save writes each shard file as soon as it is full, so the writer
// holds at most one shard (size_per_shard, or one larger tensor) plus what
// the plugin is handing over (one bucket / unit for sharded plugins), never
// the whole model or optimizer. Shard names carry the total count
// ("-00002-of-00005"), unknown until the end: shards are written under
// provisional names and named when the save commits
// (NOTE [Sharded checkpoint commit]).

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
    bool strict_unexpected,
    const TensorLoader& loader) {
  auto targets = model_state_dict(module);
  std::vector<std::string> unexpected;
  at::NoGradGuard no_grad;
  for (const auto& item : state) {
    if (loader && loader(item.key(), item.value(), file)) {
      if (seen) {
        seen->insert(item.key());
      }
      continue;
    }
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
    // lazy: no random init first; else a view into a mapped file is read
    // straight into the target
    if (!lazy::assign_lazy(*target, src) &&
        !detail::read_mapped_into(*target, src)) {
      detail::populate(src);
      target->copy_(src);
    }
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
      state.insert(k, async ? snapshot(t) : t.detach());
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
              model, [&](const std::string& k, const at::Tensor& t) {
                guarded(error, [&] {
                  if (shards) {
                    shards->add(k, t);
                  }
                });
              });
          guarded(error, [&] {
            if (shards) {
              shards->finish();
            }
          });
        },
        [&](detail::ShardedCommit& commit) {
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
    commit.commit(detail::Index(), weights);
  };
  if (!o.use_async()) {
    if (writer) {
      write([&](const TensorSink& sink) { stream_model_state(model, sink); });
    } else {
      stream_model_state(model, [](const std::string&, const at::Tensor&) {});
    }
    return;
  }
  // A background save needs an owned copy of everything anyway (and goes
  // through the one writer, in parts or not).
  StateDict state;
  stream_model_state(model, [&](const std::string& k, const at::Tensor& t) {
    if (writer) {
      state.insert(k, snapshot(t));
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
  load_model_state(
      *model.unwrap(), state, checkpoint, &seen, strict, tensor_loader_);
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
    load_model_state(
        *model.unwrap(),
        read_tensors(path),
        path,
        &seen,
        strict,
        tensor_loader_);
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
  auto groups = optimizer_param_groups(optimizer);
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
  auto write_groups = [group_name](
                          detail::ShardedCommit& commit,
                          const c10::impl::GenericList& groups) {
    detail::write_bytes(
        commit.extra(group_name, "param_groups"), torch::pickle_save(groups));
    commit.commit(detail::Index(), "");
  };
  if (num_parts() > 1 && !o.use_async()) {
    save_in_parts(
        checkpoint,
        index_name + ".index.json",
        index_name,
        max_bytes,
        [&](detail::ShardedCommit* part, std::string& error) {
          std::unique_ptr<OptimizerShards> shards;
          if (part != nullptr) {
            shards = std::make_unique<OptimizerShards>(*part);
          }
          stream_optimizer_part(optimizer, [&](int64_t id, const StateDict& s) {
            guarded(error, [&] {
              if (shards) {
                shards->add(id, s);
              }
            });
          });
          guarded(error, [&] {
            if (shards) {
              shards->finish();
            }
          });
        },
        [&](detail::ShardedCommit& commit) {
          write_groups(commit, optimizer_param_groups(optimizer));
        });
    return;
  }
  if (!writer) {
    // Take part in the plugin's collectives; the writer writes.
    stream_optimizer_states(optimizer, [](int64_t, const StateDict&) {});
    return;
  }
  auto groups = optimizer_param_groups(optimizer);
  // Shards hold whole parameter states (NOTE [Streamed sharded saves]).
  auto write = [=](const std::function<void(const StateSink&)>& feed) {
    detail::ShardedCommit commit(
        checkpoint, index_name + ".index.json", index_name, max_bytes);
    OptimizerShards shards(commit);
    feed([&](int64_t id, const StateDict& s) { shards.add(id, s); });
    shards.finish();
    write_groups(commit, groups);
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

// NOTE [Sharded saves in parts]
// Under pipeline parallelism each stage writes the shards of the tensors it
// owns, in parallel, and one index names them all (ColossalAI's hybrid
// checkpoint layout, with Hugging Face's file names):
//  1. The writer (rank 0) starts the commit and recovers a killed save
//     (NOTE [Sharded checkpoint commit]) before any part is written; an
//     exchange tells every rank that this is done (or failed).
//  2. Every rank streams its part (collective within the part); the part's
//     writer writes shard temporaries as tensors arrive. A write error is
//     recorded, not thrown, so the part's collectives still complete.
//  3. An exchange carries each part's temporaries and keys (or its error)
//     to every rank. The writer adopts them in part order, so shard numbers
//     run across parts, and commits: it alone renames, writes the index and
//     retires the previous checkpoint. Any error aborts the save on every
//     rank, and the writer removes every temporary.
//  4. A last exchange carries the commit's outcome, so no rank returns
//     before the index is published, or returns quietly when it was not.
void GeneralCheckpointIO::save_in_parts(
    const std::string& dir,
    const std::string& index_name,
    const std::string& stem,
    int64_t max_bytes,
    const std::function<void(detail::ShardedCommit*, std::string&)>& write_part,
    const std::function<void(detail::ShardedCommit&)>& finish) {
  const bool writer = is_writer();
  auto first_error = [](const std::vector<std::string>& all) {
    for (size_t r = 0; r < all.size(); ++r) {
      if (!all[r].empty()) {
        return "rank " + std::to_string(r) + ": " + all[r];
      }
    }
    return std::string();
  };
  std::unique_ptr<detail::ShardedCommit> coordinator;
  std::string error;
  if (writer) {
    guarded(error, [&] {
      coordinator = std::make_unique<detail::ShardedCommit>(
          dir, index_name, stem, max_bytes);
    });
  }
  auto failed = first_error(exchange(error));
  TORCH_CHECK(failed.empty(), "cannot save '", dir, "': ", failed);

  const int k = my_part();
  std::unique_ptr<detail::ShardedCommit> part;
  if (k >= 0) {
    guarded(error, [&] {
      part = std::make_unique<detail::ShardedCommit>(
          dir, index_name, stem, max_bytes, "s" + std::to_string(k) + "-");
    });
  }
  write_part(part.get(), error);
  nlohmann::json mine;
  mine["part"] = k;
  mine["error"] = error;
  mine["shards"] = nlohmann::json::array();
  if (part && error.empty()) {
    guarded(error, [&] {
      for (const auto& p : part->hand_over()) {
        mine["shards"].push_back(
            {{"temp", p.temp}, {"keys", p.keys}, {"bytes", p.bytes}});
      }
    });
    mine["error"] = error;
  }
  auto all = exchange(mine.dump());
  std::string outcome;
  if (writer) {
    std::vector<std::string> errors;
    std::vector<std::vector<detail::ShardedCommit::Part>> by_part(num_parts());
    for (const auto& text : all) {
      auto j = nlohmann::json::parse(text);
      errors.push_back(j.at("error").get<std::string>());
      const int n = j.at("part").get<int>();
      for (const auto& e : j.at("shards")) {
        detail::ShardedCommit::Part p;
        p.temp = e.at("temp").get<std::string>();
        p.keys = e.at("keys").get<std::vector<std::string>>();
        p.bytes = e.at("bytes").get<int64_t>();
        TORCH_INTERNAL_ASSERT(n >= 0 && n < num_parts(), "part ", n);
        by_part[n].push_back(std::move(p));
      }
    }
    // Adopted even on error: the coordinator then removes them.
    for (const auto& parts : by_part) {
      coordinator->adopt(parts);
    }
    outcome = first_error(errors);
    if (outcome.empty()) {
      guarded(outcome, [&] { finish(*coordinator); });
    }
  }
  failed = first_error(exchange(outcome));
  TORCH_CHECK(failed.empty(), "cannot save '", dir, "': ", failed);
}

void GeneralCheckpointIO::load_unsharded_optimizer(
    interface::OptimizerWrapper& optimizer,
    const std::string& checkpoint) {
  detail::load_state_dict(
      read_pickle(checkpoint),
      checkpoint,
      [&](const c10::IValue& groups) {
        load_optimizer_groups(optimizer, groups, checkpoint);
      },
      [&](int64_t id, const StateDict& state) {
        load_optimizer_state(optimizer, id, state, checkpoint);
      });
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
  auto groups_file = detail::join(dir, groups_it->second);
  load_optimizer_groups(optimizer, read_pickle(groups_file), groups_file);
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
    for (const auto& kv : detail::param_states(read_pickle(path), path)) {
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

c10::impl::GenericList StateAccess::optimizer_param_groups(
    interface::OptimizerWrapper& optimizer) {
  return detail::optimizer_param_groups(optimizer.unwrap());
}

void StateAccess::load_optimizer_groups(
    interface::OptimizerWrapper& optimizer,
    const c10::IValue& groups,
    const std::string& file) {
  detail::load_param_groups(optimizer.unwrap(), groups, file);
}

std::vector<int> StateAccess::part_writers() {
  return {};
}

void StateAccess::stream_model_part(
    interface::ModelWrapper& model,
    const TensorSink& sink) {
  stream_model(model, sink);
}

void StateAccess::stream_optimizer_part(
    interface::OptimizerWrapper& optimizer,
    const StateSink& sink) {
  stream_optimizer(optimizer, sink);
}

TensorLoader StateAccess::model_tensor_loader(interface::ModelWrapper&) {
  return nullptr;
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

c10::impl::GenericList GeneralCheckpointIO::optimizer_param_groups(
    interface::OptimizerWrapper& optimizer) {
  return StateAccess().optimizer_param_groups(optimizer);
}

void GeneralCheckpointIO::load_optimizer_groups(
    interface::OptimizerWrapper& optimizer,
    const c10::IValue& groups,
    const std::string& file) {
  StateAccess().load_optimizer_groups(optimizer, groups, file);
}

int GeneralCheckpointIO::num_parts() {
  return 1;
}

int GeneralCheckpointIO::my_part() {
  return is_writer() ? 0 : -1;
}

void GeneralCheckpointIO::stream_model_part(
    interface::ModelWrapper& model,
    const TensorSink& sink) {
  stream_model_state(model, sink);
}

void GeneralCheckpointIO::stream_optimizer_part(
    interface::OptimizerWrapper& optimizer,
    const StateSink& sink) {
  stream_optimizer_states(optimizer, sink);
}

std::vector<std::string> GeneralCheckpointIO::exchange(
    const std::string& bytes) {
  return {bytes};
}

} // namespace checkpoint_io
} // namespace colossalai
