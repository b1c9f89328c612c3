// models::Tokenizer against transformers' (the `tokenizers` library behind
// it), one thread each, on Debian's fortunes: encode time of one long text
// with four tokenizers trained on it (GPT-2's byte-level pipeline, LLaMA 3's
// and Qwen 2's split regex, Qwen 2's NFC, a SentencePiece BPE read from
// tokenizer.model), the ids checked equal. Ours and the Python peer
// (bench/peers/tokenizer_peer.py) alternate round by round; the ratio is
// the median of the per-round ratios.
//
// bench_tokenizer [--rounds R] [--mb M] [--work DIR] [--python PY]
//                 [--out FILE.json]

#include <colossalai/models/tokenizer.h>

#include "bench_util.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace models = colossalai::models;
using colossalai::bench::median;
using colossalai::bench::stats_json;

const char* const kSource = COLOSSALAI_BENCH_SOURCE_DIR;
const char* const kNames[] = {"gpt2", "llama3", "qwen2", "sentencepiece"};

using colossalai::bench::run_command;
const auto& quote = colossalai::bench::shell_quote;

// FNV-1a 64 of the ids as little-endian int64, as the peer computes it.
uint64_t fnv(const std::vector<int64_t>& ids) {
  return colossalai::bench::fnv1a_ids(ids.data(), ids.size());
}

// The fortune files (no extension: .dat indexes and .u8 links are not
// text), in name order, up to `bytes`.
std::string corpus(size_t bytes) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator("/usr/share/games/fortunes")) {
    if (e.is_regular_file() && e.path().extension().empty()) {
      files.push_back(e.path());
    }
  }
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    text += ss.str();
    if (text.size() >= bytes) {
      break;
    }
  }
  text.resize(std::min(text.size(), bytes));
  // Whole code points only (the peer reads the file as UTF-8).
  while (!text.empty() &&
         (static_cast<unsigned char>(text.back()) & 0xC0) == 0x80) {
    text.pop_back();
  }
  if (!text.empty() && static_cast<unsigned char>(text.back()) >= 0xC0) {
    text.pop_back();
  }
  return text;
}

} // namespace

int main(int argc, char** argv) {
  int rounds = 5;
  double mb = 2.0;
  std::string work = (fs::temp_directory_path() / "bench_tokenizer").string();
  std::string python = std::string(kSource) + "/.venv/bin/python";
  std::string out_file;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rounds") {
      rounds = std::stoi(v);
    } else if (k == "--mb") {
      mb = std::stod(v);
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
  if (!fs::exists("/usr/share/games/fortunes")) {
    std::cerr << "bench_tokenizer: Debian's fortunes are absent "
                 "(./scripts/setup.sh installs them)\n";
    return 2;
  }
  const std::string peer =
      std::string(kSource) + "/bench/peers/tokenizer_peer.py";
  const std::string text = corpus(static_cast<size_t>(mb * 1e6));
  fs::create_directories(work);
  const std::string corpus_file = work + "/corpus.txt";
  std::ofstream(corpus_file, std::ios::binary) << text;

  // The tokenizers, trained once on this corpus by the Python libraries.
  if (!fs::exists(work + "/sentencepiece/tokenizer.model") ||
      !fs::exists(work + "/stamp") ||
      std::stoul(run_command("cat " + quote(work + "/stamp"))) != text.size()) {
    std::fprintf(
        stderr, "training the tokenizers on %zu bytes...\n", text.size());
    run_command(quote(python) + " " + quote(peer) + " fixtures " + quote(work) + " " +
        quote(corpus_file) + " 2>&1");
    std::ofstream(work + "/stamp") << text.size();
  }

  struct Row {
    std::string name;
    models::Tokenizer tok;
    double load_ms;
    int64_t vocab, ids;
    uint64_t hash;
    bool equal = true;
    std::vector<double> ours, theirs, ratio;
  };
  std::vector<Row> rows;
  std::string dirs;
  for (const char* name : kNames) {
    const std::string dir = work + "/" + name;
    const auto t0 = std::chrono::steady_clock::now();
    auto tok = models::Tokenizer::from_pretrained(dir);
    const double load_ms = std::chrono::duration<double, std::milli>(
                               std::chrono::steady_clock::now() - t0)
                               .count();
    const auto ids = tok.encode(text); // warm-up, and the ids to compare
    rows.push_back(
        {name,
         std::move(tok),
         load_ms,
         0,
         static_cast<int64_t>(ids.size()),
         fnv(ids)});
    rows.back().vocab = rows.back().tok.vocab_size();
    dirs += ' ';
    dirs += quote(dir);
  }

  nlohmann::json versions;
  for (int r = 0; r < rounds; ++r) {
    for (auto& row : rows) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto ids = row.tok.encode(text);
      row.ours.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count());
      row.equal = row.equal && static_cast<int64_t>(ids.size()) == row.ids;
    }
    const auto j = nlohmann::json::parse(run_command(
        "TOKENIZERS_PARALLELISM=false " + quote(python) + " " + quote(peer) +
        " encode " + quote(corpus_file) + dirs + " 2>/dev/null"));
    versions = j.at("versions");
    for (auto& row : rows) {
      const auto& p = j.at("results").at(work + "/" + row.name);
      row.theirs.push_back(p.at("seconds").get<double>());
      row.ratio.push_back(row.theirs.back() / row.ours.back());
      row.equal = row.equal && p.at("ids").get<int64_t>() == row.ids &&
          p.at("fnv").get<std::string>() == std::to_string(row.hash);
    }
    std::fprintf(stderr, "round %d/%d done\n", r + 1, rounds);
  }

  std::printf(
      "\n%zu bytes of fortunes, %d rounds, one thread each; median (p10-p90)\n\n",
      text.size(),
      rounds);
  std::printf(
      "| tokenizer | vocab | ids | equal | ours s | transformers s | "
      "ours MB/s | transformers / ours |\n|---|---|---|---|---|---|---|---|\n");
  std::ostringstream js;
  js << "{\n  \"machine\": " << colossalai::bench::machine_json()
     << ",\n  \"peer\": " << versions.dump()
     << ",\n  \"corpus_bytes\": " << text.size()
     << ",\n  \"rounds\": " << rounds << ",\n  \"tokenizers\": [";
  for (size_t k = 0; k < rows.size(); ++k) {
    const auto& row = rows[k];
    std::printf(
        "| %s | %lld | %lld | %s | %.3f | %.3f | %.2f | %.2fx |\n",
        row.name.c_str(),
        static_cast<long long>(row.vocab),
        static_cast<long long>(row.ids),
        row.equal ? "yes" : "NO",
        median(row.ours),
        median(row.theirs),
        text.size() / 1e6 / median(row.ours),
        median(row.ratio));
    js << (k ? "," : "") << "\n    {\"name\": \"" << row.name
       << "\", \"vocab\": " << row.vocab << ", \"ids\": " << row.ids
       << ", \"ids_equal\": " << (row.equal ? "true" : "false")
       << ", \"load_ms\": " << row.load_ms
       << ", \"ours_s\": " << stats_json(row.ours)
       << ", \"transformers_s\": " << stats_json(row.theirs)
       << ", \"transformers_over_ours\": " << stats_json(row.ratio) << "}";
  }
  js << "\n  ]\n}\n";
  if (!out_file.empty()) {
    std::ofstream(out_file) << js.str();
  }
  bool all_equal = true;
  for (const auto& row : rows) {
    all_equal = all_equal && row.equal;
  }
  return all_equal ? 0 : 1;
}
