"""The learning rate at every step of transformers' schedules, for tests/optim.

Argument: a JSON list of cases {"name", "lr", "warmup", "total", "kwargs", "steps"}; prints a
JSON list with each case's lrs (the lr the optimizer holds during steps 0 .. steps-1).
"""
import json
import sys

import torch
from transformers import get_scheduler


def lrs_of(case):
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight], lr=case["lr"])
    schedule = get_scheduler(case["name"], optimizer, num_warmup_steps=case["warmup"],
                             num_training_steps=case["total"],
                             scheduler_specific_kwargs=case.get("kwargs") or {})
    out = []
    for _ in range(case["steps"]):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return out


print(json.dumps([lrs_of(c) for c in json.loads(sys.argv[1])]))
