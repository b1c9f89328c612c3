#pragma once

// JSON from users' files (config.json, checkpoint indexes), parsed and
// quoted with bounded work (internal).
//
// nlohmann's parser is iterative, but copying, comparing and dumping a value
// recurse once per level: ~1e5 nested arrays in one field overflow the stack
// in whatever later touches them. Parses here refuse nesting deeper than a
// real file has, and messages quote a value through json_excerpt, never a
// whole dump.

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <string>

namespace colossalai {
namespace utils {

/// Deepest nesting accepted (a Hugging Face config nests 3 or 4 levels).
constexpr int kMaxJsonDepth = 64;

/// `text` parsed; throws c10::Error naming `file` when it is not JSON or
/// nests deeper than `max_depth`.
template <class Json = nlohmann::json>
Json parse_bounded_json(
    const std::string& text,
    const std::string& file,
    int max_depth = kMaxJsonDepth) {
  auto bound = [&](int depth, typename Json::parse_event_t, Json&) {
    TORCH_CHECK(
        depth <= max_depth,
        file,
        ": JSON nested deeper than ",
        max_depth,
        " levels");
    return true;
  };
  try {
    return Json::parse(text, bound);
  } catch (const typename Json::exception& e) {
    TORCH_CHECK(false, file, " is not valid JSON: ", e.what());
  }
}

/// A short quote of `value` for a message: scalars as JSON (a string cut to
/// 40 characters), containers by their size only; never recursive.
template <class Json>
std::string json_excerpt(const Json& value) {
  if (value.is_array() || value.is_object()) {
    return std::string(value.is_array() ? "an array" : "an object") + " of " +
        std::to_string(value.size()) +
        (value.size() == 1 ? " entry" : " entries");
  }
  if (value.is_string()) {
    const auto& s = value.template get_ref<const std::string&>();
    // The cut may split a UTF-8 sequence: dumped with a replacement.
    return Json(s.substr(0, 40))
               .dump(-1, ' ', false, Json::error_handler_t::replace) +
        (s.size() > 40 ? "..." : "");
  }
  return value.dump();
}

} // namespace utils
} // namespace colossalai
