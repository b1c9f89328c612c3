#pragma once

// PEFT's string form of target_modules: `re.fullmatch(pattern, name)` on
// each module's dotted name (internal).
//
// NOTE [Module regexes]
// std::regex backtracks: `(.*.*)*c_attnX` takes minutes on one name, and it
// recurses once per group, so 30,000 nested groups overflow the stack. A
// pattern from adapter_config.json is untrusted, so it is compiled by our
// own parser (Python's `re` syntax, bounded in length, nesting and program
// size) into a program run by a Pike VM (Thompson's simulation: every
// alternative advanced together, each program position at most once per
// character): O(name x program) whatever the pattern. Supported: literals
// and escapes, `.`, classes, \d \w \s (ASCII, as module names are) and
// their negations, groups (capturing, (?:...), (?P<name>...)), |, * + ? {m,n}
// (greedy or lazy: the same for a yes/no match), ^ $ \A \Z \b \B,
// lookahead and fixed-width lookbehind (each position's answer computed
// once), flags i, m, s (global at the start, or scoped (?i:...)).
// Refused by name: backreferences, atomic groups and possessive
// quantifiers, conditionals, verbose mode.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace colossalai {
namespace lora {
namespace detail {

class ModuleRegex {
 public:
  static constexpr size_t kMaxPatternLength = 4096;
  static constexpr int kMaxNesting = 64;
  static constexpr size_t kMaxProgram = 20000;
  static constexpr int kMaxRepeat = 1000;

  /// Compiles `pattern`; throws std::invalid_argument saying what is wrong
  /// and at which character (NOTE [Module regexes]).
  explicit ModuleRegex(const std::string& pattern);

  /// Whether the whole of `name` matches (Python's re.fullmatch).
  bool fullmatch(const std::string& name) const;

  enum class Op : uint8_t {
    kChar,
    kAny,
    kClass,
    kSplit,
    kJump,
    kMatch,
    kAssert,
    kLook
  };
  enum class Assert : uint8_t {
    kLineStart, // ^ under (?m)
    kLineEnd, //   $ under (?m)
    kTextStart, // ^, \A
    kTextEnd, //   \Z
    kEndOrFinalNewline, // $
    kWordBoundary,
    kNotWordBoundary
  };
  struct Inst {
    Op op;
    bool flag = false; // kChar: ignore case; kAny: dot-all
    Assert assert_kind = Assert::kTextStart;
    uint32_t c = 0; // kChar
    int32_t x = 0, y = 0; // kSplit / kJump targets; kClass, kLook: index
  };
  struct Class {
    std::vector<std::pair<uint32_t, uint32_t>> ranges;
    std::string shorthands; // "dwsDWS" members
    bool negate = false;
    bool fold = false;
    bool contains(uint32_t c) const;
  };
  struct Look {
    int32_t start; // its program, ending in its own kMatch
    bool behind, negate;
    size_t width; // behind: the fixed width it matches
  };

 private:
  friend class Compiler;
  bool run(
      int32_t start,
      const std::vector<uint32_t>& text,
      size_t from,
      size_t end,
      bool any_end,
      std::vector<std::vector<int8_t>>& memo) const;

  std::vector<Inst> prog_;
  std::vector<Class> classes_;
  std::vector<Look> looks_;
  int32_t start_ = 0;
};

} // namespace detail
} // namespace lora
} // namespace colossalai
