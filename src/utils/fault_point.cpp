#include "fault_point.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace colossalai {
namespace utils {

namespace {

struct Target {
  std::string name; // empty: no fault injection
  long hit = 1;
  int signal = SIGKILL;
};

const Target& target() {
  static const Target t = [] {
    Target t;
    const char* v = std::getenv("COLOSSALAI_FAULT_POINT");
    if (v == nullptr) {
      return t;
    }
    t.name = v;
    auto at = t.name.find('@');
    if (at != std::string::npos) {
      t.signal = t.name.compare(at + 1, std::string::npos, "TERM") == 0
          ? SIGTERM
          : SIGKILL;
      t.name.resize(at);
    }
    auto hash = t.name.find('#');
    if (hash != std::string::npos) {
      t.hit = std::strtol(t.name.c_str() + hash + 1, nullptr, 10);
      t.name.resize(hash);
    }
    return t;
  }();
  return t;
}

} // namespace

void fault_point(const char* name) {
  const auto& t = target();
  if (t.name.empty() || t.name != name) {
    return;
  }
  static std::atomic<long> hits{0};
  if (++hits == t.hit) {
    ::kill(::getpid(), t.signal);
    ::pause();
  }
}

} // namespace utils
} // namespace colossalai
