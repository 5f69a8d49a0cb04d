#include "trace_analysis.h"

#include <cxxabi.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <unordered_map>

namespace tessera::kernel_trace {

namespace {

struct DepthChange {
  uint64_t time;
  int delta_a;
  int delta_b;
};

// Sweeps the sorted boundaries and sums the lengths between consecutive ones on which
// `counts(depth_a, depth_b)` holds. Boundaries at equal times are all applied before the
// next length is added, so the order among them does not matter.
template <class Predicate>
uint64_t sweep(std::vector<DepthChange>& changes, Predicate counts) {
  std::sort(changes.begin(), changes.end(),
            [](const DepthChange& x, const DepthChange& y) { return x.time < y.time; });
  uint64_t total = 0;
  int depth_a = 0, depth_b = 0;
  uint64_t previous = changes.empty() ? 0 : changes.front().time;
  for (const DepthChange& change : changes) {
    if (counts(depth_a, depth_b)) total += change.time - previous;
    previous = change.time;
    depth_a += change.delta_a;
    depth_b += change.delta_b;
  }
  return total;
}

void add_changes(std::vector<DepthChange>& changes, const std::vector<Interval>& intervals,
                 bool first_set) {
  for (const Interval& interval : intervals) {
    if (interval.end <= interval.start) continue;
    changes.push_back({interval.start, first_set ? 1 : 0, first_set ? 0 : 1});
    changes.push_back({interval.end, first_set ? -1 : 0, first_set ? 0 : -1});
  }
}

void replace_all(std::string& text, std::string_view from, std::string_view to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at)) {
    text.replace(at, from.size(), to);
    at += to.size();
  }
}

// "{lambda(float)#2}" (with any nesting inside) becomes "{lambda}": the signature of a
// lambda says little in a table and makes PyTorch's elementwise kernel names unreadable.
void collapse_lambdas(std::string& text) {
  constexpr std::string_view opening = "{lambda(";
  for (size_t at = text.find(opening); at != std::string::npos; at = text.find(opening, at + 1)) {
    int depth = 0;
    size_t close = at;
    for (; close < text.size(); ++close) {
      if (text[close] == '{') ++depth;
      if (text[close] == '}' && --depth == 0) break;
    }
    if (close == text.size()) return;  // unbalanced: leave the rest as it is
    text.replace(at, close + 1 - at, "{lambda}");
  }
}

// Cuts the trailing parameter list "(...)" of a demangled function name.
void strip_parameter_list(std::string& text) {
  if (text.empty() || text.back() != ')') return;
  int depth = 0;
  for (size_t i = text.size(); i-- > 0;) {
    if (text[i] == ')') ++depth;
    if (text[i] == '(' && --depth == 0) {
      if (i > 0) text.resize(i);
      return;
    }
  }
}

std::optional<int> parse_rank(const char* text) {
  if (text == nullptr || *text == '\0') return std::nullopt;
  std::string_view digits(text);
  if (digits.size() > 9 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return std::atoi(text);
}

}  // namespace

uint64_t covered_length(const std::vector<Interval>& intervals, int min_depth) {
  std::vector<DepthChange> changes;
  changes.reserve(2 * intervals.size());
  add_changes(changes, intervals, true);
  return sweep(changes, [min_depth](int depth, int) { return depth >= min_depth; });
}

uint64_t intersection_length(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  std::vector<DepthChange> changes;
  changes.reserve(2 * (a.size() + b.size()));
  add_changes(changes, a, true);
  add_changes(changes, b, false);
  return sweep(changes, [](int depth_a, int depth_b) { return depth_a > 0 && depth_b > 0; });
}

std::string demangle(const std::string& name) {
  if (name.rfind("_Z", 0) != 0) return name;
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> readable(
      abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status), std::free);
  return status == 0 && readable ? std::string(readable.get()) : name;
}

std::string shorten_kernel_name(std::string_view demangled, size_t max_length) {
  std::string text(demangled);
  if (text.rfind("void ", 0) == 0) text.erase(0, 5);
  strip_parameter_list(text);
  replace_all(text, "(anonymous namespace)::", "");
  collapse_lambdas(text);
  replace_all(text, "::operator()() const", "");
  if (max_length >= 8 && text.size() > max_length) {
    const size_t head = max_length * 2 / 3;
    const size_t tail = max_length - head - 3;
    text = text.substr(0, head) + "..." + text.substr(text.size() - tail);
  }
  return text;
}

bool is_communication_kernel(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lower.find("nccl") != std::string::npos;
}

std::vector<KernelStat> kernel_stats(const Trace& trace) {
  std::vector<std::string> short_names(trace.names.size());
  std::unordered_map<std::string, KernelStat> by_name;
  for (const Activity& activity : trace.activities) {
    if (activity.kind != ActivityKind::kernel || activity.name_id >= trace.names.size()) continue;
    std::string& name = short_names[activity.name_id];
    if (name.empty()) name = shorten_kernel_name(demangle(trace.names[activity.name_id]));
    KernelStat& stat = by_name[name];
    stat.name = name;
    stat.count += 1;
    stat.total_ns += activity.end_ns > activity.start_ns ? activity.end_ns - activity.start_ns : 0;
  }
  std::vector<KernelStat> stats;
  stats.reserve(by_name.size());
  for (auto& [name, stat] : by_name) stats.push_back(std::move(stat));
  std::sort(stats.begin(), stats.end(), [](const KernelStat& x, const KernelStat& y) {
    return x.total_ns != y.total_ns ? x.total_ns > y.total_ns : x.name < y.name;
  });
  return stats;
}

std::string output_stem(const std::string& prefix, const char* rank_env, const char* local_rank_env,
                        long pid, int* rank_out, std::string* warning) {
  const char* variable = rank_env != nullptr && *rank_env != '\0' ? "RANK" : "LOCAL_RANK";
  const char* text = rank_env != nullptr && *rank_env != '\0' ? rank_env : local_rank_env;
  std::optional<int> rank = parse_rank(text);
  if (!rank && text != nullptr && *text != '\0' && warning != nullptr)
    *warning = std::string(variable) + "='" + text +
               "' is not a non-negative integer; naming the files by process id";
  if (rank_out != nullptr) *rank_out = rank.value_or(-1);
  if (rank) return prefix + ".rank" + std::to_string(*rank);
  return prefix + ".pid" + std::to_string(pid);
}

std::optional<double> parse_seconds(const char* text, std::string* error) {
  if (text == nullptr || *text == '\0') {
    if (error != nullptr) *error = "is empty";
    return std::nullopt;
  }
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(value) || value < 0) {
    if (error != nullptr) *error = std::string("'") + text + "' is not a number of seconds >= 0";
    return std::nullopt;
  }
  return value;
}

}  // namespace tessera::kernel_trace
