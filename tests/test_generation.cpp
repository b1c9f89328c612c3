// Generation without Python: the KVCache's bookkeeping and masks, each
// family's cached steps against its whole-sequence forward, transformers'
// warpers on hand-computed values, generation_config.json, and bad input
// refused by name. test_hf_models checks generate against transformers'.

#include <colossalai/models/bloom.h>
#include <colossalai/models/generation.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/kv_cache.h>
#include <colossalai/models/llama.h>
#include <colossalai/models/opt.h>
#include <harness/test_util.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <limits>
#include <string>
#include <type_traits>

namespace models = colossalai::models;
using colossalai::testing::error_of;

namespace {

void expect_has(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << text;
}

at::Tensor keys(int64_t t, double base) {
  return at::arange(t, at::kFloat).add(base).view({1, 1, t, 1});
}

} // namespace

// The cache appends each step's keys after the kept ones, and its masks say
// which the step's queries see; a sliding window of 3 keeps 2 keys.
TEST(KVCache, AppendsStepsAndKeepsTheWindow) {
  models::KVCache cache;
  auto mask = cache.begin_step(4, at::Tensor(), /*sliding_window=*/3, at::kCPU);
  // Causal within the window: query i sees keys i - 2 .. i.
  const auto want = at::tensor(
                        {1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1},
                        at::kLong)
                        .to(at::kBool)
                        .view({1, 1, 4, 4});
  EXPECT_TRUE(mask.equal(want));
  for (int64_t layer = 0; layer < 2; ++layer) {
    auto kv = cache.update(layer, keys(4, 0), keys(4, 10));
    EXPECT_EQ(kv.first.size(2), 4);
  }
  cache.end_step();
  EXPECT_EQ(cache.length(), 4);
  EXPECT_EQ(cache.kept(), 2); // positions 2 and 3
  // Position 4 sees 2, 3 and itself; padding at position 2 hides it.
  const auto pad = at::tensor({1, 1, 0, 1, 1}, at::kLong).view({1, 5});
  mask = cache.begin_step(1, pad, 3, at::kCPU);
  EXPECT_TRUE(mask.equal(at::tensor({0, 1, 1}, at::kLong).to(at::kBool).view({1, 1, 1, 3})));
  for (int64_t layer = 0; layer < 2; ++layer) {
    auto kv = cache.update(layer, keys(1, 4), keys(1, 14));
    EXPECT_TRUE(kv.first.flatten().equal(at::tensor({2.f, 3.f, 4.f})));
    EXPECT_TRUE(kv.second.flatten().equal(at::tensor({12.f, 13.f, 14.f})));
  }
  cache.end_step();
  EXPECT_EQ(cache.length(), 5);
  // Without a window everything stays; growth keeps what was written.
  models::KVCache all;
  for (int64_t s = 0; s < 9; ++s) {
    all.begin_step(1, at::Tensor(), 0, at::kCPU);
    auto kv = all.update(0, keys(1, s), keys(1, -s));
    EXPECT_TRUE(kv.first.flatten().equal(at::arange(s + 1, at::kFloat)));
    all.end_step();
  }
  EXPECT_EQ(all.kept(), 9);
}

TEST(KVCache, RefusesMisuseByName) {
  models::KVCache cache;
  expect_has(
      error_of([&] { cache.update(0, keys(1, 0), keys(1, 0)); }),
      "outside a step");
  expect_has(
      error_of([&] {
        cache.begin_step(2, at::ones({1, 3}, at::kLong), 0, at::kCPU);
      }),
      "attention_mask must be [B, past + new tokens] = [B, 2]");
  cache.begin_step(2, at::Tensor(), 0, at::kCPU);
  expect_has(
      error_of([&] { cache.update(0, keys(1, 0), keys(1, 0)); }),
      "must be [B, H, 2, D]");
  cache.update(0, keys(2, 0), keys(2, 0));
  expect_has(
      error_of([&] { cache.update(0, keys(2, 0), keys(2, 0)); }),
      "layer 0 was updated twice");
  cache.end_step();
  expect_has(
      error_of([&] { cache.begin_step(1, at::Tensor(), 4, at::kCPU); }),
      "sliding window 0, now one with 4");
  cache.begin_step(1, at::Tensor(), 0, at::kCPU);
  expect_has(
      error_of([&] {
        cache.update(0, at::zeros({2, 1, 1, 1}), at::zeros({2, 1, 1, 1}));
      }),
      "another batch needs reset()");
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
}

namespace {

// Prefill of 5 tokens, then one token per step: each step's logits equal
// the whole sequence's forward at that position, with and without left
// padding (row 1's first 2 tokens). Both are the same fp32 operations on
// the same values, the cached step's attention over fewer keys (masked
// ones left out): 1e-5 covers the reordered sums at logits of magnitude ~1.
// The whole sequence's forward (BLOOM's ALiBi takes no positions).
template <class M>
at::Tensor full_forward(
    M& model,
    const at::Tensor& ids,
    const at::Tensor& mask,
    const at::Tensor& pos) {
  if constexpr (std::is_same_v<M, models::BloomForCausalLM>) {
    return model->forward(ids, mask);
  } else {
    return model->forward(ids, mask, pos);
  }
}

template <class M>
void check_steps(M model, const char* name) {
  SCOPED_TRACE(name);
  model->eval();
  at::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(3);
  const int64_t t = 9;
  const auto ids = at::randint(90, {2, t}, gen);
  for (bool padded : {false, true}) {
    auto mask = at::ones({2, t}, at::kLong);
    if (padded) {
      mask.index_put_({1, at::indexing::Slice(0, 2)}, 0);
    }
    const auto pos = (mask.cumsum(1) - 1).masked_fill(mask.eq(0), 0);
    const at::Tensor want =
        full_forward(model, ids, padded ? mask : at::Tensor(), pos);
    models::KVCache cache;
    at::Tensor got = model->forward_cached(
        ids.narrow(1, 0, 5),
        cache,
        padded ? mask.narrow(1, 0, 5) : at::Tensor(),
        padded ? pos.narrow(1, 0, 5) : at::Tensor());
    std::vector<at::Tensor> steps{got};
    for (int64_t i = 5; i < t; ++i) {
      steps.push_back(model->forward_cached(
          ids.narrow(1, i, 1),
          cache,
          padded ? mask.narrow(1, 0, i + 1) : at::Tensor(),
          padded ? pos.narrow(1, i, 1) : at::Tensor()));
    }
    at::Tensor cached = at::cat(steps, 1);
    ASSERT_EQ(cached.sizes(), want.sizes());
    // Padded positions' outputs mean nothing.
    auto real = mask.to(at::kBool).unsqueeze(-1).expand_as(want);
    EXPECT_LE(
        (cached - want).masked_select(real).abs().max().item<double>(), 1e-5)
        << (padded ? "padded" : "unpadded");
    EXPECT_EQ(cache.length(), t);
    // logits_to_keep: the last position only.
    models::KVCache again;
    at::Tensor last = model->forward_cached(
        ids, again, padded ? mask : at::Tensor(), at::Tensor(), 1);
    EXPECT_EQ(last.size(1), 1);
  }
}

} // namespace

TEST(ForwardCached, StepsEqualTheWholeSequencesForward) {
  torch::manual_seed(0);
  // GQA (8 heads over 4), and a sliding window (4) the 9 tokens exceed.
  check_steps(
      models::LlamaForCausalLM(
          models::LlamaConfig::tiny_test().sliding_window(4).model_type(
              "mistral")),
      "mistral");
  check_steps(models::GPT2LMHeadModel(models::GPT2Config::tiny_test()), "gpt2");
  check_steps(models::OPTForCausalLM(models::OPTConfig::tiny_test()), "opt");
  check_steps(
      models::BloomForCausalLM(models::BloomConfig::tiny_test()), "bloom");
}

// transformers' warpers on values worked by hand: temperature divides,
// top-k keeps the k largest (ties with the k-th too), top-p keeps the
// fewest largest whose mass reaches p, and always the largest.
TEST(Generation, WarpersKeepWhatTransformersKeeps) {
  const double inf = std::numeric_limits<double>::infinity();
  const auto scores = at::tensor({1.0, 3.0, 2.0, 3.0, 0.0}).view({1, 5});
  auto none = models::GenerationConfig().top_k(0);
  EXPECT_TRUE(models::process_logits(scores, none).equal(scores));
  EXPECT_TRUE(models::process_logits(scores, models::GenerationConfig()
                                                 .top_k(0)
                                                 .temperature(2.0))
                  .allclose(scores / 2.0));
  auto top2 = models::process_logits(scores, none.top_k(2));
  EXPECT_TRUE(top2.equal(at::tensor({-inf, 3.0, -inf, 3.0, -inf}).view({1, 5})));
  // softmax([0, 1, 2, 3, 3]) in ascending order: 0.0117, 0.0317, 0.0861,
  // 0.2341, 0.2341 of 0.5977 -> cumulative 0.0196, 0.0726, 0.2167, 0.6083,
  // 1. top_p 0.75: out while cumulative <= 0.25 (0, 1, 2).
  auto p = models::process_logits(
      scores, models::GenerationConfig().top_k(0).top_p(0.75));
  EXPECT_TRUE(p.equal(at::tensor({-inf, 3.0, -inf, 3.0, -inf}).view({1, 5})));
  // top_p 0.9: out while cumulative <= 0.1 (0 and 1): 2.0 stays.
  p = models::process_logits(
      scores, models::GenerationConfig().top_k(0).top_p(0.9));
  EXPECT_TRUE(p.equal(at::tensor({-inf, 3.0, 2.0, 3.0, -inf}).view({1, 5})));
  // A tiny p keeps the largest only (of two equal ones, the later in the
  // ascending sort).
  p = models::process_logits(
      scores, models::GenerationConfig().top_k(0).top_p(1e-9));
  EXPECT_EQ(p.isfinite().sum().item<int64_t>(), 1);
}

TEST(Generation, GreedyRowsStopAtTheirStopTokens) {
  torch::manual_seed(1);
  models::LlamaForCausalLM model(models::LlamaConfig::tiny_test());
  model->eval();
  const auto ids = at::randint(100, {2, 4}, at::kLong);
  auto cfg = models::GenerationConfig().max_new_tokens(6);
  const auto free = models::generate(model, ids, at::Tensor(), cfg);
  ASSERT_EQ(free.size(1), 10);
  // Row 0's second new token as a stop token: each row ends at its first
  // stop token (padding 99 after it), and both rows done end the steps.
  const int64_t stop = free[0][5].item<int64_t>();
  const auto out = models::generate(
      model, ids, at::Tensor(), cfg.eos_token_id({stop}).pad_token_id(99));
  const auto first_stop = [&](const at::Tensor& row) {
    for (int64_t i = 4; i < row.size(0); ++i) {
      if (row[i].item<int64_t>() == stop) {
        return i;
      }
    }
    return row.size(0);
  };
  const int64_t end0 = first_stop(free[0]), end1 = first_stop(free[1]);
  ASSERT_EQ(out.size(1), std::min<int64_t>(10, std::max(end0, end1) + 1));
  for (int64_t r = 0; r < 2; ++r) {
    const int64_t end = r == 0 ? end0 : end1;
    for (int64_t i = 0; i < out.size(1); ++i) {
      EXPECT_EQ(
          out[r][i].item<int64_t>(),
          i <= end ? free[r][i].item<int64_t>() : 99)
          << "row " << r << " column " << i;
    }
  }
  // max_new_tokens 0: the prompts.
  EXPECT_TRUE(models::generate(model, ids, at::Tensor(), cfg.max_new_tokens(0))
                  .equal(ids));
}

TEST(Generation, GenerationConfigReadsTheDirectory) {
  colossalai::testing::ScratchDir dir("generation_config");
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir.path + "/" + name) << text;
  };
  write("config.json", R"({"eos_token_id": 2, "pad_token_id": null})");
  auto c = models::GenerationConfig::from_pretrained(dir.path);
  EXPECT_EQ(c.eos_token_id(), std::vector<int64_t>{2});
  EXPECT_EQ(c.pad_token_id(), -1);
  EXPECT_FALSE(c.do_sample());
  write(
      "generation_config.json",
      R"({"eos_token_id": [5, 7], "pad_token_id": 3, "do_sample": true,
          "temperature": 0.6, "top_k": 10, "top_p": 0.9,
          "max_new_tokens": 64, "bos_token_id": 1,
          "repetition_penalty": 1.2, "min_new_tokens": 5})");
  c = models::GenerationConfig::from_pretrained(dir.path);
  EXPECT_EQ(c.eos_token_id(), (std::vector<int64_t>{5, 7}));
  EXPECT_EQ(c.pad_token_id(), 3);
  EXPECT_TRUE(c.do_sample());
  EXPECT_DOUBLE_EQ(c.temperature(), 0.6);
  EXPECT_EQ(c.top_k(), 10);
  EXPECT_DOUBLE_EQ(c.top_p(), 0.9);
  EXPECT_EQ(c.max_new_tokens(), 64);
  EXPECT_DOUBLE_EQ(c.repetition_penalty(), 1.2);
  EXPECT_EQ(c.min_new_tokens(), 5);
  write("generation_config.json", R"({"eos_token_id": "</s>"})");
  expect_has(
      error_of([&] { models::GenerationConfig::from_pretrained(dir.path); }),
      "field 'eos_token_id' must be a token id");
  write("generation_config.json", R"({"do_sample": true, "top_p": 0})");
  expect_has(
      error_of([&] { models::GenerationConfig::from_pretrained(dir.path); }),
      "top_p must be in (0, 1]");
  write("generation_config.json", "{");
  expect_has(
      error_of([&] { models::GenerationConfig::from_pretrained(dir.path); }),
      "is not valid JSON");
}

TEST(Generation, BadInputIsRefusedByName) {
  torch::manual_seed(2);
  models::GPT2LMHeadModel model(models::GPT2Config::tiny_test());
  model->eval();
  const auto ids = at::randint(100, {2, 4}, at::kLong);
  auto right = at::ones({2, 4}, at::kLong);
  right.index_put_({1, 3}, 0);
  expect_has(
      error_of([&] { models::generate(model, ids, right); }),
      "padding must be on the left");
  expect_has(
      error_of([&] { models::generate(model, ids, at::zeros({2, 4}, at::kLong)); }),
      "at least one real token");
  expect_has(
      error_of([&] { models::generate(model, ids.to(at::kInt)); }),
      "input_ids must be int64 [B, T]");
  expect_has(
      error_of([&] {
        models::generate(
            model,
            ids,
            at::Tensor(),
            models::GenerationConfig().do_sample(true).temperature(0));
      }),
      "temperature must be a finite number above 0");
  expect_has(
      error_of([&] {
        models::generate(
            model,
            ids,
            at::Tensor(),
            models::GenerationConfig().repetition_penalty(0));
      }),
      "repetition_penalty must be a finite number above 0");
  // GPT-2 has 32 learned positions.
  expect_has(
      error_of([&] {
        models::generate(
            model, ids, at::Tensor(), models::GenerationConfig().max_new_tokens(40));
      }),
      "beyond the learned positions (n_positions 32)");
  // A model sharded with sequence parallelism.
  model->parallel_state().sp_mode =
      colossalai::shardformer::SequenceParallelMode::kAllToAll;
  expect_has(
      error_of([&] { models::generate(model, ids); }),
      "runs without sequence parallelism");
}
