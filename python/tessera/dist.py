"""tessera.dist: the process group and collectives (PyTorch's names), DDP's buckets."""
from ._tessera.dist import (  # noqa: F401
    Work, ProcessGroup, init_process_group, is_initialized, destroy_process_group, world, read_env,
    Bucket, DistributedDataParallel,
)


def get_rank():
    return world().rank() if is_initialized() else read_env()["rank"]


def get_world_size():
    return world().size() if is_initialized() else read_env()["world_size"]


def all_reduce(tensor, op="sum", async_op=False):
    """In place: every rank ends with ``op`` ("sum", "avg", "max", "min") over all ranks."""
    work = world().all_reduce(tensor, op)
    return work if async_op else work.wait()


def broadcast(tensor, src=0, async_op=False):
    work = world().broadcast(tensor, src)
    return work if async_op else work.wait()


def barrier():
    world().barrier().wait()
