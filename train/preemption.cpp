#include "tessera/train/preemption.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>

#include "tessera/core/error.h"

namespace tessera::train {
namespace {

std::atomic<int> g_received{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

// Async-signal-safe: an atomic store, and for a second signal only signal() and raise().
void on_preemption_signal(int sig) {
  int none = 0;
  if (g_received.compare_exchange_strong(none, sig)) return;
  // A second signal: its default action now (the process ends as if no handler were there).
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

const std::map<std::string, int>& known_signals() {
  static const std::map<std::string, int> all = {{"TERM", SIGTERM}, {"INT", SIGINT},
                                                 {"USR1", SIGUSR1}, {"USR2", SIGUSR2},
                                                 {"HUP", SIGHUP},   {"QUIT", SIGQUIT},
                                                 {"XCPU", SIGXCPU}};
  return all;
}

}  // namespace

int preemption_signal_number(const std::string& name) {
  std::string upper = name;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (upper.rfind("SIG", 0) == 0) upper = upper.substr(3);
  const auto it = known_signals().find(upper);
  TESSERA_CHECK(it != known_signals().end(), "\"", name,
                "\" is not a signal a job is stopped with (TERM, INT, USR1, USR2, HUP, QUIT, XCPU)");
  return it->second;
}

std::string signal_name(int signal) {
  for (const auto& [name, number] : known_signals())
    if (number == signal) return "SIG" + name;
  return "signal " + std::to_string(signal);
}

PreemptionSignals::PreemptionSignals(const std::vector<int>& signals, double grace_s)
    : signals_(signals), previous_(signals.size()) {
  g_received = 0;
  struct sigaction action {};
  action.sa_handler = on_preemption_signal;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &action, &previous_[i]);
  if (grace_s > 0 && !signals_.empty()) watchdog_ = std::thread([this, grace_s] { watch(grace_s); });
}

PreemptionSignals::~PreemptionSignals() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  for (size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &previous_[i], nullptr);
}

int PreemptionSignals::received() { return g_received.load(); }

void PreemptionSignals::saved() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_ = true;
  }
  wake_.notify_all();
}

// The handler cannot start a clock, so the watchdog looks at the flag every few
// milliseconds; the grace period runs from the first look that sees it.
void PreemptionSignals::watch(double grace_s) {
  using Clock = std::chrono::steady_clock;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!finished_ && received() == 0) wake_.wait_for(lock, std::chrono::milliseconds(20));
  if (finished_) return;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_s));
  if (wake_.wait_until(lock, deadline, [this] { return finished_; })) return;
  const int sig = received();
  std::fprintf(stderr,
               "tessera train: received %s but the checkpoint was not saved within the preemption "
               "grace of %g s; exiting without it (the previous checkpoint stays the newest)\n",
               signal_name(sig).c_str(), grace_s);
  std::fflush(stderr);
  ::_exit(128 + sig);
}

}  // namespace tessera::train
