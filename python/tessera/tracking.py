"""Experiment trackers for tessera.Accelerator, with Accelerate's names and semantics.

``Accelerator(log_with=...)`` takes built-in tracker names ("tensorboard", "csv", "mlflow",
"all"), written by Tessera's C++ side on the main process, and tracker objects with
Accelerate's ``GeneralTracker`` interface (``name``, ``requires_logging_directory``,
``store_init_configuration(values)``, ``log(values, step=None)``, ``finish()``), for example
a subclass of :class:`GeneralTracker` below or of ``accelerate.tracking.GeneralTracker``.
An object with ``main_process_only = False`` is called on every process; others on the main
process only, as in Accelerate.
"""
from __future__ import annotations

import json

__all__ = ["GeneralTracker", "BuiltinTracker", "split_log_with"]

_REQUIRED_METHODS = ("store_init_configuration", "log", "finish")


class GeneralTracker:
    """The interface a tracker of one's own implements (Accelerate's GeneralTracker)."""

    name = ""
    requires_logging_directory = False
    main_process_only = True

    def store_init_configuration(self, values: dict):
        pass

    def log(self, values: dict, step: int | None = None, **kwargs):
        pass

    def finish(self):
        pass


class BuiltinTracker:
    """What ``Accelerator.get_tracker`` returns for a built-in tracker: its C++ tracker."""

    def __init__(self, accelerator, tracker):
        self._accelerator = accelerator  # keeps the C++ tracker's owner alive
        self._tracker = tracker

    @property
    def name(self):
        return self._tracker.name

    @property
    def requires_logging_directory(self):
        return self._tracker.requires_logging_directory

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values):
        self._tracker._store_init_configuration(json.dumps(values))

    def log(self, values, step=None, **kwargs):
        self._tracker._log(json.dumps(values), 0 if step is None else int(step))

    def finish(self):
        self._tracker.finish()


def _is_tracker_object(obj):
    return all(callable(getattr(obj, m, None)) for m in _REQUIRED_METHODS) and hasattr(obj, "name")


def split_log_with(log_with):
    """``log_with`` as (built-in names, tracker objects); TypeError for anything else."""
    if log_with is None:
        return [], []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    names, objects = [], []
    for item in items:
        value = getattr(item, "value", item)  # Accelerate's LoggerType members are str enums
        if isinstance(value, str):
            names.append(str(value))
        elif isinstance(item, type):
            raise TypeError(f"Accelerator: log_with takes tracker objects, not the class "
                            f"{item.__name__}; pass an instance")
        elif _is_tracker_object(item):
            objects.append(item)
        else:
            missing = [m for m in ("name",) + _REQUIRED_METHODS if not hasattr(item, m)]
            raise TypeError(f"Accelerator: log_with item {item!r} is neither a tracker name nor "
                            f"a tracker object (it lacks {', '.join(missing)})")
    return names, objects


class TrackingMixin:
    """Accelerate's tracker methods for tessera.Accelerator (see the module's docstring)."""

    def _set_tracker_objects(self, objects):
        self._tracker_objects = list(objects)
        self._active_tracker_objects = []

    def _tracker_objects_here(self):
        return [t for t in self._active_tracker_objects
                if self.is_main_process or not getattr(t, "main_process_only", True)]

    def init_trackers(self, project_name: str, config: dict | None = None,
                      init_kwargs: dict | None = None):
        """Starts every tracker for ``project_name`` and hands each ``config``."""
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"Accelerator.init_trackers: config must be a dict, got "
                            f"{type(config).__name__}")
        init_kwargs = dict(init_kwargs or {})
        object_names = {t.name for t in self._tracker_objects}
        builtin_kwargs = {k: v for k, v in init_kwargs.items() if k not in object_names}
        self._init_trackers(project_name, json.dumps(config), json.dumps(builtin_kwargs))
        self._active_tracker_objects = list(self._tracker_objects)
        if config is not None:
            for tracker in self._tracker_objects_here():
                tracker.store_init_configuration(config)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None):
        """Logs ``values`` ({name: value}) to every tracker at ``step``."""
        if not isinstance(values, dict):
            raise TypeError(f"Accelerator.log: values must be a dict, got {type(values).__name__}")
        self._log(json.dumps(values), step)
        log_kwargs = log_kwargs or {}
        for tracker in self._tracker_objects_here():
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called ``name`` (for a built-in one, its C++ tracker)."""
        for tracker in self._active_tracker_objects:
            if tracker.name == name:
                return getattr(tracker, "tracker", tracker) if unwrap else tracker
        try:
            return BuiltinTracker(self, self._get_tracker(name))
        except ValueError as e:
            if not self._active_tracker_objects:
                raise
            others = ", ".join(t.name for t in self._active_tracker_objects)
            raise ValueError(f"{e}; tracker objects: {others}") from None

    def end_training(self):
        """Finishes every tracker, then waits for every process (Accelerate's end_training)."""
        for tracker in self._tracker_objects_here():
            tracker.finish()
        self._active_tracker_objects = []
        super().end_training()
