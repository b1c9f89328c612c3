// The module regex parser's structure: flags, alternation, repetition and
// groups (NOTE [Module regexes] in src/lora/module_regex.h).

#include "module_regex_internal.h"

namespace colossalai {
namespace lora {
namespace detail {

// Python's flags: i, m, s apply; a and u are the defaults here (ASCII
// classes, Unicode text); x and L are refused.
bool Compiler::flag_letters(Flags& f, bool on) {
  bool any = false;
  for (; more(); ++at_) {
    switch (peek()) {
      case 'i':
        f.i = on;
        break;
      case 'm':
        f.m = on;
        break;
      case 's':
        f.s = on;
        break;
      case 'a':
      case 'u':
        break;
      case 'x':
        bad("verbose mode (?x) is not supported");
      case 'L':
        bad("the locale flag (?L) is not supported");
      default:
        return any;
    }
    any = true;
  }
  return any;
}

// (?flags) groups at the start.
void Compiler::global_flags(Flags& f) {
  for (;;) {
    const size_t mark = at_;
    Flags g = f;
    if (!(take('(') && take('?') && flag_letters(g, true) && take(')'))) {
      at_ = mark;
      return;
    }
    f = g;
  }
}

int32_t Compiler::alt(int depth, Flags f) {
  std::vector<int32_t> kids{concat(depth, f)};
  while (take('|')) {
    kids.push_back(concat(depth, f));
  }
  if (kids.size() == 1) {
    return kids[0];
  }
  Node n;
  n.kind = Node::kAlt;
  n.kids = std::move(kids);
  return node(std::move(n));
}

int32_t Compiler::concat(int depth, Flags f) {
  Node n;
  n.kind = Node::kConcat;
  while (more() && peek() != '|' && peek() != ')') {
    n.kids.push_back(repeat(depth, f));
  }
  return node(std::move(n));
}

// {m}, {m,}, {,n}, {m,n} at the cursor: whether it is one (else '{' is a
// literal, as in Python).
bool Compiler::quantifier_brace() const {
  size_t k = at_ + 1;
  bool digits = false, comma = false;
  for (; k < p_.size() && p_[k] != '}'; ++k) {
    if (p_[k] == ',' && !comma) {
      comma = true;
    } else if (is_digit(p_[k])) {
      digits = true;
    } else {
      return false;
    }
  }
  return k < p_.size() && (digits || comma);
}

int Compiler::count() {
  long v = -1;
  while (more() && is_digit(peek())) {
    v = (v < 0 ? 0 : v) * 10 + static_cast<long>(p_[at_++] - '0');
    if (v > ModuleRegex::kMaxRepeat) {
      bad("a repeat count above " + std::to_string(ModuleRegex::kMaxRepeat));
    }
  }
  return static_cast<int>(v);
}

bool Compiler::quantifier(int& min, int& max) {
  if (take('*')) {
    min = 0, max = -1;
  } else if (take('+')) {
    min = 1, max = -1;
  } else if (take('?')) {
    min = 0, max = 1;
  } else if (peek() == '{' && quantifier_brace()) {
    ++at_;
    min = count();
    max = min;
    if (take(',')) {
      max = count(); // -1: none, unbounded
    }
    min = min < 0 ? 0 : min;
    take('}');
    if (max >= 0 && min > max) {
      bad("min repeat greater than max repeat");
    }
  } else {
    return false;
  }
  return true;
}

int32_t Compiler::repeat(int depth, Flags f) {
  const int32_t a = atom(depth, f);
  int min = 0, max = 0;
  if (!quantifier(min, max)) {
    return a;
  }
  if (nodes_[a].kind == Node::kAssert || nodes_[a].kind == Node::kEmpty) {
    bad("nothing to repeat");
  }
  take('?'); // lazy: the same yes / no
  if (peek() == '+') {
    bad("possessive quantifiers are not supported");
  }
  int m2 = 0, x2 = 0;
  if (quantifier(m2, x2)) {
    bad("multiple repeat");
  }
  Node n;
  n.kind = Node::kRepeat;
  n.kids = {a};
  n.min = min;
  n.max = max;
  return node(std::move(n));
}

int32_t Compiler::group(int depth, Flags f) {
  if (depth + 1 > ModuleRegex::kMaxNesting) {
    bad("groups nested more than " +
        std::to_string(ModuleRegex::kMaxNesting) + " deep");
  }
  auto close = [&](int32_t inner) {
    if (!take(')')) {
      bad("missing ), unterminated subpattern");
    }
    return inner;
  };
  if (!take('?')) {
    return close(alt(depth + 1, f));
  }
  if (take(':')) {
    return close(alt(depth + 1, f));
  }
  if (take('P')) {
    if (take('=')) {
      bad("backreferences (?P=name) are not supported");
    }
    if (!take('<')) {
      bad("unknown extension ?P");
    }
    while (more() && (is_word(peek()) || peek() > 0x7F)) {
      ++at_;
    }
    if (!take('>')) {
      bad("bad group name");
    }
    return close(alt(depth + 1, f));
  }
  if (take('#')) {
    while (more() && peek() != ')') {
      ++at_;
    }
    return close(node(Node{}));
  }
  if (peek() == '=' || peek() == '!' ||
      (peek() == '<' && (peek(1) == '=' || peek(1) == '!'))) {
    const bool behind = take('<');
    const bool negate = peek() == '!';
    ++at_;
    const int32_t inner = close(alt(depth + 1, f));
    size_t width = 0;
    if (behind) {
      const long w = fixed_width(inner);
      if (w < 0) {
        bad("look-behind requires fixed-width pattern");
      }
      width = static_cast<size_t>(w);
    }
    re_.looks_.push_back({0, behind, negate, width});
    pending_.push_back(inner);
    Node n;
    n.kind = Node::kAssert;
    n.index = static_cast<int32_t>(re_.looks_.size() - 1);
    return node(std::move(n));
  }
  if (peek() == '>') {
    bad("atomic groups (?>...) are not supported");
  }
  if (peek() == '(') {
    bad("conditional groups (?(...)...) are not supported");
  }
  // Scoped flags (?i:...), (?-i:...), (?i-s:...).
  Flags scoped = f;
  const bool on = flag_letters(scoped, true);
  bool off = false;
  if (take('-')) {
    off = flag_letters(scoped, false);
    if (!off) {
      bad("missing flag");
    }
  }
  if ((on || off) && take(':')) {
    return close(alt(depth + 1, scoped));
  }
  if (on && peek() == ')') {
    bad("global flags not at the start of the expression");
  }
  bad("unknown extension (?" +
      (more() ? std::string(1, static_cast<char>(peek())) : std::string()) +
      "...)");
}

} // namespace detail
} // namespace lora
} // namespace colossalai
