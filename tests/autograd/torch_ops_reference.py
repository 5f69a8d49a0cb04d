"""PyTorch (CPU) reference for tests/autograd/test_ops_parity.cpp.

Reads --cases (a JSON list of {"name", "op", "dtype", "params", "n_inputs"}) and --inputs
(safetensors): tensors "<name>/x<i>" (float64 values already
rounded to the case's dtype), optional "<name>/index", and "<name>/dy" (the upstream gradient
of output 0). Writes --out: "<name>/out" and "<name>/grad<i>" in float64. f32 and f64 cases
run in their dtype; f16 and bf16 cases run in float32 (PyTorch's CPU kernels for them compute
in float32 too), so the comparison there is against the exactly rounded result.
"""
import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0] + "/../nn")
from reference_gpt import read_safetensors, write_safetensors  # noqa: E402


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x, theta):  # x [B, T, H, D], positions 0..T-1
    T, D = x.shape[1], x.shape[3]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos = emb.cos().to(x.dtype)[None, :, None, :]
    sin = emb.sin().to(x.dtype)[None, :, None, :]
    return x * cos + rotate_half(x) * sin


def run(op, p, xs, index):
    if op in ("sin", "cos", "log1p", "expm1", "reciprocal", "silu", "erf", "gelu_erf"):
        f = {"silu": torch.nn.functional.silu, "gelu_erf": torch.nn.functional.gelu}.get(op) or getattr(torch, op)
        return f(xs[0])
    if op == "clamp":
        return torch.clamp(xs[0], min=p.get("min"), max=p.get("max"))
    if op == "swiglu":
        return torch.nn.functional.silu(xs[0]) * xs[1]
    if op == "var":
        return torch.var(xs[0], dim=p["dims"], correction=p["correction"], keepdim=p["keepdim"])
    if op == "std":
        return torch.std(xs[0], dim=p["dims"], correction=p["correction"], keepdim=p["keepdim"])
    if op == "logsumexp":
        return torch.logsumexp(xs[0], dim=p["dims"], keepdim=p["keepdim"])
    if op == "prod":
        return torch.prod(xs[0], dim=p["dim"], keepdim=p["keepdim"])
    if op == "cumsum":
        return torch.cumsum(xs[0], dim=p["dim"])
    if op in ("max", "min"):
        return getattr(torch, op)(xs[0], dim=p["dim"], keepdim=p["keepdim"]).values
    if op == "topk":
        return torch.topk(xs[0], p["k"], dim=p["dim"], largest=p["largest"]).values
    if op == "gather":
        return torch.gather(xs[0], p["dim"], index)
    if op == "scatter_add":
        return torch.scatter_add(xs[0], p["dim"], index, xs[1])
    if op == "index_select":
        return torch.index_select(xs[0], p["dim"], index)
    if op == "rms_norm":
        x, w = xs
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + p["eps"]) * w
    if op == "rope":
        return rope(xs[0], p["theta"])
    raise ValueError("unknown op " + op)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(2)
    with open(a.cases) as f:
        cases = json.load(f)
    tensors = read_safetensors(a.inputs)
    out = {}
    for c in cases:
        name = c["name"]
        dt = {"f64": torch.float64}.get(c["dtype"], torch.float32)
        xs = [tensors[f"{name}/x{i}"].to(dt).requires_grad_(True) for i in range(c["n_inputs"])]
        index = tensors[f"{name}/index"].long() if f"{name}/index" in tensors else None
        y = run(c["op"], c["params"], xs, index)
        y.backward(tensors[f"{name}/dy"].to(dt))
        out[f"{name}/out"] = y.detach().double().contiguous()
        for i, x in enumerate(xs):
            out[f"{name}/grad{i}"] = x.grad.double().contiguous()
    write_safetensors(a.out, out)


if __name__ == "__main__":
    main()
