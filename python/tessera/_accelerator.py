"""tessera.Accelerator: Hugging Face Accelerate's API over Tessera's C++ Accelerator."""
from __future__ import annotations

import builtins
import contextlib
import os
import pickle

from . import _tessera as _C
from .tracking import TrackingMixin, split_log_with
from . import utils as _utils
from .state import PartialState, split_inputs

_PRECISIONS = ("no", "fp16", "bf16")


def _precision_name(mixed_precision):
    if mixed_precision is None:
        return ""  # TESSERA_MIXED_PRECISION (tessera launch) or "no"
    name = str(mixed_precision).lower()
    if name not in _PRECISIONS:
        raise ValueError(f"Unknown mixed_precision mode: {name}. Choose between {list(_PRECISIONS)}")
    return name


def _plugin_options(deepspeed_plugin, fsdp_plugin, explicit):
    """The C++ options the plugins set, checked against the ones given directly."""
    if deepspeed_plugin is not None and fsdp_plugin is not None:
        raise ValueError("Accelerator: deepspeed_plugin and fsdp_plugin cannot be used together")
    for name, plugin, kind in (("deepspeed_plugin", deepspeed_plugin, _utils.DeepSpeedPlugin),
                               ("fsdp_plugin", fsdp_plugin, _utils.FullyShardedDataParallelPlugin)):
        if plugin is not None and not isinstance(plugin, kind):
            raise TypeError(f"Accelerator: {name} must be a tessera.{kind.__name__}, got {type(plugin).__name__}")
    plugin = deepspeed_plugin or fsdp_plugin
    options = plugin.accelerator_options() if plugin is not None else {}
    for key, value in options.items():
        if key in explicit and explicit[key] != value:
            raise ValueError(f"Accelerator: {key}={explicit[key]!r} contradicts the plugin's {key}={value!r}")
    return options


class Accelerator(TrackingMixin, _C._Accelerator):
    """Prepares a model, optimizer, DataLoader and LR schedule for the launch environment.

    The process group comes from ``tessera launch`` / torchrun / mpirun / SLURM variables
    (one process when there are none) and is shared by every Accelerator and Trainer of the
    process (tessera.PartialState). Method names follow Accelerate::

        acc = tessera.Accelerator(gradient_accumulation_steps=2)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        for x, y in loader:
            with acc.accumulate(model):
                loss = model.loss(x, y)
                acc.backward(loss)
                acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step(); sched.step(); opt.zero_grad()
    """

    def __init__(self, *, mixed_precision=None, gradient_accumulation_steps=1, cpu=False,
                 deepspeed_plugin=None, fsdp_plugin=None, backend="auto",
                 bucket_bytes=_C.DEFAULT_BUCKET_BYTES, find_unused_parameters=False,
                 zero_stage=None, reduce_dtype="", log_with=None, project_dir=None,
                 logging_dir=None, project_config=None):
        explicit = {}  # what a plugin must agree with
        if zero_stage is not None:
            explicit["zero_stage"] = zero_stage
        if gradient_accumulation_steps != 1:
            explicit["gradient_accumulation_steps"] = gradient_accumulation_steps
        options = dict(mixed_precision=_precision_name(mixed_precision),
                       gradient_accumulation_steps=gradient_accumulation_steps, backend=backend,
                       bucket_bytes=bucket_bytes, find_unused_parameters=find_unused_parameters,
                       cpu=cpu, zero_stage=-1 if zero_stage is None else zero_stage,
                       reduce_dtype=reduce_dtype)
        plugin_options = _plugin_options(deepspeed_plugin, fsdp_plugin, explicit)
        options.update(plugin_options)
        # Trackers (tessera.tracking): names go to C++, tracker objects stay here.
        names, objects = split_log_with(log_with)
        project_dir = project_dir or getattr(project_config, "project_dir", None) or ""
        logging_dir = logging_dir or getattr(project_config, "logging_dir", None) or ""
        options.update(log_with=names, project_dir=str(project_dir), logging_dir=str(logging_dir))
        # The shared process group first, so this Accelerator does not own (and end) it.
        self._state = PartialState(cpu=cpu, backend=backend)
        super().__init__(**options)
        self._set_tracker_objects(objects)
        self.deepspeed_plugin, self.fsdp_plugin = deepspeed_plugin, fsdp_plugin
        self._custom_objects = []

    @property
    def state(self):
        return self._state

    @property
    def distributed_type(self):
        return self._state.distributed_type

    @property
    def is_last_process(self):
        return self._state.is_last_process

    def prepare(self, *objects):
        """Prepares each object in place and returns them (one object alone, else a tuple)."""
        self._prepare(*objects)
        return objects[0] if len(objects) == 1 else objects

    # ---- micro-steps and precision ----
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
    def autocast(self, autocast_handler=None):
        """Runs matmul, linear and attention in the mixed-precision compute dtype (bf16/fp16)
        inside the block; nothing changes with mixed_precision "no"."""
        if autocast_handler is not None:
            raise ValueError("Accelerator.autocast: autocast_handler is not supported by Tessera")
        if self.mixed_precision == "no":
            yield
            return
        self._enter_autocast()
        try:
            yield
        finally:
            self._exit_autocast()

    @contextlib.contextmanager
    def no_sync(self, model):
        """Backward inside the block accumulates gradients locally without synchronising them."""
        entered = self._enter_no_sync(model)
        try:
            yield
        finally:
            if entered:
                self._exit_no_sync()

    # ---- collectives over nested lists/tuples/dicts of tensors ----
    def gather(self, tensor):
        """Every process's tensors concatenated along dim 0, for each tensor of a nested
        list/tuple/dict."""
        return _utils.recursively_apply(lambda t: _C._Accelerator.gather(self, t), tensor, "gather")

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """gather() without the duplicates that padding added; objects that are not tensors
        are gathered with gather_object."""
        if use_gather_object or not _utils._tensors_only(input_data):
            gathered = _utils.gather_object(input_data if isinstance(input_data, (list, tuple)) else [input_data])
            return gathered
        return _utils.recursively_apply(lambda t: _C._Accelerator.gather_for_metrics(self, t), input_data,
                                        "gather_for_metrics")

    def reduce(self, tensor, reduction="sum", scale=1.0):
        def one(t):
            out = _C._Accelerator.reduce(self, t, reduction)
            return out if scale == 1.0 else out * scale
        return _utils.recursively_apply(one, tensor, "reduce")

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        return _utils.recursively_apply(
            lambda t: _C._Accelerator.pad_across_processes(self, t, dim, pad_index, pad_first), tensor,
            "pad_across_processes")

    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding=False):
        """This process's contiguous share of ``inputs``: a list, tuple, Tensor (rows) or dict
        (each value split, as Accelerate does); with apply_padding every share has the same
        length (gather_for_metrics drops the padding again)."""
        n = len(next(iter(inputs.values()))) if isinstance(inputs, dict) and inputs else \
            (inputs.shape[0] if isinstance(inputs, _C.Tensor) else len(inputs))
        self._split_between_processes(list(range(n)), apply_padding)  # remembers the padding
        yield split_inputs(inputs, self.process_index, self.num_processes, apply_padding)

    # ---- which process runs what ----
    @contextlib.contextmanager
    def main_process_first(self):
        with self._state.main_process_first():
            yield

    @contextlib.contextmanager
    def local_main_process_first(self):
        with self._state.local_main_process_first():
            yield

    def on_main_process(self, function=None):
        return self._state.on_main_process(function)

    def on_local_main_process(self, function=None):
        return self._state.on_local_main_process(function)

    def on_last_process(self, function=None):
        return self._state.on_last_process(function)

    def on_process(self, function=None, process_index=None):
        return self._state.on_process(function, process_index=process_index)

    def on_local_process(self, function=None, local_process_index=None):
        return self._state.on_local_process(function, local_process_index=local_process_index)

    def print(self, *args, **kwargs):
        """print() on the main process only."""
        if self.is_main_process:
            builtins.print(*args, **kwargs)

    # ---- state ----
    def register_for_checkpointing(self, *objects):
        """Objects with state_dict() and load_state_dict() that save_state/load_state keep
        too (custom_checkpoint_<i>.pkl, as Accelerate names them)."""
        invalid = [f"- Item at index {i}, `{type(o).__name__}`" for i, o in enumerate(objects)
                   if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if invalid:
            raise ValueError("All `objects` must include a `state_dict` and `load_state_dict` function to be "
                             "stored. The following inputs are invalid:\n" + "\n".join(invalid))
        self._custom_objects.extend(objects)

    def save_state(self, output_dir=None, safe_serialization=True):
        if output_dir is None:
            raise ValueError("Accelerator.save_state: output_dir is required")
        if not safe_serialization:
            raise ValueError("Accelerator.save_state: safe_serialization=False is not supported "
                             "(Tessera writes safetensors)")
        output_dir = os.fspath(output_dir)
        super().save_state(output_dir)
        if self.is_main_process:
            for i, obj in enumerate(self._custom_objects):
                with open(os.path.join(output_dir, f"custom_checkpoint_{i}.pkl"), "wb") as f:
                    pickle.dump(obj.state_dict(), f)
        self.wait_for_everyone()

    def load_state(self, input_dir=None):
        if input_dir is None:
            raise ValueError("Accelerator.load_state: input_dir is required")
        input_dir = os.fspath(input_dir)
        custom = [os.path.join(input_dir, f"custom_checkpoint_{i}.pkl") for i in range(len(self._custom_objects))]
        missing = [path for path in custom if not os.path.isfile(path)]
        if missing:  # before anything changes
            raise RuntimeError(f"Accelerator.load_state: {missing[0]} is missing (the objects given to "
                               f"register_for_checkpointing: {len(custom)})")
        super().load_state(input_dir)
        for obj, path in zip(self._custom_objects, custom):
            with open(path, "rb") as f:
                obj.load_state_dict(pickle.load(f))

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        """The model's weights (its state_dict) as model.safetensors on the main process, or
        as shards of at most max_shard_size with model.safetensors.index.json."""
        from ._save_model import save_model
        save_model(self, model, save_directory, max_shard_size, safe_serialization)

    def get_state_dict(self, model, unwrap=True):
        if unwrap:
            model = self.unwrap_model(model)
        return model.state_dict()

    def skip_first_batches(self, dataloader, num_batches=0):
        """The DataLoader with the first num_batches batches of its current epoch skipped
        (after load_state, which restored the position, the same position again)."""
        if not hasattr(dataloader, "skip_first_batches"):
            raise TypeError(f"Accelerator.skip_first_batches: cannot skip in a {type(dataloader).__name__}")
        return dataloader.skip_first_batches(num_batches)

    def end_training(self):
        """Waits for everyone, releases the prepared objects and ends the process group (the
        next Accelerator or Trainer starts a new one), as Accelerate's does."""
        if not _C.dist.is_initialized():
            return
        super().end_training()
        self._state.destroy_process_group()
