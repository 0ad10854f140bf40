"""A small pool of worker processes that run one function with a hard wall-clock limit per call.

Some checks cannot be interrupted from inside: sympy simplifying a pathological expression, or one long C call
building a huge integer. A timer thread or a signal handler inside the same process fires only between bytecodes
(and not at all on a loaded machine when the interpreter is stuck in C), so a check runs here in a worker process
that the caller kills when its time is up; the next call gets a fresh worker. Workers are reused across calls, so
heavy imports are paid once per worker, and their start-up does not count against a call's limit.

    pool = KillablePool("math:gcd", size=2)
    pool.call([12, 18], timeout_s=5)   # the function's JSON result (6); CallTimeout past 5 s
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

_SERVE = r"""
import importlib, json, resource, sys
module, name, memory = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path[0] = sys.argv[4]  # the caller's package root, not the working directory (another checkout may be there)
out = sys.stdout
try:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))  # a blow-up dies here, not in the host's OOM killer
    fn = getattr(importlib.import_module(module), name)
except BaseException as e:  # the reason goes to the caller, whose error says it
    out.write("failed " + json.dumps(type(e).__name__ + ": " + str(e)[:300]) + "\n")
    out.flush()
    sys.exit(1)
out.write("ready\n")
out.flush()
for line in sys.stdin:
    try:
        reply = {"ok": fn(*json.loads(line))}
    except MemoryError:
        reply = {"error": "MemoryError"}
    except Exception as e:
        reply = {"error": type(e).__name__ + ": " + str(e)[:200]}
    out.write(json.dumps(reply) + "\n")
    out.flush()
"""


class CallTimeout(Exception):
    """A call ran past its wall-clock limit; its worker was killed."""


class WorkerFailed(RuntimeError):
    """A worker died, could not start, or the function raised."""

    reason = "worker_failed"


class _Worker:
    def __init__(self, target: str, memory_mb: int, startup_s: float):
        module, name = target.split(":")
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, module, name, str(memory_mb << 20), _PACKAGE_ROOT],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self._pending = b""
        try:
            line = self._line(time.monotonic() + startup_s)
        except WorkerFailed:
            line = f"failed {json.dumps(f'exited with code {self.proc.returncode}')}".encode()
        if line != b"ready":
            self.kill()
            if line is None:
                raise WorkerFailed(f"worker for {target} did not start within {startup_s:.0f} s")
            why = json.loads(line[7:]) if line.startswith(b"failed ") else f"it printed {line[:200]!r}"
            raise WorkerFailed(f"worker for {target} could not start: {why}")

    def _line(self, deadline: float) -> bytes | None:
        """The next line from the worker, None if none comes before ``deadline``; WorkerFailed if it died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.proc.wait()
                raise WorkerFailed(f"worker died (exit code {self.proc.returncode})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def call(self, args: list, timeout_s: float):
        try:
            self.proc.stdin.write((json.dumps(args) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            raise WorkerFailed(f"worker is gone: {e}") from None
        line = self._line(time.monotonic() + timeout_s)
        if line is None:
            raise CallTimeout()
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerFailed(reply["error"])
        return reply["ok"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class KillablePool:
    """Up to ``size`` workers running ``target`` ("module:function"); safe to call from many threads."""

    def __init__(self, target: str, size: int = 2, memory_mb: int = 4096, startup_s: float = 300.0):
        self.target, self.size, self.memory_mb, self.startup_s = target, size, memory_mb, startup_s
        self._idle: list[_Worker] = []
        self._alive = 0
        self._cond = threading.Condition()
        atexit.register(self.close)

    def call(self, args: list, timeout_s: float):
        """``target(*args)`` in a worker; CallTimeout after ``timeout_s`` seconds of wall clock (the worker is
        killed), WorkerFailed when it raised or died."""
        worker = self._take()
        try:
            result = worker.call(args, timeout_s)
        except (CallTimeout, WorkerFailed):
            if worker.proc.poll() is None and sys.exc_info()[0] is WorkerFailed:
                raise  # the function raised; its worker is fine and goes back to the pool
            worker.kill()
            worker = None
            raise
        finally:
            self._give(worker)
        return result

    def _take(self) -> _Worker:
        with self._cond:
            while not self._idle and self._alive >= self.size:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._alive += 1
        try:
            return _Worker(self.target, self.memory_mb, self.startup_s)
        except BaseException:
            self._give(None)
            raise

    def _give(self, worker: _Worker | None) -> None:
        with self._cond:
            if worker is None:
                self._alive -= 1
            else:
                self._idle.append(worker)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
            self._alive -= len(idle)
        for worker in idle:
            worker.kill()
