// SentencePiece BPE as transformers' LlamaTokenizer: reading LLaMA's
// tokenizer.model (its protobuf) into the vocabulary, merges and added
// tokens; see include/colossalai/models/tokenizer.h.
//
// NOTE [SentencePiece]
// transformers (5.x) does not run libsentencepiece to tokenize: it converts
// a `tokenizer.model` into a `tokenizers` pipeline, and that pipeline is the
// reference we equal.
//  - Vocabulary: the model's pieces, id = position.
//  - Merges (generate_merges): for each piece in id order, every split
//    into two pieces of the vocabulary, shorter left part first; the rank is
//    that order. Merging the lowest rank first is SentencePiece's "highest
//    score first", since pieces are stored by descending score.
//  - BPE with byte fallback: a code point outside the vocabulary becomes
//    the "<0xXX>" pieces of its UTF-8 bytes; no unk token in the model.
//  - Pre-tokenizer Metaspace: " " -> "▁", and a "▁" prepended unless the
//    text starts with one: to the first piece of text only (prepend scheme
//    "first", LlamaTokenizer's default), to each piece between added tokens
//    (legacy=true: "always"), or never (add_prefix_space=false). The model's
//    own normalizer spec (add_dummy_prefix, a precompiled charsmap) is not
//    consulted, as in transformers.
//  - Control (<s>, </s>) and unknown pieces are special added tokens,
//    user-defined pieces non-special ones, matched before all this.
//  - Decoder: "▁" -> " ", "<0xXX>" runs -> bytes, one leading space
//    dropped.
//  - When tokenizer_config.json names LlamaTokenizer, transformers builds
//    this pipeline over a tokenizer.json's vocabulary, merges, added tokens
//    and post-processor too, and ignores the file's normalizer,
//    pre-tokenizer and decoder (LLaMA 2 ships a tokenizer.json with the
//    older Prepend / Replace normalizer and that class): so do we.
// Reading the protobuf ourselves instead of linking libsentencepiece keeps
// the tokenizer free of a second protobuf runtime: Debian's
// libsentencepiece.so.0 exports the protobuf-lite it carries, and
// LibTorch 1.13's libprotobuf.so.32 binds its static initialisers to those
// symbols and crashes before main.

#include "tokenizer_internal.h"
#include "tokenizer_literals.h"

#include <cstring>

namespace colossalai {
namespace models {
namespace tokenizer_detail {
const char* const kSpace = "\xE2\x96\x81"; // U+2581 LOWER ONE EIGHTH BLOCK

namespace {

// ---------------------------------------------------------------------------
// The protobuf wire format, as far as sentencepiece_model.proto needs it.

class Wire {
 public:
  Wire(const std::string& data, size_t begin, size_t end, const fs::path& file)
      : data_(data), at_(begin), end_(end), file_(file) {}

  bool more() const {
    return at_ < end_;
  }

  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      need(1);
      const auto c = static_cast<unsigned char>(data_[at_++]);
      v |= static_cast<uint64_t>(c & 0x7F) << shift;
      if (!(c & 0x80)) {
        return v;
      }
    }
    bad("a varint of more than 10 bytes");
  }

  // A length-delimited field: its byte range.
  std::pair<size_t, size_t> bytes() {
    const uint64_t n = varint();
    if (n > end_ - at_) {
      bad("a field of " + std::to_string(n) + " bytes runs past its end");
    }
    const std::pair<size_t, size_t> r{at_, at_ + n};
    at_ += n;
    return r;
  }

  std::string string() {
    const auto r = bytes();
    return data_.substr(r.first, r.second - r.first);
  }

  float fixed32() {
    need(4);
    uint32_t u = 0;
    for (int k = 3; k >= 0; --k) { // little-endian on the wire
      u = (u << 8) | static_cast<unsigned char>(data_[at_ + k]);
    }
    at_ += 4;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }

  void skip(int wire_type) {
    switch (wire_type) {
      case 0:
        varint();
        break;
      case 1:
        need(8);
        at_ += 8;
        break;
      case 2:
        bytes();
        break;
      case 5:
        need(4);
        at_ += 4;
        break;
      default:
        bad("wire type " + std::to_string(wire_type));
    }
  }

  [[noreturn]] void bad(const std::string& what) const {
    fail(
        file_,
        "is not a SentencePiece model (malformed protobuf: " + what +
            " at byte " + std::to_string(at_) +
            "; LLaMA 3's tiktoken tokenizer.model is not supported, its "
            "tokenizer.json is)");
  }

 private:
  void need(size_t n) const {
    if (end_ - at_ < n) {
      bad("truncated");
    }
  }

  const std::string& data_;
  size_t at_, end_;
  const fs::path& file_;
};

// sentencepiece_model.proto's ModelProto, the fields we read.
struct SentencePieceModel {
  enum Type { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4 };
  struct Piece {
    std::string piece;
    float score = 0;
    int type = kNormal;
  };
  std::vector<Piece> pieces; // field 1
  int model_type = 1; // trainer_spec (2).model_type (3): 1 UNIGRAM, 2 BPE
};

SentencePieceModel parse_model(const std::string& data, const fs::path& file) {
  SentencePieceModel m;
  Wire w(data, 0, data.size(), file);
  while (w.more()) {
    const uint64_t key = w.varint();
    const uint64_t field = key >> 3;
    const int wire_type = static_cast<int>(key & 7);
    if (field == 1 && wire_type == 2) {
      const auto [begin, end] = w.bytes();
      Wire p(data, begin, end, file);
      SentencePieceModel::Piece piece;
      while (p.more()) {
        const uint64_t k = p.varint();
        if ((k >> 3) == 1 && (k & 7) == 2) {
          piece.piece = p.string();
        } else if ((k >> 3) == 2 && (k & 7) == 5) {
          piece.score = p.fixed32();
        } else if ((k >> 3) == 3 && (k & 7) == 0) {
          piece.type = static_cast<int>(p.varint());
        } else {
          p.skip(static_cast<int>(k & 7));
        }
      }
      m.pieces.push_back(std::move(piece));
    } else if (field == 2 && wire_type == 2) {
      const auto [begin, end] = w.bytes();
      Wire t(data, begin, end, file);
      while (t.more()) {
        const uint64_t k = t.varint();
        if ((k >> 3) == 3 && (k & 7) == 0) {
          m.model_type = static_cast<int>(t.varint());
        } else {
          t.skip(static_cast<int>(k & 7));
        }
      }
    } else {
      w.skip(wire_type);
    }
  }
  if (m.pieces.empty()) {
    fail(file, "is not a SentencePiece model (no pieces)");
  }
  return m;
}

const char* model_type_name(int t) {
  switch (t) {
    case 1:
      return "UNIGRAM";
    case 2:
      return "BPE";
    case 3:
      return "WORD";
    case 4:
      return "CHAR";
    default:
      return "unknown";
  }
}

} // namespace

Tokenizer Reader::sentencepiece_model(
    const fs::path& file,
    const Field& config) {
  const auto data = read_text(file, kMaxTokenizerFileBytes);
  const auto m = parse_model(data, file);
  if (m.model_type != 2) {
    fail(
        file,
        std::string("SentencePiece model type ") +
            model_type_name(m.model_type) +
            " is not supported (BPE, as LLaMA / Mistral; not a Unigram "
            "model such as T5's)");
  }
  Tokenizer tok;
  tok.kind_ = Tokenizer::Kind::kSentencePiece;
  tok.sentencepiece_model_ = data;
  // The pieces, and tries of them forward and backward for the merges.
  ByteTrie forward, backward;
  for (size_t id = 0; id < m.pieces.size(); ++id) {
    const auto& piece = m.pieces[id].piece;
    if (piece.empty() || tok.vocab_.count(piece)) {
      fail(
          file,
          "malformed: piece " + std::to_string(id) + " (" +
              brief(json(piece)) + ") is empty or repeated");
    }
    tok.add_token(piece, static_cast<int64_t>(id));
    forward.add(piece.data(), piece.data() + piece.size(), id);
    const std::string r(piece.rbegin(), piece.rend());
    backward.add(r.data(), r.data() + r.size(), id);
  }
  // transformers' generate_merges: in piece order, each split of a piece
  // into two pieces, the shorter left part first (this loop's order is
  // already the rank). The pieces that begin and end a piece come from one
  // walk down each trie: linear in the piece, where looking each split's
  // halves up is quadratic.
  std::vector<int64_t> prefix, suffix; // the piece of each byte length
  for (size_t id = 0; id < m.pieces.size(); ++id) {
    const auto& p = m.pieces[id].piece;
    const size_t n = p.size();
    prefix.assign(n + 1, -1);
    suffix.assign(n + 1, -1);
    for (int32_t f = ByteTrie::kRoot, b = ByteTrie::kRoot, k = 0;
         k < static_cast<int32_t>(n) && (f >= 0 || b >= 0);
         ++k) {
      f = f >= 0 ? forward.child(f, static_cast<unsigned char>(p[k])) : -1;
      b = b >= 0 ? backward.child(b, static_cast<unsigned char>(p[n - 1 - k]))
                 : -1;
      prefix[k + 1] = f >= 0 ? forward.value(f) : -1;
      suffix[k + 1] = b >= 0 ? backward.value(b) : -1;
    }
    const auto u = decode_utf8(p);
    for (size_t k = 1; k < u.cp.size(); ++k) {
      const int64_t left = prefix[u.at[k]], right = suffix[n - u.at[k]];
      if (left >= 0 && right >= 0) {
        tok.add_merge(left, right, static_cast<int64_t>(id));
      }
    }
  }
  for (size_t id = 0; id < m.pieces.size(); ++id) {
    const int type = m.pieces[id].type;
    if (type == SentencePieceModel::kUnknown ||
        type == SentencePieceModel::kControl ||
        type == SentencePieceModel::kUserDefined) {
      Tokenizer::AddedToken a;
      a.content = m.pieces[id].piece;
      a.id = static_cast<int64_t>(id);
      a.special = type != SentencePieceModel::kUserDefined;
      a.normalized = false;
      tok.push_added(std::move(a));
    }
  }
  llama_pipeline(tok, config);
  auto special = [&](const char* key, const char* fallback) {
    const auto s = token_content(config[key]);
    return s.empty() ? std::string(fallback) : s;
  };
  const auto bos = tok.token_to_id(special("bos_token", "<s>"));
  const auto eos = tok.token_to_id(special("eos_token", "</s>"));
  if (config["add_bos_token"].flag(false) && bos >= 0) {
    tok.prefix_ids_ = {bos};
  }
  if (config["add_eos_token"].flag(false) && eos >= 0) {
    tok.suffix_ids_ = {eos};
  }
  return tok;
}

} // namespace tokenizer_detail
} // namespace models
} // namespace colossalai
