"""PyTorch's side of bench_reduction_accuracy: reads float32 values (raw little-endian) and
prints the relative errors of torch's f32 sum / mean / var (unbiased) against float64, as one
JSON object: {"sum": e, "mean": e, "var": e}."""
import json
import sys

import numpy as np
import torch

values = np.fromfile(sys.argv[1], dtype=np.float32)
x = torch.from_numpy(values)
x64 = x.double()
ref = {"sum": x64.sum().item(), "mean": x64.mean().item(), "var": x64.var().item()}
got = {"sum": x.sum().item(), "mean": x.mean().item(), "var": x.var().item()}
print(json.dumps({k: abs(got[k] - ref[k]) / abs(ref[k]) for k in ref}))
