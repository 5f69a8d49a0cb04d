"""Hugging Face `transformers` reference for Tessera's Llama (tests/nn/test_llama_parity.cpp).

  --make DIR --config JSON     builds LlamaForCausalLM(LlamaConfig(**config)) with its own
                               random init (seed 0; RMSNorm weights drawn around 1 so they
                               matter) and saves it with save_pretrained (safetensors).
  --model DIR --batch FILE --out FILE [--steps N]
                               loads DIR with from_pretrained (float32, eager attention) and
                               writes "logits" for the batch's "idx", "loss" (mean
                               cross-entropy against "targets"), "grad/<name>" of the first
                               step and "param/<name>" after N AdamW steps (lr 1e-3, betas
                               0.9/0.95, eps 1e-8, weight decay 0.1 on tensors of rank >= 2).
Exits 3 when transformers' LlamaForCausalLM is not usable (the C++ test then skips).
"""
import argparse
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from reference_gpt import read_safetensors, write_safetensors  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                 num_hidden_layers=1, num_attention_heads=2))
except Exception:  # missing, or a transformers that refuses this torch
    sys.exit(3)


def load(path):
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                             attn_implementation="eager")
    return model


def make(path, config):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)


def run(args):
    torch.set_num_threads(2)
    batch = read_safetensors(args.batch)
    idx, targets = batch["idx"].long(), batch["targets"].long()
    model = load(args.model)
    out = {}

    def loss_and_logits():
        logits = model(idx).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)), logits

    loss, logits = loss_and_logits()
    out["logits"], out["loss"] = logits.detach(), loss.detach().reshape(())
    loss.backward()
    params = dict(model.named_parameters())
    for name, p in params.items():
        out["grad/" + name] = p.grad.detach().clone()
    groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(args.steps):
        opt.zero_grad()
        loss_and_logits()[0].backward()
        opt.step()
    for name, p in params.items():
        out["param/" + name] = p.detach().clone()
    write_safetensors(args.out, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--make")
    ap.add_argument("--config")
    ap.add_argument("--model")
    ap.add_argument("--batch")
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if args.make:
        make(args.make, json.loads(args.config))
    else:
        run(args)


if __name__ == "__main__":
    main()
