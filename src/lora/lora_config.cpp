#include <colossalai/lora/lora_config.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <regex>

namespace colossalai {
namespace lora {

void LoraConfig::validate() const {
  TORCH_CHECK(r() > 0, "LoraConfig: r must be > 0, got ", r());
  TORCH_CHECK(
      lora_dropout() >= 0.0 && lora_dropout() < 1.0,
      "LoraConfig: lora_dropout must be in [0, 1), got ",
      lora_dropout());
  TORCH_CHECK(
      bias() == "none" || bias() == "all" || bias() == "lora_only",
      "LoraConfig: bias must be 'none', 'all' or 'lora_only', got '",
      bias(),
      "'");
  TORCH_CHECK(
      init_lora_weights() == "default" || init_lora_weights() == "gaussian" ||
          init_lora_weights() == "none",
      "LoraConfig: init_lora_weights must be 'default', 'gaussian' or "
      "'none', got '",
      init_lora_weights(),
      "'");
  TORCH_CHECK(
      !target_modules().empty() || !target_modules_regex().empty(),
      "LoraConfig: set target_modules (names) or target_modules_regex");
  if (!target_modules_regex().empty()) {
    try {
      std::regex re(target_modules_regex());
    } catch (const std::regex_error& e) {
      TORCH_CHECK(
          false,
          "LoraConfig: target_modules_regex '",
          target_modules_regex(),
          "' is not a regular expression: ",
          e.what());
    }
  }
}

std::string LoraConfig::to_json() const {
  nlohmann::json j;
  // PEFT's LoraConfig fields; those it has and we do not use keep their
  // defaults, so PEFT reads the file as written by its save_pretrained.
  j["peft_type"] = "LORA";
  j["task_type"] = task_type().empty() ? nlohmann::json(nullptr)
                                       : nlohmann::json(task_type());
  j["base_model_name_or_path"] = nullptr;
  j["revision"] = nullptr;
  j["inference_mode"] = true;
  j["r"] = r();
  // An int where it is one, as PEFT writes its (int) lora_alpha.
  const double alpha = lora_alpha();
  if (alpha == std::floor(alpha) && std::abs(alpha) < 1e15) {
    j["lora_alpha"] = static_cast<int64_t>(alpha);
  } else {
    j["lora_alpha"] = alpha;
  }
  j["lora_dropout"] = lora_dropout();
  if (!target_modules_regex().empty()) {
    j["target_modules"] = target_modules_regex();
  } else {
    j["target_modules"] = target_modules();
  }
  j["bias"] = bias();
  j["use_rslora"] = use_rslora();
  j["use_dora"] = false;
  j["fan_in_fan_out"] = fan_in_fan_out();
  j["modules_to_save"] = modules_to_save().empty()
      ? nlohmann::json(nullptr)
      : nlohmann::json(modules_to_save());
  if (init_lora_weights() == "default") {
    j["init_lora_weights"] = true;
  } else if (init_lora_weights() == "none") {
    j["init_lora_weights"] = false;
  } else {
    j["init_lora_weights"] = init_lora_weights();
  }
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["rank_pattern"] = nlohmann::json::object();
  j["alpha_pattern"] = nlohmann::json::object();
  return j.dump(2);
}

LoraConfig LoraConfig::from_json(
    const std::string& text,
    const std::string& file) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "'", file, "' is not JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "'", file, "' is not a JSON object");
  TORCH_CHECK(
      j.value("peft_type", std::string("LORA")) == "LORA",
      "'",
      file,
      "' is a ",
      j.value("peft_type", std::string()),
      " adapter; only LORA adapters load");
  LoraConfig c;
  try {
    if (j.contains("r")) {
      c.r(j.at("r").get<int64_t>());
    }
    if (j.contains("lora_alpha")) {
      c.lora_alpha(j.at("lora_alpha").get<double>());
    }
    if (j.contains("lora_dropout")) {
      c.lora_dropout(j.at("lora_dropout").get<double>());
    }
    const auto& t = j.at("target_modules");
    if (t.is_string()) {
      c.target_modules_regex(t.get<std::string>());
    } else {
      c.target_modules(t.get<std::vector<std::string>>());
    }
    if (j.contains("task_type") && j.at("task_type").is_string()) {
      c.task_type(j.at("task_type").get<std::string>());
    }
    if (j.contains("bias")) {
      c.bias(j.at("bias").get<std::string>());
    }
    if (j.contains("use_rslora")) {
      c.use_rslora(j.at("use_rslora").get<bool>());
    }
    if (j.contains("fan_in_fan_out")) {
      c.fan_in_fan_out(j.at("fan_in_fan_out").get<bool>());
    }
    if (j.contains("modules_to_save") && !j.at("modules_to_save").is_null()) {
      c.modules_to_save(
          j.at("modules_to_save").get<std::vector<std::string>>());
    }
    if (j.contains("init_lora_weights")) {
      const auto& i = j.at("init_lora_weights");
      c.init_lora_weights(
          i.is_boolean() ? (i.get<bool>() ? "default" : "none")
                         : i.get<std::string>());
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "'", file, "': ", e.what());
  }
  for (const char* unsupported : {"rank_pattern", "alpha_pattern"}) {
    TORCH_CHECK(
        !j.contains(unsupported) || j.at(unsupported).empty(),
        "'",
        file,
        "' sets ",
        unsupported,
        ", which is not supported");
  }
  TORCH_CHECK(
      !j.value("use_dora", false),
      "'",
      file,
      "' is a DoRA adapter (use_dora), which is not supported");
  c.validate();
  return c;
}

} // namespace lora
} // namespace colossalai
