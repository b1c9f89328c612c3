#include "test_util.h"

#include <colossalai/distributed/error.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <filesystem>

namespace colossalai {
namespace testing {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return distributed::error_text(e);
  }
  return "";
}

std::string temp_dir(const std::string& prefix) {
  namespace fs = std::filesystem;
  auto dir = fs::temp_directory_path() /
      (prefix + "_" + std::to_string(::getpid()) + "_" +
       std::to_string(
           std::chrono::steady_clock::now().time_since_epoch().count()));
  fs::create_directories(dir);
  return dir.string();
}

std::string scratch(int parent, const std::string& what) {
  return (std::filesystem::temp_directory_path() /
          ("colossalai_" + what + "_" + std::to_string(parent)))
      .string();
}

void remove_scratch(const std::string& what) {
  if (std::getenv("COLOSSALAI_TEST_CHILD") == nullptr) {
    std::filesystem::remove_all(scratch(::getpid(), what));
  }
}

} // namespace testing
} // namespace colossalai
