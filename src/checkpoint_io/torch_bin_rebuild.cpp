// The unpickler's Python objects beyond containers: the few callables a state
// dict names, and tensors rebuilt over the zip's storage records.

#include "torch_bin_unpickler.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <tuple>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

namespace {

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

} // namespace

int64_t Unpickler::int_arg(Obj* o, const char* what) {
  check(
      o->kind == Kind::Int,
      std::string(what) + " is a " + kind_name(o->kind) + ", not an int");
  return o->i;
}

std::vector<int64_t> Unpickler::ints_arg(Obj* o, const char* what) {
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

Obj* Unpickler::call(
    const std::string& name,
    const std::vector<Obj*>& args,
    int depth) {
  check(depth < 4, "tensor rebuild calls nest too deeply");
  if (name == "collections.OrderedDict") {
    check(args.empty(), "OrderedDict built from arguments");
    return make(Kind::Dict);
  }
  if (name == "collections.Counter") {
    // PyTorch's MultiStepLR keeps its milestones in a Counter, which pickles
    // as Counter(dict): the dict is all it holds.
    check(args.size() <= 1, "Counter built from several arguments");
    return args.empty() ? make(Kind::Dict)
                        : expect(args[0], Kind::Dict, "Counter");
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

Obj* Unpickler::persistent_load(Obj* pid) {
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
      "storage '" + key->s + "' is shorter than its " + std::to_string(numel) +
          " elements");
  storage->storage = cached->second;
  return storage;
}

Obj* Unpickler::rebuild_tensor(
    Obj* storage,
    Obj* offset_obj,
    Obj* size,
    Obj* stride) {
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

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
