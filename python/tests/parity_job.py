"""Accelerate's methods on however many processes this job has (test_accelerate_parity.py runs
it as one process and as two under `tessera launch`); prints "parity checks passed"."""
import os
import sys
import tempfile

import numpy as np

import tessera
from tessera import nn, optim

out_dir = sys.argv[1]
acc = tessera.Accelerator(cpu=True)
rank, world = acc.process_index, acc.num_processes

# A second Accelerator, and dropping the first, leave the process group working.
other = tessera.Accelerator(cpu=True)
del acc
acc = other
acc.wait_for_everyone()

# gather over a nested structure: every process's rows, in process order.
mine = {"a": tessera.full([2], float(rank)), "b": [tessera.full([1, 3], rank + 10.0)]}
gathered = acc.gather(mine)
assert np.asarray(gathered["a"]).tolist() == [float(r) for r in range(world) for _ in range(2)]
assert np.asarray(gathered["b"][0]).shape == (world, 3)
assert np.asarray(gathered["b"][0])[:, 0].tolist() == [r + 10.0 for r in range(world)]

# gather_object: the processes' lists concatenated.
objects = tessera.gather_object([{"rank": rank}, f"text {rank}"])
assert objects == [item for r in range(world) for item in ({"rank": r}, f"text {r}")], objects

# split_between_processes: each value of a dict is split; padding and gather_for_metrics.
data = {"x": list(range(7)), "y": [str(i) for i in range(7)]}
with acc.split_between_processes(data) as share:
    assert set(share) == {"x", "y"} and share["y"] == [str(i) for i in share["x"]]
    gathered_x = tessera.gather_object(share["x"])
assert gathered_x == list(range(7))
with acc.split_between_processes(tessera.arange(5, dtype=tessera.float32), apply_padding=True) as rows:
    assert rows.shape[0] == -(-5 // world)
    assert np.asarray(acc.gather_for_metrics(rows)).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]

# main_process_first: the main process's block ends before the others' starts.
order = os.path.join(out_dir, "order.txt")
with acc.main_process_first():
    with open(order, "a") as f:
        f.write(f"{rank} {'found' if os.path.exists(order + '.main') else 'first'}\n")
    if acc.is_main_process:
        open(order + ".main", "w").close()
acc.wait_for_everyone()
lines = open(order).read().split("\n")[:world]
assert lines[0] == "0 first" and all(line.endswith("found") for line in lines[1:]), lines

# on_* decorators: the function runs where it should and does nothing elsewhere.
ran = []
acc.on_main_process(lambda: ran.append("main"))()
acc.on_last_process(lambda: ran.append("last"))()
acc.on_process(process_index=world - 1)(lambda: ran.append("chosen"))()
expected = (["main"] if rank == 0 else []) + (["last", "chosen"] if rank == world - 1 else [])
assert ran == expected, (ran, expected)

# no_sync: gradients stay this process's own; outside it they are averaged.
tessera.manual_seed(0)
model = nn.Linear(3, 1)
opt = optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
x = tessera.full([4, 3], float(rank + 1))
with acc.no_sync(model):
    acc.backward(model(x).sum())
local = np.asarray(model.parameters()[0].grad).copy()
np.testing.assert_allclose(local, np.full((3, 1), 4.0 * (rank + 1)))
opt.zero_grad()
acc.backward(model(x).sum())
np.testing.assert_allclose(np.asarray(model.parameters()[0].grad),
                           np.full((3, 1), 4.0 * np.mean(np.arange(1, world + 1))), rtol=1e-6)
opt.zero_grad()


# register_for_checkpointing: the object's state comes back with load_state.
class Counter:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


counter = Counter()
counter.count = 5
acc.register_for_checkpointing(counter)
state_dir = os.path.join(out_dir, "state")
acc.save_state(state_dir)
counter.count = 99
acc.load_state(state_dir)
assert counter.count == 5

# save_model: the weights once, from the main process, as safetensors.
acc.save_model(model, os.path.join(out_dir, "saved"))
assert os.path.isfile(os.path.join(out_dir, "saved", "model.safetensors"))
acc.print(f"parity checks passed on {world} process(es)")
acc.end_training()
