"""Turns at the machine's memory for the two xdist workers of `make test`.

A 24 GB CI machine holds one real-size job (Megatron ranks at real width, an SGLang server of the 0.5B) beside the
worker that launched it, but not beside whatever the other worker runs: twice CI's OOM killer took a rank or a
worker so. `alone()` wraps such a job: it waits for the other worker's test in progress to finish, and the other
worker starts no test until the job is done. Every test outside the memory unit runs under `sharing()`.

Two flock(2) files, so the job cannot starve behind a stream of tests: the job takes the gate and then the memory,
both exclusive; a test takes the gate shared only long enough to take the memory shared. Each wait is bounded: past
WAIT_S the caller goes on without its turn and says so on stderr (a slow machine, never a hang).
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

WAIT_S = 1800


def _lock_file(name: str) -> Path:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"solo-{os.getpid()}")  # the same in both workers of one run
    return Path(tempfile.gettempdir()) / f"megaopd-tests-{run}.{name}"


def _take(path: Path, mode: int, who: str):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                print(f"machine_memory: {who} waited {WAIT_S} s for {path.name}; going on without it",
                      file=sys.stderr)
                os.close(fd)
                return None
            time.sleep(0.2)


def _release(fd) -> None:
    if fd is not None:
        os.close(fd)  # closing the descriptor drops its lock


_alone_depth = 0  # a job alone inside another (a server fixture's module) already has its turn
_sharing = False  # this process runs a test that shares the machine


@contextmanager
def alone(who: str):
    """Run the body with no test of the other worker running."""
    global _alone_depth
    if _sharing:
        raise RuntimeError(f"{who}: a job alone in a test that shares the machine would wait for itself; add the "
                           "test's file to the memory unit of tests/conftest.py (SHARED)")
    if _alone_depth:
        _alone_depth += 1
        try:
            yield
        finally:
            _alone_depth -= 1
        return
    gate = _take(_lock_file("gate"), fcntl.LOCK_EX, who)
    memory = _take(_lock_file("memory"), fcntl.LOCK_EX, who)
    _alone_depth = 1
    try:
        yield
    finally:
        _alone_depth = 0
        _release(memory)
        _release(gate)


@contextmanager
def sharing(who: str):
    """Run the body (one test) unless a job is alone, or waiting to be."""
    global _sharing
    gate = _take(_lock_file("gate"), fcntl.LOCK_SH, who)
    memory = _take(_lock_file("memory"), fcntl.LOCK_SH, who)
    _release(gate)
    _sharing = True
    try:
        yield
    finally:
        _sharing = False
        _release(memory)
