"""A reduced embedded study on a real Slurm cluster (.ci/slurm_up.sh starts a one-node one), submitted with
`megaopd submit` and the scripts in slurm/: dependent jobs, run directories, report, TensorBoard files, and a
preemption mid-stage that requeues the job and resumes from its checkpoint with the same FLOP ledger.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megaopd.launch import submit

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slurm

SMALL = ["eval.every=2", "eval.prompts_per_domain=4", "eval.final_prompts_per_domain=8", "checkpoint.every=2",
         "rollout.max_new_tokens=16", "train.prompts_per_step=4"]
DATA = ["data.train=[{out}/data/arith_add/train.jsonl]", "data.eval=[{out}/data/arith_add/test.jsonl]"]


@pytest.fixture(scope="module")
def cluster():
    if shutil.which("sbatch") is None:
        pytest.skip("sbatch is not on PATH (start a cluster with .ci/slurm_up.sh)")
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10).stdout
    except subprocess.TimeoutExpired:
        states = ""
    if not any(s.startswith(("idle", "mixed", "allocated")) for s in states.split()):
        pytest.skip(f"the Slurm cluster is not up (sinfo: {states.strip() or 'no answer'}); run .ci/slurm_up.sh")


def write_study(tmp_path: Path, stages: list[dict]) -> Path:
    study = {"out": str(tmp_path / "out"),
             "assets": {"presets": ["qwen3-tiny"], "domains": ["arith_add"], "train_rows": 200, "heldout_rows": 40},
             "stages": stages}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def submit_study(study: Path, capsys) -> dict[str, str]:
    # One CPU per job: the CI machine has two, so two independent stages run at the same time.
    assert submit.main([str(study), "--set", f"venv={sys.prefix}", "--set", "cpus_per_task=1",
                        "--set", f"workdir={ROOT}"]) == 0
    return dict(line.split() for line in capsys.readouterr().out.splitlines())


def job_field(job_id: str, key: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return next(tok.split("=", 1)[1] for tok in out.split() if tok.startswith(f"{key}="))


def wait_for(ids: dict[str, str], timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        queued = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(ids.values())],
                                capture_output=True, text=True).stdout.split()
        if not queued:
            return
        time.sleep(1)
    subprocess.run(["scancel", *ids.values()])
    pytest.fail(f"jobs still queued after {timeout} s: {queued}")


def assert_final_eval_is_the_saved_models(final: dict, model: Path, data: Path) -> None:
    """The stage's final metrics are what `megaopd eval` measures on the model directory it saved (the same 8
    held-out prompts, greedy): accuracy and response length, exactly."""
    out = subprocess.run([sys.executable, "-m", "megaopd.cli", "eval", "--model", str(model), "--data",
                          str(data / "test.jsonl"), "--max-new-tokens", "16", "--prompts-per-domain", "8"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    again = json.loads(out)
    for metric in ("arith_add/accuracy_greedy", "arith_add/response_length", "mean/accuracy_greedy"):
        assert final[f"final/{metric}"] == again[f"eval/{metric}"], metric


def test_study_runs_as_dependent_jobs(cluster, tmp_path, capsys):
    study = write_study(tmp_path, [
        {"name": "base", "config": str(ROOT / "configs/embedded/sft.yaml"),
         "overrides": ["model.path={out}/models/qwen3-tiny", *DATA, *SMALL, "train.steps=4",
                       "sft.stop_at_accuracy=0"]},
        {"name": "grpo", "config": str(ROOT / "configs/embedded/grpo.yaml"),
         "overrides": ["model.path={out}/base/final", *DATA, *SMALL, "train.steps=4"]},
        {"name": "opd_self", "config": str(ROOT / "configs/embedded/opd.yaml"),
         "overrides": ["model.path={out}/base/final", "opd.teachers.*={out}/grpo/final", *DATA, *SMALL,
                       "train.steps=4"]},
    ])
    ids = submit_study(study, capsys)
    assert list(ids) == ["assets", "base", "grpo", "opd_self", "report"]
    assert f"afterok:{ids['base']}" in job_field(ids["grpo"], "Dependency")
    wait_for(ids)
    assert {name: job_field(i, "JobState") for name, i in ids.items()} == dict.fromkeys(ids, "COMPLETED")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    report = (out / "report.txt").read_text()
    for stage, algorithm in (("base", "sft"), ("grpo", "grpo"), ("opd_self", "opd")):
        summary = json.loads((out / stage / "summary.json").read_text())
        assert summary["algorithm"] == algorithm and summary["steps"] == 4
        assert summary["ledger"]["totals"]["stage"] > 0
        assert_final_eval_is_the_saved_models(summary["final"], out / stage / "final", out / "data" / "arith_add")
        assert f"{stage} (final)" in report
        events = EventAccumulator(str(out / stage / "tensorboard"))
        events.Reload()
        steps = [e.step for e in events.Scalars("flops/total_stage")]
        assert steps[0] == 0 and steps[-1] == 4
        assert "final/mean/accuracy_greedy" in events.Tags()["scalars"]
    # Each later stage built on the one before: its ledger counts the upstream FLOPs.
    opd = json.loads((out / "opd_self" / "summary.json").read_text())["ledger"]["totals"]
    assert opd["with_teachers"] > opd["stage"]


def test_preempted_stage_requeues_and_resumes_with_the_same_ledger(cluster, tmp_path, capsys):
    # Two identical GRPO stages with no dependency between them run side by side; one is preempted. Long enough
    # that USR1, sent once step 2 is logged, lands mid-stage: ~60 ms a step on an idle machine (with 10 steps it
    # landed at step 4; a signal in the final eval lets the stage finish, and it is not requeued).
    stage = {"config": str(ROOT / "configs/embedded/grpo.yaml"),
             "overrides": ["model.path={out}/models/qwen3-tiny", *DATA, *SMALL, "train.steps=60"]}
    study = write_study(tmp_path, [{"name": "steady", **stage}, {"name": "preempted", **stage}])
    ids = submit_study(study, capsys)
    metrics = tmp_path / "out" / "preempted" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and '"step": 2' in metrics.read_text()):  # mid-stage: a step done, more to go
        assert time.time() < deadline, "the stage did not start"
        time.sleep(0.2)
    # What `#SBATCH --signal=B:USR1@N` does near the time limit: signal the batch script, which forwards it.
    subprocess.run(["scancel", "--batch", "--signal=USR1", ids["preempted"]], check=True)
    wait_for(ids)

    assert job_field(ids["preempted"], "JobState") == "COMPLETED"
    assert job_field(ids["preempted"], "Restarts") == "1"
    assert job_field(ids["steady"], "Restarts") == "0"
    log = next((tmp_path / "out" / "slurm" / "logs").glob(f"*-preempted-{ids['preempted']}.out")).read_text()
    assert "requeueing job" in log and "resumed" in log
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == 60
    ledgers = {name: json.loads((tmp_path / "out" / name / "summary.json").read_text())["ledger"]["own"]
               for name in ("steady", "preempted")}
    assert ledgers["preempted"] == ledgers["steady"]
    assert ledgers["steady"]["rollout"] > 0
