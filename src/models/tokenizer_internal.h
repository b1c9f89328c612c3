#pragma once

// What the tokenizer's source files share (src/models/tokenizer*.cpp): file
// reading and writing with errors that name the file, and UTF-8.

#include <colossalai/models/tokenizer.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <unordered_map>
#include <vector>

namespace colossalai {
namespace models {
namespace tokenizer_detail {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

/// Throws std::runtime_error("Tokenizer: FILE: WHAT").
[[noreturn]] void fail(const fs::path& file, const std::string& what);

std::string read_text(const fs::path& file);
json read_json(const fs::path& file);

/// Writes `text` to a temporary file renamed over `file` (never half a file).
void write_whole(const fs::path& file, const std::string& text);

/// A special token's content in tokenizer_config.json: a string or an
/// AddedToken object ({"content": ...}); "" for null / absent.
std::string token_content(const json& j);

/// The Split pre-tokenizer regexes we compute, as tokenizer.json spells
/// them.
extern const char* const kGpt2Pattern;
extern const char* const kLlama3Pattern;
extern const char* const kQwen2Pattern;
extern const char* const kBloomPattern;

/// U+2581, SentencePiece's space.
extern const char* const kSpace;

/// The key of the merge of ids (a, b) in Tokenizer::merge_of_.
uint64_t pair_key(int64_t a, int64_t b);

/// The code points of a text: each one's value (0xFFFFFFFF for a byte that
/// is not valid UTF-8, kept as a byte), and where its bytes start.
struct CodePoints {
  std::vector<uint32_t> cp;
  std::vector<size_t> at; // byte offsets, one more than cp (the end)
};
CodePoints decode_utf8(const std::string& s);
void append_utf8(std::string& out, uint32_t cp);

/// Unicode NFC as `tokenizers`' NFC normalizer (src/models/unicode_nfc.cpp);
/// bytes that are not UTF-8 are kept.
std::string nfc(const std::string& text);

/// The ids of the words of one encode call, each distinct word computed
/// once (a text repeats its words).
class WordCache {
 public:
  /// Appends the ids of `word` to `out`, from `bpe(word, ids)` the first
  /// time.
  template <class Bpe>
  void append(std::string word, const Bpe& bpe, std::vector<int64_t>& out) {
    auto it = ids_.find(word);
    if (it == ids_.end()) {
      std::vector<int64_t> ids;
      bpe(word, ids);
      it = ids_.emplace(std::move(word), std::move(ids)).first;
    }
    out.insert(out.end(), it->second.begin(), it->second.end());
  }

 private:
  std::unordered_map<std::string, std::vector<int64_t>> ids_;
};

/// White_Space as `tokenizers`' regexes read \s.
bool is_white(uint32_t cp);

/// Tokenizer's readers of SentencePiece files
/// (src/models/tokenizer_sentencepiece.cpp), friends of the class.
struct Reader {
  /// Whether tokenizer.json `j` is SentencePiece-style: byte fallback, a
  /// Metaspace pre-tokenizer or a Prepend / Replace normalizer.
  static bool is_sentencepiece_json(const json& j);
  /// tokenizer.json's normalizer: NFC, SentencePiece's Prepend / Replace.
  static void normalizer(Tokenizer& tok, const json& j, const fs::path& file);
  /// Its pre-tokenizer, decoder and BPE flags into `tok`.
  static void sentencepiece_pipeline(
      Tokenizer& tok,
      const json& j,
      const fs::path& file);
  /// tokenizer.json's post_processor: the ids around one sequence.
  static void post_processor(
      Tokenizer& tok,
      const json& p,
      const fs::path& file);
  /// transformers' LlamaTokenizer pipeline with tokenizer_config.json's
  /// `config` options: it replaces a tokenizer.json's normalizer,
  /// pre-tokenizer, decoder and BPE flags when the config names that class.
  static void llama_pipeline(Tokenizer& tok, const json& config);
  /// A SentencePiece tokenizer.model with tokenizer_config.json's `config`
  /// (an object, maybe empty), as transformers' LlamaTokenizer.
  static Tokenizer sentencepiece_model(
      const fs::path& file,
      const json& config);
};

} // namespace tokenizer_detail
} // namespace models
} // namespace colossalai
