// SentencePiece BPE as transformers' LlamaTokenizer; see
// include/colossalai/models/tokenizer.h.
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

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <unordered_map>

namespace colossalai {
namespace models {
namespace tokenizer_detail {
const char* const kSpace = "\xE2\x96\x81"; // U+2581 LOWER ONE EIGHTH BLOCK

namespace {

// One pass (replacing in place would move the tail at each match).
std::string replace_all(
    const std::string& s,
    const std::string& from,
    const std::string& to) {
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  size_t at = 0;
  for (size_t hit = s.find(from); hit != std::string::npos;
       hit = s.find(from, at)) {
    out.append(s, at, hit - at);
    out += to;
    at = hit + from.size();
  }
  out.append(s, at, std::string::npos);
  return out;
}

std::string byte_piece(unsigned char b) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "<0x%02X>", b);
  return buf;
}

// The byte of a "<0xXX>" piece (upper-case hex, as SentencePiece writes),
// -1 for any other token.
int byte_of_piece(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') {
    return -1;
  }
  int v = 0;
  for (int k = 3; k < 5; ++k) {
    const char c = t[k];
    const int d = c >= '0' && c <= '9' ? c - '0'
        : c >= 'A' && c <= 'F'         ? c - 'A' + 10
                                       : -1;
    if (d < 0) {
      return -1;
    }
    v = v * 16 + d;
  }
  return v;
}

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

// A Replace's pattern when it is a plain string ("\x01", no string, when
// not).
std::string string_pattern(const Field& replace) {
  return replace["pattern"]["String"].str("\x01");
}

// Metaspace's prepend scheme (older files: add_prefix_space).
std::string prepend_scheme(const Field& metaspace) {
  return metaspace.value().contains("prepend_scheme")
      ? metaspace["prepend_scheme"].str()
      : (metaspace["add_prefix_space"].flag(true) ? "always" : "never");
}

} // namespace

bool Reader::is_sentencepiece_json(const Field& root) {
  if (root["model"]["byte_fallback"].flag(false)) {
    return true;
  }
  for (const auto& p : components(root["pre_tokenizer"], "pretokenizers")) {
    if (p["type"].str() == "Metaspace") {
      return true;
    }
  }
  for (const auto& n : components(root["normalizer"], "normalizers")) {
    const auto type = n["type"].str();
    if (type == "Prepend" || (type == "Replace" && string_pattern(n) == " ")) {
      return true;
    }
  }
  return false;
}

void Reader::normalizer(Tokenizer& tok, const Field& root) {
  for (const auto& n : components(root["normalizer"], "normalizers")) {
    const auto type = n["type"].str();
    if (type == "NFC") {
      tok.nfc_ = true;
    } else if (type == "Prepend" && n["prepend"].str() == kSpace) {
      tok.normalizer_prepend_ = true;
    } else if (
        type == "Replace" && string_pattern(n) == " " &&
        n["content"].str() == kSpace) {
      tok.normalizer_replace_ = true;
    } else {
      fail(
          n.file(),
          "normalizer " + brief(n.value()) +
              " is not supported (NFC; for SentencePiece-style files "
              "Prepend(\"\xE2\x96\x81\") and Replace(\" \", "
              "\"\xE2\x96\x81\"))");
    }
  }
}

void Reader::sentencepiece_pipeline(Tokenizer& tok, const Field& root) {
  tok.kind_ = Tokenizer::Kind::kSentencePiece;
  const Field model = root["model"];
  tok.byte_fallback_ = model["byte_fallback"].flag(false);
  tok.fuse_unk_ = model["fuse_unk"].flag(false);

  const Field pre = root["pre_tokenizer"];
  if (!pre.is_null()) {
    if (pre["type"].str() != "Metaspace" ||
        pre["replacement"].str(kSpace) != kSpace) {
      fail(
          pre.file(),
          "pre_tokenizer " + brief(pre.value()) +
              " is not supported (SentencePiece-style files: none, or "
              "Metaspace with replacement \"\xE2\x96\x81\")");
    }
    tok.metaspace_ = true;
    const auto scheme = prepend_scheme(pre);
    if (scheme == "always") {
      tok.prepend_ = Tokenizer::Prepend::kAlways;
    } else if (scheme == "first") {
      tok.prepend_ = Tokenizer::Prepend::kFirst;
    } else if (scheme == "never") {
      tok.prepend_ = Tokenizer::Prepend::kNever;
    } else {
      pre["prepend_scheme"].bad("must be \"always\", \"first\" or \"never\"");
    }
    tok.metaspace_split_ = pre["split"].flag(true);
  }

  tok.decode_replace_ = tok.decode_byte_fallback_ = false;
  tok.decode_strip_ = 0;
  for (const auto& d : components(root["decoder"], "decoders")) {
    const auto type = d["type"].str();
    if (type == "Replace" && string_pattern(d) == kSpace &&
        d["content"].str() == " ") {
      tok.decode_replace_ = true;
    } else if (type == "ByteFallback") {
      tok.decode_byte_fallback_ = true;
    } else if (type == "Fuse") {
    } else if (
        type == "Strip" && d["content"].str() == " " &&
        d["stop"].integer(0, 0, 0) == 0) {
      tok.decode_strip_ = static_cast<int>(d["start"].integer(0, 0, 1 << 20));
    } else if (type == "Metaspace") {
      tok.decode_replace_ = true;
      tok.decode_strip_ = prepend_scheme(d) == "never" ? 0 : 1;
    } else {
      fail(
          d.file(),
          "decoder " + brief(d.value()) +
              " is not supported (SentencePiece-style files: Replace "
              "\"\xE2\x96\x81\" -> \" \", ByteFallback, Fuse, Strip, or "
              "Metaspace)");
    }
  }
}

void Reader::post_processor(Tokenizer& tok, const Field& p) {
  if (p.is_null()) {
    return;
  }
  const auto type = p["type"].str();
  // An id of the vocabulary (NOTE [Token ids]).
  const auto vocab_id = [&](const Field& id) {
    const int64_t n = static_cast<int64_t>(tok.tokens_.size());
    return id.integer(-1, 0, std::max<int64_t>(n - 1, 0));
  };
  auto special_id = [&](const Field& pair) {
    if (!pair.value().is_array() || pair.value().size() != 2) {
      pair.bad("must be [token, id]");
    }
    return vocab_id(pair[size_t{1}]);
  };
  if (type == "ByteLevel") {
    return; // offsets only
  } else if (type == "Sequence") {
    // Nesting is bounded by kMaxJsonDepth, so is this recursion.
    for (const auto& q : p["processors"].elements()) {
      post_processor(tok, q);
    }
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    tok.prefix_ids_ = {special_id(p["cls"])};
    tok.suffix_ids_ = {special_id(p["sep"])};
  } else if (type == "TemplateProcessing") {
    tok.prefix_ids_.clear();
    tok.suffix_ids_.clear();
    bool seen_sequence = false;
    const Field specials = p["special_tokens"];
    for (const auto& item : p["single"].elements()) {
      if (item.value().contains("Sequence")) {
        seen_sequence = true;
        continue;
      }
      const auto name = item["SpecialToken"]["id"].str();
      const Field ids = specials[name]["ids"];
      if (name.empty() || !ids.value().is_array()) {
        fail(
            p.file(),
            "malformed: post_processor.single names " + brief(json(name)) +
                ", which post_processor.special_tokens lacks");
      }
      auto& to = seen_sequence ? tok.suffix_ids_ : tok.prefix_ids_;
      for (const auto& id : ids.elements()) {
        to.push_back(vocab_id(id));
      }
    }
  } else {
    fail(
        p.file(),
        "post_processor " + brief(json(type)) +
            " is not supported (ByteLevel, TemplateProcessing, "
            "BertProcessing, RobertaProcessing or a Sequence of them)");
  }
}

void Reader::llama_pipeline(Tokenizer& tok, const Field& config) {
  tok.kind_ = Tokenizer::Kind::kSentencePiece;
  tok.llama_pipeline_ = true;
  tok.nfc_ = tok.normalizer_prepend_ = tok.normalizer_replace_ = false;
  tok.byte_fallback_ = true;
  tok.fuse_unk_ = true;
  tok.unk_id_ = -1;
  tok.metaspace_ = true;
  tok.metaspace_split_ = false;
  const bool add_prefix_space = config["add_prefix_space"].flag(true);
  tok.prepend_ = !add_prefix_space      ? Tokenizer::Prepend::kNever
      : config["legacy"].flag(false) ? Tokenizer::Prepend::kAlways
                                     : Tokenizer::Prepend::kFirst;
  tok.decode_replace_ = tok.decode_byte_fallback_ = true;
  tok.decode_strip_ = add_prefix_space ? 1 : 0;
}

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

using namespace tokenizer_detail;

void Tokenizer::sentencepiece_bpe(
    const std::string& word,
    std::vector<int64_t>& out) const {
  const auto u = decode_utf8(word);
  std::vector<int64_t> ids; // -1: unknown (becomes the unk token)
  ids.reserve(u.cp.size());
  for (size_t k = 0; k < u.cp.size(); ++k) {
    const auto ch = word.substr(u.at[k], u.at[k + 1] - u.at[k]);
    const auto it = vocab_.find(ch);
    if (it != vocab_.end()) {
      ids.push_back(it->second);
      continue;
    }
    const size_t before = ids.size();
    for (const char c : byte_fallback_ ? ch : std::string()) {
      const auto b = vocab_.find(byte_piece(static_cast<unsigned char>(c)));
      if (b == vocab_.end()) {
        ids.resize(before);
        break;
      }
      ids.push_back(b->second);
    }
    if (ids.size() == before && unk_id_ >= 0) {
      ids.push_back(-1);
    } // else dropped before merging, as `tokenizers` does
  }
  merge_symbols(ids);
  bool last_unknown = false;
  for (const int64_t id : ids) {
    if (id >= 0) {
      out.push_back(id);
      last_unknown = false;
    } else {
      if (!(fuse_unk_ && last_unknown)) {
        out.push_back(unk_id_);
      }
      last_unknown = true;
    }
  }
}

void Tokenizer::encode_sentencepiece(
    const std::string& text,
    bool at_start,
    std::vector<int64_t>& out) const {
  // `text` is normalized already (Tokenizer::normalize).
  std::string s = metaspace_ ? replace_all(text, " ", kSpace) : text;
  if (metaspace_ && s.rfind(kSpace, 0) != 0 &&
      (prepend_ == Prepend::kAlways ||
       (prepend_ == Prepend::kFirst && at_start))) {
    s = kSpace + s;
  }
  WordCache cache;
  const auto merge = [this](const std::string& w, std::vector<int64_t>& ids) {
    sentencepiece_bpe(w, ids);
  };
  auto word = [&](size_t begin, size_t end) {
    cache.append(s.substr(begin, end - begin), merge, out);
  };
  // Words: with split=true one at each "▁" (merged with the text after
  // it). Without, the text is one word for `tokenizers`; where no piece
  // has a "▁" after another character (words_at_spaces_), no merge
  // crosses the start of a run of "▁", so the words between them give the
  // same ids, faster.
  const bool at_each = metaspace_ && metaspace_split_;
  if (!at_each && !words_at_spaces_) {
    word(0, s.size());
    return;
  }
  const size_t n = std::strlen(kSpace);
  size_t begin = 0;
  for (size_t at = s.find(kSpace, n); at != std::string::npos;
       at = s.find(kSpace, at + n)) {
    const bool run_start = at < n || s.compare(at - n, n, kSpace) != 0;
    if (at > begin && (at_each || run_start)) {
      word(begin, at);
      begin = at;
    }
  }
  word(begin, s.size());
}

bool Tokenizer::pieces_start_at_spaces() const {
  if (!vocab_.count(kSpace)) {
    return false; // an unknown "▁" would fuse with an unknown before it
  }
  const size_t n = std::strlen(kSpace);
  for (const auto& kv : vocab_) {
    const auto& p = kv.first;
    size_t lead = 0;
    while (p.compare(lead, n, kSpace) == 0) {
      lead += n;
    }
    if (p.find(kSpace, lead) != std::string::npos) {
      return false;
    }
  }
  return true;
}

std::string Tokenizer::normalize(const std::string& text) const {
  std::string s = nfc_ ? nfc(text) : text;
  if (s.empty() || kind_ != Kind::kSentencePiece) {
    return s;
  }
  s = normalizer_prepend_ ? kSpace + s : s;
  return normalizer_replace_ ? replace_all(std::move(s), " ", kSpace) : s;
}

std::string Tokenizer::decode_sentencepiece(
    const std::vector<int64_t>& ids) const {
  std::string out;
  for (const int64_t id : ids) {
    const auto added = added_of_id_.find(id);
    // `tokenizers` gives a normalized added token its normalized form.
    const auto token =
        added != added_of_id_.end() && added_[added->second].normalized
        ? normalize(added_[added->second].content)
        : id_to_token(id);
    const int byte = decode_byte_fallback_ ? byte_of_piece(token) : -1;
    if (byte >= 0) {
      out += static_cast<char>(byte);
    } else {
      out += decode_replace_ ? replace_all(token, kSpace, " ") : token;
    }
  }
  size_t strip = 0;
  while (strip < static_cast<size_t>(std::max(decode_strip_, 0)) &&
         strip < out.size() && out[strip] == ' ') {
    ++strip;
  }
  return out.erase(0, strip);
}

} // namespace models
} // namespace colossalai
