#include <colossalai/lazy/lazy_init.h>

#include <colossalai/checkpoint_io/model_state_hooks.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/nn/module.h>

#include "../utils/host_memory.h"

#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace colossalai {
namespace lazy {

// One context's recorded operations, in order (NOTE [Lazy
// initialization]).
class Recording {
 public:
  struct Op {
    c10::OperatorHandle op;
    std::vector<c10::IValue> inputs;  // as called (devices as asked)
    std::vector<c10::IValue> outputs; // the meta results
  };
  std::vector<Op> ops;
  at::Tensor generator_state; // the CPU generator at the context's entry
};

namespace {

constexpr auto kKey = c10::DispatchKey::DeferredInit;

thread_local Recording* current = nullptr;

// Lazy tensors, by storage -> their recording. Storage, not TensorImpl:
// LibTorch's variable factories and views give the user other TensorImpls
// of the storage an operation made.
using Key = const c10::StorageImpl*;
std::mutex registry_mutex;
std::unordered_map<Key, std::shared_ptr<Recording>>& registry() {
  static std::unordered_map<Key, std::shared_ptr<Recording>> r;
  return r;
}

Key key_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl()
                                        : nullptr;
}
thread_local std::shared_ptr<Recording> current_owner;

void for_each_tensor(
    const std::vector<c10::IValue>& values,
    const std::function<void(const at::Tensor&)>& f) {
  for (const auto& v : values) {
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      // get(i): a value on every version (iterating yields proxies on some,
      // references on others).
      const auto list = v.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        f(list.get(i));
      }
    } else if (v.isOptionalTensorList()) {
      for (const c10::optional<at::Tensor>& t : v.toOptionalTensorList()) {
        if (t.has_value()) {
          f(*t);
        }
      }
    }
  }
}

// `v` with every tensor in it replaced by f(tensor).
c10::IValue map_tensors(
    const c10::IValue& v,
    const std::function<at::Tensor(const at::Tensor&)>& f) {
  if (v.isTensor()) {
    return f(v.toTensor());
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    const auto list = v.toTensorList();
    for (size_t i = 0; i < list.size(); ++i) {
      out.push_back(f(list.get(i)));
    }
    return out;
  }
  if (v.isOptionalTensorList()) {
    c10::List<c10::optional<at::Tensor>> out;
    for (const c10::optional<at::Tensor>& t : v.toOptionalTensorList()) {
      out.push_back(
          t.has_value() ? c10::optional<at::Tensor>(f(*t)) : c10::nullopt);
    }
    return out;
  }
  return v;
}

// A meta tensor's own alias (same storage and view): what the recording
// keeps, so installing values into the user's tensors later does not
// change the recording.
at::Tensor alias(const at::Tensor& t) {
  if (!t.defined() || !t.is_meta()) {
    return t;
  }
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(t.storage()),
      c10::DispatchKeySet(c10::DispatchKey::Meta),
      t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides());
  impl->set_storage_offset(t.storage_offset());
  return at::Tensor(std::move(impl));
}

// Records the call and runs it on meta tensors.
void record_and_run_on_meta(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  TORCH_INTERNAL_ASSERT(current != nullptr, "lazy fallback outside a context");
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  Recording::Op rec{op, {stack->end() - n, stack->end()}, {}};
  // Factories make meta tensors (the recorded call keeps the device asked).
  for (size_t i = 0; i < n; ++i) {
    if (args[i].name() == "device") {
      (*stack)[stack->size() - n + i] = c10::IValue(c10::Device(c10::kMeta));
    }
  }
  try {
    c10::impl::ExcludeDispatchKeyGuard guard(kKey);
    op.redispatchBoxed(keys.remove(kKey), stack);
  } catch (const c10::Error& e) {
    TORCH_CHECK(
        false,
        "LazyInitContext: ",
        op.schema().name(),
        " cannot run while modules are built lazily (it needs tensor values, "
        "which do not exist until materialize): ",
        e.what_without_backtrace());
  }
  const size_t m = op.schema().returns().size();
  rec.outputs.assign(stack->end() - m, stack->end());
  for (auto* values : {&rec.inputs, &rec.outputs}) {
    for (auto& v : *values) {
      v = map_tensors(v, alias);
    }
  }
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for_each_tensor(rec.outputs, [](const at::Tensor& t) {
      if (t.defined() && t.is_meta() && key_of(t) != nullptr) {
        registry()[key_of(t)] = current_owner;
      }
    });
  }
  current->ops.push_back(std::move(rec));
}

TORCH_LIBRARY_IMPL(_, DeferredInit, m) {
  m.fallback(
      torch::CppFunction::makeFromBoxedFunction<&record_and_run_on_meta>());
}

std::shared_ptr<Recording> recording_of(const at::Tensor& t) {
  if (!t.defined() || !t.is_meta()) {
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(key_of(t));
  return it == registry().end() ? nullptr : it->second;
}

} // namespace

LazyInitContext::LazyInitContext() {
  TORCH_CHECK(current == nullptr, "LazyInitContext: contexts do not nest");
  // Lazy init's part in checkpoints (NOTE [Model state hooks]): a lazy
  // tensor takes a checkpoint's value as it is, without its random init.
  static const bool registered = [] {
    checkpoint_io::ModelStateHooks hooks;
    hooks.assign = [](const at::Tensor& target, const at::Tensor& value) {
      return assign_lazy(target, value);
    };
    checkpoint_io::register_model_state_hooks("lazy_init", std::move(hooks));
    return true;
  }();
  (void)registered;
  recording_ = std::make_shared<Recording>();
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    recording_->generator_state = gen.get_state();
  }
  current = recording_.get();
  current_owner = recording_;
  c10::impl::tls_set_dispatch_key_included(kKey, true);
}

LazyInitContext::~LazyInitContext() {
  c10::impl::tls_set_dispatch_key_included(kKey, false);
  current = nullptr;
  current_owner = nullptr;
}

void LazyInitContext::discard() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (auto it = registry().begin(); it != registry().end();) {
      it = it->second == recording_ ? registry().erase(it) : std::next(it);
    }
  }
  recording_->ops.clear();
}

bool is_lazy(const at::Tensor& t) {
  return recording_of(t) != nullptr;
}

bool is_lazy(const torch::nn::Module& module) {
  for (const auto& p : module.parameters()) {
    if (is_lazy(p)) {
      return true;
    }
  }
  for (const auto& b : module.buffers()) {
    if (is_lazy(b)) {
      return true;
    }
  }
  return false;
}

namespace {
std::unordered_map<
    const c10::TensorImpl*,
    std::function<at::Tensor(const at::Tensor&)>>&
transforms() {
  static std::unordered_map<
      const c10::TensorImpl*,
      std::function<at::Tensor(const at::Tensor&)>>
      t;
  return t;
}
} // namespace

bool transform_lazy(
    const at::Tensor& t,
    std::function<at::Tensor(const at::Tensor&)> transform) {
  if (!is_lazy(t)) {
    return false;
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& slot = transforms()[t.unsafeGetTensorImpl()];
  if (slot) {
    slot = [first = std::move(slot), then = std::move(transform)](
               const at::Tensor& x) { return then(first(x)); };
  } else {
    slot = std::move(transform);
  }
  return true;
}

bool assign_lazy(const at::Tensor& t, const at::Tensor& value) {
  if (!is_lazy(t)) {
    return false;
  }
  TORCH_CHECK(
      value.sizes() == t.sizes(),
      "assign_lazy: shape ",
      value.sizes(),
      " for a tensor of shape ",
      t.sizes());
  at::NoGradGuard no_grad;
  auto own = value.detach().to(t.scalar_type()).contiguous().clone();
  t.unsafeGetTensorImpl()->shallow_copy_from(own.getIntrusivePtr());
  return true;
}

bool install_lazy(const at::Tensor& t, const at::Tensor& value) {
  if (!is_lazy(t)) {
    return false;
  }
  TORCH_CHECK(
      value.sizes() == t.sizes() && value.device().is_cpu(),
      "install_lazy: a CPU tensor of shape ",
      t.sizes(),
      " expected, got ",
      value.sizes(),
      " on ",
      value.device());
  t.unsafeGetTensorImpl()->shallow_copy_from(
      value.detach().getIntrusivePtr());
  return true;
}

void materialize(torch::nn::Module& module, const KeepFn& keep) {
  TORCH_CHECK(
      current == nullptr,
      "materialize: close the LazyInitContext first (its recording is not "
      "complete)");
  // The module's lazy tensors, by recording.
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> targets;
  std::shared_ptr<Recording> rec;
  auto collect = [&](const std::string& name, const at::Tensor& t) {
    auto r = recording_of(t);
    if (r == nullptr) {
      return;
    }
    TORCH_CHECK(
        rec == nullptr || rec == r,
        "materialize: '",
        name,
        "' was built in another LazyInitContext than the module's other "
        "tensors");
    rec = r;
    names.emplace(t.unsafeGetTensorImpl(), name);
    targets.emplace(t.unsafeGetTensorImpl(), t);
  };
  for (const auto& item : module.named_parameters()) {
    collect(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers()) {
    collect(item.key(), item.value());
  }
  if (rec == nullptr) {
    return;
  }
  // Initialisers that overwrite a whole storage without reading it, whose
  // result the next use of the storage overwrites again (a layer's own
  // init, redrawn by the model's): only their random draws matter, so they
  // run on a scratch tensor, and a storage made by empty() is allocated at
  // its first use that counts. So a tensor is whole in memory from its last
  // initialiser on, not from its construction on.
  const auto overwrite_of = [](const Recording::Op& op) -> Key {
    static const std::unordered_set<std::string> kInit = {
        "aten::uniform_",
        "aten::normal_",
        "aten::fill_",
        "aten::zero_",
        "aten::random_",
        "aten::bernoulli_",
        "aten::exponential_",
        "aten::geometric_",
        "aten::log_normal_",
        "aten::cauchy_"};
    if (!kInit.count(op.op.schema().name()) || op.inputs.empty() ||
        !op.inputs[0].isTensor()) {
      return nullptr;
    }
    const auto& self = op.inputs[0].toTensor();
    if (key_of(self) == nullptr || self.storage_offset() != 0 ||
        !self.is_contiguous() ||
        static_cast<size_t>(self.numel() * self.element_size()) !=
            self.storage().nbytes()) {
      return nullptr;
    }
    for (size_t k = 1; k < op.inputs.size(); ++k) {
      if (op.inputs[k].isTensor() &&
          key_of(op.inputs[k].toTensor()) != nullptr) {
        return nullptr; // fill_ from a tensor of the recording
      }
    }
    return key_of(self);
  };
  std::vector<Key> overwrites(rec->ops.size(), nullptr);
  std::unordered_map<Key, std::vector<size_t>> uses;
  for (size_t i = 0; i < rec->ops.size(); ++i) {
    overwrites[i] = overwrite_of(rec->ops[i]);
    std::unordered_set<Key> seen;
    auto mark = [&](const at::Tensor& t) {
      if (key_of(t) != nullptr && seen.insert(key_of(t)).second) {
        uses[key_of(t)].push_back(i);
      }
    };
    for_each_tensor(rec->ops[i].inputs, mark);
    for_each_tensor(rec->ops[i].outputs, mark);
  }
  // The storages each op uses last, so what is not kept is freed early.
  std::vector<std::vector<Key>> ends(rec->ops.size());
  for (const auto& kv : uses) {
    ends[kv.second.back()].push_back(kv.first);
  }
  std::vector<bool> dead(rec->ops.size(), false);
  std::unordered_set<size_t> deferred_empty;
  for (const auto& kv : uses) {
    const auto& u = kv.second;
    for (size_t k = 0; k + 1 < u.size(); ++k) {
      if (overwrites[u[k + 1]] != kv.first) {
        continue;
      }
      if (overwrites[u[k]] == kv.first) {
        dead[u[k]] = true;
      } else if (
          k == 0 && rec->ops[u[k]].op.schema().name() == "aten::empty" &&
          rec->ops[u[k]].outputs.size() == 1) {
        deferred_empty.insert(u[k]);
      }
    }
  }
  // Storages whose empty() was deferred: allocated at first real use.
  std::unordered_map<Key, at::Tensor> pending; // key -> its meta tensor
  std::unordered_map<Key, c10::Device> pending_device;

  std::unordered_map<Key, std::vector<at::Tensor>> targets_by_storage;
  for (const auto& kv : targets) {
    targets_by_storage[key_of(kv.second)].push_back(kv.second);
  }
  // Replay from the generator's state at the context's entry; the caller's
  // generator state is restored after.
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved = gen.get_state();
    gen.set_state(rec->generator_state);
  }
  struct Restore {
    at::Generator gen;
    at::Tensor state;
    ~Restore() {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  } restore{gen, saved};

  // Recorded storage -> the replay's real one; a recorded tensor is the
  // same view (offset, sizes, strides) of it.
  std::unordered_map<Key, at::Tensor> real;
  auto real_view = [&](const at::Tensor& meta) -> at::Tensor {
    const auto& base = real.at(key_of(meta));
    return at::empty({0}, base.options())
        .set_(
            base.storage(),
            meta.storage_offset(),
            meta.sizes(),
            meta.strides());
  };
  std::string op_name;
  auto to_real = [&](const at::Tensor& t) -> at::Tensor {
    const Key key = key_of(t);
    if (key != nullptr && pending.count(key)) {
      const auto& meta = pending.at(key);
      real[key] = at::empty(
          {static_cast<int64_t>(meta.storage().nbytes()) /
           static_cast<int64_t>(meta.element_size())},
          meta.options().device(pending_device.at(key)));
      pending.erase(key);
    }
    if (key != nullptr && real.count(key)) {
      return real_view(t);
    }
    TORCH_CHECK(
        !t.defined() || !t.is_meta() || !recording_of(t),
        "materialize: ",
        op_name,
        " reads a lazy tensor that no earlier recorded operation made "
        "(built in another context?)");
    return t;
  };
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < rec->ops.size(); ++i) {
    const auto& op = rec->ops[i];
    op_name = op.op.schema().name();
    if (deferred_empty.count(i)) {
      const auto& meta = op.outputs[0].toTensor();
      c10::Device device(c10::kCPU);
      const auto& args = op.op.schema().arguments();
      for (size_t k = 0; k < args.size() && k < op.inputs.size(); ++k) {
        if (args[k].name() == "device" && op.inputs[k].isDevice()) {
          device = op.inputs[k].toDevice();
        }
      }
      pending[key_of(meta)] = meta;
      pending_device.emplace(key_of(meta), device);
      continue;
    }
    torch::jit::Stack stack;
    if (dead[i]) {
      // Only the random draws count: a scratch tensor takes them.
      const auto& self = op.inputs[0].toTensor();
      const auto key = key_of(self);
      const auto device = real.count(key) ? real.at(key).device()
          : pending_device.count(key)     ? pending_device.at(key)
                                          : c10::Device(c10::kCPU);
      stack.push_back(at::empty(self.sizes(), self.options().device(device)));
      for (size_t k = 1; k < op.inputs.size(); ++k) {
        stack.push_back(map_tensors(op.inputs[k], to_real));
      }
      op.op.callBoxed(&stack);
      continue;
    }
    for (const auto& v : op.inputs) {
      stack.push_back(map_tensors(v, to_real));
    }
    op.op.callBoxed(&stack);
    TORCH_INTERNAL_ASSERT(stack.size() == op.outputs.size());
    auto map = [&](const at::Tensor& meta, const at::Tensor& got) {
      // A new storage maps to the real output's; an in-place op or a view
      // keeps the mapping it has.
      if (key_of(meta) != nullptr && !real.count(key_of(meta)) &&
          got.defined()) {
        real[key_of(meta)] =
            at::empty({0}, got.options()).set_(got.storage(), 0, {0}, {1});
      }
    };
    for (size_t k = 0; k < stack.size(); ++k) {
      if (op.outputs[k].isTensor() && stack[k].isTensor()) {
        map(op.outputs[k].toTensor(), stack[k].toTensor());
      } else if (op.outputs[k].isTensorList() && stack[k].isTensorList()) {
        auto metas = op.outputs[k].toTensorList();
        auto reals = stack[k].toTensorList();
        TORCH_INTERNAL_ASSERT(metas.size() == reals.size());
        for (size_t j = 0; j < metas.size(); ++j) {
          map(metas.get(j), reals.get(j));
        }
      }
    }
    // Storages whose last use this was: install the module's tensors, drop
    // the rest.
    for (const auto key : ends[i]) {
      if (!real.count(key)) {
        continue; // deferred, or never made real
      }
      auto t = targets_by_storage.find(key);
      bool reshaped = false; // a transform or keep made a new tensor of it
      if (t != targets_by_storage.end()) {
        for (auto& target : t->second) {
          at::Tensor value = real_view(target);
          std::function<at::Tensor(const at::Tensor&)> transform;
          {
            std::lock_guard<std::mutex> lock(registry_mutex);
            auto it = transforms().find(target.unsafeGetTensorImpl());
            if (it != transforms().end()) {
              transform = std::move(it->second);
              transforms().erase(it);
            }
          }
          if (transform) {
            value = transform(value);
          }
          if (keep) {
            value = keep(names.at(target.unsafeGetTensorImpl()), value);
          }
          reshaped = reshaped || transform || keep;
          // In place: every holder of the tensor sees the real one.
          target.unsafeGetTensorImpl()->shallow_copy_from(
              value.detach().getIntrusivePtr());
        }
        std::lock_guard<std::mutex> lock(registry_mutex);
        registry().erase(key);
      }
      auto dropped = real.find(key);
      const bool large = reshaped && dropped != real.end() &&
          dropped->second.has_storage() &&
          dropped->second.storage().nbytes() >= (1 << 20);
      real.erase(key);
      if (large) {
        // A whole tensor gave way to its shard. glibc maps tensors above
        // its mmap threshold and unmaps them on free, but the threshold
        // adapts upwards (to 32 MiB) once a large mapped block is freed, as
        // the PyPI wheel's start-up does: then whole tensors come from the
        // heap and each leaves a resident hole the next, differently sized,
        // may not fit. Measured on gpt2-medium-sized models under 2.15:
        // tp 4 peaked at 990 MB above start (the whole model: 841 MB)
        // without this, 273 MB on 1.13.
        utils::release_freed_host_memory();
      }
    }
  }
}

} // namespace lazy
} // namespace colossalai
