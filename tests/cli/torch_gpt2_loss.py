"""Loss of a Tessera model directory computed by PyTorch, independently of Tessera.

Reads model.safetensors as a plain state dict with the Hugging Face GPT-2 names (parsed
here with struct + numpy), runs GPT-2 (pre-LayerNorm blocks, Conv1D weights [in, out],
tanh GELU, tied or untied head) in torch, and prints the mean cross-entropy over the
first BATCHES sequential [B, T] windows of an llm.c token file, the rows `tessera eval`
scores: row b of batch k starts at token (k*B + b)*T.

usage: torch_gpt2_loss.py MODEL_DIR TOKENS B T BATCHES
"""
import json
import math
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "I32": np.int32, "F16": np.float16}


def load_state_dict(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    state = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        array = np.frombuffer(body[begin:end], dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
        state[name] = torch.from_numpy(array.astype(np.float64) if array.dtype.kind == "f" else array.copy())
    return state


def read_tokens(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype="<i4")
        assert header[0] == 20240520, "bad magic"
        dtype = "<u2" if header[1] == 1 else "<u4"
        return np.frombuffer(f.read(), dtype=dtype)[: header[2]].astype(np.int64)


def gpt2_logits(sd, cfg, idx):
    _, T = idx.shape
    C, H = cfg["n_embd"], cfg["n_head"]
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    ln = lambda x, p: F.layer_norm(x, (C,), sd[p + ".weight"], sd[p + ".bias"], eps)
    conv = lambda x, p: x @ sd[p + ".weight"] + sd[p + ".bias"]
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}"
        q, k, v = conv(ln(x, p + ".ln_1"), p + ".attn.c_attn").split(C, dim=2)
        heads = lambda t: t.view(t.shape[0], T, H, C // H).transpose(1, 2)
        q, k, v = heads(q), heads(k), heads(v)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(C // H)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(x.shape)
        x = x + conv(y, p + ".attn.c_proj")
        h = conv(ln(x, p + ".ln_2"), p + ".mlp.c_fc")
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        x = x + conv(h, p + ".mlp.c_proj")
    x = ln(x, "transformer.ln_f")
    head = sd.get("lm_head.weight", sd["transformer.wte.weight"])
    return x @ head.T


def main():
    model_dir, tokens_path, B, T, batches = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    cfg = json.load(open(model_dir + "/config.json"))
    assert cfg["model_type"] == "gpt2"
    sd = load_state_dict(model_dir + "/model.safetensors")
    tokens = torch.from_numpy(read_tokens(tokens_path))
    n = len(tokens)
    total = 0.0
    with torch.no_grad():
        for k in range(batches):
            pos = (k * B * T + torch.arange(B * T + 1)) % n
            window = tokens[pos]
            x, y = window[:-1].view(B, T), window[1:].view(B, T)
            logits = gpt2_logits(sd, cfg, x)
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    print(json.dumps({"loss": total / batches, "tokens": batches * B * T}))


if __name__ == "__main__":
    main()
