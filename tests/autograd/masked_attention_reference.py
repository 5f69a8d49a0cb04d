"""PyTorch reference for Tessera's masked scaled_dot_product_attention
(tests/autograd/test_masked_attention.cpp), run with /usr/bin/python3 (torch 1.13, CPU).

torch 1.13 has no torch.nn.functional.scaled_dot_product_attention, so the reference is the
math it documents, written out: softmax(q k^T / sqrt(D) with a causal mask and attn_mask
(bool: False -> -inf; float: added)) v, grouped-query heads repeated.

Usage: masked_attention_reference.py CASES_JSON INPUTS OUT. For every case of CASES_JSON (a
list of {name, causal}), from INPUTS' "<name>/q", "/k", "/v", "/mask", "/dy", OUT gets:
  <name>/naive_out            the plain composition: NaN in a row whose keys are all masked
                              (what torch 1.13, and SDPA before PyTorch 2.5, give);
  <name>/out, /dq, /dk, /dv   PyTorch 2.5's _safe_softmax semantics: such rows give 0 and pass
                              no gradient (their scores are set to 0 before the softmax and
                              their probabilities to 0 after, so no NaN reaches backward).
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "nn"))
from reference_gpt import read_safetensors, write_safetensors  # noqa: E402

import torch  # noqa: E402


def scores_of(q, k, mask, causal):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        tq, tk = s.shape[-2], s.shape[-1]
        future = torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1)
        s = s.masked_fill(future, -math.inf)
    return s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask


def attend(p, v, groups):
    return p @ v.repeat_interleave(groups, dim=1)


def main(cases_path, inputs_path, out_path):
    torch.set_num_threads(2)
    with open(cases_path) as f:
        cases = json.load(f)
    t = read_safetensors(inputs_path)
    out = {}
    for c in cases:
        n, causal = c["name"], c["causal"]
        q, k, v = (t[f"{n}/{x}"].clone().requires_grad_(True) for x in "qkv")
        mask, dy = t[f"{n}/mask"], t[f"{n}/dy"]
        groups = q.shape[1] // k.shape[1]
        with torch.no_grad():
            out[f"{n}/naive_out"] = attend(torch.softmax(scores_of(q, k, mask, causal), -1), v, groups)
        s = scores_of(q, k, mask, causal)
        empty_rows = torch.isneginf(s).all(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(empty_rows, 0.0), -1).masked_fill(empty_rows, 0.0)
        y = attend(p, v, groups)
        y.backward(dy)
        out[f"{n}/out"] = y.detach()
        for name, x in zip(("dq", "dk", "dv"), (q, k, v)):
            out[f"{n}/{name}"] = x.grad
    write_safetensors(out_path, {k: v.contiguous() for k, v in out.items()})


if __name__ == "__main__":
    main(*sys.argv[1:])
