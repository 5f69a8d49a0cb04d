"""Hugging Face `transformers` interoperability check for Tessera's GPT model directories.

1. Loads the directory Tessera wrote (--tessera-dir) with GPT2LMHeadModel.from_pretrained
   and writes its logits on the token batch (--batch) to --out as "logits".
2. Builds a fresh GPT-2 with transformers (same config, its own random init), saves it with
   save_pretrained(safe_serialization=True) to --hf-dir, and adds its logits on the batch to
   --out as "hf_logits", for Tessera to load and compare.
Exits 3 when transformers is not importable (the C++ test then skips).
"""
import argparse
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from reference_gpt import read_safetensors, write_safetensors  # noqa: E402

try:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError:
    sys.exit(3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera-dir", required=True)
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    idx = read_safetensors(args.batch)["idx"].long()

    model = GPT2LMHeadModel.from_pretrained(args.tessera_dir).eval()
    with torch.no_grad():
        logits = model(idx).logits

    torch.manual_seed(0)
    cfg = GPT2Config.from_pretrained(args.tessera_dir)
    fresh = GPT2LMHeadModel(cfg).eval()
    fresh.save_pretrained(args.hf_dir, safe_serialization=True)
    with torch.no_grad():
        hf_logits = fresh(idx).logits
    write_safetensors(args.out, {"logits": logits, "hf_logits": hf_logits})


if __name__ == "__main__":
    main()
