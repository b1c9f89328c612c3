#pragma once

// Files and a background thread for HybridAdam's offloaded states
// (internal).

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>

namespace colossalai {
namespace nn {
namespace optimizer {
namespace detail {

/// Runs submitted jobs one at a time, in submission order, on one thread.
/// The order matters: a read into a buffer submitted after the write-back of
/// that buffer's previous contents cannot overtake it.
class SerialWorker {
 public:
  SerialWorker();
  ~SerialWorker();
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  /// The future carries the job's exception, if any.
  std::future<void> submit(std::function<void()> job);

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

/// Checks `dir` is an existing writable directory (`option` names the option
/// in the error) and creates a fresh private subdirectory in it.
std::string make_offload_dir(const std::string& dir, const char* option);

/// Writes / reads exactly `bytes` at offset 0 with pwrite / pread.
void write_state_file(const std::string& path, const void* data, size_t bytes);
void read_state_file(const std::string& path, void* data, size_t bytes);

} // namespace detail
} // namespace optimizer
} // namespace nn
} // namespace colossalai
