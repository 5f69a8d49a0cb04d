// Rendezvous: a TCP key-value store served by rank 0, torchrun style. Ranks
// use it to find each other (addresses of the TCP process group, the NCCL
// unique id) and to meet at barriers that give up after a timeout instead of
// hanging.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessera/dist/socket.h"

namespace tessera::dist {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Waits until the key exists (up to the store's timeout) and returns its value.
  virtual std::string get(const std::string& key) = 0;
  // Adds `delta` to the integer under key (missing = 0) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Waits until every key exists, up to the store's timeout.
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // All `world_size` callers of barrier(name) return together; the error on timeout says
  // how many arrived.
  void barrier(const std::string& name, int world_size);
  virtual double timeout_seconds() const = 0;
};

// The rendezvous of init_process_group: rank `rank` announces itself in `store` and waits
// until all `world_size` ranks have, printing "waiting for K of N ranks at WHERE (30 s of
// T s)" every so often (rank 0 also names them); after `timeout_s` it throws a TimeoutError
// naming the ranks that never joined. Two processes with the same rank are an error.
void join_rendezvous(Store& store, int rank, int world_size, const std::string& where,
                     double timeout_s);
// Waits until rank 0's store accepts connections at host:port, printing progress likewise;
// after `timeout_s` a TimeoutError says that rank 0 never served it there.
void wait_for_store(const std::string& host, int port, int rank, double timeout_s);

class TCPStoreServer;

class TCPStore : public Store {
 public:
  // The process with is_server runs the server (on host:port, port 0 = any free port) and is
  // also a client of it. Every call waits at most `timeout_s` seconds. `generation` tells
  // successive stores on the same port apart: a client only talks to a server of its own
  // generation and keeps retrying until that one is up (a job that tears its process group
  // down and builds it again cannot reach the old store by mistake).
  TCPStore(const std::string& host, int port, bool is_server, double timeout_s,
           uint64_t generation = 0);
  ~TCPStore() override;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  void wait(const std::vector<std::string>& keys) override;
  bool check(const std::vector<std::string>& keys) override;
  double timeout_seconds() const override { return timeout_s_; }
  int port() const { return port_; }
  // This host's address as seen on the connection to the server (reachable by peers).
  std::string local_address() const { return socket_.local_address(); }

 private:
  // Sends one request and reads the reply under the mutex; on timeout the connection is
  // reset so the store stays usable.
  template <class Reply>
  Reply request(uint8_t command, const std::vector<std::string>& args, const std::string& what);
  void connect();

  std::string host_;
  int port_ = 0;
  double timeout_s_ = 300;
  uint64_t generation_ = 0;
  std::unique_ptr<TCPStoreServer> server_;
  std::mutex mutex_;
  Socket socket_;
};

// A store that lives in this process only (tests; world of one).
class LocalStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  void wait(const std::vector<std::string>& keys) override;
  bool check(const std::vector<std::string>& keys) override;
  double timeout_seconds() const override { return 1; }

 private:
  std::mutex mutex_;
  std::vector<std::pair<std::string, std::string>> values_;
  std::string* find(const std::string& key);
};

}  // namespace tessera::dist
