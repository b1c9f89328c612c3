// BertPolicy: BERT's tensor-parallel, sequence-parallel and pipeline split.

#include <colossalai/models/bert.h>

namespace colossalai {
namespace models {

namespace sl = shardformer::layer;

shardformer::ShardInfo BertPolicy::shard(
    torch::nn::Module& model,
    const shardformer::ShardConfig& cfg) {
  auto& m = policy_model<BertForMaskedLMImpl>(
      model, "BertPolicy", "a BertForMaskedLM");
  const auto tp = cfg.tensor_parallel_process_group();
  const auto mode = cfg.sp_mode();
  TORCH_CHECK(
      !shardformer::on_sp_group(mode),
      "BertPolicy: sequence_parallelism_mode '",
      shardformer::to_string(mode),
      "' is not supported for BERT (split_gather, ring)");
  auto& st = m.parallel_state();
  configure_parallel_state(
      st,
      cfg,
      m.config().num_attention_heads(),
      "BertPolicy",
      "num_attention_heads");

  auto& emb = *m.bert->embeddings;
  shard_vocab_parallel(*emb.word_embeddings, cfg);
  shardformer::ShardInfo info;
  // The decoder's bias goes with the decoder's (word_embeddings') rows:
  // padded like them (zeros) and split over tp.
  const auto bias_spec =
      sl::ShardSpec::split(0, m.config().vocab_size(), tp)
          .with_padding(emb.word_embeddings->padded_num_embeddings());
  sl::detail::shard_param_(m.cls->predictions->bias, bias_spec);
  info.specs["cls.predictions.bias"] = bias_spec;

  const bool split_gather = shardformer::on_tensor_group(mode);
  // Activations between the row and the next column layer: sequence chunks
  // over tp under split_gather, replicated otherwise.
  const auto act_group = split_gather ? tp : nullptr;
  set_dropout(emb.dropout, nullptr, false); // before the split: replicated
  auto& layers = *m.bert->encoder->layer;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto* blk = layers[i]->as<BertLayerImpl>();
    auto& self = *blk->attention->self;
    auto& self_out = *blk->attention->output;
    auto& out = *blk->output;
    shard_linears(
        {self.query.get(),
         self.key.get(),
         self.value.get(),
         blk->intermediate->dense.get()},
        {self_out.dense.get(), out.dense.get()},
        tp,
        mode,
        cfg);
    set_dropout(self.dropout, tp, true); // heads are split
    set_dropout(self_out.dropout, act_group, act_group != nullptr);
    set_dropout(out.dropout, act_group, act_group != nullptr);
    if (split_gather) {
      // Used on this rank's sequence chunk only: partial gradients.
      add_partial_grads(
          info,
          "bert.encoder.layer." + std::to_string(i) + ".",
          {"attention.output.dense.bias",
           "attention.output.LayerNorm.weight",
           "attention.output.LayerNorm.bias",
           "output.dense.bias",
           "output.LayerNorm.weight",
           "output.LayerNorm.bias"});
    }
  }
  return info;
}


int64_t BertPolicy::num_pipeline_layers(const torch::nn::Module& model) const {
  return policy_model<BertForMaskedLMImpl>(
             model, "BertPolicy", "a BertForMaskedLM")
      .config()
      .num_hidden_layers();
}

std::vector<std::string> BertPolicy::held_layers(
    const torch::nn::Module& model,
    const shardformer::StageLayers& layers) const {
  const int64_t n = BertPolicy::num_pipeline_layers(model);
  std::vector<std::string> names;
  if (layers.first) {
    names.push_back("bert.embeddings");
  }
  append_stage_blocks(names, layers, n, "bert.encoder.layer.");
  if (layers.last) {
    names.push_back("cls");
    if (!layers.first) {
      names.emplace_back("bert.embeddings.word_embeddings"); // the tied decoder
    }
  }
  return names;
}

std::vector<std::string> BertPolicy::shared_params(
    const torch::nn::Module&) const {
  return {"bert.embeddings.word_embeddings.weight"};
}

at::Tensor BertPolicy::stage_forward(
    torch::nn::Module& model,
    const shardformer::StageLayers& layers,
    const std::vector<at::Tensor>& micro_batch,
    const at::Tensor& hidden) const {
  auto& m = policy_model<BertForMaskedLMImpl>(
      model, "BertPolicy", "a BertForMaskedLM");
  TORCH_CHECK(
      !micro_batch.empty() && micro_batch[0].defined(),
      "BertPolicy: the micro-batch must start with the input ids");
  // [1] is the criterion's labels: not an input of the forward.
  return m.forward_stage(
      layers,
      micro_batch[0],
      hidden,
      micro_batch_input(micro_batch, 2),
      micro_batch_input(micro_batch, 3));
}

} // namespace models
} // namespace colossalai
