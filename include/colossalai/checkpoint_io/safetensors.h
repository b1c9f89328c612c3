#pragma once

/// The safetensors format (https://github.com/huggingface/safetensors):
/// 8-byte little-endian header length N, N bytes of JSON
/// `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
/// {str: str}}`, then the raw little-endian tensor bytes; offsets are relative
/// to the end of the header. Dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL.
///
/// Example:
/// \code
///   namespace st = colossalai::checkpoint_io::safetensors;
///   st::save_file("model.safetensors", model_state);
///   auto file = st::MappedFile::open("model.safetensors");
///   at::Tensor w = file->tensor("fc.weight"); // no copy: views the mapping
/// \endcode

#include <colossalai/checkpoint_io/state_dict.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace checkpoint_io {
namespace safetensors {

struct TensorInfo {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  /// Byte range relative to the start of the data section.
  int64_t begin = 0;
  int64_t end = 0;
};

struct Header {
  /// In file order of their data.
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  /// Offset of the data section from the start of the file (8 + N).
  int64_t data_offset = 0;
};

/// Parses and validates the header of a safetensors file whose first `size`
/// bytes are at `data` (`size` is the whole file's size: offsets are checked
/// against it). Throws c10::Error naming `file` and, where it applies, the
/// key: header length beyond the file or above 100 MB, invalid JSON, unknown
/// dtype, negative shape, byte range not matching dtype x shape, ranges
/// outside the file, overlapping, or leaving holes.
Header parse_header(const uint8_t* data, size_t size, const std::string& file);

/// Writes `tensors` (any device, layout or dtype from the list above) to
/// `path`, each tensor's bytes written once, straight from the tensor when it
/// is a contiguous CPU tensor. The header is padded with spaces to a multiple
/// of 8 bytes so tensor data stays aligned.
void save_file(
    const std::string& path,
    const StateDict& tensors,
    const std::map<std::string, std::string>& metadata = {});

/// A safetensors file mapped into memory; tensors view the mapping (no copy)
/// and keep it alive. The mapping is private copy-on-write, so writing to a
/// returned tensor never changes the file. The file must not shrink while
/// mapped: reading pages past its new end raises SIGBUS.
class MappedFile {
 public:
  static std::shared_ptr<MappedFile> open(const std::string& path);
  ~MappedFile();

  const Header& header() const {
    return header_;
  }
  const std::string& path() const {
    return path_;
  }
  bool contains(const std::string& name) const;
  /// Throws naming file and key when absent. Data that its writer left
  /// unaligned for the dtype (a header not padded to 8 bytes) is copied.
  at::Tensor tensor(const std::string& name);
  /// Every tensor, in file order.
  StateDict tensors();

 private:
  MappedFile() = default;
  std::string path_;
  void* base_ = nullptr;
  size_t size_ = 0;
  Header header_;
  std::map<std::string, size_t> index_;
  std::weak_ptr<MappedFile> self_;
};

/// Loads every tensor of `path` (views of a shared mapping).
StateDict load_file(const std::string& path);

} // namespace safetensors
} // namespace checkpoint_io
} // namespace colossalai
