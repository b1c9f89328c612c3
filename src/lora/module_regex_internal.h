#pragma once

// What the module regex's files share (src/lora/module_regex*.cpp): ASCII
// character tests, UTF-8 code points, and the compiler from a pattern to a
// program (internal). See NOTE [Module regexes] in module_regex.h.

#include "module_regex.h"

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace colossalai {
namespace lora {
namespace detail {

/// Code points of UTF-8 text; a byte that is not UTF-8 becomes one past
/// Unicode (0x110000 + byte), matching only itself and classes that negate.
std::vector<uint32_t> code_points(const std::string& s);

/// ASCII lower case ('A'..'Z' -> 'a'..'z'; anything else as it is).
uint32_t lower(uint32_t c);
/// '0'..'9'.
bool is_digit(uint32_t c);
/// An ASCII word character (\w): letter, digit or '_'.
bool is_word(uint32_t c);

/// Pattern -> syntax tree -> program. The recursion of both follows the
/// group nesting, which the parser bounds (kMaxNesting). The parser is in
/// module_regex_parse.cpp and module_regex_atoms.cpp, the code generation
/// in module_regex_compile.cpp.
class Compiler {
  using Assert = ModuleRegex::Assert;

  struct Node {
    enum Kind { kEmpty, kChar, kAny, kClass, kConcat, kAlt, kRepeat, kAssert };
    Kind kind = kEmpty;
    bool flag = false; // kChar: ignore case; kAny: dot-all
    uint32_t c = 0;
    Assert assert_kind = Assert::kTextStart;
    int32_t index = -1; // kClass: class; a lookaround: its look
    std::vector<int32_t> kids;
    int min = 0, max = 0; // kRepeat; max -1: unbounded
  };

  struct Flags {
    bool i = false, m = false, s = false;
  };

 public:
  Compiler(const std::string& pattern, ModuleRegex& re)
      : p_(code_points(pattern)), re_(re) {}

  /// Parses the pattern and writes its program (and its lookarounds') into
  /// the ModuleRegex; throws std::invalid_argument on a bad pattern.
  void compile();

 private:
  [[noreturn]] void bad(const std::string& what) const {
    throw std::invalid_argument(
        what + " at position " + std::to_string(at_));
  }
  bool more() const {
    return at_ < p_.size();
  }
  uint32_t peek(size_t ahead = 0) const {
    return at_ + ahead < p_.size() ? p_[at_ + ahead] : 0;
  }
  bool take(uint32_t c) {
    if (more() && p_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  int32_t node(Node n) {
    nodes_.push_back(std::move(n));
    return static_cast<int32_t>(nodes_.size() - 1);
  }

  // The parser's structure (module_regex_parse.cpp).
  /// Flag letters at the cursor into `f` (set when `on`); whether any.
  bool flag_letters(Flags& f, bool on);
  /// The (?flags) groups at the start.
  void global_flags(Flags& f);
  /// a|b|...
  int32_t alt(int depth, Flags f);
  /// A sequence up to the next | or ).
  int32_t concat(int depth, Flags f);
  /// Whether the '{' at the cursor begins a quantifier.
  bool quantifier_brace() const;
  /// A repeat count's digits (-1: none).
  int count();
  /// A quantifier at the cursor into [min, max]; whether there is one.
  bool quantifier(int& min, int& max);
  /// An atom and its quantifier.
  int32_t repeat(int depth, Flags f);
  /// What follows a '(': groups, lookarounds, scoped flags.
  int32_t group(int depth, Flags f);

  // The parser's atoms (module_regex_atoms.cpp).
  /// An escape's code point.
  uint32_t escaped_char(bool in_class);
  /// \d \D \w \W \s \S.
  bool shorthand_letter(uint32_t c) const;
  /// A class node for `c`.
  int32_t add_class(ModuleRegex::Class c);
  /// [...] after its '['.
  int32_t char_class(Flags f);
  /// An assertion node.
  int32_t assertion(Assert kind);
  /// One character, class, group, escape or assertion.
  int32_t atom(int depth, Flags f);

  // The code (module_regex_compile.cpp).
  /// The number of characters `id` always matches, -1 if that varies.
  long fixed_width(int32_t id) const;
  /// Appends `inst`; returns its position.
  int32_t emit(ModuleRegex::Inst inst);
  int32_t here() const {
    return static_cast<int32_t>(re_.prog_.size());
  }
  /// Emits `id`'s code; returns where it starts.
  int32_t emit_node(int32_t id);

  std::vector<uint32_t> p_;
  size_t at_ = 0;
  ModuleRegex& re_;
  std::vector<Node> nodes_;
  std::vector<int32_t> pending_; // lookaround bodies to emit
};

} // namespace detail
} // namespace lora
} // namespace colossalai
