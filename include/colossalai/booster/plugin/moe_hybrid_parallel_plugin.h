#pragma once

#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>

#include <string>

namespace colossalai {
namespace booster {
namespace plugin {

/// MoeHybridParallelPlugin's options: HybridParallelPlugin's, with ep_size.
using MoeHybridParallelPluginOptions = HybridParallelPluginOptions;

/// Expert parallelism beside tensor, pipeline and data parallelism
/// (`colossalai.booster.plugin.MoeHybridParallelPlugin`), for the
/// mixture-of-experts families of colossalai::models (Mixtral, Qwen2-MoE,
/// Qwen3-MoE) or a model whose custom_policy fills
/// `ShardInfo::expert_owner`.
///
/// NOTE [Expert parallelism]
/// The data-parallel axis splits into (moe_dp, ep), ep inside: dp =
/// moe_dp x ep. Each sparse layer's E experts are split over the ep group,
/// rank r computing experts [r E / ep, (r + 1) E / ep) and releasing the
/// others' parameters. Every rank routes its own tokens (the router is
/// replicated), sorts the (token, expert) rows by expert, tells each ep rank
/// how many rows of each of its experts it will get, and sends them with one
/// all-to-all of uneven splits; the experts run on what arrived, and a
/// second all-to-all brings the results back to be weighted and summed
/// (dropless: no capacity, so the result is one process's). Under tensor
/// parallelism each expert is split over the tensor group as LlamaMLP is,
/// and every tensor rank exchanges with its own ep peers. Gradients: the
/// non-expert parameters are averaged over dp (DDP ignores the experts, or
/// ZeRO shards them over dp); an expert's over moe_dp, the ranks holding the
/// same expert (ZeRO shards them there: ColossalAI's pg_to_param_list), with
/// a 1 / ep inside the block so the result is the mean over the whole
/// data-parallel batch. The global norm counts each expert once (ZeRO
/// pieces are disjoint over dp; without ZeRO the non-experts count on ep
/// rank 0 and the ep group sums). Checkpoints hold every expert under its
/// transformers name: each part (pipeline stage x ep rank) writes the
/// tensors it owns, and a load at any ep / tp / pp / dp size (or under
/// another plugin) reads the experts each rank holds.
///
/// Not combined with sequence parallelism (refused by name). The balancing
/// loss is computed per rank from its own tokens, as transformers' training
/// under DDP does.
///
/// Example:
/// \code
///   auto plugin = std::make_shared<MoeHybridParallelPlugin>(
///       MoeHybridParallelPluginOptions().ep_size(2).tp_size(2).zero_stage(1)
///           .precision("bf16"));
///   Booster booster(BoosterOptions().plugin(plugin));
///   auto model = models::from_pretrained<models::MixtralForCausalLM>(dir);
///   auto boosted = booster.boost(model, optimizer);
///   auto loss = model->loss(boosted.model(ids), targets);
///   booster.backward(loss, *boosted.optimizer);
///   boosted.optimizer->step();
/// \endcode
class MoeHybridParallelPlugin : public HybridParallelPlugin {
 public:
  explicit MoeHybridParallelPlugin(MoeHybridParallelPluginOptions options = {})
      : HybridParallelPlugin(std::move(options), /*experts=*/true) {}

  std::string name() const override {
    return "MoeHybridParallelPlugin";
  }
};

} // namespace plugin
} // namespace booster
} // namespace colossalai
