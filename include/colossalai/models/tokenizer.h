#pragma once

/// A byte-level BPE tokenizer, equal to Hugging Face's GPT-2 tokenizer
/// (transformers' GPT2Tokenizer / `tokenizers`' ByteLevel BPE with
/// add_prefix_space=False): the same ids for the same text and vocabulary,
/// with no special tokens added by encode. Plain C++ (no LibTorch).

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colossalai {
namespace models {

/// Text to ids and back with a byte-level BPE vocabulary: GPT-2's
/// pre-tokenization (contractions, letter / number / other runs with one
/// leading space, whitespace runs), each word's UTF-8 bytes mapped to GPT-2's
/// printable characters (bytes_to_unicode) and merged by the merges' ranks.
/// Added tokens (tokenizer.json's added_tokens, tokenizer_config.json's
/// special tokens) are matched literally before pre-tokenization and encode
/// to their own id.
///
/// \code
///   auto tok = colossalai::models::Tokenizer::from_pretrained("gpt2_dir");
///   std::vector<int64_t> ids = tok.encode("Hello world");  // {15496, 995}
///   std::string text = tok.decode(ids);                     // "Hello world"
///
///   auto small = colossalai::models::Tokenizer::train(corpus, 1000);
///   small.save_pretrained("out");  // AutoTokenizer.from_pretrained("out")
/// \endcode
class Tokenizer {
 public:
  /// A model directory's tokenizer: tokenizer.json (a "BPE" model with a
  /// ByteLevel pre-tokenizer, as GPT-2 / OPT / Bloom-style byte-level
  /// files), or vocab.json + merges.txt. tokenizer_config.json, where
  /// present, names the special tokens (eos_token, ...) and
  /// model_max_length. Errors (std::runtime_error) name the file and what is
  /// wrong (missing, not byte-level BPE, malformed).
  static Tokenizer from_pretrained(const std::string& dir);

  /// Trains a byte-level BPE of `vocab_size` entries (256 byte tokens, id =
  /// byte value, then merges, then "<|endoftext|>" as the last id) on
  /// `text`, greedily merging the most frequent adjacent pair (ties: the
  /// lexicographically smallest pair of token strings, deterministic) over
  /// the pre-tokenized words. Stops early (a smaller vocabulary) when no
  /// pair is left. `vocab_size` must be at least 257.
  static Tokenizer train(const std::string& text, int64_t vocab_size);

  /// The ids of `text` (any bytes; invalid UTF-8 bytes are kept as bytes).
  std::vector<int64_t> encode(const std::string& text) const;

  /// The text of `ids`: each token's bytes (added tokens: their content)
  /// concatenated; a byte sequence that is not valid UTF-8 is returned as
  /// is. Throws std::out_of_range for an unknown id.
  std::string decode(const std::vector<int64_t>& ids) const;

  /// The number of ids (largest id + 1), added / special tokens included.
  int64_t vocab_size() const;

  /// The id of the eos token: tokenizer_config.json's eos_token, else
  /// "<|endoftext|>"; -1 if the vocabulary has neither.
  int64_t eos_token_id() const;

  /// The id of a token string in byte-level form ("Ġworld") or of an added
  /// token; -1 if none.
  int64_t token_to_id(const std::string& token) const;

  /// The token string of `id` (byte-level form, or an added token's
  /// content). Throws std::out_of_range for an unknown id.
  const std::string& id_to_token(int64_t id) const;

  /// Writes vocab.json, merges.txt (GPT-2's layout, "#version: 0.2" first)
  /// and tokenizer_config.json (tokenizer_class "GPT2Tokenizer", the
  /// eos/bos/unk tokens, model_max_length, the added tokens) so that
  /// transformers' AutoTokenizer.from_pretrained(dir) loads it. Each file is
  /// written whole (a temporary file renamed over it). Creates `dir`.
  void save_pretrained(const std::string& dir) const;

 private:
  Tokenizer() = default;

  enum class Split { kGpt2, kBloom, kNone };
  struct AddedToken {
    std::string content;
    int64_t id = -1;
    bool special = true;
    bool normalized = false;
    bool lstrip = false;
    bool rstrip = false;
  };
  struct Merge {
    int64_t rank;
    int64_t id;
  };

  void add_token(const std::string& token, int64_t id);
  void add_merge(const std::string& a, const std::string& b);
  void add_special(const std::string& content, bool special = true);
  void bpe(const std::string& word, std::vector<int64_t>& out) const;
  void encode_plain(const std::string& text, std::vector<int64_t>& out) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> tokens_; // by id; "" for an unused id
  std::vector<std::pair<std::string, std::string>> merges_; // by rank
  std::unordered_map<std::string, Merge> merge_of_; // "a\xff" "b" -> merge
  std::vector<AddedToken> added_;
  std::unordered_map<int64_t, size_t> added_of_id_;
  Split split_ = Split::kGpt2;
  bool ignore_merges_ = false;
  int64_t unk_id_ = -1;
  std::string eos_token_, bos_token_, unk_token_;
  int64_t model_max_length_ = 1024;
};

} // namespace models
} // namespace colossalai
