// PreemptionGuard: SIGTERM becomes a flag the ranks agree on.

#include <colossalai/booster/preemption.h>
#include <colossalai/distributed/collectives.h>

#include <c10/util/Exception.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace colossalai {
namespace booster {

namespace {

volatile sig_atomic_t g_signalled = 0;
volatile sig_atomic_t g_grace = 0;
struct sigaction g_previous {};
std::atomic<bool> g_installed{false};

void on_term(int) {
  if (g_signalled == 0) {
    g_signalled = 1;
    // The backstop: SIGALRM's default action ends the process.
    ::alarm(static_cast<unsigned>(g_grace));
  }
}

} // namespace

PreemptionGuard::PreemptionGuard(int grace_seconds)
    : grace_seconds_(grace_seconds) {
  TORCH_CHECK(
      grace_seconds >= 1,
      "PreemptionGuard: grace_seconds must be >= 1, got ",
      grace_seconds);
  TORCH_CHECK(
      !g_installed.exchange(true),
      "PreemptionGuard: one is already alive in this process");
  g_grace = grace_seconds;
  struct sigaction sa {};
  sa.sa_handler = on_term;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &sa, &g_previous);
}

PreemptionGuard::~PreemptionGuard() {
  ::sigaction(SIGTERM, &g_previous, nullptr);
  g_installed.store(false);
}

bool PreemptionGuard::signalled() {
  return g_signalled != 0;
}

bool PreemptionGuard::requested() {
  if (!distributed::is_initialized()) {
    return signalled();
  }
  auto flag = at::full({1}, signalled() ? 1.0f : 0.0f);
  distributed::all_reduce(
      flag, *distributed::world_group(), distributed::ReduceOp::kMax)
      .wait();
  return flag.item<float>() > 0;
}

} // namespace booster
} // namespace colossalai
