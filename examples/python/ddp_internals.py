"""DDP from the inside, in notebook-sized cells (each ``# %%`` is one cell; run the whole file
as a script under ``tessera launch --nproc-per-node 2 python3 ddp_internals.py``, or as one
process, where the all-reduce is over a world of one).

What it shows, with checks that stop the script if the engine ever disagrees:
  1. the buckets: every parameter's .grad is a view into one flat gradient buffer per bucket;
  2. the grad-ready hook: the order in which gradients become final during backward (the last
     layer's first), which is when DDP launches a bucket's all-reduce;
  3. the all-reduce: after backward, the bucket holds the average over ranks of what each
     rank computed alone, the same as an explicit all_reduce(avg) of local gradients.
"""
# %% 1. A model prepared for data parallelism
import tessera
from tessera import nn, dist

acc = tessera.Accelerator(bucket_bytes=64 << 10)  # small buckets, so there are several
rank, world = acc.process_index, acc.num_processes
tessera.manual_seed(7)
config = nn.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
model = acc.prepare(nn.GPT(config))
ddp = acc.ddp_of(model)
names = ddp.parameter_names()
acc.print(f"world of {world}; {len(names)} parameters in {len(ddp.buckets())} buckets")

# %% 2. Bucket views: one flat buffer per bucket, each .grad a view into it
x = tessera.randint(0, 64, [2, 16], generator=tessera.Generator(100 + rank))
y = tessera.randint(0, 64, [2, 16], generator=tessera.Generator(200 + rank))

ready_order = []
handles = [tessera.register_grad_ready_hook(p, lambda leaf, name=name: ready_order.append(name))
           for p, name in zip(ddp.parameters(), names)]
acc.backward(model.loss(x, y))
for h in handles:
    h.remove()

params = ddp.parameters()
for b, bucket in enumerate(ddp.buckets()):
    flat = bucket.gradients
    acc.print(f"bucket {b}: {bucket.numel} elements ({len(bucket.params)} parameters), "
              f"first {names[bucket.params[0]]}")
    for i, offset in zip(bucket.params, bucket.offsets):
        grad = params[i].grad
        assert grad.data_ptr() == flat.data_ptr() + offset * flat.element_size(), names[i]
        assert grad.shares_memory_with(flat), names[i]
acc.print("every .grad is a view at its offset in its bucket's flat buffer")

# %% 3. The grad-ready hook: gradients become final from the output backwards
acc.print("first gradients ready:", ready_order[:3])
acc.print("last gradients ready: ", ready_order[-3:])
assert len(ready_order) == len(names)
# The blocks' parameters finish from the output backwards. The token table is the exception:
# it is also the output layer, and DDP synchronises its lookup's rows apart (docs/
# architecture.md), so its gradient is final first.
blocks = [n for n in ready_order if not n.startswith(("transformer.wte", "transformer.wpe"))]
assert names.index(blocks[-1]) < names.index(blocks[0])

# %% 4. The all-reduce: DDP's gradient is the average of every rank's own gradient
alone = nn.GPT(config)
alone.load_state_dict(model.state_dict())  # the same (broadcast) weights, no DDP
alone.loss(x, y).backward()
worst = 0.0
for p_ddp, (name, p_alone) in zip(ddp.parameters(), alone.named_parameters()):
    local = p_alone.grad.clone()
    dist.all_reduce(local, "avg")  # what the bucket's collective did, one tensor at a time
    worst = max(worst, (local - p_ddp.grad).abs().max().item())
acc.print(f"max |all_reduce(avg) of local gradients - DDP gradient| = {worst:.3g}")
assert worst < 1e-6
acc.print("ddp_internals: all checks passed")
acc.end_training()
