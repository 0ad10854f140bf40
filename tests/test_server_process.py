"""The process side of megaopd's SGLang servers, without SGLang: the ports they are given and how they are stopped.
(tests/test_sglang.py launches the real server, its first port taken.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from megaopd.rollout.serving.server import SGLangServer, _ephemeral_low, _group_members, free_port


def test_free_ports_lie_below_the_ephemeral_range_where_outgoing_connections_take_theirs():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert all(port < low for port in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random: two launches at once rarely get the same one


# A server's tree: a parent that exits on SIGTERM, and a child that ignores it (as a busy scheduler may), writing
# its PID where the test reads it.
TREE = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def test_stop_returns_once_every_process_of_the_server_has_exited(tmp_path: Path):
    child_pid = tmp_path / "child.pid"
    server = SGLangServer("http://127.0.0.1:1")
    server.process = subprocess.Popen([sys.executable, "-c", TREE, str(child_pid)], start_new_session=True)
    deadline = time.monotonic() + 60
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline, "the tree's child never started"
        time.sleep(0.1)
    pgid, child = server.process.pid, int(child_pid.read_text())
    assert sorted(_group_members(pgid)) == sorted([pgid, child])

    server.stop(timeout_s=2)
    assert _group_members(pgid) == []  # the child too, though it ignored SIGTERM and its parent is gone
    assert server.process is None
    try:
        state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("Z", "X", "gone"), state  # a zombie has released its memory; only its parent can reap it
