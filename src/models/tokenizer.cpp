// models::Tokenizer: reading a directory, byte-level BPE, encode / decode;
// see include/colossalai/models/tokenizer.h.

#include <colossalai/models/tokenizer.h>

#include "tokenizer_internal.h"
#include "tokenizer_literals.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <map>
#include <queue>
#include <stdexcept>
#include <tuple>

namespace colossalai {
namespace models {
namespace tokenizer_detail {

const char* const kEndOfText = "<|endoftext|>";

uint64_t pair_key(int64_t a, int64_t b) {
  return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b);
}

} // namespace tokenizer_detail

using namespace tokenizer_detail;

// ---------------------------------------------------------------------------

void Tokenizer::add_token(const std::string& token, int64_t id) {
  vocab_[token] = id;
  if (static_cast<int64_t>(tokens_.size()) <= id) {
    tokens_.resize(id + 1);
  }
  tokens_[id] = token;
}

void Tokenizer::add_merge(const std::string& a, const std::string& b) {
  add_merge(vocab_.at(a), vocab_.at(b), vocab_.at(a + b));
}

void Tokenizer::add_merge(int64_t a, int64_t b, int64_t merged) {
  merge_of_[pair_key(a, b)] =
      Merge{static_cast<int64_t>(merges_.size()), merged};
  merges_.emplace_back(a, b);
}

void Tokenizer::push_added(AddedToken token) {
  added_of_id_[token.id] = added_.size();
  added_of_content_.emplace(token.content, added_.size());
  added_.push_back(std::move(token));
}

void Tokenizer::add_special(const std::string& content, bool special) {
  if (content.empty() || added_of_content_.count(content)) {
    return;
  }
  const auto it = vocab_.find(content);
  if (it == vocab_.end()) {
    return; // transformers would append it as a new id: not supported
  }
  AddedToken t;
  t.content = content;
  t.id = it->second;
  t.special = special;
  push_added(std::move(t));
}

Tokenizer Tokenizer::from_pretrained(const std::string& dir) {
  const fs::path root(dir);
  if (!fs::is_directory(root)) {
    fail(
        root,
        "no such directory (a tokenizer's tokenizer.json, "
        "vocab.json + merges.txt or tokenizer.model)");
  }
  // tokenizer_config.json: the special tokens and their added-token
  // entries, model_max_length; for tokenizer.model, LlamaTokenizer's
  // options. Without it, the defaults of GPT2Tokenizer / LlamaTokenizer.
  const auto config_file = root / "tokenizer_config.json";
  json config_json = json::object();
  if (fs::exists(config_file)) {
    config_json = read_json(config_file, kMaxConfigFileBytes);
    if (!config_json.is_object()) {
      fail(config_file, "malformed: not an object");
    }
  }
  const Field config(config_json, "", config_file);
  Tokenizer tok;
  const auto tokenizer_json = root / "tokenizer.json";
  const auto vocab_json = root / "vocab.json";
  const auto merges_txt = root / "merges.txt";
  const auto tokenizer_model = root / "tokenizer.model";
  // exists() follows links and is true for a FIFO too: the readers refuse
  // what is not a regular file without opening it for long.
  if (fs::exists(tokenizer_json)) {
    Reader::tokenizer_json(tok, tokenizer_json);
  } else if (fs::exists(vocab_json) || fs::exists(merges_txt)) {
    Reader::vocab_and_merges(tok, vocab_json, merges_txt);
  } else if (fs::exists(tokenizer_model)) {
    tok = Reader::sentencepiece_model(tokenizer_model, config);
  } else {
    fail(
        root,
        "has no tokenizer.json, vocab.json + merges.txt nor "
        "tokenizer.model");
  }
  // transformers' LlamaTokenizer keeps a tokenizer.json's vocabulary,
  // merges, added tokens and post-processor but builds the rest itself.
  const auto tokenizer_class = config["tokenizer_class"].str();
  Reader::config(
      tok,
      config,
      fs::exists(tokenizer_json) &&
          (tokenizer_class == "LlamaTokenizer" ||
           tokenizer_class == "LlamaTokenizerFast"));
  tok.finish();
  return tok;
}

Tokenizer Tokenizer::train(const std::string& text, int64_t vocab_size) {
  if (vocab_size < 257) {
    throw std::invalid_argument(
        "Tokenizer::train: vocab_size " + std::to_string(vocab_size) +
        " is below 257 (256 bytes and <|endoftext|>)");
  }
  Tokenizer tok;
  const auto& bm = byte_map();
  for (int b = 0; b < 256; ++b) {
    tok.add_token(bm.to_char[b], b);
  }
  // The distinct words, as symbol ids, and their counts.
  std::map<std::string, int64_t> counts;
  for (const auto& s : split_gpt2(text)) {
    ++counts[text.substr(s.first, s.second - s.first)];
  }
  std::vector<std::vector<int64_t>> words;
  std::vector<int64_t> freq;
  for (const auto& kv : counts) {
    std::vector<int64_t> w;
    for (char c : kv.first) {
      w.push_back(static_cast<unsigned char>(c));
    }
    words.push_back(std::move(w));
    freq.push_back(kv.second);
  }
  while (static_cast<int64_t>(tok.tokens_.size()) < vocab_size - 1) {
    std::map<std::pair<int64_t, int64_t>, int64_t> pairs;
    for (size_t w = 0; w < words.size(); ++w) {
      for (size_t k = 0; k + 1 < words[w].size(); ++k) {
        pairs[{words[w][k], words[w][k + 1]}] += freq[w];
      }
    }
    if (pairs.empty()) {
      break;
    }
    auto best = pairs.begin();
    for (auto it = std::next(pairs.begin()); it != pairs.end(); ++it) {
      if (it->second > best->second ||
          (it->second == best->second &&
           std::tie(
               tok.tokens_[it->first.first], tok.tokens_[it->first.second]) <
               std::tie(
                   tok.tokens_[best->first.first],
                   tok.tokens_[best->first.second]))) {
        best = it;
      }
    }
    const auto [a, b] = best->first;
    const std::string merged = tok.tokens_[a] + tok.tokens_[b];
    auto found = tok.vocab_.find(merged);
    const int64_t id = found != tok.vocab_.end()
        ? found->second
        : static_cast<int64_t>(tok.tokens_.size());
    if (found == tok.vocab_.end()) {
      tok.add_token(merged, id);
    }
    tok.add_merge(tok.tokens_[a], tok.tokens_[b]);
    for (auto& w : words) {
      size_t out = 0;
      for (size_t k = 0; k < w.size(); ++k) {
        if (k + 1 < w.size() && w[k] == a && w[k + 1] == b) {
          w[out++] = id;
          ++k;
        } else {
          w[out++] = w[k];
        }
      }
      w.resize(out);
    }
  }
  const int64_t eos = static_cast<int64_t>(tok.tokens_.size());
  tok.add_token(kEndOfText, eos);
  tok.eos_token_ = tok.bos_token_ = tok.unk_token_ = kEndOfText;
  tok.add_special(kEndOfText);
  tok.finish();
  return tok;
}

// One word (its raw bytes) through byte-level BPE.
void Tokenizer::bpe(const std::string& word, std::vector<int64_t>& out) const {
  const auto& bm = byte_map();
  if (ignore_merges_) {
    std::string whole;
    for (const char c : word) {
      whole += bm.to_char[static_cast<unsigned char>(c)];
    }
    const auto it = vocab_.find(whole);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<int64_t> ids;
  ids.reserve(word.size());
  for (const char c : word) {
    const auto it = vocab_.find(bm.to_char[static_cast<unsigned char>(c)]);
    ids.push_back(it != vocab_.end() ? it->second : -1);
  }
  merge_symbols(ids);
  for (const int64_t id : ids) {
    if (id >= 0) {
      out.push_back(id);
    } else if (unk_id_ >= 0) {
      out.push_back(unk_id_); // `tokenizers` drops it without an unk token
    }
  }
}

// The lowest-ranked adjacent pair is merged (the leftmost of equal rank),
// until no pair has a rank. Symbols are ids (-1: not in the vocabulary,
// merges with nothing). The symbols are a linked list and the candidate
// pairs a heap by (rank, position), as `tokenizers` merges a word:
// O(n log n) where rescanning the word after each merge is quadratic (a
// SentencePiece text is one word).
void Tokenizer::merge_symbols(std::vector<int64_t>& ids) const {
  const size_t n = ids.size();
  if (n < 2) {
    return;
  }
  constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<size_t> prev(n), next(n);
  std::vector<uint32_t> version(n, 0);
  for (size_t k = 0; k < n; ++k) {
    prev[k] = k == 0 ? kNone : k - 1;
    next[k] = k + 1 == n ? kNone : k + 1;
  }
  struct Candidate {
    int64_t rank;
    size_t left, right;
    uint32_t left_version, right_version;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto offer = [&](size_t left, size_t right) {
    if (left == kNone || right == kNone || ids[left] < 0 || ids[right] < 0) {
      return;
    }
    const auto it = merge_of_.find(pair_key(ids[left], ids[right]));
    if (it != merge_of_.end()) {
      heap.push({it->second.rank, left, right, version[left], version[right]});
    }
  };
  for (size_t k = 0; k + 1 < n; ++k) {
    offer(k, k + 1);
  }
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    // Stale: a side merged since (or merged away).
    if (next[c.left] != c.right || version[c.left] != c.left_version ||
        version[c.right] != c.right_version) {
      continue;
    }
    ids[c.left] = merge_of_.at(pair_key(ids[c.left], ids[c.right])).id;
    ++version[c.left];
    ++version[c.right]; // merged away
    next[c.left] = next[c.right];
    if (next[c.right] != kNone) {
      prev[next[c.right]] = c.left;
    }
    next[c.right] = kNone;
    offer(prev[c.left], c.left);
    offer(c.left, next[c.left]);
  }
  size_t out = 0;
  for (size_t k = 0; k != kNone; k = next[k]) {
    ids[out++] = ids[k];
  }
  ids.resize(out);
}

void Tokenizer::encode_plain(
    const std::string& text,
    bool at_start,
    std::vector<int64_t>& out) const {
  if (text.empty()) {
    return;
  }
  if (kind_ == Kind::kSentencePiece) {
    encode_sentencepiece(text, at_start, out);
    return;
  }
  if (split_ == Split::kNone) {
    bpe(text, out);
    return;
  }
  const auto spans = split_ == Split::kGpt2 ? split_gpt2(text)
      : split_ == Split::kLlama3            ? split_llama3(text, 3)
      : split_ == Split::kQwen2             ? split_llama3(text, 1)
                                            : split_bloom(text);
  WordCache cache;
  const auto merge = [this](const std::string& w, std::vector<int64_t>& ids) {
    bpe(w, ids);
  };
  for (const auto& sp : spans) {
    auto word = text.substr(sp.first, sp.second - sp.first);
    if (ignore_merges_) {
      bpe(word, out); // a vocabulary lookup first: cheaper than the cache
    } else {
      cache.append(std::move(word), merge, out);
    }
  }
}

namespace tokenizer_detail {

// The added tokens' contents, raw and normalized, for leftmost-longest
// matching (values: indices in Tokenizer::added_).
struct AddedTokenMatchers {
  LiteralMatcher raw, normalized;
};

} // namespace tokenizer_detail

void Tokenizer::finish() {
  auto m = std::make_shared<AddedTokenMatchers>();
  for (size_t k = 0; k < added_.size(); ++k) {
    const auto& t = added_[k];
    if (t.normalized) {
      m->normalized.add(normalize(t.content), static_cast<int64_t>(k));
    } else {
      m->raw.add(t.content, static_cast<int64_t>(k));
    }
  }
  m->raw.build();
  m->normalized.build();
  matchers_ = std::move(m);
  words_at_spaces_ = kind_ == Kind::kSentencePiece && pieces_start_at_spaces();
}

// The pieces of `text`: plain text (id -1) or an added token of
// `normalized` kind, matched as its (normalized) content; the longest match
// at the leftmost position wins, as `tokenizers`. Linear in the text: the
// matches come from one automaton pass, and what lstrip / rstrip take is
// read once (it is never plain text afterwards).
std::vector<Tokenizer::Span> Tokenizer::split_added(
    const std::string& text,
    bool normalized) const {
  if (matchers_ == nullptr) {
    throw std::logic_error("Tokenizer: used before finish()");
  }
  const auto& matcher = normalized ? matchers_->normalized : matchers_->raw;
  std::vector<Span> out;
  size_t at = 0; // start of the plain text not yet emitted
  for (const auto& m : matcher.starts(text)) {
    if (m.begin < at) {
      continue; // inside the previous token or what it stripped
    }
    const auto& token = added_[static_cast<size_t>(m.value)];
    size_t begin = m.begin, end = m.begin + m.length;
    // lstrip / rstrip: the token takes the whitespace beside it.
    if (token.lstrip) {
      const auto left = decode_utf8(text.substr(at, begin - at));
      size_t k = left.cp.size();
      while (k > 0 && left.cp[k - 1] != 0xFFFFFFFFu &&
             is_white(left.cp[k - 1])) {
        --k;
      }
      begin = at + left.at[k];
    }
    if (token.rstrip) {
      size_t len = 0;
      for (uint32_t cp = 0; end < text.size(); end += len) {
        cp = code_point_at(text, end, len);
        if (cp == 0xFFFFFFFFu || !is_white(cp)) {
          break;
        }
      }
    }
    if (at < begin) {
      out.push_back({at, begin, -1});
    }
    out.push_back({begin, end, token.id});
    at = end;
  }
  if (at < text.size()) {
    out.push_back({at, text.size(), -1});
  }
  return out;
}

std::vector<int64_t> Tokenizer::encode(const std::string& text) const {
  // As `tokenizers`: the added tokens that skip normalization are split off
  // the raw text; each plain piece is normalized (SentencePiece's legacy
  // Prepend / Replace; nothing for byte-level) and the other added tokens,
  // normalized the same way, are split off that; what is left is
  // pre-tokenized and merged.
  std::vector<int64_t> ids;
  for (const auto& p : split_added(text, false)) {
    if (p.id >= 0) {
      ids.push_back(p.id);
      continue;
    }
    const auto piece = normalize(text.substr(p.begin, p.end - p.begin));
    for (const auto& q : split_added(piece, true)) {
      if (q.id >= 0) {
        ids.push_back(q.id);
      } else {
        encode_plain(
            piece.substr(q.begin, q.end - q.begin),
            p.begin == 0 && q.begin == 0,
            ids);
      }
    }
  }
  return ids;
}

std::vector<int64_t> Tokenizer::encode(
    const std::string& text,
    bool add_special_tokens) const {
  auto ids = encode(text);
  if (add_special_tokens) {
    ids.insert(ids.begin(), prefix_ids_.begin(), prefix_ids_.end());
    ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  if (kind_ == Kind::kSentencePiece) {
    return decode_sentencepiece(ids);
  }
  const auto& bm = byte_map();
  std::string out;
  for (const int64_t id : ids) {
    const auto& token = id_to_token(id);
    if (added_of_id_.count(id)) {
      out += token;
      continue;
    }
    const auto u = decode_utf8(token);
    for (size_t k = 0; k < u.cp.size(); ++k) {
      const auto it = bm.to_byte.find(u.cp[k]);
      if (it != bm.to_byte.end()) {
        out += static_cast<char>(it->second);
      } else {
        // Not a byte-level character: itself, as `tokenizers`' decoder.
        out.append(token, u.at[k], u.at[k + 1] - u.at[k]);
      }
    }
  }
  return out;
}

int64_t Tokenizer::vocab_size() const {
  return static_cast<int64_t>(tokens_.size());
}

int64_t Tokenizer::eos_token_id() const {
  int64_t id = eos_token_.empty() ? -1 : token_to_id(eos_token_);
  return id >= 0 ? id : token_to_id(kEndOfText);
}

int64_t Tokenizer::bos_token_id() const {
  return bos_token_.empty() ? -1 : token_to_id(bos_token_);
}

int64_t Tokenizer::token_to_id(const std::string& token) const {
  const auto it = vocab_.find(token);
  if (it != vocab_.end()) {
    return it->second;
  }
  for (const auto& t : added_) {
    if (t.content == token) {
      return t.id;
    }
  }
  return -1;
}

const std::string& Tokenizer::id_to_token(int64_t id) const {
  if (id < 0 || id >= static_cast<int64_t>(tokens_.size()) ||
      tokens_[id].empty()) {
    throw std::out_of_range(
        "Tokenizer: id " + std::to_string(id) + " is not in the vocabulary (" +
        std::to_string(tokens_.size()) + " ids)");
  }
  return tokens_[id];
}

} // namespace models
} // namespace colossalai
