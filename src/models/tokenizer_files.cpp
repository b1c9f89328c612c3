// The tokenizer's file reading and writing, and typed access to the fields
// of its JSON files; errors name the file and the field
// (src/models/tokenizer_internal.h).

#include "tokenizer_internal.h"

#include "../utils/bounded_read.h"

#include <fstream>
#include <stdexcept>

namespace colossalai {
namespace models {
namespace tokenizer_detail {

[[noreturn]] void fail(const fs::path& file, const std::string& what) {
  throw std::runtime_error("Tokenizer: " + file.string() + ": " + what);
}

std::string read_text(const fs::path& file, uint64_t max_bytes) {
  std::string text;
  const auto why = utils::read_regular_file(file.string(), max_bytes, text);
  if (!why.empty()) {
    fail(file, why);
  }
  return text;
}

json read_json(const fs::path& file, uint64_t max_bytes) {
  const auto text = read_text(file, max_bytes);
  // Before parsing: the parser copes, but copies, dumps and walks of such
  // a value recurse once per level.
  const auto deep = utils::json_depth_error(text, kMaxJsonDepth);
  if (!deep.empty()) {
    fail(file, "malformed: " + deep);
  }
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(file, std::string("malformed JSON: ") + e.what());
  }
}

void write_whole(const fs::path& file, const std::string& text) {
  auto tmp = file;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      fail(tmp, "cannot be written");
    }
  }
  std::error_code ec;
  fs::rename(tmp, file, ec);
  if (ec) {
    fs::remove(tmp, ec);
    fail(file, "cannot be written");
  }
}

std::string brief(const json& j) {
  return utils::excerpt(j.dump(-1, ' ', false, json::error_handler_t::replace));
}

namespace {
const json& null_json() {
  static const json null;
  return null;
}
} // namespace

Field Field::operator[](const std::string& key) const {
  const auto path = path_.empty() ? key : path_ + "." + key;
  if (!j_->is_object()) {
    return Field(null_json(), path, *file_);
  }
  const auto it = j_->find(key);
  return Field(it == j_->end() ? null_json() : *it, path, *file_);
}

Field Field::operator[](size_t i) const {
  const auto path = path_ + "[" + std::to_string(i) + "]";
  return Field(
      j_->is_array() && i < j_->size() ? (*j_)[i] : null_json(), path, *file_);
}

void Field::bad(const std::string& what) const {
  fail(
      *file_,
      "malformed: field '" + path_ + "' " + what + ", got " + brief(*j_));
}

std::string Field::str(const std::string& def) const {
  if (j_->is_null()) {
    return def;
  }
  if (!j_->is_string()) {
    bad("must be a string");
  }
  return j_->get<std::string>();
}

bool Field::flag(bool def) const {
  if (j_->is_null()) {
    return def;
  }
  if (!j_->is_boolean()) {
    bad("must be true or false");
  }
  return j_->get<bool>();
}

int64_t Field::integer(int64_t def, int64_t min, int64_t max) const {
  if (j_->is_null()) {
    return def;
  }
  // An unsigned value above INT64_MAX is out of range, not negative.
  if (!j_->is_number_integer() ||
      (j_->is_number_unsigned() &&
       j_->get<uint64_t>() > static_cast<uint64_t>(max)) ||
      j_->get<int64_t>() < min || j_->get<int64_t>() > max) {
    bad("must be an integer from " + std::to_string(min) + " to " +
        std::to_string(max));
  }
  return j_->get<int64_t>();
}

std::vector<Field> Field::elements() const {
  std::vector<Field> out;
  if (j_->is_null()) {
    return out;
  }
  if (!j_->is_array()) {
    bad("must be a list");
  }
  out.reserve(j_->size());
  for (size_t i = 0; i < j_->size(); ++i) {
    out.push_back((*this)[i]);
  }
  return out;
}

std::string token_content(const Field& f) {
  if (f.value().is_string()) {
    return f.str();
  }
  if (f.is_object()) {
    return f["content"].str();
  }
  if (!f.is_null()) {
    f.bad("must be a token: a string or an object with \"content\"");
  }
  return "";
}

std::vector<Field> components(const Field& f, const char* key) {
  std::vector<Field> out;
  // Nesting is bounded by kMaxJsonDepth, so is this recursion.
  if (f.is_null()) {
    return out;
  }
  if (f["type"].str() == "Sequence") {
    for (const auto& c : f[key].elements()) {
      for (auto& leaf : components(c, key)) {
        out.push_back(std::move(leaf));
      }
    }
    return out;
  }
  out.push_back(f);
  return out;
}

} // namespace tokenizer_detail
} // namespace models
} // namespace colossalai
