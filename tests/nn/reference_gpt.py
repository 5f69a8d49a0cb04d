"""PyTorch reference for Tessera's GPT parity test (run with /usr/bin/python3, torch 1.13 CPU).

Reads a GPT-2 model directory written by Tessera (config.json + model.safetensors in
Hugging Face GPT-2 layout) and a token batch, builds the same model in plain PyTorch,
and writes (as safetensors):
  logits, loss, grad/<name> of every parameter (first step),
  param/<name> after `--steps` AdamW steps with global-norm clipping and a
  warmup + cosine schedule,
and, to check that Tessera reads files written here, the trained weights under their
HF names in --weights-out.

The `safetensors` package is not installed, so the format is read and written here
with numpy + json.
"""
import argparse
import json
import math
import struct

import numpy as np
import torch
import torch.nn.functional as F

NP_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I32": np.int32,
             "I64": np.int64, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[base + begin:base + end], dtype=NP_DTYPES[info["dtype"]])
        out[name] = torch.from_numpy(arr.reshape(info["shape"]).copy())
    return out


def write_safetensors(path, tensors):
    names = sorted(tensors)
    header, blobs, offset = {}, [], 0
    inverse = {v: k for k, v in NP_DTYPES.items()}
    for name in names:
        arr = np.ascontiguousarray(tensors[name].detach().cpu().numpy())
        raw = arr.tobytes()
        header[name] = {"dtype": inverse[arr.dtype.type], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class GPT(torch.nn.Module):
    """GPT-2 with HF tensor names; Conv1D layout (y = x @ W + b)."""

    def __init__(self, cfg, weights):
        super().__init__()
        self.cfg = cfg
        self.params = torch.nn.ParameterDict()
        self.names = list(weights)
        for name, w in weights.items():
            self.params[name.replace(".", "__")] = torch.nn.Parameter(w.clone().float())

    def p(self, name):
        return self.params[name.replace(".", "__")]

    def ln(self, x, prefix):
        return F.layer_norm(x, (x.shape[-1],), self.p(prefix + ".weight"), self.p(prefix + ".bias"),
                            self.cfg["layer_norm_epsilon"])

    def conv1d(self, x, prefix):
        return x @ self.p(prefix + ".weight") + self.p(prefix + ".bias")

    def forward(self, idx):
        B, T = idx.shape
        C, H = self.cfg["n_embd"], self.cfg["n_head"]
        x = self.p("transformer.wte.weight")[idx] + self.p("transformer.wpe.weight")[:T]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        for i in range(self.cfg["n_layer"]):
            pre = f"transformer.h.{i}."
            h = self.ln(x, pre + "ln_1")
            q, k, v = self.conv1d(h, pre + "attn.c_attn").split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
            att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            x = x + self.conv1d(y, pre + "attn.c_proj")
            h = self.ln(x, pre + "ln_2")
            x = x + self.conv1d(gelu_tanh(self.conv1d(h, pre + "mlp.c_fc")), pre + "mlp.c_proj")
        x = self.ln(x, "transformer.ln_f")
        head = "lm_head.weight" if "lm_head.weight" in self.names else "transformer.wte.weight"
        return x @ self.p(head).t()


def lr_factor(step, warmup, total, min_ratio):
    if step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return min_ratio
    progress = (step - warmup) / (total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--weights-out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--max-norm", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    with open(args.model + "/config.json") as f:
        cfg = json.load(f)
    weights = read_safetensors(args.model + "/model.safetensors")
    batch = read_safetensors(args.batch)
    idx, targets = batch["idx"].long(), batch["targets"].long()
    model = GPT(cfg, weights)

    out = {}
    logits = model(idx)
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
    loss.backward()
    out["logits"] = logits.detach()
    out["loss"] = loss.detach().reshape([])
    for name in model.names:
        out["grad/" + name] = model.p(name).grad.detach().clone()

    decay = [model.p(n) for n in model.names if model.p(n).dim() >= 2]
    no_decay = [model.p(n) for n in model.names if model.p(n).dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.warmup, args.steps, args.min_lr_ratio))
    norms = []
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)))
        opt.step()
        sched.step()
    out["grad_norms"] = torch.tensor(norms, dtype=torch.float64)
    for name in model.names:
        out["param/" + name] = model.p(name).detach().clone()
    write_safetensors(args.out, out)
    write_safetensors(args.weights_out, {n: model.p(n).detach() for n in model.names})


if __name__ == "__main__":
    main()
