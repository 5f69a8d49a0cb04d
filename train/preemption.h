// Preemption: a cluster (SLURM, Kubernetes, a spot instance) asks a job to stop with a signal
// and kills it a little later. While Trainer::train() runs, the signals of
// TrainingArguments::preempt_signals (SIGTERM, SIGINT and SIGUSR1 by default) only raise a flag;
// the Trainer finishes the optimizer step in progress (and an evaluation or a save in
// progress), every rank agrees on that step, a checkpoint is saved collectively, and train()
// returns with preempted_by() set. `tessera train` then exits with kPreemptedExitStatus.
//
// A second signal ends the process at once (the signal's default action: 128 + signal), as
// it would without the handlers. With a grace period, a watchdog ends the process (128 +
// signal) when the save has not finished that many seconds after the first signal; the
// checkpoint being written is then only a checkpoint-N.partial/ folder, which no load ever
// takes for a checkpoint.
#pragma once
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessera/dist/launcher.h"

namespace tessera::train {

// The exit status of a run stopped by a preemption signal after saving its checkpoint
// (sysexits' EX_TEMPFAIL: try again later); `tessera launch` passes it on when every rank
// exited with it.
inline constexpr int kPreemptedExitStatus = dist::kPreemptedExitStatus;

// "TERM", "SIGTERM", "term" -> SIGTERM; the signals a job can be asked to stop with
// (TERM, INT, USR1, USR2, HUP, QUIT, XCPU). Anything else is an error naming it.
int preemption_signal_number(const std::string& name);
std::string signal_name(int signal);  // "SIGTERM"

// Installs the handlers for its lifetime and restores the previous ones afterwards. One at a
// time per process (the flag is process-wide).
class PreemptionSignals {
 public:
  // `grace_s` > 0 starts the watchdog described above.
  PreemptionSignals(const std::vector<int>& signals, double grace_s);
  ~PreemptionSignals();
  PreemptionSignals(const PreemptionSignals&) = delete;
  PreemptionSignals& operator=(const PreemptionSignals&) = delete;

  // The first signal received since construction, 0 when none.
  static int received();
  // The checkpoint is on disk: the watchdog stands down.
  void saved();

 private:
  void watch(double grace_s);

  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool finished_ = false;  // saved() or destruction
  std::thread watchdog_;
};

}  // namespace tessera::train
