"""Megatron's distributed checkpoints on disk: writing one safely under a preemption signal, and retention.

The preemption signals (USR1 before the time limit, TERM on preemption) reach every process of the job step:
Slurm signals the whole step and torchrun's agent signals each worker's process group. Megatron's checkpoint
writer starts helper processes (a ``multiprocessing`` Manager that collects the write results, forked writers),
whose default action on either signal is to die, so the very checkpoint the signal asked for would fail. They are
started with those signals blocked, a mask they inherit; the trainer's own handler runs once the save returns.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
from multiprocessing import resource_tracker
from pathlib import Path

PREEMPTION_SIGNALS = {signal.SIGUSR1, signal.SIGTERM}


@contextlib.contextmanager
def preemption_signals_blocked():
    """Hold USR1 and TERM pending in this thread, and in every process started from it, until the block exits."""
    # The resource tracker unblocks TERM in the caller while it starts itself: start it before blocking.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def save(sharded_state: dict, directory: str | Path) -> None:
    """Write megatron's distributed checkpoint of `sharded_state` to `directory` (collective over all ranks)."""
    from megatron.core import dist_checkpointing

    Path(directory).mkdir(parents=True, exist_ok=True)
    with preemption_signals_blocked():
        dist_checkpointing.save(sharded_state, str(directory))


def keep_newest(checkpoint_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` ``step_*`` checkpoints in `checkpoint_dir` (call it on one rank)."""
    if keep > 0:
        for old in sorted(checkpoint_dir.glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
