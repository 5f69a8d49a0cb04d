# PyTorch baseline for the quality bar: the same GPT-2 (4 layers, 4 heads, 128 channels,
# context 128, byte vocabulary 256), AdamW lr 1e-3 (PyTorch defaults otherwise), batch 32,
# sequential llm.c data order, trained for SECONDS of wall time, then the validation loss
# over the first 20 sequential [32, 128] windows of val.bin.
import math, sys, time
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F

def tokens(path):
    with open(path, "rb") as f:
        h = np.frombuffer(f.read(1024), dtype="<i4")
        return torch.from_numpy(np.frombuffer(f.read(), dtype="<u2")[: h[2]].astype(np.int64))

class Block(nn.Module):
    def __init__(s, C, H):
        super().__init__(); s.H = H
        s.ln1, s.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        s.attn, s.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        s.fc, s.fc_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.attn(s.ln1(x)).split(C, 2)
        q, k, v = [t.view(B, T, s.H, C // s.H).transpose(1, 2) for t in (q, k, v)]
        att = (q @ k.transpose(-1, -2)) / math.sqrt(C // s.H)
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        x = x + s.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return x + s.fc_proj(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))

class GPT(nn.Module):
    def __init__(s, V=256, T=128, C=128, L=4, H=4):
        super().__init__()
        s.wte, s.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        s.h = nn.ModuleList([Block(C, H) for _ in range(L)]); s.ln_f = nn.LayerNorm(C)
        for n, p in s.named_parameters():
            if p.dim() >= 2: nn.init.normal_(p, 0, 0.02 / (math.sqrt(2 * L) if n.endswith("proj.weight") else 1))
            elif n.endswith("bias"): nn.init.zeros_(p)
    def forward(s, idx):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1]))
        for b in s.h: x = b(x)
        return s.ln_f(x) @ s.wte.weight.T

def batch(data, k, B, T):
    w = data[(k * B * T + torch.arange(B * T + 1)) % len(data)]
    return w[:-1].view(B, T), w[1:].view(B, T)

def main():
    train, val, seconds = tokens(sys.argv[1]), tokens(sys.argv[2]), float(sys.argv[3])
    torch.manual_seed(0); torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 2)
    model = GPT(); opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    B, T, k, start = 32, 128, 0, time.time()
    while time.time() - start < seconds:
        x, y = batch(train, k, B, T); k += 1
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        opt.zero_grad(); loss.backward(); opt.step()
    elapsed = time.time() - start
    with torch.no_grad():
        v = sum(F.cross_entropy(model(x).view(-1, 256), y.view(-1)).item() for x, y in (batch(val, j, B, T) for j in range(20))) / 20
    print(f"pytorch: {k} steps in {elapsed:.1f} s ({1000 * elapsed / k:.0f} ms/step), train loss {loss.item():.4f}, val_loss {v:.4f}")

main()
