"""make test's hand-out to its xdist workers (tests/conftest.py): the shared units first, in SHARED's order, then
the files with slow tests, then the rest; each unit on one worker. xdist's own order (the units with the most tests
first) is the one this must beat: it started the memory unit, the run's longest chain, a third of the way in."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).parent


def test_the_shared_units_go_first_in_their_order_then_the_slow_files(tmp_path):
    for helper in ("conftest.py", "machine_memory.py"):
        shutil.copy(TESTS / helper, tmp_path / helper)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: a slow test\n")
    first = {unit: names[0] for unit, names in SHARED.items()}  # one file of each unit, one test each
    for file in first.values():
        (tmp_path / file).write_text("def test_one():\n    pass\n")
    (tmp_path / "test_slow_file.py").write_text("import pytest\n\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n")
    # the most tests, and first by name: first under xdist's order, and under the files' own
    (tmp_path / "test_a_crowd.py").write_text("".join(f"def test_{i}():\n    pass\n\n\n" for i in range(8)))
    # not this run's turns: the inner run is a run of its own (its own lock files and turns file)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-v", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    order = list(dict.fromkeys(re.findall(r"PASSED (test_\w+\.py)::", done.stdout)))
    assert order == [*first.values(), "test_slow_file.py", "test_a_crowd.py"], done.stdout[-3000:]
