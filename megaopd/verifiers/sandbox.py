"""Run untrusted, model-written Python programs under hard limits.

Every program is hostile until proven otherwise. One call to :func:`run_python` runs one program once, in a fresh
child process, and returns what it printed. Many run at once: ``megaopd.verifiers.code.score_many`` runs them on
a thread pool of :func:`default_workers` (threads only wait on child processes). Two modes (``docs/verifiers.md``
has the threat model and what each guarantees):

* **Namespaces** (when ``unshare`` works; as root, or unprivileged through a user namespace): a network namespace
  (only a down loopback), an IPC namespace, a PID namespace (its own /proc; everything in it dies with its init) and a mount
  namespace whose root is a new, mostly read-only tree with no host files but the interpreter's (see
  ``sandbox_init``). As root the program runs as a uid of its own; in a user namespace with no capabilities.
* **Fallback** (root without namespaces, e.g. Docker without CAP_SYS_ADMIN): a uid of its own per worker slot, an
  audit hook against sockets, and afterwards every process of that uid is killed and its files in world-writable
  directories and its System V IPC objects removed. A non-root trainer without user namespaces gets no fallback: :func:`isolation` refuses,
  since the program would run as the trainer's own user with the user's files.

In both: rlimits (CPU, memory, processes, file size, descriptors, no core), no_new_privs, a scrubbed environment,
stdin/stdout/stderr as pipes (nothing on disk to re-read or for another run to read), a wall clock and an output cap
kept by the parent, and cleanup that never raises.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
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

from megaopd.config import SandboxConfig
from megaopd.verifiers import confine
from megaopd.verifiers.cleanup import (kill_uid, live_pids_of_uid, remove_tree, sweep_files, sweep_ipc,
                                       world_writable_dirs)
from megaopd.verifiers.sandbox_init import CHILD, INIT_FAILED as _INIT_FAILED, NS_INIT

__all__ = ["Limits", "Result", "Isolation", "SandboxError", "SandboxUnavailable", "isolation", "run_python", "live_pids_of_uid",
           "default_workers", "describe"]

log = logging.getLogger(__name__)

# High uids that no real account is likely to own (sssd and container ranges stay below 2**31); each process gets
# its own block of 64 so two trainers on one host do not share NPROC or kill each other's programs.
_UID_BASE = 3_000_000_000
_UID_BLOCK = 64
_NS_FLAGS = ("--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount", "--propagation", "private")
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
_SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf", "/etc/passwd", "/etc/group")


class SandboxError(RuntimeError):
    """One run could not be sandboxed (counted by ``verifiers.score`` under this reason)."""

    reason = "sandbox_error"


class SandboxUnavailable(RuntimeError):
    """This machine cannot contain programs as promised; raised at start-up, never a silent weaker mode."""


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 4.0  # RLIMIT_CPU: busy loops
    wall_s: float = 8.0  # parent's clock: sleeping, blocking on input, waiting on children
    memory_mb: int = 1024  # RLIMIT_AS: memory bombs that would push the host into swap or the OOM killer
    nproc: int = 16  # RLIMIT_NPROC (per uid, hence the per-slot uid): fork bombs
    fsize_mb: int = 16  # RLIMIT_FSIZE: filling the disk
    nofile: int = 64  # RLIMIT_NOFILE: exhausting file descriptors
    max_output: int = 1 << 20  # bytes of stdout and of stderr the parent reads; past that the program is killed


@dataclass
class Result:
    status: str  # "ok", "error" (non-zero exit), "timeout", "killed" (a signal), "output_limit", "sandbox_error"
    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def raise_for_sandbox(self) -> "Result":
        """This result, unless the sandbox itself failed: that is no verdict on the program, so it is raised (and
        ``verifiers.score`` counts it) rather than scored as a silent 0."""
        if self.status == "sandbox_error":
            raise SandboxError(self.stderr[-500:])
        return self


@dataclass(frozen=True)
class Isolation:
    namespaces: bool  # network + pid + mount namespaces and a new root, through unshare
    user_namespace: bool  # unprivileged: namespaces need a user namespace too
    uid_drop: bool  # running as root: the program gets its own unprivileged uid
    python: str  # the interpreter that runs programs; the sandbox uid must be able to read it
    visible: tuple[str, ...] = ()  # host trees the program sees, read-only (namespaces)
    hidden: tuple[str, ...] = ()  # site-packages inside them, covered by empty mounts
    swept: tuple[str, ...] = ()  # world-writable directories cleaned of the uid's files (fallback)
    landlock: int = 0  # fallback: the Landlock ABI confining reads, writes and TCP (0: none)
    seccomp: bool = False  # fallback: the seccomp filter (sockets but AF_UNIX, ptrace, io_uring, namespaces, ...)

    @property
    def network(self) -> str:
        if self.namespaces:
            return "network namespace"
        layers = ["seccomp (AF_UNIX sockets only)"] * self.seccomp + ["Landlock (no TCP)"] * (self.landlock >= 4)
        return " + ".join(layers + ["audit hook (Python-level socket block)"])


def _unshare_works(args: tuple[str, ...]) -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        done = subprocess.run(["unshare", *args, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


# The prefix and every site-packages (a venv's and its base interpreter's), which the new root covers up.
_PROBE = ("import json, sys, site, sysconfig; v = {'base': sys.base_prefix, 'platbase': sys.base_exec_prefix}; "
          "print(json.dumps([sys.base_prefix, site.getsitepackages() + "
          "[sysconfig.get_path(k, vars=v) for k in ('purelib', 'platlib')]]))")


def _probe_python(python: str, uid: int | None) -> tuple[str, list[str]] | None:
    """(prefix, site-packages dirs) of an interpreter the sandbox uid can run, else None."""
    try:
        done = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, timeout=30, cwd="/", user=uid,
                              group=uid, extra_groups=[] if uid is not None else None)
        prefix, sites = json.loads(done.stdout)
        return os.path.realpath(prefix), list(dict.fromkeys(os.path.realpath(s) for s in sites))
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


_settings = SandboxConfig()  # this process's: a run's verifier.sandbox, set at its start (configure)


def configure(settings: SandboxConfig) -> None:
    """This process's sandbox settings (config ``verifier.sandbox``): the trainer sets them at start-up
    (``verifiers.check_ready``), before the first ``isolation()``, which probes again when they change."""
    global _settings
    if settings != _settings:
        _settings = settings
        isolation.cache_clear()


@functools.lru_cache(maxsize=None)
def isolation() -> Isolation:
    """Probe once which isolation this machine allows (``namespaces=False`` asks for the fallback) and which
    interpreter the sandbox uid can run: the configured ``python``, else ours, else a system python3 (ours may live
    under a directory only root can read, such as a pyenv in /root). SandboxUnavailable when neither mode's
    guarantee can be kept, or when only the fallback works and it was not accepted (``allow_fallback``)."""
    root = os.geteuid() == 0
    user_ns = () if root else ("--user", "--map-root-user")
    wanted = _settings.namespaces
    namespaces = (wanted and sys.platform == "linux" and platform.machine() in _PIVOT_ROOT
                  and _unshare_works(user_ns + _NS_FLAGS))
    if not namespaces and not root:
        why = ("verifier.sandbox.namespaces=false" if not wanted else
               "user namespaces are not available (`unshare --user --map-root-user --net --pid --mount true` fails: "
               "check kernel.unprivileged_userns_clone, user.max_user_namespaces and AppArmor's "
               "restrict_unprivileged_userns)")
        raise SandboxUnavailable(f"cannot sandbox code as a non-root user: {why}. Without them programs would run "
                                 "as this user, able to read and rewrite its files; run as root or enable them")
    probe_uid = _UID_BASE + _UID_BLOCK - 1 if root else None
    candidates = [_settings.python, sys.executable, shutil.which("python3"), "/usr/local/bin/python3",
                  "/usr/bin/python3"]
    for python in filter(None, candidates):
        probed = _probe_python(python, probe_uid)
        if probed:
            break
    else:
        raise SandboxUnavailable(f"no Python interpreter the sandbox uid can run among {candidates}; set "
                                 "verifier.sandbox.python (or MEGAOPD_SANDBOX_PYTHON) to one installed in a "
                                 "world-readable place")
    prefix, sites = probed
    python = os.path.realpath(python)  # a venv's bin/python is a link into a tree the new root may not hold
    trees = [t for t in _SYSTEM_TREES if os.path.isdir(t) and not os.path.islink(t)]
    if not any(prefix == t or prefix.startswith(t + "/") for t in trees):
        trees.append(prefix)
    # Each mode this machine may use, best first, must run a program end to end: a namespace that unshare allows
    # but whose new root cannot be built (an odd container) is found here, not as a silent 0 on every program.
    modes = [namespaces] + ([False] if root and namespaces else [])
    problems = []
    for ns in modes:
        if not ns and wanted and not _settings.allow_fallback:
            why = problems[0] if problems else "`unshare --net --pid --ipc --mount --fork true` fails"
            raise SandboxUnavailable(f"the code sandbox cannot use namespaces here ({why[:500]}); the fallback mode "
                                     f"(uid drop, {_fallback_layers()}) is weaker: set "
                                     "verifier.sandbox.allow_fallback=true to accept it, or give the trainer "
                                     "namespaces (CAP_SYS_ADMIN, e.g. docker --privileged)")
        layers = {} if ns else confine.layers()
        iso = Isolation(namespaces=ns, user_namespace=ns and not root, uid_drop=root, python=python,
                        visible=tuple(trees), hidden=tuple(sites), swept=() if ns else world_writable_dirs(),
                        **layers)
        probe = _run(iso, "print('ok')", "", Limits(cpu_s=10, wall_s=60), {}, None)
        if probe.stdout == "ok\n":
            if not ns:
                log.warning("sandbox: the fallback mode (namespaces %s), with %s", "unusable: " + problems[0]
                            if problems else "off: verifier.sandbox.namespaces=false", _fallback_layers())
            return iso
        problems.append(f"{probe.status}: {probe.stderr[-1000:]}")
    raise SandboxUnavailable(f"the sandbox cannot run a program here: {'; '.join(problems)}")


def _fallback_layers() -> str:
    layers = confine.layers()
    return ", ".join([f"Landlock ABI {layers['landlock']}" if layers["landlock"] else "no Landlock (files of the "
                      "host readable)", "seccomp" if layers["seccomp"] else "no seccomp (raw sockets open)"])


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


def _scrubbed_env(home: str) -> dict[str, str]:
    # Nothing from the parent: API keys, tokens and cluster credentials live in the environment.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home,
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_python(source: str, stdin: str | int = "", limits: Limits = Limits(), files: dict[str, str] | None = None,
               stdout: int | None = None) -> Result:
    """Run ``source`` as a Python program in a fresh scratch directory (plus ``files`` written there) under
    ``limits``. ``stdin`` is text written to its stdin pipe, or a pipe descriptor to hand it; ``stdout`` may be a
    descriptor to write to instead of the returned text. Never raises for anything the program does, nor for a
    failure to clean up after it (that is logged)."""
    return _run(isolation(), source, stdin, limits, files or {}, stdout)


def _run(iso: Isolation, source: str, stdin: str | int, limits: Limits, files: dict[str, str],
         stdout: int | None) -> Result:
    uid = _slots.acquire() if iso.uid_drop else None
    root = None
    try:
        root = Path(tempfile.mkdtemp(prefix="megaopd-sandbox-"))
        return _run_in(root, source, stdin, stdout, limits, files, iso, uid)
    except OSError as e:
        return Result("sandbox_error", -1, "", f"sandbox failed: {e}", 0.0)
    finally:
        _clean_up(iso, uid, root)


def _clean_up(iso: Isolation, uid: int | None, root: Path | None) -> None:
    """Never raises. The namespace dies with its init, but asynchronously to our wait, so as root we make sure
    before the uid is reused; a uid whose processes survive SIGKILL is never handed out again."""
    try:
        if uid is not None and kill_uid(uid):
            if not iso.namespaces:
                sweep_files(uid, iso.swept)
                sweep_ipc(uid)
            _slots.release(uid)
        if root is not None:
            remove_tree(str(root))
    except Exception:  # noqa: BLE001: a cleanup bug must not stop training; it is logged
        log.exception("sandbox cleanup failed (uid %s, %s)", uid, root)


def _command(iso: Isolation, root: Path, work: Path, limits: Limits, uid: int | None) -> tuple[list[str], str]:
    """The command line that runs main.py in ``work`` under ``iso``, and the program's home directory."""
    rlimits = {
        "RLIMIT_CPU": max(1, int(limits.cpu_s + 0.999)),
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_NPROC": limits.nproc,
        "RLIMIT_FSIZE": limits.fsize_mb << 20,
        "RLIMIT_NOFILE": limits.nofile,
        "RLIMIT_CORE": 0,
    }
    child = [iso.python, "-I", "-S", "-c", CHILD, json.dumps(rlimits), "-" if iso.namespaces else "no_new_privs"]
    ro_files = [f for f in _ETC_FILES if os.path.isfile(f)]
    if not iso.namespaces:
        return child + [json.dumps(confine.plan(iso.visible, iso.hidden, ro_files, str(work)))], str(work)
    child.append("{}")
    (root / "newroot").mkdir()
    config = {"root": str(root / "newroot"), "uid": -1 if uid is None else uid, "links": _links(),
              "ro": list(iso.visible), "ro_files": ro_files,
              "hide": list(iso.hidden), "tmpfs_mb": 64 + limits.fsize_mb, "inodes": 16384,
              "pivot_root": _PIVOT_ROOT[platform.machine()], "argv": child, "env": _scrubbed_env("/scratch")}
    user_ns = ("--user", "--map-root-user") if iso.user_namespace else ()
    return ["unshare", *user_ns, *_NS_FLAGS, iso.python, "-I", "-S", "-c", NS_INIT, json.dumps(config)], "/scratch"


@functools.lru_cache(maxsize=None)
def _links() -> list[tuple[str, str]]:
    return [(t, os.readlink(t)) for t in _SYSTEM_TREES if os.path.islink(t)]


def _run_in(root: Path, source: str, stdin: str | int, stdout: int | None, limits: Limits, files: dict[str, str],
            iso: Isolation, uid: int | None) -> Result:
    # root/ is ours (0700; 0711 in the fallback so the uid can reach work/); root/work holds the program's files.
    work = root / "work"
    work.mkdir(mode=0o700)
    (work / "main.py").write_text(source, encoding="utf-8")
    for name, text in files.items():
        (work / name).write_text(text, encoding="utf-8")
    if uid is not None and not iso.namespaces:
        os.chmod(root, 0o711)
        for path in [work, *work.iterdir()]:
            os.chown(path, uid, uid)
    cmd, home = _command(iso, root, work, limits, uid)
    drop: dict = {"user": uid, "group": uid, "extra_groups": []} if uid is not None and not iso.namespaces else {}
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if isinstance(stdin, str) else stdin,
                                stdout=subprocess.PIPE if stdout is None else stdout, stderr=subprocess.PIPE,
                                cwd=work, env=_scrubbed_env(home), start_new_session=True, close_fds=True, **drop)
    except OSError as e:
        return Result("sandbox_error", -1, "", f"could not start the sandbox: {e}", 0.0)
    try:
        outcome, out, err = _communicate(proc, stdin.encode() if isinstance(stdin, str) else b"", limits)
    finally:
        try:  # the whole group: children and grandchildren that did not call setsid
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        returncode = proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    if outcome == "exited" and returncode == _INIT_FAILED:
        outcome = "sandbox_error"
    elif outcome == "exited":
        if returncode < 0 or returncode >= 128:  # killed by a signal (directly, or reported by the namespace init)
            outcome = "killed"
        else:
            outcome = "ok" if returncode == 0 else "error"
    decode = lambda b: b[:limits.max_output].decode("utf-8", errors="replace")  # noqa: E731
    return Result(outcome, returncode, decode(out), decode(err), time.monotonic() - start)


def _communicate(proc: subprocess.Popen, data: bytes, limits: Limits) -> tuple[str, bytes, bytes]:
    """Feed stdin and read stdout/stderr until the program exits ("exited"), the wall clock runs out ("timeout")
    or a stream passes ``max_output`` ("output_limit"). A pidfd wakes us the moment it exits; reading stops there
    (a daemon holding the pipes open does not keep us waiting), then what is already buffered is drained."""
    deadline = time.monotonic() + limits.wall_s
    pidfd = os.pidfd_open(proc.pid)
    buffers: dict[int, bytearray] = {}
    readers = [p.fileno() for p in (proc.stdout, proc.stderr) if p is not None]
    for fd in readers:
        buffers[fd] = bytearray()
        os.set_blocking(fd, False)
    writer = proc.stdin.fileno() if proc.stdin is not None else None
    if writer is not None:
        os.set_blocking(writer, False)
        if not data:
            proc.stdin.close()
            writer = None
    outcome = "timeout"
    try:
        while time.monotonic() < deadline:
            ready_r, ready_w, _ = select.select(readers + [pidfd], [writer] if writer is not None else [], [],
                                                max(0.0, deadline - time.monotonic()))
            if ready_w:
                try:
                    data = data[os.write(writer, data[:1 << 16]):]
                except BlockingIOError:
                    pass
                except BrokenPipeError:  # it closed its stdin: the rest stays unread
                    data = b""
                if not data:
                    proc.stdin.close()
                    writer = None
            for fd in ready_r:
                if fd != pidfd:
                    _read_into(fd, buffers[fd], readers)
            if any(len(b) > limits.max_output for b in buffers.values()):
                outcome = "output_limit"
                break
            if pidfd in ready_r:
                outcome = "exited"
                for fd in list(readers):  # whatever the program wrote before it exited
                    while fd in readers and len(buffers[fd]) <= limits.max_output:
                        if not _read_into(fd, buffers[fd], readers):
                            break
                break
    finally:
        os.close(pidfd)
    out = bytes(buffers[proc.stdout.fileno()]) if proc.stdout is not None else b""
    return outcome, out, bytes(buffers[proc.stderr.fileno()])


def _read_into(fd: int, buffer: bytearray, readers: list[int]) -> bool:
    """Read what is available; False when nothing more is now (at EOF ``fd`` also leaves ``readers``)."""
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        return False
    if not chunk:
        readers.remove(fd)
        return False
    buffer += chunk
    return True


def default_workers() -> int:
    """One program per core: they are CPU-bound and the CPU rlimit is per process."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def describe() -> str:
    """One line for logs: which isolation is active."""
    return json.dumps({**asdict(isolation()), "network": isolation().network})
