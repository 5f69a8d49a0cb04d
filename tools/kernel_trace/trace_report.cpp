// The two files the tracer writes: a text summary and a Chrome/Perfetto trace.
#include <unistd.h>
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <ostream>
#include <set>

#include "trace_analysis.h"

namespace tessera::kernel_trace {

namespace {

std::string format(const char* pattern, auto... values) {
  char buffer[512];
  std::snprintf(buffer, sizeof buffer, pattern, values...);
  return buffer;
}

std::string milliseconds(uint64_t ns) { return format("%.3f ms", static_cast<double>(ns) * 1e-6); }

// Exact microseconds with three decimals, from integer nanoseconds (a double of an absolute
// CUPTI time in microseconds would already have lost the nanoseconds).
std::string microseconds_exact(uint64_t ns) {
  return format("%" PRIu64 ".%03" PRIu64, ns / 1000, ns % 1000);
}

double percent(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole);
}

uint64_t duration(const Activity& activity) {
  return activity.end_ns > activity.start_ns ? activity.end_ns - activity.start_ns : 0;
}

struct StreamUse {
  std::vector<Interval> intervals;
  uint64_t kernels = 0;
};

struct DeviceUse {
  std::vector<Interval> all, communication, compute;
  std::map<uint32_t, StreamUse> streams;
  uint64_t first_start = UINT64_MAX, last_end = 0;
};

std::map<uint32_t, DeviceUse> device_use(const Trace& trace) {
  std::vector<int> communication_by_name(trace.names.size(), -1);
  std::map<uint32_t, DeviceUse> devices;
  for (const Activity& activity : trace.activities) {
    if (activity.kind != ActivityKind::kernel || activity.name_id >= trace.names.size()) continue;
    int& communication = communication_by_name[activity.name_id];
    if (communication < 0) communication = is_communication_kernel(trace.names[activity.name_id]);
    const Interval interval{activity.start_ns, activity.end_ns};
    DeviceUse& device = devices[activity.device];
    device.all.push_back(interval);
    (communication ? device.communication : device.compute).push_back(interval);
    StreamUse& stream = device.streams[activity.stream];
    stream.intervals.push_back(interval);
    stream.kernels += 1;
    device.first_start = std::min(device.first_start, activity.start_ns);
    device.last_end = std::max(device.last_end, activity.end_ns);
  }
  return devices;
}

void write_header(std::ostream& os, const Trace& trace) {
  os << "tessera kernel trace of " << trace.process_label << "\n";
  if (trace.window_start_s || trace.window_seconds) {
    const double start = trace.window_start_s.value_or(0.0);
    os << format("window: activities starting from %.3f s after CUDA initialisation", start);
    if (trace.window_seconds) os << format(" for %.3f s", *trace.window_seconds);
    os << "\n";
  } else {
    os << "window: every activity from CUDA initialisation to exit\n";
  }
  uint64_t counts[4] = {0, 0, 0, 0};
  for (const Activity& activity : trace.activities) counts[static_cast<int>(activity.kind)] += 1;
  os << "records: " << counts[0] << " kernels, " << counts[1] << " memcpy, " << counts[2]
     << " memset, " << counts[3] << " host synchronisations; left out: " << trace.outside_window
     << " outside the window, " << trace.over_capacity << " over the record limit, "
     << trace.dropped_by_cupti << " lost by CUPTI";
  if (trace.without_times > 0) os << ", " << trace.without_times << " without timestamps";
  os << "\n\n";
}

void write_device_use(std::ostream& os, const Trace& trace) {
  uint64_t first = UINT64_MAX, last = 0;
  const std::map<uint32_t, DeviceUse> devices = device_use(trace);
  for (const auto& [id, device] : devices) {
    first = std::min(first, device.first_start);
    last = std::max(last, device.last_end);
  }
  if (devices.empty()) return;
  os << "span of kernels (first start to last end): " << milliseconds(last - first) << "\n";
  for (const auto& [id, device] : devices) {
    const uint64_t span = device.last_end - device.first_start;
    const uint64_t busy = covered_length(device.all);
    os << "device " << id << ": busy " << milliseconds(busy)
       << format(" (%.1f%% of its span ", percent(busy, span)) << milliseconds(span)
       << "), two or more kernels at once " << milliseconds(covered_length(device.all, 2)) << "\n";
    const uint64_t communication = covered_length(device.communication);
    const uint64_t overlapped = intersection_length(device.communication, device.compute);
    os << "  communication (nccl) busy " << milliseconds(communication) << ", compute busy "
       << milliseconds(covered_length(device.compute)) << ", communication overlapped by compute "
       << milliseconds(overlapped) << ", exposed communication "
       << milliseconds(communication - overlapped) << "\n";
    for (const auto& [stream_id, stream] : device.streams)
      os << "  stream " << stream_id << ": busy " << milliseconds(covered_length(stream.intervals))
         << ", " << stream.kernels << " kernels\n";
  }
  os << "\n";
}

// Kernel records per CUDA graph: its distinct kernel nodes and so how many times it was
// replayed in the window (a training step recorded as one graph: the number of steps).
void write_graphs(std::ostream& os, const Trace& trace) {
  struct GraphUse {
    uint64_t records = 0;
    std::set<uint64_t> nodes;
  };
  std::map<uint32_t, GraphUse> graphs;
  for (const Activity& activity : trace.activities) {
    if (activity.kind != ActivityKind::kernel || activity.graph_id == 0) continue;
    GraphUse& graph = graphs[activity.graph_id];
    graph.records += 1;
    graph.nodes.insert(activity.graph_node_id);
  }
  if (graphs.empty()) return;
  os << "CUDA graphs (kernel nodes only):\n";
  for (const auto& [id, graph] : graphs)
    os << "  graph " << id << ": " << graph.records << " kernel records of " << graph.nodes.size()
       << format(" nodes, %.1f replays\n",
                 static_cast<double>(graph.records) / static_cast<double>(graph.nodes.size()));
  os << "\n";
}

void write_kernel_table(std::ostream& os, const Trace& trace) {
  const std::vector<KernelStat> stats = kernel_stats(trace);
  const uint64_t summed =
      std::accumulate(stats.begin(), stats.end(), uint64_t{0},
                      [](uint64_t total, const KernelStat& stat) { return total + stat.total_ns; });
  os << "kernels by total time (summed kernel time " << milliseconds(summed) << "):\n";
  os << format("%10s %14s %12s %7s  %s\n", "count", "total_us", "mean_us", "pct", "name");
  for (const KernelStat& stat : stats) {
    const double total_us = static_cast<double>(stat.total_ns) * 1e-3;
    os << format("%10" PRIu64 " %14.3f %12.3f %6.2f%%  ", stat.count, total_us,
                 total_us / static_cast<double>(stat.count), percent(stat.total_ns, summed))
       << stat.name << "\n";
  }
  os << "\n";
}

struct NamedTotal {
  uint64_t count = 0, total_ns = 0, bytes = 0;
};

// Count, time and bytes per name of the activities of the given kinds.
std::map<std::string, NamedTotal> totals_by_name(const Trace& trace,
                                                 std::initializer_list<ActivityKind> kinds) {
  std::map<std::string, NamedTotal> by_name;
  for (const Activity& activity : trace.activities) {
    if (std::find(kinds.begin(), kinds.end(), activity.kind) == kinds.end() ||
        activity.name_id >= trace.names.size())
      continue;
    NamedTotal& total = by_name[trace.names[activity.name_id]];
    total.count += 1;
    total.total_ns += duration(activity);
    total.bytes += activity.bytes;
  }
  return by_name;
}

void write_memory_table(std::ostream& os, const Trace& trace) {
  const auto by_name = totals_by_name(trace, {ActivityKind::memcpy, ActivityKind::memset});
  if (by_name.empty()) return;
  os << "memory operations:\n";
  os << format("%10s %14s %16s  %s\n", "count", "total_us", "bytes", "kind");
  for (const auto& [name, total] : by_name)
    os << format("%10" PRIu64 " %14.3f %16" PRIu64 "  ", total.count,
                 static_cast<double>(total.total_ns) * 1e-3, total.bytes)
       << name << "\n";
  os << "\n";
}

// Time host threads spent blocked until the GPU caught up: large when the GPU is the
// bottleneck, small when the host is (it then never has to wait).
void write_host_waits(std::ostream& os, const Trace& trace) {
  const auto by_name = totals_by_name(trace, {ActivityKind::synchronization});
  if (by_name.empty()) return;
  uint64_t total_ns = 0, calls = 0;
  for (const auto& [name, total] : by_name) total_ns += total.total_ns, calls += total.count;
  os << "host waits in CUDA synchronisation: " << milliseconds(total_ns) << " in " << calls
     << " calls (CPU time blocked, not GPU time):\n";
  os << format("%10s %14s  %s\n", "count", "total_us", "call");
  for (const auto& [name, total] : by_name)
    os << format("%10" PRIu64 " %14.3f  ", total.count, static_cast<double>(total.total_ns) * 1e-3)
       << name << "\n";
  os << "\n";
}

void write_json_string(std::ostream& os, std::string_view text) {
  os << '"';
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      os << '\\' << c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      os << format("\\u%04x", static_cast<unsigned>(c));
    } else {
      os << c;
    }
  }
  os << '"';
}

// Chrome's "pid": the device, and for a ranked process 100 * rank + device, so the files of
// several ranks can be loaded into one Perfetto view without their tracks colliding; the
// host's synchronisation waits go on track 99 (100 * rank + 99).
uint64_t track_process(const Trace& trace, uint32_t device) {
  const uint64_t local = device == kHostTrack ? 99 : device;
  return trace.rank >= 0 ? 100 * static_cast<uint64_t>(trace.rank) + local : local;
}

// Writes the separator before each element of traceEvents: none before the first.
struct EventList {
  std::ostream& os;
  bool empty = true;
  std::ostream& next() {
    os << (empty ? "\n" : ",\n");
    empty = false;
    return os;
  }
};

void write_track_names(EventList& events, const Trace& trace) {
  std::set<std::pair<uint32_t, uint32_t>> streams;
  for (const Activity& activity : trace.activities)
    streams.insert({activity.device, activity.stream});
  std::set<uint32_t> devices;
  for (const auto& [device, stream] : streams) {
    if (devices.insert(device).second) {
      std::ostream& os = events.next();
      os << format("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%" PRIu64
                   ",\"tid\":0,\"args\":{\"name\":",
                   track_process(trace, device));
      write_json_string(os, trace.process_label + (device == kHostTrack
                                                       ? std::string(" host (CUDA synchronisation)")
                                                       : " GPU " + std::to_string(device)));
      os << "}}";
    }
    events.next() << format("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%" PRIu64
                            ",\"tid\":%u,\"args\":{\"name\":\"stream %u\"}}",
                            track_process(trace, device), stream, stream);
  }
}

void write_event(EventList& events, const Trace& trace, const Activity& activity,
                 const std::string& name) {
  const bool kernel = activity.kind == ActivityKind::kernel;
  const bool host = activity.kind == ActivityKind::synchronization;
  std::ostream& os = events.next();
  os << "{\"name\":";
  write_json_string(os, name);
  os << ",\"cat\":\""
     << (kernel ? "kernel"
         : host ? "sync"
                : "memory")
     << "\",\"ph\":\"X\",\"ts\":" << microseconds_exact(activity.start_ns)
     << ",\"dur\":" << microseconds_exact(duration(activity))
     << format(",\"pid\":%" PRIu64 ",\"tid\":%u,\"args\":{\"correlation_id\":%u",
               track_process(trace, activity.device), activity.stream, activity.correlation_id);
  if (kernel) {
    os << format(
        ",\"grid\":[%d,%d,%d],\"block\":[%d,%d,%d],\"registers\":%u"
        ",\"static_shared_bytes\":%u,\"dynamic_shared_bytes\":%u",
        activity.grid[0], activity.grid[1], activity.grid[2], activity.block[0], activity.block[1],
        activity.block[2], activity.registers, activity.static_shared_bytes,
        activity.dynamic_shared_bytes);
  } else if (!host) {
    os << ",\"bytes\":" << activity.bytes;
  }
  if (activity.graph_id != 0)
    os << ",\"graph_id\":" << activity.graph_id << ",\"graph_node_id\":" << activity.graph_node_id;
  os << "}}";
}

}  // namespace

void write_summary(std::ostream& os, const Trace& trace) {
  write_header(os, trace);
  write_device_use(os, trace);
  write_graphs(os, trace);
  write_kernel_table(os, trace);
  write_memory_table(os, trace);
  write_host_waits(os, trace);
}

void write_chrome_trace(std::ostream& os, const Trace& trace) {
  // Event names: the shortened demangled name; the full demangled names of those that were
  // shortened are listed once under "kernelNames" rather than repeated in every event.
  std::vector<std::string> event_names(trace.names.size());
  std::map<std::string, std::string> full_names;
  std::vector<bool> is_kernel_name(trace.names.size(), false);
  for (const Activity& activity : trace.activities)
    if (activity.kind == ActivityKind::kernel && activity.name_id < trace.names.size())
      is_kernel_name[activity.name_id] = true;
  for (size_t id = 0; id < trace.names.size(); ++id) {
    if (!is_kernel_name[id]) {
      event_names[id] = trace.names[id];
      continue;
    }
    const std::string full = demangle(trace.names[id]);
    event_names[id] = shorten_kernel_name(full);
    if (event_names[id] != full) full_names[event_names[id]] = full;
  }
  std::vector<size_t> order(trace.activities.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    return trace.activities[x].start_ns < trace.activities[y].start_ns;
  });

  os << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"tool\":\"tessera_kernel_trace\","
        "\"process\":";
  write_json_string(os, trace.process_label);
  os << ",\"init_ns\":" << trace.init_ns << "},\n\"kernelNames\":{";
  bool first = true;
  for (const auto& [short_name, full] : full_names) {
    os << (first ? "\n" : ",\n");
    first = false;
    write_json_string(os, short_name);
    os << ":";
    write_json_string(os, full);
  }
  os << "},\n\"traceEvents\":[";
  EventList events{os};
  write_track_names(events, trace);
  for (size_t index : order) {
    const Activity& activity = trace.activities[index];
    if (activity.name_id >= trace.names.size()) continue;
    write_event(events, trace, activity, event_names[activity.name_id]);
  }
  os << "\n]}\n";
}

bool write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& body,
                           std::string* error) {
  const std::string temporary = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) {
      if (error != nullptr) *error = "cannot open " + temporary + " for writing";
      return false;
    }
    body(out);
    out.flush();
    if (!out) {
      if (error != nullptr) *error = "writing " + temporary + " failed (disk full?)";
      out.close();
      std::remove(temporary.c_str());
      return false;
    }
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    if (error != nullptr) *error = "cannot rename " + temporary + " to " + path;
    std::remove(temporary.c_str());
    return false;
  }
  return true;
}

}  // namespace tessera::kernel_trace
