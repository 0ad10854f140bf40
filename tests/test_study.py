"""A reduced study end to end, twice: the same seed on the same machine gives the same report numbers, and so
does a third run of two seeds whose stages run side by side in worker processes (workers=2), one stage shared."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import file_mtimes, tiny_overrides
from megaopd.cli import main
from megaopd.analysis.stats import CENSORED, INCONCLUSIVE, NOT_MEASURED, NOT_REPRODUCED, REPRODUCED, TEACHER_BELOW
from megaopd.run.study import StageConfig, StudyConfig, run_study

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["train.steps=3", "train.prompts_per_step=4", "train.micro_batch_size=16", "rollout.max_new_tokens=12",
         "eval.every=1", "eval.prompts_per_domain=6", "eval.final_prompts_per_domain=12", "checkpoint.every=2"]


VERDICTS = {REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, CENSORED, NOT_MEASURED, TEACHER_BELOW}
# The shipped studies of the embedded models (the real-model and cluster ones import published checkpoints or run on
# Slurm: `megaopd rehearse`).
EMBEDDED_STUDIES = ["two_domain", "self_teacher", "external_teacher", "four_domain", "async_expert", "opd_forms",
                    "length_sweep", "fair_control"]


def _write_study(tmp_path: Path, out: Path, workers: int = 1, seeds: tuple[int, ...] = (),
                 name: str = "self_teacher") -> Path:
    """A shipped study, reduced: a few rows, steps and eval prompts per stage, the seeds given (none: one run)."""
    study = yaml.safe_load((ROOT / f"configs/studies/{name}.yaml").read_text())
    study["out"], study["workers"], study["seeds"] = str(out), workers, list(seeds)
    study["stages"][0]["shared"] = True  # with seeds: one cold start for all of them
    study["assets"].update(train_rows=120, heldout_rows=24, validation_rows=24)
    for stage in study["stages"]:
        stage["config"] = str(ROOT / stage["config"])
        stage["overrides"] += SMALL + (["rollout.samples_per_prompt=4"] if stage["role"] == "grpo" else [])
        # A reduced teacher is no stronger than its student: the check runs (and is reported) without refusing.
        stage["allow_weaker_teacher"] = True
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def _seed_numbers(seed: dict) -> dict:
    """A seed's report less its stages' wall-clock seconds, which the machine decides, not the seed."""
    return {**seed, "stages": {name: {k: v for k, v in stage.items() if k != "wall_clock"}
                               for name, stage in seed["stages"].items()}}


def _numbers(out: Path) -> str:
    report = json.loads((out / "report" / "report.json").read_text().replace(str(out), "OUT"))
    report = {k: v for k, v in report.items() if k != "wall_clock"}
    return json.dumps({**report, "seeds": [_seed_numbers(seed) for seed in report["seeds"]]}, indent=1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_same_seed_same_report(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["study", str(_write_study(tmp_path, tmp_path / name))]) == 0
    printed = capsys.readouterr().out
    assert "(c)" in printed and "report:" in printed
    assert _numbers(tmp_path / "a") == _numbers(tmp_path / "b")
    report = json.loads(_numbers(tmp_path / "a"))
    # Two seeds' stages side by side in spawned worker processes: seed 0's numbers do not depend on where its
    # stages ran, and seed 1 uses the shared cold start instead of training its own.
    assert main(["study", str(_write_study(tmp_path, tmp_path / "c", workers=2, seeds=(0, 1)))]) == 0
    seeds = json.loads((tmp_path / "c" / "report" / "report.json").read_text())["seeds"]
    seed_0 = json.loads(json.dumps(seeds[0]).replace(str(tmp_path / "c" / "seed_0"), "OUT"))
    assert _seed_numbers(seed_0) == report["seeds"][0]
    assert (tmp_path / "c" / "seed_1" / "base").resolve() == (tmp_path / "c" / "seed_0" / "base").resolve()
    assert seeds[1]["seed"] == 1 and seeds[1]["stages"] != seeds[0]["stages"]
    assert {f["id"] for f in report["findings"]} >= {"a", "b", "c", "d", "e", "f"}
    assert {f["verdict"] for f in report["findings"]} <= VERDICTS
    # Each eval's per-prompt rewards (what the report resamples) average to the logged accuracy.
    record = json.loads((tmp_path / "a" / "grpo" / "evals" / "final.json").read_text())
    final = json.loads((tmp_path / "a" / "grpo" / "summary.json").read_text())["final"]
    for domain, rewards in record["reward"]["greedy"].items():
        assert record["prompts"][domain]["n"] == len(rewards) == 12
        assert sum(rewards) / len(rewards) == pytest.approx(final[f"final/{domain}/accuracy_greedy"])
    assert report["seeds"][0]["intervals"], "no bootstrap interval in a study with per-prompt results"
    for png in ("accuracy_mean.png", "response_length.png"):
        assert (tmp_path / "a" / "report" / png).stat().st_size > 10_000
    # A finished study is reused, not retrained: a second run leaves the stage summaries untouched.
    summary = tmp_path / "a" / "grpo" / "summary.json"
    before = summary.stat().st_mtime_ns
    assert main(["study", str(tmp_path / "a.yaml")]) == 0
    assert summary.stat().st_mtime_ns == before


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", EMBEDDED_STUDIES)
def test_every_shipped_embedded_study_runs_to_its_report(tmp_path, name):
    """Each shipped study of the embedded models, reduced, runs every stage to its report: whatever number its
    short stages leave missing (targets never reached, no multi-teacher stage), the report is written, with a
    verdict of the rules for every finding and no 0 / inf standing for a never."""
    assert main(["study", str(_write_study(tmp_path, tmp_path / name, name=name))]) == 0
    text = (tmp_path / name / "report" / "report.json").read_text()
    report = json.loads(text)
    assert {f["verdict"] for f in report["findings"]} <= VERDICTS
    assert '"inf"' not in text and '"-inf"' not in text and "Infinity" not in text and "NaN" not in text
    md = (tmp_path / name / "report" / "report.md").read_text()
    assert all(f"- ({f['id']}) {f['claim']}: **{f['verdict']}**" in md for f in report["findings"])


def test_a_stage_whose_cap_was_raised_trains_on(assets, tmp_path):
    """A finished stage is reused only under the step cap it ended at: with a larger train.steps the study trains
    it on from its latest checkpoint (in a worker process too, as the workers=1 path does); then it is reused."""
    overrides = [o for o in tiny_overrides(assets, "", "grpo", **{"checkpoint.every": 1, "eval.every": 1})
                 if not o.startswith("run_dir=")]

    def study(steps: int, workers: int = 1) -> StudyConfig:
        stage = StageConfig("grpo", str(ROOT / "configs/embedded/grpo.yaml"), overrides + [f"train.steps={steps}"])
        return StudyConfig(out=str(tmp_path / "study"), workers=workers, stages=[stage])

    summary = tmp_path / "study" / "grpo" / "summary.json"
    run_study(study(1))
    assert json.loads(summary.read_text())["steps"] == 1
    run_study(study(2, workers=2))
    trained_on = json.loads(summary.read_text())
    assert trained_on["steps"] == 2 and trained_on["stop"]["cap"] == 2
    written = file_mtimes(tmp_path / "study" / "grpo")
    run_study(study(2))
    assert file_mtimes(tmp_path / "study" / "grpo") == written


def _children(pid: int) -> set[int]:
    return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from Linux's /proc")
@pytest.mark.timeout(300)
def test_a_killed_study_takes_its_stage_workers_with_it(tmp_path):
    """`kill -9` of a study with workers=2: its stage workers end with it instead of training on as orphans into the
    run directories a resumed study trains in. (Negative control, by hand: without ``study._end_with`` the two
    workers were still alive 30 s after the kill.)"""
    study = _write_study(tmp_path, tmp_path / "s", workers=2, seeds=(0, 1))
    proc = subprocess.Popen([sys.executable, "-m", "megaopd.cli", "study", str(study)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while not list((tmp_path / "s").glob("seed_*/*/metrics.jsonl")):  # a stage is training in a worker
            assert proc.poll() is None and time.time() < deadline, "no stage started"
            time.sleep(0.5)
        workers = {c for c in _children(proc.pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()}
        assert workers, "no worker process"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 30
    while any(_alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.2)
    alive = [w for w in workers if _alive(w)]
    for w in alive:
        os.kill(w, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their study"
