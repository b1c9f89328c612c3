#pragma once

/// Fashion-MNIST as a torch::data dataset, read straight from the gzipped
/// IDX files that the Debian package dataset-fashion-mnist installs in
/// /usr/share/datasets/fashion-mnist/:
///   train-images-idx3-ubyte.gz  train-labels-idx1-ubyte.gz
///   t10k-images-idx3-ubyte.gz   t10k-labels-idx1-ubyte.gz
/// Uncompressed files with the same names work too (zlib reads them
/// transparently).
///
/// Example:
/// \code
///   using colossalai::zoo::FashionMNIST;
///   auto train = FashionMNIST(FashionMNIST::default_root(),
///                             FashionMNIST::Mode::kTrain)
///                    .map(torch::data::transforms::Stack<>());
/// \endcode

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace colossalai {
namespace zoo {

/// The whole split is decoded into memory at construction (60,000 images
/// are 188 MB as float), so `get` is a cheap slice and the dataset can be
/// shared by distributed samplers without re-reading files.
class FashionMNIST : public torch::data::datasets::Dataset<FashionMNIST> {
 public:
  enum class Mode { kTrain, kTest };

  /// Pixel mean and standard deviation of the training split (after
  /// scaling to [0, 1]), used to normalise images.
  static constexpr double kMean = 0.2860;
  static constexpr double kStd = 0.3530;
  static constexpr int64_t kNumClasses = 10;
  static constexpr int64_t kRows = 28;
  static constexpr int64_t kCols = 28;

  /// Loads one split from `root`. Throws c10::Error naming the path when
  /// the directory or a file is missing, and naming the file when it is
  /// corrupt, truncated, or not an IDX file of the expected kind.
  explicit FashionMNIST(
      const std::string& root = default_root(),
      Mode mode = Mode::kTrain);

  /// (image [1, 28, 28] float normalised as (x/255 - kMean)/kStd,
  ///  label [] int64 in [0, 9]).
  torch::data::Example<> get(size_t index) override;

  c10::optional<size_t> size() const override;

  bool is_train() const {
    return mode_ == Mode::kTrain;
  }

  /// All images [N, 1, 28, 28] float, normalised.
  const at::Tensor& images() const {
    return images_;
  }

  /// All labels [N] int64.
  const at::Tensor& labels() const {
    return labels_;
  }

  /// Where the Debian package installs the files.
  static std::string default_root();

  /// Human-readable class name for a label in [0, 9] ("T-shirt/top", ...).
  static const char* class_name(int64_t label);

 private:
  Mode mode_;
  at::Tensor images_;
  at::Tensor labels_;
};

} // namespace zoo
} // namespace colossalai
