// all_to_all: the shared-memory channel on one host (each pair's split
// checked on every rank), else the backend.

#include "collective_ops.h"

namespace colossalai {
namespace distributed {

using namespace detail; // the shared helpers (collective_ops.h)

Work all_to_all(
    at::Tensor& output,
    const at::Tensor& input,
    const ProcessGroup& group,
    std::vector<int64_t> output_splits,
    std::vector<int64_t> input_splits) {
  Issue issue(group, "all_to_all");
  check_dense(output, "all_to_all", "output");
  check_dense(input, "all_to_all", "input");
  if (auto w = via_carried(
          output,
          input,
          group,
          "all_to_all",
          [&](at::Tensor& o, const at::Tensor& i) {
            return all_to_all(o, i, group, output_splits, input_splits);
          })) {
    return std::move(*w);
  }
  TORCH_CHECK(
      output.scalar_type() == input.scalar_type(),
      "all_to_all: output and input dtypes differ");
  const int n = group.size();
  TORCH_CHECK(
      output_splits.empty() || (int)output_splits.size() == n,
      "all_to_all: output_splits needs ",
      n,
      " entries");
  TORCH_CHECK(
      input_splits.empty() || (int)input_splits.size() == n,
      "all_to_all: input_splits needs ",
      n,
      " entries");
  if (input_splits.empty()) {
    TORCH_CHECK(
        input.size(0) % n == 0,
        "all_to_all: input dim 0 (",
        input.size(0),
        ") must divide by the group size ",
        n,
        " when no splits are given");
  }
  if (auto* channel = shm(group, input, /*reduces=*/false)) {
    // Splits count rows of dim 0; the segment moves bytes.
    auto bytes = [n](const at::Tensor& t, const std::vector<int64_t>& splits) {
      const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
      const int64_t row = rows > 0 ? t.numel() / rows * t.element_size() : 0;
      std::vector<int64_t> b(n, rows / n * row);
      if (!splits.empty()) {
        int64_t total = 0;
        for (int q = 0; q < n; ++q) {
          b[q] = splits[q] * row;
          total += splits[q];
        }
        TORCH_CHECK(
            total == rows,
            "all_to_all: splits sum to ",
            total,
            " rows, the tensor has ",
            rows);
      }
      return b;
    };
    if (output_splits.empty()) {
      TORCH_CHECK(
          output.dim() > 0 && output.size(0) % n == 0,
          "all_to_all: output dim 0 must divide by the group size ",
          n,
          " when no splits are given");
    }
    auto send_bytes = bytes(input, input_splits);
    auto recv_bytes = bytes(output, output_splits);
    TORCH_CHECK(
        send_bytes[group.rank()] == recv_bytes[group.rank()],
        "all_to_all: this rank sends itself ",
        send_bytes[group.rank()],
        " bytes but expects ",
        recv_bytes[group.rank()]);
    count(input, group);
    return shm_work(
        channel->all_to_all(
            output, input, std::move(send_bytes), std::move(recv_bytes)),
        "all_to_all",
        group);
  }
  if (auto* channel = channel_of(group)) {
    auto o = output;
    return in_order(
        channel,
        "all_to_all",
        group,
        [o, input, output_splits, input_splits, g = &group]() mutable {
          return all_to_all(o, input, *g, output_splits, input_splits);
        });
  }
  count(input, group);
  if (n == 1) {
    output.copy_(input);
    return Work();
  }
  auto o = raw(output, group);
  auto i = raw(input, group);
  return detail::make_work(
      detail::post(
          group,
          "all_to_all",
          [&] {
            return compat::all_to_all_single(
                detail::backend(group), o, i, output_splits, input_splits);
          }),
      nullptr,
      "all_to_all",
      group);
}

} // namespace distributed
} // namespace colossalai
