#include <colossalai/shardformer/policy.h>

namespace colossalai {
namespace shardformer {

SequenceParallelMode parse_sequence_parallel_mode(
    const std::string& name,
    const char* who) {
  using M = SequenceParallelMode;
  for (M m : {M::kSplitGather, M::kRing, M::kAllToAll, M::kRingAttn}) {
    if (name == to_string(m)) {
      return m;
    }
  }
  TORCH_CHECK(
      false,
      who,
      ": sequence_parallelism_mode must be 'split_gather', 'ring', "
      "'all_to_all' or 'ring_attn', got '",
      name,
      "'");
}

const char* to_string(SequenceParallelMode mode) {
  switch (mode) {
    case SequenceParallelMode::kSplitGather:
      return "split_gather";
    case SequenceParallelMode::kRing:
      return "ring";
    case SequenceParallelMode::kAllToAll:
      return "all_to_all";
    case SequenceParallelMode::kRingAttn:
      return "ring_attn";
    case SequenceParallelMode::kNone:
      break;
  }
  return "";
}

int ShardConfig::sp_size() const {
  const auto mode = sp_mode();
  if (mode == SequenceParallelMode::kNone) {
    return 1;
  }
  // all_to_all and ring_attn have their own axis; split_gather and ring
  // run on the tensor group.
  const auto& g = on_sp_group(mode) ? sequence_parallel_process_group_
                                    : tensor_parallel_process_group_;
  return g == nullptr ? 1 : g->size();
}

ShardInfo Policy::shard(torch::nn::Module& model, const ShardConfig& config) {
  TORCH_CHECK(
      !config.enable_sequence_parallelism(),
      name(),
      ": sequence parallelism needs a policy that knows the model's forward "
      "(pass one as custom_policy)");
  for (const auto& item : model.named_modules()) {
    if (auto* p = dynamic_cast<layer::ParallelModule*>(item.value().get())) {
      p->fp8_communication = config.fp8_communication();
      p->shard_(config.tensor_parallel_process_group());
    }
  }
  return ShardInfo();
}

std::vector<std::string> Policy::held_layers(
    const torch::nn::Module& model,
    const StageLayers& layers) const {
  TORCH_CHECK(
      layers.first && layers.last,
      name(),
      ": no pipeline split is defined for this model; pass a custom_policy "
      "that overrides num_pipeline_layers, held_layers and stage_forward");
  std::vector<std::string> names;
  for (const auto& item : model.named_children()) {
    names.push_back(item.key());
  }
  return names;
}

at::Tensor Policy::stage_forward(
    torch::nn::Module&,
    const StageLayers&,
    const std::vector<at::Tensor>&,
    const at::Tensor&) const {
  TORCH_CHECK(
      false,
      name(),
      ": no pipeline forward is defined for this model; pass a "
      "custom_policy that overrides stage_forward");
  return at::Tensor();
}

std::map<std::string, layer::ShardSpec> collect_shard_specs(
    const torch::nn::Module& model) {
  std::map<std::string, layer::ShardSpec> specs;
  for (const auto& item : model.named_modules()) {
    const auto* p =
        dynamic_cast<const layer::ParallelModule*>(item.value().get());
    if (p == nullptr) {
      continue;
    }
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& kv : p->shard_specs()) {
      if (kv.second.is_split()) {
        specs.emplace(prefix + kv.first, kv.second);
      }
    }
  }
  return specs;
}

std::shared_ptr<Policy> resolve_policy(
    torch::nn::Module& model,
    std::shared_ptr<Policy> policy) {
  if (policy == nullptr) {
    if (auto* m = dynamic_cast<ShardableModel*>(&model)) {
      policy = m->default_policy();
    }
  }
  return policy != nullptr ? policy : std::make_shared<Policy>();
}

ShardInfo shard_model(
    torch::nn::Module& model,
    const ShardConfig& config,
    std::shared_ptr<Policy> policy) {
  policy = resolve_policy(model, std::move(policy));
  const auto mode = config.enable_sequence_parallelism()
      ? parse_sequence_parallel_mode(
            config.sequence_parallelism_mode(), "shard_model")
      : SequenceParallelMode::kNone;
  TORCH_CHECK(
      !(mode == SequenceParallelMode::kAllToAll &&
        config.sequence_parallel_process_group() == nullptr),
      "shard_model: all_to_all sequence parallelism needs "
      "sequence_parallel_process_group");
  TORCH_CHECK(
      !config.enable_sequence_overlap() || on_tensor_group(mode),
      "shard_model: enable_sequence_overlap needs enable_sequence_parallelism "
      "with sequence_parallelism_mode 'split_gather' or 'ring'");
  auto info = policy->shard(model, config);
  for (auto& kv : collect_shard_specs(model)) {
    info.specs.emplace(kv.first, kv.second);
  }
  return info;
}

std::pair<int64_t, int64_t> stage_block_range(
    int64_t blocks,
    int stage,
    int num_stages) {
  TORCH_CHECK(
      num_stages >= 1 && stage >= 0 && stage < num_stages &&
          blocks >= num_stages,
      "stage_block_range: ",
      blocks,
      " blocks cannot be split over ",
      num_stages,
      " stages (stage ",
      stage,
      ")");
  // The remainder goes to the middle stages: the first and the last hold
  // the embeddings and the head as well.
  const int64_t base = blocks / num_stages;
  const int64_t extra = blocks % num_stages;
  auto count = [&](int s) {
    const int64_t from_middle = s - (num_stages - extra) / 2;
    return base + (from_middle >= 0 && from_middle < extra ? 1 : 0);
  };
  int64_t start = 0;
  for (int s = 0; s < stage; ++s) {
    start += count(s);
  }
  return {start, start + count(stage)};
}

} // namespace shardformer
} // namespace colossalai
