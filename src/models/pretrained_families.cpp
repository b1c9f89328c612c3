// config.json <-> the families' configs, and their checkpoint key names.

#include "models/pretrained_internal.h"

#include <nlohmann/json.hpp>

#include <string>

namespace colossalai {
namespace models {

using json = nlohmann::json;

namespace {

using detail::ends_with;
using detail::starts_with;

} // namespace

GPT2Config gpt2_config_from_json(const std::string& text) {
  const detail::ConfigFields f(text);
  f.one_of("model_type", "gpt2", {"gpt2"}, "GPT2LMHeadModel");
  f.one_of(
      "activation_function",
      "gelu_new",
      {"gelu_new", "gelu_pytorch_tanh"},
      "GPT-2");
  f.require("scale_attn_weights", true, "GPT-2");
  f.require("scale_attn_by_inverse_layer_idx", false, "GPT-2");
  f.require("add_cross_attention", false, "GPT-2");
  f.require("tie_word_embeddings", true, "GPT-2");
  GPT2Config c;
  c.vocab_size(f.size("vocab_size", c.vocab_size()))
      .n_positions(f.size("n_positions", c.n_positions()))
      .n_embd(f.size("n_embd", c.n_embd()))
      .n_layer(f.size("n_layer", c.n_layer()))
      .n_head(f.size("n_head", c.n_head()))
      .n_inner(f.size("n_inner", 0)) // null: 4 x n_embd
      .layer_norm_epsilon(
          f.positive("layer_norm_epsilon", c.layer_norm_epsilon()))
      .embd_pdrop(f.probability("embd_pdrop", c.embd_pdrop()))
      .attn_pdrop(f.probability("attn_pdrop", c.attn_pdrop()))
      .resid_pdrop(f.probability("resid_pdrop", c.resid_pdrop()))
      .initializer_range(
          f.non_negative("initializer_range", c.initializer_range()))
      .pad_token_id(
          detail::token_id_or_none(f, "pad_token_id", -1, c.vocab_size()))
      .source_json(text);
  detail::check_divisible(f, "n_embd", c.n_embd(), "n_head", c.n_head());
  return c;
}

std::string config_to_json(const GPT2Config& c) {
  auto j = detail::source_fields(c.source_json());
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

namespace {

// The mixture-of-experts fields of MixtralConfig, Qwen2MoeConfig and
// Qwen3MoeConfig (their defaults where absent).
MoeConfig moe_config_from_fields(
    const detail::ConfigFields& f,
    const std::string& type,
    int64_t layers) {
  const bool mixtral = type == "mixtral";
  MoeConfig m;
  // Mixtral names it num_local_experts; transformers 5 writes that name for
  // Qwen3-MoE too.
  const char* experts_key =
      mixtral || !f.has("num_experts") ? "num_local_experts" : "num_experts";
  m.num_experts(
       f.size(experts_key, mixtral ? 8 : (type == "qwen2_moe" ? 60 : 128)))
      .num_experts_per_tok(f.size(
          "num_experts_per_tok", mixtral ? 2 : (type == "qwen2_moe" ? 4 : 8)))
      .router_aux_loss_coef(
          f.non_negative("router_aux_loss_coef", m.router_aux_loss_coef()))
      .output_router_logits(f.boolean("output_router_logits", false));
  if (m.num_experts_per_tok() > m.num_experts()) {
    f.fail(
        "num_experts_per_tok",
        "(" + std::to_string(m.num_experts_per_tok()) +
            ") must be at most the number of experts (" +
            std::to_string(m.num_experts()) + ")");
  }
  if (mixtral) {
    // Multiplicative noise on the router's input while training: not
    // reproducible against one process, so not implemented.
    if (f.non_negative("router_jitter_noise", 0.0) != 0.0) {
      f.fail("router_jitter_noise", "other than 0 is not supported");
    }
    return m.norm_topk_prob(true);
  }
  m.moe_intermediate_size(
       f.size("moe_intermediate_size", type == "qwen2_moe" ? 1408 : 768))
      .norm_topk_prob(f.boolean("norm_topk_prob", false))
      .decoder_sparse_step(f.size("decoder_sparse_step", 1))
      .mlp_only_layers(f.integers("mlp_only_layers", 0, layers - 1));
  if (type == "qwen2_moe") {
    m.shared_expert_intermediate_size(
        f.count("shared_expert_intermediate_size", 5632));
  }
  return m;
}

} // namespace

LlamaConfig llama_config_from_json(const std::string& text) {
  const detail::ConfigFields f(text);
  const auto type = f.one_of(
      "model_type",
      "llama",
      {"llama",
       "mistral",
       "qwen2",
       "qwen3",
       "mixtral",
       "qwen2_moe",
       "qwen3_moe"},
      "LlamaForCausalLM");
  f.one_of("hidden_act", "silu", {"silu"}, type.c_str());
  LlamaConfig c;
  c.model_type(type)
      .vocab_size(f.size("vocab_size", c.vocab_size()))
      .hidden_size(f.size("hidden_size", c.hidden_size()))
      .intermediate_size(f.size("intermediate_size", c.intermediate_size()))
      .num_hidden_layers(f.size("num_hidden_layers", c.num_hidden_layers()))
      .num_attention_heads(
          f.size("num_attention_heads", c.num_attention_heads()));
  c.num_key_value_heads(f.size("num_key_value_heads", c.num_attention_heads()))
      .head_dim(f.size("head_dim", 0)) // null: hidden / heads
      .max_position_embeddings(
          f.size("max_position_embeddings", c.max_position_embeddings()))
      .rms_norm_eps(f.positive("rms_norm_eps", c.rms_norm_eps()))
      .initializer_range(
          f.non_negative("initializer_range", c.initializer_range()))
      .tie_word_embeddings(f.boolean("tie_word_embeddings", false))
      .attention_bias(f.boolean("attention_bias", false))
      .mlp_bias(f.boolean("mlp_bias", false))
      .qkv_bias(type == "qwen2" || type == "qwen2_moe")
      .qk_norm(type == "qwen3" || type == "qwen3_moe")
      .source_json(text);
  // pad_token_id: absent or null is none, LlamaConfig's default.
  c.pad_token_id(
      detail::token_id_or_none(f, "pad_token_id", -1, c.vocab_size()));
  detail::check_divisible(
      f,
      "num_attention_heads",
      c.num_attention_heads(),
      "num_key_value_heads",
      c.num_key_value_heads());
  if (!f.has("head_dim")) {
    detail::check_divisible(
        f,
        "hidden_size",
        c.hidden_size(),
        "num_attention_heads",
        c.num_attention_heads());
  }
  if (c.resolved_head_dim() % 2 != 0) {
    f.fail(
        f.has("head_dim") ? "head_dim" : "hidden_size",
        "gives heads of " + std::to_string(c.resolved_head_dim()) +
            " dimensions; rotary embeddings need an even number");
  }
  // Rotary parameters: transformers 5's rope_parameters, or rope_theta and
  // rope_scaling before it.
  const auto rope =
      f.object(f.has("rope_parameters") ? "rope_parameters" : "rope_scaling");
  c.rope_theta(
      rope.positive("rope_theta", f.positive("rope_theta", c.rope_theta())));
  const char* type_key = rope.has("rope_type") ? "rope_type" : "type";
  const auto rope_type = rope.one_of(
      type_key, "default", {"default", "linear", "llama3"}, type.c_str());
  RopeScaling rs;
  rs.rope_type(rope_type)
      .factor(rope.positive("factor", 1.0))
      .low_freq_factor(rope.positive("low_freq_factor", 1.0))
      .high_freq_factor(rope.positive("high_freq_factor", 4.0))
      .original_max_position_embeddings(
          rope.size("original_max_position_embeddings", 8192));
  if (rope_type == "llama3" && rs.low_freq_factor() >= rs.high_freq_factor()) {
    rope.fail(
        "low_freq_factor",
        "(" + json(rs.low_freq_factor()).dump() +
            ") must be below high_freq_factor (" +
            json(rs.high_freq_factor()).dump() + ")");
  }
  c.rope_scaling(rs);
  if (type == "mistral" || type == "mixtral") {
    c.sliding_window(f.count("sliding_window", 0));    // null, 0: none
  } else if (f.boolean("use_sliding_window", false)) { // the Qwens
    f.fail("use_sliding_window", "= true is not supported by " + type);
  }
  if (type == "mixtral" || type == "qwen2_moe" || type == "qwen3_moe") {
    c.moe(moe_config_from_fields(f, type, c.num_hidden_layers()));
  }
  return c;
}

std::string config_to_json(const LlamaConfig& c) {
  auto j = detail::source_fields(c.source_json());
  const auto& type = c.model_type();
  const char* arch = type == "mistral" ? "MistralForCausalLM"
      : type == "qwen2"                ? "Qwen2ForCausalLM"
      : type == "qwen3"                ? "Qwen3ForCausalLM"
      : type == "mixtral"              ? "MixtralForCausalLM"
      : type == "qwen2_moe"            ? "Qwen2MoeForCausalLM"
      : type == "qwen3_moe"            ? "Qwen3MoeForCausalLM"
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
  } else if (type == "qwen3" || type == "qwen3_moe") {
    j["attention_bias"] = c.attention_bias();
  }
  const auto& moe = c.moe();
  if (moe.enabled()) {
    j[type == "mixtral" ? "num_local_experts" : "num_experts"] =
        moe.num_experts();
    j["num_experts_per_tok"] = moe.num_experts_per_tok();
    j["router_aux_loss_coef"] = moe.router_aux_loss_coef();
    j["output_router_logits"] = moe.output_router_logits();
    if (type == "mixtral") {
      j["router_jitter_noise"] = 0.0;
    } else {
      j["moe_intermediate_size"] = moe.expert_width(c.intermediate_size());
      j["norm_topk_prob"] = moe.norm_topk_prob();
      j["decoder_sparse_step"] = moe.decoder_sparse_step();
      j["mlp_only_layers"] = moe.mlp_only_layers();
    }
    if (type == "qwen2_moe") {
      j["shared_expert_intermediate_size"] =
          moe.shared_expert_intermediate_size();
    }
  }
  if (type == "mistral" || type == "mixtral") {
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
  j["rope_parameters"] = rope;
  // transformers before 5 (ColossalAI 0.5 pins 4.51) reads these instead,
  // and takes rope_theta's default, silently, when it is absent; 5 and
  // from_pretrained read rope_parameters first.
  j["rope_theta"] = c.rope_theta();
  rope.erase("rope_theta");
  j["rope_scaling"] = rs.rope_type() == "default" ? json(nullptr) : rope;
  return j.dump(2) + "\n";
}

template <>
GPT2LMHeadModel from_pretrained<GPT2LMHeadModel>(
    const std::string& dir,
    const FromPretrainedOptions& options) {
  const auto config =
      detail::read_pretrained_config(dir, gpt2_config_from_json);
  return detail::load_pretrained_model<GPT2LMHeadModel>(
      dir,
      config,
      {config.n_layer(), "n_layer"},
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
  const auto config =
      detail::read_pretrained_config(dir, llama_config_from_json);
  const bool tied = config.tie_word_embeddings();
  return detail::load_pretrained_model<LlamaForCausalLM>(
      dir,
      config,
      {config.num_hidden_layers(), "num_hidden_layers"},
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
