// Writing safetensors files: the header's JSON and padding, then each
// tensor's bytes through a buffered file writer.

#include <colossalai/checkpoint_io/safetensors.h>

#include "../utils/fd_io.h"
#include "safetensors_internal.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

namespace colossalai {
namespace checkpoint_io {
namespace safetensors {
namespace {

using detail::dtype_name;
using detail::Json;

/// Writes whole buffers to a file descriptor, gathering small ones so that a
/// state dict of many small tensors costs few system calls.
class FileWriter {
 public:
  explicit FileWriter(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TORCH_CHECK(
        fd_ >= 0,
        "cannot open '",
        path,
        "' for writing: ",
        std::strerror(errno));
    buffer_.reserve(kBufferBytes);
  }
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  ~FileWriter() {
    if (fd_ >= 0) {
      ::close(fd_);
    }
  }

  void write(const void* data, size_t n) {
    if (n >= kDirectBytes) {
      flush();
      write_all(data, n);
      return;
    }
    if (buffer_.size() + n > kBufferBytes) {
      flush();
    }
    const char* p = static_cast<const char*>(data);
    buffer_.insert(buffer_.end(), p, p + n);
  }

  void close() {
    flush();
    int fd = fd_;
    fd_ = -1;
    TORCH_CHECK(
        ::close(fd) == 0, "cannot write '", path_, "': ", std::strerror(errno));
  }

 private:
  static constexpr size_t kBufferBytes = 4 << 20;
  static constexpr size_t kDirectBytes = 1 << 20;

  void flush() {
    if (!buffer_.empty()) {
      write_all(buffer_.data(), buffer_.size());
      buffer_.clear();
    }
  }

  void write_all(const void* data, size_t n) {
    const int err = utils::write_fully(fd_, data, n);
    TORCH_CHECK(err == 0, "cannot write '", path_, "': ", std::strerror(err));
  }

  std::string path_;
  int fd_ = -1;
  std::vector<char> buffer_;
};

/// Strided, CPU, resolved bits and contiguous: a tensor whose bytes can be
/// written straight from data_ptr (no copy when `t` already is one).
at::Tensor writable(const at::Tensor& t) {
  at::Tensor out = t;
  if (out.layout() != at::kStrided) {
    out = out.to_dense();
  }
  if (!out.is_cpu()) {
    out = out.cpu();
  }
  out = out.resolve_neg();
  if (!out.is_contiguous()) {
    out = out.contiguous();
  }
  return out;
}

} // namespace

void save_file(
    const std::string& path,
    const StateDict& tensors,
    const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& kv : metadata) {
      meta[kv.first] = kv.second;
    }
    header["__metadata__"] = std::move(meta);
  }
  int64_t offset = 0;
  for (const auto& item : tensors) {
    const std::string& name = item.key();
    const at::Tensor& t = item.value();
    TORCH_CHECK(
        name != "__metadata__",
        "cannot save to '",
        path,
        "': \"__metadata__\" is reserved and cannot name a tensor");
    TORCH_CHECK(
        t.defined(),
        "cannot save to '",
        path,
        "': tensor '",
        name,
        "' is undefined");
    const char* dtype = dtype_name(t.scalar_type());
    TORCH_CHECK(
        dtype != nullptr,
        "cannot save to '",
        path,
        "': tensor '",
        name,
        "' has dtype ",
        t.scalar_type(),
        ", which safetensors files here do not hold (F64 F32 F16 BF16 I64 I32 "
        "I16 I8 U8 BOOL)");
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    Json entry = Json::object();
    entry["dtype"] = dtype;
    entry["shape"] = t.sizes().vec();
    entry["data_offsets"] = Json::array({offset, offset + nbytes});
    header[name] = std::move(entry);
    offset += nbytes;
  }

  std::string text;
  try {
    text = header.dump(-1, ' ', false, Json::error_handler_t::strict);
  } catch (const Json::exception& e) {
    TORCH_CHECK(
        false,
        "cannot save to '",
        path,
        "': a tensor name or metadata string is not valid UTF-8 (",
        e.what(),
        ")");
  }
  // Pad so that the data starts on a cache line (8 + N a multiple of 64;
  // the format asks for 8): then a tensor whose bytes are a multiple of 64
  // never sits just past its parameter's page offset, where the kernel's
  // copy of a load is slow (NOTE [Copies just past their source]).
  text.append((64 - (8 + text.size()) % 64) % 64, ' ');
  const uint64_t n = text.size();
  char length[8];
  for (int i = 0; i < 8; ++i) {
    length[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  }

  FileWriter out(path);
  out.write(length, sizeof(length));
  out.write(text.data(), text.size());
  for (const auto& item : tensors) {
    if (item.value().numel() == 0) {
      continue;
    }
    // One tensor at a time, so device tensors are staged on the host singly.
    at::Tensor t = writable(item.value());
    out.write(t.data_ptr(), t.numel() * t.element_size());
  }
  out.close();
}

} // namespace safetensors
} // namespace checkpoint_io
} // namespace colossalai
