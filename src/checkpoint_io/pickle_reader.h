#pragma once

// The hardened reader of torch.save archives, for optimizer states and other
// non-tensor-dict pickles (internal; NOTE [Reading .bin files]).

#include <ATen/core/ivalue.h>

#include <string>

namespace caffe2 {
namespace serialize {
class PyTorchStreamReader;
} // namespace serialize
} // namespace caffe2

namespace colossalai {
namespace checkpoint_io {
namespace detail {

/// The object a zip archive written by Python's torch.save or LibTorch's
/// pickle_save holds: dicts (str or int keys), lists, tuples, strings,
/// numbers, bools, None and tensors. Any other Python object, nesting deeper
/// than 32 levels, or a malformed file raise an error naming `path`; nothing
/// the file names is run.
c10::IValue load_pickle(const std::string& path);

/// The same from an open archive; `name` is used in errors.
c10::IValue load_pickle(
    caffe2::serialize::PyTorchStreamReader& archive,
    const std::string& name);

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
