// Greedy generation, one thread: models::generate with its KV cache against
// transformers' generate (bench/peers/generate_peer.py) on the same
// LLaMA-shaped directory (gpt-small-cpu's size, GQA) and prompts (4 of 64
// tokens, two left-padded), and against our generation without a cache
// (every step runs the whole sequence again). The sequences are checked
// equal to transformers'. Ours and the peer alternate round by round; the
// ratios are medians of the per-round ratios.
//
// bench_generate [--rounds R] [--new N] [--work DIR] [--python PY]
//                [--out FILE.json]

#include <colossalai/models/generation.h>
#include <colossalai/models/llama.h>
#include <colossalai/models/pretrained.h>
#include <colossalai/checkpoint_io/safetensors.h>

#include "bench_util.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace models = colossalai::models;
using colossalai::bench::median;
using colossalai::bench::stats_json;

const char* const kSource = COLOSSALAI_BENCH_SOURCE_DIR;

using colossalai::bench::run_command;
const auto& quote = colossalai::bench::shell_quote;

// FNV-1a 64 of the ids as little-endian int64, as the peer computes it.
uint64_t fnv(const at::Tensor& t) {
  const auto c = t.contiguous();
  return colossalai::bench::fnv1a_ids(
      c.data_ptr<int64_t>(), static_cast<size_t>(c.numel()));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

} // namespace

int main(int argc, char** argv) {
  int rounds = 5;
  int64_t new_tokens = 128;
  std::string work = (fs::temp_directory_path() / "bench_generate").string();
  std::string python = std::string(kSource) + "/.venv/bin/python";
  std::string out_file;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rounds") {
      rounds = std::stoi(v);
    } else if (k == "--new") {
      new_tokens = std::stoll(v);
    } else if (k == "--work") {
      work = v;
    } else if (k == "--python") {
      python = v;
    } else if (k == "--out") {
      out_file = v;
    } else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  at::set_num_threads(1);
  const std::string peer =
      std::string(kSource) + "/bench/peers/generate_peer.py";
  const std::string dir = work + "/llama";
  if (!fs::exists(dir + "/prompts.safetensors")) {
    fs::create_directories(dir);
    run_command(quote(python) + " " + quote(peer) + " make " + quote(dir) + " 2>&1");
  }
  auto model = models::from_pretrained<models::LlamaForCausalLM>(dir);
  model->eval();
  auto prompts = colossalai::checkpoint_io::safetensors::load_file(
      dir + "/prompts.safetensors");
  const at::Tensor ids = prompts["ids"], mask = prompts["attention_mask"];
  auto cfg = models::GenerationConfig().max_new_tokens(new_tokens).pad_token_id(0);
  models::generate(model, ids, mask, cfg); // warm-up

  std::vector<double> ours, uncached, theirs, vs_peer, vs_uncached;
  bool equal = true;
  nlohmann::json versions;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    const auto out = models::generate(model, ids, mask, cfg);
    ours.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    const auto slow =
        models::generate(model, ids, mask, models::GenerationConfig(cfg).use_cache(false));
    uncached.push_back(seconds_since(t0));
    const auto j = nlohmann::json::parse(run_command(
        quote(python) + " " + quote(peer) + " run " + quote(dir) + " " +
        std::to_string(new_tokens) + " 2>/dev/null"));
    versions = j.at("versions");
    theirs.push_back(j.at("seconds").get<double>());
    vs_peer.push_back(theirs.back() / ours.back());
    vs_uncached.push_back(uncached.back() / ours.back());
    equal = equal && out.equal(slow) &&
        std::to_string(fnv(out)) == j.at("fnv").get<std::string>() &&
        j.at("new_tokens").get<int64_t>() == new_tokens;
    std::fprintf(
        stderr,
        "round %d: ours %.3f s, transformers %.3f s, ours without a cache "
        "%.3f s\n",
        r + 1,
        ours.back(),
        theirs.back(),
        uncached.back());
  }
  const double tokens = static_cast<double>(ids.size(0) * new_tokens);
  std::printf(
      "greedy, 4 prompts x 64 tokens (2 left-padded), %lld new tokens each, "
      "1 thread, medians of %d rounds\n",
      static_cast<long long>(new_tokens),
      rounds);
  std::printf("| | seconds | new tokens/s | speed-up of ours |\n|---|---|---|---|\n");
  std::printf(
      "| ours (KV cache) | %.3f | %.0f | |\n",
      median(ours),
      tokens / median(ours));
  std::printf(
      "| transformers generate | %.3f | %.0f | %.2fx |\n",
      median(theirs),
      tokens / median(theirs),
      median(vs_peer));
  std::printf(
      "| ours without a cache | %.3f | %.0f | %.2fx |\n",
      median(uncached),
      tokens / median(uncached),
      median(vs_uncached));
  std::printf("sequences equal to transformers': %s\n", equal ? "yes" : "NO");
  if (!out_file.empty()) {
    nlohmann::json j = {
        {"benchmark", "generate"},
        {"model",
         "LLaMA of gpt-small-cpu's size (vocab 4096, width 256, 4 layers, 4 heads over 2 key/value heads)"},
        {"batch", ids.size(0)},
        {"prompt_tokens", ids.size(1)},
        {"new_tokens", new_tokens},
        {"threads", 1},
        {"ours_seconds", nlohmann::json::parse(stats_json(ours))},
        {"peer_seconds", nlohmann::json::parse(stats_json(theirs))},
        {"uncached_seconds", nlohmann::json::parse(stats_json(uncached))},
        {"peer_over_ours", nlohmann::json::parse(stats_json(vs_peer))},
        {"uncached_over_ours", nlohmann::json::parse(stats_json(vs_uncached))},
        {"sequences_equal", equal},
        {"versions", versions},
        {"machine", nlohmann::json::parse(colossalai::bench::machine_json())}};
    std::ofstream(out_file) << j.dump(2) << "\n";
  }
  return equal ? 0 : 1;
}
