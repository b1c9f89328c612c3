// SentencePiece BPE's encoding and decoding: Metaspace, byte fallback,
// the normalizer's Prepend / Replace, the decoder (NOTE [SentencePiece] in
// src/models/tokenizer_sentencepiece.cpp).

#include "tokenizer_internal.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace colossalai {
namespace models {
namespace tokenizer_detail {

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

} // namespace
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
