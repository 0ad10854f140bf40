"""The two small programs that start a sandboxed run, kept as source text (they run in fresh interpreters).

``CHILD`` is the program's own interpreter (``python -I -S -c CHILD RLIMITS no_new_privs|- CONFINE``): no_new_privs
(unless its parent set it), rlimits, in the fallback mode Landlock and seccomp (``confine.plan``), the socket audit
hook, then ``main.py`` as ``__main__``.

``NS_INIT`` is init of a fresh PID namespace (started by ``unshare``), root inside its namespaces. It builds a new
root on a small tmpfs holding only what an interpreter needs: /usr, /bin, /lib* (read-only binds, Python's
site-packages covered by empty mounts, so no installed dataset is visible), a few /dev nodes, a fresh /proc, empty
world-writable /tmp, /var/tmp, /dev/shm, /run/lock, and /scratch holding the run's files. It pivots into it, so the
host's files (datasets, the trainer's home, megaopd itself) are not there to read or write, then forks the program
without privileges: as root it drops to the slot uid, in a user namespace it drops every capability. Its exit
kills everything left in the namespace, daemons included.
"""

# The exit status of NS_INIT or CHILD when it could not build the sandbox (or the program exits 125 itself).
INIT_FAILED = 125

CHILD = r"""
import json, resource, sys
if sys.argv[2] == "no_new_privs":  # (the namespace init has set it already)
    import ctypes
    ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: a setuid binary (su) cannot raise privileges
    del ctypes
for name, value in json.loads(sys.argv[1]).items():
    # CPU: SIGXCPU at the soft limit, SIGKILL a second later for a program that catches it.
    resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
confine = json.loads(sys.argv[3])  # the fallback mode's Landlock rules and seccomp filter (megaopd.verifiers.confine)
if confine:
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    def failed(what):  # fail closed: the program does not run half-confined
        sys.stderr.write("sandbox confinement failed: %s (errno %d)\n" % (what, ctypes.get_errno()))
        sys.stderr.flush()
        os._exit(INIT_FAILED_STATUS)
    abi = confine["landlock"]
    if abi:
        # handled fs rights, TCP bind+connect (ABI 4), abstract unix sockets + signals scoped (ABI 6)
        attr = (ctypes.c_uint64 * 3)(confine["fs"], 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
        ruleset = libc.syscall(444, attr, ctypes.c_size_t(8 if abi < 4 else 16 if abi < 6 else 24), 0)
        if ruleset < 0:
            failed("landlock_create_ruleset")
        class Beneath(ctypes.Structure):
            _pack_ = 1
            _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
        for path, access in confine["rules"]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            added = libc.syscall(445, ruleset, 1, ctypes.byref(Beneath(access, fd)), 0)  # RULE_PATH_BENEATH
            os.close(fd)
            if added != 0:
                failed("landlock_add_rule " + path)
        if libc.syscall(446, ruleset, 0) != 0:
            failed("landlock_restrict_self")
        os.close(ruleset)
    if confine["seccomp"]:
        class Insn(ctypes.Structure):
            _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                        ("k", ctypes.c_uint32)]
        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]
        insns = (Insn * len(confine["seccomp"]))(*[Insn(*i) for i in confine["seccomp"]])
        if libc.prctl(22, 2, ctypes.byref(Prog(len(insns), insns)), 0, 0) != 0:  # SECCOMP_MODE_FILTER
            failed("seccomp")
    del ctypes, os, libc, failed, abi
def _no_network(event, args):
    if event in ("socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo"):
        raise PermissionError("network access is disabled in the sandbox")
sys.addaudithook(_no_network)
del json, resource, name, value, _no_network, confine
import runpy
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
""".replace("INIT_FAILED_STATUS", str(INIT_FAILED))

NS_INIT = r"""
import ctypes, json, os, sys
def failed(*exc):  # the run is a sandbox error, not the program's failure
    __import__("traceback").print_exception(*exc)
    sys.stderr.flush()
    os._exit(INIT_FAILED_STATUS)
sys.excepthook = failed
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
ATIME = 1024 | 2048 | 4096  # noatime, nodiratime, relatime: locked in a user namespace, so a remount keeps them

def call(ret, what):  # fail closed: the run does not start on a half-built root
    if ret != 0:
        raise OSError(ctypes.get_errno(), "sandbox init: " + what)

def mount(source, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    call(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), "mount " + target)

def bind_ro(path):
    mount(path, new + path, None, BIND | REC)
    kept = os.statvfs(new + path).f_flag & (NOEXEC | ATIME)
    mount(None, new + path, None, BIND | REMOUNT | RDONLY | NOSUID | NODEV | kept)

new = cfg["root"]
mount(None, "/", None, REC | PRIVATE)
mount("tmpfs", new, "tmpfs", NOSUID | NODEV, "size=%dm,nr_inodes=%d,mode=755" % (cfg["tmpfs_mb"], cfg["inodes"]))
for link, target in cfg["links"]:
    os.symlink(target, new + link)
for path in cfg["ro"]:
    os.makedirs(new + path, exist_ok=True)
    bind_ro(path)
for path in cfg["ro_files"]:  # the loader's cache and a few lookups, not the rest of /etc
    os.makedirs(os.path.dirname(new + path), exist_ok=True)
    open(new + path, "w").close()
    bind_ro(path)
for path in cfg["hide"]:
    if os.path.isdir(new + path):
        mount("tmpfs", new + path, "tmpfs", RDONLY | NOSUID | NODEV, "size=4k,mode=755")
os.makedirs(new + "/dev", exist_ok=True)
for node in ("null", "zero", "full", "random", "urandom"):
    open(new + "/dev/" + node, "w").close()
    mount("/dev/" + node, new + "/dev/" + node, None, BIND)
for i, name in enumerate(("stdin", "stdout", "stderr")):
    os.symlink("/proc/self/fd/%d" % i, new + "/dev/" + name)
os.symlink("/proc/self/fd", new + "/dev/fd")
os.makedirs(new + "/proc")
mount("proc", new + "/proc", "proc", NOSUID | NODEV | NOEXEC)
for path in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):  # fresh and empty, gone with the namespace
    os.makedirs(new + path, exist_ok=True)
    os.chmod(new + path, 0o1777)
os.makedirs(new + "/scratch")
for name in os.listdir("."):  # the run's files, from the host scratch dir (ours) onto the tmpfs
    with open(name, "rb") as src, open(new + "/scratch/" + name, "wb") as dst:
        dst.write(src.read())
uid = cfg["uid"]
for path in [new + "/scratch"] + [new + "/scratch/" + n for n in os.listdir(new + "/scratch")]:
    os.chown(path, max(uid, 0), max(uid, 0))
os.chmod(new + "/scratch", 0o700)
os.chdir(new)
call(libc.syscall(cfg["pivot_root"], b".", b"."), "pivot_root")  # the old root stacks under the new one...
call(libc.umount2(b".", 2), "detach the old root")  # ...and goes: MNT_DETACH
os.chdir("/scratch")

child = os.fork()
if child == 0:
    if uid >= 0:  # root outside: become the slot uid (capabilities go with uid 0)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:  # uid 0 of a user namespace: keep the uid, drop every capability, for good
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP: exec cannot grant them back
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        call(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    call(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
while True:
    pid, status = os.wait()
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
""".replace("INIT_FAILED_STATUS", str(INIT_FAILED))
