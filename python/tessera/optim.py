"""tessera.optim: AdamW, SGD, LR schedules and global-norm clipping."""
from ._tessera.optim import (  # noqa: F401
    Optimizer, AdamW, SGD, LRSchedule, ConstantSchedule, CosineSchedule, LinearSchedule,
    clip_grad_norm_, grad_norm,
)
