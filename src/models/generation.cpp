#include <colossalai/models/generation.h>

#include "utils/bounded_json.h"

#include <colossalai/checkpoint_io/io_utils.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <ATen/core/grad_mode.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

namespace colossalai {
namespace models {

namespace {

namespace cd = checkpoint_io::detail;

// A token id field: an integer, or for eos_token_id a list of them.
std::vector<int64_t> token_ids(
    const nlohmann::json& j,
    const char* key,
    const std::string& file,
    bool list_allowed) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    return {};
  }
  auto one = [&](const nlohmann::json& v) {
    TORCH_CHECK(
        v.is_number_integer() && v.get<int64_t>() >= 0,
        file,
        ": field '",
        key,
        "' must be a token id (an integer >= 0)",
        list_allowed ? " or a list of them" : "",
        ", got ",
        utils::json_excerpt(v));
    return v.get<int64_t>();
  };
  if (list_allowed && it->is_array()) {
    std::vector<int64_t> ids;
    for (const auto& v : *it) {
      ids.push_back(one(v));
    }
    return ids;
  }
  return {one(*it)};
}

void check_config(const GenerationConfig& c) {
  TORCH_CHECK(
      c.max_new_tokens() >= 0,
      "generate: max_new_tokens must be >= 0, got ",
      c.max_new_tokens());
  if (c.do_sample()) {
    TORCH_CHECK(
        c.temperature() > 0 && std::isfinite(c.temperature()),
        "generate: temperature must be a finite number above 0 when "
        "sampling (do_sample), got ",
        c.temperature(),
        "; for greedy decoding set do_sample(false)");
    TORCH_CHECK(
        c.top_k() >= 0, "generate: top_k must be >= 0, got ", c.top_k());
    TORCH_CHECK(
        c.top_p() > 0 && c.top_p() <= 1,
        "generate: top_p must be in (0, 1], got ",
        c.top_p());
  }
  TORCH_CHECK(
      c.repetition_penalty() > 0 && std::isfinite(c.repetition_penalty()),
      "generate: repetition_penalty must be a finite number above 0 (1: "
      "none), got ",
      c.repetition_penalty());
  TORCH_CHECK(
      c.min_new_tokens() >= 0,
      "generate: min_new_tokens must be >= 0, got ",
      c.min_new_tokens());
  for (const int64_t id : c.eos_token_id()) {
    TORCH_CHECK(
        id >= 0, "generate: eos_token_id entries must be >= 0, got ", id);
  }
}

} // namespace

GenerationConfig GenerationConfig::from_pretrained(const std::string& dir) {
  GenerationConfig c;
  const auto gen_path = cd::join(dir, "generation_config.json");
  const bool has_gen = cd::exists(gen_path);
  const auto path = has_gen ? gen_path : cd::join(dir, "config.json");
  TORCH_CHECK(
      cd::exists(path),
      "GenerationConfig::from_pretrained: ",
      dir,
      " has neither generation_config.json nor config.json");
  const auto bytes = cd::read_bytes(path, cd::kMaxJsonFileBytes, "generation config");
  const auto j = utils::parse_bounded_json<nlohmann::json>(
      std::string(bytes.begin(), bytes.end()), path);
  TORCH_CHECK(j.is_object(), path, " must hold a JSON object");
  c.eos_token_id(token_ids(j, "eos_token_id", path, true));
  const auto pad = token_ids(j, "pad_token_id", path, false);
  c.pad_token_id(pad.empty() ? -1 : pad[0]);
  if (!has_gen) {
    return c;
  }
  auto number = [&](const char* key, double fallback, bool integer) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
      return fallback;
    }
    TORCH_CHECK(
        integer ? it->is_number_integer() : it->is_number(),
        path,
        ": field '",
        key,
        "' must be ",
        integer ? "an integer" : "a number",
        ", got ",
        utils::json_excerpt(*it));
    return it->get<double>();
  };
  auto it = j.find("do_sample");
  if (it != j.end() && !it->is_null()) {
    TORCH_CHECK(
        it->is_boolean(),
        path,
        ": field 'do_sample' must be true or false, got ",
        utils::json_excerpt(*it));
    c.do_sample(it->get<bool>());
  }
  c.temperature(number("temperature", c.temperature(), false));
  c.top_k(static_cast<int64_t>(number("top_k", 50, true)));
  c.top_p(number("top_p", c.top_p(), false));
  c.max_new_tokens(
      static_cast<int64_t>(number("max_new_tokens", c.max_new_tokens(), true)));
  c.repetition_penalty(
      number("repetition_penalty", c.repetition_penalty(), false));
  c.min_new_tokens(
      static_cast<int64_t>(number("min_new_tokens", c.min_new_tokens(), true)));
  try {
    check_config(c);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.msg());
  }
  return c;
}

at::Tensor process_logits(
    const at::Tensor& scores,
    const GenerationConfig& config) {
  TORCH_CHECK(
      scores.dim() == 2,
      "process_logits: scores must be [B, V], got ",
      scores.sizes());
  const double neg_inf = -std::numeric_limits<double>::infinity();
  at::Tensor s = scores;
  if (config.temperature() != 1.0) {
    s = s / config.temperature();
  }
  const int64_t v = s.size(1);
  if (config.top_k() > 0 && config.top_k() < v) {
    // Below the k-th largest: out (ties with it stay).
    auto kth = std::get<0>(s.topk(config.top_k(), -1)).narrow(1, -1, 1);
    s = s.masked_fill(s.lt(kth), neg_inf);
  }
  if (config.top_p() < 1.0) {
    // Ascending: the tokens whose cumulative mass stays within 1 - top_p
    // are out; the most likely one always stays.
    at::Tensor sorted, order;
    std::tie(sorted, order) = s.sort(-1, /*descending=*/false);
    auto out = sorted.softmax(-1).cumsum(-1).le(1.0 - config.top_p());
    out.narrow(1, v - 1, 1).fill_(false);
    s = s.masked_fill(out.scatter(1, order, out), neg_inf);
  }
  return s;
}

at::Tensor generate_with(
    const CausalLMStep& step,
    const at::Tensor& input_ids,
    const at::Tensor& attention_mask,
    const GenerationConfig& config) {
  check_config(config);
  TORCH_CHECK(
      input_ids.dim() == 2 && input_ids.size(0) > 0 && input_ids.size(1) > 0 &&
          input_ids.scalar_type() == at::kLong,
      "generate: input_ids must be int64 [B, T] with B, T > 0, got ",
      input_ids.scalar_type(),
      " ",
      input_ids.sizes());
  at::NoGradGuard no_grad;
  const auto device = input_ids.device();
  const int64_t b = input_ids.size(0), t = input_ids.size(1);
  at::Tensor mask;
  if (attention_mask.defined()) {
    TORCH_CHECK(
        attention_mask.sizes() == input_ids.sizes(),
        "generate: attention_mask must be [B, T] like input_ids ",
        input_ids.sizes(),
        ", got ",
        attention_mask.sizes());
    mask = attention_mask.to(device).ne(0).to(at::kLong);
    // A decoder continues from its last column: padding must come first.
    const auto bad = mask.narrow(1, 0, t - 1).gt(mask.narrow(1, 1, t - 1));
    TORCH_CHECK(
        t == 1 || !bad.any().item<bool>(),
        "generate: padding must be on the left (a decoder-only model "
        "continues from the last column); row ",
        bad.any(1).nonzero().min().item<int64_t>(),
        " of attention_mask has padding after a real token");
    TORCH_CHECK(
        mask.select(1, t - 1).all().item<bool>(),
        "generate: every row needs at least one real token in "
        "attention_mask");
  } else {
    mask = at::ones({b, t}, input_ids.options());
  }
  int64_t pad = config.pad_token_id();
  if (pad < 0 && !config.eos_token_id().empty()) {
    pad = config.eos_token_id()[0];
  }
  const auto eos = at::tensor(config.eos_token_id(), at::kLong).to(device);
  at::Generator gen;
  if (config.do_sample()) {
    gen = at::detail::createCPUGenerator(config.seed());
  }

  auto ids = input_ids;
  auto unfinished = at::ones({b}, input_ids.options().dtype(at::kBool));
  KVCache cache;
  cache.reserve(t + config.max_new_tokens());
  // Positions count the real tokens before each (padding gets 0, as
  // transformers; nothing sees it); each new token's is the last one's + 1.
  auto pos = (mask.cumsum(1) - 1).masked_fill(mask.eq(0), 0);
  for (int64_t n = 0; n < config.max_new_tokens(); ++n) {
    at::Tensor logits;
    if (!config.use_cache()) {
      logits = step(ids, mask, pos, nullptr);
    } else if (n == 0) {
      logits = step(ids, mask, pos, &cache);
    } else {
      logits = step(
          ids.narrow(1, -1, 1), mask, pos.narrow(1, -1, 1), &cache);
    }
    TORCH_CHECK(
        logits.dim() == 3 && logits.size(0) == b,
        "generate: the model step must give logits [B, T, vocab], got ",
        logits.sizes());
    auto scores = logits.select(1, -1).to(at::kFloat);
    if (config.repetition_penalty() != 1.0) {
      // Every token of the row but its left padding, once.
      const int64_t v = scores.size(1);
      auto seen = at::zeros({b, v + 1}, scores.options().dtype(at::kBool));
      seen.scatter_(1, ids.masked_fill(mask.eq(0), v).clamp_max(v), true);
      seen = seen.narrow(1, 0, v);
      const double penalty = config.repetition_penalty();
      scores = at::where(
          seen,
          at::where(scores.lt(0), scores * penalty, scores / penalty),
          scores);
    }
    if (n < config.min_new_tokens() && eos.numel() > 0) {
      const auto vocab = at::arange(scores.size(1), eos.options());
      scores = scores.masked_fill(
          vocab.unsqueeze(1).eq(eos.unsqueeze(0)).any(1).unsqueeze(0),
          -std::numeric_limits<double>::infinity());
    }
    at::Tensor next;
    if (config.do_sample()) {
      // The generator is a CPU one: the probabilities are drawn there.
      auto probs = process_logits(scores, config).softmax(-1).to(at::kCPU);
      next = at::multinomial(probs, 1, /*replacement=*/false, gen)
                 .squeeze(1)
                 .to(device);
    } else {
      next = scores.argmax(-1);
    }
    if (pad >= 0) {
      next = at::where(unfinished, next, at::full_like(next, pad));
    }
    ids = at::cat({ids, next.unsqueeze(1)}, 1);
    mask = at::cat({mask, at::ones({b, 1}, mask.options())}, 1);
    pos = at::cat({pos, pos.narrow(1, -1, 1) + 1}, 1);
    if (eos.numel() > 0) {
      unfinished = unfinished.logical_and(
          next.unsqueeze(1).eq(eos.unsqueeze(0)).any(1).logical_not());
      if (!unfinished.any().item<bool>()) {
        break;
      }
    }
  }
  return ids;
}

} // namespace models
} // namespace colossalai
