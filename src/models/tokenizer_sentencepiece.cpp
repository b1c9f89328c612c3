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

// A tokenizer.json component as a list: a "Sequence" of `key`, one
// component, or none (null).
std::vector<json> components(const json& j, const char* key) {
  if (j.is_null()) {
    return {};
  }
  if (j.value("type", std::string()) == "Sequence" && j.contains(key) &&
      j[key].is_array()) {
    return std::vector<json>(j[key].begin(), j[key].end());
  }
  return {j};
}

std::string string_pattern(const json& replace) {
  return replace.contains("pattern") && replace["pattern"].is_object()
      ? replace["pattern"].value("String", std::string("\x01"))
      : std::string("\x01");
}

} // namespace

bool Reader::is_sentencepiece_json(const json& j) {
  if (j.contains("model") && j["model"].is_object() &&
      j["model"].value("byte_fallback", false)) {
    return true;
  }
  for (const auto& p :
       components(j.value("pre_tokenizer", json()), "pretokenizers")) {
    if (p.value("type", std::string()) == "Metaspace") {
      return true;
    }
  }
  for (const auto& n :
       components(j.value("normalizer", json()), "normalizers")) {
    const auto type = n.value("type", std::string());
    if (type == "Prepend" || (type == "Replace" && string_pattern(n) == " ")) {
      return true;
    }
  }
  return false;
}

void Reader::normalizer(Tokenizer& tok, const json& j, const fs::path& f) {
  for (const auto& n :
       components(j.value("normalizer", json()), "normalizers")) {
    const auto type = n.value("type", std::string());
    if (type == "NFC") {
      tok.nfc_ = true;
    } else if (
        type == "Prepend" && n.value("prepend", std::string()) == kSpace) {
      tok.normalizer_prepend_ = true;
    } else if (
        type == "Replace" && string_pattern(n) == " " &&
        n.value("content", std::string()) == kSpace) {
      tok.normalizer_replace_ = true;
    } else {
      fail(
          f,
          "normalizer " + n.dump() +
              " is not supported (NFC; for SentencePiece-style files "
              "Prepend(\"\xE2\x96\x81\") and Replace(\" \", "
              "\"\xE2\x96\x81\"))");
    }
  }
}

void Reader::sentencepiece_pipeline(
    Tokenizer& tok,
    const json& j,
    const fs::path& f) {
  tok.kind_ = Tokenizer::Kind::kSentencePiece;
  const auto& model = j["model"];
  tok.byte_fallback_ = model.value("byte_fallback", false);
  tok.fuse_unk_ = model.value("fuse_unk", false);

  const json pre = j.value("pre_tokenizer", json());
  if (!pre.is_null()) {
    if (pre.value("type", std::string()) != "Metaspace" ||
        pre.value("replacement", std::string(kSpace)) != kSpace) {
      fail(
          f,
          "pre_tokenizer " + pre.dump() +
              " is not supported (SentencePiece-style files: none, or "
              "Metaspace with replacement \"\xE2\x96\x81\")");
    }
    tok.metaspace_ = true;
    const auto scheme = pre.contains("prepend_scheme")
        ? pre.value("prepend_scheme", std::string())
        : (pre.value("add_prefix_space", true) ? "always" : "never");
    if (scheme == "always") {
      tok.prepend_ = Tokenizer::Prepend::kAlways;
    } else if (scheme == "first") {
      tok.prepend_ = Tokenizer::Prepend::kFirst;
    } else if (scheme == "never") {
      tok.prepend_ = Tokenizer::Prepend::kNever;
    } else {
      fail(f, "pre_tokenizer Metaspace prepend_scheme \"" + scheme + "\"");
    }
    tok.metaspace_split_ = pre.value("split", true);
  }

  const json dec = j.value("decoder", json());
  tok.decode_replace_ = tok.decode_byte_fallback_ = false;
  tok.decode_strip_ = 0;
  for (const auto& d : components(dec, "decoders")) {
    const auto type = d.value("type", std::string());
    if (type == "Replace" && string_pattern(d) == kSpace &&
        d.value("content", std::string()) == " ") {
      tok.decode_replace_ = true;
    } else if (type == "ByteFallback") {
      tok.decode_byte_fallback_ = true;
    } else if (type == "Fuse") {
    } else if (
        type == "Strip" && d.value("content", std::string()) == " " &&
        d.value("stop", 0) == 0) {
      tok.decode_strip_ = d.value("start", 0);
    } else if (type == "Metaspace") {
      tok.decode_replace_ = true;
      const auto scheme = d.contains("prepend_scheme")
          ? d.value("prepend_scheme", std::string())
          : (d.value("add_prefix_space", true) ? "always" : "never");
      tok.decode_strip_ = scheme == "never" ? 0 : 1;
    } else {
      fail(
          f,
          "decoder " + d.dump() +
              " is not supported (SentencePiece-style files: Replace "
              "\"\xE2\x96\x81\" -> \" \", ByteFallback, Fuse, Strip, or "
              "Metaspace)");
    }
  }
}

void Reader::post_processor(Tokenizer& tok, const json& p, const fs::path& f) {
  if (p.is_null()) {
    return;
  }
  const auto type = p.value("type", std::string());
  auto special_id = [&](const json& pair, const char* what) {
    if (!pair.is_array() || pair.size() != 2 || !pair[1].is_number_integer()) {
      fail(f, std::string("malformed: post_processor.") + what);
    }
    return pair[1].get<int64_t>();
  };
  if (type == "ByteLevel") {
    return; // offsets only
  } else if (type == "Sequence") {
    for (const auto& q : p.value("processors", json::array())) {
      post_processor(tok, q, f);
    }
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    tok.prefix_ids_ = {special_id(p.value("cls", json()), "cls")};
    tok.suffix_ids_ = {special_id(p.value("sep", json()), "sep")};
  } else if (type == "TemplateProcessing") {
    tok.prefix_ids_.clear();
    tok.suffix_ids_.clear();
    bool seen_sequence = false;
    for (const auto& item : p.value("single", json::array())) {
      if (item.contains("Sequence")) {
        seen_sequence = true;
        continue;
      }
      const auto name = item.contains("SpecialToken")
          ? item["SpecialToken"].value("id", std::string())
          : std::string();
      const auto specials = p.value("special_tokens", json::object());
      if (name.empty() || !specials.contains(name) ||
          !specials[name].contains("ids") ||
          !specials[name]["ids"].is_array()) {
        fail(
            f,
            "malformed: post_processor.single names \"" + name +
                "\", which special_tokens lacks");
      }
      auto& to = seen_sequence ? tok.suffix_ids_ : tok.prefix_ids_;
      for (const auto& id : specials[name]["ids"]) {
        to.push_back(id.get<int64_t>());
      }
    }
  } else {
    fail(
        f,
        "post_processor " + type +
            " is not supported (ByteLevel, TemplateProcessing, "
            "BertProcessing, RobertaProcessing or a Sequence of them)");
  }
}

void Reader::llama_pipeline(Tokenizer& tok, const json& config) {
  tok.kind_ = Tokenizer::Kind::kSentencePiece;
  tok.llama_pipeline_ = true;
  tok.nfc_ = tok.normalizer_prepend_ = tok.normalizer_replace_ = false;
  tok.byte_fallback_ = true;
  tok.fuse_unk_ = true;
  tok.unk_id_ = -1;
  tok.metaspace_ = true;
  tok.metaspace_split_ = false;
  const json prefix_space = config.value("add_prefix_space", json());
  const bool add_prefix_space =
      prefix_space.is_boolean() ? prefix_space.get<bool>() : true;
  const json legacy = config.value("legacy", json());
  tok.prepend_ = !add_prefix_space                ? Tokenizer::Prepend::kNever
      : legacy.is_boolean() && legacy.get<bool>() ? Tokenizer::Prepend::kAlways
                                                  : Tokenizer::Prepend::kFirst;
  tok.decode_replace_ = tok.decode_byte_fallback_ = true;
  tok.decode_strip_ = add_prefix_space ? 1 : 0;
}

Tokenizer Reader::sentencepiece_model(
    const fs::path& file,
    const json& config) {
  const auto data = read_text(file);
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
  for (size_t id = 0; id < m.pieces.size(); ++id) {
    const auto& piece = m.pieces[id].piece;
    if (piece.empty() || tok.vocab_.count(piece)) {
      fail(
          file,
          "malformed: piece " + std::to_string(id) + " (\"" + piece +
              "\") is empty or repeated");
    }
    tok.add_token(piece, static_cast<int64_t>(id));
  }
  // transformers' generate_merges: in piece order, each split of a piece
  // into two pieces, the shorter left part first (this loop's order is
  // already the rank).
  for (const auto& p : m.pieces) {
    const auto u = decode_utf8(p.piece);
    for (size_t k = 1; k < u.cp.size(); ++k) {
      const auto left = p.piece.substr(0, u.at[k]);
      const auto right = p.piece.substr(u.at[k]);
      if (tok.vocab_.count(left) && tok.vocab_.count(right)) {
        tok.add_merge(left, right);
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
      tok.added_of_id_[a.id] = tok.added_.size();
      tok.added_.push_back(a);
    }
  }
  llama_pipeline(tok, config);
  auto special = [&](const char* key, const char* fallback) {
    const auto s =
        config.contains(key) ? token_content(config[key]) : std::string();
    return s.empty() ? std::string(fallback) : s;
  };
  const auto bos = tok.token_to_id(special("bos_token", "<s>"));
  const auto eos = tok.token_to_id(special("eos_token", "</s>"));
  if (config.value("add_bos_token", false) && bos >= 0) {
    tok.prefix_ids_ = {bos};
  }
  if (config.value("add_eos_token", false) && eos >= 0) {
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
