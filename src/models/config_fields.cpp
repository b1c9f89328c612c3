#include "models/config_fields.h"

#include "utils/bounded_json.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace colossalai {
namespace models {
namespace detail {

using json = nlohmann::json;
using utils::json_excerpt;

ConfigFields::ConfigFields(const std::string& text)
    : root_(std::make_shared<const json>(
          utils::parse_bounded_json<json>(text, "config.json"))),
      fields_(root_.get()) {
  TORCH_CHECK(
      fields_->is_object(),
      "config.json: must be a JSON object, got ",
      json_excerpt(*fields_));
}

ConfigFields::ConfigFields(
    std::shared_ptr<const json> root,
    const json* fields,
    std::string prefix)
    : root_(std::move(root)), fields_(fields), prefix_(std::move(prefix)) {}

const json* ConfigFields::find(const char* key) const {
  const auto it = fields_->find(key);
  return it == fields_->end() || it->is_null() ? nullptr : &*it;
}

bool ConfigFields::has(const char* key) const {
  return find(key) != nullptr;
}

bool ConfigFields::is_null(const char* key) const {
  const auto it = fields_->find(key);
  return it != fields_->end() && it->is_null();
}

std::string ConfigFields::name(const char* key) const {
  return prefix_ + key;
}

void ConfigFields::fail(const char* key, const std::string& what) const {
  TORCH_CHECK(false, "config.json: field '", name(key), "' ", what);
}

void ConfigFields::wrong(const char* key, const std::string& expected) const {
  fail(key, "must be " + expected + ", got " + json_excerpt(*find(key)));
}

ConfigFields ConfigFields::object(const char* key) const {
  static const json kEmpty = json::object();
  const json* v = find(key);
  if (v == nullptr) {
    return ConfigFields(root_, &kEmpty, name(key) + ".");
  }
  if (!v->is_object()) {
    wrong(key, "an object");
  }
  return ConfigFields(root_, v, name(key) + ".");
}

int64_t ConfigFields::integer(
    const char* key,
    int64_t fallback,
    int64_t lo,
    int64_t hi) const {
  const json* v = find(key);
  if (v == nullptr) {
    return fallback;
  }
  const std::string expected = lo == 1 && hi == kMaxConfigSize
      ? "a positive integer"
      : lo == 0 && hi == kMaxConfigSize ? "a non-negative integer"
                                        : "an integer in [" +
          std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (!v->is_number_integer()) {
    wrong(key, expected);
  }
  // An unsigned value above int64's range is above any `hi`.
  const bool huge = v->is_number_unsigned() &&
      v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
  if (huge || v->get<int64_t>() > hi) {
    fail(
        key,
        "must be at most " + std::to_string(hi) + ", got " + json_excerpt(*v));
  }
  if (v->get<int64_t>() < lo) {
    wrong(key, expected);
  }
  return v->get<int64_t>();
}

std::vector<int64_t> ConfigFields::integers(
    const char* key,
    int64_t lo,
    int64_t hi) const {
  const json* v = find(key);
  std::vector<int64_t> out;
  if (v == nullptr) {
    return out;
  }
  const std::string expected = "a list of integers in [" + std::to_string(lo) +
      ", " + std::to_string(hi) + "]";
  if (!v->is_array()) {
    wrong(key, expected);
  }
  for (const auto& item : *v) {
    if (!item.is_number_integer() ||
        (item.is_number_unsigned() &&
         item.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) ||
        item.get<int64_t>() < lo || item.get<int64_t>() > hi) {
      wrong(key, expected);
    }
    out.push_back(item.get<int64_t>());
  }
  return out;
}

int64_t ConfigFields::size(const char* key, int64_t fallback) const {
  return integer(key, fallback, 1, kMaxConfigSize);
}

int64_t ConfigFields::count(const char* key, int64_t fallback) const {
  return integer(key, fallback, 0, kMaxConfigSize);
}

double ConfigFields::number(
    const char* key,
    double fallback,
    bool (*valid)(double),
    const char* expected) const {
  const json* v = find(key);
  if (v == nullptr) {
    return fallback;
  }
  if (!v->is_number() || !valid(v->get<double>())) {
    wrong(key, expected);
  }
  return v->get<double>();
}

double ConfigFields::positive(const char* key, double fallback) const {
  return number(
      key,
      fallback,
      [](double x) { return std::isfinite(x) && x > 0; },
      "a finite number above 0");
}

double ConfigFields::non_negative(const char* key, double fallback) const {
  return number(
      key,
      fallback,
      [](double x) { return std::isfinite(x) && x >= 0; },
      "a finite number of at least 0");
}

double ConfigFields::probability(const char* key, double fallback) const {
  return number(
      key,
      fallback,
      [](double x) { return x >= 0 && x <= 1; },
      "a number in [0, 1]");
}

bool ConfigFields::boolean(const char* key, bool fallback) const {
  const json* v = find(key);
  if (v == nullptr) {
    return fallback;
  }
  if (!v->is_boolean()) {
    wrong(key, "true or false");
  }
  return v->get<bool>();
}

std::string ConfigFields::string(const char* key, const std::string& fallback)
    const {
  const json* v = find(key);
  if (v == nullptr) {
    return fallback;
  }
  if (!v->is_string()) {
    wrong(key, "a string");
  }
  return v->get<std::string>();
}

std::string ConfigFields::one_of(
    const char* key,
    const std::string& fallback,
    std::initializer_list<const char*> allowed,
    const char* who) const {
  const auto value = string(key, fallback);
  std::string names;
  for (const char* a : allowed) {
    if (value == a) {
      return value;
    }
    names += (names.empty() ? "" : ", ") + std::string(a);
  }
  fail(
      key,
      "is " + json_excerpt(json(value)) + ", which " + who +
          " does not compute (only " + names + ")");
}

void ConfigFields::require(
    const char* key,
    const json& expected,
    const char* who) const {
  const json* v = find(key);
  // Numbers compare by value (0 == 0.0), as Python's == does.
  const bool same = v == nullptr ||
      (v->is_number() && expected.is_number()
           ? v->get<double>() == expected.get<double>()
           : *v == expected);
  if (!same) {
    fail(
        key,
        "= " + json_excerpt(*v) + " is not supported by " + who + " (only " +
            expected.dump() + ")");
  }
}

int64_t token_id_or_none(
    const ConfigFields& f,
    const char* key,
    int64_t fallback,
    int64_t vocab_size) {
  if (f.is_null(key)) {
    return -1;
  }
  if (!f.has(key)) {
    return fallback;
  }
  const auto id = f.count(key, fallback);
  if (id >= vocab_size) {
    f.fail(
        key,
        "(" + std::to_string(id) + ") must be below field 'vocab_size' (" +
            std::to_string(vocab_size) + ")");
  }
  return id;
}

void check_divisible(
    const ConfigFields& f,
    const char* a_key,
    int64_t a,
    const char* b_key,
    int64_t b) {
  if (b <= 0 || a % b != 0) {
    f.fail(
        a_key,
        "(" + std::to_string(a) + ") must be divisible by field '" +
            f.name(b_key) + "' (" + std::to_string(b) + ")");
  }
}

} // namespace detail
} // namespace models
} // namespace colossalai
