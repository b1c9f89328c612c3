// Byte tries and leftmost-longest literal matching; see
// src/models/tokenizer_literals.h.

#include "tokenizer_literals.h"

#include <algorithm>

namespace colossalai {
namespace models {
namespace tokenizer_detail {

ByteTrie::ByteTrie() : nodes_(1) {
  std::fill(std::begin(root_), std::end(root_), -1);
}

void ByteTrie::add(const char* begin, const char* end, int64_t value) {
  int32_t node = kRoot;
  for (const char* p = begin; p != end; ++p) {
    const auto c = static_cast<unsigned char>(*p);
    int32_t next = child(node, c);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      Node n;
      n.depth = nodes_[node].depth + 1;
      n.byte = c;
      nodes_.push_back(std::move(n));
      nodes_[node].children.push_back(next);
      if (node == kRoot) {
        root_[c] = next;
      } else {
        edges_.emplace(edge(node, c), next);
      }
    }
    node = next;
  }
  if (nodes_[node].value < 0) {
    nodes_[node].value = value;
  }
}

void LiteralMatcher::add(const std::string& pattern, int64_t value) {
  if (pattern.empty()) {
    return;
  }
  const std::string r(pattern.rbegin(), pattern.rend());
  reversed_.add(r.data(), r.data() + r.size(), value);
  empty_ = false;
}

void LiteralMatcher::build() {
  const auto& t = reversed_;
  fail_.assign(t.size(), ByteTrie::kRoot);
  best_.assign(t.size(), -1);
  // Breadth first: a node's failure link is shallower, so set already.
  std::vector<int32_t> queue{ByteTrie::kRoot};
  for (size_t head = 0; head < queue.size(); ++head) {
    const int32_t u = queue[head];
    for (const int32_t v : t.children(u)) {
      int32_t f = ByteTrie::kRoot;
      if (u != ByteTrie::kRoot) {
        f = fail_[u];
        while (f != ByteTrie::kRoot && t.child(f, t.byte(v)) < 0) {
          f = fail_[f];
        }
        const int32_t next = t.child(f, t.byte(v));
        f = next >= 0 ? next : ByteTrie::kRoot;
      }
      fail_[v] = f;
      best_[v] = t.value(v) >= 0 ? v : best_[f];
      queue.push_back(v);
    }
  }
}

std::vector<LiteralMatcher::Match> LiteralMatcher::starts(
    const std::string& text) const {
  std::vector<Match> out;
  if (empty_) {
    return out;
  }
  const auto& t = reversed_;
  int32_t state = ByteTrie::kRoot;
  for (size_t i = text.size(); i-- > 0;) {
    const auto c = static_cast<unsigned char>(text[i]);
    while (state != ByteTrie::kRoot && t.child(state, c) < 0) {
      state = fail_[state];
    }
    const int32_t next = t.child(state, c);
    state = next >= 0 ? next : ByteTrie::kRoot;
    // The state is the longest suffix of the reversed text read so far in
    // the trie, so the longest key that is such a suffix is its best.
    const int32_t b = best_[state];
    if (b >= 0) {
      out.push_back({i, t.depth(b), t.value(b)});
    }
  }
  std::reverse(out.begin(), out.end());
  return out;
}

} // namespace tokenizer_detail
} // namespace models
} // namespace colossalai
