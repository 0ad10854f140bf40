"""launchers/nemo_run_study.py: the study as a nemo-run Experiment, run by nemo-run's local executor
(the assets task, then one small stage), with NEMORUN_HOME kept inside the test's directory."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megaopd.config import load_config
from megaopd.launch.slurm import LaunchConfig, absolute_study
from megaopd.study import StudyConfig

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.nemo
run = pytest.importorskip("nemo_run", reason="nemo-run is not installed (pip install nemo-run==0.11.1 "
                                             "leptonai==0.27.3)")


def launcher():
    spec = importlib.util.spec_from_file_location("nemo_run_study", ROOT / "launchers" / "nemo_run_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_local_executor_runs_a_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemo_home"))
    run.config.set_nemorun_home(str(tmp_path / "nemo_home"))  # nemo-run reads the variable once, at import
    study = absolute_study(load_config(ROOT / "configs/studies/self_teacher.yaml", [
        f"out={tmp_path / 'out'}", "assets.train_rows=200", "assets.heldout_rows=40"], cls=StudyConfig))
    study.stages = [s for s in study.stages if s.name in ("base", "grpo")]
    for s in study.stages:
        s.config = str(ROOT / s.config)
        s.overrides += ["train.steps=2", "sft.stop_at_accuracy=0", "eval.every=2", "eval.prompts_per_domain=4",
                        "eval.final_prompts_per_domain=4", "rollout.max_new_tokens=8", "train.prompts_per_step=4"]
    module = launcher()
    with run.Experiment("t") as exp:
        module.add_study(exp, study, LaunchConfig(), module.local_executor, stages=["base"],
                          python=sys.executable)
        assert [job.id for job in exp.jobs] == ["assets", "base"]  # grpo was not asked for
        exp.run(sequential=False)
        states = {job.id: str(job.status(exp._runner)) for job in exp.jobs}
    assert all(s.endswith("SUCCEEDED") for s in states.values()), states
    summary = json.loads((tmp_path / "out" / "base" / "summary.json").read_text())
    assert summary["algorithm"] == "sft" and summary["steps"] == 2
    assert not (tmp_path / "out" / "grpo").exists()
    assert list((tmp_path / "nemo_home" / "experiments" / "t").iterdir())  # nemo-run kept its logs there
