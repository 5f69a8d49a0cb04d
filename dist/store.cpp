#include "tessera/dist/store.h"

#include <poll.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>

namespace tessera::dist {

namespace {
enum Command : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kWait = 4, kCheck = 5, kHello = 6 };

// Requests are a command byte, an argument count and length-prefixed strings; replies are
// one length-prefixed string. A request goes out in one write: a client stopped between
// several writes (SIGSTOP) would hold the server's one thread in the middle of a request.
void send_request(Socket& s, uint8_t command, const std::vector<std::string>& args, Deadline d) {
  std::string request(1, static_cast<char>(command));
  auto append_u64 = [&](uint64_t v) { request.append(reinterpret_cast<const char*>(&v), sizeof v); };
  append_u64(args.size());
  for (const std::string& a : args) {
    append_u64(a.size());
    request += a;
  }
  s.send_all(request.data(), request.size(), d);
}
}  // namespace

// Serves the store from one thread: a poll loop over the listening socket and every client.
// A get/wait whose keys are missing is parked and answered when a set/add provides them.
class TCPStoreServer {
 public:
  TCPStoreServer(Listener listener, uint64_t generation)
      : listener_(std::move(listener)), generation_(generation), thread_([this] { serve(); }) {}
  ~TCPStoreServer() {
    stop_ = true;
    thread_.join();
  }
  int port() const { return listener_.port(); }

 private:
  struct Client {
    Socket socket;
    std::vector<std::string> waiting_for;  // non-empty while a get/wait is parked
    uint8_t waiting_command = 0;
  };

  void serve() {
    while (!stop_) {
      std::vector<pollfd> fds{{listener_.fd(), POLLIN, 0}};
      for (const auto& c : clients_) fds.push_back({c->socket.fd(), POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        try {
          auto client = std::make_unique<Client>();
          client->socket = listener_.accept(Deadline::after(1));
          clients_.push_back(std::move(client));
        } catch (const Error&) {
        }
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        Client& c = *clients_[i - 1];
        try {
          handle(c);
        } catch (const Error&) {
          c.socket.close();  // the client went away; forget it
        }
      }
      std::erase_if(clients_, [](const auto& c) { return !c->socket.valid(); });
    }
  }

  void handle(Client& c) {
    Deadline d = Deadline::after(10);
    uint8_t command = 0;
    c.socket.recv_all(&command, 1, d);
    uint64_t n = c.socket.recv_u64(d);
    TESSERA_CHECK(n < 1000000, "store: corrupt request");
    std::vector<std::string> args(n);
    for (auto& a : args) a = c.socket.recv_string(d);
    switch (command) {
      case kSet:
        values_[args.at(0)] = args.at(1);
        c.socket.send_string("", d);
        wake_waiters();
        break;
      case kAdd: {
        auto it = values_.find(args.at(0));
        int64_t value = (it == values_.end() ? 0 : std::stoll(it->second)) + std::stoll(args.at(1));
        values_[args.at(0)] = std::to_string(value);
        c.socket.send_string(std::to_string(value), d);
        wake_waiters();
        break;
      }
      case kCheck:
        c.socket.send_string(all_present(args) ? "1" : "0", d);
        break;
      case kHello:
        // A client of another generation is dropped; it will retry until its server is up.
        if (args.at(0) != std::to_string(generation_)) {
          c.socket.close();
          return;
        }
        c.socket.send_string("", d);
        break;
      case kGet:
      case kWait:
        c.waiting_for = args;
        c.waiting_command = command;
        wake_waiters();
        break;
      default:
        TESSERA_FAIL("store: unknown command ", int(command));
    }
  }

  bool all_present(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!values_.count(k)) return false;
    return true;
  }

  void wake_waiters() {
    for (auto& c : clients_) {
      if (c->waiting_for.empty() || !all_present(c->waiting_for)) continue;
      std::string reply = c->waiting_command == kGet ? values_.at(c->waiting_for[0]) : "";
      c->waiting_for.clear();
      try {
        c->socket.send_string(reply, Deadline::after(10));
      } catch (const Error&) {
        c->socket.close();
      }
    }
  }

  Listener listener_;
  uint64_t generation_;
  std::map<std::string, std::string> values_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

void Store::barrier(const std::string& name, int world_size) {
  const std::string counter = "barrier/" + name;
  const std::string done = counter + "/done";
  if (add(counter, 1) == world_size) set(done, "1");
  try {
    wait({done});
  } catch (const TimeoutError&) {
    int64_t arrived = add(counter, 0);
    throw TimeoutError(detail::concat("dist: barrier '", name, "' timed out after ",
                                      timeout_seconds(), " s: only ", arrived, " of ", world_size,
                                      " ranks arrived"));
  }
}

namespace {
using Clock = std::chrono::steady_clock;

// Progress lines come every tenth of the timeout, at least 1 s and at most 30 s apart.
Clock::duration progress_interval(double timeout_s) {
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::clamp(timeout_s / 10, 1.0, 30.0)));
}

long whole_seconds(Clock::duration d) {
  return std::lround(std::chrono::duration<double>(d).count());
}

void print_progress(const std::string& line) {
  std::fputs((line + "\n").c_str(), stderr);  // one write: lines of several ranks stay whole
  std::fflush(stderr);
}

std::string rendezvous_key(int rank) { return "rendezvous/rank/" + std::to_string(rank); }

// "rank 1" / "ranks 1,3" of the ranks that have not joined, or "" where this rank does not
// look (only rank 0 of a large job asks the store about every rank).
std::string missing_ranks(Store& store, int rank, int world_size) {
  if (rank != 0 && world_size > 64) return "";
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r)
    if (!store.check({rendezvous_key(r)})) missing.push_back(r);
  std::string text;
  for (size_t i = 0; i < missing.size() && i < 32; ++i)
    text += (i ? "," : "") + std::to_string(missing[i]);
  if (missing.size() > 32) text += ",... (" + std::to_string(missing.size()) + " in all)";
  return missing.empty() ? "" : (missing.size() > 1 ? "ranks " : "rank ") + text;
}
}  // namespace

void join_rendezvous(Store& store, int rank, int world_size, const std::string& where,
                     double timeout_s) {
  TESSERA_CHECK(store.add(rendezvous_key(rank), 1) == 1, "dist: two processes joined the "
                "rendezvous at ", where, " as rank ", rank, " (do two ranks have the same RANK?)");
  store.add("rendezvous/joined", 1);
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + std::chrono::duration_cast<Clock::duration>(
                                                 std::chrono::duration<double>(timeout_s));
  Clock::time_point next_progress = start + progress_interval(timeout_s);
  auto pause = std::chrono::milliseconds(2);
  for (;;) {
    const int64_t joined = store.add("rendezvous/joined", 0);
    if (joined >= world_size) return;
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      const std::string missing = missing_ranks(store, rank, world_size);
      throw TimeoutError(detail::concat(
          "dist: rank ", rank, ": the rendezvous at ", where, " timed out after ", timeout_s,
          " s: ", joined, " of ", world_size, " ranks joined",
          missing.empty() ? "" : "; " + missing + " never joined",
          " (were they started, with this MASTER_ADDR and MASTER_PORT? "
          "TESSERA_RENDEZVOUS_TIMEOUT sets the limit)"));
    }
    if (now >= next_progress) {
      const std::string missing = missing_ranks(store, rank, world_size);
      print_progress(detail::concat("dist: rank ", rank, " waiting for ", world_size - joined,
                                    " of ", world_size, " ranks at ", where, " (",
                                    whole_seconds(now - start), " s of ", timeout_s, " s)",
                                    missing.empty() ? "" : ": " + missing + " not joined yet"));
      next_progress += progress_interval(timeout_s);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
}

void wait_for_store(const std::string& host, int port, int rank, double timeout_s) {
  const std::string where = detail::concat(host, ":", port);
  const Clock::time_point start = Clock::now();
  const Deadline deadline = Deadline::after(timeout_s);
  for (;;) {
    const double step = std::chrono::duration<double>(progress_interval(timeout_s)).count();
    try {
      Socket::connect(host, port, Deadline::after(std::min(step, deadline.remaining_ms() / 1e3)),
                      "the rendezvous store (rank 0, MASTER_ADDR:MASTER_PORT)");
      return;  // it listens; the store's own connection follows
    } catch (const TimeoutError&) {
      if (deadline.expired())
        throw TimeoutError(detail::concat(
            "dist: rank ", rank, ": the rendezvous at ", where, " timed out after ", timeout_s,
            " s: rank 0 never served its store there (was it started, with this MASTER_ADDR "
            "and MASTER_PORT? TESSERA_RENDEZVOUS_TIMEOUT sets the limit)"));
      print_progress(detail::concat("dist: rank ", rank, " waiting for rank 0's store at ", where,
                                    " (", whole_seconds(Clock::now() - start), " s of ", timeout_s,
                                    " s)"));
    }
  }
}

TCPStore::TCPStore(const std::string& host, int port, bool is_server, double timeout_s,
                   uint64_t generation)
    : host_(host), port_(port), timeout_s_(timeout_s), generation_(generation) {
  if (is_server) {
    server_ = std::make_unique<TCPStoreServer>(Listener(host, port), generation_);
    port_ = server_->port();
  }
  connect();
}

void TCPStore::connect() {
  socket_.close();
  Deadline deadline = Deadline::after(timeout_s_);
  while (true) {
    socket_ = Socket::connect(host_, port_, deadline,
                              "the rendezvous store (rank 0, MASTER_ADDR:MASTER_PORT)");
    try {
      send_request(socket_, kHello, {std::to_string(generation_)}, deadline);
      socket_.recv_string(deadline);
      return;
    } catch (const PeerClosedError&) {  // a server of another generation: try again
      socket_.close();
      if (deadline.expired())
        throw TimeoutError(detail::concat("dist: the rendezvous store at ", host_, ":", port_,
                                          " is not the one of this job (generation ",
                                          generation_, ") before the timeout"));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
}

TCPStore::~TCPStore() {
  socket_.close();
  server_.reset();
}

template <class Reply>
Reply TCPStore::request(uint8_t command, const std::vector<std::string>& args,
                        const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  Deadline deadline = Deadline::after(timeout_s_);
  try {
    send_request(socket_, command, args, deadline);
    std::string reply = socket_.recv_string(deadline);
    if constexpr (std::is_same_v<Reply, int64_t>) {
      return std::stoll(reply);
    } else if constexpr (std::is_same_v<Reply, bool>) {
      return reply == "1";
    } else {
      return reply;
    }
  } catch (const TimeoutError&) {
    connect();  // the parked request is abandoned with the old connection
    throw TimeoutError(detail::concat("dist: store ", what, " timed out after ", timeout_s_,
                                      " s (a rank may have failed or not reached this point)"));
  } catch (const PeerClosedError&) {
    throw PeerClosedError(detail::concat("dist: store ", what,
                                         ": lost the connection to the store on rank 0 (did "
                                         "rank 0 exit?)"));
  }
}

void TCPStore::set(const std::string& key, const std::string& value) {
  request<std::string>(kSet, {key, value}, "set('" + key + "')");
}
std::string TCPStore::get(const std::string& key) {
  return request<std::string>(kGet, {key}, "get('" + key + "')");
}
int64_t TCPStore::add(const std::string& key, int64_t delta) {
  return request<int64_t>(kAdd, {key, std::to_string(delta)}, "add('" + key + "')");
}
void TCPStore::wait(const std::vector<std::string>& keys) {
  request<std::string>(kWait, keys, "wait('" + (keys.empty() ? "" : keys[0]) + "'...)");
}
bool TCPStore::check(const std::vector<std::string>& keys) {
  return request<bool>(kCheck, keys, "check");
}

std::string* LocalStore::find(const std::string& key) {
  for (auto& [k, v] : values_)
    if (k == key) return &v;
  return nullptr;
}
void LocalStore::set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::string* v = find(key)) *v = value;
  else values_.emplace_back(key, value);
}
std::string LocalStore::get(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string* v = find(key);
  if (!v) throw TimeoutError("dist: local store has no key '" + key + "'");
  return *v;
}
int64_t LocalStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string* v = find(key);
  int64_t value = (v ? std::stoll(*v) : 0) + delta;
  if (v) *v = std::to_string(value);
  else values_.emplace_back(key, std::to_string(value));
  return value;
}
void LocalStore::wait(const std::vector<std::string>& keys) {
  for (const auto& k : keys) get(k);
}
bool LocalStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& k : keys)
    if (!find(k)) return false;
  return true;
}

}  // namespace tessera::dist
