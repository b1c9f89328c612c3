// NOTE [FP8 messages]
// The FP8 collectives move bytes, not floats: each message is a row of
// 4 + L bytes, its float32 inverse scale and then its L values in FP8
// (quantization/fp8_rows.h), so that a value and its scale travel in one
// operation of the byte-moving collectives (all-gather, all-to-all), which
// every backend carries for uint8. Rows are padded to a common length L,
// the longest shard. Nothing here reduces in FP8 on the wire: a
// reduce-scatter is an all-to-all of shards and a float32 sum at each
// shard's owner; an all-reduce adds an all-gather of the sums (ColossalAI's
// scheme), and every rank, the owner included, decodes the gathered bytes,
// so every rank ends with the same values.

#include <colossalai/quantization/fp8.h>

#include "../quantization/fp8_rows.h"
#include "collective_ops.h"

namespace colossalai {
namespace quantization {

namespace {

void fp8_check_input(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(
      t.is_floating_point() && t.element_size() >= 2,
      op,
      ": ",
      what,
      " must be float32, bf16 or fp16, got ",
      t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous");
}

} // namespace

distributed::Work all_gather_fp8(
    at::Tensor& output,
    const at::Tensor& input,
    const distributed::ProcessGroup& group,
    const std::string& fp8_format) {
  const bool e4m3 = detail::fp8_is_e4m3(fp8_format, "all_gather_fp8");
  fp8_check_input(output, "all_gather_fp8", "output");
  fp8_check_input(input, "all_gather_fp8", "input");
  const int world = group.size();
  const int64_t total = output.numel();
  const auto mine = distributed::shard_range(total, world, group.rank());
  TORCH_CHECK(
      input.numel() == mine.second - mine.first,
      "all_gather_fp8: input has ",
      input.numel(),
      " elements, this rank's shard of ",
      total,
      " has ",
      mine.second - mine.first);
  distributed::detail::Issue issue(group, "all_gather_fp8");
  if (world == 1 || total == 0) {
    output.copy_(input.view_as(output));
    return distributed::Work();
  }
  const int64_t longest = (total + world - 1) / world;
  auto row = at::zeros({1, longest}, input.options().dtype(at::kFloat));
  row.narrow(1, 0, input.numel()).copy_(input.reshape({1, -1}));
  auto sent = detail::fp8_pack_rows(row, e4m3).view({-1});
  auto received = at::empty({world * (4 + longest)}, sent.options());
  auto gathered = std::make_shared<distributed::Work>(
      distributed::all_gather(received, sent, group));
  auto out = output; // shares the storage
  return distributed::detail::make_work(
      compat::WorkPtr(),
      [gathered, sent, received, out, world, longest, total, e4m3]() mutable {
        gathered->wait();
        auto values = detail::fp8_unpack_rows(
            received.view({world, 4 + longest}), e4m3); // [world, longest]
        auto flat = out.view({-1});
        for (int r = 0; r < world; ++r) {
          const auto range = distributed::shard_range(total, world, r);
          flat.narrow(0, range.first, range.second - range.first)
              .copy_(values[r].narrow(0, 0, range.second - range.first));
        }
      },
      "all_gather_fp8",
      group,
      [gathered] { return gathered->is_completed(); });
}

namespace {

// The flat `input` as [world, longest] float32 rows, row r rank r's shard
// (distributed::shard_range), zero-padded; a view when nothing is to pad
// or convert.
at::Tensor shard_rows(const at::Tensor& input, int world, int64_t longest) {
  const int64_t total = input.numel();
  auto flat = input.view({-1});
  if (total == world * longest && input.scalar_type() == at::kFloat) {
    return flat.view({world, longest});
  }
  auto rows = at::zeros({world, longest}, input.options().dtype(at::kFloat));
  for (int r = 0; r < world; ++r) {
    const auto range = distributed::shard_range(total, world, r);
    rows[r]
        .narrow(0, 0, range.second - range.first)
        .copy_(flat.narrow(0, range.first, range.second - range.first));
  }
  return rows;
}

void fp8_check_sum(distributed::ReduceOp op, const char* name) {
  TORCH_CHECK(
      op == distributed::ReduceOp::kSum || op == distributed::ReduceOp::kAvg,
      name,
      ": only kSum and kAvg reduce through FP8");
}

} // namespace

distributed::Work reduce_scatter_fp8(
    at::Tensor& output,
    const at::Tensor& input,
    const distributed::ProcessGroup& group,
    distributed::ReduceOp op,
    const std::string& fp8_format) {
  const bool e4m3 = detail::fp8_is_e4m3(fp8_format, "reduce_scatter_fp8");
  fp8_check_input(output, "reduce_scatter_fp8", "output");
  fp8_check_input(input, "reduce_scatter_fp8", "input");
  fp8_check_sum(op, "reduce_scatter_fp8");
  const int world = group.size();
  const int64_t total = input.numel();
  const auto mine = distributed::shard_range(total, world, group.rank());
  const int64_t length = mine.second - mine.first;
  TORCH_CHECK(
      output.numel() == length,
      "reduce_scatter_fp8: output has ",
      output.numel(),
      " elements, this rank's shard of ",
      total,
      " has ",
      length);
  distributed::detail::Issue issue(group, "reduce_scatter_fp8");
  if (world == 1 || total == 0) {
    output.copy_(input.view_as(output));
    return distributed::Work();
  }
  const int64_t longest = (total + world - 1) / world;
  auto sent =
      detail::fp8_pack_rows(shard_rows(input, world, longest), e4m3).view({-1});
  auto received = at::empty_like(sent);
  auto exchanged = std::make_shared<distributed::Work>(
      distributed::all_to_all(received, sent, group));
  auto out = output; // shares the storage
  return distributed::detail::make_work(
      compat::WorkPtr(),
      [exchanged,
       sent,
       received,
       out,
       op,
       world,
       longest,
       length,
       e4m3]() mutable {
        exchanged->wait();
        // This rank's shard from every rank, added in rank order.
        auto sum =
            detail::fp8_unpack_rows(received.view({world, 4 + longest}), e4m3)
                .sum(0);
        if (op == distributed::ReduceOp::kAvg) {
          sum.div_(world);
        }
        out.view({-1}).copy_(sum.narrow(0, 0, length));
      },
      "reduce_scatter_fp8",
      group,
      [exchanged] { return exchanged->is_completed(); });
}

distributed::Work all_reduce_fp8(
    at::Tensor& tensor,
    const distributed::ProcessGroup& group,
    distributed::ReduceOp op,
    const std::string& fp8_format) {
  detail::fp8_is_e4m3(fp8_format, "all_reduce_fp8");
  fp8_check_input(tensor, "all_reduce_fp8", "tensor");
  fp8_check_sum(op, "all_reduce_fp8");
  distributed::detail::Issue issue(group, "all_reduce_fp8");
  const int world = group.size();
  if (world == 1 || tensor.numel() == 0) {
    return distributed::Work();
  }
  const auto mine =
      distributed::shard_range(tensor.numel(), world, group.rank());
  auto sum =
      at::empty({mine.second - mine.first}, tensor.options().dtype(at::kFloat));
  auto scattered = std::make_shared<distributed::Work>(
      reduce_scatter_fp8(sum, tensor, group, op, fp8_format));
  auto out = tensor;      // shares the storage
  const auto* g = &group; // make_work keeps the group alive
  return distributed::detail::make_work(
      compat::WorkPtr(),
      [scattered, sum, out, g, fp8_format]() mutable {
        scattered->wait();
        all_gather_fp8(out, sum, *g, fp8_format).wait();
      },
      "all_reduce_fp8",
      group,
      [scattered] { return scattered->is_completed(); });
}

distributed::Work all_to_all_fp8(
    at::Tensor& output,
    const at::Tensor& input,
    const distributed::ProcessGroup& group,
    const std::string& fp8_format) {
  detail::fp8_is_e4m3(fp8_format, "all_to_all_fp8");
  fp8_check_input(output, "all_to_all_fp8", "output");
  fp8_check_input(input, "all_to_all_fp8", "input");
  const int world = group.size();
  TORCH_CHECK(
      input.numel() % world == 0 && output.numel() == input.numel(),
      "all_to_all_fp8: input and output must have the same number of "
      "elements, a multiple of the group's ",
      world,
      " ranks; got ",
      input.numel(),
      " and ",
      output.numel());
  if (input.numel() == 0) {
    distributed::detail::Issue issue(group, "all_to_all_fp8");
    return distributed::Work();
  }
  // Equal blocks are the uneven exchange with every split equal: one
  // message, one scale, per rank.
  const std::vector<int64_t> splits(world, input.numel() / world);
  auto rows_out = output.view({-1, 1});
  return all_to_all_fp8(
      rows_out, input.view({-1, 1}), group, splits, splits, fp8_format);
}

distributed::Work all_to_all_fp8(
    at::Tensor& output,
    const at::Tensor& input,
    const distributed::ProcessGroup& group,
    const std::vector<int64_t>& output_splits,
    const std::vector<int64_t>& input_splits,
    const std::string& fp8_format) {
  const bool e4m3 = detail::fp8_is_e4m3(fp8_format, "all_to_all_fp8");
  fp8_check_input(output, "all_to_all_fp8", "output");
  fp8_check_input(input, "all_to_all_fp8", "input");
  const int world = group.size();
  TORCH_CHECK(
      input.dim() > 0 && output.dim() > 0 &&
          static_cast<int>(output_splits.size()) == world &&
          static_cast<int>(input_splits.size()) == world,
      "all_to_all_fp8: needs tensors with rows and ",
      world,
      " output and input splits");
  const int64_t width =
      c10::multiply_integers(input.sizes().begin() + 1, input.sizes().end());
  int64_t in_rows = 0, out_rows = 0;
  for (int r = 0; r < world; ++r) {
    in_rows += input_splits[r];
    out_rows += output_splits[r];
  }
  TORCH_CHECK(
      in_rows == input.size(0) && out_rows == output.size(0) &&
          output.numel() == out_rows * width,
      "all_to_all_fp8: the splits (",
      in_rows,
      " rows in, ",
      out_rows,
      " out) do not match the tensors' rows (",
      input.size(0),
      ", ",
      output.size(0),
      ") of ",
      width,
      " values");
  distributed::detail::Issue issue(group, "all_to_all_fp8");
  if (world == 1) {
    output.copy_(input.view_as(output));
    return distributed::Work();
  }
  // One message per rank: its rows under their own scale, 4 + rows x width
  // bytes (an empty message still carries its 4).
  std::vector<at::Tensor> messages;
  std::vector<int64_t> in_bytes, out_bytes;
  const auto flat = input.view({input.size(0), width});
  int64_t row = 0;
  for (int r = 0; r < world; ++r) {
    const int64_t n = input_splits[r] * width;
    auto values =
        flat.narrow(0, row, input_splits[r]).reshape({1, n}).to(at::kFloat);
    messages.push_back(
        n > 0 ? detail::fp8_pack_rows(values, e4m3).view({-1})
              : at::zeros({4}, input.options().dtype(at::kByte)));
    in_bytes.push_back(4 + n);
    out_bytes.push_back(4 + output_splits[r] * width);
    row += input_splits[r];
  }
  auto sent = at::cat(messages);
  int64_t total = 0;
  for (auto b : out_bytes) {
    total += b;
  }
  auto received = at::empty({total}, sent.options());
  auto exchanged = std::make_shared<distributed::Work>(
      distributed::all_to_all(received, sent, group, out_bytes, in_bytes));
  auto out = output;
  return distributed::detail::make_work(
      compat::WorkPtr(),
      [exchanged,
       sent,
       received,
       out,
       output_splits,
       width,
       world,
       e4m3]() mutable {
        exchanged->wait();
        auto rows = out.view({out.size(0), width});
        int64_t at_byte = 0, at_row = 0;
        for (int r = 0; r < world; ++r) {
          const int64_t n = output_splits[r] * width;
          if (n > 0) {
            rows.narrow(0, at_row, output_splits[r])
                .copy_(
                    detail::fp8_unpack_rows(
                        received.narrow(0, at_byte, 4 + n).view({1, -1}), e4m3)
                        .view({output_splits[r], width}));
          }
          at_byte += 4 + n;
          at_row += output_splits[r];
        }
      },
      "all_to_all_fp8",
      group,
      [exchanged] { return exchanged->is_completed(); });
}

} // namespace quantization
} // namespace colossalai
