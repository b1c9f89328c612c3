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
using detail::get_or;
using detail::require;

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
  const auto j = detail::parse_json(text);
  const auto type = get_or<std::string>(j, "model_type", "bert");
  TORCH_CHECK(
      type == "bert",
      "BertConfig: config.json's model_type is '",
      type,
      "', not bert");
  const auto act = get_or<std::string>(j, "hidden_act", "gelu");
  TORCH_CHECK(
      act == "gelu" || act == "gelu_new" || act == "gelu_pytorch_tanh",
      "BERT config.json: hidden_act '",
      act,
      "' is not supported (gelu, gelu_new, gelu_pytorch_tanh)");
  require(j, "position_embedding_type", std::string("absolute"), "BERT");
  require(j, "is_decoder", false, "BERT");
  require(j, "add_cross_attention", false, "BERT");
  require(j, "tie_word_embeddings", true, "BERT");
  BertConfig c;
  c.vocab_size(get_or<int64_t>(j, "vocab_size", c.vocab_size()))
      .hidden_size(get_or<int64_t>(j, "hidden_size", c.hidden_size()))
      .num_hidden_layers(
          get_or<int64_t>(j, "num_hidden_layers", c.num_hidden_layers()))
      .num_attention_heads(
          get_or<int64_t>(j, "num_attention_heads", c.num_attention_heads()))
      .intermediate_size(
          get_or<int64_t>(j, "intermediate_size", c.intermediate_size()))
      .hidden_act(act)
      .hidden_dropout_prob(
          get_or<double>(j, "hidden_dropout_prob", c.hidden_dropout_prob()))
      .attention_probs_dropout_prob(get_or<double>(
          j, "attention_probs_dropout_prob", c.attention_probs_dropout_prob()))
      .max_position_embeddings(get_or<int64_t>(
          j, "max_position_embeddings", c.max_position_embeddings()))
      .type_vocab_size(
          get_or<int64_t>(j, "type_vocab_size", c.type_vocab_size()))
      .initializer_range(
          get_or<double>(j, "initializer_range", c.initializer_range()))
      .layer_norm_eps(get_or<double>(j, "layer_norm_eps", c.layer_norm_eps()))
      .source_json(text);
  // pad_token_id: absent is BertConfig's default (0), null is none.
  if (j.contains("pad_token_id")) {
    c.pad_token_id(
        j["pad_token_id"].is_null() ? -1
                                    : get_or<int64_t>(j, "pad_token_id", 0));
  }
  return c;
}

std::string config_to_json(const BertConfig& c) {
  auto j = c.source_json().empty() ? json::object()
                                   : detail::parse_json(c.source_json());
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
  const auto text = detail::read_config_json(dir);
  return detail::load_pretrained_model<BertForMaskedLM>(
      dir, text, bert_config_from_json(text), options, bert_key);
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
