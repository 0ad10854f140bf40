"""Hostile programs: each is contained, scores 0, leaves the host as it was and ends within its limits.

Every attack ends with ``print(42)``, the expected output, so it scores 1 exactly when the attack got through. The
suite runs once with namespaces (where ``unshare`` works) and once without (the fallback: uid drop, rlimits,
process sweep, Landlock, seccomp and the socket audit hook), so the fallback is tested on machines that have both.
"""

import os
import socket
import time

import pytest

from megaopd.config import SandboxConfig
from megaopd.verifiers import sandbox
from megaopd.verifiers.code import score_code

TESTS = {"inputs": [""], "outputs": ["42\n"]}
LIMITS = {"time_limit_s": 1, "memory_mb": 256}  # wall clock: 3 s


@pytest.fixture(params=["namespaces", "fallback"])
def mode(request):
    sandbox.configure(SandboxConfig(namespaces=request.param == "namespaces"))
    if request.param == "namespaces" and not sandbox.isolation().namespaces:
        pytest.skip("unshare is not allowed here")
    yield request.param
    sandbox.configure(SandboxConfig())


def attack(body: str) -> tuple[float, float]:
    """(score, seconds) of a program that runs ``body`` and then prints the expected answer."""
    start = time.monotonic()
    score = score_code(f"```python\n{body}\nprint(42)\n```", TESTS, LIMITS)
    return score, time.monotonic() - start


def leftover_processes(token: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_the_harmless_program_passes(mode):
    assert attack("pass")[0] == 1.0


def test_fork_bomb(mode):
    """The program reaches its print only with 64 live children: the process limit (16) must stop it first."""
    body = "import os, time\nfor _ in range(64):\n    if os.fork() == 0:\n        time.sleep(60)\n        os._exit(0)"
    score, seconds = attack(body)
    assert score == 0.0 and seconds < 6
    if os.geteuid() == 0:  # every uid this process hands out
        block = sandbox._UID_BASE + (os.getpid() % 1_000_000) * sandbox._UID_BLOCK
        assert not [pid for uid in range(block, block + sandbox._UID_BLOCK) for pid in sandbox.live_pids_of_uid(uid)]


def test_a_busy_loop_is_stopped_by_the_cpu_limit(mode):
    """3 s of CPU, then the print, under a wall clock of 60 s: only the CPU limit (1 s) can stop it, by a signal."""
    result = sandbox.run_python("import time\nwhile time.process_time() < 3:\n    pass\nprint(42)", "",
                                sandbox.Limits(cpu_s=1, wall_s=60))
    assert result.status == "killed" and "42" not in result.stdout and result.wall_s < 30


def test_memory_bomb(mode):
    """512 MiB, then the print: the memory limit (256 MiB) must stop it."""
    score, seconds = attack("blocks = [bytearray(64 << 20) for _ in range(8)]")
    assert score == 0.0 and seconds < 4


def test_huge_output_is_capped(mode):
    result = sandbox.run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
                                limits=sandbox.Limits(cpu_s=1, wall_s=3, fsize_mb=4, max_output=1000))
    assert not result.ok and len(result.stdout) == 1000
    assert attack("import sys\nfor _ in range(10**6):\n    sys.stdout.write('x' * 65536)")[0] == 0.0


def test_writing_and_deleting_outside_the_scratch_dir(mode, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    escape = f"/tmp/megaopd-escape-{os.getpid()}"
    body = f"""
import os, shutil
for action in (lambda: open({str(victim)!r}, "w").write("pwned"), lambda: os.remove({str(victim)!r}),
               lambda: shutil.rmtree({str(tmp_path)!r}), lambda: open({escape!r}, "w").write("x")):
    try:
        action()
    except OSError:
        pass
assert open({str(victim)!r}).read() == "pwned"
"""
    assert attack(body)[0] == 0.0
    assert victim.read_text() == "original"
    assert not os.path.exists(escape)


def test_parent_environment_secrets(mode, monkeypatch):
    monkeypatch.setenv("MEGAOPD_TEST_SECRET", "hunter2-secret")
    body = """
import os
seen = str(dict(os.environ))
for pid in {os.getppid(), 1, *[int(p) for p in os.listdir("/proc") if p.isdigit()]}:
    try:
        seen += open(f"/proc/{pid}/environ", errors="replace").read()
    except OSError:
        pass
assert "hunter2-secret" in seen
"""
    assert attack(body)[0] == 0.0
    assert "MEGAOPD_TEST_SECRET" not in sandbox._scrubbed_env("/x")


def assert_never_reaches_a_local_server(program) -> None:
    """`program(port)` is the attack's source; it scores 0 and nothing connects to the server on that port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    try:
        assert attack(program(server.getsockname()[1]))[0] == 0.0
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


def test_network_connection(mode):
    assert_never_reaches_a_local_server(lambda port: f"""
import socket
s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
s.sendall(b"exfiltrated")
""")


def test_raw_syscall_network_is_stopped_in_both_modes(mode):
    """ctypes goes around the audit hook: the network namespace stops it, and in the fallback seccomp (issue 24)."""
    assert_never_reaches_a_local_server(lambda port: f"""
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)
addr = struct.pack("!HH4s8x", 2, {port}, bytes([127, 0, 0, 1]))
addr = struct.pack("=H", 2) + addr[2:]
assert libc.connect(fd, addr, len(addr)) == 0
""")


def test_signalling_the_parent(mode):
    """The program reaches its print only if a signal to its parent, to us or to our process group was let
    through (and we are still here to assert that none was)."""
    body = f"""
import os, signal
reached = []
for target in (os.getppid(), {os.getpid()}, -{os.getpgid(0)}):
    for sig in (signal.SIGKILL, signal.SIGTERM):
        try:
            os.kill(target, sig)
            reached.append(target)
        except OSError:
            pass
if not reached:
    raise SystemExit(1)
"""
    assert attack(body)[0] == 0.0


def test_sleeping_past_the_wall_clock(mode):
    score, seconds = attack("import time\ntime.sleep(60)")
    assert score == 0.0 and 2.5 < seconds < 5


def test_daemon_does_not_outlive_the_test(mode):
    token = f"{os.getpid()}.31337"
    body = f"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{token}"])
    os._exit(0)
raise SystemExit(1)
"""
    assert attack(body)[0] == 0.0
    time.sleep(0.2)
    assert leftover_processes(token) == []
