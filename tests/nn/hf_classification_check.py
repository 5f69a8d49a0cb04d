"""Hugging Face `transformers` reference for Tessera's sequence-classification models
(tests/nn/test_sequence_classification.cpp).

  --make DIR --arch A --config JSON
        builds {Bert,DistilBert,GPT2,Llama}ForSequenceClassification(config) with its own
        random init (seed 0; norm weights drawn around 1 and biases around 0 so they matter)
        and saves it with save_pretrained (safetensors).
  --model DIR --arch A --batch FILE --out FILE [--steps N --lr LR]
        loads DIR with from_pretrained (float32, eager attention), in train mode (the configs
        have no dropout), and writes "logits" and "loss" of the batch ("input_ids",
        "attention_mask", "labels", and for BERT "token_type_ids") and "param/<name>" after N
        AdamW steps (betas 0.9/0.999, eps 1e-8, weight decay 0.01 on tensors of rank >= 2).
  --logits DIR --arch A --batch FILE --out FILE
        loads DIR (as Tessera saved it) and writes its "logits" for the batch in eval mode.
Exits 3 when transformers is not usable (the C++ test then skips).
"""
import argparse
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from reference_gpt import read_safetensors, write_safetensors  # noqa: E402

try:
    import torch
    import transformers
    transformers.BertConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)
except Exception:  # missing, or a transformers that refuses this torch
    sys.exit(3)

ARCHS = {
    "bert": ("BertConfig", "BertForSequenceClassification"),
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification"),
    "gpt2": ("GPT2Config", "GPT2ForSequenceClassification"),
    "llama": ("LlamaConfig", "LlamaForSequenceClassification"),
}


def model_class(arch):
    return getattr(transformers, ARCHS[arch][1])


def make(path, arch, config):
    torch.manual_seed(0)
    cfg = getattr(transformers, ARCHS[arch][0])(**config)
    model = model_class(arch)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name.lower() or "ln_" in name):
                p.normal_(1.0, 0.1) if name.endswith("weight") else p.normal_(0.0, 0.1)
            elif p.dim() == 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)


def load(path, arch):
    return model_class(arch).from_pretrained(path, torch_dtype=torch.float32,
                                             attn_implementation="eager")


def forward(model, arch, batch):
    kwargs = {"input_ids": batch["input_ids"].long(),
              "attention_mask": batch["attention_mask"].long()}
    if arch == "bert":
        kwargs["token_type_ids"] = batch["token_type_ids"].long()
    labels = batch["labels"]
    kwargs["labels"] = labels.long() if labels.dtype in (torch.int32, torch.int64) else labels
    return model(**kwargs)


def train(args):
    torch.set_num_threads(2)
    batch = read_safetensors(args.batch)
    model = load(args.model, args.arch).train()
    first = forward(model, args.arch, batch)
    out = {"logits": first.logits.detach(), "loss": first.loss.detach().reshape(())}
    params = dict(model.named_parameters())
    groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(args.steps):
        opt.zero_grad()
        forward(model, args.arch, batch).loss.backward()
        opt.step()
    for name, p in params.items():
        out["param/" + name] = p.detach().clone()
    write_safetensors(args.out, out)


def logits(args):
    torch.set_num_threads(2)
    batch = read_safetensors(args.batch)
    model = load(args.logits, args.arch).eval()
    with torch.no_grad():
        write_safetensors(args.out, {"logits": forward(model, args.arch, batch).logits})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--make")
    ap.add_argument("--config")
    ap.add_argument("--model")
    ap.add_argument("--logits")
    ap.add_argument("--arch", required=True, choices=sorted(ARCHS))
    ap.add_argument("--batch")
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5e-5)
    args = ap.parse_args()
    if args.make:
        make(args.make, args.arch, json.loads(args.config))
    elif args.model:
        train(args)
    else:
        logits(args)


if __name__ == "__main__":
    main()
