// Reading safetensors files: MappedFile maps a file and views (or, when
// unaligned, copies) its tensors; load_file.

#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/mapped_reads.h>
#include <colossalai/checkpoint_io/safetensors.h>

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace colossalai {
namespace checkpoint_io {
namespace safetensors {

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  int64_t file_size = 0;
  const int fd = checkpoint_io::detail::open_regular(path, &file_size);
  const size_t size = static_cast<size_t>(file_size);
  if (size < 8) {
    ::close(fd);
    TORCH_CHECK(
        false,
        "safetensors file '",
        path,
        "' is truncated: ",
        size,
        " bytes, less than the 8-byte header length");
  }
  // Private and writable: tensors may be modified in place (copy on write)
  // without touching the file.
  void* base =
      ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  int err = errno;
  if (base == MAP_FAILED) {
    ::close(fd);
  }
  TORCH_CHECK(
      base != MAP_FAILED, "cannot map '", path, "': ", std::strerror(err));
  // Loads read through the descriptor (NOTE [Loads read into the
  // parameters]); it is closed with the mapping.
  checkpoint_io::detail::register_mapping(base, size, fd);

  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = path;
  file->base_ = base;
  file->size_ = size;
  file->header_ = parse_header(static_cast<const uint8_t*>(base), size, path);
  for (size_t i = 0; i < file->header_.tensors.size(); ++i) {
    file->index_.emplace(file->header_.tensors[i].name, i);
  }
  file->self_ = file;
  return file;
}

MappedFile::~MappedFile() {
  if (base_ != nullptr) {
    checkpoint_io::detail::unregister_mapping(base_);
    ::munmap(base_, size_);
  }
}

bool MappedFile::contains(const std::string& name) const {
  return index_.count(name) != 0;
}

at::Tensor MappedFile::tensor(const std::string& name) {
  auto it = index_.find(name);
  TORCH_CHECK(
      it != index_.end(),
      "safetensors file '",
      path_,
      "' has no tensor '",
      name,
      "'");
  const TensorInfo& info = header_.tensors[it->second];
  uint8_t* data =
      static_cast<uint8_t*>(base_) + header_.data_offset + info.begin;
  const auto options = at::TensorOptions().dtype(info.dtype);
  const size_t item = c10::elementSize(info.dtype);
  if (reinterpret_cast<uintptr_t>(data) % item != 0) {
    // Only writers that do not pad the header get here; kernels may assume
    // element-aligned data, so these tensors are copied instead of viewed.
    at::Tensor copy = at::empty(info.shape, options);
    std::memcpy(
        copy.data_ptr(), data, static_cast<size_t>(info.end - info.begin));
    return copy;
  }
  std::shared_ptr<MappedFile> keep = self_.lock();
  return at::from_blob(
      data, info.shape, [keep](void*) {}, options);
}

StateDict MappedFile::tensors() {
  StateDict out;
  out.reserve(header_.tensors.size());
  for (const TensorInfo& info : header_.tensors) {
    out.insert(info.name, tensor(info.name));
  }
  return out;
}

StateDict load_file(const std::string& path) {
  return MappedFile::open(path)->tensors();
}

} // namespace safetensors
} // namespace checkpoint_io
} // namespace colossalai
