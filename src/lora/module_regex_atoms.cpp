// The module regex parser's atoms: escapes, character classes, assertions
// (NOTE [Module regexes] in src/lora/module_regex.h).

#include "module_regex_internal.h"

namespace colossalai {
namespace lora {
namespace detail {

// An escape's code point (\n, \x41, \0, \-, ...); letters and digits that
// are not escapes are errors, as in Python.
uint32_t Compiler::escaped_char(bool in_class) {
  const uint32_t c = p_[at_++];
  auto hex = [&](int digits) {
    uint32_t v = 0;
    for (int k = 0; k < digits; ++k) {
      const uint32_t h = lower(peek());
      if (!is_digit(h) && !(h >= 'a' && h <= 'f')) {
        bad("incomplete escape");
      }
      v = v * 16 + (is_digit(h) ? h - '0' : h - 'a' + 10);
      ++at_;
    }
    if (v > 0x10FFFF) {
      bad("bad escape");
    }
    return v;
  };
  switch (c) {
    case 'n':
      return '\n';
    case 't':
      return '\t';
    case 'r':
      return '\r';
    case 'f':
      return '\f';
    case 'v':
      return '\v';
    case 'a':
      return 7;
    case 'x':
      return hex(2);
    case 'u':
      return hex(4);
    case 'U':
      return hex(8);
    case '0': {
      uint32_t v = 0;
      for (int k = 0; k < 2 && peek() >= '0' && peek() <= '7'; ++k) {
        v = v * 8 + (p_[at_++] - '0');
      }
      return v;
    }
    default:
      break;
  }
  if (in_class && c == 'b') {
    return 8;
  }
  if (is_digit(c)) {
    bad("backreferences (\\" + std::string(1, static_cast<char>(c)) +
        ") are not supported");
  }
  if (c < 0x80 && is_word(c)) {
    bad("bad escape \\" + std::string(1, static_cast<char>(c)));
  }
  return c;
}

bool Compiler::shorthand_letter(uint32_t c) const {
  return c == 'd' || c == 'D' || c == 'w' || c == 'W' || c == 's' ||
      c == 'S';
}

int32_t Compiler::add_class(ModuleRegex::Class c) {
  re_.classes_.push_back(std::move(c));
  Node n;
  n.kind = Node::kClass;
  n.index = static_cast<int32_t>(re_.classes_.size() - 1);
  return node(std::move(n));
}

int32_t Compiler::char_class(Flags f) {
  ModuleRegex::Class cls;
  cls.fold = f.i;
  cls.negate = take('^');
  bool first = true;
  for (;; first = false) {
    if (!more()) {
      bad("unterminated character set");
    }
    if (peek() == ']' && !first) {
      ++at_;
      break;
    }
    uint32_t lo = 0;
    if (take('\\')) {
      if (!more()) {
        bad("bad escape (end of pattern)");
      }
      if (shorthand_letter(peek())) {
        cls.shorthands += static_cast<char>(p_[at_++]);
        continue;
      }
      lo = escaped_char(true);
    } else {
      lo = p_[at_++];
    }
    uint32_t hi = lo;
    if (peek() == '-' && peek(1) != ']' && at_ + 1 < p_.size()) {
      ++at_;
      if (take('\\')) {
        if (!more() || shorthand_letter(peek())) {
          bad("bad character range");
        }
        hi = escaped_char(true);
      } else {
        hi = p_[at_++];
      }
      if (hi < lo) {
        bad("bad character range");
      }
    }
    cls.ranges.emplace_back(lo, hi);
  }
  return add_class(std::move(cls));
}

int32_t Compiler::assertion(Assert kind) {
  Node n;
  n.kind = Node::kAssert;
  n.assert_kind = kind;
  return node(std::move(n));
}

int32_t Compiler::atom(int depth, Flags f) {
  const uint32_t c = p_[at_++];
  Node n;
  switch (c) {
    case '(':
      return group(depth, f);
    case '[':
      return char_class(f);
    case '.':
      n.kind = Node::kAny;
      n.flag = f.s;
      return node(std::move(n));
    case '^':
      return assertion(f.m ? Assert::kLineStart : Assert::kTextStart);
    case '$':
      return assertion(f.m ? Assert::kLineEnd : Assert::kEndOrFinalNewline);
    case '*':
    case '+':
    case '?':
      --at_;
      bad("nothing to repeat");
    case '\\': {
      if (!more()) {
        bad("bad escape (end of pattern)");
      }
      const uint32_t e = peek();
      if (shorthand_letter(e)) {
        ++at_;
        ModuleRegex::Class cls;
        cls.shorthands = std::string(1, static_cast<char>(e));
        return add_class(std::move(cls));
      }
      switch (e) {
        case 'b':
          ++at_;
          return assertion(Assert::kWordBoundary);
        case 'B':
          ++at_;
          return assertion(Assert::kNotWordBoundary);
        case 'A':
          ++at_;
          return assertion(Assert::kTextStart);
        case 'Z':
          ++at_;
          return assertion(Assert::kTextEnd);
        default:
          break;
      }
      n.c = escaped_char(false);
      break;
    }
    default:
      n.c = c;
      break;
  }
  n.kind = Node::kChar;
  n.flag = f.i;
  return node(std::move(n));
}

} // namespace detail
} // namespace lora
} // namespace colossalai
