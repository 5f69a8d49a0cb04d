"""PyTorch reference for bench_gpt2_train and the multi-GPU benchmarks: the same GPT-2
training step (bf16 autocast with fp32 parameters, F.scaled_dot_product_attention, fused
AdamW, global-norm clipping at 1.0, random tokens), eager or torch.compile, timed the same way
(warm-up steps, then the mean over the timed steps between device synchronisations; peak
memory is the allocator's peak over the timed steps).

Prints one JSON line per strategy run:
  {"mode", "strategy", "world", "ms_per_step", "tokens_per_s", "peak_gib", "loss", "torch"}
(tokens_per_s is per GPU; --grad-accum K runs K micro-batches per optimizer step, the
gradient synchronised in the last one only). Under torch.distributed.run with WORLD_SIZE > 1 --strategies picks
how the model is distributed (one after the other in this process, each on a fresh model):
  ddp   DistributedDataParallel (NCCL, one GPU per rank, default 25 MB buckets);
  zero  DDP with torch.distributed.optim.ZeroRedundancyOptimizer (optimizer state sharded,
        the counterpart of ZeRO stage 1);
  fsdp  FSDP FULL_SHARD (ZeRO stage 3): fully_shard per block and at the root with bf16
        parameters and f32 gradient reduction (PyTorch >= 2.6), else FullyShardedDataParallel
        with the same policy; its AdamW is the foreach one (fused AdamW over sharded
        parameters is not available in every version).
and rank 0 prints its per-GPU figures. A single process runs the plain model ("single").
--device cpu (gloo, no fused AdamW) is for checking the script without a GPU.
"""
import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def causal_attention(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # PyTorch < 2.0 (CPU checks only): the same attention, written out.
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


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
        y = causal_attention(q, k, v)
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
    """The flags every training-step reference takes (a model's own shape flags come on top)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--strategies", default="ddp",
                    help="comma-separated, run in turn when WORLD_SIZE > 1: ddp, zero, fsdp")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="micro-batches of --batch rows per optimizer step; DDP and ZeRO all-reduce "
                         "in the last one only (no_sync before it), as an accumulating user would")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's CUDA time per kernel for one step (to stderr)")
    return ap


def strategies_of(args):
    names = [s for s in args.strategies.split(",") if s]
    for s in names:
        if s not in ("ddp", "zero", "fsdp"):
            raise SystemExit(f"--strategies: unknown strategy '{s}' (ddp, zero, fsdp)")
    return names


def adamw(params, fused):
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    options = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
    if fused:
        options["fused"] = True
    return groups, options


def shard_fully(model, dev):
    """FSDP FULL_SHARD with bf16 parameters and f32 reductions; returns (module, clip)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # PyTorch >= 2.6
    except ImportError:
        fully_shard = None
    if fully_shard is not None:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    import functools
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    options = {}
    if dev.type == "cuda":
        options["device_id"] = dev
    if "use_orig_params" in FullyShardedDataParallel.__init__.__code__.co_varnames:
        options["use_orig_params"] = True
    wrapped = FullyShardedDataParallel(
        model, sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16), **options)
    return wrapped, lambda: wrapped.clip_grad_norm_(1.0)


def build(make_model, args, strategy, world, dev):
    """(module to call, optimizer, clip function) of one strategy on a fresh model."""
    torch.manual_seed(0)
    model = make_model().to(dev)
    fused = dev.type == "cuda"
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    run = model
    if strategy == "fsdp":
        run, clip = shard_fully(model, dev)
        groups, options = adamw(list(run.parameters()), fused=False)
        opt = torch.optim.AdamW(groups, **options)
    elif strategy == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        groups, options = adamw(list(model.parameters()), fused)
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **options)
    else:
        groups, options = adamw(list(model.parameters()), fused)
        opt = torch.optim.AdamW(groups, **options)
    if world > 1 and strategy in ("ddp", "zero"):
        ids = [dev.index] if dev.type == "cuda" else None
        run = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if args.mode == "compile":
        run = torch.compile(run)
    return run, opt, clip


def measure(make_model, args, strategy, world, rank, dev):
    run, opt, clip = build(make_model, args, strategy, world, dev)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    cuda = dev.type == "cuda"

    accum = args.grad_accum
    if accum < 1:
        raise SystemExit(f"--grad-accum must be >= 1 (got {accum})")
    # DDP's no_sync; FSDP2 and a single process have none and run the micro-steps as they are.
    no_sync = getattr(run, "no_sync", contextlib.nullcontext)

    def micro_step():
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
            loss = run(idx, targets)
        (loss / accum if accum > 1 else loss).backward()
        return loss

    def step():
        for _ in range(accum - 1):
            with no_sync():
                micro_step()
        loss = micro_step()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step().item()
    synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if world > 1:
        torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    synchronize()
    ms = (time.perf_counter() - start) * 1e3 / args.steps
    if args.profile and cuda:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90),
              file=sys.stderr)
    if rank == 0:
        print(json.dumps({"mode": args.mode, "strategy": strategy if world > 1 else "single", "world": world,
                          "ms_per_step": ms, "tokens_per_s": args.batch * args.seq * accum / (ms / 1e3),
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                          "loss": loss.item(), "torch": torch.__version__}), flush=True)


def benchmark(make_model, args):
    """Times args.steps training steps of make_model() after args.warmup under each of
    --strategies (with WORLD_SIZE > 1), bf16 autocast, AdamW (decay on rank >= 2), clipping at
    1.0; rank 0 prints one JSON line per strategy. Returns the exit status."""
    strategies = strategies_of(args)
    torch.backends.cuda.matmul.allow_tf32 = True
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dev = torch.device(args.device)
    if args.device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if world > 1:
        if dev.type == "cuda":
            torch.distributed.init_process_group("nccl", device_id=dev)
        else:
            torch.distributed.init_process_group("gloo")
    failed = 0
    for strategy in strategies if world > 1 else ["ddp"]:
        try:
            measure(make_model, args, strategy, world, rank, dev)
        except Exception as e:  # every rank fails alike (e.g. an API this version lacks): go on
            failed += 1
            print(json.dumps({"mode": args.mode, "strategy": strategy, "world": world,
                              "error": f"{type(e).__name__}: {e}"[:400]}),
                  file=sys.stdout if rank == 0 else sys.stderr, flush=True)
        gc.collect()  # the next strategy starts from a fresh model and an empty cache
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if world > 1:
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


def main():
    args = common_arguments("GPT-2 training step (PyTorch reference of bench_gpt2_train)").parse_args()
    return benchmark(lambda: GPT(args.vocab, args.seq, args.layers, args.heads, args.channels), args)


if __name__ == "__main__":
    sys.exit(main())
