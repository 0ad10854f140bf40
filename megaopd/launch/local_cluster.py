"""A real N-node Slurm cluster on this machine, for CI and cluster rehearsals: one network namespace per node.

    python -m megaopd.launch.local_cluster up --nodes 4 --state /tmp/megaopd-mn      # as root; idle in ~1-3 s
    python -m megaopd.launch.local_cluster status --nodes 4 --state /tmp/megaopd-mn
    python -m megaopd.launch.local_cluster down --nodes 4 --state /tmp/megaopd-mn

    with LocalCluster(4, Path("/tmp/megaopd-mn")) as cluster:                 # up() ... down()
        cluster.client(["sbatch", "--nodes=3", "job.sbatch"])                 # run in the head namespace

The layout: a head namespace ``<name>-head`` holds a
bridge at ``<subnet>.1`` and slurmctld (hostname ``<name>head``); node k lives in ``<name>-n<k>`` at
``<subnet>.<10+k>``, joined to the bridge by a veth pair born inside these namespaces, and runs one slurmd with
hostname ``node<k>``. Every daemon gets its own UTS and mount namespace (``nsenter --net`` + ``unshare``; not
``ip netns exec``, whose fresh /sys hides the cgroup tree slurmd needs), so its hostname equals its NodeName
and it sees the cluster's own /etc/hosts; its jobs inherit both. The cluster has its own munged on its own socket,
its own ``slurm.conf`` (``.env["SLURM_CONF"]``), state under ``state_dir`` (slurmd's spool in
/tmp/megaopd-spool-<name>), and GPU GRES backed by stand-in char devices so that ``--gpus-per-node`` requests
are accepted (steps see ``CUDA_VISIBLE_DEVICES``; there are no GPUs). Clients (sbatch, squeue, ``megaopd
submit``) run inside the head namespace: the root namespace gets no interface and no address, so all traffic
stays on loopback or inside these namespaces. ``name`` and ``subnet`` tell two clusters apart. Slurm has no
accounting database here: finished jobs are kept by the controller (``scontrol show job``) and recorded in
``jobcomp.txt`` (``.job_records()``). Needs root and Debian's ``slurmctld slurmd slurm-client munge`` packages.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from megaopd.config import ConfigError

NETNS_DIR = Path("/run/netns")
HOSTS_DIR = Path("/etc/netns")
TOOLS = ("slurmctld", "slurmd", "munged", "sinfo", "ip", "nsenter", "unshare")
STATE_SUBDIRS = ("etc", "munge", "run", "log", "ctld", "dev")
IFNAMSIZ = 15  # Linux's limit on interface names


# Why a pending job would never start: ``LocalCluster.wait`` stops waiting for it.
NEVER_RUNS = ("DependencyNeverSatisfied", "PartitionNodeLimit", "PartitionConfig", "BadConstraints")


def check_name_and_subnet(name: str, subnet: str) -> None:
    """A cluster's name (its namespaces' prefix) and /24, refused in one line before anything is brought up."""
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", name):
        raise ConfigError(f"name={name!r}: 1-8 lowercase letters or digits, starting with a letter; choose such a "
                          "name")
    if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet) or max(map(int, subnet.split("."))) > 255:
        raise ConfigError(f"subnet={subnet!r}: the first three octets of a /24, e.g. 10.77.0; give one such")


class LocalCluster:
    """``nodes`` slurmd nodes named node1..nodeN, ``gpus_per_node`` stand-in GPUs each, ``cpus`` CPUs each
    (default: this machine's count; every node advertises the same real cores). With ``aliases`` the node names
    are known to Slurm only, as on sites whose NodeNames are aliases: node k's hostname is ``<name>host<k>``, and
    that is the only name of its address in the cluster's /etc/hosts. With ``loopback_hostname`` each node's
    /etc/hosts first maps its own hostname to 127.0.1.1 (Debian's convention, common on GPU nodes): a process
    that looks its own address up by name gets loopback."""

    def __init__(self, nodes: int, state_dir: Path, name: str = "mns", subnet: str = "10.77.0",
                 gpus_per_node: int = 2, cpus: int | None = None, aliases: bool = False,
                 loopback_hostname: bool = False):
        if not 1 <= nodes <= 200:
            raise ConfigError(f"nodes={nodes}: between 1 and 200 (addresses <subnet>.11 to .210); use fewer nodes")
        check_name_and_subnet(name, subnet)
        self.nodes, self.name, self.subnet = nodes, name, subnet
        self.state_dir = Path(state_dir).resolve()
        self.gpus_per_node, self.cpus = gpus_per_node, cpus or os.cpu_count() or 1
        self.head_ns, self.head_host = f"{name}-head", f"{name}head"
        self.node_names = [f"node{k}" for k in range(1, nodes + 1)]
        self.hostnames = [f"{name}host{k}" if aliases else f"node{k}" for k in range(1, nodes + 1)]
        self.loopback_hostname = loopback_hostname
        self.conf = self.state_dir / "etc" / "slurm.conf"
        self.jobcomp = self.state_dir / "log" / "jobcomp.txt"
        # slurmd makes a Unix socket per job step in its spool (node1_<job>.<step>), and a socket path holds 108
        # bytes at most: under a long state_dir (a test's tmp_path under xdist) the step would fail to launch and
        # the job be held. So the spool has a short path of its own, one per cluster name (names are unique).
        self.spool = Path("/tmp") / f"megaopd-spool-{name}"

    @property
    def env(self) -> dict[str, str]:
        """What a client needs: sbatch passes it on to the jobs, whose sruns need it too."""
        return {"SLURM_CONF": str(self.conf)}

    def node_ns(self, k: int) -> str:
        return f"{self.name}-n{k}"

    # ----- up -----

    def up(self, timeout: float = 60) -> None:
        """Start the cluster (a no-op when it is already running) and wait until every node is idle."""
        _require_root_and_tools()
        if not self._daemons_alive():
            self.down()
            try:
                self._write_files()
                self._make_network()
                self._start_daemons()
            except Exception:
                self.down()
                raise
        self._wait_idle(timeout)

    def _write_files(self) -> None:
        for sub in STATE_SUBDIRS:
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        (self.state_dir / "munge").chmod(0o700)  # munged refuses a key or socket others can write
        for node in self.node_names:  # slurmd does not create its spool/%n itself
            (self.spool / node).mkdir(parents=True, exist_ok=True)
        key = self.state_dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for g in range(self.gpus_per_node):  # slurmd drops GRES without File=; a /dev/null-like device will do
            os.mknod(self.state_dir / "dev" / f"gpu{g}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        hosts = f"{self.subnet}.1 {self.head_host}\n" + "".join(
            f"{self.subnet}.{10 + k} {host}\n" for k, host in enumerate(self.hostnames, 1))
        for ns, host in zip(self._all_ns(), [None, *self.hostnames]):  # the head namespace, then node k's
            own = f"127.0.1.1 {host}\n" if self.loopback_hostname and host else ""  # the first match wins
            (HOSTS_DIR / ns).mkdir(parents=True, exist_ok=True)
            (HOSTS_DIR / ns / "hosts").write_text("127.0.0.1 localhost\n" + own + hosts)
        self.conf.write_text(self._slurm_conf())
        gpus = f"gpu[0-{self.gpus_per_node - 1}]" if self.gpus_per_node > 1 else "gpu0"
        gres = [f"NodeName=node[1-{self.nodes}] Name=gpu File={self.state_dir}/dev/{gpus}"] if self.gpus_per_node else []
        (self.conf.parent / "gres.conf").write_text("\n".join(["AutoDetect=off", *gres]) + "\n")

    def _slurm_conf(self) -> str:
        s = self.state_dir
        mem_mb = int(_mem_total_kb() / 1024 * 0.9)
        gres = f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else ""
        nodes = [f"NodeName={node} NodeHostname={host} NodeAddr={self.subnet}.{10 + k} CPUs={self.cpus} "
                 f"RealMemory={mem_mb}{gres} State=UNKNOWN"
                 for k, (node, host) in enumerate(zip(self.node_names, self.hostnames), 1)]
        return "\n".join([
            f"ClusterName={self.name}",
            f"SlurmctldHost={self.head_host}({self.subnet}.1)",  # must equal the controller's UTS hostname
            "AuthType=auth/munge",
            # A requeued job waits cred_expire seconds before it can start again (default 120 s); short for tests.
            f"AuthInfo=socket={s}/munge/munge.sock,cred_expire=10",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SlurmUser=root",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none",
            "ReturnToService=2", "KillWait=5", "SchedulerParameters=sched_interval=2",
            "MinJobAge=3600",  # finished jobs stay in `scontrol show job` for the tests (no accounting database)
            "MailProg=/bin/true",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={self.jobcomp}",
            f"StateSaveLocation={s}/ctld",
            f"SlurmdSpoolDir={self.spool}/%n",  # %n: the node name
            f"SlurmctldPidFile={s}/run/slurmctld.pid", f"SlurmdPidFile={s}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={s}/log/slurmctld.log", f"SlurmdLogFile={s}/log/slurmd-%n.log",
            "GresTypes=gpu",
            *nodes,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n"

    def _make_network(self) -> None:
        head = self.head_ns
        _ip("netns", "add", head)
        _ip("-n", head, "link", "set", "lo", "up")
        _ip("-n", head, "link", "add", "br0", "type", "bridge")
        _ip("-n", head, "addr", "add", f"{self.subnet}.1/24", "dev", "br0")
        _ip("-n", head, "link", "set", "br0", "up")
        for k in range(1, self.nodes + 1):
            ns, veth = self.node_ns(k), f"v{k}"
            assert len(veth) <= IFNAMSIZ
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Both ends are born inside our namespaces: the root namespace never sees an interface.
            _ip("-n", head, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", head, "link", "set", veth, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.subnet}.{10 + k}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def _start_daemons(self) -> None:
        s = self.state_dir
        _run_daemon(["munged", "--force", f"--socket={s}/munge/munge.sock", f"--key-file={s}/munge/munge.key",
                     f"--pid-file={s}/run/munged.pid", f"--seed-file={s}/munge/munge.seed",
                     f"--log-file={s}/log/munged.log"], s / "log" / "munged.out")
        self._in_ns(self.head_ns, self.head_host, ["slurmctld", "-f", str(self.conf)])
        for k, (node, host) in enumerate(zip(self.node_names, self.hostnames), 1):
            self._in_ns(self.node_ns(k), host, ["slurmd", "-f", str(self.conf), "-N", node])

    def _in_ns(self, ns: str, hostname: str, argv: list[str]) -> None:
        """Start a daemon inside netns ``ns`` in its own UTS and mount namespace, with the cluster's /etc/hosts."""
        script = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
        _run_daemon(["nsenter", f"--net={NETNS_DIR / ns}", "unshare", "--mount", "--uts", "sh", "-c", script,
                     str(HOSTS_DIR / ns / "hosts"), hostname, *argv], self.state_dir / "log" / f"{hostname}.out")

    def _wait_idle(self, timeout: float) -> None:
        deadline, states = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if len(states) == self.nodes and all(st.startswith("idle") and not st.endswith("*")
                                                 for st in states.values()):
                return
            for node, st in states.items():  # left down or drained by an earlier run
                if st.startswith(("down", "drain")):
                    self.client(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
            time.sleep(0.5)
        logs = "\n".join(f"{p.name}: {_tail(p)}" for p in sorted((self.state_dir / "log").glob("*.log")))
        raise RuntimeError(f"local cluster {self.name}: nodes not idle after {timeout:.0f} s "
                           f"(sinfo: {states or 'no answer'})\n{logs}")

    # ----- queries -----

    def client(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run a client command (sbatch, squeue, scontrol, ``python -m megaopd.cli submit``, ...) inside the head
        namespace with ``.env``; keyword arguments go to ``subprocess.run`` (default: text output captured)."""
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 120)
        kw["env"] = {**os.environ, **kw.get("env", {}), **self.env}
        return subprocess.run(["ip", "netns", "exec", self.head_ns, *argv], **kw)

    def wait(self, job_ids: list[str], timeout_s: float) -> None:
        """Until the jobs have left the queue. Jobs left pending for a reason they can never leave (``NEVER_RUNS``:
        an upstream job failed, say) are cancelled, and so is every job still there after `timeout_s` (then
        TimeoutError). A busy controller answers squeue with an error: then it is asked again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listed = self.client(["squeue", "-h", "-o", "%i %T %r", "-j", ",".join(job_ids)])
            if listed.returncode == 0 or "Invalid job id" in listed.stderr:
                queue = [line.split(maxsplit=2) for line in listed.stdout.splitlines() if line.strip()]
                if not queue:
                    return
                if all(state == "PENDING" and reason in NEVER_RUNS for _, state, reason in queue):
                    self.client(["scancel", *(job for job, _, _ in queue)])
                    return
            time.sleep(1)
        self.client(["scancel", *job_ids])
        raise TimeoutError(f"jobs {', '.join(job_ids)} still queued or running after {timeout_s:.0f} s")

    def node_states(self) -> dict[str, str]:
        """Node name -> Slurm state (``idle``, ``allocated``, ``down*``, ...); empty when the controller is down."""
        if not (NETNS_DIR / self.head_ns).exists():
            return {}
        try:
            out = self.client(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=10).stdout
        except subprocess.TimeoutExpired:
            return {}
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def job_records(self) -> list[dict[str, str]]:
        """One dict per job ending (``JobId``, ``JobName``, ``JobState``, ``NodeList``, ...), from jobcomp.txt;
        a requeued job has one record per run."""
        if not self.jobcomp.exists():
            return []
        return [dict(field.split("=", 1) for field in line.split() if "=" in field)
                for line in self.jobcomp.read_text().splitlines()]

    def _daemons_alive(self) -> bool:
        run = self.state_dir / "run"
        expected = ["munged", "slurmctld", *(f"slurmd-{node}" for node in self.node_names)]
        return all(_alive_daemon(run / f"{name}.pid") for name in expected)

    def _all_ns(self) -> list[str]:
        return [self.head_ns, *(self.node_ns(k) for k in range(1, self.nodes + 1))]

    # ----- down -----

    def down(self, timeout: float = 15) -> None:
        """Stop everything this cluster started, whatever state it is in: the daemons (by PID file), every
        process left in its namespaces (job steps), the namespaces, /etc/netns entries and the state files."""
        pattern = re.compile(rf"{re.escape(self.name)}-(head|n\d+)")
        namespaces = sorted({*self._all_ns(), *(p.name for p in NETNS_DIR.glob(f"{self.name}-*")
                                                 if pattern.fullmatch(p.name))})
        pids = {pid for pidfile in (self.state_dir / "run").glob("*.pid") if (pid := _alive_daemon(pidfile))}
        for ns in namespaces:
            if (NETNS_DIR / ns).exists():
                out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
                pids |= {int(p) for p in out.split()}
        pids.discard(os.getpid())
        _stop(pids, timeout)
        for ns in namespaces:
            if (NETNS_DIR / ns).exists():
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(HOSTS_DIR / ns, ignore_errors=True)
        for sub in STATE_SUBDIRS:  # only what up() made: state_dir may hold other things
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        shutil.rmtree(self.spool, ignore_errors=True)
        try:
            self.state_dir.rmdir()
        except OSError:
            pass

    def __enter__(self) -> LocalCluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def _require_root_and_tools() -> None:
    if os.geteuid() != 0:
        raise PermissionError("a local multi-node Slurm cluster needs root: it creates network namespaces, "
                              "device nodes and bind mounts, and runs slurmd/slurmctld as SlurmUser=root. Run it "
                              "as root (sudo python -m megaopd.launch.local_cluster up ...), or check the batch "
                              "scripts without a cluster: megaopd submit STUDY --launch L.yaml --dry-run")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise FileNotFoundError(f"a local Slurm cluster needs {', '.join(missing)} (not on PATH): "
                                "apt-get install slurmctld slurmd slurm-client munge iproute2 util-linux")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _run_daemon(argv: list[str], out: Path) -> None:
    """Run a daemon that forks into the background; its own stdout/stderr (before it detaches) go to ``out``."""
    with out.open("ab") as log:
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=30)
    if result.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {_tail(out)}")


def _alive_daemon(pidfile: Path) -> int | None:
    """The PID in ``pidfile`` if that process is alive and is the daemon the file is named after."""
    try:
        pid = int(pidfile.read_text().split()[0])
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError, IndexError):
        return None
    return pid if pidfile.stem.split("-")[0] == comm else None


def _stop(pids: set[int], timeout: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)}
            time.sleep(0.1)
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _mem_total_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1])
    return 1024 * 1024


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megaopd.launch.local_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--state", type=Path, required=True, help="state directory (config, logs, spool)")
    parser.add_argument("--name", default="mns", help="namespace prefix and ClusterName")
    parser.add_argument("--subnet", default="10.77.0", help="first three octets of the cluster's /24")
    parser.add_argument("--gpus-per-node", type=int, default=2, help="stand-in GPUs per node (GRES)")
    parser.add_argument("--cpus", type=int, default=None, help="CPUs each node advertises (default: nproc)")
    parser.add_argument("--aliases", action="store_true", help="node names known to Slurm only (see LocalCluster)")
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.nodes, args.state, args.name, args.subnet, args.gpus_per_node, args.cpus,
                           args.aliases)
    if args.action == "up":
        try:
            cluster.up()
        except (PermissionError, FileNotFoundError, RuntimeError) as e:
            print(f"local_cluster: {e}", file=sys.stderr)
            return 1
        print(f"local cluster {args.name} up: {args.nodes} nodes idle; clients: "
              f"ip netns exec {cluster.head_ns} env SLURM_CONF={cluster.conf} sinfo")
    elif args.action == "down":
        cluster.down()
        print(f"local cluster {args.name} down")
    else:
        states = cluster.node_states()
        print(" ".join(f"{node}={state}" for node, state in states.items()) or f"local cluster {args.name}: down")
        return 0 if states else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
