"""One client per job: under torchrun (the Megatron backend) every rank runs the same loop on the same batch, but
only global rank 0 talks to the servers; the others receive its answer, or its error, by broadcast.

The broadcast is a collective, so it runs on the main thread, where every rank reaches it at the same point of the
loop. Work that rank 0 does on another thread (the rollout pipeline's generation, overlapping the update) runs
``leader_only``: there ``on_leader`` calls ``fn`` without a broadcast on rank 0, and is a no-op elsewhere; the
main thread then hands its result to every rank with ``on_leader`` again, at a point all ranks share.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")
_local = threading.local()


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_leader() -> bool:
    return not distributed() or dist.get_rank() == 0


@contextmanager
def leader_only() -> Iterator[None]:
    """Within (on this thread): ``on_leader(fn)`` is ``fn()`` on rank 0 and None on the others, no collective."""
    _local.leader_only = True
    try:
        yield
    finally:
        _local.leader_only = False


def on_leader(fn: Callable[[], T]) -> T:
    """fn() on rank 0; every rank returns its result, or raises its exception (so all ranks stop together)."""
    if not distributed():
        return fn()
    if getattr(_local, "leader_only", False):
        return fn() if dist.get_rank() == 0 else None
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
