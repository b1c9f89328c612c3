// QLoRA (ctest label `qlora`) against bitsandbytes, transformers and PEFT
// themselves, run with the Python of the test set-up: the quantizers on the
// same tensors (tests/python/bnb_reference.py), quantized layers against
// bitsandbytes' and quantized models with adapters against transformers +
// bitsandbytes + PEFT (tests/python/qlora_reference.py); QLoRA training
// under the plugins against one process, checkpoints, and misuse.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/gemini_plugin.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/lora/lora_model.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/models/pretrained.h>
#include <colossalai/quantization/bnb.h>
#include <colossalai/quantization/quantize_model.h>
#include <colossalai/quantization/quantized_weight.h>
#include <colossalai/shardformer/layer/linear.h>
#include <colossalai/utils/compat.h>
#include <harness/multiprocess.h>
#include <harness/test_util.h>
#include <zoo/gpt.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>

namespace q = colossalai::quantization;
namespace st = colossalai::checkpoint_io::safetensors;
namespace cb = colossalai::booster;
namespace cl = colossalai::lora;
namespace cio = colossalai::checkpoint_io;
namespace models = colossalai::models;
namespace sl = colossalai::shardformer::layer;
namespace fs = std::filesystem;
using colossalai::testing::error_of;

namespace {

const char* const kHfPython = COLOSSALAI_TEST_HF_PYTHON;

struct Scratch : colossalai::testing::ScratchDir {
  Scratch() : ScratchDir("qlora") {}
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

// ---------------------------------------------------------------------------
// Quantized layers against bitsandbytes' Linear8bitLt / Linear4bit.

fs::path python_dir() {
  return fs::path(__FILE__).parent_path() / "python";
}

void run_python(const std::string& args) {
  const auto r = colossalai::testing::run_shell(
      std::string(kHfPython) + " '" +
      (python_dir() / "qlora_reference.py").string() + "' " + args);
  ASSERT_EQ(r.first, 0) << "qlora_reference.py " << args
                        << " failed (the test set-up installs transformers, "
                           "peft and bitsandbytes: ./scripts/setup.sh "
                           "--tests):\n"
                        << r.second;
}

// Layer shapes with a bias; inputs with activations past LLM.int8's
// threshold (6) in two columns, so its outlier path runs.
std::map<std::string, std::map<std::string, at::Tensor>> layer_cases() {
  torch::manual_seed(21);
  std::map<std::string, std::map<std::string, at::Tensor>> c;
  for (auto shape : {std::make_pair(48, 64), std::make_pair(96, 128)}) {
    const auto name =
        std::to_string(shape.first) + "x" + std::to_string(shape.second);
    auto x = at::randn({3, 5, shape.second});
    x.index_put_({1, 2, 3}, 9.0);
    x.index_put_({2, 0, shape.second - 7}, -7.5);
    c[name] = {
        {"w", at::randn({shape.first, shape.second}) * 0.1},
        {"b", at::randn({shape.first}) * 0.1},
        {"x", x},
        {"g", at::randn({3, 5, shape.first})}};
  }
  return c;
}

cio::StateDict layer_reference() {
  static const auto ref = [] {
    Scratch dir;
    cio::StateDict in;
    for (const auto& c : layer_cases()) {
      for (const auto& t : c.second) {
        in.insert(t.first + "." + c.first, t.second);
      }
    }
    st::save_file(dir.path + "/in.safetensors", in);
    run_python(
        "layers '" + dir.path + "/in.safetensors' '" + dir.path +
        "/out.safetensors'");
    return st::load_file(dir.path + "/out.safetensors");
  }();
  return ref;
}

// A Linear1D layer holding `w`, `b`, quantized as `config` says.
sl::Linear1D_Col quantized_layer(
    const at::Tensor& w,
    const at::Tensor& b,
    const q::BnbQuantizationConfig& config) {
  sl::Linear1D_Col layer(sl::Linear1DOptions(w.size(1), w.size(0)));
  {
    at::NoGradGuard no_grad;
    layer->weight.copy_(w);
    layer->bias.copy_(b);
  }
  layer->bias.requires_grad_(false);
  layer->quantize_(config);
  return layer;
}

double max_abs(const at::Tensor& t) {
  return t.abs().max().item<double>();
}

// LLM.int8: the weight's int8 rows and scales bit for bit. The outputs: the
// int8 product is exact in both (integers below 2^24 in fp32), so they
// differ only in the fp32 rounding of the outlier columns' addmm and of the
// bias (added after it here, inside it there): a few ulps of the output.
// The input's gradient is the dequantized weight's product.
TEST(Qlora, Int8LayersEqualBitsandbytes) {
  auto ref = layer_reference();
  for (const auto& c : layer_cases()) {
    SCOPED_TRACE(c.first);
    const auto& t = c.second;
    auto rows = q::int8_vectorwise_quant(t.at("w"));
    ASSERT_TRUE(ref.contains("cb." + c.first));
    EXPECT_TRUE(at::equal(rows.data, ref["cb." + c.first]));
    EXPECT_TRUE(at::equal(rows.stats, ref["scb." + c.first]));
    auto layer = quantized_layer(
        t.at("w"), t.at("b"), q::BnbQuantizationConfig().load_in_8bit(true));
    EXPECT_EQ(layer->weight.scalar_type(), at::kChar);
    EXPECT_FALSE(layer->weight.requires_grad());
    auto x = t.at("x").clone().requires_grad_(true);
    auto y = layer(x);
    (y * t.at("g")).sum().backward();
    const auto want = ref["y.int8." + c.first];
    const double scale = std::max(1.0, max_abs(want));
    EXPECT_LE(max_abs(y - want), 1e-5 * scale);
    EXPECT_LE(
        max_abs(x.grad() - ref["dx.int8." + c.first]),
        1e-5 * std::max(1.0, max_abs(ref["dx.int8." + c.first])));
    // The outliers mattered: without them the output moves.
    auto plain = q::int8_linear(
        t.at("x"), rows.data, rows.stats, t.at("b"), /*threshold=*/0.0);
    EXPECT_GT(max_abs(plain.detach() - want), 1e-3 * scale);
  }
}

// 4-bit: the dequantized weight equals bitsandbytes' bit for bit (above),
// so outputs differ only by fp32 matmul rounding (two BLAS libraries, the
// bias added separately): bound 1e-5 of the output's scale, as
// test_hf_models' logits. In bf16 compute both round x and W to bf16 alike
// and multiply in bf16; how a CPU's bf16 matmul rounds its partial sums
// differs between LibTorch builds and CPUs (measured: 2.3% of the largest
// input gradient, 5 bf16 ulps, on an AMD EPYC with LibTorch 1.13): bound
// 4e-2, 10 ulps (2^-8 relative each). The fp32 kinds above check the
// quantization itself to 1e-5.
TEST(Qlora, FourBitLayersEqualBitsandbytes) {
  auto ref = layer_reference();
  struct Kind {
    std::string name;
    q::BnbQuantizationConfig config;
    double rel;
  };
  const auto nf4 = q::BnbQuantizationConfig()
                       .load_in_4bit(true)
                       .bnb_4bit_quant_type("nf4")
                       .bnb_4bit_use_double_quant(true);
  const std::vector<Kind> kinds = {
      {"nf4", nf4, 1e-5},
      {"fp4",
       q::BnbQuantizationConfig().load_in_4bit(true).bnb_4bit_quant_type("fp4"),
       1e-5},
      {"nf4bf16",
       q::BnbQuantizationConfig(nf4).bnb_4bit_compute_dtype(at::kBFloat16),
       4e-2}};
  for (const auto& c : layer_cases()) {
    for (const auto& k : kinds) {
      SCOPED_TRACE(c.first + " " + k.name);
      const auto& t = c.second;
      auto layer = quantized_layer(t.at("w"), t.at("b"), k.config);
      EXPECT_EQ(layer->weight.scalar_type(), at::kByte);
      auto x = t.at("x").clone().requires_grad_(true);
      auto y = layer(x);
      EXPECT_EQ(y.scalar_type(), at::kFloat);
      (y * t.at("g")).sum().backward();
      const auto want = ref["y." + k.name + "." + c.first];
      const auto dwant = ref["dx." + k.name + "." + c.first];
      ASSERT_TRUE(want.defined());
      EXPECT_LE(max_abs(y - want), k.rel * std::max(1.0, max_abs(want)));
      EXPECT_LE(
          max_abs(x.grad() - dwant), k.rel * std::max(1.0, max_abs(dwant)));
    }
  }
}

// The dequantizer forms each value as ATen would: the code times its
// block's absmax in fp32 (a nested absmax decoded as dequantize_blockwise +
// offset), rounded once; bit for bit, in three dtypes, with blocks that
// start mid-byte (blocksize 33) and a last partial block.
TEST(Qlora, DequantizerEqualsItsAtenComposition) {
  torch::manual_seed(25);
  const auto w = torch::randn({61, 45}).mul(0.05);
  const int64_t n = w.numel();
  for (const std::string type : {"nf4", "fp4"}) {
    for (const bool nested : {false, true}) {
      for (const int64_t blocksize : {64, 33}) {
        auto [packed, state] = q::quantize_4bit(w, blocksize, type, nested);
        const auto absmax = nested
            ? q::dequantize_blockwise(
                  state.absmax,
                  state.state2_absmax,
                  state.state2_code,
                  state.state2_blocksize) +
                state.offset
            : state.absmax;
        const auto bytes = packed.reshape(-1).to(at::kLong);
        const auto idx = at::stack({bytes.bitwise_right_shift(4), bytes.bitwise_and(15)}, 1)
                             .reshape(-1)
                             .narrow(0, 0, n);
        const auto values = state.code.index_select(0, idx) *
            absmax.repeat_interleave(blocksize).narrow(0, 0, n);
        for (auto t : {at::kFloat, at::kHalf, at::kBFloat16}) {
          SCOPED_TRACE(
              type + (nested ? " nested " : " ") + std::to_string(blocksize) +
              " " + c10::toString(t));
          EXPECT_TRUE(at::equal(
              q::dequantize_4bit(packed, state, t),
              values.to(t).reshape(w.sizes())));
        }
      }
    }
  }
}

// A corrupt 4-bit state is refused by name by the dequantizer and the
// few-row product alike, never read past its tensors' ends.
TEST(Qlora, CorruptFourBitStatesAreRefusedByName) {
  torch::manual_seed(26);
  const auto w = torch::randn({8, 64}).mul(0.05);
  const auto x = torch::randn({1, 64});
  auto expect_refused = [&](const q::QuantState4bit& st, const at::Tensor& packed, const std::string& what) {
    for (int op = 0; op < 2; ++op) {
      try {
        if (op == 0) {
          q::dequantize_4bit(packed, st, at::kFloat);
        } else {
          q::gemv_4bit(x, packed, st);
        }
        ADD_FAILURE() << what << " was taken by " << (op == 0 ? "dequantize_4bit" : "gemv_4bit");
      } catch (const c10::Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(op == 0 ? "dequantize_4bit" : "gemv_4bit"), std::string::npos) << msg;
        EXPECT_NE(msg.find(what), std::string::npos) << msg;
      }
    }
  };
  for (const bool nested : {false, true}) {
    SCOPED_TRACE(nested ? "nested" : "plain");
    auto [packed, state] = q::quantize_4bit(w, 64, "nf4", nested);
    auto short_absmax = state;
    short_absmax.absmax = state.absmax.narrow(0, 0, 1);
    expect_refused(short_absmax, packed, "corrupt");
    auto short_code = state;
    short_code.code = state.code.narrow(0, 0, 15);
    expect_refused(short_code, packed, "16");
    auto no_code = state;
    no_code.code = at::Tensor();
    expect_refused(no_code, packed, "16");
    if (nested) {
      auto no_code2 = state;
      no_code2.state2_code = at::Tensor();
      expect_refused(no_code2, packed, "corrupt nested");
      // A second-level block size no power of two and too large for a
      // shift: read by division, no hang.
      auto odd = state;
      odd.state2_blocksize = (int64_t(1) << 62) + 1;
      EXPECT_EQ(q::dequantize_4bit(packed, odd, at::kFloat).sizes(), w.sizes());
    }
  }
}

// ---------------------------------------------------------------------------
// The few-row products on quantized weights (NOTE [Few-row products on
// quantized weights]).

// Restores the process-wide row limit on scope exit.
struct GemvRows {
  explicit GemvRows(int64_t rows) : saved(q::gemv_max_rows()) {
    q::set_gemv_max_rows(rows);
  }
  ~GemvRows() {
    q::set_gemv_max_rows(saved);
  }
  int64_t saved;
};

// Unit roundoff of a result dtype.
double unit_roundoff(at::ScalarType t) {
  return t == at::kBFloat16 ? std::ldexp(1.0, -8)
      : t == at::kHalf      ? std::ldexp(1.0, -11)
                            : std::ldexp(1.0, -24);
}

// x times one-hot rows reads single weight values back: each output is one
// product with 1, so exact whatever the order of the sums. They must be the
// dequantizer's values bit for bit: nibble order, rows starting mid-byte
// (odd in_features), blocks crossing rows (odd blocksize), the nested
// absmax decoded on the way, and 11 rows (a slice of 8, then 3).
TEST(Qlora, Gemv4bitReadsTheDequantizersValues) {
  torch::manual_seed(21);
  for (const std::string type : {"nf4", "fp4"}) {
    for (const bool nested : {false, true}) {
      for (const int64_t blocksize : {64, 33}) {
        const auto w = torch::randn({37, 67}).mul(0.05);
        auto [packed, state] = q::quantize_4bit(w, blocksize, type, nested);
        for (auto t : {at::kFloat, at::kHalf, at::kBFloat16}) {
          SCOPED_TRACE(
              type + (nested ? " nested " : " ") + std::to_string(blocksize) +
              " " + c10::toString(t));
          const auto full = q::dequantize_4bit(packed, state, t);
          const auto cols = torch::tensor(
              {0, 1, 2, 31, 32, 33, 63, 64, 65, 66, 5}, at::kLong);
          const auto x = at::one_hot(cols, 67).to(t);
          const auto y = q::gemv_4bit(x, packed, state);
          ASSERT_EQ(y.scalar_type(), t);
          ASSERT_EQ(y.sizes(), (at::IntArrayRef{11, 37}));
          EXPECT_TRUE(at::equal(y, full.index_select(1, cols).t()));
        }
      }
    }
  }
}

// Random x: against the float64 product of the same operands (x and the
// dequantized weight as the result dtype holds them). Any order of n fp32
// sums errs by at most gamma_n sum |x w| (gamma_n = n u / (1 - n u), u =
// 2^-24), and the result's rounding by u_T |y|: that bound (twice the sum
// term, for the rounding of the products) holds on any CPU.
TEST(Qlora, Gemv4bitIsTheProductWithinFp32Summation) {
  torch::manual_seed(22);
  const int64_t k = 1000;
  const auto w = torch::randn({70, k}).mul(0.05);
  for (const bool nested : {false, true}) {
    auto [packed, state] = q::quantize_4bit(w, 64, "nf4", nested);
    for (auto t : {at::kFloat, at::kHalf, at::kBFloat16}) {
      for (const int64_t m : {1, 4, 8}) {
        SCOPED_TRACE(
            std::string(nested ? "nested " : "") + c10::toString(t) + " m " +
            std::to_string(m));
        const auto x = torch::randn({1, m, k}).to(t);
        const auto y = q::gemv_4bit(x, packed, state);
        ASSERT_EQ(y.sizes(), (at::IntArrayRef{1, m, 70}));
        const auto wd = q::dequantize_4bit(packed, state, t).to(at::kDouble);
        const auto xd = x.to(at::kDouble);
        const auto exact = at::matmul(xd, wd.t());
        const auto mag = at::matmul(xd.abs(), wd.abs().t());
        const double u = std::ldexp(1.0, -24);
        const double gamma = k * u / (1 - k * u);
        const auto bound = exact.abs() * unit_roundoff(t) + mag * (2 * gamma);
        const auto err = (y.to(at::kDouble) - exact).abs();
        EXPECT_TRUE(at::all(err <= bound).item<bool>())
            << "max error " << max_abs(err) << ", max bound "
            << max_abs(bound);
      }
    }
  }
}

// int8 a b^T: every sum is an integer, so the fused pass equals the exact
// product bit for bit, at any length (fp32 matmul stops being exact beyond
// 1040 features); bad input is refused by name.
TEST(Qlora, Int8LinearMatmulIsExact) {
  torch::manual_seed(23);
  for (const int64_t k : {7, 256, 4099}) {
    for (const int64_t m : {1, 3, 8, 9}) {
      SCOPED_TRACE("k " + std::to_string(k) + " m " + std::to_string(m));
      const auto a = torch::randint(-127, 128, {m, k}).to(at::kChar);
      const auto b = torch::randint(-127, 128, {45, k}).to(at::kChar);
      const auto y = q::int8_linear_matmul(a, b);
      ASSERT_EQ(y.scalar_type(), at::kInt);
      const auto exact =
          at::matmul(a.to(at::kDouble), b.to(at::kDouble).t());
      if (m <= 8 || k < 1040) {
        EXPECT_TRUE(at::equal(y.to(at::kDouble), exact));
      }
    }
  }
  const auto a = torch::zeros({2, 8}, at::kChar);
  EXPECT_THROW(q::int8_linear_matmul(a, torch::zeros({3, 9}, at::kChar)), c10::Error);
  try {
    q::int8_linear_matmul(a.to(at::kFloat), a);
    ADD_FAILURE() << "a float a was taken";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("int8 a [m, k]"), std::string::npos) << e.what();
  }
  try {
    q::set_gemv_max_rows(9);
    ADD_FAILURE() << "9 rows were taken";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("set_gemv_max_rows"), std::string::npos) << e.what();
  }
  EXPECT_THROW(q::set_gemv_max_rows(-1), c10::Error);
}

// The layers take the fused product for a few tokens and the dequantized
// weight's matmul otherwise; both give the same forward within the bound
// above (4-bit, fp32 compute: two fp32 sums of the same 300 products in
// different orders differ by at most 2 gamma_301 sum |x w|, and each adds
// the same bias with one rounding, u |y|) or bit for bit (8-bit: both
// products exact at 300 features), and the same input gradient (backward
// always dequantizes), and the limit is obeyed.
TEST(Qlora, FewTokenForwardsEqualTheDequantizedOnes) {
  torch::manual_seed(24);
  const auto w = torch::randn({40, 300}).mul(0.05);
  const auto b = torch::randn({40}).mul(0.01);
  const auto nf4 = q::BnbQuantizationConfig()
                       .load_in_4bit(true)
                       .bnb_4bit_quant_type("nf4")
                       .bnb_4bit_use_double_quant(true);
  for (const auto& config :
       {nf4, q::BnbQuantizationConfig().load_in_8bit(true)}) {
    SCOPED_TRACE(config.load_in_4bit() ? "nf4" : "int8");
    auto layer = quantized_layer(w, b, config);
    for (const int64_t tokens : {1, 3, 5}) {
      SCOPED_TRACE(tokens);
      const auto x0 = torch::randn({1, tokens, 300});
      const auto g = torch::randn({1, tokens, 40});
      at::Tensor y[2], dx[2];
      for (const int64_t rows : {4, 0}) {
        GemvRows limit(rows);
        auto x = x0.clone().requires_grad_(true);
        auto out = layer(x);
        (out * g).sum().backward();
        y[rows == 0] = out.detach();
        dx[rows == 0] = x.grad();
      }
      if (config.load_in_4bit()) {
        // gamma_301: 300 products and their sums, each rounded once.
        const double u = std::ldexp(1.0, -24), gamma = 301 * u / (1 - 301 * u);
        const auto wd = layer->quantized->dequantize(layer->weight, at::kFloat).to(at::kDouble);
        const auto mag = at::matmul(x0.to(at::kDouble).abs(), wd.abs().t());
        const auto bound = mag * (2 * gamma) +
            (y[0].to(at::kDouble).abs() + y[1].to(at::kDouble).abs()) * u;
        EXPECT_TRUE(at::all((y[0] - y[1]).to(at::kDouble).abs() <= bound).item<bool>())
            << "max difference " << max_abs(y[0] - y[1]);
      } else {
        EXPECT_TRUE(at::equal(y[0], y[1]));
      }
      EXPECT_TRUE(at::equal(dx[0], dx[1]));
      if (tokens > 4 && config.load_in_4bit()) {
        // Above the limit both runs took the same path: the same bits.
        EXPECT_TRUE(at::equal(y[0], y[1]));
      }
    }
  }
  // Under autocast a few tokens multiply in autocast's dtype, as at::linear
  // would in the dequantizing path (fp32 compute dtype here); on the CPU a
  // 16-bit dtype takes that path itself (quantized_weight.cpp).
  auto [data, qw] = q::QuantizedWeight::quantize(w, nf4);
  const auto x = torch::randn({2, 300});
  at::Tensor y;
  {
    colossalai::compat::AutocastGuard autocast(at::kCPU, at::kBFloat16);
    y = qw->linear(x, data);
  }
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(
      y,
      at::linear(
          x.to(at::kBFloat16),
          q::dequantize_4bit(data, qw->state_4bit(), at::kBFloat16))
          .to(at::kFloat)));
}

// ---------------------------------------------------------------------------
// Quantized models with PEFT adapters against transformers + bitsandbytes +
// PEFT.

// Written once per test program, removed at its exit.
fs::path model_fixtures() {
  static const Scratch dir;
  static const bool made = [] {
    run_python("models '" + dir.path + "'");
    return true;
  }();
  (void)made;
  return fs::path(dir.path);
}

template <class M>
at::Tensor adapted_logits(
    const std::string& name,
    const c10::optional<q::BnbQuantizationConfig>& config) {
  const auto dir = model_fixtures() / name;
  auto model = models::from_pretrained<M>(dir.string());
  model->eval();
  cb::Booster booster;
  auto lora = booster.enable_lora(
      model,
      (dir / "adapter").string(),
      std::nullopt,
      config ? std::optional<q::BnbQuantizationConfig>(*config) : std::nullopt,
      config.has_value());
  lora->refresh();
  at::NoGradGuard no_grad;
  auto ref = st::load_file((dir / "reference.safetensors").string());
  return model->forward(ref["ids"]);
}

// The quantized bases are the same bits on both sides (layers above), so
// 4-bit logits differ by fp32 rounding as test_hf_models' (1e-5 of their
// scale, 2e-5 with the adapter's extra terms). LLM.int8 quantizes every
// activation row to int8: an fp32 rounding difference upstream can move an
// activation across a rounding midpoint, one int8 step (its row's absmax /
// 127) times a weight column, about 1e-3 of the logits here per flip; the
// bound 1e-2 of the scale allows a few; what int8 quantization itself moves
// them by is printed, and must be ten times our difference.
TEST(Qlora, QuantizedModelsWithAdaptersMatchTransformersAndPeft) {
  const auto nf4 = q::BnbQuantizationConfig()
                       .load_in_4bit(true)
                       .bnb_4bit_quant_type("nf4")
                       .bnb_4bit_use_double_quant(true)
                       .bnb_4bit_compute_dtype(at::kFloat);
  const auto int8 = q::BnbQuantizationConfig().load_in_8bit(true);
  for (const std::string name : {"llama", "gpt2"}) {
    SCOPED_TRACE(name);
    auto ref = st::load_file(
        (model_fixtures() / name / "reference.safetensors").string());
    auto run = [&](const c10::optional<q::BnbQuantizationConfig>& c) {
      return name == "llama" ? adapted_logits<models::LlamaForCausalLM>(name, c)
                             : adapted_logits<models::GPT2LMHeadModel>(name, c);
    };
    const double scale = std::max(1.0, max_abs(ref["logits.full"]));
    struct Case {
      std::string kind;
      c10::optional<q::BnbQuantizationConfig> config;
      double rel;
    };
    for (const auto& c : std::vector<Case>{
             {"full", c10::nullopt, 2e-5},
             {"nf4", nf4, 2e-5},
             {"int8", int8, 1e-2}}) {
      const auto logits = run(c.config);
      const auto want = ref["logits." + c.kind];
      ASSERT_EQ(logits.sizes(), want.sizes());
      const double diff = max_abs(logits - want);
      const double moved = max_abs(want - ref["logits.full"]);
      std::cout << name << " " << c.kind
                << ": max |logits - transformers + peft| = " << diff
                << " (bound " << c.rel * scale
                << "; quantization moves them by " << moved << ")\n";
      EXPECT_LE(diff, c.rel * scale);
      if (c.config) {
        EXPECT_GT(moved, 10 * diff)
            << "quantization moves the logits far more than we differ";
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Training, checkpoints, misuse.

models::GPT2LMHeadModel gpt2(int seed) {
  torch::manual_seed(seed);
  return models::GPT2LMHeadModel(models::GPT2Config::tiny_test().n_layer(2));
}

at::Tensor tokens(int seed, int64_t batch) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randint(100, {batch, 9}, gen);
}

cl::LoraConfig lora_config() {
  return cl::LoraConfig()
      .r(4)
      .lora_alpha(8)
      .target_modules({"c_attn", "c_proj"})
      .init_lora_weights("gaussian");
}

q::BnbQuantizationConfig nf4_fp32() {
  return q::BnbQuantizationConfig()
      .load_in_4bit(true)
      .bnb_4bit_quant_type("nf4")
      .bnb_4bit_use_double_quant(true)
      .bnb_4bit_compute_dtype(at::kFloat);
}

std::map<std::string, at::Tensor> params_of(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.named_parameters()) {
    out[item.key()] = colossalai::testing::host(item.value().detach()).clone();
  }
  return out;
}

// QLoRA data-parallel training equals one process training the same
// adapters on the whole batch (3 SGD-momentum steps), for 4-bit and 8-bit
// bases: bound as test_lora's (fp32 gradient sums in another order; both
// sides run the same quantized forward). The stored base never changes and
// the optimizer holds only adapters.
TEST(Qlora, TrainsUnderDdpZeroAndHybridLikeOneProcess) {
  constexpr int kSteps = 3;
  constexpr double kAtol = 2e-5;
  auto batch = [](int step) {
    auto t = tokens(300 + step, 8);
    return std::make_pair(
        t.narrow(1, 0, 8).contiguous(), t.narrow(1, 1, 8).contiguous());
  };
  for (const auto& qc :
       {nf4_fp32(), q::BnbQuantizationConfig().load_in_8bit(true)}) {
    SCOPED_TRACE(qc.load_in_4bit() ? "4-bit" : "8-bit");
    std::map<std::string, at::Tensor> want;
    {
      auto model = gpt2(6);
      cl::LoraModel lora(model.ptr(), lora_config());
      q::quantize_model(*model, qc);
      torch::optim::SGD opt(
          lora.trainable_parameters(),
          torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < kSteps; ++step) {
        auto b = batch(step);
        opt.zero_grad();
        model->loss(model->forward(b.first), b.second).backward();
        opt.step();
      }
      want = params_of(*model);
    }
    colossalai::testing::run_distributed(2, [&](int rank, int world) {
      std::vector<std::pair<std::string, std::shared_ptr<cb::plugin::Plugin>>>
          plugins{
              {"TorchDDP", std::make_shared<cb::plugin::TorchDDPPlugin>()},
              {"ZeRO-2",
               std::make_shared<cb::plugin::LowLevelZeroPlugin>(
                   cb::plugin::LowLevelZeroPluginOptions().stage(2).precision(
                       "fp32"))},
              {"Hybrid dp2 ZeRO-1",
               std::make_shared<cb::plugin::HybridParallelPlugin>(
                   cb::plugin::HybridParallelPluginOptions()
                       .zero_stage(1)
                       .precision("fp32"))}};
      for (auto& [name, plugin] : plugins) {
        SCOPED_TRACE(name);
        cb::Booster booster(cb::BoosterOptions().plugin(plugin));
        auto model = gpt2(6);
        booster.enable_lora(model, "", lora_config(), qc, true);
        auto opt = std::make_shared<torch::optim::SGD>(
            model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        auto boosted = booster.boost(model, opt);
        const int64_t local = 8 / world;
        for (int step = 0; step < kSteps; ++step) {
          auto b = batch(step);
          auto x = b.first.narrow(0, rank * local, local);
          auto y = b.second.narrow(0, rank * local, local);
          boosted.optimizer->zero_grad();
          booster.backward(
              model->loss(boosted.model(x), y), *boosted.optimizer);
          boosted.optimizer->step();
        }
        size_t held = 0;
        for (const auto& g : opt->param_groups()) {
          held += g.params().size();
        }
        EXPECT_LE(held, 2u * 6u); // adapters only
        for (const auto& item : params_of(*model)) {
          const auto& w = want.at(item.first);
          ASSERT_EQ(item.second.scalar_type(), w.scalar_type()) << item.first;
          if (item.first.find("lora_") == std::string::npos) {
            EXPECT_TRUE(at::equal(item.second, w))
                << item.first << " is frozen but moved";
          } else {
            EXPECT_LE(max_abs(item.second - w), kAtol) << item.first;
          }
        }
      }
    });
  }
}

// The base is quantized from its full-precision checkpoint at load (the
// same bits as quantizing the loaded weights), the quantized base refuses
// to be saved, and adapters saved in PEFT's layout reload onto a freshly
// quantized base with the same outputs, bit for bit.
TEST(Qlora, CheckpointsQuantizeAtLoadAndAdaptersRoundTrip) {
  Scratch dir;
  const auto base_file = dir.path + "/base.safetensors";
  {
    auto base = gpt2(8);
    st::save_file(base_file, cio::model_state_dict(*base));
  }
  auto ids = tokens(9, 2);
  cb::Booster booster;
  auto model = gpt2(99); // other weights, replaced by the load
  booster.enable_lora(model, "", lora_config(), nf4_fp32(), true);
  auto boosted = booster.boost(model);
  booster.load_model(boosted.model, base_file);
  {
    auto direct = gpt2(8);
    cl::LoraModel lora(direct.ptr(), lora_config());
    q::quantize_model(*direct, nf4_fp32());
    const auto got = params_of(*model), want = params_of(*direct);
    for (const auto& kv : want) {
      if (kv.first.find("lora_") == std::string::npos) {
        EXPECT_TRUE(at::equal(got.at(kv.first), kv.second)) << kv.first;
      }
    }
    auto layer = [](torch::nn::Module& m) {
      return std::dynamic_pointer_cast<sl::Linear1D_ColImpl>(
          m.named_modules()["transformer.h.0.attn.c_attn"]);
    };
    ASSERT_NE(layer(*model), nullptr);
    ASSERT_NE(layer(*model)->quantized, nullptr);
    EXPECT_TRUE(at::equal(
        layer(*model)->quantized->state_4bit().absmax,
        layer(*direct)->quantized->state_4bit().absmax));
  }
  // A wrong shape is named.
  {
    cio::StateDict bad;
    bad.insert("transformer.h.0.attn.c_attn.weight", at::zeros({3, 3}));
    st::save_file(dir.path + "/bad.safetensors", bad);
    const auto e = error_of([&] {
      booster.load_model(boosted.model, dir.path + "/bad.safetensors", false);
    });
    EXPECT_NE(e.find("quantized"), std::string::npos) << e;
  }
  // The quantized base is not saved.
  const auto e =
      error_of([&] { booster.save_model(boosted.model, dir.path + "/x.bin"); });
  EXPECT_NE(e.find("save_lora_as_pretrained"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir.path + "/x.bin"));
  // Adapters out in PEFT's layout, back onto a new quantized base.
  {
    at::NoGradGuard no_grad;
    for (auto& p : model->parameters()) {
      if (p.requires_grad()) {
        p.add_(0.01); // trained adapters, not the init
      }
    }
  }
  booster.save_lora_as_pretrained(boosted.model, dir.path + "/adapter", true);
  EXPECT_TRUE(fs::exists(dir.path + "/adapter/adapter_config.json"));
  EXPECT_TRUE(fs::exists(dir.path + "/adapter/adapter_model.safetensors"));
  model->eval();
  at::Tensor want;
  {
    at::NoGradGuard no_grad;
    want = boosted.model(ids);
  }
  cb::Booster booster2;
  auto again = gpt2(8);
  auto lora2 = booster2.enable_lora(
      again, dir.path + "/adapter", std::nullopt, nf4_fp32(), true);
  again->eval();
  lora2->refresh();
  at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(again->forward(ids), want));
}

TEST(Qlora, MisuseNamesTheProblem) {
  auto has = [](const std::function<void()>& f, const std::string& what) {
    const auto e = error_of(f);
    EXPECT_NE(e.find(what), std::string::npos) << "got: " << e;
  };
  colossalai::testing::run_distributed(1, [&](int, int) {
    has(
        [] {
          cb::Booster booster(cb::BoosterOptions().plugin(
              std::make_shared<cb::plugin::GeminiPlugin>(
                  cb::plugin::GeminiPluginOptions().precision("fp32"))));
          auto m = gpt2(1);
          booster.enable_lora(m, "", lora_config(), nf4_fp32(), true);
        },
        "does not support LoRA or QLoRA");
  });
  has(
      [] {
        cb::Booster booster;
        auto m = gpt2(1);
        booster.enable_lora(m, "", lora_config(), nf4_fp32(), false);
      },
      "quantize is false");
  has(
      [] {
        cb::Booster booster;
        auto m = gpt2(1);
        booster.enable_lora(
            m,
            "",
            lora_config(),
            q::BnbQuantizationConfig().load_in_4bit(true).load_in_8bit(true),
            true);
      },
      "exactly one of load_in_4bit");
  has(
      [] {
        // torch::nn::Linear layers: nothing QLoRA can quantize.
        torch::manual_seed(1);
        colossalai::zoo::GPT m(colossalai::zoo::GPTConfig::tiny_test());
        q::quantize_model(*m, nf4_fp32());
      },
      "nothing to quantize");
  has(
      [] {
        auto m = gpt2(1);
        cl::LoraModel lora(m.ptr(), lora_config());
        q::quantize_model(*m, nf4_fp32());
        lora.merge();
      },
      "quantized");
  has(
      [] {
        auto m = gpt2(1);
        q::quantize_model(*m, nf4_fp32());
        q::quantize_model(*m, nf4_fp32());
      },
      "nothing to quantize");
  {
    // A QLoRA call that fails leaves the model as it was: no adapters, and
    // a later call works.
    cb::Booster booster;
    auto m = gpt2(1);
    const auto before = params_of(*m);
    has(
        [&] {
          booster.enable_lora(
              m,
              "",
              lora_config(),
              nf4_fp32().skip_modules({"transformer", "lm_head"}),
              true);
        },
        "nothing to quantize");
    const auto after = params_of(*m);
    EXPECT_EQ(after.size(), before.size());
    for (const auto& [name, p] : after) {
      EXPECT_EQ(name.find("lora"), std::string::npos) << name;
    }
    EXPECT_NO_THROW(
        booster.enable_lora(m, "", lora_config(), nf4_fp32(), true));
  }
}

// Memory: what a quantized base holds per parameter, against the formula
// (bench_qlora reports it on a larger model).
TEST(Qlora, BytesPerParameterFollowTheFormula) {
  auto m = gpt2(1);
  q::quantize_model(
      *m,
      q::BnbQuantizationConfig().load_in_4bit(true).bnb_4bit_quant_type("nf4"));
  const auto f = q::quantized_footprint(*m);
  EXPECT_GT(f.params, 0);
  EXPECT_EQ(f.data_bytes, f.params / 2);
  // absmax: one fp32 per block of 64, plus the 16-entry code per layer.
  const int64_t layers = 4 * 2; // c_attn, c_proj, c_fc, mlp c_proj per block
  EXPECT_EQ(f.state_bytes, f.params / 64 * 4 + layers * 16 * 4);
  // Embeddings and norms stay: the model's float parameters are untouched.
  EXPECT_TRUE(
      m->named_parameters()["transformer.wte.weight"].is_floating_point());
  // The layer moves and casts with its stored dtype kept.
  m->to(at::kBFloat16);
  EXPECT_EQ(
      m->named_parameters()["transformer.h.0.attn.c_attn.weight"].scalar_type(),
      at::kByte);
  EXPECT_EQ(
      m->named_parameters()["transformer.h.0.attn.c_attn.bias"].scalar_type(),
      at::kBFloat16);
}

} // namespace
