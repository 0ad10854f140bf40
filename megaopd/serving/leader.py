"""One client per job: under torchrun (the Megatron backend) every rank runs the same loop on the same batch, but
only global rank 0 talks to the servers; the others receive its answer, or its error, by broadcast.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_leader() -> bool:
    return not distributed() or dist.get_rank() == 0


def on_leader(fn: Callable[[], T]) -> T:
    """fn() on rank 0; every rank returns its result, or raises its exception (so all ranks stop together)."""
    if not distributed():
        return fn()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (True, fn())
        except Exception as error:  # handed to every rank, then raised everywhere
            box[0] = (False, error)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value
