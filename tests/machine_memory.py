"""Turns at the machine's memory for the xdist workers of `make test`.

A 24 GB CI machine holds one real-size job (Megatron ranks at real width, an SGLang server of the 0.5B) beside the
worker that launched it, but not beside whatever the other workers run: twice CI's OOM killer took a rank or a
worker so. `alone()` wraps such a job: it waits for the other workers' tests in progress to finish, and the other
workers start no test until the job is done. Every test outside the memory unit runs under `sharing()`, except
podman's and the Slurm clusters' (tests/conftest.py's NO_SHARING_TURN says why). A job alone has the machine's cores
too: `alone()` yields their number for the processes it starts, and gives this process's torch that many threads
while it holds the turn (the other workers' cores would idle otherwise).

Two flock(2) files, so the job cannot starve behind a stream of tests: the job takes the gate and then the memory,
both exclusive; a test takes the gate shared only long enough to take the memory shared. Each wait is bounded: past
WAIT_S the caller raises NoTurn naming who holds the turn (running without it is how CI's workers were OOM-killed).
Each holder records its name beside the lock file, so the message can say whom it waited for. Each job alone adds
a line to the run's turns file (who, seconds waited, seconds held): `make test` ends with their sum and the longest
waits (tests/conftest.py), the suite's serial part that no worker count shortens.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

WAIT_S = 1800


def _lock_file(name: str) -> Path:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"solo-{os.getpid()}")  # the same in both workers of one run
    return Path(tempfile.gettempdir()) / f"megaopd-tests-{run}.{name}"


class NoTurn(RuntimeError):
    """A wait for a turn ran past WAIT_S."""


def turns_file() -> Path:
    return _lock_file("turns")


def turns(path: Path) -> list[tuple[str, float, float]]:
    """The jobs alone of a run, as `alone` recorded them: (who, seconds waited for the turn, seconds held)."""
    if not path.exists():
        return []
    return [(who, float(waited), float(held))
            for who, waited, held in (line.rsplit("\t", 2) for line in path.read_text().splitlines())]


def forget_run() -> None:
    """Remove this run's files (its locks, their holders' records, its turns), once no party of it is left: the
    run that made them, at its end (tests/conftest.py)."""
    for name in ("gate", "memory", "turns"):
        path = _lock_file(name)
        shutil.rmtree(_holders(path), ignore_errors=True)
        path.unlink(missing_ok=True)


def _holders(path: Path) -> Path:
    """The directory of the lock's holders: one file per process, named by its pid, holding what it runs."""
    return path.with_name(path.name + ".holders")


def _holding(path: Path) -> list[str]:
    names = []
    for record in sorted(_holders(path).glob("*")):
        try:
            os.kill(int(record.name), 0)  # a holder killed mid-turn left its record; the kernel dropped its lock
            names.append(f"{record.read_text()} (pid {record.name})")
        except (ProcessLookupError, FileNotFoundError):
            continue
    return names


def _take(path: Path, mode: int, who: str) -> tuple[int, Path]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise NoTurn(f"machine_memory: {who} waited {WAIT_S} s for the {path.suffix[1:]} turn, held by "
                             f"{'; '.join(_holding(path)) or 'no live process on record'}") from None
            time.sleep(0.2)
    record = _holders(path) / str(os.getpid())
    record.parent.mkdir(exist_ok=True)
    record.write_text(who)
    return fd, record


def _release(held: tuple[int, Path]) -> None:
    fd, record = held
    record.unlink(missing_ok=True)
    os.close(fd)  # closing the descriptor drops its lock


_alone_depth = 0  # a job alone inside another (a server fixture's module) already has its turn
_sharing = False  # this process runs a test that shares the machine


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


@contextmanager
def every_core():
    """This process's torch (where it has imported it: the test parties have not) on every core, then as before."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(cores())
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def alone(who: str):
    """Run the body with no test of another worker running; yields the cores it may use (all of them)."""
    global _alone_depth
    if _sharing:
        raise RuntimeError(f"{who}: a job alone in a test that shares the machine would wait for itself; add the "
                           "test's file to the memory unit of tests/conftest.py (SHARED)")
    if _alone_depth:
        _alone_depth += 1
        try:
            yield cores()
        finally:
            _alone_depth -= 1
        return
    asked = time.monotonic()
    gate = _take(_lock_file("gate"), fcntl.LOCK_EX, who)
    try:
        memory = _take(_lock_file("memory"), fcntl.LOCK_EX, who)
    except NoTurn:
        _release(gate)
        raise
    _alone_depth = 1
    taken = time.monotonic()
    try:
        with every_core():
            yield cores()
    finally:
        _alone_depth = 0
        with turns_file().open("a") as record:  # one short line: an O_APPEND write lands whole
            record.write(f"{who}\t{taken - asked:.1f}\t{time.monotonic() - taken:.1f}\n")
        _release(memory)
        _release(gate)


@contextmanager
def sharing(who: str):
    """Run the body (one test) unless a job is alone, or waiting to be."""
    global _sharing
    gate = _take(_lock_file("gate"), fcntl.LOCK_SH, who)
    try:
        memory = _take(_lock_file("memory"), fcntl.LOCK_SH, who)
    finally:
        _release(gate)
    _sharing = True
    try:
        yield
    finally:
        _sharing = False
        _release(memory)
