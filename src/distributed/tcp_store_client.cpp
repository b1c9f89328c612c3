#include "tcp_store_client.h"

#include <c10/util/Exception.h>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace colossalai {
namespace distributed {
namespace detail {

namespace {

// TCPStoreBackend.hpp's QueryType, CheckResponseType and WaitResponseType.
enum Query : uint8_t {
  kValidate = 0,
  kSet = 1,
  kCompareSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kGetNumKeys = 7,
  kDeleteKey = 8,
  kCancelWait = 12,
};
constexpr uint32_t kValidationMagic = 0x3C85F7CE;
constexpr uint8_t kReady = 0;
constexpr uint8_t kStopWaiting = 0;
constexpr uint8_t kWaitCanceled = 1;
// TCPStore's client prefixes every key but its workers' counter.
constexpr const char* kKeyPrefix = "/";
constexpr const char* kInitKey = "init/";
// A reply larger than this is not a store's (values are addresses, ids).
constexpr uint64_t kMaxValueBytes = uint64_t(1) << 30;

} // namespace

// One request, built in memory and sent whole (the byte order is the host's,
// little-endian on every platform PyTorch runs on, as TCPStore writes it).
class TcpStoreClient::Message {
 public:
  explicit Message(uint8_t query) {
    bytes_.push_back(query);
  }
  template <class T>
  Message& value(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
    return *this;
  }
  Message& bytes(const std::vector<uint8_t>& b) {
    value<uint64_t>(b.size());
    bytes_.insert(bytes_.end(), b.begin(), b.end());
    return *this;
  }
  Message& key(const std::string& k, const char* prefix = kKeyPrefix) {
    const std::string full = prefix + k;
    return bytes(std::vector<uint8_t>(full.begin(), full.end()));
  }
  Message& keys(const std::vector<std::string>& ks) {
    value<uint64_t>(ks.size());
    for (const auto& k : ks) {
      key(k);
    }
    return *this;
  }
  const std::vector<uint8_t>& data() const {
    return bytes_;
  }

 private:
  std::vector<uint8_t> bytes_;
};

TcpStoreClient::TcpStoreClient(
    std::string host,
    int port,
    std::chrono::milliseconds timeout)
    : ::c10d::Store(timeout), host_(std::move(host)), port_(port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(
      host_.c_str(), std::to_string(port_).c_str(), &hints, &found);
  if (rc != 0) {
    fail(std::string("cannot resolve the host: ") + ::gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owner(
      found, &::freeaddrinfo);
  int err = 0;
  for (auto* a = found; a != nullptr && fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      err = errno;
      continue;
    }
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      fd_ = fd;
    } else {
      err = errno;
      ::close(fd);
    }
  }
  if (fd_ < 0) {
    fail(std::string("cannot connect: ") + std::strerror(err));
  }
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // The handshake has no reply; the counter's reply shows a 2.x server took
  // it (another answers nothing, or closes the connection).
  try {
    Message hello(kValidate);
    hello.value<uint32_t>(kValidationMagic);
    send(hello.data());
    send(Message(kAdd).key(kInitKey, "").value<int64_t>(1).data());
    receive_value<int64_t>();
  } catch (...) {
    ::close(fd_); // no destructor runs for an object never constructed
    throw;
  }
}

TcpStoreClient::~TcpStoreClient() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

void TcpStoreClient::fail(const std::string& what) const {
  TORCH_CHECK(
      false,
      "torchrun's TCPStore at ",
      host_,
      ":",
      port_,
      ": ",
      what,
      " (the agent's store speaks PyTorch 2.x's protocol)");
}

void TcpStoreClient::send(const std::vector<uint8_t>& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n =
        ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      fail(std::string("send failed: ") + std::strerror(errno));
    }
    done += static_cast<size_t>(n);
  }
}

void TcpStoreClient::receive(
    void* out,
    size_t n,
    std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto* p = static_cast<uint8_t*>(out);
  size_t done = 0;
  while (done < n) {
    int wait_ms = -1;
    if (timeout.count() > 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        fail(
            "no reply within " + std::to_string(timeout.count()) +
            " ms (Socket Timeout)");
      }
      wait_ms = static_cast<int>(left.count());
    }
    pollfd pfd{fd_, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, wait_ms);
    if (ready < 0 && errno == EINTR) {
      continue;
    }
    if (ready == 0) {
      continue; // the deadline check above reports it
    }
    const ssize_t got = ::recv(fd_, p + done, n - done, 0);
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got <= 0) {
      fail(
          got == 0 ? std::string("the server closed the connection")
                   : std::string("receive failed: ") + std::strerror(errno));
    }
    done += static_cast<size_t>(got);
  }
}

template <class T>
T TcpStoreClient::receive_value() {
  T v{};
  receive(&v, sizeof(T), timeout_);
  return v;
}

std::vector<uint8_t> TcpStoreClient::receive_bytes() {
  const auto n = receive_value<uint64_t>();
  if (n > kMaxValueBytes) {
    fail("a reply of " + std::to_string(n) + " bytes is no store value");
  }
  std::vector<uint8_t> out(n);
  if (n > 0) {
    receive(out.data(), n, timeout_);
  }
  return out;
}

void TcpStoreClient::set(
    const std::string& key,
    const std::vector<uint8_t>& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  send(Message(kSet).key(key).bytes(value).data());
}

std::vector<uint8_t> TcpStoreClient::compareSet(
    const std::string& key,
    const std::vector<uint8_t>& expected,
    const std::vector<uint8_t>& desired) {
  std::lock_guard<std::mutex> lock(mutex_);
  send(Message(kCompareSet).key(key).bytes(expected).bytes(desired).data());
  return receive_bytes();
}

std::vector<uint8_t> TcpStoreClient::get(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  wait_locked({key}, timeout_);
  send(Message(kGet).key(key).data());
  return receive_bytes();
}

int64_t TcpStoreClient::add(const std::string& key, int64_t value) {
  std::lock_guard<std::mutex> lock(mutex_);
  send(Message(kAdd).key(key).value<int64_t>(value).data());
  return receive_value<int64_t>();
}

bool TcpStoreClient::deleteKey(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  send(Message(kDeleteKey).key(key).data());
  return receive_value<int64_t>() == 1;
}

bool TcpStoreClient::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  send(Message(kCheck).keys(keys).data());
  return receive_value<uint8_t>() == kReady;
}

int64_t TcpStoreClient::getNumKeys() {
  std::lock_guard<std::mutex> lock(mutex_);
  send(Message(kGetNumKeys).data());
  return receive_value<int64_t>();
}

void TcpStoreClient::wait(const std::vector<std::string>& keys) {
  wait(keys, timeout_);
}

void TcpStoreClient::wait(
    const std::vector<std::string>& keys,
    const std::chrono::milliseconds& timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  wait_locked(keys, timeout);
}

void TcpStoreClient::wait_locked(
    const std::vector<std::string>& keys,
    std::chrono::milliseconds timeout) {
  send(Message(kWait).keys(keys).data());
  pollfd pfd{fd_, POLLIN, 0};
  int ready = 0;
  do {
    ready = ::poll(
        &pfd, 1, timeout.count() > 0 ? static_cast<int>(timeout.count()) : -1);
  } while (ready < 0 && errno == EINTR);
  if (ready > 0) {
    if (receive_value<uint8_t>() != kStopWaiting) {
      fail("an unexpected reply to WAIT");
    }
    return;
  }
  // Cancel the wait; the keys may have arrived meanwhile (then both replies
  // come, the wait's first).
  send(Message(kCancelWait).data());
  if (receive_value<uint8_t>() != kWaitCanceled &&
      receive_value<uint8_t>() != kWaitCanceled) {
    fail("an unexpected reply to CANCEL_WAIT");
  }
  std::string names;
  for (const auto& k : keys) {
    names += (names.empty() ? "" : ", ") + k;
  }
  fail(
      "timed out after " + std::to_string(timeout.count()) +
      " ms waiting for keys [" + names + "] (Socket Timeout)");
}

c10::intrusive_ptr<::c10d::Store> TcpStoreClient::clone() {
  return c10::make_intrusive<TcpStoreClient>(host_, port_, timeout_);
}

} // namespace detail
} // namespace distributed
} // namespace colossalai
