"""tessera.optim: AdamW, SGD, LR schedules (Tessera's own and transformers' under its names)
and global-norm clipping."""
from ._tessera.optim import (  # noqa: F401
    Optimizer, AdamW, SGD, LRSchedule, ConstantSchedule, CosineSchedule, LinearSchedule,
    clip_grad_norm_, grad_norm,
    get_scheduler, get_constant_schedule, get_constant_schedule_with_warmup,
    get_linear_schedule_with_warmup, get_cosine_schedule_with_warmup,
    get_cosine_with_hard_restarts_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup,
    get_polynomial_decay_schedule_with_warmup, get_inverse_sqrt_schedule,
)
