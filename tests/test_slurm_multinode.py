"""The multi-node Slurm scripts on a real multi-node cluster: megaopd.launch.local_cluster (one network namespace
per node; .ci/slurm_multinode_up.sh starts the 4-node one that `make test` uses).

The cluster's own life cycle (up, a job across nodes, two clusters side by side, down with nothing left) runs on
small clusters of its own; everything else runs on the CI cluster through the path users take.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megaopd.launch.local_cluster import NETNS_DIR, LocalCluster

ROOT = Path(__file__).resolve().parents[1]
CI_STATE = Path(os.environ.get("MEGAOPD_MULTINODE_STATE", "/tmp/megaopd-multinode"))
pytestmark = pytest.mark.multinode


def absent(reason: str):
    """Outside CI a missing cluster skips; in CI (CI=true) it fails: those tests must always run there."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (CI=true: the multi-node tests must run)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster() -> LocalCluster:
    """The 4-node CI cluster, as .ci/slurm_multinode_up.sh started it."""
    c = LocalCluster(4, CI_STATE, name="mns", subnet="10.77.0")
    if os.geteuid() != 0:
        absent("the multi-node cluster needs root")
    states = c.node_states()
    if sorted(states) != c.node_names or not all(s.startswith(("idle", "mixed", "alloc")) for s in states.values()):
        absent(f"the 4-node cluster is not up (sinfo: {states or 'no answer'}); run .ci/slurm_multinode_up.sh")
    return c


@pytest.fixture
def root_only():
    if os.geteuid() != 0:
        absent("a local cluster needs root")


def test_without_root_the_cluster_says_what_it_needs(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root.*--dry-run"):
        LocalCluster(2, tmp_path).up()


def test_names_that_would_break_the_namespaces_are_refused(tmp_path):
    with pytest.raises(ValueError, match="1-8 lowercase"):
        LocalCluster(2, tmp_path, name="a-very-long-name")
    with pytest.raises(ValueError, match="subnet"):
        LocalCluster(2, tmp_path, subnet="10.77.0.0/24")


def test_two_clusters_side_by_side_run_jobs_across_nodes_and_leave_nothing_behind(root_only, tmp_path):
    a = LocalCluster(2, tmp_path / "a", name="mnta", subnet="10.79.1", gpus_per_node=1)
    b = LocalCluster(3, tmp_path / "b", name="mntb", subnet="10.79.2", gpus_per_node=2)
    try:
        with a, b:
            a.up()  # idempotent: already up
            job = ("srun -l --nodes={n} --ntasks={n} bash -c "
                   "'echo $(hostname) $SLURMD_NODENAME $(getent hosts $(hostname)) gpus=$CUDA_VISIBLE_DEVICES'")
            for c, n in ((a, 2), (b, 3)):
                out = c.client(["sbatch", "--wait", f"--nodes={n}", f"--gpus-per-node={c.gpus_per_node}",
                                f"--output={tmp_path}/{c.name}.out", f"--wrap={job.format(n=n)}"])
                assert out.returncode == 0, out.stderr
                lines = sorted((tmp_path / f"{c.name}.out").read_text().split("\n")[:n])
                # Each node: its own hostname (== NodeName) and address in this cluster's subnet.
                assert [line.split()[1:5] for line in lines] == [
                    [f"node{k}", f"node{k}", f"{c.subnet}.{10 + k}", f"node{k}"] for k in range(1, n + 1)]
                assert all(line.endswith("gpus=" + ",".join(map(str, range(c.gpus_per_node)))) for line in lines)
                (record,) = c.job_records()
                assert record["JobState"] == "COMPLETED" and record["NodeCnt"] == str(n)
            # The root namespace gets no interface or address of either cluster.
            assert "10.79." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    finally:
        a.down(), b.down()
    for c in (a, b):
        assert not list(NETNS_DIR.glob(f"{c.name}-*")) and not Path(f"/etc/netns/{c.head_ns}").exists()
        assert not c.state_dir.exists()
        c.down()  # again, on nothing: no error
