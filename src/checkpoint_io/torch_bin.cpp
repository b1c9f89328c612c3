#include <colossalai/checkpoint_io/torch_bin.h>

#include "pickle_reader.h"
#include "zip_records.h"

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <unordered_map>

namespace colossalai {
namespace checkpoint_io {
namespace {

// NOTE [Reading .bin files]
// LibTorch's own torch::pickle_load (1.13) cannot read what Python's
// torch.save writes for ordinary state dicts: it has no SETITEM/APPEND opcodes
// (Python emits them for one-element dicts and lists) and it turns
// collections.OrderedDict, the type of every nn.Module.state_dict(), into
// None. So .bin files are read with the small unpickler below: it accepts the
// opcodes of protocols 2 to 5 that containers of tensors use, rebuilds tensors
// from the zip's storage records and refuses any other Python object, so no
// code named by the file runs. Model and optimizer files both go through it
// (torch::pickle_load also crashes on malformed input: a REDUCE on an empty
// stack, 200,000 nested lists). It is iterative, so nesting costs memory, not
// stack; conversion to IValues stops at a fixed depth.

std::string errno_message(int err) {
  return std::strerror(err);
}

/// Writes through a file descriptor for PyTorchStreamWriter. Errors are kept
/// rather than thrown, because the writer calls back from C code; the caller
/// checks them once the archive is complete.
class FileSink {
 public:
  explicit FileSink(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TORCH_CHECK(
        fd_ >= 0,
        "cannot open '",
        path,
        "' for writing: ",
        errno_message(errno));
  }
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;
  ~FileSink() {
    if (fd_ >= 0) {
      ::close(fd_);
    }
  }

  /// Always reports `n` bytes written: after a failure the rest is dropped,
  /// and the zip writer never sees an error it would throw from a destructor.
  size_t write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    size_t left = n;
    while (error_ == 0 && left > 0) {
      ssize_t r = ::write(fd_, p, std::min<size_t>(left, size_t(1) << 30));
      if (r < 0 && errno == EINTR) {
        continue;
      }
      if (r <= 0) {
        error_ = r < 0 ? errno : EIO;
        break;
      }
      p += r;
      left -= static_cast<size_t>(r);
    }
    return n;
  }

  void close() {
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0 && error_ == 0) {
      error_ = errno;
    }
    TORCH_CHECK(
        error_ == 0, "cannot write '", path_, "': ", errno_message(error_));
  }

 private:
  std::string path_;
  int fd_ = -1;
  int error_ = 0;
};

enum class Kind {
  None,
  Bool,
  Int,
  Float,
  Str,
  Bytes,
  Tuple,
  List,
  Dict,
  Global,
  Storage,
  Tensor,
};

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

/// A Python object of the pickle. Objects live in the unpickler's arena and
/// refer to each other by pointer, so cycles and deep nesting cost nothing
/// to tear down.
struct Obj {
  explicit Obj(Kind k) : kind(k) {}
  Kind kind;
  int64_t i = 0;           // Int, Bool
  double f = 0;            // Float
  std::string s;           // Str, Bytes, Global ("module.name")
  std::vector<Obj*> items; // Tuple, List; Dict as key, value, key, value...
  // Dict: position of each str / int key's value in `items`, so building a
  // dict of n keys costs O(n), not O(n^2).
  std::unique_ptr<std::unordered_map<std::string, size_t>> keys;
  at::Tensor tensor;                // Tensor
  c10::Storage storage;             // Storage
  at::ScalarType dtype = at::kByte; // Storage
};

struct StorageType {
  const char* name;
  at::ScalarType dtype;
};

constexpr StorageType kStorageTypes[] = {
    {"torch.DoubleStorage", at::kDouble},
    {"torch.FloatStorage", at::kFloat},
    {"torch.HalfStorage", at::kHalf},
    {"torch.BFloat16Storage", at::kBFloat16},
    {"torch.LongStorage", at::kLong},
    {"torch.IntStorage", at::kInt},
    {"torch.ShortStorage", at::kShort},
    {"torch.CharStorage", at::kChar},
    {"torch.ByteStorage", at::kByte},
    {"torch.BoolStorage", at::kBool},
    {"torch.ComplexFloatStorage", at::kComplexFloat},
    {"torch.ComplexDoubleStorage", at::kComplexDouble},
};

class Unpickler {
 public:
  Unpickler(
      const std::string& file,
      caffe2::serialize::PyTorchStreamReader& archive,
      const detail::ZipRecords* mapped = nullptr)
      : file_(file), archive_(archive), mapped_(mapped) {}

  Obj* run(const char* data, size_t size) {
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

 private:
  [[noreturn]] void fail(const std::string& what) {
    TORCH_CHECK(false, "'", file_, "' is not a valid .bin checkpoint: ", what);
  }
  void check(bool ok, const std::string& what) {
    if (!ok) {
      fail(what);
    }
  }
  static std::string hex(uint8_t v) {
    const char* digits = "0123456789abcdef";
    return {digits[v >> 4], digits[v & 15]};
  }

  Obj* make(Kind kind) {
    arena_.emplace_back(kind);
    return &arena_.back();
  }

  const char* bytes(uint64_t n) {
    check(n <= size_ - pos_, "the pickle is truncated");
    const char* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  uint64_t little(int n) {
    const char* p = bytes(n);
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) {
      v = (v << 8) | static_cast<uint8_t>(p[k]);
    }
    return v;
  }
  uint8_t u8() {
    return static_cast<uint8_t>(little(1));
  }
  uint16_t u16() {
    return static_cast<uint16_t>(little(2));
  }
  uint32_t u32() {
    return static_cast<uint32_t>(little(4));
  }
  uint64_t u64() {
    return little(8);
  }
  std::string line() {
    const void* end = std::memchr(data_ + pos_, '\n', size_ - pos_);
    check(end != nullptr, "the pickle is truncated");
    size_t n = static_cast<const char*>(end) - (data_ + pos_);
    std::string s(bytes(n), n);
    pos_ += 1;
    return s;
  }
  /// Two's-complement little-endian integer of `n` bytes.
  int64_t read_long(uint64_t n) {
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

  void push(Obj* o) {
    stack_.push_back(o);
  }
  void push_int(int64_t v) {
    Obj* o = make(Kind::Int);
    o->i = v;
    push(o);
  }
  void push_string(Kind kind, uint64_t n) {
    Obj* o = make(kind);
    const char* p = bytes(n);
    o->s.assign(p, n);
    push(o);
  }
  size_t floor() const {
    return marks_.empty() ? 0 : marks_.back();
  }
  Obj* top() {
    check(stack_.size() > floor(), "the pickle pops an empty stack");
    return stack_.back();
  }
  Obj* pop() {
    Obj* o = top();
    stack_.pop_back();
    return o;
  }
  std::vector<Obj*> pop_mark() {
    check(!marks_.empty(), "the pickle has no MARK to pop");
    size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<Obj*> items(stack_.begin() + mark, stack_.end());
    stack_.resize(mark);
    return items;
  }
  Obj* memo_get(uint64_t key) {
    auto it = memo_.find(key);
    check(it != memo_.end(), "the pickle reads an unset memo entry");
    return it->second;
  }
  Obj* expect(Obj* o, Kind kind, const char* op) {
    check(
        o->kind == kind,
        std::string(op) + " expects a " + kind_name(kind) + ", got a " +
            kind_name(o->kind));
    return o;
  }
  void set_item(Obj* dict, Obj* key, Obj* value) {
    // Python semantics: a repeated key replaces the value.
    std::string id;
    if (key->kind == Kind::Str) {
      id = "s" + key->s;
    } else if (key->kind == Kind::Int) {
      id = "i" + std::to_string(key->i);
    }
    if (!id.empty()) {
      if (!dict->keys) {
        dict->keys =
            std::make_unique<std::unordered_map<std::string, size_t>>();
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

  int64_t int_arg(Obj* o, const char* what) {
    check(
        o->kind == Kind::Int,
        std::string(what) + " is a " + kind_name(o->kind) + ", not an int");
    return o->i;
  }
  std::vector<int64_t> ints_arg(Obj* o, const char* what) {
    check(
        o->kind == Kind::Tuple || o->kind == Kind::List,
        std::string(what) + " is a " + kind_name(o->kind) + ", not a tuple");
    std::vector<int64_t> out;
    for (Obj* item : o->items) {
      int64_t v = int_arg(item, what);
      check(v >= 0, std::string(what) + " has a negative entry");
      out.push_back(v);
    }
    return out;
  }

  /// The few callables a state dict names; anything else is refused.
  Obj* call(
      const std::string& name,
      const std::vector<Obj*>& args,
      int depth = 0) {
    check(depth < 4, "tensor rebuild calls nest too deeply");
    if (name == "collections.OrderedDict") {
      check(args.empty(), "OrderedDict built from arguments");
      return make(Kind::Dict);
    }
    if (name == "torch._utils._rebuild_tensor_v2" ||
        name == "torch._utils._rebuild_tensor") {
      check(args.size() >= 4, name + " with too few arguments");
      return rebuild_tensor(args[0], args[1], args[2], args[3]);
    }
    if (name == "torch._utils._rebuild_parameter" ||
        name == "torch._utils._rebuild_parameter_with_state") {
      check(!args.empty(), name + " without arguments");
      return expect(args[0], Kind::Tensor, "_rebuild_parameter");
    }
    if (name == "torch._tensor._rebuild_from_type_v2") {
      check(args.size() >= 3, name + " with too few arguments");
      Obj* func = expect(args[0], Kind::Global, "_rebuild_from_type_v2");
      Obj* inner = expect(args[2], Kind::Tuple, "_rebuild_from_type_v2");
      return call(func->s, inner->items, depth + 1);
    }
    if (name == "torch.jit._pickle.build_intlist" ||
        name == "torch.jit._pickle.build_doublelist" ||
        name == "torch.jit._pickle.build_boollist" ||
        name == "torch.jit._pickle.build_tensorlist") {
      // Written by LibTorch's pickle_save for List[int] and friends.
      check(args.size() == 1, name + " takes one list");
      return expect(args[0], Kind::List, "build_*list");
    }
    if (name == "torch.jit._pickle.restore_type_tag") {
      // Written by LibTorch's pickle_save around typed containers.
      check(!args.empty(), name + " without arguments");
      return args[0];
    }
    fail("it names the Python object '" + name + "', which is not allowed");
  }

  Obj* persistent_load(Obj* pid) {
    expect(pid, Kind::Tuple, "BINPERSID");
    const auto& t = pid->items;
    check(
        t.size() == 5 && t[0]->kind == Kind::Str && t[0]->s == "storage",
        "a persistent id that is not ('storage', type, key, location, numel)");
    Obj* type = expect(t[1], Kind::Global, "storage type");
    Obj* key = expect(t[2], Kind::Str, "storage key");
    const int64_t numel = int_arg(t[4], "storage numel");
    check(numel >= 0, "a negative storage size");

    Obj* storage = make(Kind::Storage);
    bool known = false;
    for (const auto& st : kStorageTypes) {
      if (type->s == st.name) {
        storage->dtype = st.dtype;
        known = true;
      }
    }
    check(known, "unsupported storage type '" + type->s + "'");

    auto cached = records_.find(key->s);
    if (cached == records_.end()) {
      const std::string record = "data/" + key->s;
      check(archive_.hasRecord(record), "record '" + record + "' is missing");
      c10::Storage s;
      const bool mapped = mapped_ != nullptr && mapped_->storage(record, s) &&
          reinterpret_cast<uintptr_t>(s.data()) %
                  c10::elementSize(storage->dtype) ==
              0;
      if (!mapped) {
        at::DataPtr ptr;
        size_t bytes = 0;
        std::tie(ptr, bytes) = archive_.getRecord(record);
        s = c10::Storage(
            c10::Storage::use_byte_size_t(),
            bytes,
            std::move(ptr),
            /*allocator=*/nullptr,
            /*resizable=*/false);
      }
      cached = records_.emplace(key->s, std::move(s)).first;
    }
    int64_t need = 0;
    check(
        !__builtin_mul_overflow(
            numel,
            static_cast<int64_t>(c10::elementSize(storage->dtype)),
            &need) &&
            static_cast<uint64_t>(need) <= cached->second.nbytes(),
        "storage '" + key->s + "' is shorter than its " +
            std::to_string(numel) + " elements");
    storage->storage = cached->second;
    return storage;
  }

  Obj* rebuild_tensor(Obj* storage, Obj* offset_obj, Obj* size, Obj* stride) {
    expect(storage, Kind::Storage, "_rebuild_tensor");
    const int64_t offset = int_arg(offset_obj, "storage offset");
    const std::vector<int64_t> sizes = ints_arg(size, "tensor size");
    const std::vector<int64_t> strides = ints_arg(stride, "tensor stride");
    check(offset >= 0, "a negative storage offset");
    check(sizes.size() == strides.size(), "sizes and strides differ in rank");
    const int64_t item = c10::elementSize(storage->dtype);
    const int64_t available =
        static_cast<int64_t>(storage->storage.nbytes()) / item;
    // The largest element index the view touches must lie in the storage.
    bool empty = false;
    int64_t last = offset;
    bool overflow = false;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] == 0) {
        empty = true;
        continue;
      }
      int64_t span = 0;
      overflow |= __builtin_mul_overflow(sizes[d] - 1, strides[d], &span);
      overflow |= __builtin_add_overflow(last, span, &last);
    }
    check(!overflow, "tensor size and stride overflow");
    check(
        empty ? offset <= available : last < available,
        "a tensor reaches past the end of its storage");
    Obj* t = make(Kind::Tensor);
    t->tensor = at::empty({0}, at::TensorOptions().dtype(storage->dtype))
                    .set_(storage->storage, offset, sizes, strides);
    return t;
  }

  const std::string& file_;
  caffe2::serialize::PyTorchStreamReader& archive_;
  const detail::ZipRecords* mapped_; // stored records, mapped; may be null
  const char* data_ = nullptr;
  size_t size_ = 0;
  size_t pos_ = 0;
  std::deque<Obj> arena_;
  std::vector<Obj*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Obj*> memo_;
  std::unordered_map<std::string, c10::Storage> records_;
};

// Deeper than any optimizer or model state (dict -> dict -> dict -> tensor;
// list -> dict -> tuple); a deeper file is malformed or hostile.
constexpr int kMaxDepth = 32;

/// Converts the pickle's objects to IValues. Shared objects (the memo) are
/// converted once, so a file cannot blow up by reference; cycles and deep
/// nesting stop at kMaxDepth.
class ToIValue {
 public:
  explicit ToIValue(const std::string& file) : file_(file) {}

  c10::IValue operator()(Obj* o, int depth = 0) {
    TORCH_CHECK(
        depth < kMaxDepth,
        "'",
        file_,
        "' is not a valid checkpoint: its objects nest deeper than ",
        kMaxDepth,
        " levels (or refer to themselves)");
    auto cached = done_.find(o);
    if (cached != done_.end()) {
      return cached->second;
    }
    c10::IValue v = convert(o, depth);
    done_.emplace(o, v);
    return v;
  }

 private:
  c10::IValue convert(Obj* o, int depth) {
    switch (o->kind) {
      case Kind::None:
        return c10::IValue();
      case Kind::Bool:
        return c10::IValue(o->i != 0);
      case Kind::Int:
        return c10::IValue(o->i);
      case Kind::Float:
        return c10::IValue(o->f);
      case Kind::Str:
      case Kind::Bytes:
        return c10::IValue(o->s);
      case Kind::Tensor:
        return c10::IValue(o->tensor);
      case Kind::Tuple: {
        std::vector<c10::IValue> items;
        for (Obj* item : o->items) {
          items.push_back((*this)(item, depth + 1));
        }
        return c10::ivalue::Tuple::create(std::move(items));
      }
      case Kind::List: {
        c10::impl::GenericList list(c10::AnyType::get());
        for (Obj* item : o->items) {
          list.push_back((*this)(item, depth + 1));
        }
        return list;
      }
      case Kind::Dict: {
        bool all_str = true, all_int = true;
        for (size_t k = 0; k < o->items.size(); k += 2) {
          const Kind kk = o->items[k]->kind;
          TORCH_CHECK(
              kk == Kind::Str || kk == Kind::Int,
              "'",
              file_,
              "' is not a valid checkpoint: a dict has a key of type ",
              kind_name(kk));
          all_str &= kk == Kind::Str;
          all_int &= kk == Kind::Int;
        }
        c10::TypePtr key_type = c10::AnyType::get();
        if (all_str) {
          key_type = c10::StringType::get();
        } else if (all_int) {
          key_type = c10::IntType::get();
        }
        c10::impl::GenericDict dict(key_type, c10::AnyType::get());
        for (size_t k = 0; k < o->items.size(); k += 2) {
          dict.insert_or_assign(
              (*this)(o->items[k], depth + 1),
              (*this)(o->items[k + 1], depth + 1));
        }
        return dict;
      }
      default:
        TORCH_CHECK(
            false,
            "'",
            file_,
            "' is not a valid checkpoint: it holds a ",
            kind_name(o->kind),
            " outside a tensor");
    }
  }

  const std::string& file_;
  std::unordered_map<Obj*, c10::IValue> done_;
};

std::string first_line(const char* what) {
  std::string s(what);
  size_t eol = s.find('\n');
  return eol == std::string::npos ? s : s.substr(0, eol);
}

/// Runs `fn`, turning the errors of the zip reader and the standard library
/// (which do not name the file) into errors that do.
template <class Fn>
auto naming_file(const std::string& path, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find("'" + path + "'") != std::string::npos) {
      throw;
    }
    TORCH_CHECK(
        false,
        "'",
        path,
        "' is not a valid checkpoint (truncated or corrupt zip): ",
        first_line(msg.c_str()));
  } catch (const std::bad_alloc&) {
    TORCH_CHECK(
        false,
        "'",
        path,
        "' is not a valid checkpoint: it declares records too large to load");
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "'", path, "' is not a valid checkpoint: ", e.what());
  }
}

/// Checks `path` starts like a torch.save zip archive, with a message that
/// says what it is instead.
void check_zip(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open '", path, "': ", errno_message(errno));
  struct stat st {};
  const bool is_file = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  char magic[4] = {0, 0, 0, 0};
  const ssize_t got = is_file ? ::pread(fd, magic, sizeof(magic), 0) : 0;
  ::close(fd);
  TORCH_CHECK(is_file, "cannot open '", path, "': not a regular file");
  TORCH_CHECK(got > 0, "'", path, "' is empty, not a .bin checkpoint");
  TORCH_CHECK(
      !(got >= 2 && static_cast<uint8_t>(magic[0]) == 0x80),
      "'",
      path,
      "' was written in PyTorch's legacy (pre-1.6) format; re-save it with "
      "torch.save's default zip format");
  TORCH_CHECK(
      got == 4 && std::memcmp(magic, "PK\x03\x04", 4) == 0,
      "'",
      path,
      "' is not a .bin checkpoint (a zip archive from torch.save): ",
      got < 4 ? "it is truncated" : "it does not start like a zip archive");
}

/// The root object of an archive's data.pkl; `keep` holds the objects.
Obj* read_root(
    caffe2::serialize::PyTorchStreamReader& archive,
    const std::string& path,
    std::unique_ptr<Unpickler>& keep,
    const detail::ZipRecords* mapped = nullptr) {
  if (archive.hasRecord("byteorder")) {
    auto record = archive.getRecord("byteorder");
    std::string order(
        static_cast<const char*>(std::get<0>(record).get()),
        std::get<1>(record));
    TORCH_CHECK(
        order == "little",
        "'",
        path,
        "' holds ",
        order,
        "-endian tensors, which are unsupported");
  }
  TORCH_CHECK(
      archive.hasRecord("data.pkl"),
      "'",
      path,
      "' is not a valid .bin checkpoint: it has no data.pkl");
  auto pickle = archive.getRecord("data.pkl");
  keep = std::make_unique<Unpickler>(path, archive, mapped);
  return keep->run(
      static_cast<const char*>(std::get<0>(pickle).get()), std::get<1>(pickle));
}

} // namespace

void save_bin(const std::string& path, const StateDict& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : tensors) {
    TORCH_CHECK(
        item.value().defined(),
        "cannot save to '",
        path,
        "': tensor '",
        item.key(),
        "' is undefined");
    dict.insert(item.key(), item.value());
  }
  // A plain dict (no LibTorch type tag), as Python's torch.save writes one.
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* data, size_t n) {
        pickle.insert(pickle.end(), data, data + n);
      },
      /*tensor_table=*/nullptr,
      /*type_renamer=*/nullptr,
      /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr,
      /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();

  // Streamed to the file: the tensors' bytes are not gathered in memory.
  FileSink sink(path);
  {
    caffe2::serialize::PyTorchStreamWriter writer(
        [&](const void* data, size_t n) { return sink.write(data, n); });
    torch::jit::writeArchiveAndTensors(
        "data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
    writer.writeEndOfFile();
  }
  sink.close();
}

StateDict load_bin(const std::string& path) {
  check_zip(path);
  return naming_file(path, [&] {
    caffe2::serialize::PyTorchStreamReader archive(path);
    const auto mapped = detail::ZipRecords::open(path);
    std::unique_ptr<Unpickler> unpickler;
    Obj* root = read_root(archive, path, unpickler, mapped.get());
    TORCH_CHECK(
        root->kind == Kind::Dict,
        "'",
        path,
        "' holds a ",
        kind_name(root->kind),
        ", not a dict of tensors");
    StateDict out;
    out.reserve(root->items.size() / 2);
    for (size_t k = 0; k < root->items.size(); k += 2) {
      Obj* key = root->items[k];
      Obj* value = root->items[k + 1];
      TORCH_CHECK(
          key->kind == Kind::Str,
          "'",
          path,
          "' is not a dict of tensors: it has a key of type ",
          kind_name(key->kind));
      TORCH_CHECK(
          value->kind == Kind::Tensor,
          "'",
          path,
          "' is not a dict of tensors: entry '",
          key->s,
          "' is a ",
          kind_name(value->kind));
      out.insert(key->s, value->tensor);
    }
    return out;
  });
}

namespace detail {

c10::IValue load_pickle(
    caffe2::serialize::PyTorchStreamReader& archive,
    const std::string& name) {
  return naming_file(name, [&] {
    std::unique_ptr<Unpickler> unpickler;
    Obj* root = read_root(archive, name, unpickler);
    return ToIValue(name)(root);
  });
}

c10::IValue load_pickle(const std::string& path) {
  check_zip(path);
  return naming_file(path, [&] {
    caffe2::serialize::PyTorchStreamReader archive(path);
    return load_pickle(archive, path);
  });
}

} // namespace detail

} // namespace checkpoint_io
} // namespace colossalai
