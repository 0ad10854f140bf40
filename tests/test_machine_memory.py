"""tests/machine_memory.py, as two xdist workers use it: a job alone waits for the test in progress, and no test
starts while it runs. Each party is a process of its own that logs when it holds its turn."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

PARTY = """
import sys, time
sys.path.insert(0, {tests!r})
from machine_memory import {kind}
log, hold, label = sys.argv[1], float(sys.argv[2]), sys.argv[3]
with {kind}(label):
    start = time.time()
    time.sleep(hold)
    open(log, "a").write(f"{{label}} {{start}} {{time.time()}}\\n")
"""


def party(kind: str, log: Path, hold: float, label: str, run: str) -> subprocess.Popen:
    code = PARTY.format(tests=str(Path(__file__).parent), kind=kind)
    return subprocess.Popen([sys.executable, "-c", code, str(log), str(hold), label],
                             env={"PYTEST_XDIST_TESTRUNUID": run, "PATH": "/usr/bin:/bin"})


def spans(log: Path) -> dict[str, tuple[float, float]]:
    return {label: (float(a), float(b)) for label, a, b in (line.split() for line in log.read_text().splitlines())}


def test_a_job_alone_waits_for_the_test_in_progress_and_holds_off_the_next(tmp_path):
    log, run = tmp_path / "log", uuid.uuid4().hex
    first = party("sharing", log, 1.5, "first_test", run)
    time.sleep(0.5)  # the first test holds its turn
    job = party("alone", log, 1.5, "job", run)
    time.sleep(0.5)  # the job waits at the memory lock, holding the gate
    second = party("sharing", log, 0.1, "second_test", run)
    for p in (first, job, second):
        assert p.wait(60) == 0
    t = spans(log)
    assert t["job"][0] >= t["first_test"][1]  # the job began after the test in progress ended
    assert t["second_test"][0] >= t["job"][1]  # and the test that asked during its wait began after it


def test_tests_share_the_machine_with_each_other(tmp_path):
    """The negative control of the locks' kinds: two tests overlap (a lock that serialised everything would pass
    the test above too)."""
    log, run = tmp_path / "log", uuid.uuid4().hex
    parties = [party("sharing", log, 1.5, f"test_{i}", run) for i in range(2)]
    for p in parties:
        assert p.wait(60) == 0
    (a0, a1), (b0, b1) = spans(log).values()
    assert max(a0, b0) < min(a1, b1)
