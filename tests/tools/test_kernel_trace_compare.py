#!/usr/bin/env python3
"""tools/kernel_trace/compare.py on hand-written summaries and a hand-written Chrome trace,
against category totals and whole-trace figures computed by hand; merge.py on three traces;
gaps.py on a hand-written trace whose idle stretches are known."""
import contextlib
import io
import json
import os
import pathlib
import re
import sys
import tempfile
import unittest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "kernel_trace"))
import compare  # noqa: E402
import gaps  # noqa: E402
import merge  # noqa: E402

HEADER = """tessera kernel trace of {who}
window: every activity from CUDA initialisation to exit
records: 53 kernels, 0 memcpy, 0 memset; left out: 0 outside the window, 0 over the record limit, 0 lost by CUPTI

span of kernels (first start to last end): {span} ms
device 0: busy {busy} ms (83.3% of its span {span} ms), two or more kernels at once {overlap} ms
  communication (nccl) busy 0.800 ms, compute busy 10.700 ms, communication overlapped by compute 0.500 ms, exposed communication {exposed} ms
  stream 7: busy 10.000 ms, 50 kernels

{graphs}"""

ONE_GPU = HEADER.format(who="rank 0", span="12.000", busy="10.000", overlap="0.000",
                        exposed="0.000", graphs="""CUDA graphs (kernel nodes only):
  graph 3: 86 kernel records of 43 nodes, 2.0 replays
  graph 5: 1 kernel records of 1 nodes, 1.0 replays

""") + """\
kernels by total time (summed kernel time 10.000 ms):
     count       total_us      mean_us     pct  name
        10       4000.000      400.000  40.00%  nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT
         5       2000.000      400.000  20.00%  tessera::kernels::flash_attention_forward<128, true>
         5       1500.000      300.000  15.00%  tessera::kernels::layer_norm_forward<__nv_bfloat16>
        20       1000.000       50.000  10.00%  tessera::kernels::gelu_forward<__nv_bfloat16>
         1       1000.000     1000.000  10.00%  tessera::optim::multi_tensor_adamw<4>
         2        500.000      250.000   5.00%  tessera::kernels::cross_entropy_forward

memory operations:
     count       total_us            bytes  kind
         1          0.100               64  memset

host waits in CUDA synchronisation: 2.500 ms in 2 calls (CPU time blocked, not GPU time):
     count       total_us  call
         2       2500.000  cudaStreamSynchronize
"""

TWO_GPU = HEADER.format(who="rank 0", span="13.000", busy="11.000", overlap="0.500",
                        exposed="0.300", graphs="""CUDA graphs (kernel nodes only):
  graph 7: 188 kernel records of 47 nodes, 4.0 replays

""") + """\
kernels by total time (summed kernel time 11.500 ms):
     count       total_us      mean_us     pct  name
        10       4400.000      440.000  38.26%  nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT
         5       2000.000      400.000  17.39%  fmha_cutlassF_bf16_aligned_64x64_rf_sm80
         5       1500.000      300.000  13.04%  tessera::kernels::layer_norm_forward<__nv_bfloat16>
        20       1200.000       60.000  10.43%  tessera::kernels::gelu_forward<__nv_bfloat16>
         1       1000.000     1000.000   8.70%  tessera::optim::multi_tensor_adamw<4>
         4        800.000      200.000   6.96%  ncclDevKernel_AllReduce_Sum_bf16_RING_LL
         2        600.000      300.000   5.22%  at::native::cunn_SoftMaxForward<4, float, float>

host waits in CUDA synchronisation: 0.400 ms in 4 calls (CPU time blocked, not GPU time):
     count       total_us  call
         4        400.000  cudaStreamSynchronize
"""

# pid 0: gemm [100, 110) us, nccl [105, 120), gelu [130, 140); a memcpy that is no kernel.
# Busy [100, 120) + [130, 140) = 30 us, two at once [105, 110) = 5 us, nccl not under
# compute [110, 120) = 10 us, span 40 us.
CHROME_TRACE = {"traceEvents": [
    {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rank 0 GPU 0"}},
    {"name": "sm90_xmma_gemm_bf16bf16_bf16f32", "cat": "kernel", "ph": "X", "ts": 1700000000000100.000,
     "dur": 10.0, "pid": 0, "tid": 7},
    {"name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "cat": "kernel", "ph": "X",
     "ts": 1700000000000105.000, "dur": 15.0, "pid": 0, "tid": 9},
    {"name": "gelu", "cat": "kernel", "ph": "X", "ts": 1700000000000130.000, "dur": 10.0, "pid": 0,
     "tid": 7},
    {"name": "memcpy HtoD", "cat": "memory", "ph": "X", "ts": 1700000000000000.000, "dur": 500.0,
     "pid": 0, "tid": 7},
    {"name": "cudaStreamSynchronize", "cat": "sync", "ph": "X", "ts": 1700000000000101.000,
     "dur": 30.5, "pid": 99, "tid": 7},
]}


class CompareTest(unittest.TestCase):
    def setUp(self):
        self.folder = tempfile.TemporaryDirectory()
        self.addCleanup(self.folder.cleanup)

    def write(self, name, text):
        path = os.path.join(self.folder.name, name)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        return path

    def test_categories_by_name(self):
        self.assertEqual(compare.category("fmha_cutlassF_bf16_aligned_64x64_rf_sm80"), "attention/flash")
        self.assertEqual(compare.category("cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>"), "gemm")
        self.assertEqual(compare.category("ncclDevKernel_AllGather_RING_LL"), "nccl")
        self.assertEqual(compare.category("triton_tem_fused_addmm_gelu_3"), "gemm")
        self.assertEqual(compare.category("triton_tem_fused_flex_attention_0"), "attention/flash")
        self.assertEqual(compare.category("triton_per_fused_native_layer_norm_5"), "layer_norm")
        self.assertEqual(compare.category("void multi_tensor_apply_kernel<FusedAdamMathFunctor>"),
                         "adamw/multi_tensor")
        self.assertEqual(compare.category("at::native::cunn_SoftMaxForward<4>"),
                         "softmax/cross_entropy/classifier")
        self.assertEqual(compare.category("tessera::kernels::add"), "elementwise/other")

    def test_summary_totals_by_category(self):
        stats = compare.read_stats(self.write("a.summary.txt", ONE_GPU))
        totals = compare.by_category(stats)
        self.assertEqual(totals["gemm"], [10, 4000.0])
        self.assertEqual(totals["attention/flash"], [5, 2000.0])
        self.assertEqual(totals["layer_norm"], [5, 1500.0])
        self.assertEqual(totals["adamw/multi_tensor"], [1, 1000.0])
        self.assertEqual(totals["softmax/cross_entropy/classifier"], [2, 500.0])
        self.assertEqual(totals["elementwise/other"], [20, 1000.0])
        self.assertEqual(totals["nccl"], [0, 0.0])
        self.assertEqual(stats.figures, {"span": 12.0, "busy": 10.0, "overlap": 0.0,
                                         "exposed communication": 0.0, "host waits": 2.5})

    def run_main(self, *args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = compare.main(list(args))
        return code, out.getvalue(), err.getvalue()

    def row(self, table, name):
        match = re.search(rf"^{re.escape(name)}\s+(.*)$", table, re.MULTILINE)
        self.assertIsNotNone(match, f"no row {name} in\n{table}")
        return match.group(1).split()

    def test_side_by_side_table_per_step(self):
        a = self.write("one.summary.txt", ONE_GPU)
        b = self.write("two.summary.txt", TWO_GPU)
        code, table, _ = self.run_main(a, b, "--labels", "1gpu", "2gpu", "--steps", "2", "4", "--top", "3")
        self.assertEqual(code, 0)
        # gemm: A 4 ms over 2 steps = 2 ms/step, 40% of A; B 4.4 ms over 4 steps = 1.1 ms/step,
        # 4.4 / 11.5 = 38.3% of B; B - A = -0.9; B / A = 0.55.
        self.assertEqual(self.row(table, "gemm"), ["10", "2.000", "40.0%", "10", "1.100", "38.3%",
                                                  "-0.900", "0.55"])
        self.assertEqual(self.row(table, "nccl"), ["0", "0.000", "0.0%", "4", "0.200", "7.0%",
                                                  "+0.200", "-"])
        # The CUTLASS attention kernel counts as attention, the flash one too.
        self.assertEqual(self.row(table, "attention/flash")[:5], ["5", "1.000", "20.0%", "5", "0.500"])
        self.assertEqual(self.row(table, "total kernel time"),
                         ["43", "5.000", "100.0%", "47", "2.875", "100.0%", "-2.125", "0.57"])
        # Whole-trace figures per step too: busy 10 / 2 and 11 / 4.
        self.assertEqual(self.row(table, "busy (kernels' union)"), ["5.000", "2.750", "-2.250"])
        self.assertEqual(self.row(table, "exposed communication"), ["0.000", "0.075", "+0.075"])
        self.assertEqual(self.row(table, "host blocked in CUDA syncs"), ["1.250", "0.100", "-1.150"])
        self.assertIn("steps: A 2, B 4\n", table)
        # The summaries' graphs were replayed 2 (graph 3) and 4 times: auto finds the same.
        code, auto_table, _ = self.run_main(a, b, "--labels", "1gpu", "2gpu", "--steps", "auto",
                                            "--top", "3")
        self.assertEqual(code, 0)
        self.assertEqual(auto_table, table)
        self.assertIn("A = 1gpu: " + a, table)
        top = table[table.index("top 3 kernels"):].splitlines()[2:]
        self.assertEqual(len(top), 3)
        self.assertTrue(top[0].endswith("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"), top[0])
        # Ordered by the larger per-step time: flash (A 1.0) before fmha (B 0.5).
        self.assertTrue(top[1].endswith("flash_attention_forward<128, true>"), top[1])
        self.assertTrue(top[2].endswith("layer_norm_forward<__nv_bfloat16>"), top[2])

    def test_chrome_trace_input(self):
        path = self.write("t.rank0.json", json.dumps(CHROME_TRACE))
        stats = compare.read_stats(path)
        self.assertEqual(stats.kernels, {"sm90_xmma_gemm_bf16bf16_bf16f32": [1, 10.0],
                                         "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": [1, 15.0],
                                         "gelu": [1, 10.0]})
        for figure, value in {"span": 0.040, "busy": 0.030, "overlap": 0.005,
                              "exposed communication": 0.010, "host waits": 0.0305}.items():
            self.assertAlmostEqual(stats.figures[figure], value, places=9, msg=figure)
        self.assertIsNone(stats.graph_replays)
        # Graph 2's two nodes replayed three times (six records), graph 8's one node once.
        replayed = json.loads(json.dumps(CHROME_TRACE))
        for replay in range(3):
            for node in (40, 41):
                replayed["traceEvents"].append({
                    "name": "gelu", "cat": "kernel", "ph": "X", "ts": 200.0 + 10 * replay + node,
                    "dur": 1.0, "pid": 0, "tid": 7, "args": {"graph_id": 2, "graph_node_id": node}})
        replayed["traceEvents"].append({"name": "gelu", "cat": "kernel", "ph": "X", "ts": 300.0,
                                        "dur": 1.0, "pid": 0, "tid": 7,
                                        "args": {"graph_id": 8, "graph_node_id": 90}})
        self.assertEqual(compare.read_stats(self.write("g.json", json.dumps(replayed))).graph_replays, 3)
        code, table, _ = self.run_main(path, self.write("one.summary.txt", ONE_GPU))
        self.assertEqual(code, 0)
        self.assertEqual(self.row(table, "gemm")[:3], ["1", "0.010", "28.6%"])

    def test_bad_input_names_the_file(self):
        bad = self.write("notes.txt", "hello\n")
        code, _, err = self.run_main(bad, bad)
        self.assertEqual(code, 2)
        self.assertIn("notes.txt: no 'kernels by total time' table", err)
        broken = self.write("broken.summary.txt", ONE_GPU.replace("        10       4000.000",
                                                                  "        ten      4000.000"))
        code, _, err = self.run_main(broken, broken)
        self.assertEqual(code, 2)
        self.assertIn("broken.summary.txt:16: not a kernel row", err)
        code, _, err = self.run_main(os.path.join(self.folder.name, "missing.json"), bad)
        self.assertEqual(code, 2)
        self.assertIn("cannot read", err)
        code, _, err = self.run_main(self.write("x.json", "{\"traceEvents\": 3"), bad)
        self.assertIn("x.json: not a Chrome trace", err)
        one = self.write("one.summary.txt", ONE_GPU)
        for steps, message in ((["2"], "two positive numbers or 'auto', got 2"),
                               (["2", "0"], "got 2 0"), (["two", "4"], "got two 4")):
            code, _, err = self.run_main(one, one, "--steps", *steps)
            self.assertEqual(code, 2)
            self.assertIn(message, err)
        no_graphs = self.write("ng.summary.txt", HEADER.format(
            who="pid 9", span="1.000", busy="1.000", overlap="0.000", exposed="0.000", graphs="")
            + ONE_GPU[ONE_GPU.index("kernels by total time"):])
        code, _, err = self.run_main(one, no_graphs, "--steps", "auto")
        self.assertEqual(code, 2)
        self.assertIn("ng.summary.txt: no CUDA graph replays to count steps by", err)


class MergeTest(unittest.TestCase):
    def test_ranks_keep_their_tracks_and_times_line_up(self):
        def trace(process, pid, ts):
            return {"otherData": {"process": process}, "kernelNames": {process: "full " + process},
                    "traceEvents": [
                        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {}},
                        {"name": "k", "cat": "kernel", "ph": "X", "ts": ts, "dur": 1.5, "pid": pid,
                         "tid": 7}]}
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        paths = []
        # Rank 0 (pid 0), rank 1 (pid 100) and a process named by its id whose track (0)
        # collides with rank 0's. Times 1 ns apart at an absolute CUPTI magnitude.
        for name, content in (("a.rank0.json", trace("rank 0", 0, "1700000000000100.001")),
                              ("a.rank1.json", trace("rank 1", 100, "1700000000000100.002")),
                              ("b.pid42.json", trace("pid 42", 0, "1700000000000100.000"))):
            paths.append(os.path.join(folder.name, name))
            with open(paths[-1], "w", encoding="utf-8") as handle:
                handle.write(json.dumps(content).replace('"17000', "17000").replace('.001"', ".001")
                             .replace('.002"', ".002").replace('.000"', ".000"))
        output = os.path.join(folder.name, "merged.json")
        with contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(merge.main(paths + ["-o", output]), 0)
        with open(output, encoding="utf-8") as handle:
            merged = json.load(handle)
        kernels = [e for e in merged["traceEvents"] if e["ph"] == "X"]
        self.assertEqual([e["pid"] for e in kernels], [0, 100, 10000])
        self.assertEqual([e["ts"] for e in kernels], [0.001, 0.002, 0.0])
        self.assertEqual(merged["otherData"]["base_us"], "1700000000000100.000")
        self.assertEqual(merged["otherData"]["merged"], ["rank 0", "rank 1", "pid 42"])
        self.assertEqual(len(merged["kernelNames"]), 3)
        self.assertEqual(os.listdir(folder.name).count("merged.json"), 1)
        self.assertFalse([f for f in os.listdir(folder.name) if ".tmp" in f])
        bad = os.path.join(folder.name, "bad.json")
        with open(bad, "w", encoding="utf-8") as handle:
            handle.write("[1, 2]")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(merge.main([bad, "-o", output]), 2)
        self.assertIn("bad.json is not a Chrome trace", err.getvalue())


class GapsTest(unittest.TestCase):
    def test_idle_time_by_pair_and_per_step(self):
        def kernel(name, ts, dur, node, pid=0):
            return {"name": name, "cat": "kernel", "ph": "X", "ts": ts, "dur": dur, "pid": pid,
                    "tid": 7, "args": {"graph_id": 4, "graph_node_id": node}}
        events = []
        # Two replays of one step 101 us apart: layer_norm, a 4-byte memset 4 us after it, a
        # GEMM 6 us after the memset, and an attention kernel overlapping the GEMM's end (no
        # gap), then a second kernel on another stream inside the busy stretch.
        for step in range(2):
            t = 101.0 * step
            events += [kernel("layer_norm", t, 10, 1),
                       {"name": "memset", "cat": "memory", "ph": "X", "ts": t + 14, "dur": 1,
                        "pid": 0, "tid": 7, "args": {"bytes": 4, "graph_id": 4}},
                       kernel("gemm", t + 21, 30, 2), kernel("attention", t + 45, 20, 3),
                       kernel("inner", t + 50, 5, 4)]
        # Another device: one gap of 8 us.
        events += [kernel("a", 0, 2, 9, pid=1), kernel("b", 10, 2, 10, pid=1)]
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        path = os.path.join(folder.name, "t.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"traceEvents": events}, handle)
        devices, replays = gaps.read_activities(path)
        self.assertEqual(replays, 2)
        span, idle, pairs = gaps.idle_by_pair(devices[0])
        # Busy [0,10] [14,15] [21,65] | [101,111] [115,116] [122,166]; idle 4 + 6 + 36 + 4 + 6.
        self.assertEqual(span, 166)
        self.assertEqual(idle, 56)
        self.assertEqual(dict(pairs), {("layer_norm", "memset 4 B"): [2, 8],
                                       ("memset 4 B", "gemm"): [2, 12],
                                       ("attention", "layer_norm"): [1, 36]})
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(gaps.main([path, "--steps", "auto", "--top", "2"]), 0)
        lines = out.getvalue().splitlines()
        self.assertEqual(lines[0], "device 0: span 0.083 ms, idle 0.028 ms per step (2.0 steps)")
        self.assertEqual(lines[2].split(), ["0.018", "0.5", "36.00", "attention", "->",
                                            "layer_norm"])
        self.assertEqual(lines[3].split(), ["0.006", "1.0", "6.00", "memset", "4", "B", "->",
                                            "gemm"])
        self.assertEqual(len(lines), 7)  # two pairs per device
        self.assertEqual(lines[4], "device 1: span 0.006 ms, idle 0.004 ms per step (2.0 steps)")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(gaps.main([path, "--steps", "0"]), 2)
            no_graph = os.path.join(folder.name, "n.json")
            with open(no_graph, "w", encoding="utf-8") as handle:
                json.dump({"traceEvents": [{"name": "k", "ph": "X", "ts": 0, "dur": 1}]}, handle)
            self.assertEqual(gaps.main([no_graph, "--steps", "auto"]), 2)
            self.assertEqual(gaps.main([os.path.join(folder.name, "missing.json")]), 2)
        self.assertIn("positive number or 'auto', got 0", err.getvalue())
        self.assertIn("n.json: no CUDA graph replays", err.getvalue())
        self.assertIn("cannot read", err.getvalue())


if __name__ == "__main__":
    unittest.main()
