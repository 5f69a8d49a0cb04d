"""tessera.utils: Accelerate's utilities under their names (accelerate.utils): nested
collectives over lists/tuples/dicts of tensors, gather_object, find_executable_batch_size,
the DeepSpeed and FSDP plugin objects, and size strings ("10GB")."""
from __future__ import annotations

import functools
import gc
import inspect
import pickle
import re

import numpy as _np

from . import _tessera as _C
from ._plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin  # noqa: F401
from .state import PartialState


def recursively_apply(function, data, what="gather"):
    """function(tensor) on every Tensor of a nested list/tuple/dict, keeping its shape."""
    if isinstance(data, (list, tuple)):
        return type(data)(recursively_apply(function, item, what) for item in data)
    if isinstance(data, dict):
        return type(data)({key: recursively_apply(function, value, what) for key, value in data.items()})
    if isinstance(data, _C.Tensor):
        return function(data)
    raise TypeError(f"Unsupported type {type(data).__name__} passed to {what}: only nested "
                    "lists/tuples/dicts of tessera.Tensor can be passed (gather_object takes "
                    "any picklable object)")


def _tensors_only(data):
    if isinstance(data, (list, tuple)):
        return all(_tensors_only(item) for item in data)
    if isinstance(data, dict):
        return all(_tensors_only(value) for value in data.values())
    return isinstance(data, _C.Tensor)


def gather_object(object):
    """Every process's list concatenated in process order (Accelerate's gather_object); on one
    process the object itself."""
    state = PartialState()
    if not state.use_distributed:
        return object
    if not isinstance(object, (list, tuple)):
        raise TypeError("gather_object: object must be a list or tuple (each process's items are "
                        f"concatenated, as in Accelerate); got {type(object).__name__}")
    world = _C.dist.world()
    payload = _np.frombuffer(pickle.dumps(list(object)), dtype=_np.uint8).astype(_np.int32)
    # Lengths first: every process learns how long each one's bytes are.
    lengths = _C._zeros([state.num_processes], _C.dtype.int64, None, False)
    world.all_gather(lengths, _C.tensor([len(payload)], dtype=_C.dtype.int64)).wait()
    lengths = [int(v) for v in lengths.tolist()]
    longest = max(lengths)
    padded = _np.zeros(longest, dtype=_np.int32)
    padded[:len(payload)] = payload
    out = _C._zeros([state.num_processes * longest], _C.dtype.int32, None, False)
    world.all_gather(out, _C.from_numpy(padded)).wait()
    everything = _np.asarray(out).astype(_np.uint8)
    result = []
    for rank, n in enumerate(lengths):
        result.extend(pickle.loads(everything[rank * longest: rank * longest + n].tobytes()))
    return result


def _out_of_memory(error):
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and "out of memory" in str(error))


def find_executable_batch_size(function=None, starting_batch_size: int = 128, reduce_batch_size_fn=None):
    """Decorator: calls function(batch_size, *args, **kwargs) with starting_batch_size, and
    again with a smaller one (halved, or reduce_batch_size_fn()) after each out-of-memory
    error, until it runs; RuntimeError when the batch size reaches zero."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size
    if reduce_batch_size_fn is None:
        def reduce_batch_size_fn():
            return batch_size // 2

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        nonlocal batch_size
        gc.collect()
        params = list(inspect.signature(function).parameters.keys())
        if len(params) < len(args) + 1:
            arg_str = ", ".join(f"{arg}={value}" for arg, value in zip(params[1:], args[1:]))
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument "
                            f"when called. Remove this as the decorator already does so: "
                            f"`{function.__name__}({arg_str})`")
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:  # noqa: BLE001  (only out-of-memory errors are retried)
                if not _out_of_memory(error):
                    raise
                gc.collect()
                batch_size = reduce_batch_size_fn()
    return decorator


def convert_file_size_to_int(size):
    """transformers' size strings: "10GB" = 10^10 bytes, "5GiB" = 5·2^30, "500MB", or an int."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)\s*", str(size).upper().replace("IB", "iB"))
    if not match:
        raise ValueError(f"`size` {size!r} is not in a valid format: use an integer followed by a unit "
                         "(e.g. '5GB' or '500MiB')")
    value, unit = float(match.group(1)), match.group(2)
    power = "KMGT".index(unit[0]) + 1
    return int(value * (2 ** (10 * power) if "i" in unit else 10 ** (3 * power)))
