"""tessera.Accelerator: Hugging Face Accelerate's API over Tessera's C++ Accelerator."""
from __future__ import annotations

import builtins
import contextlib

from . import _tessera as _C
from .tracking import TrackingMixin, split_log_with


class Accelerator(TrackingMixin, _C._Accelerator):
    """Prepares a model, optimizer, DataLoader and LR schedule for the launch environment.

    The process group comes from ``tessera launch`` / torchrun / mpirun / SLURM variables
    (one process when there are none). Method names follow Accelerate::

        acc = tessera.Accelerator(gradient_accumulation_steps=2)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        for x, y in loader:
            with acc.accumulate(model):
                loss = model.loss(x, y)
                acc.backward(loss)
                acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step(); sched.step(); opt.zero_grad()
    """

    def __init__(self, *, mixed_precision="", gradient_accumulation_steps=1, backend="auto",
                 bucket_bytes=25 << 20, find_unused_parameters=False, cpu=False, zero_stage=-1,
                 reduce_dtype="", log_with=None, project_dir=None, logging_dir=None,
                 project_config=None):
        # Trackers (tessera.tracking): names go to C++, tracker objects stay here.
        names, objects = split_log_with(log_with)
        project_dir = project_dir or getattr(project_config, "project_dir", None) or ""
        logging_dir = logging_dir or getattr(project_config, "logging_dir", None) or ""
        super().__init__(mixed_precision=mixed_precision,
                         gradient_accumulation_steps=gradient_accumulation_steps, backend=backend,
                         bucket_bytes=bucket_bytes, find_unused_parameters=find_unused_parameters,
                         cpu=cpu, zero_stage=zero_stage, reduce_dtype=reduce_dtype,
                         log_with=names, project_dir=str(project_dir), logging_dir=str(logging_dir))
        self._set_tracker_objects(objects)

    def prepare(self, *objects):
        """Prepares each object in place and returns them (one object alone, else a tuple)."""
        self._prepare(*objects)
        return objects[0] if len(objects) == 1 else objects

    @contextlib.contextmanager
    def accumulate(self, model):
        """One micro-step: gradients are synchronised only on every
        gradient_accumulation_steps-th one (``acc.sync_gradients`` says which); the prepared
        optimizer and schedule act only then."""
        self._enter_accumulate(model)
        try:
            yield
        finally:
            self._exit_accumulate()

    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding=False):
        """This process's contiguous share of ``inputs`` (a list); with apply_padding every
        share has the same length (gather_for_metrics drops the padding again)."""
        yield self._split_between_processes(list(inputs), apply_padding)

    def print(self, *args, **kwargs):
        """print() on the main process only."""
        if self.is_main_process:
            builtins.print(*args, **kwargs)
