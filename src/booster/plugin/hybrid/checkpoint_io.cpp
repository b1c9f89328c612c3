#include "checkpoint_io.h"

#include <colossalai/checkpoint_io/mapped_reads.h>
#include <colossalai/checkpoint_io/optimizer_state.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/lazy/lazy_init.h>
#include <colossalai/shardformer/layer/parallel_module.h>

#include <torch/csrc/autograd/grad_mode.h>

#include <cstring>

namespace colossalai {
namespace booster {
namespace plugin {

namespace {

namespace sl = shardformer::layer;

using checkpoint_io::StateDict;

bool tp_active(const HybridState& s) {
  return s.tp != nullptr && s.tp->size() > 1;
}

// How parameter `name` is split over the tensor axis, read from the
// placement table (NOTE [Placement table]); not split when the table does
// not split it (buffers, replicated and partial parameters).
sl::ShardSpec tp_spec(const HybridState& s, const std::string& name) {
  const auto* where = tp_active(s) ? s.table->find(name) : nullptr;
  if (where == nullptr || !where->on("tp").is_shard()) {
    return sl::ShardSpec::replicated();
  }
  const auto& p = where->on("tp");
  auto spec = sl::ShardSpec::split(p.dim, where->global_shape[p.dim], s.tp)
                  .with_sections(p.sections);
  return p.padded > 0 ? spec.with_padding(p.padded) : spec;
}

// Whole tensor of a tensor-split local `t` on tensor rank 0 (undefined
// elsewhere): one gather, so no other rank holds it whole.
at::Tensor gather_whole(
    const at::Tensor& t,
    const sl::ShardSpec& spec,
    const distributed::ProcessGroupPtr& tp) {
  const int n = tp->size();
  auto local = t.detach().contiguous();
  at::Tensor out;
  if (tp->rank() == 0) {
    out = at::empty({n * local.numel()}, local.options());
  }
  distributed::gather(out, local.view({-1}), 0, *tp).wait();
  if (tp->rank() != 0) {
    return at::Tensor();
  }
  std::vector<int64_t> shape{n};
  shape.insert(shape.end(), local.sizes().begin(), local.sizes().end());
  auto parts = out.view(shape).unbind(0);
  return sl::unshard_tensor(
      std::vector<at::Tensor>(parts.begin(), parts.end()), spec);
}

// One parameter's optimizer state between ranks: a header {id, number of
// keys} (id -1 ends a stream), the keys, then the tensors.
void send_state(
    const distributed::ProcessGroup& group,
    int dst,
    int64_t id,
    const StateDict& state) {
  auto head = at::empty({2}, at::kLong);
  head[0] = id;
  head[1] = static_cast<int64_t>(state.size());
  distributed::send_tensor(head, dst, group);
  if (state.size() > 0) {
    std::string keys;
    for (const auto& item : state) {
      keys += item.key();
      keys += '\0';
    }
    auto k = at::empty({static_cast<int64_t>(keys.size())}, at::kByte);
    std::memcpy(k.data_ptr(), keys.data(), keys.size());
    distributed::send_tensor(k, dst, group);
    for (const auto& item : state) {
      distributed::send_tensor(item.value(), dst, group);
    }
  }
}

bool recv_state(
    const distributed::ProcessGroup& group,
    int src,
    int64_t& id,
    StateDict& state) {
  auto head = distributed::recv_tensor(src, group).cpu();
  id = head[0].item<int64_t>();
  const int64_t n = head[1].item<int64_t>();
  if (id < 0) {
    return false;
  }
  state = StateDict();
  if (n == 0) {
    return true;
  }
  auto k = distributed::recv_tensor(src, group).cpu();
  const auto* p = static_cast<const char*>(k.data_ptr());
  std::vector<std::string> keys;
  for (int64_t i = 0, start = 0; i < k.numel(); ++i) {
    if (p[i] == '\0') {
      keys.emplace_back(p + start, i - start);
      start = i + 1;
    }
  }
  TORCH_INTERNAL_ASSERT(
      static_cast<int64_t>(keys.size()) == n, "corrupt optimizer state keys");
  for (const auto& key : keys) {
    state.insert(key, distributed::recv_tensor(src, group));
  }
  return true;
}

// Checkpoints hold whole Hugging Face-layout tensors (any tp / pp / dp size
// and any plugin loads them): split tensors are gathered to tensor rank 0
// one at a time on save, and cut to this rank's shard on load. Under
// pipelines and expert parallelism each part (a stage's share of the
// model, or one expert-parallel rank's experts) writes what it owns (NOTE
// [Sharded saves in parts]), or sends it to the one writer for a single
// file.
class HybridStateAccess : public checkpoint_io::StateAccess {
 public:
  explicit HybridStateAccess(std::shared_ptr<HybridState> state)
      : state_(std::move(state)) {}

  void stream_model(
      interface::ModelWrapper& model,
      const checkpoint_io::TensorSink& sink) override {
    if (!state_->partitioned) {
      stream_part_model(model, sink);
      return;
    }
    // Each tensor goes to the writer (global rank 0) from the part that
    // owns it, in the model's order, one at a time, so the writer holds one
    // tensor (or one shard of a sharded save) at a time and no rank gathers
    // the whole model.
    auto& s = *state_;
    const int me = distributed::get_rank();
    for (const auto& item : checkpoint_io::model_state_dict(*model.unwrap())) {
      const auto& name = item.key();
      const int owner = s.owner_of(name);
      const int src = s.part_source.at(owner);
      at::Tensor whole;
      if (s.part == owner) {
        whole = whole_tensor(name, item.value());
      }
      const auto& world = *distributed::world_group();
      if (me == 0) {
        sink(name, src == 0 ? whole : distributed::recv_tensor(src, world));
      } else if (me == src) {
        distributed::send_tensor(whole, 0, world);
      }
    }
  }

  std::vector<int> part_writers() override {
    return state_->partitioned ? state_->part_source : std::vector<int>();
  }

  void stream_model_part(
      interface::ModelWrapper& model,
      const checkpoint_io::TensorSink& sink) override {
    stream_part_model(model, sink);
  }

  // Streaming: each split tensor's shard is cut from the checkpoint's whole
  // tensor as it is read, so no rank holds a whole model and the load moves
  // no bytes between ranks.
  checkpoint_io::TensorLoader model_tensor_loader(
      interface::ModelWrapper& model) override {
    if (!tp_active(*state_) && !state_->partitioned) {
      return nullptr;
    }
    auto module = model.unwrap();
    auto named = module->named_parameters(true);
    auto targets = std::make_shared<
        std::map<std::string, std::pair<at::Tensor, sl::ShardSpec>>>();
    // The table holds what this rank holds (its part's, when partitioned).
    for (const auto* where : state_->table->entries()) {
      auto spec = tp_spec(*state_, where->name);
      if (!spec.is_split()) {
        continue;
      }
      auto* p = named.find(where->name);
      TORCH_INTERNAL_ASSERT(p != nullptr, "no parameter ", where->name);
      targets->emplace(where->name, std::make_pair(*p, spec));
    }
    auto state = state_;
    auto names = std::make_shared<std::set<std::string>>();
    for (const auto& item : named) {
      names->insert(item.key());
    }
    return [targets, state, names](
               const std::string& key,
               const at::Tensor& src,
               const std::string& file) {
      // A parameter this part released: the parts holding it read it.
      // (Every part keeps every buffer.)
      if (state->partitioned && names->count(key) && !state->held.count(key)) {
        return true;
      }
      auto it = targets->find(key);
      if (it == targets->end()) {
        return false;
      }
      auto& param = it->second.first;
      const auto& spec = it->second.second;
      auto whole = param.sizes().vec();
      whole[spec.dim] = spec.full_size;
      TORCH_CHECK(
          src.sizes().vec() == whole,
          "load_model: '",
          file,
          "': key '",
          key,
          "' has shape ",
          src.sizes(),
          " but the model's whole tensor has shape ",
          at::IntArrayRef(whole));
      at::NoGradGuard no_grad;
      // A shard that is one contiguous slice of a mapped file (unsplit, or
      // split along dimension 0 with no sections or padding) is read
      // straight into the parameter (NOTE [Loads read into the
      // parameters]); the others are cut and copied.
      if (checkpoint_io::detail::read_mapped_into(
              param, sl::shard_view(src, spec))) {
        return true;
      }
      const auto shard = sl::shard_tensor(src, spec);
      if (!lazy::assign_lazy(param, shard)) {
        param.copy_(shard);
      }
      return true;
    };
  }

  void load_model(
      interface::ModelWrapper& model,
      const std::function<void()>& load) override {
    load();
    if (auto z = state_->zero.lock()) {
      z->sync_master_from_working();
    }
  }

  void stream_optimizer(
      interface::OptimizerWrapper& optimizer,
      const checkpoint_io::StateSink& sink) override {
    auto& s = *state_;
    if (!s.partitioned) {
      stream_part_optimizer(optimizer, sink);
      return;
    }
    // One file: part by part to the writer (global rank 0), which streams
    // its own part first; the others send theirs (ColossalAI gathers them
    // with all_gather_object, holding every stage's states at once).
    const int me = distributed::get_rank();
    const int src = s.part_source.at(s.part);
    stream_part_optimizer(
        optimizer, [&](int64_t id, const checkpoint_io::StateDict& state) {
          if (me == 0) {
            sink(id, state);
          } else if (me == src) {
            send_state(*distributed::world_group(), 0, id, state);
          }
        });
    if (me == src && me != 0) {
      send_state(
          *distributed::world_group(), 0, -1, checkpoint_io::StateDict());
    }
    if (me == 0) {
      for (size_t part = 1; part < s.part_source.size(); ++part) {
        int64_t id = 0;
        checkpoint_io::StateDict state;
        while (recv_state(
            *distributed::world_group(), s.part_source[part], id, state)) {
          sink(id, state);
        }
      }
    }
  }

  void stream_optimizer_part(
      interface::OptimizerWrapper& optimizer,
      const checkpoint_io::StateSink& sink) override {
    stream_part_optimizer(optimizer, sink);
  }

  c10::impl::GenericList optimizer_param_groups(
      interface::OptimizerWrapper& optimizer) override {
    auto groups =
        checkpoint_io::detail::optimizer_param_groups(optimizer.unwrap());
    if (!state_->partitioned) {
      return groups;
    }
    // The whole model's ids (this part's optimizer holds some of them).
    TORCH_INTERNAL_ASSERT(groups.size() == state_->global_groups.size());
    for (size_t i = 0; i < groups.size(); ++i) {
      auto d = groups.get(i).toGenericDict();
      c10::impl::GenericList ids(c10::AnyType::get()); // see optimizer_state
      for (auto id : state_->global_groups[i]) {
        ids.push_back(id);
      }
      d.insert_or_assign("params", ids);
    }
    return groups;
  }

  void load_optimizer_groups(
      interface::OptimizerWrapper& optimizer,
      const c10::IValue& value,
      const std::string& file) override {
    auto& optim = optimizer.unwrap();
    if (!state_->partitioned) {
      checkpoint_io::detail::load_param_groups(optim, value, file);
      return;
    }
    // Checked against the whole model's groups, then read as this part's.
    const auto& global = state_->global_groups;
    TORCH_CHECK(
        value.isList() && value.toList().size() == global.size(),
        "load_optimizer: '",
        file,
        "' has ",
        value.isList() ? std::to_string(value.toList().size()) : "no",
        " param groups, the optimizer has ",
        global.size());
    auto groups = value.toList().copy();
    for (size_t i = 0; i < groups.size(); ++i) {
      TORCH_CHECK(
          groups.get(i).isGenericDict(),
          "load_optimizer: '",
          file,
          "': param group ",
          i,
          " is not a dict");
      auto d = groups.get(i).toGenericDict().copy();
      const c10::IValue key(std::string("params"));
      const int64_t n = d.contains(key) && d.at(key).isList()
          ? static_cast<int64_t>(d.at(key).toList().size())
          : -1;
      TORCH_CHECK(
          n == static_cast<int64_t>(global[i].size()),
          "load_optimizer: '",
          file,
          "': param group ",
          i,
          " has ",
          n,
          " parameters, the model's has ",
          global[i].size());
      c10::List<int64_t> mine;
      for (int64_t k = 0;
           k < static_cast<int64_t>(optim.param_groups()[i].params().size());
           ++k) {
        mine.push_back(k);
      }
      d.insert_or_assign(key, mine);
      groups.set(i, d);
    }
    checkpoint_io::detail::load_param_groups(optim, groups, file);
  }

  void load_optimizer_param(
      interface::OptimizerWrapper& optimizer,
      int64_t id,
      const checkpoint_io::StateDict& state,
      const std::string& file) override {
    if (state_->partitioned) {
      const auto& g = state_->global_id;
      auto it = std::find(g.begin(), g.end(), id);
      if (it == g.end()) {
        TORCH_CHECK(
            id >= 0 && id < static_cast<int64_t>(state_->global_name.size()),
            "optimizer checkpoint '",
            file,
            "' has state for parameter ",
            id,
            ", but the model has ",
            state_->global_name.size());
        return; // another part's
      }
      id = it - g.begin();
    }
    checkpoint_io::StateDict mine = state;
    const auto spec =
        id >= 0 && id < static_cast<int64_t>(state_->name_by_id.size())
        ? tp_spec(*state_, state_->name_by_id[id])
        : sl::ShardSpec::replicated();
    if (spec.is_split()) {
      const auto& full =
          state_->table->find(state_->name_by_id[id])->global_shape;
      mine = checkpoint_io::StateDict();
      for (const auto& item : state) {
        const auto& t = item.value();
        mine.insert(
            item.key(),
            t.defined() && t.dim() > 0 && t.sizes().vec() == full
                ? sl::shard_tensor(t, spec)
                : t);
      }
    }
    if (auto z = zero_of(optimizer)) {
      z->wait_all_gathers(); // they would write the master slices back
      z->load_full_state(id, mine, file);
    } else {
      checkpoint_io::detail::load_param_state(
          optimizer.unwrap(), id, mine, file);
    }
  }

 private:
  // The whole tensor of parameter or buffer `name` (gathered over the
  // tensor group when split: defined on tensor rank 0 only).
  at::Tensor whole_tensor(const std::string& name, const at::Tensor& t) {
    const auto spec = tp_spec(*state_, name);
    return spec.is_split() ? gather_whole(t, spec, state_->tp) : t.detach();
  }

  // The tensors this part writes (when partitioned, those it owns; else
  // all), in the model's order.
  void stream_part_model(
      interface::ModelWrapper& model,
      const checkpoint_io::TensorSink& sink) {
    const auto& s = *state_;
    for (const auto& item : checkpoint_io::model_state_dict(*model.unwrap())) {
      if (s.partitioned && s.owner_of(item.key()) != s.part) {
        continue;
      }
      auto whole = whole_tensor(item.key(), item.value());
      if (whole.defined()) {
        sink(item.key(), whole);
      }
    }
  }

  // The optimizer states this part writes, by checkpoint id (when
  // partitioned: of the parameters it owns, by whole-model id).
  void stream_part_optimizer(
      interface::OptimizerWrapper& optimizer,
      const checkpoint_io::StateSink& sink) {
    const auto& s = *state_;
    auto emit = [&](int64_t id, const checkpoint_io::StateDict& state) {
      int64_t out_id = id;
      if (s.partitioned) {
        out_id = s.global_id.at(id);
        if (s.owner_of(s.global_name.at(out_id)) != s.part) {
          return; // a tied parameter: its first stage's part writes it
        }
      }
      const auto spec = tp_spec(s, s.name_by_id.at(id));
      if (!spec.is_split()) {
        sink(out_id, state);
        return;
      }
      const auto& local = s.local_shape_by_id.at(id);
      checkpoint_io::StateDict whole;
      for (const auto& item : state) {
        const auto& t = item.value();
        if (t.defined() && t.dim() > 0 && t.sizes().vec() == local) {
          auto w = gather_whole(t, spec, s.tp);
          if (w.defined()) {
            whole.insert(item.key(), w);
          }
        } else {
          whole.insert(item.key(), t);
        }
      }
      if (s.tp->rank() == 0) {
        sink(out_id, whole);
      }
    };
    if (auto z = zero_of(optimizer)) {
      z->stream_full_states(emit);
      return;
    }
    for (const auto& kv :
         checkpoint_io::detail::optimizer_param_states(optimizer.unwrap())) {
      emit(kv.first, kv.second);
    }
  }

  static zero::LowLevelZeroOptimizer* zero_of(interface::OptimizerWrapper& o) {
    return dynamic_cast<zero::LowLevelZeroOptimizer*>(&o);
  }

  std::shared_ptr<HybridState> state_;
};

} // namespace

std::shared_ptr<checkpoint_io::StateAccess> hybrid_state_access(
    std::shared_ptr<HybridState> state) {
  return std::make_shared<HybridStateAccess>(std::move(state));
}

std::vector<std::vector<std::string>> optimizer_param_names(
    interface::OptimizerWrapper& optimizer,
    const std::unordered_map<const void*, std::string>& name_of) {
  std::vector<std::vector<std::string>> out;
  for (auto& g : optimizer.param_groups()) {
    out.emplace_back();
    for (auto& p : g.params()) {
      auto it = name_of.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(
          it != name_of.end(),
          "HybridParallelPlugin",
          ": the optimizer holds a parameter (shape ",
          p.sizes(),
          ") that is not in the boosted model");
      out.back().push_back(it->second);
    }
  }
  return out;
}

} // namespace plugin
} // namespace booster
} // namespace colossalai
