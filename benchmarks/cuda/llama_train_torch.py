"""PyTorch reference for bench_llama_train: the same Llama training step as Tessera's nn::Llama
(pre-RMSNorm decoder layers, rotary embeddings in Hugging Face's rotate-half form, grouped-query
attention through F.scaled_dot_product_attention, SwiGLU MLP, projections without bias, an
untied or tied head), written in plain PyTorch so it runs under any transformers version, eager
or torch.compile, timed like gpt2_train_torch.py (whose benchmark loop it shares).

Prints one JSON line: {"mode", "ms_per_step", "tokens_per_s", "peak_gib", "loss", "torch"}.
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_train_torch import benchmark, common_arguments  # noqa: E402


def rms_norm_module(C, eps):
    if hasattr(nn, "RMSNorm"):  # torch >= 2.4: one fused kernel eager, and known to the compiler
        return nn.RMSNorm(C, eps=eps)

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(C))

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * self.weight

    return RMSNorm()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, C, H, H_kv):
        super().__init__()
        self.H, self.H_kv, self.D = H, H_kv, C // H
        self.q_proj = nn.Linear(C, H * self.D, bias=False)
        self.k_proj = nn.Linear(C, H_kv * self.D, bias=False)
        self.v_proj = nn.Linear(C, H_kv * self.D, bias=False)
        self.o_proj = nn.Linear(H * self.D, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.H_kv, self.D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.H_kv, self.D).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # as Hugging Face: rotate in the compute dtype
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.H_kv != self.H:
            try:  # torch >= 2.5 attends grouped heads without copies
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            except TypeError:
                groups = self.H // self.H_kv
                y = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                   v.repeat_interleave(groups, 1), is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.H * self.D))


class DecoderLayer(nn.Module):
    def __init__(self, C, H, H_kv, I, eps):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = rms_norm_module(C, eps), rms_norm_module(C, eps)
        self.self_attn = Attention(C, H, H_kv)
        self.gate_proj = nn.Linear(C, I, bias=False)
        self.up_proj = nn.Linear(C, I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, V, T, L, H, H_kv, C, I, theta, tied, eps=1e-6):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList(DecoderLayer(C, H, H_kv, I, eps) for _ in range(L))
        self.norm = rms_norm_module(C, eps)
        self.lm_head = None if tied else nn.Linear(C, V, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
        D = C // H
        inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx, targets):
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        logits = x @ self.embed_tokens.weight.t() if self.lm_head is None else self.lm_head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


def main():
    ap = common_arguments("Llama training step (PyTorch reference of bench_llama_train)")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--tied", action="store_true")
    args = ap.parse_args()
    benchmark(lambda: Llama(args.vocab, args.seq, args.layers, args.heads, args.kv_heads, args.channels,
                            args.intermediate, args.rope_theta, args.tied), args)


if __name__ == "__main__":
    main()
