// The elastic rendezvous of `colossalai run --nnodes MIN:MAX`: nodes agree,
// through one TCPStore, on who is in the job, and notice when that must
// change.
//
// NOTE [Elastic rendezvous]
// The job's life is a sequence of rounds, numbered in the store's "round".
// A node joins the open round r by adding 1 to "r/joined" (its index i is
// the count before) and writing "r/node/i" (its address, a free port there,
// its --nproc_per_node). The round closes once, by compareSet on
// "r/closed", at the count then joined: at once when MAX nodes are in,
// else `last_call_timeout` after MIN are, or as soon as every member of the
// round before and every node that waited on it is back (a failure or a
// new node re-forms the job without waiting for the last call; it only
// waits for members that are gone). Nodes 0..n-1 are its members,
// node_rank i, world size n * nproc, and node 0's address and port become
// the ranks' MASTER_ADDR / MASTER_PORT. A node that finds the round closed
// (or joined past n) adds 1 to "r/waiting" and waits for round r + 1.
// While a round runs, every member checks the store each second: a newer
// round (another member failed and joined again) or a waiting node while
// the job has fewer than MAX nodes makes it stop its ranks (SIGTERM, as a
// pre-emption: a program that saves on the way out does) and join the next
// round, which a member opens by compareSet "round" r -> r + 1 (only a
// member, or a node signalled after it joined the open round, opens the
// next; the latter's round then runs a second at most). A member whose
// ranks fail opens the next round the same way when it restarts them
// (--max_restarts); its peers' ranks then fail too, or they see the new
// round first. A node killed with its ranks is simply
// absent from the next round: the job re-forms without it, smaller.
// The store lives in the launcher whose host the endpoint names (the first
// there to bind it): that node must outlive the job, as torchrun's c10d
// backend requires of its store's host.

#include "launcher_internal.h"

#include "../utils/compat_c10d.h"

#include <colossalai/distributed/error.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace colossalai {
namespace launcher {
namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string text(const std::vector<uint8_t>& b) {
  return std::string(b.begin(), b.end());
}

std::pair<std::string, int> endpoint(const RunOptions& o) {
  if (o.rdzv_endpoint.empty()) {
    return {o.master_addr, o.master_port};
  }
  const auto colon = o.rdzv_endpoint.rfind(':');
  return {
      o.rdzv_endpoint.substr(0, colon),
      std::stoi(o.rdzv_endpoint.substr(colon + 1))};
}

// The first IPv4 address `host` resolves to.
sockaddr_in resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  TORCH_CHECK(
      rc == 0 && found != nullptr,
      "--rdzv_endpoint: cannot resolve '",
      host,
      "': ",
      ::gai_strerror(rc));
  sockaddr_in a = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

// Whether a TCP port is free on every address (c10d's server binds them
// all): asked first so a second launcher on the store's host does not have
// c10d log its failed bind.
bool port_free(int port) {
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return true; // no IPv6 here: let c10d try
  }
  const int on = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_any;
  a.sin6_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 ||
      errno != EADDRINUSE;
  ::close(fd);
  return ok;
}

// Whether `a` is one of this host's addresses (binding to it works).
bool is_local(sockaddr_in a) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  a.sin_port = 0;
  const bool ok = fd >= 0 &&
      ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  if (fd >= 0) {
    ::close(fd);
  }
  return ok;
}

// This host's address on the route to `to` (what the other nodes reach us
// at), and a TCP port free on it now.
std::pair<std::string, int> local_address_towards(const sockaddr_in& to) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "socket() failed: ", std::strerror(errno));
  sockaddr_in self{};
  socklen_t len = sizeof(self);
  // A UDP connect sends nothing; it only picks the route.
  const bool ok =
      ::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) == 0;
  ::close(fd);
  TORCH_CHECK(ok, "no route to the rendezvous endpoint: ", std::strerror(errno));
  char name[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &self.sin_addr, name, sizeof(name));
  const int port = free_tcp_port(self.sin_addr);
  TORCH_CHECK(port > 0, "no free port on ", name, ": ", std::strerror(errno));
  return {name, port};
}

// A member whose launcher has not beaten (once a second, while its ranks
// run or it waits for the others to finish) for this long is gone.
constexpr auto kDeadAfter = std::chrono::seconds(5);

std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

} // namespace

Rendezvous::Rendezvous(const RunOptions& o, Say say, Interrupted interrupted)
    : options_(o),
      say_(std::move(say)),
      interrupted_(std::move(interrupted)),
      prefix_("colossalai/rdzv/" + o.rdzv_id + "/") {
  const auto [host, port] = endpoint(o);
  where_ = host + ":" + std::to_string(port);
  const sockaddr_in addr = resolve(host, port);
  const auto timeout = ms(o.rdzv_join_timeout);
  if (is_local(addr) && port_free(port)) {
    try {
      store_ = compat::make_tcp_store(
          host, static_cast<uint16_t>(port), /*is_server=*/true, 1, timeout);
      serves_ = true;
    } catch (const std::exception&) {
      // Another launcher on this host serves it already.
    }
  }
  if (!serves_) {
    try {
      store_ = compat::make_tcp_store(
          host, static_cast<uint16_t>(port), /*is_server=*/false, 1, timeout);
    } catch (const std::exception& e) {
      TORCH_CHECK(
          false,
          "cannot reach the rendezvous store at ",
          where_,
          " within ",
          o.rdzv_join_timeout,
          " s (its host runs `colossalai run` with this --rdzv_endpoint?): ",
          e.what());
    }
  }
  self_ = local_address_towards(addr);
  char hostname[256] = {};
  ::gethostname(hostname, sizeof(hostname) - 1);
  id_ = std::string(hostname) + ":" + std::to_string(::getpid());
  // The first node of the job starts round 0; later ones find the round.
  store_->compareSet(key("round"), {}, bytes("0"));
}

Rendezvous::~Rendezvous() = default;

std::string Rendezvous::key(const std::string& k) const {
  return prefix_ + k;
}

std::string Rendezvous::key(int64_t round, const std::string& k) const {
  return prefix_ + std::to_string(round) + "/" + k;
}

int64_t Rendezvous::current_round() {
  return std::stoll(text(store_->get(key("round"))));
}

void Rendezvous::open_after(int64_t round) {
  store_->compareSet(
      key("round"),
      bytes(std::to_string(round)),
      bytes(std::to_string(round + 1)));
}

int64_t Rendezvous::closed_size(int64_t round) {
  const auto k = key(round, "closed");
  return store_->check({k}) ? std::stoll(text(store_->get(k))) : -1;
}

int64_t Rendezvous::close(int64_t round, int64_t n) {
  return std::stoll(text(store_->compareSet(
      key(round, "closed"), {}, bytes(std::to_string(n)))));
}

Round Rendezvous::join(int64_t after) {
  refused_ = false;
  try {
    return admit(after);
  } catch (const std::exception& e) {
    if (refused_) {
      throw;
    }
    lost(distributed::error_text(e));
  }
}

void Rendezvous::lost(const std::string& what) const {
  TORCH_CHECK(
      false,
      "lost the rendezvous store at ",
      where_,
      " (the node that serves it must outlive the job): ",
      what);
}

Round Rendezvous::admit(int64_t after) {
  const auto deadline = Clock::now() + ms(options_.rdzv_join_timeout);
  const int max = options_.nnodes, min = options_.min_nodes;
  auto timed_out = [&] { return Clock::now() >= deadline; };
  for (;;) {
    const int64_t r = current_round();
    if (r <= after) {
      open_after(after); // we were in `after`: it is over
      continue;
    }
    int64_t n = closed_size(r);
    int64_t i = -1;
    if (n < 0) {
      i = store_->add(key(r, "joined"), 1) - 1;
      std::ostringstream info;
      info << self_.first << " " << self_.second << " "
           << options_.nproc_per_node << " " << id_;
      store_->set(key(r, "node/" + std::to_string(i)), bytes(info.str()));
      // Wait for the round to close: at once at MAX nodes, after the last
      // call once MIN are in.
      std::optional<Clock::time_point> last_call;
      while ((n = closed_size(r)) < 0) {
        if (interrupted_()) {
          // Counted in, we cannot leave this round: the next one opens now,
          // so members that start without us stop within a second (their
          // monitor sees it) instead of waiting for us until they time out.
          open_after(r);
          return Round();
        }
        const int64_t joined = store_->add(key(r, "joined"), 0);
        if (joined >= max) {
          n = close(r, max);
          break;
        }
        if (joined >= min && everyone_expected(r, joined)) {
          n = close(r, joined);
          break;
        }
        if (joined >= min) {
          if (!last_call) {
            last_call = Clock::now() + ms(options_.rdzv_last_call_timeout);
          }
          if (Clock::now() >= *last_call) {
            n = close(r, joined);
            break;
          }
        }
        refused_ = timed_out();
        TORCH_CHECK(
            !refused_,
            "rendezvous at ",
            where_,
            " (--rdzv_id ",
            options_.rdzv_id,
            "): ",
            joined,
            " node(s) joined within --rdzv_conf join_timeout=",
            options_.rdzv_join_timeout,
            " s, fewer than the ",
            min,
            " that --nnodes ",
            min,
            ":",
            max,
            " needs");
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    if (i >= 0 && i < n) {
      Round out;
      out.round = r;
      out.node_rank = static_cast<int>(i);
      out.nnodes = static_cast<int>(n);
      for (int64_t j = 0; j < n; ++j) {
        std::istringstream node(
            text(store_->get(key(r, "node/" + std::to_string(j)))));
        std::string addr;
        int port = 0, nproc = 0;
        node >> addr >> port >> nproc;
        refused_ = nproc != options_.nproc_per_node;
        TORCH_CHECK(
            !refused_,
            "rendezvous round ",
            r,
            ": node ",
            j,
            " (",
            addr,
            ") runs --nproc_per_node ",
            nproc,
            " and this node ",
            options_.nproc_per_node,
            "; every node of an elastic job runs the same number of ranks");
        if (j == 0) {
          out.master_addr = addr;
          out.master_port = port;
        }
      }
      return out;
    }
    // The round runs without us: wait for the next, which its members open
    // when they see us waiting (and have room) or when one of them fails.
    store_->add(key(r, "waiting"), 1);
    const int64_t place = store_->add(key(r, "waitlist"), 1) - 1;
    const auto listed = key(r, "waiter/" + std::to_string(place));
    store_->set(listed, bytes(id_));
    const bool full = n >= max;
    say_(
        "rendezvous round " + std::to_string(r) + " runs with " +
        std::to_string(n) + " node(s)" +
        (full ? ", the most --nnodes allows; waiting for a place"
              : "; waiting for its nodes to admit this one"));
    while (current_round() <= r) {
      if (interrupted_()) {
        store_->add(key(r, "waiting"), -1);
        store_->set(listed, std::vector<uint8_t>());
        return Round();
      }
      if (timed_out()) {
        store_->add(key(r, "waiting"), -1); // no longer waiting
        store_->set(listed, std::vector<uint8_t>());
        refused_ = true;
        TORCH_CHECK(
            false,
            "not admitted to the job at ",
            where_,
            " within --rdzv_conf join_timeout=",
            options_.rdzv_join_timeout,
            " s: ",
            full ? "it runs on " + std::to_string(max) +
                    " nodes, the most that --nnodes " + std::to_string(min) +
                    ":" + std::to_string(max) + " admits"
                 : std::string(
                       "its nodes did not re-form (do they run with "
                       "--nnodes MIN:MAX and this --rdzv_id?)"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
}

std::string Rendezvous::node_id(int64_t round, int64_t index) {
  // A node writes its entry just after counting itself in: until then (or
  // when it died in between) it is not in yet, rather than waited for.
  const auto k = key(round, "node/" + std::to_string(index));
  if (!store_->check({k})) {
    return "";
  }
  std::istringstream node(text(store_->get(k)));
  std::string addr, id;
  int port = 0, nproc = 0;
  node >> addr >> port >> nproc >> id;
  return id;
}

bool Rendezvous::everyone_expected(int64_t round, int64_t joined) {
  if (expected_round_ != round) {
    // The previous round's members and the nodes that waited on it: when
    // all of them are back the round need not wait for its last call,
    // which then only waits for members that are gone.
    expected_round_ = round;
    expected_.clear();
    const int64_t before = round - 1;
    const int64_t n = before >= 0 ? closed_size(before) : -1;
    if (n < 0) {
      expected_ = {""}; // nothing to go by: never complete
    }
    for (int64_t j = 0; j < n; ++j) {
      expected_.insert(node_id(before, j));
    }
    const int64_t waited = n < 0 ? 0 : store_->add(key(before, "waitlist"), 0);
    for (int64_t k = 0; k < waited; ++k) {
      const auto id =
          text(store_->get(key(before, "waiter/" + std::to_string(k))));
      if (!id.empty()) {
        expected_.insert(id);
      }
    }
  }
  std::set<std::string> in;
  for (int64_t j = 0; j < joined; ++j) {
    const auto id = node_id(round, j);
    if (!id.empty()) {
      in.insert(id);
    }
  }
  for (const auto& id : expected_) {
    if (in.count(id) == 0) {
      return false;
    }
  }
  return true;
}

std::string Rendezvous::beat_and_check(const Round& round) {
  const auto r = round.round;
  store_->add(key(r, "beat/" + std::to_string(round.node_rank)), 1);
  const auto now = Clock::now();
  if (watched_round_ != r) {
    watched_round_ = r;
    beats_.assign(round.nnodes, {-1, now});
  }
  for (int j = 0; j < round.nnodes; ++j) {
    if (j == round.node_rank ||
        store_->check({key(r, "done/" + std::to_string(j))})) {
      continue;
    }
    const int64_t beat =
        store_->add(key(r, "beat/" + std::to_string(j)), 0);
    if (beat != beats_[j].first) {
      beats_[j] = {beat, now};
    } else if (now - beats_[j].second >= kDeadAfter) {
      return "node " + std::to_string(j) + " of rendezvous round " +
          std::to_string(r) + " stopped answering (its launcher is gone)";
    }
  }
  return "";
}

std::string Rendezvous::should_rejoin(const Round& round) {
  const int64_t now = current_round();
  if (now > round.round) {
    return "rendezvous round " + std::to_string(now) +
        " began (a node failed or left)";
  }
  std::string gone = beat_and_check(round);
  if (!gone.empty()) {
    open_after(round.round);
    return gone;
  }
  if (round.nnodes < options_.nnodes &&
      store_->add(key(round.round, "waiting"), 0) > 0) {
    open_after(round.round);
    return "a node is waiting to join";
  }
  return "";
}

std::string Rendezvous::finish(const Round& round) {
  try {
    return finish_round(round);
  } catch (const std::exception& e) {
    lost(distributed::error_text(e));
  }
}

std::string Rendezvous::finish_round(const Round& round) {
  const auto r = round.round;
  store_->set(key(r, "done/" + std::to_string(round.node_rank)), bytes("1"));
  const auto deadline = Clock::now() + ms(options_.rdzv_join_timeout);
  for (;;) {
    if (current_round() > r) {
      return "rendezvous round " + std::to_string(r + 1) +
          " began (a node failed or left)";
    }
    std::string gone = beat_and_check(round);
    if (!gone.empty()) {
      open_after(r);
      return gone;
    }
    bool all = true;
    for (int j = 0; j < round.nnodes && all; ++j) {
      all = store_->check({key(r, "done/" + std::to_string(j))});
    }
    if (all) {
      // The node serving the store leaves last: the others may still be
      // reading it (and are told by "r/acked" that they can stop).
      store_->add(key(r, "acked"), 1);
      const auto acked_by = Clock::now() + 2 * kDeadAfter;
      while (serves_ && store_->add(key(r, "acked"), 0) < round.nnodes &&
             Clock::now() < acked_by) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      return "";
    }
    // A member still running past the join timeout is not ours to wait for.
    if (interrupted_() || Clock::now() >= deadline) {
      return "";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

void Rendezvous::leave(const Round& round) {
  try {
    open_after(round.round);
  } catch (const std::exception&) {
    // The store is gone with its host: nobody is left to tell.
  }
}

} // namespace detail
} // namespace launcher
} // namespace colossalai
