"""Run untrusted, model-written Python programs under hard limits.

Every program is hostile until proven otherwise. One call to :func:`run_python` runs one program once, in a fresh
child process, and returns what it printed. Many run at once: ``megaopd.verifiers.code.score_many`` runs them on
a thread pool of :func:`default_workers` (threads only wait on child processes). The layers, outermost first:

* **Namespaces** (when ``unshare`` works here): a new network namespace (no interfaces but a down loopback, so no
  connection can leave), a new PID namespace with its own /proc (the program cannot see or signal host processes,
  and every process in it dies when its init exits) and a mount namespace where /tmp, /var/tmp and /dev/shm are
  fresh tmpfs mounts that vanish with it. As root this is a plain ``unshare``; unprivileged it adds a user
  namespace (``--user --map-root-user``), which most clusters allow.
* **Another uid** (when we are root): the program runs as an unprivileged uid unique to this process and worker
  slot, so ``RLIMIT_NPROC`` is really enforced (it is not for root), file permissions keep it out of everything that
  is not its scratch directory, it cannot signal its parent, and ``kill(-1)`` only reaches itself. Afterwards every
  process left with that uid is killed and its files in world-writable directories are removed, which catches
  daemons that left the process group when namespaces are unavailable.
* **rlimits**: CPU seconds, address space, processes, file size, open files, no core dumps.
* **An audit hook** inside the child refuses socket creation: the no-network fallback when there is no network
  namespace, and a second wall when there is one.
* **The parent** keeps the wall clock, kills the whole process group, reads at most ``max_output`` bytes of each
  stream, and deletes the scratch directory.

``isolation()`` says which layers are active on this machine.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# High uids that no real account is likely to own (sssd and container ranges stay below 2**31); each process gets
# its own block of 64 so two trainers on one host do not share NPROC or kill each other's programs.
_UID_BASE = 3_000_000_000
_UID_BLOCK = 64
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 4.0  # RLIMIT_CPU: busy loops
    wall_s: float = 8.0  # parent's clock: sleeping, blocking on input, waiting on children
    memory_mb: int = 1024  # RLIMIT_AS: memory bombs that would push the host into swap or the OOM killer
    nproc: int = 16  # RLIMIT_NPROC (per uid, hence the per-slot uid): fork bombs
    fsize_mb: int = 16  # RLIMIT_FSIZE: filling the disk (also caps what the program writes to stdout/stderr)
    nofile: int = 64  # RLIMIT_NOFILE: exhausting file descriptors
    max_output: int = 1 << 20  # bytes of stdout and stderr the parent reads back


@dataclass
class Result:
    status: str  # "ok", "error" (non-zero exit), "timeout", "killed" (a signal: rlimit, memory), "sandbox_error"
    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Isolation:
    namespaces: bool  # network + pid + mount namespaces through unshare
    user_namespace: bool  # unprivileged: namespaces need a user namespace too
    uid_drop: bool  # running as root: the program gets its own unprivileged uid
    python: str  # the interpreter that runs programs; the sandbox uid must be able to read it

    @property
    def network(self) -> str:
        return "network namespace" if self.namespaces else "audit hook (Python-level socket block)"


# The program's own interpreter, started as `python -I -S -c _CHILD CONFIG` (as the sandbox uid when we are root):
# sets the rlimits, blocks sockets, then runs main.py as __main__.
_CHILD = r"""
import json, resource, sys
for name, value in json.loads(sys.argv[1]).items():
    # CPU: SIGXCPU at the soft limit, SIGKILL a second later for a program that catches it.
    resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
def _no_network(event, args):
    if event in ("socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo"):
        raise PermissionError("network access is disabled in the sandbox")
sys.addaudithook(_no_network)
del json, resource, name, value, _no_network
import runpy
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""

# Init of the fresh PID namespace, as root inside it: private tmpfs mounts, then fork the program (dropping to the
# sandbox uid) and reap. Init itself ignores signals it has no handler for (so RLIMIT_CPU would not bite if the
# program were init), and its exit kills everything left in the namespace, daemons included.
_NS_INIT = r"""
import ctypes, os, sys
uid, tmpfs = int(sys.argv[1]), sys.argv[2].split(":")
libc = ctypes.CDLL(None, use_errno=True)
def mount(source, target, fstype, flags, options):
    if libc.mount(source, target.encode(), fstype, flags, options) != 0:  # fail closed
        raise OSError(ctypes.get_errno(), f"sandbox init: mount on {target} failed")
# The scratch dir usually lives under /tmp, which is about to be covered: keep a handle on it and bind it back at
# the same path on the new tmpfs, so paths the program computes from its cwd still work.
work, keep = os.getcwd(), os.open(".", os.O_RDONLY)
for path in tmpfs:
    mount(b"tmpfs", path, b"tmpfs", 0, b"size=16m,mode=1777")
os.makedirs(work, exist_ok=True)
mount(f"/proc/self/fd/{keep}".encode(), work, None, 4096, None)  # 4096 = MS_BIND
os.chdir(work)
os.close(keep)
child = os.fork()
if child == 0:
    if uid >= 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.execv(sys.argv[3], sys.argv[3:])
while True:
    pid, status = os.wait()
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
"""


def _unshare_works(args: tuple[str, ...]) -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        done = subprocess.run(["unshare", *args, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


_NS_FLAGS = ("--net", "--pid", "--fork", "--kill-child", "--mount-proc")


def _python_works(python: str, uid: int | None) -> bool:
    try:
        done = subprocess.run([python, "-I", "-S", "-c", "import json, resource, runpy, socket"], capture_output=True,
                              timeout=30, cwd="/", user=uid, group=uid, extra_groups=[] if uid is not None else None)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@functools.lru_cache(maxsize=None)
def isolation() -> Isolation:
    """Probe once which isolation layers this machine allows (env MEGAOPD_SANDBOX_NAMESPACES=0 turns them off) and
    which interpreter the sandbox uid can run: MEGAOPD_SANDBOX_PYTHON, else ours, else a system python3 (ours may
    live under a directory only root can read, such as a pyenv in /root)."""
    root = os.geteuid() == 0
    user_ns = () if root else ("--user", "--map-root-user")
    wanted = os.environ.get("MEGAOPD_SANDBOX_NAMESPACES", "1") != "0"
    namespaces = wanted and sys.platform == "linux" and _unshare_works(user_ns + _NS_FLAGS)
    probe_uid = _UID_BASE + _UID_BLOCK - 1 if root else None
    candidates = [os.environ.get("MEGAOPD_SANDBOX_PYTHON"), sys.executable, shutil.which("python3"),
                  "/usr/local/bin/python3", "/usr/bin/python3"]
    python = next((p for p in candidates if p and _python_works(p, probe_uid)), None)
    if python is None:
        raise RuntimeError(f"no Python interpreter the sandbox uid can run among {candidates}; "
                           "set MEGAOPD_SANDBOX_PYTHON to one installed in a world-readable place")
    return Isolation(namespaces=namespaces, user_namespace=namespaces and not root, uid_drop=root, python=python)


class _UidSlots:
    """Hands out one uid per concurrently running program (root only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._next = 0

    def acquire(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._next >= _UID_BLOCK:
                raise RuntimeError(f"more than {_UID_BLOCK} concurrent sandboxed programs")
            self._next += 1
            return _UID_BASE + (os.getpid() % 1_000_000) * _UID_BLOCK + self._next - 1

    def release(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)


_slots = _UidSlots()


def live_pids_of_uid(uid: int) -> list[int]:
    """Processes running as ``uid``, zombies excluded (they are dead and wait for init to reap them)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    with open(f"/proc/{entry.name}/stat", "rb") as f:
                        if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                            pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return pids


def _sweep_uid(uid: int) -> None:
    """Kill every process still running as the sandbox uid (setsid daemons escape the process group), then remove
    its files in world-writable directories. Loops because a process may fork while we kill its siblings; NPROC
    bounds how many there can be."""
    for _ in range(1000):
        pids = live_pids_of_uid(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)
    for top in _WORLD_WRITABLE:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def _scrubbed_env(home: str) -> dict[str, str]:
    # Nothing from the parent: API keys, tokens and cluster credentials live in the environment.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home,
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _read_capped(path: Path, limit: int) -> str:
    with path.open("rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def run_python(source: str, stdin: str = "", limits: Limits = Limits(), files: dict[str, str] | None = None) -> Result:
    """Run ``source`` as a Python program with ``stdin`` in a fresh scratch directory (plus ``files`` written there)
    under ``limits``; never raises for anything the program does."""
    iso = isolation()
    uid = _slots.acquire() if iso.uid_drop else None
    root = Path(tempfile.mkdtemp(prefix="megaopd-sandbox-"))
    try:
        return _run_in(root, source, stdin, limits, files or {}, iso, uid)
    finally:
        if uid is not None:
            _sweep_uid(uid)
            _slots.release(uid)
        shutil.rmtree(root, ignore_errors=True)


def _run_in(root: Path, source: str, stdin: str, limits: Limits, files: dict[str, str], iso: Isolation,
            uid: int | None) -> Result:
    # root/ (ours, 0700) holds the streams where the program cannot rewrite them; root/work is its scratch dir.
    work = root / "work"
    work.mkdir()
    (work / "main.py").write_text(source, encoding="utf-8")
    for name, text in files.items():
        (work / name).write_text(text, encoding="utf-8")
    if uid is not None:
        os.chmod(root, 0o711)  # the program may pass through to its scratch dir but not list or read our files
        for path in [work, *work.iterdir()]:
            os.chown(path, uid, uid)
    (root / "stdin").write_text(stdin, encoding="utf-8")
    rlimits = {
        "RLIMIT_CPU": max(1, int(limits.cpu_s + 0.999)),
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_NPROC": limits.nproc,
        "RLIMIT_FSIZE": limits.fsize_mb << 20,
        "RLIMIT_NOFILE": limits.nofile,
        "RLIMIT_CORE": 0,
    }
    cmd = [iso.python, "-I", "-S", "-c", _CHILD, json.dumps(rlimits)]
    drop: dict = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    if iso.namespaces:  # the namespace init drops the uid itself, after mounting as root
        user_ns = ("--user", "--map-root-user") if iso.user_namespace else ()
        cmd = ["unshare", *user_ns, *_NS_FLAGS, iso.python, "-I", "-S", "-c", _NS_INIT,
               str(-1 if uid is None else uid), ":".join(_WORLD_WRITABLE), *cmd]
        drop = {}
    start = time.monotonic()
    with open(root / "stdin", "rb") as fin, open(root / "stdout", "wb") as fout, open(root / "stderr", "wb") as ferr:
        try:
            proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=_scrubbed_env(str(work)),
                                    start_new_session=True, close_fds=True, **drop)
        except OSError as e:
            return Result("sandbox_error", -1, "", f"could not start the sandbox: {e}", 0.0)
        try:
            timed_out = not _exited_within(proc, limits.wall_s)
        finally:
            try:  # the whole group: children and grandchildren that did not call setsid
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            returncode = proc.wait()
    wall = time.monotonic() - start
    if timed_out:
        status = "timeout"
    elif returncode < 0 or returncode >= 128:  # killed by a signal (directly, or reported by the namespace init)
        status = "killed"
    else:
        status = "ok" if returncode == 0 else "error"
    return Result(status, returncode, _read_capped(root / "stdout", limits.max_output),
                  _read_capped(root / "stderr", limits.max_output), wall)


def _exited_within(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait for the child up to ``seconds``. Popen.wait(timeout) polls with sleeps growing to 50 ms, which costs
    more than the typical program runs; a pidfd wakes us the moment it exits."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3
        try:
            proc.wait(timeout=seconds)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([pidfd], [], [], seconds)[0])
    finally:
        os.close(pidfd)


def default_workers() -> int:
    """One program per core: they are CPU-bound and the CPU rlimit is per process."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def describe() -> str:
    """One line for logs: which isolation is active."""
    return json.dumps({**asdict(isolation()), "network": isolation().network})
