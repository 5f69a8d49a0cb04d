#pragma once
// The pure half of the kernel tracer: what it records, the interval arithmetic of the
// summary, kernel-name handling, the output files. No CUPTI and no CUDA here, so all of it
// is unit-tested on machines without a GPU (tests/tools); kernel_trace.cpp only fills a
// Trace from CUPTI's activity records and calls write_trace_files at exit.
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::kernel_trace {

// synchronization: a host thread blocked in cudaStreamSynchronize, cudaEventSynchronize or
// cudaDeviceSynchronize (CPU time, on the host track), not GPU work.
enum class ActivityKind : uint8_t { kernel, memcpy, memset, synchronization };
// The `device` of synchronization records: they belong to the host.
constexpr uint32_t kHostTrack = UINT32_MAX;

// One GPU activity or host wait. Times are CUPTI timestamps in nanoseconds.
struct Activity {
  ActivityKind kind = ActivityKind::kernel;
  uint32_t device = 0;
  uint32_t stream = 0;
  uint64_t start_ns = 0;
  uint64_t end_ns = 0;
  uint32_t name_id = 0;  // index into Trace::names (kernel name as recorded, or copy kind)
  uint32_t correlation_id = 0;
  uint32_t graph_id = 0;  // 0 when not launched from a CUDA graph
  uint64_t graph_node_id = 0;
  int32_t grid[3] = {0, 0, 0};
  int32_t block[3] = {0, 0, 0};
  uint32_t registers = 0;
  uint32_t static_shared_bytes = 0;
  uint32_t dynamic_shared_bytes = 0;
  uint64_t bytes = 0;  // memcpy / memset size
};

// The time window of records kept: [begin_ns, end_ns), on the start of each activity.
struct TraceWindow {
  uint64_t begin_ns = 0;
  uint64_t end_ns = UINT64_MAX;
  bool contains(uint64_t start_ns) const { return start_ns >= begin_ns && start_ns < end_ns; }
};

struct Trace {
  std::vector<Activity> activities;
  std::vector<std::string> names;  // mangled kernel names as CUPTI gave them, or "memcpy HtoD"...
  std::string process_label;       // "rank 1" or "pid 4242"
  int rank = -1;                   // -1 when neither RANK nor LOCAL_RANK was set
  uint64_t init_ns = 0;            // CUPTI time when tracing started (cuInit)
  std::optional<double> window_start_s, window_seconds;  // as given, for the report
  uint64_t outside_window = 0;    // records dropped because they fell outside the window
  uint64_t over_capacity = 0;     // records dropped because the record limit was reached
  uint64_t dropped_by_cupti = 0;  // records CUPTI reported as lost (buffers full)
  uint64_t without_times = 0;     // records whose timestamps CUPTI could not collect
};

// ---- interval arithmetic (all lengths in the intervals' unit) ----
struct Interval {
  uint64_t start = 0;
  uint64_t end = 0;  // exclusive; an interval with end <= start is empty
};
// Length of the time covered by at least `min_depth` of the intervals at once: 1 gives the
// busy time of their union, 2 the time during which two or more run together.
uint64_t covered_length(const std::vector<Interval>& intervals, int min_depth = 1);
// Length of the time covered by some interval of `a` and some interval of `b` at once.
uint64_t intersection_length(const std::vector<Interval>& a, const std::vector<Interval>& b);

// ---- kernel names ----
// The demangled name (the input unchanged when it is not an Itanium-mangled name).
std::string demangle(const std::string& name);
// A demangled kernel name shortened for tables: no "void " return type, no parameter list,
// no "(anonymous namespace)::", lambdas as "{lambda}", and at most max_length characters
// (the middle elided with "...").
std::string shorten_kernel_name(std::string_view demangled, size_t max_length = 160);
// NCCL's kernels (the communication the summary separates from compute).
bool is_communication_kernel(std::string_view name);

// ---- per-name aggregation ----
struct KernelStat {
  std::string name;  // shortened demangled name
  uint64_t count = 0;
  uint64_t total_ns = 0;
};
// Kernels grouped by shortened demangled name, largest total first (ties by name).
std::vector<KernelStat> kernel_stats(const Trace& trace);

// ---- output ----
// "<prefix>.rank<R>" from RANK (or LOCAL_RANK when RANK is unset), else "<prefix>.pid<P>".
// A rank variable that is not a non-negative integer is ignored (warning set to say so).
std::string output_stem(const std::string& prefix, const char* rank_env, const char* local_rank_env,
                        long pid, int* rank_out = nullptr, std::string* warning = nullptr);
// A duration in seconds from an environment variable's text ("2", "0.5"); nullopt with
// `error` set when the text is not a finite number >= 0.
std::optional<double> parse_seconds(const char* text, std::string* error);

void write_summary(std::ostream& os, const Trace& trace);
void write_chrome_trace(std::ostream& os, const Trace& trace);
// Writes through `path.tmp<pid>` renamed onto `path`, so a reader never sees half a file.
bool write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& body,
                           std::string* error);

}  // namespace tessera::kernel_trace
