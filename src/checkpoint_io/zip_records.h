#pragma once

// Direct access to the stored (uncompressed) records of a zip archive
// through a memory mapping (internal).

#include <c10/core/Storage.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

/// The records a torch.save archive stores uncompressed (all of its tensor
/// data), found from the zip central directory and served as storages that
/// view a private mapping of the file: a load copies each byte once, from
/// the page cache into the parameter, instead of going through miniz (a
/// buffered read, a fresh buffer per record and a byte-wise CRC-32, 0.3 GB/s
/// here). CRCs are not checked, as safetensors has none. Anything
/// unexpected (a compressed record, an inconsistent directory) leaves the
/// record out and the caller reads it through miniz, whose errors name the
/// problem.
class ZipRecords {
 public:
  /// Maps `path`; empty (never throws) when it cannot be mapped or parsed.
  static std::shared_ptr<ZipRecords> open(const std::string& path);
  ~ZipRecords();

  /// A storage over the record `name` (the archive's path without its
  /// first component, as PyTorchStreamReader names it, e.g. "data/0");
  /// false when the record is not served here.
  bool storage(const std::string& name, c10::Storage& out) const;
  /// The records served here.
  std::vector<std::string> names() const;

 private:
  struct Entry {
    size_t offset = 0;
    size_t size = 0;
  };
  ZipRecords() = default;
  void* base_ = nullptr;
  size_t size_ = 0;
  std::unordered_map<std::string, Entry> entries_;
  std::weak_ptr<ZipRecords> self_;
};

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
