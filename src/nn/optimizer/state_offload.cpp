#include "state_offload.h"
#include "../../utils/fd_io.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

namespace colossalai {
namespace nn {
namespace optimizer {
namespace detail {

SerialWorker::SerialWorker() : thread_([this] { loop(); }) {}

SerialWorker::~SerialWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

std::future<void> SerialWorker::submit(std::function<void()> job) {
  std::packaged_task<void()> task(std::move(job));
  auto future = task.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(task));
  }
  cv_.notify_one();
  return future;
}

void SerialWorker::loop() {
  for (;;) {
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) {
        return; // stop_ and nothing left: every job submitted has run
      }
      task = std::move(jobs_.front());
      jobs_.pop_front();
    }
    task();
  }
}

std::string make_offload_dir(const std::string& dir, const char* option) {
  namespace fs = std::filesystem;
  const std::string base =
      dir.empty() ? fs::temp_directory_path().string() : dir;
  std::error_code ec;
  TORCH_CHECK(
      fs::is_directory(base, ec),
      option,
      ": '",
      base,
      "' is not an existing directory");
  TORCH_CHECK(
      ::access(base.c_str(), W_OK | X_OK) == 0,
      option,
      ": directory '",
      base,
      "' is not writable (",
      std::strerror(errno),
      ")");
  std::string templ = (fs::path(base) / "hybrid_adam_XXXXXX").string();
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  TORCH_CHECK(
      ::mkdtemp(buf.data()) != nullptr,
      option,
      ": cannot create a directory in '",
      base,
      "': ",
      std::strerror(errno));
  return std::string(buf.data());
}

void write_state_file(const std::string& path, const void* data, size_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  TORCH_CHECK(
      fd >= 0,
      "HybridAdam: cannot open '",
      path,
      "' for writing: ",
      std::strerror(errno));
  if (const int err = utils::write_fully(fd, data, bytes)) {
    ::close(fd);
    TORCH_CHECK(
        false, "HybridAdam: writing '", path, "' failed: ", std::strerror(err));
  }
  TORCH_CHECK(
      ::close(fd) == 0,
      "HybridAdam: closing '",
      path,
      "' failed: ",
      std::strerror(errno));
}

void read_state_file(const std::string& path, void* data, size_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(
      fd >= 0,
      "HybridAdam: cannot open '",
      path,
      "' for reading: ",
      std::strerror(errno));
  char* p = static_cast<char*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, p + done, bytes - done, done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      TORCH_CHECK(
          false,
          "HybridAdam: reading '",
          path,
          "' failed: ",
          n < 0 ? std::strerror(err) : "file is shorter than the state");
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

} // namespace detail
} // namespace optimizer
} // namespace nn
} // namespace colossalai
