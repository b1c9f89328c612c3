// PEFT's target_modules regexes with bounded work; see NOTE [Module
// regexes] in src/lora/module_regex.h.

#include "module_regex.h"

#include <stdexcept>

namespace colossalai {
namespace lora {
namespace detail {
namespace {

using Assert = ModuleRegex::Assert;

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
uint32_t upper(uint32_t c) {
  return c >= 'a' && c <= 'z' ? c - 32 : c;
}
bool is_digit(uint32_t c) {
  return c >= '0' && c <= '9';
}
bool is_word(uint32_t c) {
  return is_digit(c) || (lower(c) >= 'a' && lower(c) <= 'z') || c == '_';
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

// Pattern -> syntax tree -> program. The recursion of both follows the
// group nesting, which the parser bounds (kMaxNesting).
class Compiler {
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

  void compile() {
    Flags flags;
    global_flags(flags);
    const int32_t root = alt(0, flags);
    if (at_ < p_.size()) {
      bad("unbalanced parenthesis");
    }
    re_.start_ = emit_node(root);
    emit({ModuleRegex::Op::kMatch});
    // Lookaround programs after the main one, each ending in its own match
    // (all were parsed, nested ones included, before this).
    for (size_t k = 0; k < pending_.size(); ++k) {
      re_.looks_[k].start = static_cast<int32_t>(re_.prog_.size());
      emit_node(pending_[k]);
      emit({ModuleRegex::Op::kMatch});
    }
  }

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

  // Python's flags: i, m, s apply; a and u are the defaults here (ASCII
  // classes, Unicode text); x and L are refused.
  bool flag_letters(Flags& f, bool on) {
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
  void global_flags(Flags& f) {
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

  int32_t alt(int depth, Flags f) {
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

  int32_t concat(int depth, Flags f) {
    Node n;
    n.kind = Node::kConcat;
    while (more() && peek() != '|' && peek() != ')') {
      n.kids.push_back(repeat(depth, f));
    }
    return node(std::move(n));
  }

  // {m}, {m,}, {,n}, {m,n} at the cursor: whether it is one (else '{' is a
  // literal, as in Python).
  bool quantifier_brace() const {
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

  int count() {
    long v = -1;
    while (more() && is_digit(peek())) {
      v = (v < 0 ? 0 : v) * 10 + static_cast<long>(p_[at_++] - '0');
      if (v > ModuleRegex::kMaxRepeat) {
        bad("a repeat count above " + std::to_string(ModuleRegex::kMaxRepeat));
      }
    }
    return static_cast<int>(v);
  }

  bool quantifier(int& min, int& max) {
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

  int32_t repeat(int depth, Flags f) {
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

  int32_t group(int depth, Flags f) {
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

  // An escape's code point (\n, \x41, \0, \-, ...); letters and digits that
  // are not escapes are errors, as in Python.
  uint32_t escaped_char(bool in_class) {
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

  bool shorthand_letter(uint32_t c) const {
    return c == 'd' || c == 'D' || c == 'w' || c == 'W' || c == 's' ||
        c == 'S';
  }

  int32_t add_class(ModuleRegex::Class c) {
    re_.classes_.push_back(std::move(c));
    Node n;
    n.kind = Node::kClass;
    n.index = static_cast<int32_t>(re_.classes_.size() - 1);
    return node(std::move(n));
  }

  int32_t char_class(Flags f) {
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

  int32_t assertion(Assert kind) {
    Node n;
    n.kind = Node::kAssert;
    n.assert_kind = kind;
    return node(std::move(n));
  }

  int32_t atom(int depth, Flags f) {
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

  // The number of characters `id` always matches, -1 if that varies.
  long fixed_width(int32_t id) const {
    const Node& n = nodes_[id];
    switch (n.kind) {
      case Node::kChar:
      case Node::kAny:
      case Node::kClass:
        return 1;
      case Node::kEmpty:
      case Node::kAssert:
        return 0;
      case Node::kConcat: {
        long sum = 0;
        for (const int32_t k : n.kids) {
          const long w = fixed_width(k);
          if (w < 0) {
            return -1;
          }
          sum += w;
        }
        return sum;
      }
      case Node::kAlt: {
        const long w = fixed_width(n.kids[0]);
        for (size_t k = 1; k < n.kids.size(); ++k) {
          if (fixed_width(n.kids[k]) != w) {
            return -1;
          }
        }
        return w;
      }
      case Node::kRepeat: {
        const long w = fixed_width(n.kids[0]);
        return w == 0 ? 0 : (w < 0 || n.min != n.max) ? -1 : w * n.min;
      }
    }
    return -1;
  }

  int32_t emit(ModuleRegex::Inst inst) {
    if (re_.prog_.size() >= ModuleRegex::kMaxProgram) {
      throw std::invalid_argument(
          "compiles to more than " +
          std::to_string(ModuleRegex::kMaxProgram) +
          " steps (repeat counts multiply their group)");
    }
    re_.prog_.push_back(inst);
    return static_cast<int32_t>(re_.prog_.size() - 1);
  }

  int32_t here() const {
    return static_cast<int32_t>(re_.prog_.size());
  }

  // Emits `id`'s code; returns where it starts.
  int32_t emit_node(int32_t id) {
    using Op = ModuleRegex::Op;
    const int32_t start = here();
    const Node& n = nodes_[id];
    switch (n.kind) {
      case Node::kEmpty:
        break;
      case Node::kChar: {
        ModuleRegex::Inst i{Op::kChar};
        i.c = n.flag ? lower(n.c) : n.c;
        i.flag = n.flag;
        emit(i);
        break;
      }
      case Node::kAny: {
        ModuleRegex::Inst i{Op::kAny};
        i.flag = n.flag;
        emit(i);
        break;
      }
      case Node::kClass: {
        ModuleRegex::Inst i{Op::kClass};
        i.x = n.index;
        emit(i);
        break;
      }
      case Node::kAssert: {
        ModuleRegex::Inst i{n.index >= 0 ? Op::kLook : Op::kAssert};
        i.assert_kind = n.assert_kind;
        i.x = n.index;
        emit(i);
        break;
      }
      case Node::kConcat:
        for (const int32_t k : n.kids) {
          emit_node(k);
        }
        break;
      case Node::kAlt: {
        // split L1, next; L1: a; jump end; next: split L2, next2; ... last.
        const auto& kids = n.kids;
        std::vector<int32_t> jumps;
        for (size_t k = 0; k + 1 < kids.size(); ++k) {
          const int32_t split = emit({Op::kSplit});
          re_.prog_[split].x = here();
          emit_node(kids[k]);
          jumps.push_back(emit({Op::kJump}));
          re_.prog_[split].y = here();
        }
        emit_node(kids.back());
        for (const int32_t j : jumps) {
          re_.prog_[j].x = here();
        }
        break;
      }
      case Node::kRepeat: {
        const int32_t kid = n.kids[0];
        const int min = n.min, max = n.max;
        for (int k = 0; k < min; ++k) {
          emit_node(kid);
        }
        if (max < 0) {
          const int32_t split = emit({Op::kSplit});
          re_.prog_[split].x = here();
          emit_node(kid);
          ModuleRegex::Inst back{Op::kJump};
          back.x = split;
          emit(back);
          re_.prog_[split].y = here();
        } else {
          std::vector<int32_t> splits;
          for (int k = min; k < max; ++k) {
            const int32_t split = emit({Op::kSplit});
            re_.prog_[split].x = here();
            splits.push_back(split);
            emit_node(kid);
          }
          for (const int32_t s : splits) {
            re_.prog_[s].y = here();
          }
        }
        break;
      }
    }
    return start;
  }

  std::vector<uint32_t> p_;
  size_t at_ = 0;
  ModuleRegex& re_;
  std::vector<Node> nodes_;
  std::vector<int32_t> pending_; // lookaround bodies to emit
};

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
