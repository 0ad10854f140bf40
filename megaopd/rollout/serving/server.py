"""SGLang servers seen from the trainer: launch (or attach), wait for health, JSON over HTTP, stop by PID.

The trainer never imports sglang: servers are separate processes, usually from SGLang's own environment
(``rollout.sglang.python``), and everything crosses HTTP. A request that fails is retried a bounded number of times;
after that the error names the server, so a dead node is found from the log line alone.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from megaopd.config import SGLangConfig

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """A server did not answer, or answered with an error; the message names it."""


class PortTaken(ServerError):
    """The port a server was given was taken before it could bind it."""


LAUNCH_TRIES = 3  # ports a launch tries before it gives up
# Ports from the OS's entropy, not `random`: a trainer seeds `random`, and two trainers seeded alike on one machine
# (two test workers in CI) drew the same port and ended up sharing one server.
_PORTS = random.SystemRandom()


def free_port() -> int:
    """A port nothing listens on, drawn below the kernel's ephemeral range. ``bind(0)`` draws from that range, where
    every outgoing connection takes its local port: in the tens of seconds a server loads before it binds, a busy
    machine's connections can take the port it was given (seen in CI: ``[Errno 98] address already in use``)."""
    low = _ephemeral_low()
    for _ in range(100):
        port = _PORTS.randrange(20000, low) if low > 20000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise ServerError(f"no free TCP port found in [20000, {low})")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _group_members(pgid: int) -> list[int]:
    """The live (not yet exited) processes of process group `pgid`: a zombie has released its memory already."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # exited while we read
        if int(group) == pgid and state not in "ZX":
            members.append(int(stat.parent.name))
    return members


class SGLangServer:
    """One server: its URL, and its process when megaopd launched it (then it can be restarted and is stopped)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.process: subprocess.Popen | None = None
        # Set for a server megaopd launched: enough to start it again on the weights it serves now.
        self.launch_args: list[str] | None = None
        self.env: dict[str, str] | None = None
        self.log_path: Path | None = None
        self._log_start = 0  # where the last start's lines begin in the log (it is appended to)
        self.model_path, self.weight_version = "", "0"
        self.name = ""  # the served model name each start gets: how wait_healthy knows the server that answers

    @classmethod
    def launch(cls, model_path: str, cfg: SGLangConfig, dtype: str, log_path: Path,
               weight_version: str = "0") -> "SGLangServer":
        python = cfg.python or sys.executable
        for attempt in range(1, LAUNCH_TRIES + 1):
            port = free_port()
            server = cls(f"http://127.0.0.1:{port}")
            server.launch_args = [python, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port),
                                  "--dtype", dtype, *(["--max-total-tokens", str(cfg.max_total_tokens)]
                                                      if cfg.max_total_tokens else []), *cfg.server_args]
            server.env = dict(os.environ) | cfg.env
            server.log_path = log_path
            server.model_path, server.weight_version = str(model_path), weight_version
            try:
                server.start(cfg.startup_timeout_s)
                return server
            except PortTaken as e:
                if attempt == LAUNCH_TRIES:
                    raise
                log.warning("%s; launching again on another port", e)

    @property
    def launched(self) -> bool:
        return self.launch_args is not None

    # ---- process ----
    def start(self, timeout_s: float) -> None:
        assert self.launched, f"{self.url} was attached, not launched: megaopd cannot start it"
        self.name = f"megaopd-{uuid.uuid4().hex[:12]}"
        command = self.launch_args + ["--model-path", self.model_path, "--weight-version", self.weight_version,
                                      "--served-model-name", self.name]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as out:
            # Its own session, so that stop() reaches the scheduler and detokenizer children too.
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        _LAUNCHED.add(self)
        log.info("SGLang server pid %d at %s (log %s)", self.process.pid, self.url, self.log_path)
        self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                taken = "address already in use" in self.log_since_start()
                raise (PortTaken if taken else ServerError)(f"SGLang server {self.url} exited with {self.process.returncode} during start-up; "
                                  f"last lines of {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                if not self.launched or self.get("/model_info").get("served_model_name") == self.name:
                    return
                self.stop()  # ours loads, and then cannot bind the port another server holds
                raise PortTaken(f"another server answers at {self.url} (not {self.name}, launched there)")
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"SGLang server {self.url} not healthy after {timeout_s:.0f} s; log: {self.log_path}\n"
                          f"{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_since_start(self) -> str:
        with open(self.log_path, "rb") as log_file:
            log_file.seek(self._log_start)
            return log_file.read().decode(errors="replace")

    def stop(self, timeout_s: float = 30) -> None:
        """Stop a launched server and its children by process group: SIGTERM, SIGKILL after `timeout_s`, then wait
        until every process of the group has exited. A scheduler still tearing down a model's memory after its parent
        is gone would otherwise meet the next server's start (its memory check, its warm-up)."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: the server leads its own process group
        if self.process.poll() is None:
            os.killpg(pgid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # children that outlived the parent, or the parent itself after the timeout
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        deadline = time.monotonic() + timeout_s
        while (members := _group_members(pgid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if members:
            log.warning("SGLang server %s: processes %s still exiting %.0f s after SIGKILL", self.url, members,
                        timeout_s)
        _LAUNCHED.discard(self)
        self.process = None

    def restart(self, timeout_s: float) -> None:
        log.warning("restarting SGLang server %s", self.url)
        self.stop()
        self.start(timeout_s)

    # ---- HTTP ----
    def post(self, path: str, payload: dict, timeout_s: float, retries: int = 0) -> dict | list | None:
        """POST JSON and return the decoded answer (None for an empty one, as /abort_request gives); retried
        `retries` times on connection errors and 5xx."""
        answer = self._send(path, json.dumps(payload).encode(), timeout_s, retries)
        return json.loads(answer) if answer else None

    def load_weights(self, model_path: str | Path, version: str, timeout_s: float) -> None:
        """Serve the HF weights at `model_path` under `version` (the disk sync's two calls, for one server)."""
        answer = self.post("/update_weights_from_disk", {"model_path": str(model_path), "weight_version": version,
                                                        "flush_cache": False}, timeout_s)
        if not answer.get("success", False):
            raise ServerError(f"SGLang server {self.url}/update_weights_from_disk {model_path}: {answer.get('message')}")
        self.flush_cache(timeout_s)

    def flush_cache(self, timeout_s: float) -> None:
        """Drop the prefix cache the old weights computed, as soon as the server is idle. A weight update's own
        flush is refused (400) while any request is running or queued, and a request can still be listed for a
        moment after its answer came back; this one waits for idle on the server, up to `timeout_s`."""
        self._send(f"/flush_cache?timeout={timeout_s:g}", b"{}", timeout_s + 30)

    def _send(self, path: str, data: bytes, timeout_s: float, retries: int = 0) -> bytes:
        error = None
        for attempt in range(retries + 1):
            request = urllib.request.Request(f"{self.url}{path}", data=data,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    return response.read()
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read()[:500].decode(errors='replace')}"
                if e.code < 500:
                    break  # a bad request stays bad
            except (OSError, urllib.error.URLError) as e:  # refused, reset, timed out
                error = f"{type(e).__name__}: {e}"
            if attempt < retries:
                time.sleep(min(2.0 ** attempt, 10.0))
        dead = self.process is not None and self.process.poll() is not None
        raise ServerError(f"SGLang server {self.url}{path} failed after {retries + 1} attempt(s): {error}"
                          + (f" (process exited with {self.process.returncode}; log {self.log_path})" if dead else ""))

    def get(self, path: str, timeout_s: float = 30) -> dict:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout_s) as response:
                return json.loads(response.read())
        except (OSError, urllib.error.URLError) as e:
            raise ServerError(f"SGLang server {self.url}{path}: {e}") from None


# Launched servers are stopped at interpreter exit even when a run dies with an exception.
_LAUNCHED: set[SGLangServer] = set()
atexit.register(lambda: [server.stop() for server in list(_LAUNCHED)])
