#include <colossalai/checkpoint_io/checkpoint_io_base.h>
#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/model_state_hooks.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include "pickle_reader.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/serialize/archive.h>

#include <filesystem>

#include <sys/mman.h>

namespace colossalai {
namespace checkpoint_io {

namespace {

// The index file inside a sharded checkpoint directory, or "".
std::string find_index(
    const std::string& dir,
    const std::string& must_contain) {
  std::vector<std::string> found;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    auto name = e.path().filename().string();
    if (!detail::is_hidden(name) && name.size() > 11 &&
        name.substr(name.size() - 11) == ".index.json" &&
        name.find(must_contain) != std::string::npos) {
      found.push_back(e.path().string());
    }
  }
  TORCH_CHECK(
      found.size() <= 1,
      "checkpoint directory '",
      dir,
      "' holds several index files; pass the one to load");
  return found.empty() ? "" : found.front();
}

// The checkpoint file of a directory without an index, or "": Hugging
// Face's model.safetensors or pytorch_model.bin (a transformers directory
// also holds config.json and more), else its one file of a checkpoint
// format. Hidden files (temporaries of a killed save, journals) do not
// count.
std::string single_file(const std::string& dir) {
  for (const char* name : {"model.safetensors", "pytorch_model.bin"}) {
    const auto path = std::filesystem::path(dir) / name;
    if (std::filesystem::is_regular_file(path)) {
      return path.string();
    }
  }
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const auto ext = e.path().extension().string();
    if (e.is_regular_file() &&
        !detail::is_hidden(e.path().filename().string()) &&
        (ext == ".safetensors" || ext == ".bin" || ext == ".pt" ||
         ext == ".pth")) {
      files.push_back(e.path().string());
    }
  }
  return files.size() == 1 ? files.front() : "";
}

// Host memory for snapshots. Faulting in fresh pages is most of a first
// snapshot's cost (4 KiB at a time: 1.8 s for 670 MB on a VM here), so large
// buffers ask for transparent huge pages, and later saves reuse them.
c10::Storage host_buffer(size_t bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  if (bytes < kHuge) {
    return at::empty({static_cast<int64_t>(bytes)}, at::kByte).storage();
  }
  const size_t length = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = ::mmap(
      nullptr,
      length,
      PROT_READ | PROT_WRITE,
      MAP_PRIVATE | MAP_ANONYMOUS,
      -1,
      0);
  TORCH_CHECK(
      p != MAP_FAILED,
      "async save: cannot allocate ",
      bytes,
      " bytes of host memory for the snapshot");
  ::madvise(p, length, MADV_HUGEPAGE); // a hint; fine if refused
  auto* region = new std::pair<void*, size_t>(p, length);
  c10::DataPtr data(
      p,
      region,
      [](void* ctx) {
        auto* r = static_cast<std::pair<void*, size_t>*>(ctx);
        ::munmap(r->first, r->second);
        delete r;
      },
      c10::Device(c10::kCPU));
  return c10::Storage(
      c10::Storage::use_byte_size_t(),
      bytes,
      std::move(data),
      /*allocator=*/nullptr,
      /*resizable=*/false);
}

} // namespace

CheckpointIO::~CheckpointIO() {
  if (writer_.joinable()) {
    writer_.join();
  }
}

void CheckpointIO::synchronize() {
  if (writer_.joinable()) {
    writer_.join();
  }
  if (writer_error_) {
    auto e = writer_error_;
    writer_error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void CheckpointIO::run_maybe_async(bool async, std::function<void()> job) {
  synchronize(); // the next save waits for the previous one
  if (!async) {
    job();
    return;
  }
  writer_ = std::thread([this, job = std::move(job)]() {
    try {
      job();
    } catch (...) {
      writer_error_ = std::current_exception();
    }
  });
}

at::Tensor CheckpointIO::snapshot(const at::Tensor& t) {
  const auto src = t.detach();
  const auto bytes = static_cast<size_t>(src.numel()) * src.element_size();
  if (snapshot_cursor_ == snapshot_buffers_.size()) {
    snapshot_buffers_.emplace_back();
  }
  auto& buffer = snapshot_buffers_[snapshot_cursor_++];
  if (!buffer || buffer.nbytes() < bytes) {
    buffer = host_buffer(bytes);
  }
  auto out =
      at::empty({0}, src.options().device(at::kCPU))
          .set_(buffer, 0, src.sizes(), c10::contiguous_strides(src.sizes()));
  out.copy_(src);
  return out;
}

StateDict CheckpointIO::snapshot(const StateDict& state) {
  StateDict out;
  for (const auto& item : state) {
    out.insert(item.key(), snapshot(item.value()));
  }
  return out;
}

void CheckpointIO::save_model(
    interface::ModelWrapper& model,
    const std::string& checkpoint,
    const SaveModelOptions& options) {
  if (options.use_async()) {
    synchronize(); // the snapshot buffers are free again
    snapshot_cursor_ = 0;
  }
  TORCH_CHECK(
      options.size_per_shard() > 0,
      "save_model: size_per_shard must be > 0 MB, got ",
      options.size_per_shard());
  TORCH_CHECK(
      options.gather_dtensor(),
      "save_model: gather_dtensor(false) is not supported: checkpoints always hold "
      "full tensors (so they load at any world size and under any plugin)");
  // Every rank fails alike: the check reads only this rank's model (QLoRA's
  // refusal of a quantized base, NOTE [Model state hooks]).
  for (const auto& h : detail::model_state_hooks()) {
    const std::string why =
        h.save_refusal ? h.save_refusal(*model.unwrap()) : std::string();
    TORCH_CHECK(why.empty(), "save_model: ", why);
  }
  model.synchronize_weights(); // the last step's weights, all of them
  // Every rank takes part (state may have to be gathered); only writers
  // write.
  if (options.shard()) {
    save_sharded_model(model, checkpoint, options);
  } else {
    save_unsharded_model(model, checkpoint, options);
  }
  sync_point();
}

void CheckpointIO::load_model(
    interface::ModelWrapper& model,
    const std::string& checkpoint,
    bool strict) {
  synchronize();
  sync_point();
  // An update still in flight would overwrite what loads.
  model.synchronize_weights();
  const auto& path = checkpoint;
  TORCH_CHECK(
      detail::exists(path),
      "load_model: checkpoint '",
      checkpoint,
      "' does not exist");
  if (detail::is_dir(path)) {
    auto index = find_index(path, "model");
    if (!index.empty()) {
      load_sharded_model(model, index, strict);
      return;
    }
    auto file = single_file(path);
    TORCH_CHECK(
        !file.empty(),
        "load_model: directory '",
        path,
        "' has no index file (*model*.index.json), no model.safetensors or "
        "pytorch_model.bin, and not exactly one .safetensors / .bin / .pt "
        "file");
    load_unsharded_model(model, file, strict);
  } else if (
      path.size() > 11 && path.substr(path.size() - 11) == ".index.json") {
    load_sharded_model(model, path, strict);
  } else {
    load_unsharded_model(model, path, strict);
  }
}

void CheckpointIO::load_model_tensors(
    interface::ModelWrapper& model,
    const std::function<void()>& load) {
  synchronize();
  model.synchronize_weights(); // else an update in flight overwrites them
  load_in_model_scope(model, load);
}

void CheckpointIO::save_optimizer(
    interface::OptimizerWrapper& optimizer,
    const std::string& checkpoint,
    const SaveOptimizerOptions& options) {
  optimizer.synchronize_step(); // the state as the last step left it
  if (options.use_async()) {
    synchronize(); // the snapshot buffers are free again
    snapshot_cursor_ = 0;
  }
  TORCH_CHECK(
      options.size_per_shard() > 0,
      "save_optimizer: size_per_shard must be > 0 MB, got ",
      options.size_per_shard());
  TORCH_CHECK(
      options.gather_dtensor(),
      "save_optimizer: gather_dtensor(false) is not supported: checkpoints always hold "
      "full tensors (so they load at any world size and under any plugin)");
  if (options.shard()) {
    save_sharded_optimizer(optimizer, checkpoint, options);
  } else {
    save_unsharded_optimizer(optimizer, checkpoint, options);
  }
  sync_point();
}

void CheckpointIO::load_optimizer(
    interface::OptimizerWrapper& optimizer,
    const std::string& checkpoint) {
  synchronize();
  sync_point();
  // A skipped step's counts taken back before the state is replaced.
  optimizer.synchronize_step();
  const auto& path = checkpoint;
  TORCH_CHECK(
      detail::exists(path),
      "load_optimizer: checkpoint '",
      checkpoint,
      "' does not exist");
  if (detail::is_dir(path)) {
    auto index = find_index(path, "optim");
    TORCH_CHECK(
        !index.empty(),
        "load_optimizer: directory '",
        path,
        "' has no optimizer index (pytorch_optim.bin.index.json)");
    load_sharded_optimizer(optimizer, index);
  } else if (
      path.size() > 11 && path.substr(path.size() - 11) == ".index.json") {
    load_sharded_optimizer(optimizer, path);
  } else {
    load_unsharded_optimizer(optimizer, path);
  }
}

void CheckpointIO::save_lr_scheduler(
    const nn::lr_scheduler::LRScheduler& scheduler,
    const std::string& checkpoint) {
  synchronize();
  if (is_writer()) {
    // What Python's torch.save(scheduler.state_dict()) writes.
    const auto bytes = pickle_archive(scheduler.state_dict());
    detail::atomic_write_file(checkpoint, [&](const std::string& tmp) {
      detail::write_bytes(tmp, bytes);
    });
  }
  sync_point();
}

void CheckpointIO::load_lr_scheduler(
    nn::lr_scheduler::LRScheduler& scheduler,
    const std::string& checkpoint) {
  synchronize();
  sync_point();
  const auto& path = checkpoint;
  TORCH_CHECK(
      detail::exists(path) && !detail::is_dir(path),
      "load_lr_scheduler: checkpoint file '",
      checkpoint,
      "' does not exist");
  // Both formats are zip archives: the LibTorch archive that `save` wrote
  // before scheduler files followed Python holds a TorchScript module's
  // constants.pkl, a torch.save file does not.
  bool libtorch_archive = false;
  try {
    caffe2::serialize::PyTorchStreamReader reader(path);
    libtorch_archive = reader.hasRecord("constants.pkl");
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    TORCH_CHECK(
        false,
        "load_lr_scheduler: '",
        path,
        "' is not a scheduler checkpoint: ",
        error != nullptr ? error->what_without_backtrace() : e.what());
  }
  if (libtorch_archive) {
    torch::serialize::InputArchive archive;
    try {
      archive.load_from(path);
    } catch (const c10::Error& e) {
      TORCH_CHECK(
          false,
          "load_lr_scheduler: '",
          path,
          "' is not a scheduler checkpoint: ",
          e.what_without_backtrace());
    }
    scheduler.load(archive);
    return;
  }
  // Errors of the reader name the file.
  const c10::IValue state = detail::load_pickle(path);
  TORCH_CHECK(
      state.isGenericDict(),
      "load_lr_scheduler: '",
      path,
      "' holds a ",
      state.tagKind(),
      ", not a scheduler's state_dict()");
  try {
    scheduler.load_state_dict(state.toGenericDict());
  } catch (const c10::Error& e) {
    TORCH_CHECK(
        false, "load_lr_scheduler: '", path, "': ", e.what_without_backtrace());
  }
}

} // namespace checkpoint_io
} // namespace colossalai
