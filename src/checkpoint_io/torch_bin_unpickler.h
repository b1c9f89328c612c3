#pragma once

// The unpickler of the data.pkl in torch.save archives (internal): its opcodes
// are in torch_bin_unpickler.cpp, its tensors in torch_bin_rebuild.cpp.

#include "zip_records.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Storage.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace caffe2 {
namespace serialize {
class PyTorchStreamReader;
} // namespace serialize
} // namespace caffe2

namespace colossalai {
namespace checkpoint_io {
namespace detail {

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

const char* kind_name(Kind kind);

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

class Unpickler {
 public:
  Unpickler(
      const std::string& file,
      caffe2::serialize::PyTorchStreamReader& archive,
      const detail::ZipRecords* mapped = nullptr)
      : file_(file), archive_(archive), mapped_(mapped) {}

  Obj* run(const char* data, size_t size);

 private:
  [[noreturn]] void fail(const std::string& what);
  void check(bool ok, const std::string& what);
  static std::string hex(uint8_t v);
  Obj* make(Kind kind);
  const char* bytes(uint64_t n);
  uint64_t little(int n);
  uint8_t u8();
  uint16_t u16();
  uint32_t u32();
  uint64_t u64();
  std::string line();
  /// Two's-complement little-endian integer of `n` bytes.
  int64_t read_long(uint64_t n);
  void push(Obj* o);
  void push_int(int64_t v);
  void push_string(Kind kind, uint64_t n);
  size_t floor() const;
  Obj* top();
  Obj* pop();
  std::vector<Obj*> pop_mark();
  Obj* memo_get(uint64_t key);
  Obj* expect(Obj* o, Kind kind, const char* op);
  void set_item(Obj* dict, Obj* key, Obj* value);
  // Defined in torch_bin_rebuild.cpp:
  int64_t int_arg(Obj* o, const char* what);
  std::vector<int64_t> ints_arg(Obj* o, const char* what);
  /// The few callables a state dict names; anything else is refused.
  Obj* call(
      const std::string& name,
      const std::vector<Obj*>& args,
      int depth = 0);
  Obj* persistent_load(Obj* pid);
  Obj* rebuild_tensor(Obj* storage, Obj* offset_obj, Obj* size, Obj* stride);

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

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
