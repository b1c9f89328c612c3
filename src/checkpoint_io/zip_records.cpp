#include <colossalai/checkpoint_io/mapped_reads.h>

#include "zip_records.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

namespace {

// Little-endian reads inside [0, size); false past the end.
struct Reader {
  const uint8_t* base;
  size_t size;
  bool u16(size_t at, uint32_t& v) const {
    if (at > size || size - at < 2) {
      return false;
    }
    v = base[at] | (uint32_t(base[at + 1]) << 8);
    return true;
  }
  bool u32(size_t at, uint32_t& v) const {
    if (at > size || size - at < 4) {
      return false;
    }
    v = base[at] | (uint32_t(base[at + 1]) << 8) |
        (uint32_t(base[at + 2]) << 16) | (uint32_t(base[at + 3]) << 24);
    return true;
  }
  bool u64(size_t at, uint64_t& v) const {
    uint32_t lo = 0, hi = 0;
    if (!u32(at, lo) || !u32(at + 4, hi)) {
      return false;
    }
    v = lo | (uint64_t(hi) << 32);
    return true;
  }
};

constexpr uint32_t kEocd = 0x06054b50, kEocd64 = 0x06064b50,
                   kLocator64 = 0x07064b50, kCentral = 0x02014b50,
                   kLocal = 0x04034b50, kMax32 = 0xffffffffu;

} // namespace

std::shared_ptr<ZipRecords> ZipRecords::open(const std::string& path) {
  // Non-blocking: a FIFO is refused below rather than waited on.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    return nullptr;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 22) {
    ::close(fd);
    return nullptr;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  // Private and writable, as safetensors maps: tensors may change in place
  // (copy on write) without touching the file.
  void* base =
      ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  if (base == MAP_FAILED) {
    ::close(fd);
    return nullptr;
  }
  register_mapping(base, size, fd); // closed with the mapping
  std::shared_ptr<ZipRecords> z(new ZipRecords());
  z->base_ = base;
  z->size_ = size;
  z->self_ = z;
  const Reader r{static_cast<const uint8_t*>(base), size};

  // End of central directory: the last signature within the final 64 KiB
  // (its comment is at most 65535 bytes).
  size_t eocd = size; // not found
  const size_t lowest = size > 22 + 65535 ? size - 22 - 65535 : 0;
  for (size_t at = size - 22 + 1; at-- > lowest;) {
    uint32_t sig = 0;
    if (r.u32(at, sig) && sig == kEocd) {
      eocd = at;
      break;
    }
  }
  if (eocd == size) {
    return z;
  }
  uint32_t count16 = 0, cd_size32 = 0, cd_offset32 = 0;
  if (!r.u16(eocd + 10, count16) || !r.u32(eocd + 12, cd_size32) ||
      !r.u32(eocd + 16, cd_offset32)) {
    return z;
  }
  uint64_t count = count16, cd_offset = cd_offset32;
  if (count16 == 0xffff || cd_offset32 == kMax32 || cd_size32 == kMax32) {
    // Zip64: the locator sits right before the end record.
    uint32_t sig = 0;
    uint64_t eocd64 = 0;
    if (eocd < 20 || !r.u32(eocd - 20, sig) || sig != kLocator64 ||
        !r.u64(eocd - 20 + 8, eocd64) || !r.u32(eocd64, sig) ||
        sig != kEocd64 || !r.u64(eocd64 + 32, count) ||
        !r.u64(eocd64 + 48, cd_offset)) {
      return z;
    }
  }
  size_t at = cd_offset;
  for (uint64_t i = 0; i < count; ++i) {
    uint32_t sig = 0, method = 0, comp32 = 0, size32 = 0, name_len = 0,
             extra_len = 0, comment_len = 0, local32 = 0;
    if (!r.u32(at, sig) || sig != kCentral || !r.u16(at + 10, method) ||
        !r.u32(at + 20, comp32) || !r.u32(at + 24, size32) ||
        !r.u16(at + 28, name_len) || !r.u16(at + 30, extra_len) ||
        !r.u16(at + 32, comment_len) || !r.u32(at + 42, local32) ||
        at + 46 + name_len + extra_len > size) {
      return z; // what was found so far is still right
    }
    std::string name(reinterpret_cast<const char*>(r.base + at + 46), name_len);
    uint64_t comp = comp32, uncomp = size32, local = local32;
    // Zip64 extra field: the 0xffffffff fields, in this order.
    size_t e = at + 46 + name_len;
    const size_t e_end = e + extra_len;
    while (e + 4 <= e_end) {
      uint32_t id = 0, len = 0;
      r.u16(e, id);
      r.u16(e + 2, len);
      if (id == 0x0001) {
        size_t f = e + 4;
        if (size32 == kMax32 && r.u64(f, uncomp)) {
          f += 8;
        }
        if (comp32 == kMax32 && r.u64(f, comp)) {
          f += 8;
        }
        if (local32 == kMax32) {
          r.u64(f, local);
        }
      }
      e += 4 + len;
    }
    at = e_end + comment_len;
    uint32_t lsig = 0, lname = 0, lextra = 0;
    if (method != 0 || comp != uncomp || !r.u32(local, lsig) ||
        lsig != kLocal || !r.u16(local + 26, lname) ||
        !r.u16(local + 28, lextra)) {
      continue; // compressed or odd: miniz reads it
    }
    const uint64_t data = local + 30 + lname + lextra;
    if (data > size || size - data < uncomp) {
      continue;
    }
    const auto slash = name.find('/');
    if (slash == std::string::npos) {
      continue;
    }
    z->entries_[name.substr(slash + 1)] =
        Entry{static_cast<size_t>(data), static_cast<size_t>(uncomp)};
  }
  return z;
}

ZipRecords::~ZipRecords() {
  if (base_ != nullptr) {
    unregister_mapping(base_);
    ::munmap(base_, size_);
  }
}

bool ZipRecords::storage(const std::string& name, c10::Storage& out) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return false;
  }
  auto* data = static_cast<uint8_t*>(base_) + it->second.offset;
  // The storage keeps the mapping alive.
  auto* keep = new std::shared_ptr<const ZipRecords>(self_.lock());
  c10::DataPtr ptr(
      data,
      keep,
      [](void* ctx) {
        delete static_cast<std::shared_ptr<const ZipRecords>*>(ctx);
      },
      c10::Device(c10::kCPU));
  out = c10::Storage(
      c10::Storage::use_byte_size_t(),
      it->second.size,
      std::move(ptr),
      /*allocator=*/nullptr,
      /*resizable=*/false);
  return true;
}

std::vector<std::string> ZipRecords::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) {
    out.push_back(e.first);
  }
  return out;
}

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
