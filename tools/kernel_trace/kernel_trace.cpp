// libtessera_kernel_trace.so: a CUDA injection library that records every kernel, memcpy
// and memset of any CUDA program through CUPTI's activity API and writes a Chrome/Perfetto
// trace and a text summary when the program exits (docs/profiling.md).
//
//   CUDA_INJECTION64_PATH=/path/libtessera_kernel_trace.so TESSERA_KERNEL_TRACE=out <program>
//
// The CUDA driver loads the library and calls InitializeInjection inside cuInit, before the
// program has created any stream or graph, so kernel nodes of CUDA graphs are traced too.
// The tracer must never take the traced program down: every CUPTI failure is reported once
// on stderr and the program goes on (untraced, when tracing could not start).
#include <cupti.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

#include "trace_analysis.h"

namespace tessera::kernel_trace {
namespace {

constexpr size_t kBufferBytes = 8u << 20;
constexpr uint64_t kDefaultRecordLimit = 2'000'000;  // about 200 MB of records

struct TracerState {
  std::mutex mutex;
  Trace trace;
  std::unordered_map<std::string, uint32_t> name_ids;
  TraceWindow window;
  uint64_t record_limit = kDefaultRecordLimit;
  uint64_t records_seen = 0;  // inside and outside the window
  std::string stem;           // output path without ".json" / ".summary.txt"
  pid_t pid = 0;              // the process that started tracing (a forked child writes nothing)
  std::set<std::string> reported_calls;
};

// Never destroyed: the CUPTI worker thread may still deliver buffers while static
// destructors run.
TracerState& state() {
  static TracerState* tracer = new TracerState;
  return *tracer;
}

void warn(const std::string& message) {
  std::fprintf(stderr, "tessera_kernel_trace: %s\n", message.c_str());
}

// True when the call succeeded; otherwise says so on stderr, once per call name.
bool check(CUptiResult result, const char* call) {
  if (result == CUPTI_SUCCESS) return true;
  const char* text = "unknown error";
  cuptiGetResultString(result, &text);
  TracerState& tracer = state();
  std::lock_guard<std::mutex> lock(tracer.mutex);
  if (tracer.reported_calls.insert(call).second)
    warn(std::string(call) + " failed: " + text + " (the program continues)");
  return false;
}

uint32_t name_id(TracerState& tracer, const char* name) {
  auto [it, inserted] = tracer.name_ids.try_emplace(
      name != nullptr ? name : "<unnamed>", static_cast<uint32_t>(tracer.trace.names.size()));
  if (inserted) tracer.trace.names.push_back(it->first);
  return it->second;
}

const char* memcpy_kind_name(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "memcpy PtoP";
    default:
      return "memcpy (array)";
  }
}

// The blocking synchronisation calls; nullptr for cudaStreamWaitEvent, which only orders
// streams on the device and never blocks the host.
const char* synchronization_name(CUpti_ActivitySynchronizationType type) {
  switch (type) {
    case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_EVENT_SYNCHRONIZE:
      return "cudaEventSynchronize";
    case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_STREAM_SYNCHRONIZE:
      return "cudaStreamSynchronize";
    case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_CONTEXT_SYNCHRONIZE:
      return "cudaDeviceSynchronize";
    case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_STREAM_WAIT_EVENT:
      return nullptr;
    default:
      return "synchronize (unknown kind)";
  }
}

// A copy or memset record (CUPTI's memcpy, peer-to-peer memcpy and memset records name these
// fields alike).
template <class Record>
Activity memory_activity(ActivityKind kind, const Record& r, uint32_t name) {
  Activity out{kind, r.deviceId, r.streamId, r.start, r.end, name, r.correlationId, r.graphId};
  out.bytes = r.bytes;
  return out;
}

// Converts one CUPTI record; false for kinds the tracer does not keep.
bool to_activity(TracerState& tracer, const CUpti_Activity* record, Activity& out) {
  switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL: {
      const auto* kernel = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      out = Activity{ActivityKind::kernel,  kernel->deviceId, kernel->streamId,
                     kernel->start,         kernel->end,      name_id(tracer, kernel->name),
                     kernel->correlationId, kernel->graphId};
      out.graph_node_id = kernel->graphNodeId;
      out.grid[0] = kernel->gridX, out.grid[1] = kernel->gridY, out.grid[2] = kernel->gridZ;
      out.block[0] = kernel->blockX, out.block[1] = kernel->blockY, out.block[2] = kernel->blockZ;
      out.registers = kernel->registersPerThread;
      out.static_shared_bytes = static_cast<uint32_t>(kernel->staticSharedMemory);
      out.dynamic_shared_bytes = static_cast<uint32_t>(kernel->dynamicSharedMemory);
      return true;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto* copy = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      out = memory_activity(ActivityKind::memcpy, *copy,
                            name_id(tracer, memcpy_kind_name(copy->copyKind)));
      return true;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY2: {
      const auto* copy = reinterpret_cast<const CUpti_ActivityMemcpyPtoP4*>(record);
      out = memory_activity(ActivityKind::memcpy, *copy, name_id(tracer, "memcpy PtoP"));
      return true;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const auto* set = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      out = memory_activity(ActivityKind::memset, *set, name_id(tracer, "memset"));
      return true;
    }
    case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
      const auto* sync = reinterpret_cast<const CUpti_ActivitySynchronization2*>(record);
      const char* name = synchronization_name(sync->type);
      if (name == nullptr) return false;
      out = Activity{
          ActivityKind::synchronization, kHostTrack,         sync->streamId, sync->start, sync->end,
          name_id(tracer, name),         sync->correlationId};
      return true;
    }
    default:
      return false;
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;  // no buffer: CUPTI drops and counts records
  *max_records = 0;
}

// Keeps the records of one completed buffer that fall in the window, up to the limit.
void take_records(TracerState& tracer, uint8_t* buffer, size_t valid_bytes) {
  std::lock_guard<std::mutex> lock(tracer.mutex);
  CUpti_Activity* record = nullptr;
  Activity activity;
  while (cuptiActivityGetNextRecord(buffer, valid_bytes, &record) == CUPTI_SUCCESS) {
    if (!to_activity(tracer, record, activity)) continue;
    tracer.records_seen += 1;
    if (activity.start_ns == 0 || activity.end_ns < activity.start_ns) {
      tracer.trace.without_times += 1;
    } else if (!tracer.window.contains(activity.start_ns)) {
      tracer.trace.outside_window += 1;
    } else if (tracer.trace.activities.size() >= tracer.record_limit) {
      tracer.trace.over_capacity += 1;
    } else {
      tracer.trace.activities.push_back(activity);
    }
  }
}

// Called on CUPTI's thread (or inside cuptiActivityFlushAll): nothing may escape into CUPTI.
void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t,
                               size_t valid_bytes) {
  if (buffer == nullptr) return;
  TracerState& tracer = state();
  try {
    take_records(tracer, buffer, valid_bytes);
  } catch (const std::exception& error) {  // out of memory: stop keeping records
    static std::atomic<bool> reported{false};
    if (!reported.exchange(true))
      warn(std::string("cannot keep more records (") + error.what() +
           "); lower TESSERA_KERNEL_TRACE_MAX_RECORDS or the window");
    std::lock_guard<std::mutex> lock(tracer.mutex);
    tracer.record_limit = tracer.trace.activities.size();
  }
  size_t dropped = 0;
  if (check(cuptiActivityGetNumDroppedRecords(context, stream, &dropped),
            "cuptiActivityGetNumDroppedRecords") &&
      dropped > 0) {
    std::lock_guard<std::mutex> lock(tracer.mutex);
    tracer.trace.dropped_by_cupti += dropped;
  }
  std::free(buffer);
}

void write_files(TracerState& tracer) {
  std::lock_guard<std::mutex> lock(tracer.mutex);
  if (tracer.records_seen == 0) {
    // Processes that only initialise CUDA (compile workers, launchers) leave no files
    // that could overwrite those of the rank that shares their RANK.
    warn(tracer.trace.process_label + ": no GPU activity recorded, no files written");
    return;
  }
  std::string error;
  const std::string json_path = tracer.stem + ".json";
  const std::string summary_path = tracer.stem + ".summary.txt";
  const Trace& trace = tracer.trace;
  if (!write_file_atomically(
          json_path, [&](std::ostream& os) { write_chrome_trace(os, trace); }, &error) ||
      !write_file_atomically(
          summary_path, [&](std::ostream& os) { write_summary(os, trace); }, &error)) {
    warn(error);
    return;
  }
  warn(trace.process_label + ": " + std::to_string(trace.activities.size()) +
       " activities written to " + json_path + " and " + summary_path);
}

void write_at_exit() {
  TracerState& tracer = state();
  if (::getpid() != tracer.pid) return;  // a forked child: the parent writes the trace
  check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  try {
    write_files(tracer);
  } catch (const std::exception& error) {
    warn(std::string("writing the trace failed: ") + error.what());
  }
}

// Reads TESSERA_KERNEL_TRACE_START_S / _SECONDS / _MAX_RECORDS; a bad value is reported and
// ignored (the whole run is traced) rather than stopping the program.
void read_limits(TracerState& tracer) {
  std::string error;
  if (const char* text = std::getenv("TESSERA_KERNEL_TRACE_START_S")) {
    if (auto start = parse_seconds(text, &error)) {
      tracer.trace.window_start_s = start;
      tracer.window.begin_ns = tracer.trace.init_ns + static_cast<uint64_t>(*start * 1e9);
    } else {
      warn("TESSERA_KERNEL_TRACE_START_S " + error + "; ignored");
    }
  }
  if (const char* text = std::getenv("TESSERA_KERNEL_TRACE_SECONDS")) {
    if (auto seconds = parse_seconds(text, &error)) {
      tracer.trace.window_seconds = seconds;
      const uint64_t begin = std::max(tracer.window.begin_ns, tracer.trace.init_ns);
      tracer.window.end_ns = begin + static_cast<uint64_t>(*seconds * 1e9);
    } else {
      warn("TESSERA_KERNEL_TRACE_SECONDS " + error + "; ignored");
    }
  }
  if (const char* text = std::getenv("TESSERA_KERNEL_TRACE_MAX_RECORDS")) {
    char* end = nullptr;
    const unsigned long long limit = std::strtoull(text, &end, 10);
    if (end != text && *end == '\0' && limit > 0)
      tracer.record_limit = limit;
    else
      warn(std::string("TESSERA_KERNEL_TRACE_MAX_RECORDS='") + text +
           "' is not a positive integer; ignored");
  }
}

// Starts tracing; false (with the reason on stderr) leaves the program untraced.
bool start_tracing() {
  const char* prefix = std::getenv("TESSERA_KERNEL_TRACE");
  if (prefix == nullptr || *prefix == '\0') {
    warn("TESSERA_KERNEL_TRACE (the output prefix) is not set; not tracing");
    return false;
  }
  TracerState& tracer = state();
  tracer.pid = ::getpid();
  std::string warning;
  // Absolute now: the program may change its working folder before it exits.
  std::error_code ignored;
  const std::filesystem::path absolute_prefix = std::filesystem::absolute(prefix, ignored);
  tracer.stem =
      output_stem(absolute_prefix.empty() ? prefix : absolute_prefix.string(), std::getenv("RANK"),
                  std::getenv("LOCAL_RANK"), tracer.pid, &tracer.trace.rank, &warning);
  if (!warning.empty()) warn(warning);
  const std::filesystem::path folder = std::filesystem::path(tracer.stem).parent_path();
  if (::access(folder.empty() ? "." : folder.c_str(), W_OK) != 0)
    warn("cannot write into " + folder.string() + " (from TESSERA_KERNEL_TRACE=" + prefix +
         "); the trace will be lost unless it becomes writable before the program exits");
  tracer.trace.process_label = tracer.trace.rank >= 0 ? "rank " + std::to_string(tracer.trace.rank)
                                                      : "pid " + std::to_string(tracer.pid);
  if (!check(cuptiGetTimestamp(&tracer.trace.init_ns), "cuptiGetTimestamp")) return false;
  read_limits(tracer);
  if (!check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
             "cuptiActivityRegisterCallbacks"))
    return false;
  // CONCURRENT_KERNEL (not KERNEL, which serialises kernels) also reports every kernel node
  // of a replayed CUDA graph, with its graph id.
  if (!check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
             "cuptiActivityEnable(CONCURRENT_KERNEL)"))
    return false;
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "cuptiActivityEnable(MEMCPY)");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY2), "cuptiActivityEnable(MEMCPY2)");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "cuptiActivityEnable(MEMSET)");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_SYNCHRONIZATION),
        "cuptiActivityEnable(SYNCHRONIZATION)");
  if (std::atexit(write_at_exit) != 0) {
    warn("atexit failed; not tracing");
    check(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityDisable");
    return false;
  }
  return true;
}

}  // namespace
}  // namespace tessera::kernel_trace

// Called by the CUDA driver (CUDA_INJECTION64_PATH) from cuInit; 1 tells it to go on.
extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  static std::atomic<bool> initialised{false};
  if (initialised.exchange(true)) return 1;
  try {
    tessera::kernel_trace::start_tracing();
  } catch (const std::exception& error) {
    tessera::kernel_trace::warn(std::string("cannot start tracing: ") + error.what());
  }
  return 1;
}
