// libFuzzer target for the hardened unpickler and the optimizer-state path
// (build and run with fuzz/run.sh pickle). Each input is the data.pkl of a
// torch.save archive built in memory, whose storage records data/0 .. data/3
// hold 4 KiB each. The object read is loaded, as load_optimizer does, into a
// small AdamW; a dict of tensors is read as load_model does and every tensor
// is summed, so the sanitizers see every byte a tensor claims. Any input must
// be accepted or refused with c10::Error; anything else is a finding.

#include <colossalai/checkpoint_io/optimizer_state.h>

#include "../src/checkpoint_io/pickle_reader.h"

#include <ATen/Parallel.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <sstream>
#include <string>

namespace ck = colossalai::checkpoint_io;

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  at::set_num_threads(1);
  // LibTorch initialises lazily on first use; do it before the leak checker
  // starts watching single inputs.
  at::ones({2}).sum().item<double>();
  return 0;
}

namespace {

std::string archive_with(const uint8_t* data, size_t size) {
  std::string zip;
  caffe2::serialize::PyTorchStreamWriter writer(
      [&](const void* p, size_t n) -> size_t {
        zip.append(static_cast<const char*>(p), n);
        return n;
      });
  writer.writeRecord("data.pkl", data, size);
  static const std::string payload(4096, '\x3f');
  for (int i = 0; i < 4; ++i) {
    writer.writeRecord(
        "data/" + std::to_string(i), payload.data(), payload.size());
  }
  writer.writeEndOfFile();
  return zip;
}

void touch_tensors(const c10::IValue& v, double& total, int depth = 0) {
  if (depth > 40) {
    __builtin_trap(); // the reader promised a depth limit of 32
  }
  if (v.isTensor()) {
    total += v.toTensor().to(at::kDouble).sum().item<double>();
  } else if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict()) {
      touch_tensors(kv.value(), total, depth + 1);
    }
  } else if (v.isList()) {
    for (const auto& item : v.toList()) {
      touch_tensors(item, total, depth + 1);
    }
  } else if (v.isTuple()) {
    for (const auto& item : v.toTupleRef().elements()) {
      touch_tensors(item, total, depth + 1);
    }
  }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string zip = archive_with(data, size);
  std::istringstream in(zip);
  caffe2::serialize::PyTorchStreamReader archive(&in);
  c10::IValue object;
  try {
    object = ck::detail::load_pickle(archive, "fuzz input");
  } catch (const c10::Error&) {
    return 0;
  }
  double total = 0;
  touch_tensors(object, total);

  torch::nn::Linear model(4, 2);
  torch::optim::AdamW optimizer(model->parameters());
  try {
    ck::detail::load_state_dict(
        object,
        "fuzz input",
        [&](const c10::IValue& groups) {
          ck::detail::load_param_groups(optimizer, groups, "fuzz input");
        },
        [&](int64_t id, const ck::StateDict& state) {
          ck::detail::load_param_state(optimizer, id, state, "fuzz input");
        });
  } catch (const c10::Error&) {
  }
  volatile double sink = total;
  (void)sink;
  return 0;
}
