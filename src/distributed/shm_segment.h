#pragma once

// The layout of a shared-memory segment, and what the channel and its set-up
// both read about the processes that map one (internal, Linux). See NOTE
// [Shared-memory collectives] and NOTE [Segments that cannot outlive their
// job].

#include "shm_channel.h"

#include <atomic>
#include <cstdint>
#include <string>

namespace colossalai {
namespace distributed {
namespace detail {

// One per rank, after the header: the last phase the rank finished, how
// many wait on it, and its process (for the peers' liveness checks).
struct ShmChannel::Flag {
  std::atomic<uint32_t> phase;
  std::atomic<uint32_t> waiters;
  int32_t pid;
  uint32_t unused;
  uint64_t start_time; // of the process, in clock ticks since boot
  char pad[40];
};

constexpr uint64_t kMagic = 0x636f6c6f7373686dULL; // "colosshm"
constexpr int64_t kPage = 4096;

// Header, then one 64-byte flag per rank; the slots start on the next page.
inline int64_t data_offset(int size) {
  return (64 + 64 * static_cast<int64_t>(size) + kPage - 1) / kPage * kPage;
}

struct Header {
  uint64_t magic;
  uint64_t size;
  uint64_t slot_bytes;
};

/// Bytes of segments this process maps now (every channel's).
std::atomic<int64_t>& mapped_segment_bytes();

/// The first line of the file at `path` ("" when it cannot be read).
std::string read_line(const std::string& path);

/// Process state and start time (fields 3 and 22 of /proc/<pid>/stat).
bool process_state(int pid, char* state, uint64_t* start_time);

} // namespace detail
} // namespace distributed
} // namespace colossalai
