#pragma once

// What the tokenizer's source files share (src/models/tokenizer*.cpp): file
// reading and writing with errors that name the file, and UTF-8.

#include <colossalai/models/tokenizer.h>

#include <nlohmann/json.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colossalai {
namespace models {
namespace tokenizer_detail {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

/// Throws std::runtime_error("Tokenizer: FILE: WHAT").
[[noreturn]] void fail(const fs::path& file, const std::string& what);

/// The bounds of what the tokenizer reads (src/utils/bounded_read.h):
/// tokenizer.json, vocab.json, merges.txt, tokenizer.model; the JSON
/// configs beside them; JSON nesting (serde_json's, as `tokenizers`).
constexpr uint64_t kMaxTokenizerFileBytes = uint64_t(256) << 20;
constexpr uint64_t kMaxConfigFileBytes = uint64_t(64) << 20;
constexpr size_t kMaxJsonDepth = 128;

/// The bytes of a regular file of at most `max_bytes` (a FIFO, a device or
/// a larger file fails naming it).
std::string read_text(const fs::path& file, uint64_t max_bytes);
/// A JSON file of at most `max_bytes`, nested at most kMaxJsonDepth deep.
json read_json(const fs::path& file, uint64_t max_bytes);

/// A JSON value of a file the tokenizer reads, with its path in the file
/// ("model.vocab", "added_tokens[3].id") for errors: typed reads where
/// absent or null gives the default and another type fails naming the file
/// and the field ("Tokenizer: FILE: malformed: field 'model.type' must be a
/// string, got 5"), never the JSON library's own message.
class Field {
 public:
  Field(const json& j, std::string path, const fs::path& file)
      : j_(&j), path_(std::move(path)), file_(&file) {}
  /// The member `key` (null when absent or when this is not an object).
  Field operator[](const std::string& key) const;
  /// The element `i` (null when absent or when this is not an array).
  Field operator[](size_t i) const;
  const json& value() const {
    return *j_;
  }
  const std::string& path() const {
    return path_;
  }
  const fs::path& file() const {
    return *file_;
  }
  bool is_null() const {
    return j_->is_null();
  }
  bool is_object() const {
    return j_->is_object();
  }
  std::string str(const std::string& def = "") const;
  bool flag(bool def) const;
  /// An integer in [min, max].
  int64_t integer(int64_t def, int64_t min, int64_t max) const;
  /// The elements of an array (none when null); fails on another type.
  std::vector<Field> elements() const;
  /// Fails: "malformed: field 'PATH' WHAT, got VALUE" (VALUE cut short).
  [[noreturn]] void bad(const std::string& what) const;

 private:
  const json* j_;
  std::string path_;
  const fs::path* file_;
};

/// A JSON value for a message: at most 80 characters of it.
std::string brief(const json& j);

/// Writes `text` to a temporary file renamed over `file` (never half a file).
void write_whole(const fs::path& file, const std::string& text);

/// A special token's content in tokenizer_config.json: a string or an
/// AddedToken object ({"content": ...}); "" for null / absent.
std::string token_content(const Field& f);

/// The Split pre-tokenizer regexes we compute, as tokenizer.json spells
/// them.
extern const char* const kGpt2Pattern;
extern const char* const kLlama3Pattern;
extern const char* const kQwen2Pattern;
extern const char* const kBloomPattern;

/// GPT-2's end-of-text token, the byte-level default of the special tokens.
extern const char* const kEndOfText;

/// U+2581, SentencePiece's space.
extern const char* const kSpace;

/// The key of the merge of ids (a, b) in Tokenizer::merge_of_.
uint64_t pair_key(int64_t a, int64_t b);

/// The code point at byte `i` of `s` and, in `len`, its length in bytes
/// (0xFFFFFFFF and 1 for a byte that is not valid UTF-8).
uint32_t code_point_at(const std::string& s, size_t i, size_t& len);

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

/// The classes of the pre-tokenization regexes (src/models/
/// tokenizer_unicode.cpp): \p{L}, \p{N}, \s as `tokenizers` reads them.
enum class Cls : uint8_t { kLetter, kNumber, kSpace, kOther };
Cls classify(uint32_t cp);

/// White_Space as `tokenizers`' regexes read \s.
bool is_white(uint32_t cp);

/// GPT-2's bytes_to_unicode (src/models/tokenizer_pretokenize.cpp): the
/// printable bytes stand for themselves, the others for 256, 257, ...
struct ByteMap {
  std::array<std::string, 256> to_char;      // byte -> UTF-8 of its character
  std::map<uint32_t, unsigned char> to_byte; // character -> byte
  ByteMap();
};
const ByteMap& byte_map();

/// Pre-tokenization: the byte ranges [first, second) of a text's words, as
/// the regexes of `tokenizers`' pre-tokenizers split it (by hand, linear).
using Spans = std::vector<std::pair<size_t, size_t>>;
/// GPT-2's ByteLevel regex.
Spans split_gpt2(const std::string& text);
/// LLaMA 3's Split regex (`max_digits` 3; Qwen 2's: 1).
Spans split_llama3(const std::string& text, size_t max_digits);
/// Bloom's Split regex, behaviour "isolated".
Spans split_bloom(const std::string& text);

/// A tokenizer.json component as a list: the members of a "Sequence" of
/// `key` (nested Sequences flattened), one component, or none (null).
std::vector<Field> components(const Field& f, const char* key);

/// Tokenizer's readers of its files, friends of the class: tokenizer.json,
/// vocab.json + merges.txt and tokenizer_config.json
/// (src/models/tokenizer_json.cpp); SentencePiece's pipelines
/// (src/models/tokenizer_sentencepiece_pipeline.cpp) and tokenizer.model
/// (src/models/tokenizer_sentencepiece.cpp).
struct Reader {
  /// tokenizer.json `file`: the model (vocabulary, merges), the added
  /// tokens, the normalizer, pre-tokenizer, decoder and post-processor.
  static void tokenizer_json(Tokenizer& tok, const fs::path& file);
  /// GPT-2's vocab.json and merges.txt.
  static void vocab_and_merges(
      Tokenizer& tok,
      const fs::path& vocab_json,
      const fs::path& merges_txt);
  /// tokenizer_config.json's special tokens, added_tokens_decoder,
  /// model_max_length and, with `llama` (a tokenizer.json under the class
  /// LlamaTokenizer), LlamaTokenizer's pipeline.
  static void config(Tokenizer& tok, const Field& config, bool llama);

  /// Whether tokenizer.json `root` is SentencePiece-style: byte fallback, a
  /// Metaspace pre-tokenizer or a Prepend / Replace normalizer.
  static bool is_sentencepiece_json(const Field& root);
  /// A byte-level pre-tokenizer: ByteLevel, or a Split (GPT-2's, LLaMA
  /// 3's, Qwen 2's or Bloom's regex, isolated) then a ByteLevel without
  /// its regex.
  static void byte_level_pre_tokenizer(Tokenizer& tok, const Field& pre);
  /// tokenizer.json's normalizer: NFC, SentencePiece's Prepend / Replace.
  static void normalizer(Tokenizer& tok, const Field& root);
  /// Its pre-tokenizer, decoder and BPE flags into `tok`.
  static void sentencepiece_pipeline(Tokenizer& tok, const Field& root);
  /// tokenizer.json's post_processor: the ids around one sequence.
  static void post_processor(Tokenizer& tok, const Field& p);
  /// transformers' LlamaTokenizer pipeline with tokenizer_config.json's
  /// `config` options: it replaces a tokenizer.json's normalizer,
  /// pre-tokenizer, decoder and BPE flags when the config names that class.
  static void llama_pipeline(Tokenizer& tok, const Field& config);
  /// A SentencePiece tokenizer.model with tokenizer_config.json's `config`
  /// (an object, maybe empty), as transformers' LlamaTokenizer.
  static Tokenizer sentencepiece_model(
      const fs::path& file,
      const Field& config);
};

} // namespace tokenizer_detail
} // namespace models
} // namespace colossalai
