// Byte-level pre-tokenization: GPT-2's byte <-> character map and the
// pre-tokenizers' regexes (GPT-2, LLaMA 3 / Qwen 2, Bloom) written by hand,
// linear in the text.

#include "tokenizer_internal.h"

namespace colossalai {
namespace models {
namespace tokenizer_detail {

// ---------------------------------------------------------------------------
// GPT-2's bytes_to_unicode: the printable bytes ('!'..'~', '¡'..'¬',
// '®'..'ÿ') stand for themselves, the others for 256, 257, ... in byte
// order.

ByteMap::ByteMap() {
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) ||
        (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : next++;
    append_utf8(to_char[b], cp);
    to_byte[cp] = static_cast<unsigned char>(b);
  }
}

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// ---------------------------------------------------------------------------
// Pre-tokenization: the byte ranges [first, second) of the words.

// Each code point's class (a byte that is not UTF-8: other).
std::vector<Cls> classes(const CodePoints& u) {
  std::vector<Cls> cls(u.cp.size());
  for (size_t i = 0; i < cls.size(); ++i) {
    cls[i] = u.cp[i] == 0xFFFFFFFFu ? Cls::kOther : classify(u.cp[i]);
  }
  return cls;
}

// The end of 's|'t|'re|'ve|'m|'ll|'d at code point i, or i. `fold` maps a
// code point to the letter it matches (itself; ASCII lower case for (?i)).
template <class Fold>
size_t contraction_end(const CodePoints& u, size_t i, const Fold& fold) {
  const size_t n = u.cp.size();
  if (u.cp[i] != '\'' || i + 1 >= n) {
    return i;
  }
  const uint32_t c1 = fold(u.cp[i + 1]);
  const uint32_t c2 = i + 2 < n ? fold(u.cp[i + 2]) : 0;
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
    return i + 2;
  }
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') ||
      (c1 == 'l' && c2 == 'l')) {
    return i + 3;
  }
  return i;
}

// The end of \s+(?!\S)|\s+ at the whitespace starting at i: a run before a
// non-space leaves its last character to the next word; a single space
// before one is a word.
size_t whitespace_end(const std::vector<Cls>& cls, size_t i) {
  const size_t n = cls.size();
  size_t k = i;
  while (k < n && cls[k] == Cls::kSpace) {
    ++k;
  }
  return (k == n || k - i == 1) ? k : k - 1;
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// by hand, leftmost alternative first as the backtracking regex does.
Spans split_gpt2(const std::string& text) {
  const auto u = decode_utf8(text);
  const size_t n = u.cp.size();
  const auto cls = classes(u);
  Spans out;
  size_t i = 0;
  while (i < n) {
    size_t end = contraction_end(u, i, [](uint32_t c) { return c; });
    if (end == i) {
      // ` ?X+` for X = letters, numbers, other: the class after an optional
      // leading space picks the alternative.
      const size_t start =
          (u.cp[i] == ' ' && i + 1 < n && cls[i + 1] != Cls::kSpace) ? i + 1
                                                                     : i;
      const Cls c = cls[start];
      if (c != Cls::kSpace) {
        end = start + 1;
        while (end < n && cls[end] == c) {
          ++end;
        }
      } else {
        end = whitespace_end(cls, i);
      }
    }
    out.emplace_back(u.at[i], u.at[end]);
    i = end;
  }
  return out;
}

// LLaMA 3's Split regex (max_digits 3; Qwen 2's with 1), by hand,
// leftmost alternative first as the backtracking regex does:
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
Spans split_llama3(const std::string& text, size_t max_digits) {
  const auto u = decode_utf8(text);
  const size_t n = u.cp.size();
  const auto cls = classes(u);
  auto newline = [&](size_t k) { return u.cp[k] == '\r' || u.cp[k] == '\n'; };
  // (?i): ASCII letters in either case, and U+017F (long s), which
  // Unicode case folding makes an "s".
  const auto fold = [](uint32_t c) -> uint32_t {
    return c == 0x17F ? 's' : (c < 0x80 ? (c | 0x20) : c);
  };
  Spans out;
  size_t i = 0;
  while (i < n) {
    size_t end = contraction_end(u, i, fold);
    if (end == i) {
      // [^\r\n\p{L}\p{N}]?\p{L}+: one character of another kind (a
      // space, a mark, punctuation) may lead the letters.
      const size_t start = cls[i] != Cls::kLetter && cls[i] != Cls::kNumber &&
              !newline(i) && i + 1 < n && cls[i + 1] == Cls::kLetter
          ? i + 1
          : i;
      if (cls[start] == Cls::kLetter) {
        end = start;
        while (end < n && cls[end] == Cls::kLetter) {
          ++end;
        }
      }
    }
    if (end == i && cls[i] == Cls::kNumber) {
      while (end < n && end - i < max_digits && cls[end] == Cls::kNumber) {
        ++end;
      }
    }
    if (end == i) {
      //  ?[^\s\p{L}\p{N}]+[\r\n]*
      const size_t start =
          u.cp[i] == ' ' && i + 1 < n && cls[i + 1] == Cls::kOther ? i + 1 : i;
      if (cls[start] == Cls::kOther) {
        end = start;
        while (end < n && cls[end] == Cls::kOther) {
          ++end;
        }
        while (end < n && newline(end)) {
          ++end;
        }
      }
    }
    if (end == i) {
      // Whitespace: \s*[\r\n]+ ends after the run's last line break;
      // without one, as GPT-2's.
      size_t last_break = n;
      for (size_t k = i; k < n && cls[k] == Cls::kSpace; ++k) {
        if (newline(k)) {
          last_break = k;
        }
      }
      end = last_break < n ? last_break + 1 : whitespace_end(cls, i);
    }
    out.emplace_back(u.at[i], u.at[end]);
    i = end;
  }
  return out;
}

// Bloom's Split pre-tokenizer, regex ` ?[^(\s|[.,!?…。，、।۔،])]+` with
// behaviour "isolated": the matches and the gaps between them. The class
// is Oniguruma's reading: not whitespace nor any of ( | . , ! ? … 。 ， 、 । ۔
// ، ) (the inner brackets nest a class, they are not members).
Spans split_bloom(const std::string& text) {
  const auto u = decode_utf8(text);
  const size_t n = u.cp.size();
  auto excluded = [&](size_t k) {
    const uint32_t c = u.cp[k];
    if (c == 0xFFFFFFFFu) {
      return false;
    }
    switch (c) {
      case '(':
      case ')':
      case '|':
      case '.':
      case ',':
      case '!':
      case '?':
      case 0x2026: // …
      case 0x3002: // 。
      case 0xFF0C: // ，
      case 0x3001: // 、
      case 0x0964: // ।
      case 0x06D4: // ۔
      case 0x060C: // ،
        return true;
      default:
        return classify(c) == Cls::kSpace;
    }
  };
  Spans out;
  size_t gap = 0; // start of the current gap
  size_t i = 0;
  while (i < n) {
    size_t start = n;
    if (!excluded(i)) {
      start = i;
    } else if (u.cp[i] == ' ' && i + 1 < n && !excluded(i + 1)) {
      start = i + 1;
    }
    if (start == n) {
      ++i;
      continue;
    }
    if (gap < i) {
      out.emplace_back(u.at[gap], u.at[i]);
    }
    size_t end = start + 1;
    while (end < n && !excluded(end)) {
      ++end;
    }
    out.emplace_back(u.at[i], u.at[end]);
    i = gap = end;
  }
  if (gap < n) {
    out.emplace_back(u.at[gap], u.at[n]);
  }
  return out;
}

// The regex `tokenizers`' ByteLevel pre-tokenizer uses (also a Split
// pattern in some files).
const char* const kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|"
    "\\s+(?!\\S)|\\s+";
const char* const kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";
const char* const kQwen2Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";
const char* const kBloomPattern =
    " ?[^(\\s|[.,!?\xE2\x80\xA6\xE3\x80\x82\xEF\xBC\x8C\xE3\x80\x81"
    "\xE0\xA5\xA4\xDB\x94\xD8\x8C])]+";

} // namespace tokenizer_detail
} // namespace models
} // namespace colossalai
