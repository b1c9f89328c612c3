// QLoRA's quantizers against bitsandbytes itself (ctest label `qlora`):
// the same tensors quantized here and by bitsandbytes.functional on the CPU
// (tests/python/bnb_reference.py, run with the Python of the test set-up).

#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/quantization/bnb.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <string>

namespace q = colossalai::quantization;
namespace st = colossalai::checkpoint_io::safetensors;
namespace fs = std::filesystem;

namespace {

const char* const kHfPython = COLOSSALAI_TEST_HF_PYTHON;

struct Scratch {
  Scratch() : path(colossalai::testing::temp_dir("qlora")) {}
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string path;
};

// Weight-like tensors: whole blocks, a short last block and an odd count
// (a padded nibble), fp32 and bf16, one with outliers.
std::map<std::string, at::Tensor> inputs() {
  torch::manual_seed(3);
  auto outliers = at::randn({32, 96}) * 0.05;
  outliers.index_put_({0, 5}, 4.0);
  outliers.index_put_({17, 90}, -3.0);
  return {
      {"w64x48", at::randn({64, 48}) * 0.02},
      {"odd33x7", at::randn({33, 7})},
      {"bf16", (at::randn({48, 40}) * 0.1).to(at::kBFloat16)},
      {"outliers", outliers}};
}

colossalai::checkpoint_io::StateDict run_reference(const Scratch& dir) {
  colossalai::checkpoint_io::StateDict in;
  for (const auto& kv : inputs()) {
    in.insert("x." + kv.first, kv.second);
  }
  st::save_file(dir.path + "/in.safetensors", in);
  const auto script =
      fs::path(__FILE__).parent_path() / "python" / "bnb_reference.py";
  const auto r = colossalai::testing::run_shell(
      std::string(kHfPython) + " '" + script.string() + "' '" + dir.path +
      "/in.safetensors' '" + dir.path + "/out.safetensors'");
  EXPECT_EQ(r.first, 0) << "bnb_reference.py failed (the test set-up "
                           "installs bitsandbytes: ./scripts/setup.sh "
                           "--tests):\n"
                        << r.second;
  return st::load_file(dir.path + "/out.safetensors");
}

// bitsandbytes' results, computed once per test program.
colossalai::checkpoint_io::StateDict reference() {
  static const auto ref = [] {
    Scratch dir;
    return run_reference(dir);
  }();
  return ref;
}

TEST(Qlora, DynamicMapEqualsBitsandbytes) {
  auto ref = reference();
  ASSERT_TRUE(ref.contains("dynamic_map"));
  const at::Tensor map = q::create_dynamic_map();
  EXPECT_TRUE(at::equal(map, ref["dynamic_map"]))
      << (map - ref["dynamic_map"]).abs().max() << "\n"
      << map.ne(ref["dynamic_map"]).nonzero().flatten();
}

// 4-bit: packed codes, absmax and dequantized values bit for bit.
// Double quantization: the offset (a mean, whose summation order LibTorch
// versions may change in the last bit) within 1e-6 relative, and the
// dequantized absmax within one step of the 8-bit map at that magnitude;
// bitsandbytes' native 8-bit search and the nearest-code rule differ at
// near-ties (bnb.h).
TEST(Qlora, FourBitQuantizationEqualsBitsandbytes) {
  auto ref = reference();
  int cases = 0;
  for (const auto& kv : inputs()) {
    for (const std::string qt : {"nf4", "fp4"}) {
      for (int64_t bs : {64, 128}) {
        for (bool nested : {false, true}) {
          const auto tag = kv.first + "." + qt + "." + std::to_string(bs) +
              "." + std::to_string(int(nested));
          SCOPED_TRACE(tag);
          ASSERT_TRUE(ref.contains("packed." + tag));
          at::Tensor packed;
          q::QuantState4bit state;
          std::tie(packed, state) = q::quantize_4bit(kv.second, bs, qt, nested);
          EXPECT_TRUE(at::equal(packed, ref["packed." + tag]));
          const at::Tensor deq = q::dequantize_4bit(packed, state);
          const at::Tensor want = ref["deq." + tag];
          ASSERT_EQ(deq.sizes(), want.sizes());
          ASSERT_EQ(deq.scalar_type(), want.scalar_type());
          if (!nested) {
            EXPECT_TRUE(at::equal(state.absmax, ref["absmax." + tag]));
            EXPECT_TRUE(at::equal(deq, want));
          } else {
            const double off = ref["offset." + tag].item<double>();
            EXPECT_NEAR(state.offset.item<double>(), off, 1e-6 * std::abs(off));
            const auto differ =
                state.absmax.ne(ref["absmax." + tag]).sum().item<int64_t>();
            EXPECT_LE(differ * 100, state.absmax.numel() + 99) << differ;
            // One 8-bit step at the largest absmax is < 2% of it; the
            // weights scale by the absmax of their block.
            const double bound = 0.02 * want.abs().max().item<double>() + 1e-7;
            EXPECT_LE((deq - want).abs().max().item<double>(), bound);
          }
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * 2 * 2 * 2);
}

TEST(Qlora, ConfigErrorsNameTheField) {
  using colossalai::testing::error_of;
  q::BnbQuantizationConfig c;
  EXPECT_NE(
      error_of([&] { c.validate(); }).find("exactly one of load_in_4bit"),
      std::string::npos);
  c.load_in_4bit(true).bnb_4bit_quant_type("int4");
  EXPECT_NE(
      error_of([&] { c.validate(); }).find("bnb_4bit_quant_type"),
      std::string::npos);
  c.bnb_4bit_quant_type("nf4").bnb_4bit_compute_dtype(at::kInt);
  EXPECT_NE(
      error_of([&] { c.validate(); }).find("bnb_4bit_compute_dtype"),
      std::string::npos);
  c.bnb_4bit_compute_dtype(at::kBFloat16);
  EXPECT_NO_THROW(c.validate());
  EXPECT_NE(
      error_of([] {
        q::quantize_4bit(at::ones({4}), 64, "int4");
      }).find("quant_type"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        q::quantize_4bit(at::ones({0}), 64, "nf4");
      }).find("empty"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        q::quantize_4bit(at::ones({8}), 0, "nf4");
      }).find("blocksize"),
      std::string::npos);
}

} // namespace
