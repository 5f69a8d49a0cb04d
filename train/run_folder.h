// One writer per run folder. A training job holds an advisory lock (flock) on
// output_dir/.tessera.lock for its whole life, with its pid and host written into the file;
// the kernel drops the lock when the job ends in any way (also kill -9), so a lock is never
// stale. A second job on the folder is refused before any work, naming the holder.
//
// A folder that already holds a run (its settings, metrics, checkpoints, final model) is
// not trained into by a new run unless overwrite_output_dir (Hugging Face's name) is set,
// which removes that run's files first. A resumed run may continue in its own folder, but not
// over checkpoints later than the one it resumes (they would be overwritten or mixed with
// the new ones) unless overwrite_output_dir removes them first.
#pragma once
#include <filesystem>
#include <memory>

#include "tessera/train/training_args.h"

namespace tessera::train {

inline constexpr const char* kRunFolderLockFile = ".tessera.lock";

class RunFolderLock {
 public:
  ~RunFolderLock();
  RunFolderLock(const RunFolderLock&) = delete;
  RunFolderLock& operator=(const RunFolderLock&) = delete;
  const std::filesystem::path& folder() const { return folder_; }

 private:
  friend std::shared_ptr<RunFolderLock> claim_run_folder(const TrainingArguments& args);
  RunFolderLock(std::filesystem::path folder, int fd) : folder_(std::move(folder)), fd_(fd) {}
  std::filesystem::path folder_;
  int fd_;
};

// Locks output_dir (creating it), checks what it holds against the run (see above) and, with
// overwrite_output_dir, removes what is in the way; leftover checkpoint-N.partial/ folders of
// an interrupted save are removed too. Within one process the folder's lock is shared: the
// Trainer that `tessera train` builds takes the lock run_training already holds. Errors name
// the folder, the holder (pid and host) or the files in the way, and how to proceed.
std::shared_ptr<RunFolderLock> claim_run_folder(const TrainingArguments& args);

}  // namespace tessera::train
