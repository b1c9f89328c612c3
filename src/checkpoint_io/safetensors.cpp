#include <colossalai/checkpoint_io/safetensors.h>

#include "mapped_reads.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <sstream>
#include <unordered_set>
#include <utility>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors stores little-endian data; big-endian hosts are unsupported"
#endif

namespace colossalai {
namespace checkpoint_io {
namespace safetensors {
namespace {

using Json = nlohmann::ordered_json;

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
/// Deepest legal nesting: root object > entry > shape array > number.
constexpr int kMaxJsonDepth = 3;
/// Most entries a shape may have; far above any real tensor's rank, it keeps
/// a hostile header from costing gigabytes of parsed JSON.
constexpr size_t kMaxRank = 1024;

struct DtypeName {
  const char* name;
  at::ScalarType dtype;
};

constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
};

const char* dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) {
      return d.name;
    }
  }
  return nullptr;
}

bool parse_dtype(const std::string& name, at::ScalarType* dtype) {
  for (const auto& d : kDtypes) {
    if (name == d.name) {
      *dtype = d.dtype;
      return true;
    }
  }
  return false;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << "]";
  return out.str();
}

/// A JSON number that is a non-negative integer fitting int64, or -1.
int64_t non_negative_int(const Json& v) {
  if (!v.is_number_unsigned()) {
    return -1;
  }
  uint64_t u = v.get<uint64_t>();
  return u > static_cast<uint64_t>(kInt64Max) ? -1 : static_cast<int64_t>(u);
}

TensorInfo parse_entry(
    const std::string& name,
    const Json& entry,
    int64_t data_bytes,
    const std::string& file) {
  const std::string where =
      "safetensors file '" + file + "': tensor '" + name + "' ";
  TORCH_CHECK(entry.is_object(), where, "is not described by a JSON object");
  TensorInfo info;
  info.name = name;

  auto dtype_it = entry.find("dtype");
  TORCH_CHECK(
      dtype_it != entry.end() && dtype_it->is_string(),
      where,
      "has no string \"dtype\"");
  const std::string& dtype = dtype_it->get_ref<const std::string&>();
  TORCH_CHECK(
      parse_dtype(dtype, &info.dtype),
      where,
      "has unknown dtype '",
      dtype,
      "' (expected F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)");

  auto shape_it = entry.find("shape");
  TORCH_CHECK(
      shape_it != entry.end() && shape_it->is_array(),
      where,
      "has no \"shape\" array");
  // The product of the non-zero dims must fit, so strides computed by
  // LibTorch never overflow even when another dim is 0.
  int64_t numel = 1;
  bool has_zero = false;
  for (const Json& dim : *shape_it) {
    int64_t d = non_negative_int(dim);
    TORCH_CHECK(
        d >= 0,
        where,
        "has a shape entry that is not a non-negative integer: ",
        dim.dump());
    info.shape.push_back(d);
    if (d == 0) {
      has_zero = true;
    } else {
      TORCH_CHECK(
          !__builtin_mul_overflow(numel, d, &numel),
          where,
          "has shape ",
          shape_string(info.shape),
          "... whose element count overflows");
    }
  }
  if (has_zero) {
    numel = 0;
  }
  int64_t nbytes = 0;
  TORCH_CHECK(
      !__builtin_mul_overflow(
          numel, static_cast<int64_t>(c10::elementSize(info.dtype)), &nbytes),
      where,
      "has shape ",
      shape_string(info.shape),
      " whose byte size overflows");

  auto offsets_it = entry.find("data_offsets");
  TORCH_CHECK(
      offsets_it != entry.end() && offsets_it->is_array() &&
          offsets_it->size() == 2,
      where,
      "has no \"data_offsets\" pair");
  info.begin = non_negative_int((*offsets_it)[0]);
  info.end = non_negative_int((*offsets_it)[1]);
  TORCH_CHECK(
      info.begin >= 0 && info.end >= 0,
      where,
      "has data_offsets that are not non-negative integers: ",
      offsets_it->dump());
  TORCH_CHECK(
      info.begin <= info.end,
      where,
      "has data_offsets [",
      info.begin,
      ", ",
      info.end,
      "] that end before they begin");
  TORCH_CHECK(
      info.end <= data_bytes,
      where,
      "has data_offsets [",
      info.begin,
      ", ",
      info.end,
      "] beyond the data section's ",
      data_bytes,
      " bytes (is the file truncated?)");
  TORCH_CHECK(
      info.end - info.begin == nbytes,
      where,
      "has data_offsets [",
      info.begin,
      ", ",
      info.end,
      "] spanning ",
      info.end - info.begin,
      " bytes, but dtype ",
      dtype,
      " and shape ",
      shape_string(info.shape),
      " need ",
      nbytes);
  return info;
}

Json parse_json(
    const uint8_t* begin,
    const uint8_t* end,
    const std::string& file) {
  // Keys seen so far in the object open at each depth: duplicates would make
  // the header ambiguous.
  std::vector<std::unordered_set<std::string>> keys(kMaxJsonDepth + 2);
  std::string tensor; // the top-level key being parsed
  size_t entries = 0; // in the array being parsed
  auto callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    // Bounding the depth bounds the parser's memory on hostile input.
    TORCH_CHECK(
        depth <= kMaxJsonDepth,
        "safetensors file '",
        file,
        "': header JSON is nested deeper than a safetensors header can be");
    if (depth == kMaxJsonDepth) {
      TORCH_CHECK(
          ++entries <= kMaxRank,
          "safetensors file '",
          file,
          "': tensor '",
          tensor,
          "' has an array of more than ",
          kMaxRank,
          " entries");
    }
    if (event == Json::parse_event_t::array_start) {
      entries = 0;
    } else if (event == Json::parse_event_t::object_start) {
      keys[depth + 1].clear();
    } else if (event == Json::parse_event_t::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      TORCH_CHECK(
          keys[depth].insert(key).second,
          "safetensors file '",
          file,
          "': header JSON repeats the key '",
          key,
          "'");
      if (depth == 1) {
        tensor = key;
      }
    }
    return true;
  };
  try {
    return Json::parse(begin, end, callback);
  } catch (const Json::exception& e) {
    TORCH_CHECK(
        false,
        "safetensors file '",
        file,
        "': header is not valid JSON: ",
        e.what());
  }
}

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
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      // Linux caps one write at just under 2 GiB.
      ssize_t r = ::write(fd_, p, std::min<size_t>(n, size_t(1) << 30));
      if (r < 0 && errno == EINTR) {
        continue;
      }
      TORCH_CHECK(
          r > 0,
          "cannot write '",
          path_,
          "': ",
          r < 0 ? std::strerror(errno) : "no progress");
      p += r;
      n -= static_cast<size_t>(r);
    }
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

Header parse_header(const uint8_t* data, size_t size, const std::string& file) {
  TORCH_CHECK(
      size >= 8,
      "safetensors file '",
      file,
      "' is truncated: ",
      size,
      " bytes, less than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= static_cast<uint64_t>(data[i]) << (8 * i);
  }
  TORCH_CHECK(
      n <= kMaxHeaderBytes,
      "safetensors file '",
      file,
      "' declares a header of ",
      n,
      " bytes, above the 100 MB limit (corrupt or not a safetensors file)");
  TORCH_CHECK(
      n <= size - 8,
      "safetensors file '",
      file,
      "' is truncated: the header needs ",
      n,
      " bytes after the length but the file has ",
      size - 8);

  Header header;
  header.data_offset = static_cast<int64_t>(8 + n);
  const int64_t data_bytes = static_cast<int64_t>(size) - header.data_offset;
  Json json = parse_json(data + 8, data + 8 + n, file);
  TORCH_CHECK(
      json.is_object(),
      "safetensors file '",
      file,
      "': header is JSON but not an object");

  for (auto it = json.begin(); it != json.end(); ++it) {
    const std::string& key = it.key();
    const Json& value = it.value();
    if (key == "__metadata__") {
      TORCH_CHECK(
          value.is_object(),
          "safetensors file '",
          file,
          "': \"__metadata__\" is not a JSON object");
      for (auto m = value.begin(); m != value.end(); ++m) {
        TORCH_CHECK(
            m.value().is_string(),
            "safetensors file '",
            file,
            "': metadata entry '",
            m.key(),
            "' is not a string");
        header.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    header.tensors.push_back(parse_entry(key, value, data_bytes, file));
  }

  // The spec requires the byte ranges to tile the data section; ties keep
  // header order, with empty tensors before the one starting at their offset.
  std::stable_sort(
      header.tensors.begin(),
      header.tensors.end(),
      [](const TensorInfo& a, const TensorInfo& b) {
        return std::make_pair(a.begin, a.end) < std::make_pair(b.begin, b.end);
      });
  int64_t cursor = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& info : header.tensors) {
    TORCH_CHECK(
        info.begin >= cursor,
        "safetensors file '",
        file,
        "': tensor '",
        info.name,
        "' bytes [",
        info.begin,
        ", ",
        info.end,
        ") overlap tensor '",
        previous ? previous->name : std::string(),
        "' bytes [",
        previous ? previous->begin : 0,
        ", ",
        previous ? previous->end : 0,
        ")");
    TORCH_CHECK(
        info.begin == cursor,
        "safetensors file '",
        file,
        "': data bytes [",
        cursor,
        ", ",
        info.begin,
        ") before tensor '",
        info.name,
        "' belong to no tensor");
    cursor = info.end;
    previous = &info;
  }
  TORCH_CHECK(
      cursor == data_bytes,
      "safetensors file '",
      file,
      "': the data section has ",
      data_bytes,
      " bytes but its tensors cover ",
      cursor);
  return header;
}

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

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    TORCH_CHECK(false, "cannot open '", path, "': ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, "cannot open '", path, "': not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
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
