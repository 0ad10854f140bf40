"""Kernel confinement for the fallback sandbox mode (root without namespaces): Landlock and a seccomp filter.

Without a mount or network namespace the program would see the host's files and network as its unprivileged uid
(world-readable datasets, the host's /tmp, a raw ``socket(AF_INET)`` through ctypes). The program's interpreter
confines itself before it runs anything (``sandbox_init.CHILD``, after no_new_privs, which both need):

* **Landlock** (ABI >= 1; this machine's kernel may have up to 7): reads and executes only beneath the system
  trees and the interpreter's prefix (their site-packages left out, as the namespaces mode covers them), a few
  /etc files and /dev nodes, its own /proc entry; reads and writes only beneath its scratch directory. ABI >= 4
  also refuses every TCP bind and connect; ABI >= 6 scopes abstract unix sockets and signals to the program's own
  processes.
* **seccomp** (x86_64, aarch64): ``socket``/``socketpair`` of any family but AF_UNIX, ptrace and process_vm_*,
  io_uring (which opens sockets and files without those syscalls), bpf, perf_event_open, userfaultfd, keyrings,
  mounts, namespaces (unshare, setns, clone with a namespace flag; clone3, whose flags a filter cannot read, says
  ENOSYS so libc falls back to clone), module and kexec loading fail with EPERM; another syscall ABI is killed.

:func:`layers` probes what this kernel has (logged at start-up by ``sandbox.describe``); :func:`plan` is what the
program's interpreter applies (JSON, read by ``sandbox_init.CHILD``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# Syscall numbers; clone3 is answered ENOSYS, socket/socketpair and clone are checked by argument.
_SYSCALLS = {
    "x86_64": {"socket": 41, "socketpair": 53, "clone": 56, "clone3": 435, "denied": [
        101, 310, 311,  # ptrace, process_vm_readv, process_vm_writev
        425, 426, 427,  # io_uring_setup, io_uring_enter, io_uring_register
        321, 298, 323,  # bpf, perf_event_open, userfaultfd
        248, 249, 250,  # add_key, request_key, keyctl
        272, 308, 165, 166, 155, 161,  # unshare, setns, mount, umount2, pivot_root, chroot
        428, 429, 430, 431, 432, 433, 442,  # open_tree, move_mount, fsopen, fsconfig, fsmount, fspick, mount_setattr
        175, 313, 176, 246, 320,  # init_module, finit_module, delete_module, kexec_load, kexec_file_load
    ]},
    "aarch64": {"socket": 198, "socketpair": 199, "clone": 220, "clone3": 435, "denied": [
        117, 270, 271, 425, 426, 427, 280, 241, 282, 217, 218, 219, 97, 268, 40, 39, 41, 51,
        428, 429, 430, 431, 432, 433, 442, 105, 273, 106, 104, 294,
    ]},
}
_X32_BIT = 0x40000000  # x86_64's x32 syscall ABI: same numbers with this bit, so it is refused outright
_NS_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_AF_UNIX = 1

# Landlock access rights by ABI (include/uapi/linux/landlock.h).
_FS_READ = 1 | 4 | 8  # EXECUTE, READ_FILE, READ_DIR
_FS_FILE = 1 | 2 | 4  # EXECUTE, WRITE_FILE, READ_FILE (what a rule on a file, not a directory, may grant)
_FS_ALL = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}  # + REFER, TRUNCATE, IOCTL_DEV


def _fs_all(abi: int) -> int:
    return _FS_ALL[max(k for k in _FS_ALL if k <= abi)]


@functools.lru_cache(maxsize=None)
def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when it has none (or it is disabled)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        version = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    except (OSError, AttributeError):
        return 0
    return max(0, version)


@functools.lru_cache(maxsize=None)
def seccomp_available() -> bool:
    """Whether seccomp filters work here (and we know this architecture's syscall numbers)."""
    if platform.machine() not in _SYSCALLS:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(21, 0, 0, 0, 0) >= 0  # PR_GET_SECCOMP: EINVAL without CONFIG_SECCOMP


def layers() -> dict[str, object]:
    """What the fallback mode applies on this kernel: {"landlock": ABI or 0, "seccomp": bool}."""
    return {"landlock": landlock_abi(), "seccomp": seccomp_available()}


def seccomp_filter(machine: str) -> list[tuple[int, int, int, int]]:
    """The classic-BPF program (code, jt, jf, k) described in the module docstring, for ``machine``."""
    nr = _SYSCALLS[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    kill, allow = 0x80000000, 0x7FFF0000
    deny = lambda code: (ret, 0, 0, 0x00050000 | code)  # noqa: E731: SECCOMP_RET_ERRNO
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, _AUDIT_ARCH[machine]), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if machine == "x86_64":
        prog += [(jge, 0, 1, _X32_BIT), (ret, 0, 0, kill)]
    for number in nr["denied"]:
        prog += [(jeq, 0, 1, number), deny(errno.EPERM)]
    prog += [(jeq, 0, 1, nr["clone3"]), deny(errno.ENOSYS)]
    for call in ("socket", "socketpair"):  # args[0] (the family; low 32 bits at offset 16)
        prog += [(jeq, 0, 4, nr[call]), (ld, 0, 0, 16), (jeq, 0, 1, _AF_UNIX), (ret, 0, 0, allow),
                 deny(errno.EPERM)]
    # clone's first argument is its flags on both architectures.
    prog += [(jeq, 0, 3, nr["clone"]), (ld, 0, 0, 16), (jset, 0, 1, _NS_FLAGS), deny(errno.EPERM),
             (ret, 0, 0, allow)]
    return prog


def _beneath(tree: str, hidden: list[str]) -> list[str]:
    """Paths whose union is ``tree`` without the ``hidden`` directories inside it (Landlock only adds access, so a
    hidden directory is left out by granting each of its siblings on the way down)."""
    inside = [h for h in hidden if h.startswith(tree.rstrip("/") + "/")]
    if tree in hidden:
        return []
    if not inside:
        return [tree]
    try:
        entries = sorted(os.listdir(tree))
    except OSError:
        return []
    out = []
    for name in entries:
        path = os.path.join(tree, name)
        if os.path.isdir(path) and not os.path.islink(path):
            out += _beneath(path, inside)
        else:
            out.append(path)
    return out


@functools.lru_cache(maxsize=None)
def _read_rules(visible: tuple[str, ...], hidden: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    return tuple((p, _FS_READ if os.path.isdir(p) else _FS_READ & _FS_FILE)
                 for tree in visible for p in _beneath(tree, list(hidden)))


def plan(visible: tuple[str, ...], hidden: tuple[str, ...], files: list[str], scratch: str) -> dict:
    """What the program's interpreter applies before it runs the program (JSON for ``sandbox_init.CHILD``)."""
    abi = landlock_abi()
    out: dict = {"landlock": abi, "seccomp": seccomp_filter(platform.machine()) if seccomp_available() else []}
    if abi:
        out["fs"] = _fs_all(abi)
        out["rules"] = [*_read_rules(visible, hidden), *((f, 4) for f in files),  # READ_FILE
                        *((d, 2 | 4) for d in ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")),
                        ("/proc/self", _FS_READ),  # opened by the program's interpreter: its own /proc entry
                        (scratch, out["fs"])]
    return out
