// The hang watchdog: names the rank a job is waiting for.
//
// Every rank of a job with a rendezvous store runs a background thread that writes a
// heartbeat into the store every few seconds: its pid and host, and where it is in the
// collectives of each of its groups (the one it is in, or the last one it finished: name,
// sequence number, bytes). A thread of its own keeps beating while the rank computes; it
// stops when the process is stopped (SIGSTOP), dies, or its host goes away.
//
// When a rank has waited in one collective longer than the watchdog timeout
// (TESSERA_WATCHDOG_TIMEOUT, default 60 s; `tessera launch --watchdog-timeout`), one of the
// waiting ranks (the first to claim it in the store) reads every rank's heartbeat and prints
// which ranks have not reached that collective, since when their heartbeat is silent, and
// where every other rank is. When a rank is silent (stopped, gone) it then ends its process
// (status 1), so the launcher takes the job down; when every heartbeat is alive (a rank busy
// outside the collectives) it only reports and waits on, up to the collective timeout, as
// TESSERA_WATCHDOG_ACTION=report (`--watchdog-action report`) always does. When the store itself
// stops answering (it lives in rank 0), the report names rank 0 with its last heartbeat.
//
// The host backends record their collectives here; the watchdog runs where the job also has
// a rendezvous store (tcp). Under mpi (no store) and NCCL (collectives on the device) the
// collective timeout alone bounds a hang.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace tessera::dist {

struct CollectiveSignature;
class TCPStore;

// Milliseconds since the epoch: heartbeats of several hosts are compared on it, so their
// clocks are assumed to agree (NTP) for the ages a report gives.
int64_t wall_clock_ms();

// ---- where this process is in its collectives ----

struct CollectivePosition {
  std::string group;       // "world", "world/sub0"
  std::string collective;  // "all_reduce"
  uint64_t sequence = 0;
  int64_t bytes = 0;       // this rank's payload
  bool in_flight = false;  // begun and not finished; else the last finished one
  int64_t since_ms = 0;    // wall_clock_ms() when it began (in flight) or finished
  std::string str() const;  // "all_reduce #57"
};

// Marks a collective of `group` as running on this process from construction to
// destruction (the host backends' worker wraps each collective in one).
class TrackedCollective {
 public:
  TrackedCollective(const std::string& group, const CollectiveSignature& signature);
  ~TrackedCollective();
  TrackedCollective(const TrackedCollective&) = delete;
  TrackedCollective& operator=(const TrackedCollective&) = delete;

 private:
  std::string group_;
};

// The latest position of every group this process has run a collective in.
std::vector<CollectivePosition> collective_positions();

// ---- heartbeats and the report ----

struct Heartbeat {
  int64_t pid = 0;
  std::string host;
  uint64_t beat = 0;     // counts up with every heartbeat
  int64_t wall_ms = 0;   // when it was written
  std::vector<CollectivePosition> positions;

  std::string encode() const;
  // Null when `text` is not a heartbeat (a corrupt or foreign key).
  static std::optional<Heartbeat> decode(const std::string& text);
  const CollectivePosition* position_in(const std::string& group) const;
  const CollectivePosition* oldest_in_flight() const;
};

// What `reporter` tells about the collective it has waited in (`stuck`), given every rank's
// latest heartbeat (index = rank; null where none was found) at `now_ms`: first the ranks
// that have not reached it or whose heartbeat is older than `stale_after_s`, then where
// every other rank is. One line per rank, or per group of ranks in the same place when
// there are many.
std::string hang_report(int reporter, const CollectivePosition& stuck,
                        const std::vector<std::optional<Heartbeat>>& heartbeats, int64_t now_ms,
                        double stale_after_s, double watchdog_timeout_s);

// ---- the watchdog thread ----

struct WatchdogOptions {
  double timeout_s = 60;     // a wait in one collective longer than this is a hang; 0: off
  bool end_job = true;       // false: report and keep waiting
  // From TESSERA_WATCHDOG_TIMEOUT (seconds, 0 turns it off) and TESSERA_WATCHDOG_ACTION
  // (end | report).
  static WatchdogOptions from_env();
  double heartbeat_interval_s() const;  // a fifth of the timeout, between 0.2 s and 5 s
};

class Watchdog {
 public:
  // Beats into the store served at master_addr:master_port (of `generation`), over a
  // connection of its own with short timeouts, so a silent store is noticed within seconds.
  Watchdog(WatchdogOptions options, int rank, int world_size, std::string master_addr,
           int master_port, uint64_t generation);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  void run();
  void tick();
  bool publish(const Heartbeat& mine);
  void on_hang(const Heartbeat& mine, const CollectivePosition& stuck, bool store_answers);
  std::vector<std::optional<Heartbeat>> read_heartbeats(const Heartbeat& mine);
  std::string store_silent_report(const CollectivePosition& stuck, int64_t now_ms) const;

  WatchdogOptions options_;
  int rank_;
  int world_size_;
  std::string master_addr_;
  int master_port_;
  uint64_t generation_;
  std::string host_;
  std::unique_ptr<TCPStore> store_;  // the watchdog thread's own connection
  uint64_t beat_ = 0;
  std::optional<int64_t> store_silent_since_ms_;
  std::optional<Heartbeat> rank0_;  // rank 0's latest heartbeat, for when its store goes silent
  std::string handled_;             // the hang already reported or claimed ("world#57")
  int64_t handled_at_ms_ = 0;

  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tessera::dist
