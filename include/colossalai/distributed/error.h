#pragma once

#include <stdexcept>
#include <string>

namespace colossalai {
namespace distributed {

/// A communication failure: a collective or rendezvous that timed out or lost
/// a peer. The message names the rank, the operation, the group and the cause,
/// so a log line is enough to tell which process and which step failed.
class DistributedError : public std::runtime_error {
 public:
  explicit DistributedError(const std::string& what)
      : std::runtime_error(what) {}
};

} // namespace distributed
} // namespace colossalai

#include <exception>

namespace colossalai {
namespace distributed {

/// The message of `e` without the C++ backtrace c10::Error carries.
std::string error_text(const std::exception& e);

} // namespace distributed
} // namespace colossalai
