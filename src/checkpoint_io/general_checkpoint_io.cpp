// GeneralCheckpointIO's shared helpers, sharded saves in parts, and the
// default StateAccess and state hooks.

#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/optimizer_state.h>

#include "general_checkpoint_io_internal.h"
#include "sharded_commit.h"

#include <colossalai/distributed/error.h>
#include <nlohmann/json.hpp>

namespace colossalai {
namespace checkpoint_io {

namespace detail {

at::Tensor compact(const at::Tensor& t) {
  auto d = t.detach();
  const auto bytes = static_cast<size_t>(d.numel()) * d.element_size();
  return d.is_contiguous() && d.storage().nbytes() == bytes ? d : d.clone();
}

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

} // namespace detail

// NOTE [Streamed sharded saves]
// A sharded save writes each shard file as soon as it is full, so the writer
// holds at most one shard (size_per_shard, or one larger tensor) plus what
// the plugin is handing over (one bucket / unit for sharded plugins), never
// the whole model or optimizer. Shard names carry the total count
// ("-00002-of-00005"), unknown until the end: shards are written under
// provisional names and named when the save commits
// (NOTE [Sharded checkpoint commit]).

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
    detail::guarded(error, [&] {
      coordinator = std::make_unique<detail::ShardedCommit>(
          dir, index_name, stem, max_bytes);
    });
  }
  auto failed = first_error(exchange(error));
  TORCH_CHECK(failed.empty(), "cannot save '", dir, "': ", failed);

  const int k = my_part();
  std::unique_ptr<detail::ShardedCommit> part;
  if (k >= 0) {
    detail::guarded(error, [&] {
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
    detail::guarded(error, [&] {
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
      detail::guarded(outcome, [&] { finish(*coordinator); });
    }
  }
  failed = first_error(exchange(outcome));
  TORCH_CHECK(failed.empty(), "cannot save '", dir, "': ", failed);
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
