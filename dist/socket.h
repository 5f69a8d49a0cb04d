// Small blocking TCP helpers with deadlines, shared by the rendezvous store and
// the TCP process group. Every wait is bounded: a peer that never answers ends
// in TimeoutError, a peer that goes away in PeerClosedError, so nothing hangs.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "tessera/core/error.h"

namespace tessera::dist {

class TimeoutError : public Error {
 public:
  using Error::Error;
};
class PeerClosedError : public Error {
 public:
  using Error::Error;
};

class Deadline {
 public:
  static Deadline after(double seconds);
  static Deadline never();
  bool expired() const;
  // Milliseconds left, clamped to [0, INT32_MAX]; -1 for `never` (poll's "forever").
  int remaining_ms() const;

 private:
  std::chrono::steady_clock::time_point when_{};
  bool infinite_ = false;
};

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { close(); }

  // Connects to host:port, retrying refused connections (the server may not be up yet)
  // until the deadline; `what` names the peer in error messages.
  static Socket connect(const std::string& host, int port, Deadline deadline,
                        const std::string& what);

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  void close();

  void send_all(const void* data, size_t n, Deadline deadline);
  void recv_all(void* data, size_t n, Deadline deadline);
  // Blocks until data can be read (true) or the deadline passes (false).
  bool wait_readable(Deadline deadline) const;

  void send_u64(uint64_t v, Deadline d) { send_all(&v, sizeof v, d); }
  uint64_t recv_u64(Deadline d) {
    uint64_t v = 0;
    recv_all(&v, sizeof v, d);
    return v;
  }
  void send_string(const std::string& s, Deadline d);
  std::string recv_string(Deadline d);

  // The local address of this connection as text (what peers can reach us by).
  std::string local_address() const;

 private:
  int fd_ = -1;
};

class Listener {
 public:
  // Listens on `host` ("" or "0.0.0.0" = every interface) at `port` (0 = any free port).
  Listener(const std::string& host, int port);
  Listener(Listener&&) noexcept = default;
  int port() const { return port_; }
  int fd() const { return socket_.fd(); }
  Socket accept(Deadline deadline);

 private:
  Socket socket_;
  int port_ = 0;
};

// A TCP port that was free a moment ago on this host (for single-node launches).
int find_free_port();

}  // namespace tessera::dist
