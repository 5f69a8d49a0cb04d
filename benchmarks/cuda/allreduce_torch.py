"""PyTorch's NCCL all-reduce bandwidth, the reference for example_allreduce_bandwidth: the
same float32 sizes (1 MiB x 4^k up to --max-mib), warm-up, iterations and bus-bandwidth
formula (algbw * 2(n-1)/n). Run under torch.distributed.run; rank 0 prints one line per size:
  bytes time_us algbw_GB/s busbw_GB/s
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-mib", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    n_ranks = dist.get_world_size()
    mib = 1
    while mib <= args.max_mib:
        buffer = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device="cuda")
        for _ in range(3):
            dist.all_reduce(buffer)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(buffer)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.iters
        nbytes = buffer.numel() * 4
        algbw = nbytes / seconds / 1e9
        if dist.get_rank() == 0:
            print(f"  {nbytes:12.0f} {seconds * 1e6:12.1f} {algbw:12.2f} {algbw * 2 * (n_ranks - 1) / n_ranks:12.2f}",
                  flush=True)
        mib *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
