#pragma once

// A client of a PyTorch 2.x TCPStore server (internal).
//
// NOTE [torchrun's agent store]
// torchrun's elastic agent serves a TCPStore at the MASTER_ADDR:MASTER_PORT
// it exports and says so in TORCHELASTIC_USE_AGENT_STORE=True; every worker,
// rank 0 included, is then a client of it (torch.distributed.rendezvous's
// `_create_c10d_store`: no key prefix beyond TCPStore's own "/", as the agent
// makes a new store for every restart). The agent runs the torch of the
// Python that started torchrun, whose wire protocol LibTorch's own client
// need not speak: 1.13's predates the validation handshake and its command
// codes differ, so a 2.x server never answers it. This client speaks the 2.x
// protocol whatever LibTorch is linked, as torch's Python client does:
//   connect: VALIDATE (u8 0) + u32 0x3C85F7CE, no reply;
//   SET 1: key, value; COMPARE_SET 2: key, expected, desired -> value;
//   GET 3: key -> value (after a WAIT for it); ADD 4: key, i64 -> i64;
//   CHECK 5: u64 n, n keys -> u8 (0 ready); WAIT 6: u64 n, n keys -> u8
//   (0 stop waiting), cancelled by CANCEL_WAIT 12 -> u8 (1 cancelled);
//   GETNUMKEYS 7 -> i64; DELETE_KEY 8: key -> i64 (1 deleted);
// keys and values as a little-endian u64 length and the bytes, every key
// prefixed with "/" as TCPStore's client does. On connecting it adds 1 to
// "init/", as a Python worker's TCPStore(world_size=n) does.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace colossalai {
namespace distributed {
namespace detail {

class TcpStoreClient : public ::c10d::Store {
 public:
  /// Connects to the server at host:port (which must be listening); every
  /// reply is awaited at most `timeout`. Throws a c10::Error naming the
  /// address when the server is unreachable or does not answer.
  TcpStoreClient(
      std::string host,
      int port,
      std::chrono::milliseconds timeout);
  ~TcpStoreClient() override;

  void set(const std::string& key, const std::vector<uint8_t>& value)
      override;
  std::vector<uint8_t> compareSet(
      const std::string& key,
      const std::vector<uint8_t>& expected,
      const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(
      const std::vector<std::string>& keys,
      const std::chrono::milliseconds& timeout) override;
  /// Another connection to the same server (LibTorch 2.x's Store::clone;
  /// no `override`, as 1.13's Store has none).
  c10::intrusive_ptr<::c10d::Store> clone();

 private:
  class Message;
  void send(const std::vector<uint8_t>& bytes);
  void receive(void* out, size_t n, std::chrono::milliseconds timeout);
  template <class T>
  T receive_value();
  std::vector<uint8_t> receive_bytes();
  // WAIT for `keys` (prefixed), at most `timeout` (0: no limit).
  void wait_locked(
      const std::vector<std::string>& keys,
      std::chrono::milliseconds timeout);
  [[noreturn]] void fail(const std::string& what) const;

  std::string host_;
  int port_;
  int fd_ = -1;
  std::mutex mutex_; // one request and its reply at a time
};

} // namespace detail
} // namespace distributed
} // namespace colossalai
