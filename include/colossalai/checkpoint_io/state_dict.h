#pragma once

#include <ATen/ATen.h>
#include <torch/ordered_dict.h>

#include <string>

namespace colossalai {
namespace checkpoint_io {

/// Name -> tensor, in insertion order (the module's own dotted names for
/// models, e.g. "blocks.0.qkv.weight").
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

} // namespace checkpoint_io
} // namespace colossalai
