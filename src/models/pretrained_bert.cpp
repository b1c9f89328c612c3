// config.json <-> BertConfig, and BertForMaskedLM's checkpoint key names.

#include <colossalai/models/bert.h>

#include "models/pretrained_internal.h"

#include <nlohmann/json.hpp>

namespace colossalai {
namespace models {

namespace {

using detail::ends_with;
using detail::starts_with;

using json = nlohmann::json;

// `s` with `suffix` (which it ends with) replaced by `by`.
std::string replace_suffix(
    const std::string& s,
    const std::string& suffix,
    const std::string& by) {
  return s.substr(0, s.size() - suffix.size()) + by;
}

// A checkpoint key -> BertForMaskedLM's name; "" skips the tensor.
std::string bert_key(const std::string& key) {
  std::string k = key;
  // A bare BertModel's checkpoint has no prefix.
  if (!starts_with(k, "bert.") && !starts_with(k, "cls.")) {
    k = "bert." + k;
  }
  // Tensors BertForMaskedLM does not have, or holds once: the pooler and
  // the next-sentence head (BertModel, BertForPreTraining), the decoder
  // tied to word_embeddings (its bias is cls.predictions.bias), and the
  // embeddings' position / token type buffers of old checkpoints.
  if (starts_with(k, "bert.pooler.") ||
      starts_with(k, "cls.seq_relationship.") ||
      k == "cls.predictions.decoder.weight" ||
      k == "cls.predictions.decoder.bias" ||
      k == "bert.embeddings.position_ids" ||
      k == "bert.embeddings.token_type_ids") {
    return "";
  }
  // TensorFlow-era names of the LayerNorm parameters.
  if (ends_with(k, "LayerNorm.gamma")) {
    return replace_suffix(k, "gamma", "weight");
  }
  if (ends_with(k, "LayerNorm.beta")) {
    return replace_suffix(k, "beta", "bias");
  }
  return k;
}

} // namespace

BertConfig bert_config_from_json(const std::string& text) {
  const detail::ConfigFields f(text);
  f.one_of("model_type", "bert", {"bert"}, "BertForMaskedLM");
  const auto act = f.one_of(
      "hidden_act", "gelu", {"gelu", "gelu_new", "gelu_pytorch_tanh"}, "BERT");
  f.require("position_embedding_type", "absolute", "BERT");
  f.require("is_decoder", false, "BERT");
  f.require("add_cross_attention", false, "BERT");
  f.require("tie_word_embeddings", true, "BERT");
  BertConfig c;
  c.vocab_size(f.size("vocab_size", c.vocab_size()))
      .hidden_size(f.size("hidden_size", c.hidden_size()))
      .num_hidden_layers(f.size("num_hidden_layers", c.num_hidden_layers()))
      .num_attention_heads(
          f.size("num_attention_heads", c.num_attention_heads()))
      .intermediate_size(f.size("intermediate_size", c.intermediate_size()))
      .hidden_act(act)
      .hidden_dropout_prob(
          f.probability("hidden_dropout_prob", c.hidden_dropout_prob()))
      .attention_probs_dropout_prob(f.probability(
          "attention_probs_dropout_prob", c.attention_probs_dropout_prob()))
      .max_position_embeddings(
          f.size("max_position_embeddings", c.max_position_embeddings()))
      .type_vocab_size(f.size("type_vocab_size", c.type_vocab_size()))
      .initializer_range(
          f.non_negative("initializer_range", c.initializer_range()))
      .layer_norm_eps(f.positive("layer_norm_eps", c.layer_norm_eps()))
      // Absent: BertConfig's default (0); null: none.
      .pad_token_id(detail::token_id_or_none(
          f, "pad_token_id", c.pad_token_id(), c.vocab_size()))
      .source_json(text);
  detail::check_divisible(
      f,
      "hidden_size",
      c.hidden_size(),
      "num_attention_heads",
      c.num_attention_heads());
  return c;
}

std::string config_to_json(const BertConfig& c) {
  auto j = detail::source_fields(c.source_json());
  j["model_type"] = "bert";
  j["architectures"] = {"BertForMaskedLM"};
  j["vocab_size"] = c.vocab_size();
  j["hidden_size"] = c.hidden_size();
  j["num_hidden_layers"] = c.num_hidden_layers();
  j["num_attention_heads"] = c.num_attention_heads();
  j["intermediate_size"] = c.intermediate_size();
  j["hidden_act"] = c.hidden_act();
  j["hidden_dropout_prob"] = c.hidden_dropout_prob();
  j["attention_probs_dropout_prob"] = c.attention_probs_dropout_prob();
  j["max_position_embeddings"] = c.max_position_embeddings();
  j["type_vocab_size"] = c.type_vocab_size();
  j["initializer_range"] = c.initializer_range();
  j["layer_norm_eps"] = c.layer_norm_eps();
  j["pad_token_id"] =
      c.pad_token_id() >= 0 ? json(c.pad_token_id()) : json(nullptr);
  j["tie_word_embeddings"] = true;
  return j.dump(2) + "\n";
}

template <>
BertForMaskedLM from_pretrained<BertForMaskedLM>(
    const std::string& dir,
    const FromPretrainedOptions& options) {
  const auto config =
      detail::read_pretrained_config(dir, bert_config_from_json);
  return detail::load_pretrained_model<BertForMaskedLM>(
      dir,
      config,
      {config.num_hidden_layers(), "num_hidden_layers"},
      options,
      bert_key);
}

void save_pretrained(
    BertForMaskedLM& model,
    const std::string& dir,
    const SavePretrainedOptions& options) {
  detail::save_pretrained_model(model, dir, options);
}

void save_pretrained_config(const BertConfig& config, const std::string& dir) {
  detail::write_config_json(dir, config_to_json(config));
}

} // namespace models
} // namespace colossalai
