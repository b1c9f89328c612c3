#pragma once

// config.json's fields read with their types and ranges checked before
// anything uses them (internal). Every error names the file and the field:
// `config.json: field 'n_head' must be a positive integer, got 0`; a value
// is quoted short (utils::json_excerpt), never dumped whole.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace models {
namespace detail {

/// Largest size a config field may give (a width, a count of heads, layers,
/// positions or tokens): far above any real model, it keeps products of two
/// sizes far from overflowing int64.
constexpr int64_t kMaxConfigSize = (int64_t(1) << 31) - 1;

/// The fields of a config.json, or of one object inside it ("rope_scaling"):
/// a field absent or null takes the given fallback, one present must have
/// the type and range asked for.
class ConfigFields {
 public:
  /// Parses `text` (nesting bounded, see utils::parse_bounded_json); it must
  /// be a JSON object.
  explicit ConfigFields(const std::string& text);

  /// The object `key` (its fields are named "key.field"); an empty one when
  /// absent or null, an error when it is not an object.
  ConfigFields object(const char* key) const;

  /// Whether `key` is present and not null.
  bool has(const char* key) const;
  /// Whether `key` is present and null (transformers' None).
  bool is_null(const char* key) const;

  /// An integer in [lo, hi]: a float (2.5, or even 2.0) is refused, as
  /// transformers' layers would refuse it.
  int64_t integer(const char* key, int64_t fallback, int64_t lo, int64_t hi)
      const;
  /// A list of integers each in [lo, hi] (Qwen-MoE's mlp_only_layers);
  /// empty when absent or null.
  std::vector<int64_t> integers(const char* key, int64_t lo, int64_t hi)
      const;
  /// An integer in [1, kMaxConfigSize].
  int64_t size(const char* key, int64_t fallback) const;
  /// An integer in [0, kMaxConfigSize].
  int64_t count(const char* key, int64_t fallback) const;
  /// A finite number above 0 (an epsilon, a rotary base, a scaling factor).
  double positive(const char* key, double fallback) const;
  /// A finite number >= 0 (a standard deviation).
  double non_negative(const char* key, double fallback) const;
  /// A number in [0, 1] (a dropout probability).
  double probability(const char* key, double fallback) const;
  bool boolean(const char* key, bool fallback) const;
  std::string string(const char* key, const std::string& fallback) const;
  /// A string among `allowed`; otherwise the error says `who` computes only
  /// those.
  std::string one_of(
      const char* key,
      const std::string& fallback,
      std::initializer_list<const char*> allowed,
      const char* who) const;

  /// A field that changes the computation in a way this library does not
  /// implement: refused (naming `who`) unless absent, null or `expected`.
  void require(const char* key, const nlohmann::json& expected, const char* who)
      const;

  /// "rope_scaling.factor" for key "factor" of object "rope_scaling".
  std::string name(const char* key) const;
  /// Throws `config.json: field '<name(key)>' <what>`.
  [[noreturn]] void fail(const char* key, const std::string& what) const;

 private:
  ConfigFields(
      std::shared_ptr<const nlohmann::json> root,
      const nlohmann::json* fields,
      std::string prefix);
  const nlohmann::json* find(const char* key) const;
  /// A number for which `valid` holds (`expected` says which, for the
  /// error).
  double number(
      const char* key,
      double fallback,
      bool (*valid)(double),
      const char* expected) const;
  [[noreturn]] void wrong(const char* key, const std::string& expected) const;

  std::shared_ptr<const nlohmann::json> root_; // keeps `fields_` alive
  const nlohmann::json* fields_;
  std::string prefix_;
};

/// A token id in [0, vocab_size); -1 when null (transformers' None: no such
/// token).
int64_t token_id_or_none(
    const ConfigFields& f,
    const char* key,
    int64_t fallback,
    int64_t vocab_size);

/// Refuses `a` not divisible by `b` (both fields of `f`), naming both.
void check_divisible(
    const ConfigFields& f,
    const char* a_key,
    int64_t a,
    const char* b_key,
    int64_t b);

} // namespace detail
} // namespace models
} // namespace colossalai
