// PEFT's target_modules regexes with bounded work: UTF-8 code points, the
// ASCII classes and the Pike VM that runs a compiled program; see NOTE
// [Module regexes] in src/lora/module_regex.h.

#include "module_regex_internal.h"

namespace colossalai {
namespace lora {
namespace detail {

// Code points of UTF-8 text; a byte that is not UTF-8 becomes one past
// Unicode (0x110000 + byte), matching only itself and classes that negate.
std::vector<uint32_t> code_points(const std::string& s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    size_t need = b < 0x80 ? 0
        : (b & 0xE0) == 0xC0 ? 1
        : (b & 0xF0) == 0xE0 ? 2
        : (b & 0xF8) == 0xF0 ? 3
                             : 4;
    uint32_t v = need == 0 ? b : b & (0x3F >> need);
    bool ok = need < 4 && i + need < s.size();
    for (size_t k = 1; ok && k <= need; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      ok = (c & 0xC0) == 0x80;
      v = (v << 6) | (c & 0x3F);
    }
    if (!ok) {
      out.push_back(0x110000u + b);
      ++i;
    } else {
      out.push_back(v);
      i += need + 1;
    }
  }
  return out;
}

uint32_t lower(uint32_t c) {
  return c >= 'A' && c <= 'Z' ? c + 32 : c;
}
bool is_digit(uint32_t c) {
  return c >= '0' && c <= '9';
}
bool is_word(uint32_t c) {
  return is_digit(c) || (lower(c) >= 'a' && lower(c) <= 'z') || c == '_';
}

namespace {

uint32_t upper(uint32_t c) {
  return c >= 'a' && c <= 'z' ? c - 32 : c;
}
bool is_space(uint32_t c) {
  return c == ' ' || (c >= '\t' && c <= '\r');
}

bool shorthand(char kind, uint32_t c) {
  switch (kind) {
    case 'd':
      return is_digit(c);
    case 'D':
      return !is_digit(c);
    case 'w':
      return is_word(c);
    case 'W':
      return !is_word(c);
    case 's':
      return is_space(c);
    default: // 'S'
      return !is_space(c);
  }
}

} // namespace

ModuleRegex::ModuleRegex(const std::string& pattern) {
  if (pattern.size() > kMaxPatternLength) {
    throw std::invalid_argument(
        "it is " + std::to_string(pattern.size()) +
        " characters long, more than " + std::to_string(kMaxPatternLength));
  }
  Compiler(pattern, *this).compile();
}

bool ModuleRegex::Class::contains(uint32_t c) const {
  auto test = [&](uint32_t ch) {
    for (const auto& r : ranges) {
      if (ch >= r.first && ch <= r.second) {
        return true;
      }
    }
    for (const char s : shorthands) {
      if (shorthand(s, ch)) {
        return true;
      }
    }
    return false;
  };
  const bool in = test(c) || (fold && (test(lower(c)) || test(upper(c))));
  return in != negate;
}

bool ModuleRegex::fullmatch(const std::string& name) const {
  const auto text = code_points(name);
  std::vector<std::vector<int8_t>> memo(looks_.size());
  return run(start_, text, 0, text.size(), false, memo);
}

// Thompson's simulation from `from`: true when the program reaches its
// match at `end` (any_end: at any position). Every thread is a program
// position, kept once per text position, so the work is O((end - from) x
// program) plus the lookarounds, each evaluated once per position (memo).
bool ModuleRegex::run(
    int32_t start,
    const std::vector<uint32_t>& text,
    size_t from,
    size_t end,
    bool any_end,
    std::vector<std::vector<int8_t>>& memo) const {
  const size_t n = text.size();
  std::vector<size_t> seen(prog_.size(), static_cast<size_t>(-1));
  std::vector<int32_t> now, next, stack;
  bool matched = false;
  auto word_at = [&](size_t k) { return k < n && is_word(text[k]); };
  auto holds = [&](Assert a, size_t pos) {
    switch (a) {
      case Assert::kTextStart:
        return pos == 0;
      case Assert::kTextEnd:
        return pos == n;
      case Assert::kLineStart:
        return pos == 0 || text[pos - 1] == '\n';
      case Assert::kLineEnd:
        return pos == n || text[pos] == '\n';
      case Assert::kEndOrFinalNewline:
        return pos == n || (pos + 1 == n && text[pos] == '\n');
      case Assert::kWordBoundary:
        return (pos > 0 && word_at(pos - 1)) != word_at(pos);
      case Assert::kNotWordBoundary: // never on empty text, as in Python
        return n > 0 && (pos > 0 && word_at(pos - 1)) == word_at(pos);
    }
    return false;
  };
  auto look = [&](int32_t index, size_t pos) {
    auto& m = memo[index];
    if (m.empty()) {
      m.assign(n + 1, -1);
    }
    if (m[pos] < 0) {
      const Look& l = looks_[index];
      const bool found = l.behind
          ? pos >= l.width && run(l.start, text, pos - l.width, pos, false, memo)
          : run(l.start, text, pos, n, true, memo);
      m[pos] = found != l.negate ? 1 : 0;
    }
    return m[pos] == 1;
  };
  // Follows the steps that consume nothing from `pc` at `pos`; the ones
  // that consume a character go to `list`.
  auto add = [&](int32_t pc0, size_t pos, std::vector<int32_t>& list) {
    stack.push_back(pc0);
    while (!stack.empty()) {
      const int32_t pc = stack.back();
      stack.pop_back();
      if (seen[pc] == pos) {
        continue;
      }
      seen[pc] = pos;
      const Inst& i = prog_[pc];
      switch (i.op) {
        case Op::kJump:
          stack.push_back(i.x);
          break;
        case Op::kSplit:
          stack.push_back(i.y);
          stack.push_back(i.x);
          break;
        case Op::kAssert:
          if (holds(i.assert_kind, pos)) {
            stack.push_back(pc + 1);
          }
          break;
        case Op::kLook:
          if (look(i.x, pos)) {
            stack.push_back(pc + 1);
          }
          break;
        case Op::kMatch:
          matched = matched || any_end || pos == end;
          break;
        default:
          list.push_back(pc);
          break;
      }
    }
  };
  add(start, from, now);
  for (size_t pos = from; pos < end && !now.empty() && !matched; ++pos) {
    next.clear();
    const uint32_t c = text[pos];
    for (const int32_t pc : now) {
      const Inst& i = prog_[pc];
      const bool step = i.op == Op::kChar
          ? (i.flag ? lower(c) == i.c : c == i.c)
          : i.op == Op::kAny ? (i.flag || c != '\n')
                             : classes_[i.x].contains(c);
      if (step) {
        add(pc + 1, pos + 1, next);
      }
    }
    now.swap(next);
  }
  return matched;
}
} // namespace detail
} // namespace lora
} // namespace colossalai
