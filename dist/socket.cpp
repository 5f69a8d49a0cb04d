#include "tessera/dist/socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

namespace tessera::dist {

Deadline Deadline::after(double seconds) {
  Deadline d;
  d.when_ = std::chrono::steady_clock::now() +
            std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                std::chrono::duration<double>(seconds));
  return d;
}

Deadline Deadline::never() {
  Deadline d;
  d.infinite_ = true;
  return d;
}

bool Deadline::expired() const {
  return !infinite_ && std::chrono::steady_clock::now() >= when_;
}

int Deadline::remaining_ms() const {
  if (infinite_) return -1;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                  when_ - std::chrono::steady_clock::now())
                  .count();
  if (left <= 0) return 0;
  return left > INT_MAX ? INT_MAX : static_cast<int>(left);
}

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

namespace {
sockaddr_in resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  TESSERA_CHECK(rc == 0 && found, "dist: cannot resolve host '", host, "': ", gai_strerror(rc));
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
  freeaddrinfo(found);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return addr;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}
}  // namespace

Socket Socket::connect(const std::string& host, int port, Deadline deadline,
                       const std::string& what) {
  sockaddr_in addr = resolve(host, port);
  std::string last_error;
  while (true) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    TESSERA_CHECK(fd >= 0, "dist: socket() failed: ", std::strerror(errno));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      set_nodelay(fd);
      return Socket(fd);
    }
    last_error = std::strerror(errno);
    ::close(fd);
    if (deadline.expired())
      throw TimeoutError(detail::concat("dist: could not connect to ", what, " at ", host, ":",
                                        port, " before the timeout (last error: ", last_error,
                                        ")"));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

bool Socket::wait_readable(Deadline deadline) const {
  pollfd p{fd_, POLLIN, 0};
  while (true) {
    int rc = ::poll(&p, 1, deadline.remaining_ms());
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) TESSERA_FAIL("dist: poll failed: ", std::strerror(errno));
  }
}

void Socket::send_all(const void* data, size_t n, Deadline deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t sent = ::send(fd_, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent > 0) {
      p += sent;
      n -= static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pf{fd_, POLLOUT, 0};
      int rc = ::poll(&pf, 1, deadline.remaining_ms());
      if (rc == 0) throw TimeoutError("dist: timed out sending to a peer");
      continue;
    }
    throw PeerClosedError(detail::concat("dist: sending to a peer failed: ",
                                         std::strerror(errno), " (did the peer process exit?)"));
  }
}

void Socket::recv_all(void* data, size_t n, Deadline deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_readable(deadline)) throw TimeoutError("dist: timed out waiting for a peer");
    ssize_t got = ::recv(fd_, p, n, MSG_DONTWAIT);
    if (got > 0) {
      p += got;
      n -= static_cast<size_t>(got);
      continue;
    }
    if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    throw PeerClosedError(got == 0 ? std::string("dist: a peer closed its connection (did it exit?)")
                                   : detail::concat("dist: receiving from a peer failed: ",
                                                    std::strerror(errno)));
  }
}

void Socket::send_string(const std::string& s, Deadline d) {
  send_u64(s.size(), d);
  send_all(s.data(), s.size(), d);
}

std::string Socket::recv_string(Deadline d) {
  uint64_t n = recv_u64(d);
  TESSERA_CHECK(n < (uint64_t(1) << 34), "dist: corrupt message (string of ", n, " bytes)");
  std::string s(n, '\0');
  recv_all(s.data(), n, d);
  return s;
}

std::string Socket::local_address() const {
  sockaddr_in addr{};
  socklen_t len = sizeof addr;
  TESSERA_CHECK(getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0,
                "dist: getsockname failed: ", std::strerror(errno));
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &addr.sin_addr, text, sizeof text);
  return text;
}

Listener::Listener(const std::string& host, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TESSERA_CHECK(fd >= 0, "dist: socket() failed: ", std::strerror(errno));
  socket_ = Socket(fd);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  if (host.empty() || host == "0.0.0.0") {
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
  } else {
    addr = resolve(host, port);
  }
  TESSERA_CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0,
                "dist: cannot listen on ", host.empty() ? "*" : host, ":", port, ": ",
                std::strerror(errno), " (is another job using this port? set MASTER_PORT, or `tessera launch --master-port`)");
  TESSERA_CHECK(::listen(fd, 128) == 0, "dist: listen failed: ", std::strerror(errno));
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
}

Socket Listener::accept(Deadline deadline) {
  if (!socket_.wait_readable(deadline))
    throw TimeoutError(detail::concat("dist: no peer connected to port ", port_,
                                      " before the timeout"));
  int fd = ::accept4(socket_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
  TESSERA_CHECK(fd >= 0, "dist: accept failed: ", std::strerror(errno));
  set_nodelay(fd);
  return Socket(fd);
}

int find_free_port() {
  Listener probe("127.0.0.1", 0);
  return probe.port();
}

}  // namespace tessera::dist
