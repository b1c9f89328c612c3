#pragma once

/// Hugging Face's tokenizers in plain C++ (no LibTorch): the same ids as
/// transformers' tokenizer for the same files and text.
///  - Byte-level BPE (GPT-2, OPT, Bloom, LLaMA 3, Qwen 2...: transformers'
///    GPT2Tokenizer, `tokenizers`' ByteLevel BPE with add_prefix_space=False,
///    with GPT-2's, LLaMA 3's, Qwen 2's or Bloom's split regex and an
///    optional Unicode NFC normalizer).
///  - SentencePiece BPE (LLaMA 1/2, Mistral, ...: transformers'
///    LlamaTokenizer): from a SentencePiece `tokenizer.model`, read by our
///    own reader of its protobuf (no libsentencepiece), or from the
///    tokenizer.json transformers converts it into (Metaspace, byte
///    fallback).

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colossalai {
namespace models {
namespace tokenizer_detail {
struct Reader;
struct AddedTokenMatchers;
} // namespace tokenizer_detail

/// Text to ids and back.
///
/// Byte-level BPE: the text split into words by the file's regex (GPT-2's:
/// contractions, letter / number / other runs with one leading space,
/// whitespace runs; LLaMA 3's: digits in threes, line breaks apart; ...),
/// computed by hand, each word's UTF-8 bytes mapped to GPT-2's printable
/// characters (bytes_to_unicode) and merged by the merges' ranks.
///
/// SentencePiece BPE (as transformers converts it, NOTE [SentencePiece] in
/// src/models/tokenizer_sentencepiece.cpp): spaces become "▁", a "▁" is
/// prepended to the first piece of text (LlamaTokenizer's default; to every
/// piece between added tokens with `legacy`, to none with
/// add_prefix_space=false), code points are merged by the merges' ranks,
/// and a code point outside the vocabulary becomes its UTF-8 bytes'
/// "<0xXX>" pieces (byte fallback).
///
/// Added tokens (tokenizer.json's added_tokens, tokenizer_config.json's
/// special tokens, a SentencePiece model's control and user-defined pieces)
/// are matched literally before pre-tokenization and encode to their own
/// id.
///
/// \code
///   auto tok = colossalai::models::Tokenizer::from_pretrained("gpt2_dir");
///   std::vector<int64_t> ids = tok.encode("Hello world");  // {15496, 995}
///   std::string text = tok.decode(ids);                     // "Hello world"
///
///   auto llama = colossalai::models::Tokenizer::from_pretrained("llama_dir");
///   llama.encode("Hello", /*add_special_tokens=*/true);     // {1, 15043}
///
///   auto small = colossalai::models::Tokenizer::train(corpus, 1000);
///   small.save_pretrained("out");  // AutoTokenizer.from_pretrained("out")
/// \endcode
class Tokenizer {
 public:
  /// A model directory's tokenizer, in transformers' order of preference:
  /// tokenizer.json (a "BPE" model, byte-level as GPT-2 / OPT / Bloom /
  /// LLaMA 3 / Qwen 2 (its NFC normalizer included), or
  /// SentencePiece-style with a Metaspace pre-tokenizer or the legacy
  /// Prepend / Replace normalizer and byte fallback, as LLaMA / Mistral);
  /// vocab.json + merges.txt; a SentencePiece tokenizer.model of model type
  /// BPE. tokenizer_config.json, where present, names the special tokens
  /// (eos_token, ...), model_max_length and, for tokenizer.model,
  /// add_bos_token / add_eos_token / legacy / add_prefix_space. Errors
  /// (std::runtime_error) name the file and what is wrong (missing,
  /// malformed, a model type / normalizer / pre-tokenizer that is not
  /// supported) and, for a field, its path ("field 'model.vocab' ...").
  /// What hostile files cannot do: only regular files are read (a FIFO or a
  /// device is refused, never waited on), tokenizer files up to 256 MiB and
  /// JSON configs up to 64 MiB; JSON nested over 128 levels is refused
  /// before parsing (as `tokenizers`); every id is below the number of
  /// tokens the file lists (vocabulary and added tokens); a value quoted in
  /// an error is cut short.
  static Tokenizer from_pretrained(const std::string& dir);

  /// Trains a byte-level BPE of `vocab_size` entries (256 byte tokens, id =
  /// byte value, then merges, then "<|endoftext|>" as the last id) on
  /// `text`, greedily merging the most frequent adjacent pair (ties: the
  /// lexicographically smallest pair of token strings, deterministic) over
  /// the pre-tokenized words. Stops early (a smaller vocabulary) when no
  /// pair is left. `vocab_size` must be at least 257.
  static Tokenizer train(const std::string& text, int64_t vocab_size);

  /// The ids of `text` (any bytes; invalid UTF-8 bytes are kept as bytes),
  /// without special tokens (transformers' add_special_tokens=False). Time
  /// O(n log n) in the text's length whatever it holds (runs of one
  /// character, added tokens that strip whitespace).
  std::vector<int64_t> encode(const std::string& text) const;

  /// With `add_special_tokens`, the ids with the tokens the tokenizer's
  /// post-processor adds around one sequence (e.g. LLaMA's bos with
  /// add_bos_token; GPT-2 adds none), as transformers' `tokenizer(text)`.
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens)
      const;

  /// The text of `ids` (transformers' decode, special tokens kept): each
  /// token's bytes (added tokens: their content) concatenated, "▁" read as
  /// a space and "<0xXX>" pieces as bytes for SentencePiece, whose decoder
  /// also drops the one leading space encode prepended. A byte sequence
  /// that is not valid UTF-8 is returned as is (transformers: U+FFFD).
  /// Throws std::out_of_range for an unknown id.
  std::string decode(const std::vector<int64_t>& ids) const;

  /// The number of ids (largest id + 1), added / special tokens included.
  int64_t vocab_size() const;

  /// The id of the eos token: tokenizer_config.json's eos_token, else
  /// "<|endoftext|>" (SentencePiece: "</s>"); -1 if the vocabulary has
  /// neither.
  int64_t eos_token_id() const;

  /// The id of the bos token (as eos_token_id; "<s>" for SentencePiece);
  /// -1 if none.
  int64_t bos_token_id() const;

  /// The id of a token string in the vocabulary's form ("Ġworld",
  /// "▁world") or of an added token; -1 if none.
  int64_t token_to_id(const std::string& token) const;

  /// The token string of `id` (byte-level form, or an added token's
  /// content). Throws std::out_of_range for an unknown id.
  const std::string& id_to_token(int64_t id) const;

  /// Writes the tokenizer so that transformers'
  /// AutoTokenizer.from_pretrained(dir) loads it with the same ids:
  /// GPT-2's pipeline (what `train` makes) as vocab.json + merges.txt
  /// (GPT-2's layout) and tokenizer_config.json (tokenizer_class
  /// "GPT2Tokenizer", the eos / bos / unk tokens, model_max_length, the
  /// added tokens); any other (SentencePiece, LLaMA 3's or Qwen 2's regex,
  /// NFC, a template) as tokenizer.json (the whole pipeline),
  /// tokenizer_config.json and, when read from one, a copy of
  /// tokenizer.model. Each file is written whole (a temporary file renamed
  /// over it). Creates `dir`.
  void save_pretrained(const std::string& dir) const;

 private:
  Tokenizer() = default;

  enum class Kind { kByteLevel, kSentencePiece };
  enum class Split { kGpt2, kLlama3, kQwen2, kBloom, kNone };
  enum class Prepend { kNever, kFirst, kAlways };
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

  struct Span {
    size_t begin, end;
    int64_t id; // an added token's, or -1 for plain text
  };

  void add_token(const std::string& token, int64_t id);
  void add_merge(const std::string& a, const std::string& b);
  void add_merge(int64_t a, int64_t b, int64_t merged);
  void add_special(const std::string& content, bool special = true);
  void push_added(AddedToken token);
  // After loading: the added-token matchers and words_at_spaces_.
  void finish();
  void bpe(const std::string& word, std::vector<int64_t>& out) const;
  void merge_symbols(std::vector<int64_t>& ids) const;
  std::vector<Span> split_added(const std::string& text, bool normalized) const;
  std::string normalize(const std::string& text) const;
  void encode_plain(
      const std::string& text,
      bool at_start,
      std::vector<int64_t>& out) const;
  std::vector<const AddedToken*> added_by_id() const;
  // tokenizer_config.json: the class, `flags`, the eos / bos / unk tokens,
  // model_max_length, added_tokens_decoder.
  void write_config(
      const std::string& dir,
      const std::string& tokenizer_class,
      const std::vector<std::pair<std::string, bool>>& flags) const;

  // SentencePiece BPE (src/models/tokenizer_sentencepiece*.cpp).
  // The readers of tokenizer.json's SentencePiece-style pipeline and
  // post-processor, of tokenizer.model.
  friend struct tokenizer_detail::Reader;
  void sentencepiece_bpe(const std::string& word, std::vector<int64_t>& out)
      const;
  void encode_sentencepiece(
      const std::string& text,
      bool at_start,
      std::vector<int64_t>& out) const;
  std::string decode_sentencepiece(const std::vector<int64_t>& ids) const;
  // Whether no piece has a "▁" after another character (and "▁" is one).
  bool pieces_start_at_spaces() const;
  void save_tokenizer_json(const std::string& dir) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> tokens_; // by id; "" for an unused id
  std::vector<std::pair<int64_t, int64_t>> merges_; // by rank: the ids
  std::unordered_map<uint64_t, Merge> merge_of_; // (id a, id b) -> merge
  std::vector<AddedToken> added_;
  std::unordered_map<int64_t, size_t> added_of_id_;
  std::unordered_map<std::string, size_t> added_of_content_; // the first
  // Leftmost-longest matching of added_ (raw and normalized contents),
  // built by finish().
  std::shared_ptr<const tokenizer_detail::AddedTokenMatchers> matchers_;
  Kind kind_ = Kind::kByteLevel;
  Split split_ = Split::kGpt2;
  bool ignore_merges_ = false;
  int64_t unk_id_ = -1;
  std::string eos_token_, bos_token_, unk_token_;
  int64_t model_max_length_ = 1024;
  // The post-processor's tokens around one sequence.
  std::vector<int64_t> prefix_ids_, suffix_ids_;
  // SentencePiece: the legacy normalizer (Prepend "▁", Replace " " -> "▁"),
  // the Metaspace pre-tokenizer, the decoder, the BPE model's flags.
  bool nfc_ = false; // a Unicode NFC normalizer (Qwen 2)
  bool normalizer_prepend_ = false;
  bool normalizer_replace_ = false;
  bool metaspace_ = false;
  Prepend prepend_ = Prepend::kFirst;
  bool metaspace_split_ = false;
  bool decode_replace_ = true;
  bool decode_byte_fallback_ = true;
  int decode_strip_ = 0; // leading spaces the decoder removes
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool llama_pipeline_ = false;     // transformers' LlamaTokenizer's
  bool words_at_spaces_ = false;    // pieces_start_at_spaces(), at load
  std::string sentencepiece_model_; // tokenizer.model's bytes, if read
};

} // namespace models
} // namespace colossalai
