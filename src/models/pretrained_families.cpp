// config.json <-> the families' configs, and their checkpoint key names.

#include "models/pretrained_internal.h"

#include <nlohmann/json.hpp>

namespace colossalai {
namespace models {

using json = nlohmann::json;

namespace {

using detail::ends_with;
using detail::starts_with;

json parse(const std::string& text) {
  return detail::parse_json(text);
}

using detail::get_or;
using detail::require;

json base_json(const std::string& source) {
  return source.empty() ? json::object() : parse(source);
}

} // namespace

GPT2Config gpt2_config_from_json(const std::string& text) {
  const auto j = parse(text);
  const auto type = get_or<std::string>(j, "model_type", "gpt2");
  TORCH_CHECK(
      type == "gpt2",
      "GPT2Config: config.json's model_type is '",
      type,
      "', not gpt2");
  const auto act = get_or<std::string>(j, "activation_function", "gelu_new");
  TORCH_CHECK(
      act == "gelu_new" || act == "gelu_pytorch_tanh",
      "GPT-2 config.json: activation_function '",
      act,
      "' is not supported (gelu_new, gelu_pytorch_tanh)");
  require(j, "scale_attn_weights", true, "GPT-2");
  require(j, "scale_attn_by_inverse_layer_idx", false, "GPT-2");
  require(j, "add_cross_attention", false, "GPT-2");
  require(j, "tie_word_embeddings", true, "GPT-2");
  GPT2Config c;
  c.vocab_size(get_or<int64_t>(j, "vocab_size", c.vocab_size()))
      .n_positions(get_or<int64_t>(j, "n_positions", c.n_positions()))
      .n_embd(get_or<int64_t>(j, "n_embd", c.n_embd()))
      .n_layer(get_or<int64_t>(j, "n_layer", c.n_layer()))
      .n_head(get_or<int64_t>(j, "n_head", c.n_head()))
      .n_inner(get_or<int64_t>(j, "n_inner", 0))
      .layer_norm_epsilon(
          get_or<double>(j, "layer_norm_epsilon", c.layer_norm_epsilon()))
      .embd_pdrop(get_or<double>(j, "embd_pdrop", c.embd_pdrop()))
      .attn_pdrop(get_or<double>(j, "attn_pdrop", c.attn_pdrop()))
      .resid_pdrop(get_or<double>(j, "resid_pdrop", c.resid_pdrop()))
      .initializer_range(
          get_or<double>(j, "initializer_range", c.initializer_range()))
      .pad_token_id(get_or<int64_t>(j, "pad_token_id", -1))
      .source_json(text);
  return c;
}

std::string config_to_json(const GPT2Config& c) {
  auto j = base_json(c.source_json());
  j["model_type"] = "gpt2";
  j["architectures"] = {"GPT2LMHeadModel"};
  j["vocab_size"] = c.vocab_size();
  j["n_positions"] = c.n_positions();
  j["n_embd"] = c.n_embd();
  j["n_layer"] = c.n_layer();
  j["n_head"] = c.n_head();
  j["n_inner"] = c.n_inner() > 0 ? json(c.n_inner()) : json(nullptr);
  j["layer_norm_epsilon"] = c.layer_norm_epsilon();
  j["embd_pdrop"] = c.embd_pdrop();
  j["attn_pdrop"] = c.attn_pdrop();
  j["resid_pdrop"] = c.resid_pdrop();
  j["initializer_range"] = c.initializer_range();
  j["activation_function"] = "gelu_new";
  j["tie_word_embeddings"] = true;
  j["pad_token_id"] =
      c.pad_token_id() >= 0 ? json(c.pad_token_id()) : json(nullptr);
  return j.dump(2) + "\n";
}

LlamaConfig llama_config_from_json(const std::string& text) {
  const auto j = parse(text);
  const auto type = get_or<std::string>(j, "model_type", "llama");
  TORCH_CHECK(
      type == "llama" || type == "mistral" || type == "qwen2" ||
          type == "qwen3",
      "LlamaConfig: config.json's model_type '",
      type,
      "' is not one LlamaForCausalLM computes (llama, mistral, qwen2, "
      "qwen3)");
  const auto act = get_or<std::string>(j, "hidden_act", "silu");
  TORCH_CHECK(
      act == "silu",
      type,
      " config.json: hidden_act '",
      act,
      "' is not supported (silu)");
  LlamaConfig c;
  c.model_type(type)
      .vocab_size(get_or<int64_t>(j, "vocab_size", c.vocab_size()))
      .hidden_size(get_or<int64_t>(j, "hidden_size", c.hidden_size()))
      .intermediate_size(
          get_or<int64_t>(j, "intermediate_size", c.intermediate_size()))
      .num_hidden_layers(
          get_or<int64_t>(j, "num_hidden_layers", c.num_hidden_layers()))
      .num_attention_heads(
          get_or<int64_t>(j, "num_attention_heads", c.num_attention_heads()));
  c.num_key_value_heads(
       get_or<int64_t>(j, "num_key_value_heads", c.num_attention_heads()))
      .head_dim(get_or<int64_t>(j, "head_dim", 0))
      .max_position_embeddings(get_or<int64_t>(
          j, "max_position_embeddings", c.max_position_embeddings()))
      .rms_norm_eps(get_or<double>(j, "rms_norm_eps", c.rms_norm_eps()))
      .initializer_range(
          get_or<double>(j, "initializer_range", c.initializer_range()))
      .tie_word_embeddings(get_or<bool>(j, "tie_word_embeddings", false))
      .attention_bias(get_or<bool>(j, "attention_bias", false))
      .mlp_bias(get_or<bool>(j, "mlp_bias", false))
      .qkv_bias(type == "qwen2")
      .qk_norm(type == "qwen3")
      .source_json(text);
  // pad_token_id: absent or null is none, LlamaConfig's default.
  c.pad_token_id(get_or<int64_t>(j, "pad_token_id", -1));
  // Rotary parameters: transformers 5's rope_parameters, or rope_theta and
  // rope_scaling before it.
  json rope = json::object();
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    rope = j["rope_parameters"];
  } else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) {
    rope = j["rope_scaling"];
  }
  c.rope_theta(get_or<double>(
      rope, "rope_theta", get_or<double>(j, "rope_theta", c.rope_theta())));
  const auto rope_type = get_or<std::string>(
      rope, "rope_type", get_or<std::string>(rope, "type", "default"));
  TORCH_CHECK(
      rope_type == "default" || rope_type == "linear" || rope_type == "llama3",
      type,
      " config.json: rope type '",
      rope_type,
      "' is not supported (default, linear, llama3)");
  RopeScaling rs;
  rs.rope_type(rope_type)
      .factor(get_or<double>(rope, "factor", 1.0))
      .low_freq_factor(get_or<double>(rope, "low_freq_factor", 1.0))
      .high_freq_factor(get_or<double>(rope, "high_freq_factor", 4.0))
      .original_max_position_embeddings(
          get_or<int64_t>(rope, "original_max_position_embeddings", 8192));
  c.rope_scaling(rs);
  if (type == "mistral") {
    c.sliding_window(get_or<int64_t>(j, "sliding_window", 0));
  } else if (type == "qwen2" || type == "qwen3") {
    TORCH_CHECK(
        !get_or<bool>(j, "use_sliding_window", false),
        type,
        " config.json: use_sliding_window = true is not supported");
  }
  return c;
}

std::string config_to_json(const LlamaConfig& c) {
  auto j = base_json(c.source_json());
  const auto& type = c.model_type();
  const char* arch = type == "mistral" ? "MistralForCausalLM"
      : type == "qwen2"                ? "Qwen2ForCausalLM"
      : type == "qwen3"                ? "Qwen3ForCausalLM"
                                       : "LlamaForCausalLM";
  j["model_type"] = type;
  j["architectures"] = {arch};
  j["vocab_size"] = c.vocab_size();
  j["hidden_size"] = c.hidden_size();
  j["intermediate_size"] = c.intermediate_size();
  j["num_hidden_layers"] = c.num_hidden_layers();
  j["num_attention_heads"] = c.num_attention_heads();
  j["num_key_value_heads"] = c.num_key_value_heads();
  j["head_dim"] = c.resolved_head_dim();
  j["max_position_embeddings"] = c.max_position_embeddings();
  j["rms_norm_eps"] = c.rms_norm_eps();
  j["initializer_range"] = c.initializer_range();
  j["tie_word_embeddings"] = c.tie_word_embeddings();
  j["pad_token_id"] =
      c.pad_token_id() >= 0 ? json(c.pad_token_id()) : json(nullptr);
  j["hidden_act"] = "silu";
  if (type == "llama") {
    j["attention_bias"] = c.attention_bias();
    j["mlp_bias"] = c.mlp_bias();
  } else if (type == "qwen3") {
    j["attention_bias"] = c.attention_bias();
  }
  if (type == "mistral") {
    j["sliding_window"] =
        c.sliding_window() > 0 ? json(c.sliding_window()) : json(nullptr);
  }
  const auto& rs = c.rope_scaling();
  json rope = {{"rope_type", rs.rope_type()}, {"rope_theta", c.rope_theta()}};
  if (rs.rope_type() != "default") {
    rope["factor"] = rs.factor();
  }
  if (rs.rope_type() == "llama3") {
    rope["low_freq_factor"] = rs.low_freq_factor();
    rope["high_freq_factor"] = rs.high_freq_factor();
    rope["original_max_position_embeddings"] =
        rs.original_max_position_embeddings();
  }
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = rope;
  return j.dump(2) + "\n";
}

template <>
GPT2LMHeadModel from_pretrained<GPT2LMHeadModel>(
    const std::string& dir,
    const FromPretrainedOptions& options) {
  const auto text = detail::read_config_json(dir);
  return detail::load_pretrained_model<GPT2LMHeadModel>(
      dir,
      text,
      gpt2_config_from_json(text),
      options,
      [](const std::string& key) -> std::string {
        // The tied head, and the causal-mask buffers of old checkpoints.
        if (starts_with(key, "lm_head.") || ends_with(key, ".attn.bias") ||
            ends_with(key, ".attn.masked_bias")) {
          return "";
        }
        // A bare GPT2Model's checkpoint has no prefix.
        return starts_with(key, "transformer.") ? key : "transformer." + key;
      });
}

template <>
LlamaForCausalLM from_pretrained<LlamaForCausalLM>(
    const std::string& dir,
    const FromPretrainedOptions& options) {
  const auto text = detail::read_config_json(dir);
  const auto config = llama_config_from_json(text);
  const bool tied = config.tie_word_embeddings();
  return detail::load_pretrained_model<LlamaForCausalLM>(
      dir,
      text,
      config,
      options,
      [tied](const std::string& key) -> std::string {
        if (ends_with(key, "rotary_emb.inv_freq") ||
            (tied && key == "lm_head.weight")) {
          return "";
        }
        if (starts_with(key, "model.") || starts_with(key, "lm_head.")) {
          return key;
        }
        return "model." + key; // a bare LlamaModel's checkpoint
      });
}

void save_pretrained(
    GPT2LMHeadModel& model,
    const std::string& dir,
    const SavePretrainedOptions& options) {
  detail::save_pretrained_model(model, dir, options);
}

void save_pretrained(
    LlamaForCausalLM& model,
    const std::string& dir,
    const SavePretrainedOptions& options) {
  detail::save_pretrained_model(model, dir, options);
}

void save_pretrained_config(const GPT2Config& config, const std::string& dir) {
  detail::write_config_json(dir, config_to_json(config));
}

void save_pretrained_config(const LlamaConfig& config, const std::string& dir) {
  detail::write_config_json(dir, config_to_json(config));
}

} // namespace models
} // namespace colossalai
