"""The multi-node Slurm scripts on a real multi-node cluster: megaopd.launch.local_cluster (one network namespace
per node; .ci/slurm_multinode_up.sh starts the 4-node one that `make test` uses).

The cluster's own life cycle (up, a job across nodes, two clusters side by side, down with nothing left) runs on
small clusters of its own; everything else runs on the CI cluster through the path users take.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from megaopd.launch.local_cluster import NETNS_DIR, LocalCluster
from megaopd.launch.slurm import LaunchConfig, render_stage
from megaopd.rollout.serving.sglang_cpu import cpu_server_args, cpu_server_env
from megaopd.run.study import StageConfig, StudyConfig

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "cluster_probe"  # the placement probe (trainer side) and a /health-only server
# A few tiny steps per stage: these tests are about layouts, jobs and resumption, not learning.
SMALL = ["eval.every=2", "eval.prompts_per_domain=4", "eval.final_prompts_per_domain=4", "checkpoint.every=2",
         "rollout.max_new_tokens=16", "train.prompts_per_step=4"]
DATA = {"add": "[{out}/data/arith_add/train.jsonl]", "trace": "[{out}/data/prog_trace/train.jsonl]",
        "both": "[{out}/data/arith_add/train.jsonl, {out}/data/prog_trace/train.jsonl]",
        "eval": "[{out}/data/arith_add/test.jsonl, {out}/data/prog_trace/test.jsonl]"}
LAYOUT = re.compile(r"megaopd: job (\d+) restart (\d+): train on (.+?) \((\d+) workers each, master \S+\), "
                    r"rollout on (.+?), teachers on (.+)$", re.M)
RANK = re.compile(r"^megaopd: rank (\d+)/(\d+) local (\d+) on (\S+)$", re.M)
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
        assert not c.state_dir.exists() and not c.spool.exists()
        c.down()  # again, on nothing: no error


def job_state(cluster: LocalCluster, job_id: str) -> dict[str, str]:
    out = cluster.client(["scontrol", "show", "job", job_id]).stdout
    return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)


def wait_for(cluster: LocalCluster, ids: list[str], timeout: float) -> None:
    try:
        cluster.wait(ids, timeout)
    except TimeoutError as e:
        pytest.fail(str(e))


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
    state, workers, log = run_probe_stage(cluster, tmp_path, nodes=2, gpus_per_node=2, rollout_nodes=1,
                                          socket_ifname="eth0", ib_hca="mlx5_0")
    # Slurm picks any 3 free nodes (one may still be completing an earlier test's job): the first 2 train.
    first, second, rollout = cluster.client(["scontrol", "show", "hostnames", state["NodeList"]]).stdout.split()
    assert f"rollout on {rollout}" in log
    # Each trainer node: exactly one torchrun agent and its 2 workers; the rollout node none.
    assert Counter(w["host"] for w in workers) == {first: 2, second: 2}, workers
    assert agents_per_host(workers) == {first: 1, second: 1}
    assert sorted((w["rank"], w["host"], w["local_rank"]) for w in workers) == [
        (0, first, 0), (1, first, 1), (2, second, 0), (3, second, 1)]
    assert all(w["host"] == w["node"] for w in workers)
    assert all(w["servers_reached"] for w in workers), "a trainer worker could not reach the rollout server"
    # Gloo ran over the named interface; the step had the node's 2 CPUs (not srun's default of 1), one thread per
    # worker; the weight sync names node1's NodeAddr.
    for w in workers:
        assert (w["GLOO_SOCKET_IFNAME"], w["NCCL_SOCKET_IFNAME"], w["NCCL_IB_HCA"]) == ("eth0", "eth0", "mlx5_0")
        assert (w["SLURM_CPUS_PER_TASK"], w["OMP_NUM_THREADS"]) == (str(cluster.cpus), str(max(cluster.cpus // 2, 1)))
    assert {w["sync_address"] for w in workers} == {f"{cluster.subnet}.{10 + int(first.removeprefix('node'))}"}


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


@pytest.mark.slow
def test_on_nodes_whose_hostname_is_loopback_gloo_and_the_weight_sync_use_the_node_address(root_only, tmp_path):
    """Debian-style nodes, as on many GPU sites: each resolves its own hostname to 127.0.1.1. Gloo over the named
    interface (launch setting socket_ifname) still connects the trainer nodes (without it, or with lo, it fails
    connecting to 127.0.x.1), and the weight sync gives the servers node1's NodeAddr, not 127.0.1.1."""
    with LocalCluster(3, tmp_path / "state", name="mntlo", subnet="10.79.4", gpus_per_node=1,
                      loopback_hostname=True) as debian:
        state, workers, log = run_probe_stage(debian, tmp_path, nodes=2, gpus_per_node=1, rollout_nodes=1,
                                              socket_ifname="eth0")
    assert {w["hostname_address"] for w in workers} == {"127.0.1.1"}
    assert {w["sync_address"] for w in workers} == {"10.79.4.11"}
    assert all(w["servers_reached"] for w in workers)


def sglang_python() -> str:
    """SGLang's own environment (`make test` builds .venv-sglang and exports MEGAOPD_SGLANG_PYTHON)."""
    unavailable = os.environ.get("MEGAOPD_SGLANG_UNAVAILABLE", "")
    if unavailable:  # make could not build it on this disk, and said why
        pytest.skip(f"no SGLang environment: {unavailable}")
    python = os.environ.get("MEGAOPD_SGLANG_PYTHON", "")
    if not python or subprocess.run([python, "-c", "import sglang"], capture_output=True).returncode:
        absent("no SGLang environment: set MEGAOPD_SGLANG_PYTHON (make test builds .venv-sglang)")
    return python


def cpu_launch(**fields) -> dict:
    """A launch file for the CPU cluster: megatron on gloo (megaopd.models.megatron.cpu_launch), one stand-in GPU per
    trainer node (one worker), SGLang CPU servers from their own environment, one CPU per step (every node
    advertises the machine's cores)."""
    return {"time": "00:20:00", "venv": sys.prefix, "workdir": str(ROOT), "gpus_per_node": 1, "cpus_per_task": 1,
            "trainer_module": "megaopd.models.megatron.cpu_launch", "sglang_tp": 1,
            "sglang_args": cpu_server_args(), "sglang_env": cpu_server_env(),
            "overrides": ["model.backend=megatron", "opd.form=sampled", "rollout.sglang.max_total_tokens=2048"],
            **fields}


def submit_study(cluster: LocalCluster, tmp_path: Path, stages: list[dict], launch: dict) -> dict[str, str]:
    """`megaopd submit STUDY --launch L.yaml` from the head namespace, as a user would; job name -> id."""
    study = {"out": str(tmp_path / "out"), "vars": DATA,
             "assets": {"presets": ["qwen3-tiny"], "domains": ["arith_add", "prog_trace"], "train_rows": 200,
                        "heldout_rows": 40},
             "stages": stages}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    (tmp_path / "launch.yaml").write_text(yaml.safe_dump(launch))
    result = cluster.client([sys.executable, "-m", "megaopd.cli", "submit", str(tmp_path / "study.yaml"),
                             "--launch", str(tmp_path / "launch.yaml")], cwd=ROOT,
                            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return dict(line.split() for line in result.stdout.splitlines())


def job_log(tmp_path: Path, name: str, job_id: str) -> str:
    return next((tmp_path / "out" / "slurm" / "logs").glob(f"*-{name}-{job_id}.out")).read_text()


def stage(name: str, config: str, *overrides: str) -> dict:
    return {"name": name, "config": str(ROOT / "configs" / "embedded" / config),
            "overrides": ["model.path={out}/models/qwen3-tiny", "data.eval={eval}", *SMALL, *overrides]}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # its jobs have 1200 s; 716 s measured on a loaded 2-core machine
def test_two_domain_study_runs_on_four_nodes_through_megaopd_submit(cluster, tmp_path):
    """GRPO experts (megatron DP over 2 trainer nodes), joint GRPO (+ an SGLang rollout node) and multi-teacher OPD
    from the experts (+ an SGLang teacher node each), then the report, all as dependent Slurm jobs. (Single-teacher
    OPD on a teacher node is the SIGTERM test's stage below: one SGLang start less here, CI's longest test.)"""
    sglang = sglang_python()
    grpo = ["train.steps=2", "rollout.samples_per_prompt=4"]
    stages = [
        stage("expert_add", "grpo.yaml", "data.train={add}", *grpo),
        stage("expert_trace", "grpo.yaml", "data.train={trace}", *grpo),
        stage("joint_grpo", "grpo.yaml", "data.train={both}", *grpo),
        stage("multi_teacher", "opd.yaml", "data.train={both}", "opd.teachers.arith_add={out}/expert_add/final",
              "opd.teachers.prog_trace={out}/expert_trace/final", "train.steps=2"),
    ]
    launch = cpu_launch(nodes=2, teacher_servers=True, sglang_python=sglang,
                        stages={"joint_grpo": {"rollout_nodes": 1}})
    start = time.monotonic()
    ids = submit_study(cluster, tmp_path, stages, launch)
    assert list(ids) == ["assets", "expert_add", "expert_trace", "joint_grpo", "multi_teacher", "report"]
    wait_for(cluster, list(ids.values()), timeout=1200)
    print(f"study on 4 nodes: {time.monotonic() - start:.0f} s")
    logs = {name: job_log(tmp_path, name, job_id) for name, job_id in ids.items()}
    states = {name: job_state(cluster, job_id)["JobState"] for name, job_id in ids.items()}
    assert states == dict.fromkeys(ids, "COMPLETED"), {n: logs[n][-2000:] for n, s in states.items()
                                                        if s != "COMPLETED"}

    # Per stage, from its own log: 2 trainer nodes with one rank each, then its server nodes.
    servers = {"expert_add": (0, 0), "expert_trace": (0, 0), "joint_grpo": (1, 0), "multi_teacher": (0, 2)}
    for name, (rollout_nodes, teacher_nodes) in servers.items():
        ((_, restart, train, workers, rollout, teachers),) = LAYOUT.findall(logs[name])
        train_hosts = train.split()
        assert restart == "0" and workers == "1" and len(set(train_hosts)) == 2, logs[name][:2000]
        server_hosts = [h for h in (rollout.split() + teachers.split()) if h != "none"]
        assert len(rollout.split()) == max(rollout_nodes, 1) and len(server_hosts) == rollout_nodes + teacher_nodes
        assert not set(server_hosts) & set(train_hosts)
        ranks = sorted((int(r), int(w), host) for r, w, _, host in RANK.findall(logs[name]))
        assert ranks == [(0, 2, train_hosts[0]), (1, 2, train_hosts[1])], (name, ranks)
        assert len(re.findall(r"^megaopd: SGLang .* server on ", logs[name], re.M)) == len(server_hosts)
        summary = json.loads((tmp_path / "out" / name / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["ledger"]["totals"]["stage"] > 0
    # The rollout server served every pushed version, each verified before use.
    assert "weights v2 verified on 1 server(s)" in logs["joint_grpo"]
    assert "megaopd: SGLang rollout server on " in logs["joint_grpo"]
    for route in ("arith_add", "prog_trace"):  # one teacher server per domain, each on its own node
        assert f"megaopd: SGLang teacher {route} server on " in logs["multi_teacher"]
    report = (tmp_path / "out" / "report.txt").read_text()
    assert all(f"{name} (final)" in report for name in servers)
    # The teachers' FLOPs are booked on top of the student's own.
    opd = json.loads((tmp_path / "out" / "multi_teacher" / "summary.json").read_text())["ledger"]["totals"]
    assert opd["with_teachers"] > opd["stage"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # its jobs have 600 s; 173 s measured on a loaded machine
def test_preempted_multinode_stage_requeues_and_resumes_with_the_same_ledger(cluster, tmp_path):
    """Two identical megatron GRPO stages on 2 nodes each, side by side; one gets USR1 mid-stage (what
    `#SBATCH --signal=B:USR1@N` sends): it checkpoints, requeues, resumes and ends with its twin's ledger."""
    # Long enough that USR1, sent once step 2 is logged, lands mid-stage on an idle machine too (0.7 s a step)
    same = ["data.train={add}", "train.steps=30", "rollout.samples_per_prompt=4"]
    ids = submit_study(cluster, tmp_path, [stage("steady", "grpo.yaml", *same),
                                           stage("preempted", "grpo.yaml", *same)], cpu_launch(nodes=2))
    metrics = tmp_path / "out" / "preempted" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and '"step": 2' in metrics.read_text()):  # mid-stage: a step done, more to go
        assert time.monotonic() < deadline, "the stage did not start"
        time.sleep(0.5)
    assert cluster.client(["scancel", "--batch", "--signal=USR1", ids["preempted"]]).returncode == 0
    wait_for(cluster, list(ids.values()), timeout=600)

    log = job_log(tmp_path, "preempted", ids["preempted"])
    assert job_state(cluster, ids["preempted"])["JobState"] == "COMPLETED", log[-3000:]
    assert job_state(cluster, ids["preempted"])["Restarts"] == "1"
    assert job_state(cluster, ids["steady"])["Restarts"] == "0"
    assert "requeueing job" in log and "resumed" in log
    assert [restart for _, restart, *_ in LAYOUT.findall(log)] == ["0", "1"]
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == 30
    ledgers = {name: json.loads((tmp_path / "out" / name / "summary.json").read_text())["ledger"]["own"]
               for name in ("steady", "preempted")}
    assert ledgers["preempted"] == ledgers["steady"]
    assert ledgers["steady"]["rollout"] > 0


@pytest.mark.slow
@pytest.mark.timeout(2400)  # its jobs have 900 + 1200 s; SGLang's start on a loaded 2-core machine is minutes
def test_sigterm_to_every_step_requeues_and_resumes_from_the_signals_checkpoint(cluster, tmp_path):
    """What a preemption with a grace time sends: SIGTERM to every step of a running 2-node OPD stage (the trainer
    on one node, its SGLang teacher server on the other) and to the batch shell. The server outlives the signal
    (megaopd/launch/step_signals.py), so the trainer finishes the step in flight and checkpoints there; the job
    requeues, resumes from that checkpoint (the stage has no other: checkpoint.every is past its end) and ends with
    the ledger of its unsignalled twin."""
    sglang = sglang_python()
    # Long enough that the signals, sent once step 2 is logged, land mid-stage: a step takes 50-80 ms on an idle
    # machine, and the squeue and scancel calls a few hundred (with 10 steps a loaded CI run once signalled the
    # final eval: the job requeued with no checkpoint to resume from).
    same = ["data.train={add}", "opd.teachers.*={out}/models/qwen3-tiny", "train.steps=100", "checkpoint.every=1000"]
    ids = submit_study(cluster, tmp_path, [stage("steady", "opd.yaml", *same), stage("preempted", "opd.yaml", *same)],
                       cpu_launch(nodes=1, teacher_servers=True, sglang_python=sglang))
    metrics = tmp_path / "out" / "preempted" / "metrics.jsonl"
    deadline = time.monotonic() + 900  # the assets job, then SGLang's start on CPU: minutes on a loaded machine
    while not (metrics.exists() and '"step": 2' in metrics.read_text()):  # mid-stage: a step done, more to go
        assert time.monotonic() < deadline, "the stage did not start"
        time.sleep(0.5)
    job = ids["preempted"]
    steps = cluster.client(["squeue", "-h", "-s", "-o", "%i", "-j", job]).stdout.split()
    assert len(steps) >= 2, steps  # the teacher server's step and the trainer's (and the batch step)
    assert cluster.client(["scancel", "--signal=TERM", job]).returncode == 0  # every step but the batch step
    assert cluster.client(["scancel", "--batch", "--signal=TERM", job]).returncode == 0
    wait_for(cluster, list(ids.values()), timeout=1200)

    log = job_log(tmp_path, "preempted", job)
    assert job_state(cluster, job)["JobState"] == "COMPLETED", log[-3000:]
    assert job_state(cluster, job)["Restarts"] == "1" and job_state(cluster, ids["steady"])["Restarts"] == "0"
    assert [restart for _, restart, *_ in LAYOUT.findall(log)] == ["0", "1"]
    assert "requeueing job" in log
    resumed = re.findall(r"resumed \S+ from step (\d+)", log)
    assert len(resumed) == 1 and 3 <= int(resumed[0]) < 100, log[-5000:]  # the signal's checkpoint, mid-stage
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == 100
    ledgers = {name: json.loads((tmp_path / "out" / name / "summary.json").read_text())["ledger"]["own"]
               for name in ("steady", "preempted")}
    assert ledgers["preempted"] == ledgers["steady"] and ledgers["steady"]["teacher"] > 0
