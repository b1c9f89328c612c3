// GeneralCheckpointIO: saving and loading optimizer states (one pickle, or
// per-parameter shards plus param groups).

#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/optimizer_state.h>
#include <colossalai/checkpoint_io/torch_bin.h>

#include "general_checkpoint_io_internal.h"
#include "pickle_reader.h"
#include "sharded_commit.h"

#include <torch/serialize.h>

#include <algorithm>
#include <filesystem>

namespace colossalai {
namespace checkpoint_io {

namespace {

constexpr const char* kOptimName = "pytorch_optim.bin";
constexpr const char* kOptimGroupName = "pytorch_optim_group.bin";

StateDict detached(const StateDict& state) {
  StateDict out;
  for (const auto& item : state) {
    out.insert(item.key(), item.value().detach());
  }
  return out;
}

// Pickled {id: {name: tensor}}; an int64 scalar `step` is HybridAdam's,
// which ColossalAI keeps as a Python int (optimizer_state.cpp).
c10::impl::GenericDict states_ivalue(
    const std::map<int64_t, StateDict>& states) {
  c10::impl::GenericDict d(c10::IntType::get(), c10::AnyType::get());
  for (const auto& kv : states) {
    c10::impl::GenericDict inner(c10::StringType::get(), c10::AnyType::get());
    for (const auto& item : kv.second) {
      const auto& t = item.value();
      if (item.key() == "step" && t.dim() == 0 &&
          t.scalar_type() == at::kLong) {
        inner.insert(item.key(), t.item<int64_t>());
      } else {
        inner.insert(item.key(), t);
      }
    }
    d.insert(kv.first, inner);
  }
  return d;
}

c10::IValue read_pickle(const std::string& path) {
  return detail::load_pickle(path);
}

// Whole per-parameter optimizer states into a commit's shard files.
class OptimizerShards {
 public:
  explicit OptimizerShards(detail::ShardedCommit& commit) : commit_(commit) {}
  void add(int64_t id, const StateDict& s) {
    int64_t n = 0;
    StateDict own;
    for (const auto& item : s) {
      n += detail::nbytes(item.value());
      own.insert(item.key(), detail::compact(item.value()));
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
        commit_.seal(), pickle_archive(states_ivalue(shard_)));
    shard_.clear();
  }
  detail::ShardedCommit& commit_;
  std::map<int64_t, StateDict> shard_;
};

} // namespace

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
    auto bytes = pickle_archive(d);
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
        commit.extra(group_name, "param_groups"), pickle_archive(groups));
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
            detail::guarded(error, [&] {
              if (shards) {
                shards->add(id, s);
              }
            });
          });
          detail::guarded(error, [&] {
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

} // namespace checkpoint_io
} // namespace colossalai
