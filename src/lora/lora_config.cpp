#include <colossalai/lora/lora_config.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "../utils/bounded_read.h"
#include "module_regex.h"

#include <cmath>
#include <cstdint>

namespace colossalai {
namespace lora {
namespace {
// As the tokenizer's files (serde_json's limit).
constexpr size_t kMaxJsonDepth = 128;
} // namespace

void LoraConfig::validate() const {
  TORCH_CHECK(r() > 0, "LoraConfig: r must be > 0, got ", r());
  TORCH_CHECK(
      std::isfinite(lora_alpha()),
      "LoraConfig: lora_alpha must be finite, got ",
      lora_alpha());
  TORCH_CHECK(
      lora_dropout() >= 0.0 && lora_dropout() < 1.0,
      "LoraConfig: lora_dropout must be in [0, 1), got ",
      lora_dropout());
  TORCH_CHECK(
      bias() == "none" || bias() == "all" || bias() == "lora_only",
      "LoraConfig: bias must be 'none', 'all' or 'lora_only', got '",
      utils::excerpt(bias()),
      "'");
  TORCH_CHECK(
      init_lora_weights() == "default" || init_lora_weights() == "gaussian" ||
          init_lora_weights() == "none",
      "LoraConfig: init_lora_weights must be 'default', 'gaussian' or "
      "'none', got '",
      utils::excerpt(init_lora_weights()),
      "'");
  TORCH_CHECK(
      !target_modules().empty() || !target_modules_regex().empty(),
      "LoraConfig: set target_modules (names) or target_modules_regex");
  if (!target_modules_regex().empty()) {
    try {
      detail::ModuleRegex re(target_modules_regex());
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(
          false,
          "LoraConfig: target_modules_regex (adapter_config.json's "
          "target_modules string) '",
          utils::excerpt(target_modules_regex()),
          "' is refused: ",
          e.what(),
          " (Python's re syntax, matched with bounded work: NOTE [Module "
          "regexes])");
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

namespace {

using json = nlohmann::json;

// adapter_config.json's fields, type-checked: absent or null is the
// default, another type an error naming the file and the field.
struct Fields {
  const json& j;
  const std::string& file;

  [[noreturn]] void bad(const char* key, const std::string& what) const {
    TORCH_CHECK(
        false,
        "LoRA: '",
        file,
        "': field '",
        key,
        "' ",
        what,
        ", got ",
        utils::excerpt(
            j.at(key).dump(-1, ' ', false, json::error_handler_t::replace)));
  }
  bool has(const char* key) const {
    return j.contains(key) && !j.at(key).is_null();
  }
  std::string str(const char* key, const std::string& def) const {
    if (!has(key)) {
      return def;
    }
    if (!j.at(key).is_string()) {
      bad(key, "must be a string");
    }
    return j.at(key).get<std::string>();
  }
  bool flag(const char* key, bool def) const {
    if (!has(key)) {
      return def;
    }
    if (!j.at(key).is_boolean()) {
      bad(key, "must be true or false");
    }
    return j.at(key).get<bool>();
  }
  double number(const char* key, double def) const {
    if (!has(key)) {
      return def;
    }
    if (!j.at(key).is_number() || !std::isfinite(j.at(key).get<double>())) {
      bad(key, "must be a finite number");
    }
    return j.at(key).get<double>();
  }
  std::vector<std::string> names(const char* key) const {
    std::vector<std::string> out;
    if (!has(key)) {
      return out;
    }
    const auto& v = j.at(key);
    if (!v.is_array()) {
      bad(key, "must be a list of module names");
    }
    for (const auto& e : v) {
      if (!e.is_string()) {
        bad(key, "must be a list of module names (strings)");
      }
      out.push_back(e.get<std::string>());
    }
    return out;
  }
};

} // namespace

LoraConfig LoraConfig::from_json(
    const std::string& text,
    const std::string& file) {
  const auto deep = utils::json_depth_error(text, kMaxJsonDepth);
  TORCH_CHECK(deep.empty(), "LoRA: '", file, "' is not an adapter config: ", deep);
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "LoRA: '", file, "' is not JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "LoRA: '", file, "' is not a JSON object");
  const Fields f{j, file};
  const auto peft_type = f.str("peft_type", "LORA");
  TORCH_CHECK(
      peft_type == "LORA",
      "LoRA: '",
      file,
      "' is a ",
      utils::excerpt(peft_type),
      " adapter; only LORA adapters load");
  LoraConfig c;
  if (f.has("r")) {
    const auto& r = j.at("r");
    if (!r.is_number_integer() ||
        (r.is_number_unsigned() ? r.get<uint64_t>() == 0
                                : r.get<int64_t>() <= 0) ||
        (r.is_number_unsigned() &&
         r.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
      f.bad("r", "must be an integer > 0");
    }
    c.r(r.get<int64_t>());
  }
  c.lora_alpha(f.number("lora_alpha", c.lora_alpha()));
  c.lora_dropout(f.number("lora_dropout", c.lora_dropout()));
  TORCH_CHECK(
      f.has("target_modules"),
      "LoRA: '",
      file,
      "': field 'target_modules' is missing (a list of module names or a "
      "regular expression)");
  if (j.at("target_modules").is_string()) {
    c.target_modules_regex(f.str("target_modules", ""));
  } else {
    c.target_modules(f.names("target_modules"));
  }
  c.task_type(f.str("task_type", ""));
  c.bias(f.str("bias", c.bias()));
  c.use_rslora(f.flag("use_rslora", c.use_rslora()));
  c.fan_in_fan_out(f.flag("fan_in_fan_out", c.fan_in_fan_out()));
  c.modules_to_save(f.names("modules_to_save"));
  if (f.has("init_lora_weights")) {
    c.init_lora_weights(
        j.at("init_lora_weights").is_boolean()
            ? (f.flag("init_lora_weights", true) ? "default" : "none")
            : f.str("init_lora_weights", ""));
  }
  for (const char* unsupported : {"rank_pattern", "alpha_pattern"}) {
    if (f.has(unsupported)) {
      if (!j.at(unsupported).is_object()) {
        f.bad(unsupported, "must be an object");
      }
      TORCH_CHECK(
          j.at(unsupported).empty(),
          "LoRA: '",
          file,
          "' sets ",
          unsupported,
          ", which is not supported");
    }
  }
  TORCH_CHECK(
      !f.flag("use_dora", false),
      "LoRA: '",
      file,
      "' is a DoRA adapter (use_dora), which is not supported");
  try {
    c.validate();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "LoRA: '", file, "': ", e.msg());
  }
  return c;
}

} // namespace lora
} // namespace colossalai
