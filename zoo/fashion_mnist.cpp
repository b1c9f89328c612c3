#include <zoo/fashion_mnist.h>

#include <torch/torch.h>

#include <sys/stat.h>
#include <zlib.h>

#include <cstdio>
#include <vector>

namespace colossalai {
namespace zoo {

namespace {

constexpr uint32_t kImageMagic = 0x00000803; // ubyte, 3 dimensions
constexpr uint32_t kLabelMagic = 0x00000801; // ubyte, 1 dimension
constexpr const char* kInstallHint =
    "install the Debian package dataset-fashion-mnist "
    "(apt-get install dataset-fashion-mnist) or pass the directory that "
    "holds the IDX files";

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// Decompresses the whole file. Sizes are checked by the caller against the
// IDX header, so a stream that ends early is caught either here (zlib
// reports it) or there (too few bytes).
std::vector<uint8_t> read_gz(const std::string& path) {
  TORCH_CHECK(
      is_file(path), "FashionMNIST: missing file '", path, "'; ", kInstallHint);
  gzFile file = gzopen(path.c_str(), "rb");
  TORCH_CHECK(file != nullptr, "FashionMNIST: cannot open '", path, "'");
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> chunk(1 << 20);
  while (true) {
    const int n =
        gzread(file, chunk.data(), static_cast<unsigned>(chunk.size()));
    if (n <= 0) {
      int errnum = Z_OK;
      const char* msg = gzerror(file, &errnum);
      if (n < 0 || errnum != Z_OK) {
        std::string what = msg != nullptr ? msg : "unknown zlib error";
        // zlib prefixes the message with the path, which we print anyway.
        const std::string prefix = path + ": ";
        if (what.compare(0, prefix.size(), prefix) == 0) {
          what.erase(0, prefix.size());
        }
        gzclose(file);
        TORCH_CHECK(
            false,
            "FashionMNIST: '",
            path,
            "' is corrupt or truncated (zlib: ",
            what,
            ")");
      }
      break;
    }
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + n);
  }
  gzclose(file);
  return bytes;
}

uint32_t read_be32(const std::vector<uint8_t>& bytes, size_t offset) {
  return (uint32_t{bytes[offset]} << 24) | (uint32_t{bytes[offset + 1]} << 16) |
      (uint32_t{bytes[offset + 2]} << 8) | uint32_t{bytes[offset + 3]};
}

void check_header(
    const std::string& path,
    const std::vector<uint8_t>& bytes,
    size_t header_bytes) {
  TORCH_CHECK(
      bytes.size() >= header_bytes,
      "FashionMNIST: '",
      path,
      "' is truncated: ",
      bytes.size(),
      " bytes after decompression, shorter than the ",
      header_bytes,
      "-byte IDX header");
}

void check_size(
    const std::string& path,
    const std::vector<uint8_t>& bytes,
    size_t expected) {
  TORCH_CHECK(
      bytes.size() >= expected,
      "FashionMNIST: '",
      path,
      "' is truncated: expected ",
      expected,
      " bytes after decompression, got ",
      bytes.size());
  TORCH_CHECK(
      bytes.size() == expected,
      "FashionMNIST: '",
      path,
      "' is corrupt: expected ",
      expected,
      " bytes after decompression, got ",
      bytes.size());
}

at::Tensor read_images(const std::string& path) {
  auto bytes = read_gz(path);
  check_header(path, bytes, 16);
  const uint32_t magic = read_be32(bytes, 0);
  TORCH_CHECK(
      magic == kImageMagic,
      "FashionMNIST: '",
      path,
      "' is not an IDX image file (magic ",
      hex32(magic),
      ", expected ",
      hex32(kImageMagic),
      ")");
  const uint32_t count = read_be32(bytes, 4);
  const uint32_t rows = read_be32(bytes, 8);
  const uint32_t cols = read_be32(bytes, 12);
  TORCH_CHECK(
      rows == FashionMNIST::kRows && cols == FashionMNIST::kCols,
      "FashionMNIST: '",
      path,
      "' holds ",
      rows,
      "x",
      cols,
      " images, expected 28x28");
  check_size(path, bytes, 16 + size_t{count} * rows * cols);
  // from_blob borrows `bytes`; the float conversion copies before it dies.
  auto raw = torch::from_blob(
      bytes.data() + 16,
      {int64_t{count}, 1, FashionMNIST::kRows, FashionMNIST::kCols},
      torch::kUInt8);
  return raw.to(torch::kFloat)
      .div_(255.0)
      .sub_(FashionMNIST::kMean)
      .div_(FashionMNIST::kStd);
}

at::Tensor read_labels(const std::string& path) {
  auto bytes = read_gz(path);
  check_header(path, bytes, 8);
  const uint32_t magic = read_be32(bytes, 0);
  TORCH_CHECK(
      magic == kLabelMagic,
      "FashionMNIST: '",
      path,
      "' is not an IDX label file (magic ",
      hex32(magic),
      ", expected ",
      hex32(kLabelMagic),
      ")");
  const uint32_t count = read_be32(bytes, 4);
  check_size(path, bytes, 8 + size_t{count});
  auto labels =
      torch::from_blob(bytes.data() + 8, {int64_t{count}}, torch::kUInt8)
          .to(torch::kLong);
  if (count > 0) {
    const int64_t max_label = labels.max().item<int64_t>();
    TORCH_CHECK(
        max_label < FashionMNIST::kNumClasses,
        "FashionMNIST: '",
        path,
        "' is corrupt: label ",
        max_label,
        " is outside [0, 9]");
  }
  return labels;
}

} // namespace

FashionMNIST::FashionMNIST(const std::string& root, Mode mode) : mode_(mode) {
  TORCH_CHECK(
      is_directory(root),
      "FashionMNIST: directory '",
      root,
      "' does not exist; ",
      kInstallHint);
  const std::string prefix =
      root + "/" + (mode == Mode::kTrain ? "train" : "t10k");
  const std::string images_path = prefix + "-images-idx3-ubyte.gz";
  const std::string labels_path = prefix + "-labels-idx1-ubyte.gz";
  // Check both names first so a half-installed directory reports the
  // missing file rather than whichever happened to be read first.
  TORCH_CHECK(
      is_file(images_path),
      "FashionMNIST: missing file '",
      images_path,
      "'; ",
      kInstallHint);
  TORCH_CHECK(
      is_file(labels_path),
      "FashionMNIST: missing file '",
      labels_path,
      "'; ",
      kInstallHint);
  images_ = read_images(images_path);
  labels_ = read_labels(labels_path);
  TORCH_CHECK(
      images_.size(0) == labels_.size(0),
      "FashionMNIST: '",
      images_path,
      "' has ",
      images_.size(0),
      " images but '",
      labels_path,
      "' has ",
      labels_.size(0),
      " labels");
}

torch::data::Example<> FashionMNIST::get(size_t index) {
  TORCH_CHECK(
      index < static_cast<size_t>(images_.size(0)),
      "FashionMNIST: index ",
      index,
      " out of range for size ",
      images_.size(0));
  const auto i = static_cast<int64_t>(index);
  return {images_[i], labels_[i]};
}

c10::optional<size_t> FashionMNIST::size() const {
  return static_cast<size_t>(images_.size(0));
}

std::string FashionMNIST::default_root() {
  return "/usr/share/datasets/fashion-mnist";
}

const char* FashionMNIST::class_name(int64_t label) {
  static const char* const kNames[kNumClasses] = {
      "T-shirt/top",
      "Trouser",
      "Pullover",
      "Dress",
      "Coat",
      "Sandal",
      "Shirt",
      "Sneaker",
      "Bag",
      "Ankle boot"};
  TORCH_CHECK(
      label >= 0 && label < kNumClasses,
      "FashionMNIST: label ",
      label,
      " is outside [0, 9]");
  return kNames[label];
}

} // namespace zoo
} // namespace colossalai
