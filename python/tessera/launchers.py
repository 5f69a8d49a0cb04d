"""tessera.notebook_launcher: Accelerate's notebook_launcher, starting a function in several
processes of this machine (forked, as in a notebook) that meet in one process group."""
from __future__ import annotations

import multiprocessing
import os
import socket

from . import _tessera as _C


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as_rank(function, args, rank, world_size, environment):
    os.environ.update(environment)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    function(*args)


def notebook_launcher(function, args=(), num_processes=None, mixed_precision="no", use_port="29500",
                      master_addr="127.0.0.1", node_rank=0, num_nodes=1):
    """Runs function(*args) in num_processes processes (one process, in this one, when it is
    None or 1). Create the Accelerator inside `function`: the processes meet when it starts.
    Raises when a process fails, naming its rank and exit code."""
    if num_nodes != 1 or node_rank != 0:
        raise ValueError("notebook_launcher: one machine only (num_nodes=1, node_rank=0)")
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise ValueError(f"Unknown mixed_precision mode: {mixed_precision}. Choose between ['no', 'fp16', 'bf16']")
    if num_processes is None or num_processes == 1:
        os.environ["TESSERA_MIXED_PRECISION"] = mixed_precision
        return function(*args)
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"notebook_launcher: num_processes must be a positive int, got {num_processes!r}")
    if _C.dist.is_initialized():
        raise ValueError("To launch a multi-process training from your notebook, the `Accelerator` should only "
                         "be initialized inside your training function. Restart your notebook and make sure no "
                         "cells initializes an `Accelerator` (a process group exists in this process).")
    environment = {"MASTER_ADDR": master_addr,
                   "MASTER_PORT": str(use_port if use_port is not None else _free_port()),
                   "TESSERA_MIXED_PRECISION": mixed_precision}
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_run_as_rank, args=(function, args, rank, num_processes, environment))
                 for rank in range(num_processes)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    failed = [(rank, p.exitcode) for rank, p in enumerate(processes) if p.exitcode != 0]
    if failed:
        raise RuntimeError("notebook_launcher: " + ", ".join(f"process {rank} exited with code {code}"
                                                             for rank, code in failed))
