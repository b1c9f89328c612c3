// The Jinja subset of chat templates (NOTE [Chat templates] in
// include/colossalai/models/chat_template.h): a lexer with transformers'
// whitespace rules, a recursive-descent parser with Jinja's precedence, and
// a tree-walking renderer over JSON values.

#include <colossalai/models/chat_template.h>
#include <colossalai/models/tokenizer.h>

#include "tokenizer_internal.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <sstream>

namespace colossalai {
namespace models {

namespace fs = std::filesystem;
// Python's dicts keep insertion order (tojson, items(), repr).
using json = nlohmann::ordered_json;

namespace chat_template_detail {

// ---- values ---------------------------------------------------------------

// A Jinja value: JSON, or undefined (a missing variable, key or attribute).
struct Value {
  json v;
  bool undefined = false;
  static Value undef() {
    Value u;
    u.undefined = true;
    return u;
  }
  static Value of(json j) {
    Value x;
    x.v = std::move(j);
    return x;
  }
};

[[noreturn]] void fail(const std::string& what) {
  throw ChatTemplateError("chat template: " + what);
}

bool truthy(const Value& x) {
  if (x.undefined || x.v.is_null()) {
    return false;
  }
  const auto& v = x.v;
  if (v.is_boolean()) {
    return v.get<bool>();
  }
  if (v.is_number_integer()) {
    return v.get<int64_t>() != 0;
  }
  if (v.is_number()) {
    return v.get<double>() != 0.0;
  }
  if (v.is_string()) {
    return !v.get_ref<const std::string&>().empty();
  }
  return !v.empty(); // arrays and objects
}

std::string py_float(double d) {
  if (std::isinf(d)) {
    return d > 0 ? "inf" : "-inf";
  }
  if (std::isnan(d)) {
    return "nan";
  }
  std::ostringstream os;
  os.precision(17);
  os << d;
  std::string s = os.str();
  // Shortest repr that reads back (Python's float repr).
  for (int p = 1; p <= 17; ++p) {
    std::ostringstream t;
    t.precision(p);
    t << d;
    if (std::stod(t.str()) == d) {
      s = t.str();
      break;
    }
  }
  if (s.find_first_of(".en") == std::string::npos) {
    s += ".0";
  }
  return s;
}

std::string repr(const json& v); // Python's repr, for lists and dicts

// Python's str() of a value, as Jinja prints it.
std::string str(const Value& x) {
  if (x.undefined) {
    return "";
  }
  const auto& v = x.v;
  if (v.is_string()) {
    return v.get<std::string>();
  }
  if (v.is_null()) {
    return "None";
  }
  if (v.is_boolean()) {
    return v.get<bool>() ? "True" : "False";
  }
  if (v.is_number_integer()) {
    return std::to_string(v.get<int64_t>());
  }
  if (v.is_number()) {
    return py_float(v.get<double>());
  }
  return repr(v);
}

std::string repr_string(const std::string& s) {
  const bool dq =
      s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else {
      out += c;
    }
  }
  return out + q;
}

std::string repr(const json& v) {
  if (v.is_string()) {
    return repr_string(v.get<std::string>());
  }
  if (v.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) {
      out += (i ? ", " : "") + repr(v[i]);
    }
    return out + "]";
  }
  if (v.is_object()) {
    std::string out = "{";
    bool first = true;
    for (const auto& kv : v.items()) {
      out +=
          (first ? "" : ", ") + repr_string(kv.key()) + ": " + repr(kv.value());
      first = false;
    }
    return out + "}";
  }
  return str(Value::of(v));
}

bool is_number(const json& v) {
  return v.is_number() || v.is_boolean(); // Python: bool is an int
}
double num(const json& v) {
  return v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>();
}
bool is_int(const json& v) {
  return v.is_number_integer() || v.is_boolean();
}
int64_t integer(const json& v) {
  return v.is_boolean() ? (v.get<bool>() ? 1 : 0) : v.get<int64_t>();
}

bool equal(const Value& a, const Value& b) {
  if (a.undefined || b.undefined) {
    return a.undefined && b.undefined;
  }
  if (is_number(a.v) && is_number(b.v)) {
    return num(a.v) == num(b.v);
  }
  return a.v == b.v;
}

// Python's ordering of numbers and of strings; anything else is an error.
int compare(const Value& a, const Value& b, const char* op) {
  if (is_number(a.v) && is_number(b.v)) {
    const double x = num(a.v), y = num(b.v);
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.v.is_string() && b.v.is_string()) {
    const auto& x = a.v.get_ref<const std::string&>();
    const auto& y = b.v.get_ref<const std::string&>();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  fail(std::string("'") + op + "' between " + repr(a.v) + " and " + repr(b.v));
}

std::string strip(
    const std::string& s,
    bool left,
    bool right,
    const std::string& chars = " \t\n\r\f\v") {
  size_t b = 0, e = s.size();
  while (left && b < e && chars.find(s[b]) != std::string::npos) {
    ++b;
  }
  while (right && e > b && chars.find(s[e - 1]) != std::string::npos) {
    --e;
  }
  return s.substr(b, e - b);
}

std::string map_chars(std::string s, int (*f)(int)) {
  for (auto& c : s) {
    c = static_cast<char>(f(static_cast<unsigned char>(c)));
  }
  return s;
}

std::string title(const std::string& s) {
  std::string out = s;
  bool start = true;
  for (auto& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalpha(u)) {
      c = static_cast<char>(start ? std::toupper(u) : std::tolower(u));
      start = false;
    } else {
      start = true;
    }
  }
  return out;
}

std::string capitalize(const std::string& s) {
  std::string out = map_chars(s, [](int c) { return std::tolower(c); });
  if (!out.empty()) {
    out[0] =
        static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  }
  return out;
}

std::string replace_all(
    std::string s,
    const std::string& a,
    const std::string& b) {
  if (a.empty()) {
    return s;
  }
  for (size_t at = s.find(a); at != std::string::npos;
       at = s.find(a, at + b.size())) {
    s.replace(at, a.size(), b);
  }
  return s;
}

json split(const std::string& s, const Value* sep) {
  json out = json::array();
  if (sep == nullptr || sep->v.is_null()) {
    std::istringstream in(s);
    std::string w;
    while (in >> w) {
      out.push_back(w);
    }
    return out;
  }
  const auto& d = sep->v.get_ref<const std::string&>();
  if (d.empty()) {
    fail("split: empty separator");
  }
  size_t from = 0;
  for (size_t at = s.find(d); at != std::string::npos; at = s.find(d, from)) {
    out.push_back(s.substr(from, at - from));
    from = at + d.size();
  }
  out.push_back(s.substr(from));
  return out;
}

// ---- the tree -------------------------------------------------------------

struct Expr {
  enum Kind {
    kLiteral,
    kName,
    kList,
    kDict,
    kAttr,      // a.name
    kItem,      // a[b]
    kSlice,     // a[b:c:d] (missing parts null)
    kCall,      // f(args) / a.method(args)
    kFilter,    // a | name(args)
    kTest,      // a is [not] name(args)
    kUnary,     // not, -, +
    kBinary,    // + - * / // % ~ == != < > <= >= in, not in, and, or
    kCondition, // a if b else c
  };
  Kind kind;
  json literal;
  std::string name; // variable, attribute, filter, test, operator
  bool negate = false;
  std::vector<std::shared_ptr<Expr>> args; // operands, items, arguments
  std::vector<std::pair<std::string, std::shared_ptr<Expr>>> kwargs;
};
using ExprPtr = std::shared_ptr<Expr>;

struct Node {
  enum Kind { kText, kOutput, kIf, kFor, kSet, kBody };
  Kind kind = kBody;
  std::string text;
  ExprPtr expr;                              // output, set value, for iterable
  std::vector<ExprPtr> conds;                // if: one per branch (null: else)
  std::vector<std::shared_ptr<Node>> bodies; // if branches; for: body, else
  std::vector<std::string> targets;          // for / set names
  std::string attr;                          // set ns.attr
  ExprPtr filter;                            // for ... if filter
  std::vector<std::shared_ptr<Node>> children; // body
};
using NodePtr = std::shared_ptr<Node>;

// ---- the lexer ------------------------------------------------------------

struct Tok {
  enum Kind { kName, kString, kInt, kFloat, kOp, kEnd };
  Kind kind = kEnd;
  std::string text;
  size_t at = 0; // offset in the template
};

// A template split into text and tags, with transformers' whitespace rules
// (trim_blocks, lstrip_blocks, '-' markers).
struct Segment {
  enum Kind { kText, kExpr, kStmt };
  Kind kind;
  std::string text;
  size_t at;
};

std::string where(const std::string& src, size_t at) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < at && i < src.size(); ++i) {
    if (src[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(col);
}

std::vector<Segment> segments(const std::string& src) {
  std::vector<Segment> out;
  size_t i = 0;
  bool strip_next = false;   // '-' closed the last tag
  bool block_before = false; // a block tag ended just before (trim_blocks)
  while (i < src.size()) {
    size_t open = src.find('{', i);
    while (open != std::string::npos &&
           (open + 1 >= src.size() ||
            (src[open + 1] != '{' && src[open + 1] != '%' &&
             src[open + 1] != '#'))) {
      open =
          open + 1 >= src.size() ? std::string::npos : src.find('{', open + 1);
    }
    // trim_blocks: the first newline after a block tag goes.
    size_t begin = i;
    if (block_before && begin < src.size() && src[begin] == '\n') {
      ++begin;
    }
    const size_t stop = open == std::string::npos ? src.size() : open;
    std::string text = src.substr(begin, stop - std::min(stop, begin));
    if (strip_next) {
      text = strip(text, true, false);
    }
    const bool line_starting = begin == 0 || src[begin - 1] == '\n';
    if (open == std::string::npos) {
      if (!text.empty()) {
        out.push_back({Segment::kText, text, begin});
      }
      break;
    }
    const char type = src[open + 1];
    const bool minus = open + 2 < src.size() && src[open + 2] == '-';
    const bool plus = open + 2 < src.size() && src[open + 2] == '+';
    if (minus) {
      text = strip(text, false, true);
    } else if (type != '{' && !plus) {
      // lstrip_blocks: blanks from the line's start to a block tag go.
      const size_t nl = text.find_last_of('\n');
      const size_t from = nl == std::string::npos ? 0 : nl + 1;
      if ((from > 0 || line_starting) &&
          text.find_first_not_of(" \t", from) == std::string::npos) {
        text.erase(from);
      }
    }
    if (!text.empty()) {
      out.push_back({Segment::kText, text, begin});
    }
    const char* close = type == '{' ? "}}" : (type == '%' ? "%}" : "#}");
    const size_t body = open + 2 + (minus || plus ? 1 : 0);
    const size_t end = src.find(close, body);
    if (end == std::string::npos) {
      fail(std::string("unclosed '{") + type + "' at " + where(src, open));
    }
    size_t inner_end = end;
    strip_next = false;
    bool keep_newline = false;
    if (inner_end > body && src[inner_end - 1] == '-') {
      --inner_end;
      strip_next = true;
    } else if (inner_end > body && src[inner_end - 1] == '+') {
      --inner_end;
      keep_newline = true;
    }
    if (type != '#') {
      out.push_back(
          {type == '{' ? Segment::kExpr : Segment::kStmt,
           src.substr(body, inner_end - body),
           body});
    }
    block_before = type != '{' && !keep_newline;
    i = end + 2;
  }
  return out;
}

std::vector<Tok> lex(
    const std::string& s,
    size_t base,
    const std::string& src) {
  std::vector<Tok> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
      continue;
    }
    Tok t;
    t.at = base + i;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() &&
             (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) {
        ++j;
      }
      t.kind = Tok::kName;
      t.text = s.substr(i, j - i);
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool real = false;
      while (j < s.size() &&
             (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_' ||
              (s[j] == '.' && !real && j + 1 < s.size() &&
               std::isdigit(static_cast<unsigned char>(s[j + 1]))))) {
        real = real || s[j] == '.';
        ++j;
      }
      t.kind = real ? Tok::kFloat : Tok::kInt;
      t.text = s.substr(i, j - i);
      t.text.erase(
          std::remove(t.text.begin(), t.text.end(), '_'), t.text.end());
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] == '\\' && j + 1 < s.size()) {
          const char e = s[++j];
          switch (e) {
            case 'n':
              v += '\n';
              break;
            case 't':
              v += '\t';
              break;
            case 'r':
              v += '\r';
              break;
            case '\\':
              v += '\\';
              break;
            case '\'':
              v += '\'';
              break;
            case '"':
              v += '"';
              break;
            case '\n':
              break;
            default:
              v += '\\';
              v += e;
          }
        } else {
          v += s[j];
        }
      }
      if (j >= s.size()) {
        fail("unterminated string at " + where(src, t.at));
      }
      t.kind = Tok::kString;
      t.text = v;
      i = j + 1;
    } else {
      static const char* kOps[] = {
          "//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
          ">",  "|",  ".",  ",",  ":",  "(",  ")", "[", "]", "{", "}", "="};
      bool found = false;
      for (const char* op : kOps) {
        const size_t n = std::char_traits<char>::length(op);
        if (s.compare(i, n, op) == 0) {
          t.kind = Tok::kOp;
          t.text = op;
          i += n;
          found = true;
          break;
        }
      }
      if (!found) {
        fail(
            std::string("unexpected character '") + c + "' at " +
            where(src, t.at));
      }
    }
    out.push_back(t);
  }
  Tok end;
  end.at = base + s.size();
  out.push_back(end);
  return out;
}

// ---- the parser -----------------------------------------------------------

const std::vector<std::string> kFilters = {
    "trim",    "length",  "count",   "upper", "lower",  "title", "capitalize",
    "string",  "int",     "default", "d",     "first",  "last",  "join",
    "replace", "reverse", "list",    "items", "tojson", "float", "abs"};
const std::vector<std::string> kTests = {
    "defined",
    "undefined",
    "none",
    "string",
    "number",
    "mapping",
    "sequence",
    "iterable",
    "true",
    "false",
    "odd",
    "even",
    "equalto",
    "eq",
    "boolean",
    "integer",
    "float"};
const std::vector<std::string> kMethods = {
    "strip",
    "lstrip",
    "rstrip",
    "upper",
    "lower",
    "title",
    "capitalize",
    "startswith",
    "endswith",
    "split",
    "replace",
    "get",
    "items",
    "keys",
    "values"};
const std::vector<std::string> kFunctions =
    {"raise_exception", "range", "namespace", "strftime_now", "dict"};

bool known(const std::vector<std::string>& list, const std::string& s) {
  return std::find(list.begin(), list.end(), s) != list.end();
}

class ExprParser {
 public:
  ExprParser(std::vector<Tok> toks, const std::string& src)
      : t_(std::move(toks)), src_(src) {}

  const Tok& peek(size_t k = 0) const {
    return t_[std::min(i_ + k, t_.size() - 1)];
  }
  bool op(const char* s) const {
    return peek().kind == Tok::kOp && peek().text == s;
  }
  bool word(const char* s) const {
    return peek().kind == Tok::kName && peek().text == s;
  }
  bool done() const {
    return peek().kind == Tok::kEnd;
  }
  Tok next() {
    return t_[std::min(i_++, t_.size() - 1)];
  }
  void expect_op(const char* s) {
    if (!op(s)) {
      error(std::string("expected '") + s + "'");
    }
    ++i_;
  }
  std::string expect_name() {
    if (peek().kind != Tok::kName) {
      error("expected a name");
    }
    return next().text;
  }
  [[noreturn]] void error(const std::string& what) const {
    const auto& t = peek();
    fail(
        what +
        (t.kind == Tok::kEnd ? " at the end" : " before '" + t.text + "'") +
        " (" + where(src_, t.at) + ")");
  }
  void expect_end() {
    if (!done()) {
      error("unexpected text");
    }
  }

  ExprPtr expression() {
    auto e = or_expr();
    if (word("if")) {
      ++i_;
      auto cond = or_expr();
      ExprPtr other;
      if (word("else")) {
        ++i_;
        other = expression();
      } else {
        other = make(Expr::kName); // undefined: renders as ""
        other->name = "\x01undefined";
      }
      auto c = make(Expr::kCondition);
      c->args = {cond, e, other};
      return c;
    }
    return e;
  }

  // A for loop's iterable: no `x if c else y` (its `if` filters the loop).
  ExprPtr expression_no_condition() {
    return or_expr();
  }

  // `a, b` (for / set targets are parsed apart): a tuple is a list here.
  ExprPtr tuple_or_expression() {
    auto e = expression();
    if (!op(",")) {
      return e;
    }
    auto list = make(Expr::kList);
    list->args.push_back(e);
    while (op(",")) {
      ++i_;
      if (done() || op(")")) {
        break;
      }
      list->args.push_back(expression());
    }
    return list;
  }

 private:
  ExprPtr make(Expr::Kind k) {
    auto e = std::make_shared<Expr>();
    e->kind = k;
    return e;
  }
  ExprPtr literal(json v) {
    auto e = make(Expr::kLiteral);
    e->literal = std::move(v);
    return e;
  }
  ExprPtr binary(const std::string& name, ExprPtr a, ExprPtr b) {
    auto e = make(Expr::kBinary);
    e->name = name;
    e->args = {std::move(a), std::move(b)};
    return e;
  }

  ExprPtr or_expr() {
    return level(&ExprParser::and_expr, {"or"});
  }
  ExprPtr and_expr() {
    return level(&ExprParser::not_expr, {"and"});
  }
  ExprPtr not_expr() {
    if (word("not")) {
      ++i_;
      auto e = make(Expr::kUnary);
      e->name = "not";
      e->args = {not_expr()};
      return e;
    }
    return compare();
  }
  ExprPtr compare() {
    auto e = math1();
    for (;;) {
      if (peek().kind == Tok::kOp &&
          (op("==") || op("!=") || op("<") || op(">") || op("<=") ||
           op(">="))) {
        const auto o = next().text;
        e = binary(o, e, math1());
      } else if (word("in")) {
        ++i_;
        e = binary("in", e, math1());
      } else if (
          word("not") && peek(1).kind == Tok::kName && peek(1).text == "in") {
        i_ += 2;
        e = binary("not in", e, math1());
      } else {
        return e;
      }
    }
  }
  // One left-associative level: operands of `operand`'s level joined by
  // any of `ops` (symbols, or the keywords `or` / `and`).
  ExprPtr level(
      ExprPtr (ExprParser::*operand)(),
      std::initializer_list<const char*> ops) {
    auto e = (this->*operand)();
    for (;;) {
      const char* hit = nullptr;
      for (const char* o : ops) {
        if (op(o) || word(o)) {
          hit = o;
          break;
        }
      }
      if (hit == nullptr) {
        return e;
      }
      ++i_;
      e = binary(hit, e, (this->*operand)());
    }
  }
  // Jinja's precedence, loosest first: + -, then ~, then * / // %, then **.
  ExprPtr math1() {
    return level(&ExprParser::concat, {"+", "-"});
  }
  ExprPtr concat() {
    return level(&ExprParser::math2, {"~"});
  }
  ExprPtr math2() {
    return level(&ExprParser::power, {"*", "/", "//", "%"});
  }
  ExprPtr power() {
    return level(&ExprParser::unary, {"**"});
  }
  ExprPtr unary() {
    if (op("-") || op("+")) {
      auto e = make(Expr::kUnary);
      e->name = next().text;
      e->args = {unary()};
      return e;
    }
    return filters(postfix(primary()));
  }
  ExprPtr primary() {
    const auto t = peek();
    if (t.kind == Tok::kString) {
      std::string s;
      while (peek().kind == Tok::kString) { // adjacent strings join
        s += next().text;
      }
      return literal(s);
    }
    if (t.kind == Tok::kInt) {
      ++i_;
      return literal(json(std::stoll(t.text)));
    }
    if (t.kind == Tok::kFloat) {
      ++i_;
      return literal(json(std::stod(t.text)));
    }
    if (t.kind == Tok::kName) {
      ++i_;
      if (t.text == "true" || t.text == "True") {
        return literal(true);
      }
      if (t.text == "false" || t.text == "False") {
        return literal(false);
      }
      if (t.text == "none" || t.text == "None") {
        return literal(nullptr);
      }
      auto e = make(Expr::kName);
      e->name = t.text;
      return e;
    }
    if (op("(")) {
      ++i_;
      auto e = tuple_or_expression();
      expect_op(")");
      return e;
    }
    if (op("[")) {
      ++i_;
      auto e = make(Expr::kList);
      while (!op("]")) {
        e->args.push_back(expression());
        if (!op(",")) {
          break;
        }
        ++i_;
      }
      expect_op("]");
      return e;
    }
    if (op("{")) {
      ++i_;
      auto e = make(Expr::kDict);
      while (!op("}")) {
        e->args.push_back(expression());
        expect_op(":");
        e->args.push_back(expression());
        if (!op(",")) {
          break;
        }
        ++i_;
      }
      expect_op("}");
      return e;
    }
    error("expected a value");
  }
  void call_args(Expr& e) {
    expect_op("(");
    while (!op(")")) {
      if (peek().kind == Tok::kName && peek(1).kind == Tok::kOp &&
          peek(1).text == "=") {
        auto key = next().text;
        ++i_;
        e.kwargs.emplace_back(key, expression());
      } else {
        e.args.push_back(expression());
      }
      if (!op(",")) {
        break;
      }
      ++i_;
    }
    expect_op(")");
  }
  ExprPtr postfix(ExprPtr e) {
    for (;;) {
      if (op(".")) {
        ++i_;
        auto a = make(Expr::kAttr);
        a->name = expect_name();
        a->args = {e};
        e = a;
      } else if (op("[")) {
        ++i_;
        ExprPtr parts[3];
        int colons = 0;
        while (!op("]")) {
          if (op(":")) {
            ++i_;
            if (++colons > 2) {
              error("a slice has at most two ':'");
            }
            continue;
          }
          parts[colons] = expression();
        }
        expect_op("]");
        if (colons == 0) {
          auto item = make(Expr::kItem);
          item->args = {e, parts[0]};
          e = item;
        } else {
          auto s = make(Expr::kSlice);
          s->args = {e, parts[0], parts[1], parts[2]};
          e = s;
        }
      } else if (op("(")) {
        auto c = make(Expr::kCall);
        c->args = {e};
        call_args(*c);
        if (e->kind == Expr::kName && !known(kFunctions, e->name)) {
          fail(
              "the function '" + e->name +
              "' is outside the supported subset (" + where(src_, peek().at) +
              ")");
        }
        if (e->kind == Expr::kAttr && !known(kMethods, e->name)) {
          fail(
              "the method '" + e->name + "' is outside the supported subset (" +
              where(src_, peek().at) + ")");
        }
        e = c;
      } else {
        return e;
      }
    }
  }
  ExprPtr filters(ExprPtr e) {
    for (;;) {
      if (op("|")) {
        ++i_;
        auto f = make(Expr::kFilter);
        const auto at = peek().at;
        f->name = expect_name();
        if (!known(kFilters, f->name)) {
          fail(
              "the filter '" + f->name + "' is outside the supported subset (" +
              where(src_, at) + ")");
        }
        f->args = {e};
        if (op("(")) {
          call_args(*f);
        }
        e = f;
      } else if (word("is")) {
        ++i_;
        auto t = make(Expr::kTest);
        if (word("not")) {
          ++i_;
          t->negate = true;
        }
        const auto at = peek().at;
        if (peek().kind != Tok::kName) {
          error("expected a test");
        }
        t->name = next().text;
        if (t->name == "none" || t->name == "None") {
          t->name = "none";
        }
        if (!known(kTests, t->name)) {
          fail(
              "the test '" + t->name + "' is outside the supported subset (" +
              where(src_, at) + ")");
        }
        t->args = {e};
        if (op("(")) {
          call_args(*t);
        } else if (
            (t->name == "equalto" || t->name == "eq") && !done() &&
            !word("and") && !word("or") && !op(")")) {
          t->args.push_back(primary());
        }
        e = t;
      } else {
        return e;
      }
    }
  }

  std::vector<Tok> t_;
  const std::string& src_;
  size_t i_ = 0;
};

// Statements into a tree.
class Parser {
 public:
  explicit Parser(const std::string& src) : src_(src), segs_(segments(src)) {}

  NodePtr parse() {
    auto root = body({});
    if (pos_ < segs_.size()) {
      fail(
          "unexpected '{% " + first_word(segs_[pos_]) + " %}' at " +
          where(src_, segs_[pos_].at));
    }
    return root;
  }

 private:
  static std::string first_word(const Segment& s) {
    std::istringstream in(s.text);
    std::string w;
    in >> w;
    return w;
  }

  // Nodes up to one of `ends` (left unconsumed).
  NodePtr body(const std::vector<std::string>& ends) {
    auto node = std::make_shared<Node>();
    node->kind = Node::kBody;
    while (pos_ < segs_.size()) {
      const auto& s = segs_[pos_];
      if (s.kind == Segment::kText) {
        auto t = std::make_shared<Node>();
        t->kind = Node::kText;
        t->text = s.text;
        node->children.push_back(t);
        ++pos_;
        continue;
      }
      ExprParser p(lex(s.text, s.at, src_), src_);
      if (s.kind == Segment::kExpr) {
        auto o = std::make_shared<Node>();
        o->kind = Node::kOutput;
        o->expr = p.expression();
        p.expect_end();
        node->children.push_back(o);
        ++pos_;
        continue;
      }
      const auto w = first_word(s);
      if (known(ends, w)) {
        return node;
      }
      ++pos_;
      p.next(); // the keyword
      if (w == "if") {
        node->children.push_back(if_node(p));
      } else if (w == "for") {
        node->children.push_back(for_node(p, s));
      } else if (w == "set") {
        node->children.push_back(set_node(p, s));
      } else if (w == "generation") {
        // transformers' marker of assistant text (for masks): renders its
        // body.
        p.expect_end();
        auto inner = body({"endgeneration"});
        close("endgeneration", s);
        node->children.push_back(inner);
      } else if (
          w == "endfor" || w == "endif" || w == "else" || w == "elif" ||
          w == "endgeneration") {
        fail("unexpected '{% " + w + " %}' at " + where(src_, s.at));
      } else {
        fail(
            "'{% " + w + " %}' is outside the supported subset (" +
            where(src_, s.at) + ")");
      }
    }
    return node; // the caller names a block left open
  }

  void close(const std::string& word, const Segment& opened) {
    if (pos_ >= segs_.size() || first_word(segs_[pos_]) != word) {
      fail(
          "'{% " + first_word(opened) + " %}' at " + where(src_, opened.at) +
          " has no '{% " + word + " %}'");
    }
    ExprParser p(lex(segs_[pos_].text, segs_[pos_].at, src_), src_);
    p.next();
    p.expect_end();
    ++pos_;
  }

  NodePtr if_node(ExprParser& p) {
    auto n = std::make_shared<Node>();
    n->kind = Node::kIf;
    const auto opened = segs_[pos_ - 1];
    n->conds.push_back(p.expression());
    p.expect_end();
    for (;;) {
      n->bodies.push_back(body({"elif", "else", "endif"}));
      if (pos_ >= segs_.size()) {
        fail(
            "'{% if %}' at " + where(src_, opened.at) +
            " has no '{% endif %}'");
      }
      const auto& s = segs_[pos_++];
      ExprParser q(lex(s.text, s.at, src_), src_);
      const auto w = q.next().text;
      if (w == "endif") {
        q.expect_end();
        return n;
      }
      if (w == "elif") {
        n->conds.push_back(q.expression());
      } else {
        n->conds.push_back(nullptr);
      }
      q.expect_end();
    }
  }

  NodePtr for_node(ExprParser& p, const Segment& opened) {
    auto n = std::make_shared<Node>();
    n->kind = Node::kFor;
    n->targets.push_back(p.expect_name());
    while (p.op(",")) {
      p.next();
      n->targets.push_back(p.expect_name());
    }
    if (!p.word("in")) {
      p.error("expected 'in'");
    }
    p.next();
    n->expr = p.expression_no_condition();
    if (p.word("if")) {
      p.next();
      n->filter = p.expression();
    }
    if (p.word("recursive")) {
      fail(
          "recursive loops are outside the supported subset (" +
          where(src_, opened.at) + ")");
    }
    p.expect_end();
    n->bodies.push_back(body({"else", "endfor"}));
    if (pos_ < segs_.size() && first_word(segs_[pos_]) == "else") {
      ++pos_;
      n->bodies.push_back(body({"endfor"}));
    }
    close("endfor", opened);
    return n;
  }

  NodePtr set_node(ExprParser& p, const Segment& opened) {
    auto n = std::make_shared<Node>();
    n->kind = Node::kSet;
    n->targets.push_back(p.expect_name());
    if (p.op(".")) {
      p.next();
      n->attr = p.expect_name();
    }
    while (p.op(",")) {
      p.next();
      n->targets.push_back(p.expect_name());
    }
    if (!p.op("=")) {
      fail(
          "block '{% set %}' (without '=') is outside the supported subset (" +
          where(src_, opened.at) + ")");
    }
    p.next();
    n->expr = p.tuple_or_expression();
    p.expect_end();
    return n;
  }

  const std::string& src_;
  std::vector<Segment> segs_;
  size_t pos_ = 0;
};

// ---- rendering ------------------------------------------------------------

struct Scope {
  std::vector<std::map<std::string, Value>> frames;

  Value* find(const std::string& name) {
    for (auto it = frames.rbegin(); it != frames.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) {
        return &f->second;
      }
    }
    return nullptr;
  }
};

class Renderer {
 public:
  explicit Renderer(Scope scope) : scope_(std::move(scope)) {}

  void render(const Node& n, std::string& out) {
    switch (n.kind) {
      case Node::kText:
        out += n.text;
        return;
      case Node::kOutput:
        out += str(eval(*n.expr));
        return;
      case Node::kBody:
        for (const auto& c : n.children) {
          render(*c, out);
        }
        return;
      case Node::kIf:
        for (size_t i = 0; i < n.conds.size(); ++i) {
          if (n.conds[i] == nullptr || truthy(eval(*n.conds[i]))) {
            render(*n.bodies[i], out);
            return;
          }
        }
        return;
      case Node::kSet: {
        auto v = eval(*n.expr);
        if (!n.attr.empty()) {
          Value* ns = scope_.find(n.targets[0]);
          if (ns == nullptr || !ns->v.is_object() ||
              !ns->v.contains("\x01namespace")) {
            fail(
                "set " + n.targets[0] + "." + n.attr +
                ": only a namespace() takes attributes");
          }
          ns->v[n.attr] = v.v;
          return;
        }
        assign(n.targets, v, scope_.frames.back());
        return;
      }
      case Node::kFor:
        render_for(n, out);
        return;
    }
  }

 private:
  void assign(
      const std::vector<std::string>& targets,
      const Value& v,
      std::map<std::string, Value>& frame) {
    if (targets.size() == 1) {
      frame[targets[0]] = v;
      return;
    }
    if (!v.v.is_array() || v.v.size() != targets.size()) {
      fail(
          "cannot unpack " + repr(v.v) + " into " +
          std::to_string(targets.size()) + " names");
    }
    for (size_t i = 0; i < targets.size(); ++i) {
      frame[targets[i]] = Value::of(v.v[i]);
    }
  }

  static json items_of(const Value& v) {
    if (v.undefined || v.v.is_null()) {
      return json::array();
    }
    if (v.v.is_array()) {
      return v.v;
    }
    if (v.v.is_object()) { // iterating a dict gives its keys
      json keys = json::array();
      for (const auto& kv : v.v.items()) {
        keys.push_back(kv.key());
      }
      return keys;
    }
    if (v.v.is_string()) {
      json chars = json::array();
      for (char c : v.v.get<std::string>()) {
        chars.push_back(std::string(1, c));
      }
      return chars;
    }
    fail("cannot iterate over " + repr(v.v));
  }

  void render_for(const Node& n, std::string& out) {
    json all = items_of(eval(*n.expr));
    std::vector<json> items;
    for (const auto& item : all) {
      if (n.filter != nullptr) {
        scope_.frames.emplace_back();
        assign(n.targets, Value::of(item), scope_.frames.back());
        const bool keep = truthy(eval(*n.filter));
        scope_.frames.pop_back();
        if (!keep) {
          continue;
        }
      }
      items.push_back(item);
    }
    if (items.empty()) {
      if (n.bodies.size() > 1) {
        render(*n.bodies[1], out);
      }
      return;
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < len; ++i) {
      scope_.frames.emplace_back();
      auto& frame = scope_.frames.back();
      assign(n.targets, Value::of(items[i]), frame);
      json loop = {
          {"index0", i},
          {"index", i + 1},
          {"revindex0", len - i - 1},
          {"revindex", len - i},
          {"first", i == 0},
          {"last", i == len - 1},
          {"length", len}};
      if (i > 0) {
        loop["previtem"] = items[i - 1];
      }
      if (i + 1 < len) {
        loop["nextitem"] = items[i + 1];
      }
      frame["loop"] = Value::of(loop);
      render(*n.bodies[0], out);
      // A `set` inside a loop does not leak out of it (Jinja's scoping).
      scope_.frames.pop_back();
    }
  }

  Value eval(const Expr& e) {
    switch (e.kind) {
      case Expr::kLiteral:
        return Value::of(e.literal);
      case Expr::kName: {
        if (e.name == "\x01undefined") {
          return Value::undef();
        }
        Value* v = scope_.find(e.name);
        return v == nullptr ? Value::undef() : *v;
      }
      case Expr::kList: {
        json a = json::array();
        for (const auto& x : e.args) {
          a.push_back(eval(*x).v);
        }
        return Value::of(a);
      }
      case Expr::kDict: {
        json d = json::object();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          d[str(eval(*e.args[i]))] = eval(*e.args[i + 1]).v;
        }
        return Value::of(d);
      }
      case Expr::kAttr:
        return attribute(eval(*e.args[0]), e.name);
      case Expr::kItem:
        return item(eval(*e.args[0]), eval(*e.args[1]));
      case Expr::kSlice:
        return slice(e);
      case Expr::kCall:
        return call(e);
      case Expr::kFilter:
        return filter(e);
      case Expr::kTest: {
        const bool r = test(e);
        return Value::of(e.negate ? !r : r);
      }
      case Expr::kUnary: {
        auto v = eval(*e.args[0]);
        if (e.name == "not") {
          return Value::of(!truthy(v));
        }
        if (!is_number(v.v)) {
          fail("unary '" + e.name + "' of " + repr(v.v));
        }
        if (e.name == "+") {
          return v;
        }
        return is_int(v.v) ? Value::of(-integer(v.v)) : Value::of(-num(v.v));
      }
      case Expr::kBinary:
        return binary(e);
      case Expr::kCondition:
        return truthy(eval(*e.args[0])) ? eval(*e.args[1]) : eval(*e.args[2]);
    }
    fail("unknown expression");
  }

  Value attribute(const Value& obj, const std::string& name) {
    if (obj.v.is_object()) {
      if (obj.v.contains(name)) {
        return Value::of(obj.v.at(name));
      }
    }
    return Value::undef();
  }

  Value item(const Value& obj, const Value& key) {
    if (obj.v.is_object()) {
      const auto k = key.v.is_string() ? key.v.get<std::string>() : str(key);
      return obj.v.contains(k) ? Value::of(obj.v.at(k)) : Value::undef();
    }
    if ((obj.v.is_array() || obj.v.is_string()) && is_int(key.v)) {
      const int64_t n = obj.v.is_array()
          ? static_cast<int64_t>(obj.v.size())
          : static_cast<int64_t>(obj.v.get_ref<const std::string&>().size());
      int64_t i = integer(key.v);
      if (i < 0) {
        i += n;
      }
      if (i < 0 || i >= n) {
        return Value::undef();
      }
      if (obj.v.is_array()) {
        return Value::of(obj.v[static_cast<size_t>(i)]);
      }
      return Value::of(std::string(1, obj.v.get_ref<const std::string&>()[i]));
    }
    return Value::undef();
  }

  Value slice(const Expr& e) {
    auto obj = eval(*e.args[0]);
    const bool is_str = obj.v.is_string();
    if (!obj.v.is_array() && !is_str) {
      fail("cannot slice " + repr(obj.v));
    }
    const int64_t n = is_str
        ? static_cast<int64_t>(obj.v.get_ref<const std::string&>().size())
        : static_cast<int64_t>(obj.v.size());
    auto part = [&](int k, int64_t dflt) {
      if (e.args[k] == nullptr) {
        return dflt;
      }
      auto v = eval(*e.args[k]);
      if (v.v.is_null()) {
        return dflt;
      }
      if (!is_int(v.v)) {
        fail("slice index " + repr(v.v) + " is not an integer");
      }
      return integer(v.v);
    };
    const int64_t step = part(3, 1);
    if (step == 0) {
      fail("slice step cannot be zero");
    }
    // Python's slice bounds: negative from the end, clamped to the ends.
    auto clamp = [&](int64_t i) {
      if (i < 0) {
        i += n;
      }
      return step > 0 ? std::min(std::max<int64_t>(i, 0), n)
                      : std::min(std::max<int64_t>(i, -1), n - 1);
    };
    const int64_t start =
        e.args[1] == nullptr ? (step > 0 ? 0 : n - 1) : clamp(part(1, 0));
    const int64_t stop =
        e.args[2] == nullptr ? (step > 0 ? n : -1) : clamp(part(2, 0));
    json out = json::array();
    std::string s;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (is_str) {
        s += obj.v.get_ref<const std::string&>()[i];
      } else {
        out.push_back(obj.v[static_cast<size_t>(i)]);
      }
    }
    return is_str ? Value::of(s) : Value::of(out);
  }

  std::vector<Value> args_of(const Expr& e, size_t from) {
    std::vector<Value> out;
    for (size_t i = from; i < e.args.size(); ++i) {
      out.push_back(eval(*e.args[i]));
    }
    return out;
  }

  Value call(const Expr& e) {
    const auto& callee = *e.args[0];
    auto args = args_of(e, 1);
    if (callee.kind == Expr::kName) {
      const auto& f = callee.name;
      if (f == "raise_exception") {
        throw ChatTemplateError(args.empty() ? "" : str(args[0]));
      }
      if (f == "range") {
        int64_t a = 0, b = 0, step = 1;
        if (args.size() == 1) {
          b = integer(args[0].v);
        } else if (args.size() >= 2) {
          a = integer(args[0].v);
          b = integer(args[1].v);
          if (args.size() > 2) {
            step = integer(args[2].v);
          }
        }
        if (step == 0) {
          fail("range() step cannot be zero");
        }
        json out = json::array();
        for (int64_t i = a; step > 0 ? i < b : i > b; i += step) {
          out.push_back(i);
        }
        return Value::of(out);
      }
      if (f == "namespace" || f == "dict") {
        json ns = json::object();
        for (const auto& kv : e.kwargs) {
          ns[kv.first] = eval(*kv.second).v;
        }
        if (f == "namespace") {
          ns["\x01namespace"] = true;
        }
        return Value::of(ns);
      }
      if (f == "strftime_now") {
        const std::time_t now = std::time(nullptr);
        std::tm tm{};
        localtime_r(&now, &tm);
        char buf[256];
        const auto fmt = args.empty() ? std::string() : str(args[0]);
        const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
        return Value::of(std::string(buf, n));
      }
      fail("the function '" + f + "' is outside the supported subset");
    }
    if (callee.kind != Expr::kAttr) {
      fail("only functions and methods can be called");
    }
    auto obj = eval(*callee.args[0]);
    const auto& m = callee.name;
    if (obj.v.is_string()) {
      const auto& s = obj.v.get_ref<const std::string&>();
      const std::string* chars = nullptr;
      std::string c;
      if (!args.empty() && args[0].v.is_string()) {
        c = args[0].v.get<std::string>();
        chars = &c;
      }
      if (m == "strip" || m == "lstrip" || m == "rstrip") {
        const bool l = m != "rstrip", r = m != "lstrip";
        return Value::of(
            chars != nullptr ? strip(s, l, r, *chars) : strip(s, l, r));
      }
      if (m == "upper") {
        return Value::of(map_chars(s, [](int x) { return std::toupper(x); }));
      }
      if (m == "lower") {
        return Value::of(map_chars(s, [](int x) { return std::tolower(x); }));
      }
      if (m == "title") {
        return Value::of(title(s));
      }
      if (m == "capitalize") {
        return Value::of(capitalize(s));
      }
      if ((m == "startswith" || m == "endswith") && chars != nullptr) {
        const bool r = m == "startswith" ? s.compare(0, c.size(), c) == 0
                                         : s.size() >= c.size() &&
                s.compare(s.size() - c.size(), c.size(), c) == 0;
        return Value::of(r);
      }
      if (m == "split") {
        return Value::of(split(s, args.empty() ? nullptr : &args[0]));
      }
      if (m == "replace" && args.size() == 2) {
        return Value::of(replace_all(s, str(args[0]), str(args[1])));
      }
    }
    if (obj.v.is_object()) {
      if (m == "get" && !args.empty()) {
        const auto k = str(args[0]);
        if (obj.v.contains(k)) {
          return Value::of(obj.v.at(k));
        }
        return args.size() > 1 ? args[1] : Value::of(nullptr);
      }
      if (m == "items" || m == "keys" || m == "values") {
        json out = json::array();
        for (const auto& kv : obj.v.items()) {
          if (m == "items") {
            out.push_back(json::array({kv.key(), kv.value()}));
          } else if (m == "keys") {
            out.push_back(kv.key());
          } else {
            out.push_back(kv.value());
          }
        }
        return Value::of(out);
      }
    }
    fail(
        "the method '" + m + "' of " + repr(obj.v) +
        " is outside the supported subset");
  }

  Value filter(const Expr& e) {
    auto x = eval(*e.args[0]);
    auto args = args_of(e, 1);
    const auto& f = e.name;
    if (f == "default" || f == "d") {
      const bool boolean = args.size() > 1 && truthy(args[1]);
      if (x.undefined || (boolean && !truthy(x))) {
        return args.empty() ? Value::of("") : args[0];
      }
      return x;
    }
    if (f == "trim") {
      return Value::of(strip(str(x), true, true));
    }
    if (f == "upper") {
      return Value::of(
          map_chars(str(x), [](int c) { return std::toupper(c); }));
    }
    if (f == "lower") {
      return Value::of(
          map_chars(str(x), [](int c) { return std::tolower(c); }));
    }
    if (f == "title") {
      return Value::of(title(str(x)));
    }
    if (f == "capitalize") {
      return Value::of(capitalize(str(x)));
    }
    if (f == "string") {
      return Value::of(str(x));
    }
    if (f == "length" || f == "count") {
      if (x.v.is_string()) {
        // Python counts code points.
        int64_t n = 0;
        for (unsigned char c : x.v.get<std::string>()) {
          n += (c & 0xC0) != 0x80;
        }
        return Value::of(n);
      }
      if (x.v.is_array() || x.v.is_object()) {
        return Value::of(static_cast<int64_t>(x.v.size()));
      }
      return Value::of(0);
    }
    if (f == "int") {
      if (is_number(x.v)) {
        return Value::of(static_cast<int64_t>(num(x.v)));
      }
      try {
        return Value::of(static_cast<int64_t>(std::stoll(str(x))));
      } catch (const std::exception&) {
        return args.empty() ? Value::of(0) : args[0];
      }
    }
    if (f == "float") {
      return Value::of(is_number(x.v) ? num(x.v) : std::stod(str(x)));
    }
    if (f == "abs") {
      return is_int(x.v) ? Value::of(std::llabs(integer(x.v)))
                         : Value::of(std::fabs(num(x.v)));
    }
    if (f == "first" || f == "last") {
      auto items = items_of(x);
      if (items.empty()) {
        return Value::undef();
      }
      return Value::of(f == "first" ? items.front() : items.back());
    }
    if (f == "join") {
      const auto sep = args.empty() ? std::string() : str(args[0]);
      std::string out;
      bool first = true;
      for (const auto& item : items_of(x)) {
        out += (first ? "" : sep) + str(Value::of(item));
        first = false;
      }
      return Value::of(out);
    }
    if (f == "replace" && args.size() >= 2) {
      return Value::of(replace_all(str(x), str(args[0]), str(args[1])));
    }
    if (f == "reverse") {
      if (x.v.is_string()) {
        auto s = x.v.get<std::string>();
        std::reverse(s.begin(), s.end());
        return Value::of(s);
      }
      auto items = items_of(x);
      std::reverse(items.begin(), items.end());
      return Value::of(items);
    }
    if (f == "list") {
      return Value::of(items_of(x));
    }
    if (f == "items") {
      json out = json::array();
      if (x.v.is_object()) {
        for (const auto& kv : x.v.items()) {
          out.push_back(json::array({kv.key(), kv.value()}));
        }
      }
      return Value::of(out);
    }
    if (f == "tojson") {
      // transformers' tojson: json.dumps(x, ensure_ascii=False, indent=...)
      int indent = -1;
      for (const auto& kv : e.kwargs) {
        if (kv.first == "indent") {
          indent = static_cast<int>(integer(eval(*kv.second).v));
        }
      }
      if (!args.empty()) {
        indent = static_cast<int>(integer(args[0].v));
      }
      return Value::of(python_json(x.v, indent, 0));
    }
    fail("the filter '" + f + "' is outside the supported subset");
  }

  // json.dumps with Python's separators (", ", ": ") or indentation.
  static std::string python_json(const json& v, int indent, int depth) {
    if (v.is_array() || v.is_object()) {
      if (v.empty()) {
        return v.is_array() ? "[]" : "{}";
      }
      const bool arr = v.is_array();
      std::string pad =
          indent >= 0 ? "\n" + std::string((depth + 1) * indent, ' ') : "";
      std::string out(1, arr ? '[' : '{');
      bool first = true;
      for (const auto& kv : v.items()) {
        if (kv.key().rfind("\x01", 0) == 0) {
          continue;
        }
        out += first ? pad : (indent >= 0 ? "," + pad : ", ");
        first = false;
        if (!arr) {
          out += json(kv.key()).dump(
                     -1, ' ', false, json::error_handler_t::replace) +
              ": ";
        }
        out += python_json(kv.value(), indent, depth + 1);
      }
      if (indent >= 0) {
        out += "\n" + std::string(depth * indent, ' ');
      }
      return out + (arr ? ']' : '}');
    }
    if (v.is_number_float()) {
      return py_float(v.get<double>());
    }
    return v.dump(-1, ' ', false, json::error_handler_t::replace);
  }

  bool test(const Expr& e) {
    const auto& t = e.name;
    // `defined` must not evaluate an undefined name into an error.
    auto x = eval(*e.args[0]);
    if (t == "defined") {
      return !x.undefined;
    }
    if (t == "undefined") {
      return x.undefined;
    }
    if (t == "none") {
      return !x.undefined && x.v.is_null();
    }
    if (t == "string") {
      return x.v.is_string();
    }
    if (t == "number") {
      return x.v.is_number();
    }
    if (t == "integer") {
      return x.v.is_number_integer();
    }
    if (t == "float") {
      return x.v.is_number_float();
    }
    if (t == "boolean") {
      return x.v.is_boolean();
    }
    if (t == "mapping") {
      return x.v.is_object();
    }
    if (t == "sequence" || t == "iterable") {
      return x.v.is_array() || x.v.is_string() || x.v.is_object();
    }
    if (t == "true" || t == "false") {
      return x.v.is_boolean() && x.v.get<bool>() == (t == "true");
    }
    if (t == "odd" || t == "even") {
      return is_int(x.v) && (((integer(x.v) % 2) != 0) == (t == "odd"));
    }
    if (t == "equalto" || t == "eq") {
      return e.args.size() > 1 && equal(x, eval(*e.args[1]));
    }
    fail("the test '" + t + "' is outside the supported subset");
  }

  Value binary(const Expr& e) {
    const auto& o = e.name;
    if (o == "and") {
      auto a = eval(*e.args[0]);
      return truthy(a) ? eval(*e.args[1]) : a;
    }
    if (o == "or") {
      auto a = eval(*e.args[0]);
      return truthy(a) ? a : eval(*e.args[1]);
    }
    auto a = eval(*e.args[0]);
    auto b = eval(*e.args[1]);
    if (o == "~") {
      return Value::of(str(a) + str(b));
    }
    if (o == "==") {
      return Value::of(equal(a, b));
    }
    if (o == "!=") {
      return Value::of(!equal(a, b));
    }
    if (o == "<" || o == ">" || o == "<=" || o == ">=") {
      const int c = compare(a, b, o.c_str());
      return Value::of(
          o == "<"        ? c < 0
              : o == ">"  ? c > 0
              : o == "<=" ? c <= 0
                          : c >= 0);
    }
    if (o == "in" || o == "not in") {
      bool found = false;
      if (b.v.is_string()) {
        if (!a.v.is_string()) {
          fail("'in <string>' needs a string, got " + repr(a.v));
        }
        found = b.v.get_ref<const std::string&>().find(
                    a.v.get_ref<const std::string&>()) != std::string::npos;
      } else if (b.v.is_object()) {
        found = a.v.is_string() && b.v.contains(a.v.get<std::string>());
      } else if (b.v.is_array()) {
        for (const auto& item : b.v) {
          found = found || equal(a, Value::of(item));
        }
      } else {
        fail("'in' needs a string, list or dict, got " + repr(b.v));
      }
      return Value::of(o == "in" ? found : !found);
    }
    if (o == "+") {
      if (a.v.is_string() && b.v.is_string()) {
        return Value::of(a.v.get<std::string>() + b.v.get<std::string>());
      }
      if (a.v.is_array() && b.v.is_array()) {
        json out = a.v;
        for (const auto& item : b.v) {
          out.push_back(item);
        }
        return Value::of(out);
      }
    }
    if (o == "*" && (a.v.is_string() || b.v.is_string())) {
      const auto& s = a.v.is_string() ? a : b;
      const auto& k = a.v.is_string() ? b : a;
      if (is_int(k.v)) {
        std::string out;
        for (int64_t i = 0; i < integer(k.v); ++i) {
          out += s.v.get<std::string>();
        }
        return Value::of(out);
      }
    }
    if (!is_number(a.v) || !is_number(b.v)) {
      fail(
          "unsupported operand types for " + o + ": " + repr(a.v) + " and " +
          repr(b.v));
    }
    const bool ints = is_int(a.v) && is_int(b.v);
    if (o == "/") {
      if (num(b.v) == 0) {
        fail("division by zero");
      }
      return Value::of(num(a.v) / num(b.v));
    }
    if (ints) {
      const int64_t x = integer(a.v), y = integer(b.v);
      if ((o == "//" || o == "%") && y == 0) {
        fail("integer division or modulo by zero");
      }
      if (o == "+")
        return Value::of(x + y);
      if (o == "-")
        return Value::of(x - y);
      if (o == "*")
        return Value::of(x * y);
      if (o == "**") {
        int64_t r = 1;
        for (int64_t i = 0; i < y; ++i) {
          r *= x;
        }
        return y >= 0 ? Value::of(r)
                      : Value::of(std::pow(double(x), double(y)));
      }
      // Python's floor division and modulo (the sign of the divisor).
      int64_t q = x / y, r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) {
        --q;
        r += y;
      }
      return o == "//" ? Value::of(q) : Value::of(r);
    }
    const double x = num(a.v), y = num(b.v);
    if (o == "+")
      return Value::of(x + y);
    if (o == "-")
      return Value::of(x - y);
    if (o == "*")
      return Value::of(x * y);
    if (o == "**")
      return Value::of(std::pow(x, y));
    if (y == 0) {
      fail("float division or modulo by zero");
    }
    if (o == "//")
      return Value::of(std::floor(x / y));
    return Value::of(x - std::floor(x / y) * y);
  }

  Scope scope_;
};

} // namespace chat_template_detail

namespace ctd = chat_template_detail;

ChatTemplate::ChatTemplate(const std::string& source)
    : source_(source), root_(ctd::Parser(source_).parse()) {}

ChatTemplate ChatTemplate::from_pretrained(
    const std::string& dir,
    const std::string& name) {
  const fs::path config = fs::path(dir) / "tokenizer_config.json";
  if (fs::exists(config)) {
    const nlohmann::json j = tokenizer_detail::read_json(
        config, tokenizer_detail::kMaxConfigFileBytes);
    if (j.is_object() && j.contains("chat_template")) {
      const auto& t = j.at("chat_template");
      if (t.is_string()) {
        return ChatTemplate(t.get<std::string>());
      }
      if (t.is_array()) {
        std::string names;
        for (const auto& entry : t) {
          if (entry.is_object() && entry.value("name", "") == name &&
              entry.contains("template") && entry.at("template").is_string()) {
            return ChatTemplate(entry.at("template").get<std::string>());
          }
          if (entry.is_object()) {
            names += (names.empty() ? "" : ", ") + entry.value("name", "?");
          }
        }
        throw ChatTemplateError(
            "chat template: '" + config.string() + "' has no template named '" +
            name + "' (it has: " + names + ")");
      }
      throw ChatTemplateError(
          "chat template: '" + config.string() +
          "': chat_template must be a string or a list of {name, template}");
    }
  }
  const fs::path jinja = fs::path(dir) / "chat_template.jinja";
  if (fs::exists(jinja)) {
    std::ifstream in(jinja, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ChatTemplate(ss.str());
  }
  throw ChatTemplateError(
      "chat template: '" + dir +
      "' has none (no chat_template in tokenizer_config.json, no "
      "chat_template.jinja)");
}

std::string ChatTemplate::apply(
    const std::vector<ChatMessage>& messages,
    const ChatTemplateOptions& options) const {
  ctd::Scope scope;
  scope.frames.emplace_back();
  auto& globals = scope.frames.back();
  json list = json::array();
  for (const auto& m : messages) {
    list.push_back({{"role", m.role}, {"content", m.content}});
  }
  if (!options.extra_json().empty()) {
    json extra;
    try {
      extra = json::parse(options.extra_json());
    } catch (const std::exception& e) {
      throw ChatTemplateError(
          std::string("chat template: extra_json is not JSON: ") + e.what());
    }
    if (!extra.is_object()) {
      throw ChatTemplateError("chat template: extra_json must be an object");
    }
    for (const auto& kv : extra.items()) {
      globals[kv.key()] = ctd::Value::of(kv.value());
    }
  }
  globals["messages"] = ctd::Value::of(list);
  globals["add_generation_prompt"] =
      ctd::Value::of(options.add_generation_prompt());
  globals["bos_token"] = ctd::Value::of(options.bos_token());
  globals["eos_token"] = ctd::Value::of(options.eos_token());
  scope.frames.emplace_back(); // the template's own `set`s
  std::string out;
  ctd::Renderer(std::move(scope)).render(*root_, out);
  return out;
}

std::vector<int64_t> apply_chat_template(
    const Tokenizer& tokenizer,
    const ChatTemplate& chat_template,
    const std::vector<ChatMessage>& messages,
    bool add_generation_prompt) {
  auto token = [&](int64_t id) {
    return id >= 0 ? tokenizer.id_to_token(id) : std::string();
  };
  const auto text = chat_template.apply(
      messages,
      ChatTemplateOptions()
          .add_generation_prompt(add_generation_prompt)
          .bos_token(token(tokenizer.bos_token_id()))
          .eos_token(token(tokenizer.eos_token_id())));
  return tokenizer.encode(text, /*add_special_tokens=*/false);
}

} // namespace models
} // namespace colossalai
