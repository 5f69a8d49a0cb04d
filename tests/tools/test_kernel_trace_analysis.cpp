// The kernel tracer's pure half (tools/kernel_trace/trace_analysis.h) against hand-computed
// figures: union busy time, overlap time, per-name aggregation, names, output file names,
// and the summary and Chrome trace built from a small hand-made trace.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "trace_analysis.h"

namespace tessera::kernel_trace {
namespace {

TEST(KernelTraceIntervals, DisjointIntervalsAddUp) {
  const std::vector<Interval> intervals{{10, 20}, {30, 35}, {100, 107}};
  EXPECT_EQ(covered_length(intervals), 10u + 5u + 7u);
  EXPECT_EQ(covered_length(intervals, 2), 0u);
}

TEST(KernelTraceIntervals, OverlappingNestedAndTouching) {
  // [0,10) and [5,15) overlap on [5,10); [20,40) holds [25,30) nested in it; [40,45) touches
  // [20,40) without overlapping; [12,13) lies inside [5,15) only.
  const std::vector<Interval> intervals{{5, 15}, {0, 10}, {20, 40}, {25, 30}, {40, 45}, {12, 13}};
  EXPECT_EQ(covered_length(intervals), 15u + 25u);        // [0,15) and [20,45)
  EXPECT_EQ(covered_length(intervals, 2), 5u + 1u + 5u);  // [5,10), [12,13), [25,30)
  EXPECT_EQ(covered_length(intervals, 3), 0u);
}

TEST(KernelTraceIntervals, ThreeDeepAndEmptyIntervals) {
  // Depth 3 on [4,5); an empty and a reversed interval count for nothing.
  const std::vector<Interval> intervals{{0, 6}, {2, 5}, {4, 9}, {7, 7}, {9, 3}};
  EXPECT_EQ(covered_length(intervals), 9u);
  EXPECT_EQ(covered_length(intervals, 2), 4u);  // [2,6)
  EXPECT_EQ(covered_length(intervals, 3), 1u);  // [4,5)
  EXPECT_EQ(covered_length({}), 0u);
}

TEST(KernelTraceIntervals, IntersectionOfTwoSetsCountsOverlapBetweenSetsOnly) {
  // Communication [10,30) and [50,60); compute [0,15), [12,20) (overlapping each other) and
  // [55,80). Shared time: [10,20) and [55,60) = 15; compute's own overlap does not count.
  const std::vector<Interval> communication{{10, 30}, {50, 60}};
  const std::vector<Interval> compute{{0, 15}, {12, 20}, {55, 80}};
  EXPECT_EQ(intersection_length(communication, compute), 15u);
  EXPECT_EQ(intersection_length(compute, communication), 15u);
  EXPECT_EQ(intersection_length(communication, {}), 0u);
}

TEST(KernelTraceNames, DemanglesAndShortens) {
  EXPECT_EQ(demangle("_Z10add_kernelPfPKfi"), "add_kernel(float*, float const*, int)");
  EXPECT_EQ(demangle("nvjet_tst_128x256_64x4_h_bz_NNT"), "nvjet_tst_128x256_64x4_h_bz_NNT");
  EXPECT_EQ(demangle("_Znot_really_mangled"), "_Znot_really_mangled");
  EXPECT_EQ(shorten_kernel_name("add_kernel(float*, float const*, int)"), "add_kernel");
  EXPECT_EQ(shorten_kernel_name("void tessera::(anonymous namespace)::layer_norm<__nv_bfloat16, "
                                "256>(__nv_bfloat16 const*, float*, int)"),
            "tessera::layer_norm<__nv_bfloat16, 256>");
  // A function-pointer template argument keeps its parentheses; only the parameters go.
  EXPECT_EQ(shorten_kernel_name("void apply<void (*)(int)>(int, float)"), "apply<void (*)(int)>");
  EXPECT_EQ(shorten_kernel_name("void at::native::vectorized_elementwise_kernel<4, "
                                "at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&)::"
                                "{lambda()#1}::operator()() const::{lambda(float)#2}, "
                                "std::array<char*, 2ul> >(int, std::array<char*, 2ul>)"),
            "at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl("
            "at::TensorIteratorBase&)::{lambda}::{lambda}, std::array<char*, 2ul> >");
  EXPECT_EQ(shorten_kernel_name("ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL");
}

TEST(KernelTraceNames, LongNamesKeepHeadAndTail) {
  const std::string name = std::string(100, 'a') + std::string(100, 'b');
  const std::string shortened = shorten_kernel_name(name, 30);
  EXPECT_EQ(shortened, std::string(20, 'a') + "..." + std::string(7, 'b'));
  EXPECT_EQ(shortened.size(), 30u);
}

TEST(KernelTraceNames, CommunicationKernelsAreNcclOnes) {
  EXPECT_TRUE(is_communication_kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL"));
  EXPECT_TRUE(is_communication_kernel("_Z28ncclKernel_AllReduce_RING_LLi"));
  EXPECT_FALSE(is_communication_kernel("tessera::kernels::gemm_bias_gelu"));
}

TEST(KernelTraceFiles, OutputStemUsesRankThenLocalRankThenPid) {
  int rank = -2;
  std::string warning;
  EXPECT_EQ(output_stem("/tmp/t", "3", "1", 77, &rank, &warning), "/tmp/t.rank3");
  EXPECT_EQ(rank, 3);
  EXPECT_EQ(output_stem("/tmp/t", nullptr, "1", 77, &rank, &warning), "/tmp/t.rank1");
  EXPECT_EQ(output_stem("/tmp/t", "", "0", 77, &rank, &warning), "/tmp/t.rank0");
  EXPECT_EQ(output_stem("/tmp/t", nullptr, nullptr, 77, &rank, &warning), "/tmp/t.pid77");
  EXPECT_EQ(rank, -1);
  EXPECT_TRUE(warning.empty());
  EXPECT_EQ(output_stem("out", "two", nullptr, 77, &rank, &warning), "out.pid77");
  EXPECT_NE(warning.find("RANK='two'"), std::string::npos) << warning;
}

TEST(KernelTraceFiles, SecondsParseOrSayWhy) {
  std::string error;
  EXPECT_EQ(parse_seconds("2.5", &error), 2.5);
  EXPECT_EQ(parse_seconds("0", &error), 0.0);
  EXPECT_FALSE(parse_seconds("-1", &error));
  EXPECT_NE(error.find("'-1'"), std::string::npos) << error;
  EXPECT_FALSE(parse_seconds("5s", &error));
  EXPECT_FALSE(parse_seconds("nan", &error));
  EXPECT_FALSE(parse_seconds("", &error));
}

// Device 0: stream 7 runs gemm [1000,5000) and gemm [6000,8000); stream 9 runs an NCCL
// all-reduce [4000,7000) and a memset. Device 1: layer norms [2000,2500) and [3000,3700) on
// stream 3.
Trace hand_made_trace() {
  Trace trace;
  trace.process_label = "rank 1";
  trace.rank = 1;
  trace.names = {"_Z4gemmPKfPfi", "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                 "_ZN7tessera10layer_normILi256EEEvPf", "memset"};
  auto kernel = [](uint32_t device, uint32_t stream, uint64_t start, uint64_t end, uint32_t name) {
    Activity activity;
    activity.device = device, activity.stream = stream, activity.name_id = name;
    activity.start_ns = start, activity.end_ns = end;
    activity.grid[0] = 132, activity.block[0] = 256, activity.registers = 90;
    return activity;
  };
  trace.activities = {kernel(0, 7, 6000, 8000, 0), kernel(0, 7, 1000, 5000, 0),
                      kernel(0, 9, 4000, 7000, 1), kernel(1, 3, 2000, 2500, 2),
                      kernel(1, 3, 3000, 3700, 2)};
  Activity memset = kernel(0, 9, 500, 900, 3);
  memset.kind = ActivityKind::memset, memset.bytes = 4096;
  trace.activities.push_back(memset);
  return trace;
}

TEST(KernelTraceReport, StatsGroupByShortNameLargestFirst) {
  const std::vector<KernelStat> stats = kernel_stats(hand_made_trace());
  ASSERT_EQ(stats.size(), 3u);  // the memset is no kernel
  EXPECT_EQ(stats[0].name, "gemm");
  EXPECT_EQ(stats[0].count, 2u);
  EXPECT_EQ(stats[0].total_ns, 6000u);
  EXPECT_EQ(stats[1].name, "ncclDevKernel_AllReduce_Sum_f32_RING_LL");
  EXPECT_EQ(stats[1].total_ns, 3000u);
  EXPECT_EQ(stats[2].name, "tessera::layer_norm<256>");
  EXPECT_EQ(stats[2].count, 2u);
  EXPECT_EQ(stats[2].total_ns, 1200u);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(KernelTraceReport, SummaryHoldsHandComputedFigures) {
  std::ostringstream out;
  write_summary(out, hand_made_trace());
  const std::string summary = out.str();
  SCOPED_TRACE(summary);
  EXPECT_TRUE(contains(summary,
                       "records: 5 kernels, 0 memcpy, 1 memset, 0 host synchronisations; "
                       "left out: 0 outside the "
                       "window, 0 over the record limit, 0 lost by CUPTI\n"));
  EXPECT_TRUE(contains(summary, "span of kernels (first start to last end): 0.007 ms"));
  // Device 0: kernels cover [1000,8000) = 7 us; two at once on [4000,5000) and [6000,7000).
  EXPECT_TRUE(contains(summary,
                       "device 0: busy 0.007 ms (100.0% of its span 0.007 ms), two or "
                       "more kernels at once 0.002 ms"));
  // NCCL [4000,7000) = 3 us, overlapped by gemm on 2 us of it: 1 us exposed.
  EXPECT_TRUE(contains(summary,
                       "communication (nccl) busy 0.003 ms, compute busy 0.006 ms, "
                       "communication overlapped by compute 0.002 ms, exposed "
                       "communication 0.001 ms"));
  EXPECT_TRUE(contains(summary, "stream 7: busy 0.006 ms, 2 kernels"));
  EXPECT_TRUE(contains(summary, "stream 9: busy 0.003 ms, 1 kernels"));
  EXPECT_TRUE(contains(summary, "device 1: busy 0.001 ms (70.6% of its span 0.002 ms)"));
  EXPECT_TRUE(contains(summary, "summed kernel time 0.010 ms"));
  EXPECT_TRUE(contains(summary, "         2          6.000        3.000  58.82%  gemm\n"));
  EXPECT_TRUE(contains(summary,
                       "         2          1.200        0.600  11.76%  "
                       "tessera::layer_norm<256>\n"));
  EXPECT_TRUE(contains(summary, "         1          0.400             4096  memset\n"));
}

TEST(KernelTraceReport, HeaderSaysWhatWasLeftOut) {
  Trace trace = hand_made_trace();
  trace.window_start_s = 20.0, trace.window_seconds = 5.0;
  trace.outside_window = 7, trace.over_capacity = 3, trace.dropped_by_cupti = 2;
  trace.without_times = 1;
  std::ostringstream out;
  write_summary(out, trace);
  EXPECT_TRUE(contains(out.str(),
                       "tessera kernel trace of rank 1\nwindow: activities starting "
                       "from 20.000 s after CUDA initialisation for 5.000 s\nrecords: 5 "
                       "kernels, 0 memcpy, 1 memset, 0 host synchronisations; left out: "
                       "7 outside the window, 3 over the record limit, 2 lost by CUPTI, "
                       "1 without timestamps\n"))
      << out.str();
}

TEST(KernelTraceReport, HostWaitsAreReportedApartFromGpuWork) {
  // Two stream synchronisations (1.0 and 3.0 us) and a device synchronisation (0.6 us) on
  // the host track; the GPU figures and the memory table stay those of hand_made_trace.
  Trace trace = hand_made_trace();
  trace.names.push_back("cudaStreamSynchronize");
  trace.names.push_back("cudaDeviceSynchronize");
  auto wait = [](uint32_t name, uint64_t start, uint64_t end) {
    Activity activity;
    activity.kind = ActivityKind::synchronization, activity.device = kHostTrack;
    activity.stream = 7, activity.name_id = name, activity.start_ns = start, activity.end_ns = end;
    return activity;
  };
  trace.activities.push_back(wait(4, 2000, 3000));
  trace.activities.push_back(wait(4, 5000, 8000));
  trace.activities.push_back(wait(5, 9000, 9600));
  std::ostringstream out;
  write_summary(out, trace);
  const std::string summary = out.str();
  SCOPED_TRACE(summary);
  EXPECT_TRUE(contains(summary, "1 memset, 3 host synchronisations;"));
  EXPECT_TRUE(contains(summary, "device 0: busy 0.007 ms (100.0% of its span 0.007 ms)"));
  EXPECT_FALSE(contains(summary, "device 4294967295"));
  EXPECT_TRUE(contains(summary,
                       "memory operations:\n     count       total_us            bytes  "
                       "kind\n         1          0.400             4096  memset\n\n"));
  EXPECT_TRUE(contains(summary,
                       "host waits in CUDA synchronisation: 0.005 ms in 3 calls (CPU "
                       "time blocked, not GPU time):\n     count       total_us  call\n"
                       "         1          0.600  cudaDeviceSynchronize\n"
                       "         2          4.000  cudaStreamSynchronize\n"));
  std::ostringstream json_text;
  write_chrome_trace(json_text, trace);
  const nlohmann::json json = nlohmann::json::parse(json_text.str());
  int waits = 0;
  for (const auto& event : json["traceEvents"]) {
    if (event["ph"] == "M" && event["pid"] == 199)
      if (event["name"] == "process_name")
        EXPECT_EQ(event["args"]["name"], "rank 1 host (CUDA synchronisation)");
    if (event["ph"] != "X" || event["cat"] != "sync") continue;
    waits += 1;
    EXPECT_EQ(event["pid"], 199);  // rank 1's host track
    EXPECT_FALSE(event["args"].contains("bytes"));
  }
  EXPECT_EQ(waits, 3);
}

TEST(KernelTraceReport, GraphReplaysCountedFromTheirNodes) {
  // Graph 4 of three kernel nodes replayed twice, and cut by the window after one more
  // node; graph 9 of one node replayed three times; kernels outside graphs are not counted.
  Trace trace = hand_made_trace();
  const uint64_t nodes_of_4[] = {11, 12, 13, 11, 12, 13, 11};
  uint64_t time = 10000;
  for (uint64_t node : nodes_of_4) {
    trace.activities.push_back(trace.activities[0]);
    trace.activities.back().graph_id = 4, trace.activities.back().graph_node_id = node;
    trace.activities.back().start_ns = time, trace.activities.back().end_ns = time + 10;
    time += 20;
  }
  for (int replay = 0; replay < 3; ++replay) {
    trace.activities.push_back(trace.activities[0]);
    trace.activities.back().graph_id = 9, trace.activities.back().graph_node_id = 70;
  }
  std::ostringstream out;
  write_summary(out, trace);
  EXPECT_TRUE(contains(out.str(),
                       "CUDA graphs (kernel nodes only):\n"
                       "  graph 4: 7 kernel records of 3 nodes, 2.3 replays\n"
                       "  graph 9: 3 kernel records of 1 nodes, 3.0 replays\n\n"))
      << out.str();
  std::ostringstream none;
  write_summary(none, hand_made_trace());
  EXPECT_FALSE(contains(none.str(), "CUDA graphs")) << none.str();
}

TEST(KernelTraceReport, ChromeTraceParsesWithExactTimes) {
  std::ostringstream out;
  Trace trace = hand_made_trace();
  trace.names.push_back("name with \"quotes\" and \\ and \x01");
  trace.activities.push_back(trace.activities[0]);
  trace.activities.back().name_id = 4;
  trace.activities.back().start_ns = 1'700'000'000'123'456'789ull;  // an absolute CUPTI time
  trace.activities.back().end_ns = 1'700'000'000'123'457'790ull;
  write_chrome_trace(out, trace);
  const nlohmann::json json = nlohmann::json::parse(out.str());
  std::map<std::string, int> kernels;
  for (const auto& event : json["traceEvents"]) {
    if (event["ph"] != "X") continue;
    if (event["cat"] == "kernel") kernels[event["name"]] += 1;
    EXPECT_GT(event["dur"].get<double>(), 0.0);
  }
  EXPECT_EQ(kernels["gemm"], 2);
  EXPECT_EQ(kernels["tessera::layer_norm<256>"], 2);
  EXPECT_EQ(kernels["name with \"quotes\" and \\ and \x01"], 1);
  EXPECT_EQ(json["kernelNames"]["gemm"], "gemm(float const*, float*, int)");
  // The first event in time: the memset at 0.5 us on rank 1's device 0 (pid 100), stream 9.
  const auto& first = json["traceEvents"][3 + 2];  // after 2 process and 3 stream names
  EXPECT_EQ(first["name"], "memset");
  EXPECT_EQ(first["ts"].get<double>(), 0.5);
  EXPECT_EQ(first["dur"].get<double>(), 0.4);
  EXPECT_EQ(first["pid"], 100);
  EXPECT_EQ(first["tid"], 9);
  EXPECT_EQ(first["args"]["bytes"], 4096);
  // The text keeps every nanosecond of an absolute time.
  EXPECT_TRUE(contains(out.str(), "\"ts\":1700000000123456.789,\"dur\":1.001,"));
  EXPECT_TRUE(contains(out.str(), "\"grid\":[132,0,0],\"block\":[256,0,0],\"registers\":90"));
}

TEST(KernelTraceReport, AtomicWriteLeavesNoPartialFile) {
  const std::filesystem::path folder =
      std::filesystem::temp_directory_path() / ("kernel_trace_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(folder);
  const std::string path = (folder / "t.summary.txt").string();
  std::string error;
  ASSERT_TRUE(write_file_atomically(
      path, [](std::ostream& os) { os << "first"; }, &error));
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "first");
  const std::string missing = (folder / "no_such_folder" / "t.json").string();
  EXPECT_FALSE(write_file_atomically(
      missing, [](std::ostream& os) { os << "x"; }, &error));
  EXPECT_NE(error.find("no_such_folder"), std::string::npos) << error;
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(folder),
                          std::filesystem::directory_iterator()),
            1);  // no temporary left behind
  std::filesystem::remove_all(folder);
}

}  // namespace
}  // namespace tessera::kernel_trace
