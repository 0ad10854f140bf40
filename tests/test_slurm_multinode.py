"""The multi-node Slurm scripts on a real multi-node cluster: megaopd.launch.local_cluster (one network namespace
per node; .ci/slurm_multinode_up.sh starts the 4-node one that `make test` uses).

The cluster's own life cycle (up, a job across nodes, two clusters side by side, down with nothing left) runs on
small clusters of its own; everything else runs on the CI cluster through the path users take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from megaopd.launch.local_cluster import NETNS_DIR, LocalCluster
from megaopd.launch.slurm import LaunchConfig, render_stage
from megaopd.study import StageConfig, StudyConfig

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "cluster_probe"  # the placement probe (trainer side) and a /health-only server
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


def job_state(cluster: LocalCluster, job_id: str) -> dict[str, str]:
    out = cluster.client(["scontrol", "show", "job", job_id]).stdout
    return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)


def wait_for(cluster: LocalCluster, ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not cluster.client(["squeue", "-h", "-o", "%i", "-j", ",".join(ids)]).stdout.split():
            return
        time.sleep(1)
    cluster.client(["scancel", *ids])
    pytest.fail(f"jobs {ids} still queued or running after {timeout:.0f} s")


def run_probe_stage(cluster: LocalCluster, tmp_path: Path, **launch) -> tuple[dict, list[dict], str]:
    """One GRPO stage rendered from slurm/stage_multinode.sbatch whose trainer entry point is a probe reporting
    rank -> host over gloo (tests/cluster_probe/placement_probe.py); returns the job's state, workers and log."""
    model = tmp_path / "model"  # only config.json: the job reads the heads to size the server's TP
    model.mkdir()
    (model / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 2}')
    out = tmp_path / "out"
    study = StudyConfig(out=str(out), stages=[StageConfig("grpo", str(ROOT / "configs/embedded/grpo.yaml"),
                                                          [f"model.path={model}", "model.backend=megatron"])])
    config = LaunchConfig(time="00:05:00", venv=sys.prefix, workdir=str(ROOT), trainer_module="placement_probe",
                          sglang_python=sys.executable, sglang_env={"PYTHONPATH": str(PROBE / "server")},
                          server_start_timeout_s=60, **launch)
    script = out / "slurm" / "grpo.sbatch"
    (out / "slurm" / "logs").mkdir(parents=True)
    script.write_text(render_stage(study, study.stages[0], config))
    submitted = cluster.client(["sbatch", "--parsable", str(script)],
                               env={"PYTHONPATH": f"{ROOT}:{PROBE}", "OMP_NUM_THREADS": "1"})
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    wait_for(cluster, [job_id], timeout=180)
    log = next((out / "slurm" / "logs").glob(f"*-{job_id}.out")).read_text()
    state = job_state(cluster, job_id)
    assert state["JobState"] == "COMPLETED", (state, log[-3000:])
    (line,) = [line for line in log.splitlines() if line.startswith("placement ")]
    placement = json.loads(line.split(" ", 1)[1])
    workers = placement["workers"]
    world = len(workers)
    assert sorted(w["rank"] for w in workers) == list(range(world))
    assert placement["rank_sum"] == placement["expected_sum"] == world * (world - 1) / 2
    return state, workers, log


def agents_per_host(workers: list[dict]) -> Counter:
    return Counter(host for host, _ in {(w["host"], w["agent"]) for w in workers})


def test_each_trainer_node_runs_one_torchrun_agent_and_its_share_of_ranks(cluster, tmp_path):
    """A GRPO stage's layout: 2 trainer nodes x 2 workers, then a rollout node, in one 3-node job. Before the fix
    the trainer's srun inherited the job's 3 tasks: 2 agents on node1 with all 4 ranks, node2's agent failed at
    the rendezvous, and the job ended FAILED."""
    state, workers, log = run_probe_stage(cluster, tmp_path, nodes=2, gpus_per_node=2, rollout_nodes=1)
    assert state["NodeList"] == "node[1-3]" and "rollout on node3" in log
    # Each trainer node: exactly one torchrun agent and its 2 workers; the rollout node none.
    assert Counter(w["host"] for w in workers) == {"node1": 2, "node2": 2}, workers
    assert agents_per_host(workers) == {"node1": 1, "node2": 1}
    assert sorted((w["rank"], w["host"], w["local_rank"]) for w in workers) == [
        (0, "node1", 0), (1, "node1", 1), (2, "node2", 0), (3, "node2", 1)]
    assert all(w["host"] == w["node"] for w in workers)
    assert all(w["servers_reached"] for w in workers), "a trainer worker could not reach the rollout server"


@pytest.mark.slow
def test_rendezvous_works_when_node_names_are_aliases(root_only, tmp_path):
    """NodeNames only Slurm knows (no resolver has node1): the rendezvous and the server URLs use addresses."""
    with LocalCluster(3, tmp_path / "state", name="mntal", subnet="10.79.3", gpus_per_node=1,
                      aliases=True) as aliased:
        state, workers, log = run_probe_stage(aliased, tmp_path, nodes=2, gpus_per_node=1, rollout_nodes=1)
    assert sorted((w["rank"], w["node"], w["host"]) for w in workers) == [(0, "node1", "mntalhost1"),
                                                                          (1, "node2", "mntalhost2")]
    assert agents_per_host(workers) == {"mntalhost1": 1, "mntalhost2": 1}
    assert all(w["servers_reached"] for w in workers)
    assert "master 10.79.3.11" in log
