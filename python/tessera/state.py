"""tessera.PartialState: Accelerate's process-wide state (which process this is, the device, the
process group) and the helpers that need nothing else (main_process_first, on_main_process,
split_between_processes, ...).

The process group belongs to this state, not to an Accelerator or a Trainer: every
Accelerator and Trainer of the process shares it, so creating a second one (or dropping the
first) leaves the others working. ``Accelerator.end_training()`` and
``PartialState().destroy_process_group()`` end it, as in Accelerate; the next PartialState,
Accelerator or Trainer starts a new one. A group still open when the interpreter exits
normally is ended then (a collective: every process meets there).
"""
from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import sys

from . import _tessera as _C

_dist = _C.dist


class _Ownership:
    """Whether this module started the process group (and so ends it)."""
    owns_group = False
    exit_hook_registered = False
    failed = False  # an uncaught exception: the others may not reach the exit's barrier


def _note_uncaught(previous_hook):
    def hook(kind, value, traceback):
        _Ownership.failed = True
        previous_hook(kind, value, traceback)
    return hook


def _end_group_at_exit():
    if _Ownership.owns_group and not _Ownership.failed and _dist.is_initialized():
        _dist.destroy_process_group()
    _Ownership.owns_group = False


def _ensure_process_group(cpu=False, backend="auto"):
    if _dist.is_initialized():
        return
    _dist.init_process_group(backend=backend, cpu=cpu)
    _Ownership.owns_group = True
    if not _Ownership.exit_hook_registered:
        _Ownership.exit_hook_registered = True
        sys.excepthook = _note_uncaught(sys.excepthook)
        atexit.register(_end_group_at_exit)


def _do_nothing(*args, **kwargs):
    return None


class PartialState:
    """Accelerate's PartialState: one shared state per process (every instance sees the same).

    ``cpu=True`` keeps the process on the CPU when a GPU is visible; ``backend`` is
    init_process_group's ("auto", "tcp", "nccl", "mpi", "single"). Both apply only when this
    call starts the process group.
    """

    _shared_state: dict = {}

    def __init__(self, cpu: bool = False, backend: str = "auto", **kwargs):
        if kwargs:
            raise TypeError(f"PartialState() got an unexpected keyword argument '{next(iter(kwargs))}'")
        self.__dict__ = self._shared_state
        if not _dist.is_initialized():
            _ensure_process_group(cpu=cpu, backend=backend)
            self._cpu = cpu
        self._cpu = self.__dict__.get("_cpu", cpu)

    # ---- where this process sits ----
    @property
    def initialized(self) -> bool:
        return _dist.is_initialized()

    @property
    def process_index(self) -> int:
        return _dist.world().rank()

    @property
    def num_processes(self) -> int:
        return _dist.world().size()

    @property
    def local_process_index(self) -> int:
        return _dist.read_env()["local_rank"]

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def device(self):
        if not self._cpu and _C.cuda_is_available():
            return _C.device(f"cuda:{self.local_process_index % _C.cuda_device_count()}")
        return _C.device("cpu")

    @property
    def distributed_type(self) -> str:
        """Accelerate's DistributedType names: NO, MULTI_CPU or MULTI_GPU."""
        if not self.use_distributed:
            return "NO"
        return "MULTI_GPU" if self.device.type == "cuda" else "MULTI_CPU"

    @property
    def backend(self) -> str:
        return _dist.world().backend

    def __repr__(self):
        return (f"Distributed environment: {self.distributed_type}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")

    # ---- coordination ----
    def wait_for_everyone(self):
        _dist.world().barrier().wait()

    def destroy_process_group(self):
        """Ends the process group (a collective); the next PartialState starts a new one."""
        if _dist.is_initialized():
            _dist.destroy_process_group()
        _Ownership.owns_group = False

    def _goes_first(self, is_first: bool):
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def main_process_first(self):
        """The main process runs the block first, then the others (e.g. a download or a cache)."""
        yield from self._goes_first(self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self):
        yield from self._goes_first(self.is_local_main_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """This process's contiguous share of ``inputs`` (see split_inputs)."""
        yield split_inputs(inputs, self.process_index, self.num_processes, apply_padding)

    # ---- decorators: the function runs on some processes, elsewhere it does nothing ----
    def on_main_process(self, function=None):
        return self._runs_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function=None):
        return self._runs_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function=None):
        return self._runs_if(function, lambda: self.is_last_process)

    def on_process(self, function=None, process_index=None):
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        _check_index(process_index, "on_process")
        return self._runs_if(function, lambda: self.process_index == process_index)

    def on_local_process(self, function=None, local_process_index=None):
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        _check_index(local_process_index, "on_local_process")
        return self._runs_if(function, lambda: self.local_process_index == local_process_index)

    def _runs_if(self, function, selected):
        if function is None or not callable(function):
            raise ValueError("the on_* decorators take the function to decorate")

        # Decided at call time, so a function decorated before the launch still works.
        @functools.wraps(function)
        def run_here(*args, **kwargs):
            if selected() or not self.use_distributed:
                return function(*args, **kwargs)
            return _do_nothing()
        return run_here

    def print(self, *args, **kwargs):
        if self.is_main_process:
            builtins.print(*args, **kwargs)


def _check_index(index, method):
    if not isinstance(index, int) or isinstance(index, bool):
        raise ValueError(f"{method}: the process index must be given as an int, got {index!r}")


def _share(n, index, count, apply_padding):
    """[begin, end) of process `index`'s contiguous share of n items, and the padded length:
    the first n % count processes take one item more (Accelerate's split)."""
    base, extra = divmod(n, count)
    begin = index * base + min(index, extra)
    end = begin + base + (1 if index < extra else 0)
    return begin, end, (base + (1 if extra else 0)) if apply_padding else end - begin


def split_inputs(inputs, index, count, apply_padding=False):
    """Process `index`'s share of a list, tuple, Tensor (along dim 0) or dict (each value is
    split, as Accelerate does; the values must be equally long). With apply_padding every
    share has the same length, the last item repeated."""
    if isinstance(inputs, dict):
        lengths = {key: len(value) for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"split_between_processes: the dict's values have different lengths {lengths}")
        return {key: split_inputs(value, index, count, apply_padding) for key, value in inputs.items()}
    if isinstance(inputs, _C.Tensor):
        begin, end, padded = _share(inputs.shape[0], index, count, apply_padding)
        rows = list(range(begin, end))
        rows += [inputs.shape[0] - 1] * (padded - len(rows)) if inputs.shape[0] else []
        return _C.index_select(inputs, 0, _C.tensor(rows, dtype=_C.dtype.int64))
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__getitem__"):
        raise TypeError("split_between_processes: inputs must be a list, tuple, dict or Tensor, "
                        f"not {type(inputs).__name__}")
    begin, end, padded = _share(len(inputs), index, count, apply_padding)
    share = list(inputs[begin:end])
    if len(inputs):
        share += [inputs[-1]] * (padded - len(share))
    return type(inputs)(share) if isinstance(inputs, tuple) else share
