# PyTorch's NCCL all-reduce timed like example_allreduce_bandwidth (same sizes, float32,
# 3 warm-up calls, mean of --iters), printing the same columns, for a side-by-side
# comparison in one run:  torchrun --nproc-per-node 2 reference_allreduce.py
import argparse, os, time
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--max-mib", type=int, default=1024)
parser.add_argument("--iters", type=int, default=20)
args = parser.parse_args()
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
if rank == 0:
    print(f"# {world} ranks, torch {torch.__version__} nccl\n# {'bytes':>12} {'time_us':>12} {'algbw_GB/s':>12} {'busbw_GB/s':>12}")
mib = 1
while mib <= args.max_mib:
    buf = torch.ones(mib * (1 << 20) // 4, device="cuda")
    for _ in range(3):
        dist.all_reduce(buf)
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(buf)
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iters
    algbw = buf.numel() * 4 / seconds / 1e9
    if rank == 0:
        print(f"  {buf.numel() * 4:12.0f} {seconds * 1e6:12.1f} {algbw:12.2f} {algbw * 2 * (world - 1) / world:12.2f}")
    mib *= 4
dist.destroy_process_group()
