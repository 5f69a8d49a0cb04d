#include "tessera/dist/watchdog.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <tuple>

#include "tessera/core/settings.h"
#include "tessera/dist/env.h"
#include "tessera/dist/process_group.h"
#include "tessera/dist/store.h"

namespace tessera::dist {

int64_t wall_clock_ms() {
  using namespace std::chrono;
  return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

std::string CollectivePosition::str() const {
  return collective + " #" + std::to_string(sequence);
}

// ---- the process's positions ----
namespace {
struct PositionTable {
  std::mutex mutex;
  std::map<std::string, CollectivePosition> by_group;
};
// Never destroyed: a watchdog thread may still read it while statics are torn down.
PositionTable& positions() {
  static auto* table = new PositionTable;
  return *table;
}
}  // namespace

TrackedCollective::TrackedCollective(const std::string& group, const CollectiveSignature& sig)
    : group_(group) {
  CollectivePosition p;
  p.group = group;
  p.collective = collective_kind_name(static_cast<CollectiveKind>(sig.kind));
  p.sequence = sig.sequence;
  p.bytes = sig.numel * static_cast<int64_t>(dtype_size(static_cast<DType>(sig.dtype)));
  p.in_flight = true;
  p.since_ms = wall_clock_ms();
  std::lock_guard<std::mutex> lock(positions().mutex);
  positions().by_group[group] = std::move(p);
}

TrackedCollective::~TrackedCollective() {
  std::lock_guard<std::mutex> lock(positions().mutex);
  CollectivePosition& p = positions().by_group[group_];
  p.in_flight = false;
  p.since_ms = wall_clock_ms();
}

std::vector<CollectivePosition> collective_positions() {
  std::lock_guard<std::mutex> lock(positions().mutex);
  std::vector<CollectivePosition> all;
  for (const auto& [group, p] : positions().by_group) all.push_back(p);
  return all;
}

// ---- heartbeats ----
// One line "pid host beat wall_ms", then one line per group, fields tab-separated (group
// names and hosts hold no tabs or newlines).
std::string Heartbeat::encode() const {
  std::ostringstream os;
  os << pid << '\t' << host << '\t' << beat << '\t' << wall_ms << '\n';
  for (const CollectivePosition& p : positions)
    os << p.group << '\t' << p.collective << '\t' << p.sequence << '\t' << p.bytes << '\t'
       << (p.in_flight ? 1 : 0) << '\t' << p.since_ms << '\n';
  return os.str();
}

std::optional<Heartbeat> Heartbeat::decode(const std::string& text) {
  std::istringstream lines(text);
  std::string line;
  Heartbeat h;
  if (!std::getline(lines, line)) return std::nullopt;
  std::istringstream head(line);
  if (!(head >> h.pid >> h.host >> h.beat >> h.wall_ms)) return std::nullopt;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    CollectivePosition p;
    int in_flight = 0;
    if (!std::getline(fields, p.group, '\t') || !std::getline(fields, p.collective, '\t') ||
        !(fields >> p.sequence >> p.bytes >> in_flight >> p.since_ms))
      return std::nullopt;
    p.in_flight = in_flight != 0;
    h.positions.push_back(std::move(p));
  }
  return h;
}

const CollectivePosition* Heartbeat::position_in(const std::string& group) const {
  for (const CollectivePosition& p : positions)
    if (p.group == group) return &p;
  return nullptr;
}

const CollectivePosition* Heartbeat::oldest_in_flight() const {
  const CollectivePosition* oldest = nullptr;
  for (const CollectivePosition& p : positions)
    if (p.in_flight && (!oldest || p.since_ms < oldest->since_ms)) oldest = &p;
  return oldest;
}

// ---- the report ----
namespace {
long seconds_between(int64_t from_ms, int64_t to_ms) {
  return std::lround(std::max<int64_t>(0, to_ms - from_ms) / 1000.0);
}

// "0,2-5,9"
std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    text += (text.empty() ? "" : ",") + std::to_string(ranks[i]);
    if (j > i) text += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return text;
}

// One rank's line of a report, and the words shared by ranks in the same place (for the
// grouped form of large jobs).
struct RankLine {
  int rank;
  std::string place;
  std::string line;
};

class HangReport {
 public:
  HangReport(const CollectivePosition& stuck, int64_t now_ms, double stale_after_s)
      : stuck_(stuck), now_ms_(now_ms), stale_after_ms_(stale_after_s * 1000) {}

  // Sorts rank `r` into the ranks holding the job up or the others.
  void add(int r, const std::optional<Heartbeat>& h) {
    if (!h) {
      culprits_.push_back({r, "no heartbeat", detail::concat("rank ", r,
                                                             " has published no heartbeat (did "
                                                             "it start, and reach the store?)")});
      return;
    }
    const std::string who = detail::concat("rank ", r, " (pid ", h->pid, ", host ", h->host, ")");
    const CollectivePosition* here = h->position_in(stuck_.group);
    const bool reached = here && here->sequence >= stuck_.sequence;
    const bool stale = now_ms_ - h->wall_ms > stale_after_ms_;
    const long beat_age = seconds_between(h->wall_ms, now_ms_);
    if (reached && here->sequence == stuck_.sequence && here->in_flight && !stale)
      longest_wait_ms_ = std::max(longest_wait_ms_, now_ms_ - here->since_ms);
    if (!reached) {
      const std::string rest =
          stale ? detail::concat("rank ", r, "'s last heartbeat ", beat_age, " s ago ",
                                 where(here))
                : detail::concat("its heartbeat is alive (", beat_age, " s ago) ", where(here),
                                 ": it is busy outside the collectives", elsewhere(*h));
      pending_.push_back({r, rest, who});
    } else if (stale) {
      culprits_.push_back({r, "heartbeat stopped in " + stuck_.str(),
                           detail::concat(who, " is in ", here->str(), " but its heartbeat stopped ",
                                          beat_age, " s ago (the process is stopped or hung)")});
    } else {
      others_.push_back({r, place(*h), detail::concat(who, ": ", place(*h), timing(*h))});
    }
  }

  std::string str() {
    // "Others waiting there" is known once every rank is in.
    const long waited = std::lround(longest_wait_ms_ / 1000.0);
    for (const auto& [r, rest, who] : pending_)
      culprits_.push_back({r, "has not reached " + stuck_.str(),
                           detail::concat(who, " has not reached ", stuck_.str(),
                                          " (others waiting there for ", waited, " s); ", rest)});
    std::sort(culprits_.begin(), culprits_.end(),
              [](const RankLine& a, const RankLine& b) { return a.rank < b.rank; });
    std::string text;
    append(text, culprits_);
    append(text, others_);
    return text;
  }

 private:
  std::string where(const CollectivePosition* p) const {
    if (!p) return "before its first collective of group '" + stuck_.group + "'";
    return (p->in_flight ? "in " : "at ") + p->str();
  }
  std::string elsewhere(const Heartbeat& h) const {
    const CollectivePosition* p = h.oldest_in_flight();
    if (!p || p->group == stuck_.group) return "";
    return detail::concat(" (it waits in ", p->str(), " of group '", p->group, "' for ",
                          seconds_between(p->since_ms, now_ms_), " s)");
  }
  std::string place(const Heartbeat& h) const {
    const CollectivePosition* p = h.oldest_in_flight();
    if (!p) p = h.position_in(stuck_.group);
    const std::string group = p->group == stuck_.group ? "" : " of group '" + p->group + "'";
    return (p->in_flight ? "waiting in " : "in no collective, at ") + p->str() + group;
  }
  std::string timing(const Heartbeat& h) const {
    const CollectivePosition* p = h.oldest_in_flight();
    const std::string waited =
        p ? detail::concat(" for ", seconds_between(p->since_ms, now_ms_), " s (", p->bytes,
                           " bytes)")
          : "";
    return detail::concat(waited, "; heartbeat ", seconds_between(h.wall_ms, now_ms_), " s ago");
  }

  // Each rank on its own line, or, past a screenful, one line per place.
  static void append(std::string& text, const std::vector<RankLine>& lines) {
    constexpr size_t kLinesPerRank = 16;
    if (lines.size() <= kLinesPerRank) {
      for (const RankLine& l : lines) text += "  " + l.line + "\n";
      return;
    }
    std::vector<std::pair<std::string, std::vector<int>>> places;
    for (const RankLine& l : lines) {
      auto it = std::find_if(places.begin(), places.end(),
                             [&](const auto& p) { return p.first == l.place; });
      if (it == places.end()) places.push_back({l.place, {l.rank}});
      else it->second.push_back(l.rank);
    }
    for (const auto& [place, ranks] : places)
      text += "  rank" + std::string(ranks.size() > 1 ? "s " : " ") + rank_list(ranks) + ": " +
              place + "\n";
  }

  const CollectivePosition& stuck_;
  int64_t now_ms_;
  double stale_after_ms_;
  int64_t longest_wait_ms_ = 0;
  std::vector<RankLine> culprits_, others_;
  std::vector<std::tuple<int, std::string, std::string>> pending_;  // rank, rest, who
};
}  // namespace

std::string hang_report(int reporter, const CollectivePosition& stuck,
                        const std::vector<std::optional<Heartbeat>>& heartbeats, int64_t now_ms,
                        double stale_after_s, double watchdog_timeout_s) {
  HangReport report(stuck, now_ms, stale_after_s);
  for (int r = 0; r < static_cast<int>(heartbeats.size()); ++r) report.add(r, heartbeats[r]);
  return detail::concat("tessera watchdog: rank ", reporter, " has waited ",
                        seconds_between(stuck.since_ms, now_ms), " s in ", stuck.str(),
                        " of group '", stuck.group, "' (", stuck.bytes,
                        " bytes; watchdog timeout ", watchdog_timeout_s, " s)\n", report.str());
}

// ---- options ----
WatchdogOptions WatchdogOptions::from_env() {
  WatchdogOptions o;
  o.timeout_s = setting_number(Setting::WatchdogTimeout);
  o.end_job = setting_text(Setting::WatchdogAction) == "end";
  return o;
}

double WatchdogOptions::heartbeat_interval_s() const {
  return std::clamp(timeout_s / 5, 0.2, 5.0);
}

// ---- the thread ----
namespace {
std::string heartbeat_key(int rank) { return "tessera/heartbeat/" + std::to_string(rank); }

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || !name[0]) return "?";
  return name;
}

// One write, so that the report does not interleave with other output of the process.
void print(const std::string& text) {
  std::fputs(text.c_str(), stderr);
  std::fflush(stderr);
}
}  // namespace

Watchdog::Watchdog(WatchdogOptions options, int rank, int world_size, std::string master_addr,
                   int master_port, uint64_t generation)
    : options_(options),
      rank_(rank),
      world_size_(world_size),
      master_addr_(std::move(master_addr)),
      master_port_(master_port),
      generation_(generation),
      host_(this_host()),
      thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Watchdog::run() {
  const auto interval = std::chrono::duration<double>(options_.heartbeat_interval_s());
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    try {
      tick();
    } catch (const std::exception&) {
      // The watchdog must never take a healthy job down; a failed beat is retried.
    }
    lock.lock();
    wake_.wait_for(lock, interval, [&] { return stop_; });
  }
}

void Watchdog::tick() {
  Heartbeat mine;
  mine.pid = ::getpid();
  mine.host = host_;
  mine.beat = ++beat_;
  mine.wall_ms = wall_clock_ms();
  mine.positions = collective_positions();
  const bool store_answers = publish(mine);
  const CollectivePosition* stuck = mine.oldest_in_flight();
  if (stuck && mine.wall_ms - stuck->since_ms >= options_.timeout_s * 1000)
    on_hang(mine, *stuck, store_answers);
}

// Writes this rank's heartbeat and reads rank 0's (named when its store goes silent).
bool Watchdog::publish(const Heartbeat& mine) {
  try {
    if (!store_) {
      const double timeout = std::max(1.0, options_.heartbeat_interval_s());
      store_ = std::make_unique<TCPStore>(master_addr_, master_port_, false, timeout, generation_);
    }
    store_->set(heartbeat_key(rank_), mine.encode());
    if (rank_ != 0 && store_->check({heartbeat_key(0)}))
      if (auto h = Heartbeat::decode(store_->get(heartbeat_key(0)))) rank0_ = std::move(h);
    store_silent_since_ms_.reset();
    return true;
  } catch (const std::exception&) {
    store_.reset();  // connect afresh next time
    if (!store_silent_since_ms_) store_silent_since_ms_ = mine.wall_ms;
    return false;
  }
}

std::vector<std::optional<Heartbeat>> Watchdog::read_heartbeats(const Heartbeat& mine) {
  std::vector<std::optional<Heartbeat>> all(world_size_);
  all[rank_] = mine;
  try {
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_ && store_->check({heartbeat_key(r)}))
        all[r] = Heartbeat::decode(store_->get(heartbeat_key(r)));
  } catch (const std::exception&) {
    // The ranks not read yet are reported without a heartbeat.
  }
  return all;
}

std::string Watchdog::store_silent_report(const CollectivePosition& stuck, int64_t now_ms) const {
  const int64_t silent_since = store_silent_since_ms_.value_or(now_ms);
  std::string rank0 = "rank 0 (its heartbeat was never read)";
  if (rank0_) {
    const CollectivePosition* p = rank0_->position_in(stuck.group);
    rank0 = detail::concat("rank 0 (pid ", rank0_->pid, ", host ", rank0_->host,
                           ") does not answer; rank 0's last heartbeat ",
                           seconds_between(rank0_->wall_ms, now_ms), " s ago ",
                           p ? (p->in_flight ? "in " : "at ") + p->str() : "before any collective",
                           " (the process is stopped, hung or gone)");
  }
  return detail::concat("tessera watchdog: rank ", rank_, " has waited ",
                        seconds_between(stuck.since_ms, now_ms), " s in ", stuck.str(),
                        " of group '", stuck.group, "' (", stuck.bytes, " bytes; watchdog timeout ",
                        options_.timeout_s, " s), and the rendezvous store at ", master_addr_, ":",
                        master_port_, ", which rank 0 serves, has not answered for ",
                        seconds_between(silent_since, now_ms), " s\n  ", rank0, "\n");
}

void Watchdog::on_hang(const Heartbeat& mine, const CollectivePosition& stuck,
                       bool store_answers) {
  const std::string hang = stuck.group + "#" + std::to_string(stuck.sequence);
  // A job ends only when a rank is silent (stopped, hung in the kernel, gone): a rank whose
  // heartbeat is alive is busy outside the collective (a long save, evaluation on one rank),
  // so the report is printed and the wait goes on, bounded by the collective timeout.
  const double stale_after_s = std::max(2.0, 3 * options_.heartbeat_interval_s());
  std::vector<std::optional<Heartbeat>> beats;
  if (store_answers) beats = read_heartbeats(mine);
  const int64_t now_ms = wall_clock_ms();
  const bool a_rank_is_silent =
      !store_answers || std::any_of(beats.begin(), beats.end(), [&](const auto& h) {
        return !h || now_ms - h->wall_ms > stale_after_s * 1000;
      });
  const bool end_job = options_.end_job && a_rank_is_silent;
  const std::string ending =
      end_job
          ? "tessera watchdog: ending the job (TESSERA_WATCHDOG_TIMEOUT or `tessera launch "
            "--watchdog-timeout` sets the timeout, 0 turns it off; TESSERA_WATCHDOG_ACTION=report "
            "only reports)\n"
          : options_.end_job
              ? "tessera watchdog: every rank's heartbeat is alive, so the ranks not here are busy "
                "outside the collective: waiting on (TESSERA_COLLECTIVE_TIMEOUT bounds the wait)\n"
              : "tessera watchdog: waiting on (TESSERA_COLLECTIVE_TIMEOUT bounds the wait)\n";
  auto end_process = [&] {
    if (!end_job) return;
    std::fflush(stdout);
    std::_Exit(1);  // the launcher takes the other ranks down
  };
  if (handled_ == hang) {
    // Another rank claimed the report: its process ends, and the launcher the job. Without
    // a launcher that does, this rank ends itself a timeout later.
    if (end_job && mine.wall_ms - handled_at_ms_ >= options_.timeout_s * 1000) {
      print(detail::concat("tessera watchdog: rank ", rank_, " still waits in ", stuck.str(),
                           " after another rank reported the hang; ending this process\n"));
      end_process();
    }
    return;
  }
  if (!store_answers) {
    handled_ = hang;
    print(store_silent_report(stuck, mine.wall_ms) + ending);
    end_process();
    return;
  }
  int64_t claims = 0;
  try {
    claims = store_->add("tessera/watchdog/claimed/" + hang, 1);
  } catch (const std::exception&) {
    store_.reset();  // the next beat finds the store silent and says so
    store_silent_since_ms_ = mine.wall_ms;
    return;
  }
  handled_ = hang;
  handled_at_ms_ = mine.wall_ms;
  if (claims != 1) return;  // another waiting rank reports
  print(hang_report(rank_, stuck, beats, now_ms, stale_after_s, options_.timeout_s) + ending);
  end_process();
}

}  // namespace tessera::dist
