"""launchers/nemo_run_study.py: the study as a nemo-run Experiment. The local executor runs the assets task and a
small stage; the Slurm executor's batch scripts (nemo-run's dry run) carry the rendered jobs' #SBATCH options and
hand over to the rendered scripts, which then run exactly as `megaopd submit`'s do (under bash with the stand-in
srun/scontrol of test_slurm_render). NEMORUN_HOME is kept inside the test's directory."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megaopd.config import ConfigError, load_config
from megaopd.launch.slurm import LaunchConfig, absolute_study, load_launch, plan
from megaopd.run.study import StudyConfig

from test_slurm_multinode import cluster  # noqa: F401  (the 4-node CI cluster)
from test_slurm_render import GPU_LAUNCH, demo_study, fake_cluster, sbatch_options, write_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.nemo
run = pytest.importorskip("nemo_run", reason="nemo-run is not installed (pip install nemo-run==0.11.1 "
                                             "leptonai==0.27.3)")


def launcher():
    spec = importlib.util.spec_from_file_location("nemo_run_study", ROOT / "launchers" / "nemo_run_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def nemo_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemo_home"))
    run.config.set_nemorun_home(str(tmp_path / "nemo_home"))  # nemo-run reads the variable once, at import
    return tmp_path / "nemo_home"


def test_local_executor_runs_a_stage(tmp_path, nemo_home):
    study = absolute_study(load_config(ROOT / "configs/studies/self_teacher.yaml", [
        f"out={tmp_path / 'out'}", "assets.train_rows=200", "assets.heldout_rows=40", "seed=7"], cls=StudyConfig))
    study.stages = [s for s in study.stages if s.name in ("base", "grpo")]
    for s in study.stages:
        s.config = str(ROOT / s.config)
        s.overrides += ["train.steps=2", "sft.stop_at_accuracy=0", "eval.every=2", "eval.prompts_per_domain=4",
                        "eval.final_prompts_per_domain=4", "rollout.max_new_tokens=8", "train.prompts_per_step=4"]
    module = launcher()
    with run.Experiment("t") as exp:
        module.add_local(exp, study, LaunchConfig(), stages=["base"], python=sys.executable)
        assert [job.id for job in exp.jobs] == ["assets", "base"]  # grpo was not asked for
        exp.run(sequential=False)
        states = {job.id: str(job.status(exp._runner)) for job in exp.jobs}
    assert all(s.endswith("SUCCEEDED") for s in states.values()), states
    summary = json.loads((tmp_path / "out" / "base" / "summary.json").read_text())
    assert summary["algorithm"] == "sft" and summary["steps"] == 2
    assert not (tmp_path / "out" / "grpo").exists()
    assert list((nemo_home / "experiments" / "t").iterdir())  # nemo-run kept its logs there
    # The stage runs with the study's seed, as under `megaopd study` and `megaopd submit`.
    assert yaml.safe_load((tmp_path / "out" / "base" / "config.yaml").read_text())["train"]["seed"] == 7
    with pytest.raises(ConfigError, match="the local executor runs one seed"), run.Experiment("t2") as exp:
        module.add_local(exp, dataclasses.replace(study, seeds=[0, 1]), LaunchConfig())


def run_logged(tmp_path: Path, script: Path, env: dict[str, str]) -> tuple[int, list[str]]:
    """Run a batch script under bash in ``env`` (see fake_cluster); its return code and the calls it made."""
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    for started in (tmp_path / "healthy").iterdir():  # the last script's servers are gone
        started.unlink()
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    return result.returncode, log.read_text().splitlines() if log.exists() else []


def test_slurm_executor_submits_the_rendered_jobs(tmp_path, nemo_home, monkeypatch):
    """Every launch setting reaches the job: nemo-run's script has the rendered job's nodes, GPUs, QoS, signal and
    requeue, and then runs the rendered script itself (venv, setup lines, node split, servers, torchrun, requeue
    limit), making the same calls as the script `megaopd submit` queues."""
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # nemo-run's local tunnel (invoke) reads stdin
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f"echo venv activated >> {tmp_path / 'calls.log'}\n")
    settings = [*GPU_LAUNCH, "qos=high", "max_requeues=3", f"venv={venv}", "sbatch=[--constraint=h100]",
                f"setup=['echo site setup >> {tmp_path / 'calls.log'}']"]
    settings.remove("container_image=/shared/megaopd-gpu.sqsh")  # a venv instead: the activation is observable
    study = demo_study(tmp_path / "demo")
    for stage in ("base", "grpo"):  # the servers' models (their heads decide the servers' TP)
        write_model(Path(study.out) / stage / "final")
    launch = load_launch(None, settings)
    jobs = {job.name: job for job in plan(study, launch)}
    module = launcher()
    with run.Experiment("t") as exp:
        module.add_slurm(exp, study, launch)
        assert [job.id for job in exp.jobs] == list(jobs)
        exp.dryrun(log=False, delete_exp_dir=False)
        exp_dir = Path(exp._exp_dir)

    for name, job in jobs.items():
        nemo_script = (exp_dir / f"{name}_sbatch.sh").read_text()
        nemo_options = sbatch_options(nemo_script)
        ours = sbatch_options(job.script)
        assert [o for o in nemo_options if not o.startswith("--output=")] == sorted(
            o for o in ours if not o.startswith("--output=")), name
        rendered = Path(study.out) / "slurm" / "nemo" / f"{name}.sbatch"
        assert rendered.read_text() == job.script
        assert f"\nexec bash {rendered}\n" in nemo_script
    grpo = sbatch_options(jobs["grpo"].script)
    for expected in ("--nodes=3", "--qos=high", "--signal=B:USR1@300", "--requeue", "--constraint=h100"):
        assert expected in grpo
    assert "MAX_REQUEUES=3\n" in jobs["grpo"].script

    # Run both scripts: nemo-run's makes the calls of the rendered one (after its own head-node lookup).
    cluster = fake_cluster(tmp_path, ["n1", "n2", "n3", "n4"])
    for name, env in (("opd_self", cluster), ("grpo", cluster | {"TRAINER_EXIT": "75"})):
        rc_ours, ours = run_logged(tmp_path, Path(study.out) / "slurm" / "nemo" / f"{name}.sbatch", env)
        rc_nemo, theirs = run_logged(tmp_path, exp_dir / f"{name}_sbatch.sh", env)
        # (sorted: the server steps start in the background, in either order)
        assert rc_nemo == rc_ours and sorted(theirs[1:]) == sorted(ours), (name, theirs, ours)
        assert "hostname --ip-address" in theirs[0]
        assert ours[:2] == ["site setup", "venv activated"] and any("torchrun" in c for c in ours)
    assert rc_ours == 75 and "scontrol requeue 42" in ours


@pytest.mark.multinode
@pytest.mark.slow
def test_slurm_executor_runs_a_multinode_stage_on_the_cluster(cluster, tmp_path):
    """nemo-run's Slurm executor submits a Megatron TP2 stage over 2 trainer nodes to the multi-node cluster: one
    rank per node, as the ranks themselves report, and the job COMPLETED."""
    out = tmp_path / "nemo_mn"  # the job names (megaopd-nemo_mn-*) are this test's own on the shared cluster
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({
        "out": str(out), "assets": {"presets": ["qwen3-tiny"], "domains": ["arith_add"], "train_rows": 100,
                                    "heldout_rows": 20},
        "stages": [{"name": "base", "config": str(ROOT / "configs/embedded/sft.yaml"), "overrides": [
            "model.path={out}/models/qwen3-tiny", "data.train=[{out}/data/arith_add/train.jsonl]",
            "data.eval=[{out}/data/arith_add/test.jsonl]", "train.steps=2", "sft.stop_at_accuracy=0",
            "eval.every=2", "eval.prompts_per_domain=2", "eval.final_prompts_per_domain=2",
            "rollout.max_new_tokens=8"]}]}))
    launch = [f"venv={sys.prefix}", f"workdir={ROOT}", "nodes=2", "gpus_per_node=1",
              "trainer_module=megaopd.models.megatron.cpu_launch",
              "overrides=[model.backend=megatron, model.megatron.tp=2, model.device=cpu, model.dtype=float32]"]
    home = tmp_path / "nemo_home"
    earlier = {r["JobId"] for r in cluster.job_records()}
    result = cluster.client([sys.executable, str(ROOT / "launchers" / "nemo_run_study.py"), str(study),
                             "--executor", "slurm", "--stages", "base",
                             *(a for setting in launch for a in ("--set", setting))],
                            env={"NEMORUN_HOME": str(home)}, cwd=str(ROOT), stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    names = {"megaopd-nemo_mn-assets", "megaopd-nemo_mn-base"}
    deadline = time.monotonic() + 900
    while len(records := {r["Name"]: r for r in cluster.job_records()
                          if r["Name"] in names and r["JobId"] not in earlier}) < len(names):
        assert time.monotonic() < deadline, "the jobs did not finish"
        time.sleep(2)
    assert {name: r["JobState"] for name, r in records.items()} == dict.fromkeys(names, "COMPLETED")
    assert records["megaopd-nemo_mn-base"]["NodeList"] == "node[1-2]"
    (log,) = home.glob("experiments/**/sbatch_megaopd-nemo_mn-base_*.out")
    # node\d+, not \S+: two ranks' lines in one log once came out as "... on node1megaopd: rank 1 ... on node2"
    ranks = dict(re.findall(r"megaopd: rank (\d+) of 2 \(local 0\) on (node\d+)", log.read_text()))
    assert ranks == {"0": "node1", "1": "node2"}
    assert json.loads((out / "base" / "summary.json").read_text())["steps"] == 2
