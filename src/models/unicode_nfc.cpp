// Unicode NFC as `tokenizers`' NFC normalizer computes it (the tokenizer
// of Qwen 2 and others normalizes its input so): canonical decomposition,
// canonical ordering, canonical composition (UAX #15), with the tables
// scripts/unicode_nfc_tables.py measured against `tokenizers`.

#include "tokenizer_internal.h"
#include "unicode_nfc_tables.h"

#include <algorithm>
#include <iterator>

namespace colossalai {
namespace models {
namespace tokenizer_detail {
namespace {

// Hangul syllables decompose and compose by arithmetic.
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161,
                   kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28,
                   kSCount = kLCount * kVCount * kTCount;

// A byte that is not UTF-8 travels as this bit and the byte: a starter
// that composes with nothing.
constexpr uint32_t kRawByte = 0x80000000u;

uint8_t combining_class(uint32_t cp) {
  if (cp < 0x300 || cp >= kRawByte) {
    return 0;
  }
  const auto* begin = std::begin(kCombiningClasses);
  const auto* end = std::end(kCombiningClasses);
  const auto* it = std::upper_bound(
      begin, end, cp, [](uint32_t c, const CombiningClassRange& r) {
        return c < r.first;
      });
  return it != begin && cp <= (it - 1)->last ? (it - 1)->ccc : 0;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / (kVCount * kTCount));
    out.push_back(kVBase + (s % (kVCount * kTCount)) / kTCount);
    if (s % kTCount != 0) {
      out.push_back(kTBase + s % kTCount);
    }
    return;
  }
  const auto* end = std::end(kDecompositions);
  const auto* it = std::lower_bound(
      std::begin(kDecompositions),
      end,
      cp,
      [](const Decomposition& d, uint32_t c) { return d.cp < c; });
  if (cp < 0xC0 || cp >= kRawByte || it == end || it->cp != cp) {
    out.push_back(cp);
    return;
  }
  decompose(it->first, out);
  if (it->second != 0) {
    decompose(it->second, out);
  }
}

// The primary composite of (a, b), 0 if none.
uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase &&
      b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 &&
      b > kTBase && b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const auto* end = std::end(kCompositions);
  const auto* it = std::lower_bound(
      std::begin(kCompositions),
      end,
      std::make_pair(a, b),
      [](const Composition& c, const std::pair<uint32_t, uint32_t>& key) {
        return std::make_pair(c.first, c.second) < key;
      });
  return it != end && it->first == a && it->second == b ? it->cp : 0;
}

} // namespace

std::string nfc(const std::string& text) {
  const auto u = decode_utf8(text);
  // Below U+0300 nothing decomposes, reorders or composes.
  if (std::all_of(
          u.cp.begin(), u.cp.end(), [](uint32_t c) { return c < 0x300; })) {
    return text;
  }
  std::vector<uint32_t> d;
  d.reserve(u.cp.size() + 8);
  for (size_t k = 0; k < u.cp.size(); ++k) {
    if (u.cp[k] == 0xFFFFFFFFu) {
      d.push_back(kRawByte | static_cast<unsigned char>(text[u.at[k]]));
    } else {
      decompose(u.cp[k], d);
    }
  }
  // Canonical ordering: each run of non-starters sorted by class, stably
  // (a merge sort: swapping neighbours is quadratic in a long run).
  for (size_t i = 0; i < d.size();) {
    if (combining_class(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t end = i + 1;
    while (end < d.size() && combining_class(d[end]) != 0) {
      ++end;
    }
    if (end - i > 1) {
      std::stable_sort(
          d.begin() + i, d.begin() + end, [](uint32_t a, uint32_t b) {
            return combining_class(a) < combining_class(b);
          });
    }
    i = end;
  }
  // Composition: each character with the last starter, unless a character
  // between them has a class as high (blocked).
  std::vector<uint32_t> r;
  r.reserve(d.size());
  size_t starter = 0;
  int last_class = -1; // none yet
  for (const uint32_t cp : d) {
    const int c = combining_class(cp);
    if (last_class >= 0 && (last_class < c || last_class == 0)) {
      const uint32_t composite = compose(r[starter], cp);
      if (composite != 0) {
        r[starter] = composite;
        continue;
      }
    }
    if (c == 0) {
      starter = r.size();
      last_class = 0;
    } else if (last_class >= 0) {
      last_class = c;
    }
    r.push_back(cp);
  }
  std::string out;
  out.reserve(text.size());
  for (const uint32_t cp : r) {
    if (cp >= kRawByte) {
      out += static_cast<char>(cp & 0xFF);
    } else {
      append_utf8(out, cp);
    }
  }
  return out;
}

} // namespace tokenizer_detail
} // namespace models
} // namespace colossalai
