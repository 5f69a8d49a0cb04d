"""PyTorch's all-reduce and reduce-scatter bandwidth, the reference for
example_allreduce_bandwidth: the same float32 sizes (1 MiB x 4^k up to --max-mib), warm-up,
iterations (issued back to back, waited for at the end) and nccl-tests' formulas: algbw =
bytes / time over the whole buffer (for reduce-scatter the input, all shards together);
busbw = algbw * 2(n-1)/n for all-reduce, algbw * (n-1)/n for reduce-scatter. Run under
torch.distributed.run; rank 0 prints one line per size and op:
  op bytes time_us algbw_GB/s busbw_GB/s
--device cpu (gloo) is for checking the script without a GPU (gloo has no reduce-scatter:
those rows are left out with a note).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def seconds_per_call(collective, iters, cuda):
    for _ in range(3):
        collective()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    works = [collective(async_op=True) for _ in range(iters)]
    for w in works:
        w.wait()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def reduce_scatter_of(output, buffer):
    # reduce_scatter_tensor from PyTorch 2.0 on; the private name before.
    fn = getattr(dist, "reduce_scatter_tensor", None) or getattr(dist, "_reduce_scatter_base")
    return lambda async_op=False: fn(output, buffer, async_op=async_op)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-mib", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--op", choices=["all_reduce", "reduce_scatter", "both"], default="all_reduce")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    n = dist.get_world_size()
    rank = dist.get_rank()

    def row(op, nbytes, seconds, bus_factor):
        algbw = nbytes / seconds / 1e9
        if rank == 0:
            print(f"  {op:<14} {nbytes:12.0f} {seconds * 1e6:12.1f} {algbw:12.2f} {algbw * bus_factor:12.2f}",
                  flush=True)

    if rank == 0:
        print(f"# {n} ranks, torch {torch.__version__} {dist.get_backend()}, {dev}", flush=True)
    mib = 1
    while mib <= args.max_mib:
        buffer = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device=dev)
        nbytes = buffer.numel() * 4
        if args.op != "reduce_scatter":
            row("all_reduce", nbytes,
                seconds_per_call(lambda async_op=False: dist.all_reduce(buffer, async_op=async_op),
                                 args.iters, cuda), 2 * (n - 1) / n)
        if args.op != "all_reduce" and buffer.numel() % n == 0:
            output = torch.empty(buffer.numel() // n, dtype=torch.float32, device=dev)
            if cuda:
                row("reduce_scatter", nbytes,
                    seconds_per_call(reduce_scatter_of(output, buffer), args.iters, cuda), (n - 1) / n)
            elif rank == 0:
                print(f"# reduce_scatter {nbytes}: not available on gloo", flush=True)
        del buffer
        mib *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
