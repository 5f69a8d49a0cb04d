"""Tessera from Python: tensors with autograd, GPT, AdamW, DataLoader, Accelerator and Trainer.

The engine is the C++ library (libtessera); this package is a thin layer over it, so a
training loop written here runs the same kernels, the same data order and the same
distributed code as the C++ API and the ``tessera`` command line. See docs/python.md.
"""
from __future__ import annotations

import builtins as _builtins
import contextlib as _contextlib

from . import _tessera as _C
from ._keywords import name_wrong_keywords as _name_wrong_keywords

for _native in (_C, _C.nn, _C.optim, _C.data, _C.dist):
    _name_wrong_keywords(_native, functions=_native is not _C)
from ._tessera import (  # noqa: F401  (re-exported)
    Tensor,
    Generator,
    HookHandle,
    device,
    dtype,
    manual_seed,
    default_generator,
    cuda_is_available,
    cuda_device_count,
    is_grad_enabled,
    set_grad_enabled,
    register_grad_ready_hook,
    register_hook,
    from_numpy,
    from_dlpack,
    to_dlpack,
    tensor,
    zeros_like,
    ones_like,
    empty_like,
    # maths (also methods of Tensor)
    exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu, abs, square, sin, cos, log1p, expm1,
    reciprocal, silu, neg, maximum, minimum, eq, ne, lt, le, gt, ge, swiglu, clamp, pow, where,
    masked_fill, sum, mean, amax, amin, logsumexp, prod, var, std, max, min, argmax, topk, cumsum,
    softmax, log_softmax, matmul, cat, stack, split, chunk, gather, index_select, multinomial,
)
from ._tessera import TrainingArguments, EarlyStoppingCallback  # noqa: F401

from . import nn, optim, data, dist, utils  # noqa: E402,F401
from .state import PartialState  # noqa: E402,F401
from ._accelerator import Accelerator  # noqa: E402,F401
from ._trainer import Trainer  # noqa: E402,F401
from .utils import (  # noqa: E402,F401
    DeepSpeedPlugin, FullyShardedDataParallelPlugin, find_executable_batch_size, gather_object,
)
from .launchers import notebook_launcher  # noqa: E402,F401

__version__ = "0.1.0"

float32 = dtype.float32
float16 = dtype.float16
bfloat16 = dtype.bfloat16
float64 = dtype.float64
int32 = dtype.int32
int64 = dtype.int64
uint8 = dtype.uint8
bool = dtype.bool  # noqa: A001  (tessera.bool, as torch.bool)
float = float32  # noqa: A001
double = float64
long = int64
half = float16


def _sizes(size):
    if len(size) == 1 and not isinstance(size[0], int):
        return list(size[0])
    return list(size)


def empty(*size, dtype=None, device=None, requires_grad=False):
    return _C._empty(_sizes(size), dtype, device, requires_grad)


def zeros(*size, dtype=None, device=None, requires_grad=False):
    return _C._zeros(_sizes(size), dtype, device, requires_grad)


def ones(*size, dtype=None, device=None, requires_grad=False):
    return _C._ones(_sizes(size), dtype, device, requires_grad)


def full(size, fill_value, *, dtype=None, device=None, requires_grad=False):
    return _C._full(list(size), fill_value, dtype, device, requires_grad)


def rand(*size, generator=None, dtype=None, device=None, requires_grad=False):
    """Uniform in [0, 1), from ``generator`` (a tessera.Generator) or the default one."""
    return _C._rand(_sizes(size), dtype, device, requires_grad, generator)


def randn(*size, generator=None, dtype=None, device=None, requires_grad=False):
    """Standard normal, from ``generator`` (a tessera.Generator) or the default one."""
    return _C._randn(_sizes(size), dtype, device, requires_grad, generator)


def randint(low, high=None, size=None, *, generator=None, dtype=None, device=None):
    if high is None:
        low, high = 0, low
    return _C._randint(low, high, list(size), dtype, device, generator)


def arange(start, end=None, step=1, *, dtype=None, device=None, requires_grad=False):
    if end is None:
        start, end = 0, start
    if dtype is None and any(isinstance(v, _builtins.float) for v in (start, end, step)):
        dtype = float32
    return _C._arange(start, end, step, dtype, device, requires_grad)


class no_grad(_contextlib.ContextDecorator):
    """Turns recording off in a ``with`` block (or a decorated function), as torch.no_grad."""

    def __enter__(self):
        self._previous = _C.is_grad_enabled()
        _C.set_grad_enabled(False)
        return self

    def __exit__(self, *exc):
        _C.set_grad_enabled(self._previous)
        return False


class enable_grad(no_grad):
    def __enter__(self):
        self._previous = _C.is_grad_enabled()
        _C.set_grad_enabled(True)
        return self


def _tolist(self):
    """The values as nested Python lists (a copy)."""
    t = self.detach().cpu()
    if t.dtype in (bfloat16, float16):
        t = t.float()
    return t.numpy().tolist()


def _is_floating_point(self):
    return self.dtype.is_floating_point


Tensor.tolist = _tolist
Tensor.is_floating_point = _is_floating_point
