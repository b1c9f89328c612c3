#include <colossalai/checkpoint_io/mapped_reads.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

void populate(const at::Tensor& t) {
#ifdef MADV_POPULATE_READ
  constexpr int kPopulateRead = MADV_POPULATE_READ;
#else
  constexpr int kPopulateRead = 22; // Linux >= 5.14
#endif
  if (!t.defined() || !t.device().is_cpu() || t.numel() == 0 ||
      !t.is_contiguous()) {
    return;
  }
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = begin & ~(page - 1);
  const uintptr_t end = begin + static_cast<uintptr_t>(t.nbytes());
  // Best effort: an older kernel refuses (EINVAL) and the copy faults the
  // pages in one by one as before.
  ::madvise(reinterpret_cast<void*>(first), end - first, kPopulateRead);
}

namespace {

// A fresh destination's pages are faulted in one 4 KiB page at a time as
// the read fills them; on the VMs here that costs more than the read
// (2.47 GB: 0.96 s into new memory, 0.16 s into memory already mapped).
// Mapping them in with one call first is cheaper (0.70 s for the same
// 2.47 GB). Best effort: a kernel without MADV_POPULATE_WRITE (before
// Linux 5.14) refuses, and the read faults the pages in as before.
void populate_for_write(char* out, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
  constexpr int kPopulateWrite = 23;
#endif
  constexpr size_t kWorthIt = size_t(1) << 20;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<uintptr_t>(out) + page - 1) & ~(page - 1);
  const auto end = (reinterpret_cast<uintptr_t>(out) + bytes) & ~(page - 1);
  if (bytes >= kWorthIt && begin < end) {
    ::madvise(reinterpret_cast<void*>(begin), end - begin, kPopulateWrite);
  }
}

// NOTE [Loads read into the parameters]
// Copying a parameter out of a mapped checkpoint walks the mapping 4 KiB
// page by page; on the VMs here each page costs a TLB miss or a fault worth
// microseconds, so a 256 MB load takes 40-200 ms (2-8x a plain read of the
// file). A pread() into the parameter copies from the page cache through
// the kernel's own mapping: 29 ms. Mappings of checkpoint files register
// their descriptor here, and loads read a mapped tensor's bytes straight
// into its destination.
struct Mapping {
  size_t size = 0;
  int fd = -1;
};
std::mutex g_mappings_mu;
std::map<uintptr_t, Mapping> g_mappings;

bool read_fully(int fd, char* out, size_t bytes, off_t offset) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t got = ::pread(
        fd, out + done, bytes - done, offset + static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got <= 0) {
      return false;
    }
    done += static_cast<size_t>(got);
  }
  return true;
}

// NOTE [Copies just past their source]
// The kernel copies a pread out of a page-cache page with `rep movsb`. On
// AMD EPYC (measured on a 2-core VM) that copy runs at a quarter of its
// speed (1.7-2.5 against 7-8 GB/s) when the destination lies 1-31 bytes
// past the source modulo a page, whatever else the alignment. A tensor
// above glibc's mmap threshold starts 64 bytes into a page, so one whose
// file offset is 33-63 bytes into a page lands in that band (writers pad
// the safetensors header to 8 bytes; ours pads to 64). There the read goes
// through a 1 MiB buffer at the source's page offset and user space copies
// it on (glibc's memcpy avoids the band): 4.6-5.9 GB/s.
bool just_past(const char* out, off_t offset) {
  const auto gap =
      (reinterpret_cast<uintptr_t>(out) - static_cast<uintptr_t>(offset)) &
      4095;
  return gap >= 1 && gap < 64;
}

bool read_bounced(int fd, char* out, size_t bytes, off_t offset) {
  constexpr size_t kChunk = 1 << 20; // stays in cache between the copies
  std::unique_ptr<char[]> buffer(new char[kChunk + 4096]);
  const auto start = reinterpret_cast<uintptr_t>(buffer.get());
  char* at = buffer.get() +
      ((static_cast<uintptr_t>(offset) - start) & 4095); // same page offset
  for (size_t done = 0; done < bytes;) {
    const size_t len = std::min(kChunk, bytes - done);
    if (!read_fully(fd, at, len, offset + static_cast<off_t>(done))) {
      return false;
    }
    std::memcpy(out + done, at, len);
    done += len;
  }
  return true;
}

} // namespace

void register_mapping(const void* base, size_t size, int fd) {
  std::lock_guard<std::mutex> lock(g_mappings_mu);
  g_mappings[reinterpret_cast<uintptr_t>(base)] = Mapping{size, fd};
}

void unregister_mapping(const void* base) {
  std::lock_guard<std::mutex> lock(g_mappings_mu);
  auto it = g_mappings.find(reinterpret_cast<uintptr_t>(base));
  if (it != g_mappings.end()) {
    ::close(it->second.fd);
    g_mappings.erase(it);
  }
}

bool read_mapped_into(at::Tensor& dst, const at::Tensor& src) {
  constexpr int64_t kSmall = 64 << 10; // a copy is as fast below this
  if (!dst.defined() || !src.defined() || !dst.device().is_cpu() ||
      !src.device().is_cpu() || !dst.is_contiguous() || !src.is_contiguous() ||
      dst.scalar_type() != src.scalar_type() || dst.numel() != src.numel() ||
      static_cast<int64_t>(src.nbytes()) < kSmall) {
    return false;
  }
  const auto at = reinterpret_cast<uintptr_t>(src.data_ptr());
  const size_t bytes = static_cast<size_t>(src.nbytes());
  std::lock_guard<std::mutex> lock(g_mappings_mu); // the fd stays open
  auto it = g_mappings.upper_bound(at);
  if (it == g_mappings.begin()) {
    return false;
  }
  --it;
  const uintptr_t base = it->first;
  if (at + bytes > base + it->second.size) {
    return false;
  }
  auto* out = static_cast<char*>(dst.data_ptr());
  populate_for_write(out, bytes);
  const auto offset = static_cast<off_t>(at - base);
  const bool ok = just_past(out, offset)
      ? read_bounced(it->second.fd, out, bytes, offset)
      : read_fully(it->second.fd, out, bytes, offset);
  if (!ok) {
    return false; // the caller copies from the mapping instead
  }
  dst.unsafeGetTensorImpl()->bump_version(); // as an in-place copy_ would
  return true;
}

void release_mapped(const at::Tensor& src) {
  if (!src.defined() || !src.device().is_cpu() || !src.has_storage() ||
      !src.is_contiguous() || src.nbytes() == 0) {
    return;
  }
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto at = reinterpret_cast<uintptr_t>(src.data_ptr());
  const uintptr_t begin = (at + page - 1) & ~(page - 1);
  const uintptr_t end = (at + static_cast<uintptr_t>(src.nbytes())) & ~(page - 1);
  if (begin >= end) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_mappings_mu);
  auto it = g_mappings.upper_bound(at);
  if (it == g_mappings.begin()) {
    return;
  }
  --it;
  // Only pages of a registered file mapping: dropping those of anonymous
  // memory would zero them.
  if (end > it->first + it->second.size) {
    return;
  }
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

void read_into(at::Tensor& dst, const at::Tensor& src) {
  if (read_mapped_into(dst, src)) {
    return;
  }
  populate(src);
  dst.copy_(src);
  release_mapped(src);
}

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
