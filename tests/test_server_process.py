"""The process side of megaopd's SGLang servers, without SGLang: the ports they are given and how they are stopped.
(tests/test_sglang.py launches the real server, its first port taken.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from megaopd.rollout.serving.server import PortTaken, SGLangServer, _ephemeral_low, _group_members, free_port


def test_free_ports_lie_below_the_ephemeral_range_where_outgoing_connections_take_theirs():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert all(port < low for port in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random: two launches at once rarely get the same one


def test_two_processes_seeded_alike_draw_other_ports():
    """A trainer seeds `random` (run.trainer.seed_everything): two trainers seeded alike on one machine (two test
    workers in CI) drew the same port from it, and the second's start-up found the first's server healthy."""
    draws = []
    for _ in range(2):
        random.seed(0)
        draws.append([free_port() for _ in range(5)])
    assert draws[0] != draws[1]


class _OtherServer(BaseHTTPRequestHandler):
    """Another SGLang server, healthy, under another served model name."""

    def do_GET(self):
        body = json.dumps({"served_model_name": "someone-else"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body if self.path == "/model_info" else b"")

    def log_message(self, *args):
        pass


def test_a_start_whose_port_another_server_answers_is_a_taken_port(tmp_path: Path):
    """The launched process loads for tens of seconds before it binds its port (and then fails to); meanwhile the
    server already on that port answers /health. Start-up asks who answers (the served model name each start gets)
    and stops its own process, so that launch tries another port. A server attached by URL is whatever answers."""
    other = HTTPServer(("127.0.0.1", 0), _OtherServer)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    server = SGLangServer(f"http://127.0.0.1:{other.server_address[1]}")
    server.launch_args = [sys.executable, "-c", "import time; time.sleep(600)"]  # still loading
    server.env, server.log_path = dict(os.environ), tmp_path / "server.log"
    try:
        with pytest.raises(PortTaken, match="another server answers at .* launched there"):
            server.start(timeout_s=30)
        assert server.process is None  # its own process stopped
        attached = SGLangServer(server.url)  # a URL the user gave: whatever server answers there is the one
        attached.wait_healthy(timeout_s=30)
    finally:
        other.shutdown()
        server.stop()


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
