#include "tessera/train/run_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/train/checkpoint_files.h"

namespace tessera::train {

namespace fs = std::filesystem;

namespace {

// The files a run writes into its folder besides its checkpoints (run.cpp, callbacks.cpp).
constexpr const char* kRunFiles[] = {"config.train.json", "metrics.jsonl", "loss.png", "model",
                                     "tensorboard", "metrics.csv", "metrics.config.json", "mlruns"};

std::string read_holder(int fd) {
  char buffer[256] = {};
  const ssize_t n = ::pread(fd, buffer, sizeof buffer - 1, 0);
  std::string text = n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string();
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text.empty() ? "a job that has not written its pid yet" : text;
}

void write_holder(int fd) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string text = "pid " + std::to_string(::getpid()) + " on host " + host + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) < 0)
    TESSERA_FAIL("cannot write '", kRunFolderLockFile, "': ", std::strerror(errno));
}

int lock_folder(const fs::path& folder) {
  std::error_code ec;
  fs::create_directories(folder, ec);
  TESSERA_CHECK(!ec, "output_dir '", folder.string(), "': cannot create it: ", ec.message());
  const fs::path path = folder / kRunFolderLockFile;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TESSERA_CHECK(fd >= 0, "cannot open '", path.string(), "': ", std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return fd;
  const int error = errno;
  if (error == EWOULDBLOCK) {
    const std::string holder = read_holder(fd);
    ::close(fd);
    TESSERA_FAIL("output_dir '", folder.string(), "' is in use by another training job (", holder,
                 "); wait for it to end, stop it, or train into another --out");
  }
  // A file system without flock (some network mounts): train, but say nothing guards it.
  std::fprintf(stderr, "tessera train: warning: cannot lock '%s' (%s); nothing stops a second job "
               "from writing into this folder\n", path.c_str(), std::strerror(error));
  return fd;
}

// A damaged checkpoint (--resume has fallen back past it, with a warning) holds nothing to
// protect: the resumed run may write over it.
bool is_valid_checkpoint(const fs::path& dir) {
  try {
    verify_checkpoint(dir);
    return true;
  } catch (const Error&) {
    return false;
  }
}

std::string names_of(const std::vector<fs::path>& paths) {
  std::string text;
  for (const fs::path& p : paths) text += (text.empty() ? "" : ", ") + p.filename().string();
  return text;
}

// What in `folder` belongs to a run other than the checkpoint `resumed` continues.
std::vector<fs::path> conflicting_files(const fs::path& folder, const fs::path& resumed) {
  std::vector<fs::path> found;
  if (!resumed.empty() && resumed.parent_path() == folder) {  // its own files, but not checkpoints the resumed run would overwrite
    const int64_t step = checkpoint_step(resumed).value_or(INT64_MAX);
    for (const fs::path& c : list_checkpoints(folder))
      if (*checkpoint_step(c) > step && is_valid_checkpoint(c)) found.push_back(c);
    return found;
  }
  for (const char* name : kRunFiles)
    if (fs::exists(folder / name)) found.push_back(folder / name);
  for (const fs::path& c : list_checkpoints(folder)) found.push_back(c);
  return found;
}

void remove_partial_checkpoints(const fs::path& folder) {
  for (const auto& entry : fs::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".partial") && checkpoint_step(entry.path().stem())) fs::remove_all(entry.path());
  }
}

void check_contents(const TrainingArguments& args, const fs::path& folder) {
  // `--resume` that found no checkpoint yet (a restarted job's first attempt died before
  // saving one) starts afresh in the folder it was told to continue.
  if (args.resume_from_checkpoint.empty() && args.given.count("resume_from_checkpoint")) return;
  const fs::path resumed = args.resume_from_checkpoint.empty()
                               ? fs::path()
                               : fs::absolute(args.resume_from_checkpoint).lexically_normal();
  const std::vector<fs::path> conflicts = conflicting_files(folder, resumed);
  if (conflicts.empty()) return;
  if (args.overwrite_output_dir) {
    for (const fs::path& p : conflicts) fs::remove_all(p);
    return;
  }
  if (!resumed.empty() && resumed.parent_path() == folder)
    TESSERA_FAIL("--resume ", resumed.string(), ": output_dir '", folder.string(),
                 "' holds later checkpoints (", names_of(conflicts),
                 ") that continuing from step ", checkpoint_step(resumed).value_or(0),
                 " would overwrite; resume the newest one (--resume ", folder.string(),
                 "), or add --overwrite-output-dir to remove them first");
  TESSERA_FAIL("output_dir '", folder.string(), "' already holds a run (", names_of(conflicts),
               "); continue it with --resume ", folder.string(),
               ", train into another --out, or add --overwrite-output-dir to remove that run first");
}

// Locks held by this process, by folder, so the Trainer shares run_training's.
std::map<fs::path, std::weak_ptr<RunFolderLock>>& held_locks() {
  static std::map<fs::path, std::weak_ptr<RunFolderLock>> all;
  return all;
}

}  // namespace

RunFolderLock::~RunFolderLock() { ::close(fd_); }  // closing drops the flock

std::shared_ptr<RunFolderLock> claim_run_folder(const TrainingArguments& args) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> guard(mutex);
  const fs::path folder = fs::absolute(args.output_dir).lexically_normal();
  std::shared_ptr<RunFolderLock> lock = held_locks()[folder].lock();
  if (!lock) {
    const int fd = lock_folder(folder);
    lock.reset(new RunFolderLock(folder, fd));
    // Named only once the folder is known to be this run's: a refused job changes nothing.
    check_contents(args, folder);
    write_holder(fd);
    held_locks()[folder] = lock;
  } else {
    check_contents(args, folder);
  }
  remove_partial_checkpoints(folder);
  return lock;
}

}  // namespace tessera::train
