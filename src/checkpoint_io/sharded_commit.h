#pragma once

// Writes one sharded checkpoint (an index and the files it names) into a
// directory that may hold other files (internal).

#include <colossalai/checkpoint_io/io_utils.h>

#include <set>
#include <string>
#include <vector>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

// NOTE [Sharded checkpoint commit]
// A sharded checkpoint is its index plus the files the index names; the
// directory may hold other checkpoints (another prefix, the optimizer beside
// the model) and the user's own files, which a save never touches. The index
// is the commit point, so a process killed at any step leaves the previous or
// the new checkpoint loadable, by the directory or by the index path:
//  1. Recover: a journal left by a killed save lists files it was adding or
//     retiring; those the live index does not name are removed, as are
//     temporaries of dead processes.
//  2. Each shard (and extra file, e.g. the optimizer's param groups) is
//     written to a hidden temporary and fsync'd. Loads ignore hidden files.
//  3. Final names are chosen among names no file in the directory has
//     (Hugging Face's "model-00001-of-00003.safetensors", or with a save tag
//     inserted when that name is taken), so the live checkpoint is intact.
//  4. The journal is written atomically: the new names and the live
//     checkpoint's files.
//  5. Temporaries are renamed to their final names; the directory fsync'd.
//  6. The index is written to a temporary, fsync'd and renamed over the
//     index: from here on the new checkpoint is the live one.
//  7. Files of the previous checkpoint that the new index does not name are
//     removed, then the journal.
// Shard names carry the shard count, unknown until the end, so shards are
// written under provisional names (NOTE [Streamed sharded saves]).
//
// Several writers (one per pipeline stage) may write one checkpoint: each
// part writer does step 2 for its shards and hands them over; the
// coordinator, which alone recovers (step 1, before any part is written)
// and commits, adopts them in stage order, so shard numbers run across
// parts and one index names them all. Directories must be shared.
class ShardedCommit {
 public:
  /// A sealed shard: its temporary file, its keys and their bytes.
  struct Part {
    std::string temp;
    std::vector<std::string> keys;
    int64_t bytes = 0;
  };

  /// A save of the checkpoint indexed by `dir/index_name`, whose shards are
  /// named after `stem` ("model.safetensors" -> "model-00001-of-00002..."),
  /// each at most `max_bytes` unless one entry is larger. `part_label`
  /// non-empty: a part writer (no recovery, no commit; temporaries carry
  /// the label).
  ShardedCommit(
      std::string dir,
      std::string index_name,
      std::string stem,
      int64_t max_bytes,
      std::string part_label = "");
  /// Removes the temporaries of a save that did not commit.
  ~ShardedCommit();
  ShardedCommit(const ShardedCommit&) = delete;
  ShardedCommit& operator=(const ShardedCommit&) = delete;

  /// Whether the current shard must be written before `bytes` more.
  bool full(int64_t bytes) const;
  /// Adds `key` of `bytes` to the current shard.
  void add(const std::string& key, int64_t bytes);
  /// Where to write the current shard; starts the next one.
  std::string seal();
  /// Whether the current shard has entries not yet sealed.
  bool pending() const;
  /// Where to write an extra file wanted as `name`; its final name is put in
  /// the index's metadata under `metadata_key`.
  std::string extra(const std::string& name, const std::string& metadata_key);

  /// A part writer's sealed shards, fsync'd; they are no longer this
  /// object's to remove.
  std::vector<Part> hand_over();
  /// Takes parts written by other ranks, numbered after those so far.
  void adopt(const std::vector<Part>& parts);

  /// Publishes the shards and extras with `index` (steps 3 to 7); `single`
  /// names a lone shard (empty: always numbered).
  void commit(Index index, const std::string& single);

 private:
  std::string free_name(const std::string& wanted, std::set<std::string>& taken)
      const;
  void recover();

  std::string dir_, index_name_, stem_, label_;
  int64_t max_bytes_;
  int64_t current_ = 0;
  bool sealed_ = false;
  bool committed_ = false;
  std::string tag_;
  std::vector<Part> parts_;
  struct Extra {
    std::string name, metadata_key, temp;
  };
  std::vector<Extra> extras_;
};

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
