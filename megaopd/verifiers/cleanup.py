"""Leave nothing behind after a sandboxed run, without ever raising: kill a uid's processes, remove trees, and
(fallback mode) remove what the uid left in world-writable directories.

Both run in the verifier's ``finally`` blocks, so a failure here must not escape (it would stop training and, in the
fallback mode, keep a uid slot busy forever): errors are logged and counted, never raised.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import time

log = logging.getLogger(__name__)


def live_pids_of_uid(uid: int) -> list[int]:
    """Processes of ``uid`` that still run code: a zombie counts while any of its threads lives (a thread group
    whose leader exited shows as a zombie in /proc but keeps running its other threads)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
            if not zombie or len(os.listdir(f"/proc/{entry.name}/task")) > 1:
                pids.append(int(entry.name))
        except (OSError, IndexError):
            pass
    return pids


def kill_uid(uid: int, timeout_s: float = 10.0) -> bool:
    """SIGKILL every process of ``uid`` and wait until none runs; False (logged) if some survive ``timeout_s``.

    ``kill(-1, SIGKILL)`` sent *as* that uid reaches all its processes in one pass under the kernel's task-list
    lock, so none can fork its way out, and it reaches thread groups whose leader is a zombie. The sender is
    ``/bin/kill`` started as the uid (a fork-free spawn; no Python runs between fork and exec)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = live_pids_of_uid(uid)
        if not pids:
            return True
        if time.monotonic() > deadline:
            log.error("sandbox uid %d: processes %s survive SIGKILL", uid, pids[:10])
            return False
        try:
            subprocess.run(["kill", "-KILL", "-1"], user=uid, group=uid, extra_groups=[], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=5,
                           env={"PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.SubprocessError) as e:
            log.error("sandbox uid %d: kill -1 failed: %s", uid, e)
        time.sleep(0.002)


def remove_tree(path: str) -> bool:
    """Delete ``path`` (a file or a directory tree of any depth) without recursion and without following symlinks;
    False (logged) when something could not be removed. Works through directory descriptors, so paths longer than
    PATH_MAX (a tree thousands of levels deep) are no obstacle, and it holds one descriptor at a time."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError as e:
        log.error("cleanup: cannot stat %s: %s", path, e)
        return False
    if not stat.S_ISDIR(st.st_mode):
        return _quietly(os.unlink, path)
    names: list[str] = []  # the path from `path` down to the directory `fd` is open on
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        log.error("cleanup: cannot open %s: %s", path, e)
        return False
    ok, budget = True, 10_000_000  # entries; bounds the loop even if something keeps reappearing
    try:
        while budget > 0:
            subdir = None
            try:
                entries = list(os.scandir(fd))
            except OSError as e:
                log.error("cleanup: cannot list a directory under %s: %s", path, e)
                entries, ok = [], False
            for entry in entries:
                budget -= 1
                if entry.is_dir(follow_symlinks=False):
                    subdir = entry.name
                    continue
                ok &= _quietly(os.unlink, entry.name, dir_fd=fd)
            if subdir is not None:
                try:
                    child = _open_dir(subdir, fd)
                except OSError as e:
                    log.error("cleanup: cannot enter %s under %s: %s", subdir, path, e)
                    ok = False
                    if not _quietly(os.rmdir, subdir, dir_fd=fd):
                        break  # neither enterable nor removable: stop rather than spin
                    continue
                os.close(fd)
                fd = child
                names.append(subdir)
                continue
            if not names:
                break
            parent = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = parent
            ok &= _quietly(os.rmdir, names.pop(), dir_fd=fd)
    except OSError as e:
        log.error("cleanup: removing %s: %s", path, e)
        ok = False
    finally:
        os.close(fd)
    return _quietly(os.rmdir, path) and ok


def _open_dir(name: str, dir_fd: int) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:  # a program may chmod its own dirs to 000; as their owner we may undo that
        os.chmod(name, 0o700, dir_fd=dir_fd)  # all of its processes are dead: nothing swaps it for a link
        return os.open(name, flags, dir_fd=dir_fd)


def _quietly(fn, *args, **kwargs) -> bool:
    try:
        fn(*args, **kwargs)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        log.error("cleanup: %s%s: %s", fn.__name__, args, e)
        return False


def world_writable_dirs() -> tuple[str, ...]:
    """Directories any uid may create files in, two levels down from / (the fallback sweeps these)."""
    found = []
    level = ["/"]
    for _ in range(3):
        below = []
        for top in level:
            try:
                entries = list(os.scandir(top))
            except OSError:
                continue
            for entry in entries:
                if entry.path in ("/proc", "/sys") or not entry.is_dir(follow_symlinks=False):
                    continue
                try:
                    if entry.stat(follow_symlinks=False).st_mode & 0o002:
                        found.append(entry.path)
                    below.append(entry.path)
                except OSError:
                    pass
        level = below
    return tuple(sorted(found))


def sweep_files(uid: int, dirs: tuple[str, ...]) -> None:
    """Remove what the uid left in world-writable directories (fallback only: namespaces give fresh, private
    ones)."""
    for top in dirs:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    remove_tree(entry.path)
            except OSError:
                pass


def sweep_ipc(uid: int) -> None:
    """Remove the System V shared memory segments, message queues and semaphores the uid owns: they outlive every
    process (fallback only; an IPC namespace takes them with it)."""
    for kind, flag in (("shm", "-m"), ("msg", "-q"), ("sem", "-s")):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = f.read().splitlines()
            column = header.split().index("uid")
            ids = [row.split()[1] for row in rows if row.split()[column] == str(uid)]
            if ids:
                done = subprocess.run(["ipcrm", *[arg for i in ids for arg in (flag, i)]], capture_output=True,
                                      timeout=10)
                if done.returncode != 0:
                    log.error("sandbox uid %d: ipcrm failed: %s", uid, done.stderr.decode(errors="replace")[:300])
        except (OSError, ValueError, IndexError, subprocess.SubprocessError) as e:
            log.error("sandbox uid %d: sweeping %s: %s", uid, kind, e)

