"""tests/machine_memory.py, as two xdist workers use it: a job alone waits for the test in progress, no test
starts while it runs, and a wait past its limit fails naming who holds the turn. Each party is a process of its own
that logs when it holds its turn."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from machine_memory import forget_run, turns, turns_file

pytestmark = pytest.mark.timeout(120)

PARTY = """
import os, sys, time
sys.path.insert(0, {tests!r})
import machine_memory
from machine_memory import {kind}
log, hold, label = sys.argv[1], float(sys.argv[2]), sys.argv[3]
machine_memory.WAIT_S = float(sys.argv[4])
with {kind}(label):
    start = time.time()
    open(f"{{log}}.{{label}}.held", "w").close()  # for a test that must know the turn is taken before it goes on
    while time.time() - start < hold and not os.path.exists(log + ".release"):  # released early by the test
        time.sleep(0.05)
    open(log, "a").write(f"{{label}} {{start}} {{time.time()}}\\n")
"""


@pytest.fixture
def run(monkeypatch) -> str:
    """A run of its own for the test's parties (its own lock files), its files removed after the test."""
    name = uuid.uuid4().hex
    yield name
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", name)
    forget_run()
    assert not list(Path(tempfile.gettempdir()).glob(f"megaopd-tests-{name}*"))


def party(kind: str, log: Path, hold: float, label: str, run: str, wait_s: float = 60) -> subprocess.Popen:
    code = PARTY.format(tests=str(Path(__file__).parent), kind=kind)
    return subprocess.Popen([sys.executable, "-c", code, str(log), str(hold), label, str(wait_s)],
                            env={"PYTEST_XDIST_TESTRUNUID": run, "PATH": "/usr/bin:/bin"}, stderr=subprocess.PIPE,
                            text=True)


def holding(log: Path, label: str) -> None:
    """Wait until a party holds its turn: a fixed sleep is not enough where a loaded machine starts Python slowly."""
    deadline = time.time() + 60
    while not Path(f"{log}.{label}.held").exists():
        assert time.time() < deadline, "the party never took its turn"
        time.sleep(0.05)


def release(log: Path) -> None:
    """End every party of `log` that is still holding its turn."""
    Path(f"{log}.release").touch()


def spans(log: Path) -> dict[str, tuple[float, float]]:
    lines = log.read_text().splitlines()
    return {label: (float(a), float(b)) for label, a, b in (line.rsplit(" ", 2) for line in lines)}


def test_a_job_alone_waits_for_the_test_in_progress_and_holds_off_the_next(tmp_path, monkeypatch, run):
    log = tmp_path / "log"
    first = party("sharing", log, 100, "first_test", run)  # held until the other two are queued
    holding(log, "first_test")
    job = party("alone", log, 1.5, "job", run)
    time.sleep(2)  # the job waits at the memory lock, holding the gate
    second = party("sharing", log, 0.1, "second_test", run)
    time.sleep(1)  # the second test waits at the gate
    release(log)
    for p in (first, job, second):
        assert p.wait(60) == 0
    t = spans(log)
    assert t["job"][0] >= t["first_test"][1]  # the job began after the test in progress ended
    assert t["second_test"][0] >= t["job"][1]  # and the test that asked during its wait began after it
    # make test's summary of the run's jobs alone: this one waited for the test in progress (released with it)
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", run)
    [(who, waited, held)] = turns(turns_file())
    assert who == "job" and waited >= 0.2 and held < 10, (waited, held)  # not waiting: 0.0


def test_tests_share_the_machine_with_each_other(tmp_path, run):
    """The negative control of the locks' kinds: two tests overlap (a lock that serialised everything would pass
    the test above too)."""
    log = tmp_path / "log"
    parties = [party("sharing", log, 1.5, f"test_{i}", run) for i in range(2)]
    for p in parties:
        assert p.wait(60) == 0
    (a0, a1), (b0, b1) = spans(log).values()
    assert max(a0, b0) < min(a1, b1)


def test_a_wait_past_its_limit_fails_naming_who_holds_the_turn(tmp_path, run):
    log = tmp_path / "log"
    job = party("alone", log, 100, "the 0.5B's SGLang server", run)  # held until the late test has given up
    holding(log, "the 0.5B's SGLang server")
    late = party("sharing", log, 0.1, "late_test", run, wait_s=0.5)
    _, err = late.communicate(timeout=60)
    release(log)
    assert late.returncode != 0 and job.wait(60) == 0
    assert f"NoTurn: machine_memory: late_test waited 0.5 s for the gate turn, held by the 0.5B's SGLang server " \
           f"(pid {job.pid})" in err, err
    assert list(spans(log)) == ["the 0.5B's SGLang server"]  # the late test never ran its body


def test_a_test_without_its_turn_fails_at_setup_and_the_worker_goes_on(tmp_path, run):
    """conftest's hook, as an xdist worker runs it: each test that waited too long fails at its setup with the
    one-line reason, without running, and the worker goes on to its next test (no internal error)."""
    (tmp_path / "short_wait.py").write_text("import machine_memory\nmachine_memory.WAIT_S = 0.5\n")
    (tmp_path / "test_late.py").write_text(
        "def test_late():\n    raise AssertionError('ran without its turn')\n\ndef test_next():\n    pass\n")
    job = party("alone", tmp_path / "log", 100, "a Megatron launch", run)  # held until pytest below has ended
    holding(tmp_path / "log", "a Megatron launch")
    tests = Path(__file__).parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "short_wait",
                           "-p", "conftest", "-q", "--rootdir", str(tmp_path), "-c", "/dev/null",
                           str(tmp_path / "test_late.py")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{tests}:{tests.parent}",
                               "PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_TESTRUNUID": run})
    release(tmp_path / "log")
    assert job.wait(60) == 0
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED and "2 errors" in proc.stdout, proc.stdout + proc.stderr
    for test in ("test_late", "test_next"):
        assert f"machine_memory: test_late.py::{test} waited 0.5 s for the gate turn, held by a Megatron launch " \
               f"(pid {job.pid})" in proc.stdout, proc.stdout
    assert "ran without its turn" not in proc.stdout


def test_a_job_alone_has_every_core_and_gives_them_back(monkeypatch, run):
    """While it holds its turn, this process's torch runs on every core and the job is told their number for the
    processes it starts (the other worker's core would idle); a job nested in it too; afterwards, as before."""
    import torch

    import machine_memory

    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", run)  # a run of its own: no other party's turn
    monkeypatch.setattr(machine_memory, "_sharing", False)  # under xdist this test shares its own run's machine
    monkeypatch.setattr(machine_memory, "cores", lambda: 3)  # not this machine's count, nor torch's own
    before = torch.get_num_threads()
    with machine_memory.alone("outer") as outer:
        with machine_memory.alone("nested") as nested:
            inside = torch.get_num_threads()
    assert (outer, nested, inside) == (3, 3, 3)
    assert torch.get_num_threads() == before
