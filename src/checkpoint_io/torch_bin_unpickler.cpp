// The pickle machine of the unpickler: the opcodes that containers of tensors
// use, read iteratively onto its stack, memo and arena.

#include "torch_bin_unpickler.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::None:
      return "None";
    case Kind::Bool:
      return "bool";
    case Kind::Int:
      return "int";
    case Kind::Float:
      return "float";
    case Kind::Str:
      return "str";
    case Kind::Bytes:
      return "bytes";
    case Kind::Tuple:
      return "tuple";
    case Kind::List:
      return "list";
    case Kind::Dict:
      return "dict";
    case Kind::Global:
      return "Python global";
    case Kind::Storage:
      return "storage";
    case Kind::Tensor:
      return "tensor";
  }
  return "object";
}

Obj* Unpickler::run(const char* data, size_t size) {
  data_ = data;
  size_ = size;
  pos_ = 0;
  while (true) {
    const uint8_t op = u8();
    switch (op) {
      case 0x80: // PROTO
        check(u8() <= 5, "unsupported pickle protocol");
        break;
      case 0x95: // FRAME
        u64();
        break;
      case '.': { // STOP
        Obj* result = pop();
        return result;
      }
      case '(': // MARK
        marks_.push_back(stack_.size());
        break;
      case '}': // EMPTY_DICT
        push(make(Kind::Dict));
        break;
      case ']': // EMPTY_LIST
        push(make(Kind::List));
        break;
      case ')': // EMPTY_TUPLE
        push(make(Kind::Tuple));
        break;
      case 'd': { // DICT
        Obj* dict = make(Kind::Dict);
        auto items = pop_mark();
        check(items.size() % 2 == 0, "DICT with an odd number of items");
        for (size_t k = 0; k < items.size(); k += 2) {
          set_item(dict, items[k], items[k + 1]);
        }
        push(dict);
        break;
      }
      case 'l':   // LIST
      case 't': { // TUPLE
        Obj* seq = make(op == 'l' ? Kind::List : Kind::Tuple);
        seq->items = pop_mark();
        push(seq);
        break;
      }
      case 0x85:   // TUPLE1
      case 0x86:   // TUPLE2
      case 0x87: { // TUPLE3
        Obj* tuple = make(Kind::Tuple);
        tuple->items.resize(op - 0x84);
        for (size_t k = tuple->items.size(); k > 0; --k) {
          tuple->items[k - 1] = pop();
        }
        push(tuple);
        break;
      }
      case 'a': { // APPEND
        Obj* value = pop();
        expect(top(), Kind::List, "APPEND")->items.push_back(value);
        break;
      }
      case 'e': { // APPENDS
        auto values = pop_mark();
        Obj* list = expect(top(), Kind::List, "APPENDS");
        list->items.insert(list->items.end(), values.begin(), values.end());
        break;
      }
      case 's': { // SETITEM
        Obj* value = pop();
        Obj* key = pop();
        set_item(expect(top(), Kind::Dict, "SETITEM"), key, value);
        break;
      }
      case 'u': { // SETITEMS
        auto items = pop_mark();
        Obj* dict = expect(top(), Kind::Dict, "SETITEMS");
        check(items.size() % 2 == 0, "SETITEMS with an odd number of items");
        for (size_t k = 0; k < items.size(); k += 2) {
          set_item(dict, items[k], items[k + 1]);
        }
        break;
      }
      case 'N': // NONE
        push(make(Kind::None));
        break;
      case 0x88:   // NEWTRUE
      case 0x89: { // NEWFALSE
        Obj* b = make(Kind::Bool);
        b->i = op == 0x88;
        push(b);
        break;
      }
      case 'J': // BININT
        push_int(static_cast<int32_t>(u32()));
        break;
      case 'K': // BININT1
        push_int(u8());
        break;
      case 'M': // BININT2
        push_int(u16());
        break;
      case 0x8a: // LONG1
        push_int(read_long(u8()));
        break;
      case 0x8b: // LONG4
        push_int(read_long(u32()));
        break;
      case 'G': { // BINFLOAT, big-endian
        uint64_t bits = 0;
        const char* p = bytes(8);
        for (int k = 0; k < 8; ++k) {
          bits = (bits << 8) | static_cast<uint8_t>(p[k]);
        }
        Obj* f = make(Kind::Float);
        std::memcpy(&f->f, &bits, sizeof(bits));
        push(f);
        break;
      }
      case 'X': // BINUNICODE
      case 'T': // BINSTRING
        push_string(Kind::Str, u32());
        break;
      case 0x8c: // SHORT_BINUNICODE
      case 'U':  // SHORT_BINSTRING
        push_string(Kind::Str, u8());
        break;
      case 0x8d: // BINUNICODE8
        push_string(Kind::Str, u64());
        break;
      case 'B': // BINBYTES
        push_string(Kind::Bytes, u32());
        break;
      case 'C': // SHORT_BINBYTES
        push_string(Kind::Bytes, u8());
        break;
      case 0x8e: // BINBYTES8
        push_string(Kind::Bytes, u64());
        break;
      case 'c': { // GLOBAL
        std::string module = line();
        std::string name = line();
        Obj* g = make(Kind::Global);
        g->s = module + "." + name;
        push(g);
        break;
      }
      case 0x93: { // STACK_GLOBAL
        Obj* name = expect(pop(), Kind::Str, "STACK_GLOBAL");
        Obj* module = expect(pop(), Kind::Str, "STACK_GLOBAL");
        Obj* g = make(Kind::Global);
        g->s = module->s + "." + name->s;
        push(g);
        break;
      }
      case 'q': // BINPUT
        memo_[u8()] = top();
        break;
      case 'r': // LONG_BINPUT
        memo_[u32()] = top();
        break;
      case 0x94: // MEMOIZE
        memo_[memo_.size()] = top();
        break;
      case 'h': // BINGET
        push(memo_get(u8()));
        break;
      case 'j': // LONG_BINGET
        push(memo_get(u32()));
        break;
      case 'R':    // REDUCE
      case 0x81: { // NEWOBJ
        Obj* args = expect(pop(), Kind::Tuple, "REDUCE");
        Obj* callable = expect(pop(), Kind::Global, "REDUCE");
        push(call(callable->s, args->items));
        break;
      }
      case 'b': { // BUILD
        pop();    // the state
        // OrderedDict state dicts carry `_metadata` this way, tensors their
        // Python attributes; neither matters here.
        Kind kind = top()->kind;
        check(
            kind == Kind::Dict || kind == Kind::Tensor,
            std::string("BUILD on a ") + kind_name(kind));
        break;
      }
      case 'Q': // BINPERSID
        push(persistent_load(pop()));
        break;
      default:
        check(
            false,
            "unsupported pickle opcode 0x" + hex(op) + " at byte " +
                std::to_string(pos_ - 1));
    }
  }
}

void Unpickler::fail(const std::string& what) {
  TORCH_CHECK(false, "'", file_, "' is not a valid .bin checkpoint: ", what);
}

void Unpickler::check(bool ok, const std::string& what) {
  if (!ok) {
    fail(what);
  }
}

std::string Unpickler::hex(uint8_t v) {
  const char* digits = "0123456789abcdef";
  return {digits[v >> 4], digits[v & 15]};
}

Obj* Unpickler::make(Kind kind) {
  arena_.emplace_back(kind);
  return &arena_.back();
}

const char* Unpickler::bytes(uint64_t n) {
  check(n <= size_ - pos_, "the pickle is truncated");
  const char* p = data_ + pos_;
  pos_ += n;
  return p;
}

uint64_t Unpickler::little(int n) {
  const char* p = bytes(n);
  uint64_t v = 0;
  for (int k = n - 1; k >= 0; --k) {
    v = (v << 8) | static_cast<uint8_t>(p[k]);
  }
  return v;
}

uint8_t Unpickler::u8() {
  return static_cast<uint8_t>(little(1));
}

uint16_t Unpickler::u16() {
  return static_cast<uint16_t>(little(2));
}

uint32_t Unpickler::u32() {
  return static_cast<uint32_t>(little(4));
}

uint64_t Unpickler::u64() {
  return little(8);
}

std::string Unpickler::line() {
  const void* end = std::memchr(data_ + pos_, '\n', size_ - pos_);
  check(end != nullptr, "the pickle is truncated");
  size_t n = static_cast<const char*>(end) - (data_ + pos_);
  std::string s(bytes(n), n);
  pos_ += 1;
  return s;
}

int64_t Unpickler::read_long(uint64_t n) {
  check(n <= 8, "an integer wider than 64 bits");
  if (n == 0) {
    return 0;
  }
  uint64_t v = little(static_cast<int>(n));
  if (n < 8 && (v >> (8 * n - 1)) & 1) {
    v |= ~uint64_t(0) << (8 * n);
  }
  return static_cast<int64_t>(v);
}

void Unpickler::push(Obj* o) {
  stack_.push_back(o);
}

void Unpickler::push_int(int64_t v) {
  Obj* o = make(Kind::Int);
  o->i = v;
  push(o);
}

void Unpickler::push_string(Kind kind, uint64_t n) {
  Obj* o = make(kind);
  const char* p = bytes(n);
  o->s.assign(p, n);
  push(o);
}

size_t Unpickler::floor() const {
  return marks_.empty() ? 0 : marks_.back();
}

Obj* Unpickler::top() {
  check(stack_.size() > floor(), "the pickle pops an empty stack");
  return stack_.back();
}

Obj* Unpickler::pop() {
  Obj* o = top();
  stack_.pop_back();
  return o;
}

std::vector<Obj*> Unpickler::pop_mark() {
  check(!marks_.empty(), "the pickle has no MARK to pop");
  size_t mark = marks_.back();
  marks_.pop_back();
  std::vector<Obj*> items(stack_.begin() + mark, stack_.end());
  stack_.resize(mark);
  return items;
}

Obj* Unpickler::memo_get(uint64_t key) {
  auto it = memo_.find(key);
  check(it != memo_.end(), "the pickle reads an unset memo entry");
  return it->second;
}

Obj* Unpickler::expect(Obj* o, Kind kind, const char* op) {
  check(
      o->kind == kind,
      std::string(op) + " expects a " + kind_name(kind) + ", got a " +
          kind_name(o->kind));
  return o;
}

void Unpickler::set_item(Obj* dict, Obj* key, Obj* value) {
  // Python semantics: a repeated key replaces the value.
  std::string id;
  if (key->kind == Kind::Str) {
    id = "s" + key->s;
  } else if (key->kind == Kind::Int) {
    id = "i" + std::to_string(key->i);
  }
  if (!id.empty()) {
    if (!dict->keys) {
      dict->keys = std::make_unique<std::unordered_map<std::string, size_t>>();
    }
    auto inserted = dict->keys->emplace(id, dict->items.size() + 1);
    if (!inserted.second) {
      dict->items[inserted.first->second] = value;
      return;
    }
  }
  dict->items.push_back(key);
  dict->items.push_back(value);
}

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
