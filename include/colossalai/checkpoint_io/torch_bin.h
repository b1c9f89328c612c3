#pragma once

/// PyTorch `.bin` state-dict files: a pickled dict of tensors in the zip
/// format that Python's `torch.save` writes and `torch.load` reads.

#include <colossalai/checkpoint_io/state_dict.h>

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

namespace colossalai {
namespace checkpoint_io {

/// Writes `tensors` as a dict {name: tensor} that Python's torch.load reads.
void save_bin(const std::string& path, const StateDict& tensors);

/// A torch.save archive of `value` (dicts, lists, tuples, strings, numbers,
/// None, tensors) as Python pickles them: no LibTorch type tags, which
/// torch.load refuses under its default weights_only=True since PyTorch 2.6
/// (LibTorch's pickle_save writes them). Optimizer checkpoints are written
/// this way.
std::vector<char> pickle_archive(const c10::IValue& value);

/// Reads a dict of tensors written by save_bin or by Python's torch.save.
/// Throws naming the file when it is missing, truncated or not a dict of
/// tensors.
StateDict load_bin(const std::string& path);

} // namespace checkpoint_io
} // namespace colossalai
