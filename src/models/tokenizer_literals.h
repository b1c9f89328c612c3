#pragma once

// Literal strings in a text in linear time (internal), for the tokenizer's
// added tokens and SentencePiece's merges: a byte trie, and over it
// Aho-Corasick's failure links for `tokenizers`' leftmost-longest matching.
// Matching candidate by candidate at each position is quadratic on a run of
// one character that a token is made of.

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace colossalai {
namespace models {
namespace tokenizer_detail {

/// Byte strings with a value each.
class ByteTrie {
 public:
  static constexpr int32_t kRoot = 0;

  ByteTrie();
  /// Adds the key [begin, end) with `value` (>= 0); a key added again keeps
  /// its first value.
  void add(const char* begin, const char* end, int64_t value);
  /// The node after `node` on `c`, -1 if none.
  int32_t child(int32_t node, unsigned char c) const {
    if (node == kRoot) {
      return root_[c];
    }
    const auto it = edges_.find(edge(node, c));
    return it == edges_.end() ? -1 : it->second;
  }
  /// The value of the key ending at `node`, -1 if none.
  int64_t value(int32_t node) const {
    return nodes_[node].value;
  }
  size_t depth(int32_t node) const {
    return nodes_[node].depth;
  }
  size_t size() const {
    return nodes_.size();
  }
  /// The children of `node`, in the order they were made.
  const std::vector<int32_t>& children(int32_t node) const {
    return nodes_[node].children;
  }
  unsigned char byte(int32_t node) const {
    return nodes_[node].byte;
  }

 private:
  struct Node {
    int64_t value = -1;
    size_t depth = 0;
    unsigned char byte = 0; // on the edge into it
    std::vector<int32_t> children;
  };
  static uint64_t edge(int32_t node, unsigned char c) {
    return (static_cast<uint64_t>(node) << 8) | c;
  }
  std::vector<Node> nodes_;
  int32_t root_[256];
  std::unordered_map<uint64_t, int32_t> edges_;
};

/// Leftmost-longest matching of literal patterns (`tokenizers`' added
/// tokens, the aho-corasick crate's LeftmostLongest): where several
/// patterns start at the leftmost position, the longest wins; a pattern
/// added twice keeps its first value.
class LiteralMatcher {
 public:
  struct Match {
    size_t begin;
    size_t length;
    int64_t value;
  };

  /// Adds a pattern (ignored when empty); then build().
  void add(const std::string& pattern, int64_t value);
  void build();
  bool empty() const {
    return empty_;
  }
  /// For each byte offset of `text` where a pattern starts, the longest
  /// one, in increasing order of offset: O(text + patterns). (An
  /// automaton of the reversed patterns read from the text's end: the
  /// longest pattern ending at each point of the reversed text is the
  /// longest starting there in the text.)
  std::vector<Match> starts(const std::string& text) const;

 private:
  ByteTrie reversed_;
  std::vector<int32_t> fail_; // longest proper suffix that is a node
  std::vector<int32_t> best_; // the longest key ending at a node, -1
  bool empty_ = true;
};

} // namespace tokenizer_detail
} // namespace models
} // namespace colossalai
