"""PyTorch reference for bench_gpt2_train: the same GPT-2 training step on one GPU
(bf16 autocast with fp32 parameters, F.scaled_dot_product_attention, fused AdamW,
global-norm clipping at 1.0, random tokens), eager or torch.compile, timed the same way
(warm-up steps, then the mean over the timed steps between device synchronisations; peak
memory is the allocator's peak over the timed steps).

Prints one JSON line: {"mode", "ms_per_step", "tokens_per_s", "peak_gib", "loss", "torch"}.
Under torch.distributed.run with WORLD_SIZE > 1 the model is wrapped in DistributedDataParallel
(NCCL, one GPU per rank, default 25 MB buckets) and rank 0 prints its per-GPU figures.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H, L):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        for proj in (self.c_proj, self.mlp_proj):
            nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * L))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V, T, L, H, C):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        for m in (self.wte, self.wpe):
            nn.init.normal_(m.weight, std=0.02)
        self.h = nn.ModuleList(Block(C, H, L) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied head
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


def common_arguments(description):
    """The flags every training-step reference takes (the model's shape flags come on top)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's CUDA time per kernel for one step (to stderr)")
    return ap


def benchmark(make_model, args):
    """Times args.steps training steps of make_model() (called on the right device) after
    args.warmup, bf16 autocast, fused AdamW (decay on rank >= 2), clipping at 1.0; prints the
    JSON line (rank 0)."""
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    dev = "cuda"
    model = make_model().to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    run = model
    if world > 1:
        run = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    if args.mode == "compile":
        run = torch.compile(run)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)

    def step():
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = run(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step().item()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / args.steps
    if args.profile:
        import sys
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90),
              file=sys.stderr)
    if rank == 0:
        print(json.dumps({"mode": args.mode, "ms_per_step": ms, "tokens_per_s": args.batch * args.seq / (ms / 1e3),
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": loss.item(),
                          "torch": torch.__version__}))
    if world > 1:
        torch.distributed.destroy_process_group()


def main():
    args = common_arguments("GPT-2 training step (PyTorch reference of bench_gpt2_train)").parse_args()
    benchmark(lambda: GPT(args.vocab, args.seq, args.layers, args.heads, args.channels), args)


if __name__ == "__main__":
    main()
