"""Reads a TensorBoard log folder with TensorBoard's own EventAccumulator and prints JSON:
{"scalars": {tag: [[step, value, wall_time], ...]}, "texts": {tag: [[step, text], ...]}}.
Every event is kept (size_guidance 0), not TensorBoard's default reservoir sample."""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
out = {"scalars": {}, "texts": {}}
for tag in tags["scalars"]:
    out["scalars"][tag] = [[e.step, e.value, e.wall_time] for e in acc.Scalars(tag)]
for tag in tags.get("tensors", []):
    out["texts"][tag] = [[e.step, e.tensor_proto.string_val[0].decode()] for e in acc.Tensors(tag)]
print(json.dumps(out))
