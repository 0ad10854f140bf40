"""``megaopd.run.resolve.resolve_run`` is the one place a run's settings are refused: every refusal that reads the config
alone is given in the same line by ``megaopd train``, ``megaopd plan`` (a run config, or a study's stage) and
``megaopd submit --dry-run`` (no Slurm needed), and no other module calls the checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from megaopd.cli import main

ROOT = Path(__file__).resolve().parents[1]
GRPO, OPD = "configs/embedded/grpo.yaml", "configs/embedded/opd.yaml"
TEACHER = "opd.teachers.*=teacher"
MEGATRON_OPD = [TEACHER, "opd.form=sampled", "model.backend=megatron"]
CONTROL = "train.algorithm=fixed_advantage"

# Every refusal of resolve_run that reads the config only: (the run config, the overrides, a piece of its line).
REFUSALS = {
    "tis_without_recomputed_logprobs": (OPD, [TEACHER, "opd.form=topk", "opd.topk=4", "train.tis=token",
                                              "train.recompute_old_logprobs=false"], "every weight would be 1"),
    "tis_cap": (GRPO, ["train.tis=token", "train.tis_cap=0"], "train.tis_cap must be > 0"),
    "is_mask_band": (GRPO, ["train.is_mask=token", "train.is_mask_low=1.5"], "which must hold 1"),
    "old_logprobs_of_another_distribution": (GRPO, ["train.recompute_old_logprobs=false", "rollout.top_p=0.9"],
                                             "train.recompute_old_logprobs=false makes the rollout logprobs"),
    "megatron_top_p": (GRPO, ["model.backend=megatron", "rollout.top_p=0.9"],
                       "model.backend=megatron scores at a temperature only"),
    "teachers_at_temperature_1": (OPD, [TEACHER, "opd.match_sampling=false", "rollout.temperature=0.7"],
                                  "opd.match_sampling=false scores the teachers at temperature 1"),
    "sglang_teachers_at_another_temperature": (OPD, [TEACHER, "opd.form=sampled", "opd.teacher_engine=sglang",
                                                     "rollout.temperature=0.7"],
                                               "opd.teacher_engine=sglang scores at temperature 1"),
    "megatron_teachers_top_p": (OPD, [*MEGATRON_OPD, "rollout.engine=sglang", "rollout.top_p=0.9"],
                                "model.backend=megatron teachers score at a temperature without a top-p cut"),
    "teacher_tokenizer_route": (OPD, [TEACHER, "opd.teacher_tokenizer.math=tok"],
                                "opd.teacher_tokenizer names route(s) ['math']"),
    "cross_tokenizer_kl": (OPD, [TEACHER, "opd.teacher_tokenizer.*=tok"], "so opd.form=full_vocab has no per-token KL"),
    "cross_tokenizer_megatron": (OPD, [*MEGATRON_OPD, "opd.teacher_tokenizer.*=tok"],
                                 "cross-tokenizer OPD runs on model.backend=hf"),
    "topk_k": (OPD, [TEACHER, "opd.form=topk", "opd.topk=0"], "opd.form=topk needs opd.topk=K >= 1"),
    "full_vocab_from_servers": (OPD, [TEACHER, "opd.teacher_engine=sglang"],
                                "teacher servers return at most a top-k per position"),
    "megatron_teacher_dtype": (OPD, [*MEGATRON_OPD, "opd.teacher_dtype=bfloat16"],
                               "opd.teacher_dtype=bfloat16 applies to HF and SGLang teachers"),
    "megatron_full_vocab": (OPD, [TEACHER, "model.backend=megatron"], "computes the top-k OPD form, not full_vocab"),
    "fixed_advantage_fraction": (GRPO, [CONTROL, "fixed_advantage.fraction=0"],
                                 "fixed_advantage.fraction must be in (0, 1]"),
    "fixed_advantage_advantage": (GRPO, [CONTROL, "fixed_advantage.advantage=0"],
                                  "fixed_advantage.advantage=0 trains nothing"),
    "fixed_advantage_clip": (GRPO, [CONTROL, "fixed_advantage.clip=0"], "fixed_advantage.clip must be > 0"),
    "fixed_advantage_entropy": (GRPO, [CONTROL, "fixed_advantage.scale=entropy", "train.recompute_old_logprobs=false"],
                                "fixed_advantage.scale=entropy reads each position's entropy"),
    "cover_without_plateau": (GRPO, ["train.stop.cover=[{run: partner}]"],
                              "train.stop.cover holds back the plateau rule"),
    "teacher_gap_without_teachers": (GRPO, ["train.stop.rule=plateau", "train.stop.metric=teacher_gap"],
                                     "train.stop.metric=teacher_gap needs opd.teachers"),
    "logit_chunk_rows": (GRPO, ["train.logit_chunk_rows=-1"], "train.logit_chunk_rows must be >= 0"),
}


def refused(capsys, argv: list[str]) -> str:
    """The one line a refused command prints (it exits 2 and writes nothing else)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def study_file(tmp_path: Path, config: str, overrides: list[str]) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({"out": str(tmp_path / "study"), "stages": [
        {"name": "stage", "config": str(ROOT / config), "overrides": overrides}]}))
    return path


def four_lines(tmp_path: Path, capsys, config: str, overrides: list[str]) -> list[str]:
    """The lines of `megaopd train`, `megaopd plan` of the run, and `megaopd plan` and `megaopd submit --dry-run`
    of a study whose one stage runs it."""
    run_dir = f"run_dir={tmp_path / 'run'}"
    study = str(study_file(tmp_path, config, overrides))
    lines = [refused(capsys, argv) for argv in (["train", config, *overrides, run_dir],
                                                ["plan", config, *overrides, run_dir],
                                                ["plan", study], ["submit", study, "--dry-run"])]
    assert not (tmp_path / "run").exists()  # refused before the run directory is made
    return lines


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_train_plan_and_submit_refuse_alike(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    config, overrides, why = REFUSALS[name]
    train, plan, study_plan, submit = four_lines(tmp_path, capsys, config, overrides)
    assert train.startswith("megaopd: config error: ") and why in train
    in_study = train.replace("megaopd: config error: ", "megaopd: config error: stage stage: ", 1)
    assert (plan, study_plan, submit) == (train, in_study, in_study)


def test_an_unknown_algorithm_is_refused_alike(tmp_path, capsys, monkeypatch):
    """A study refuses the name where it reads the stage's config (``study.stage_config``), as the run does."""
    monkeypatch.chdir(ROOT)
    lines = four_lines(tmp_path, capsys, GRPO, ["train.algorithm=nope"])
    assert lines == [lines[0]] * 4 and "train.algorithm: 'nope' is not one of" in lines[0]



def test_config_yaml_holds_the_resolved_run(assets, tmp_path):
    """The trainer saves what it runs: train.logit_chunk_rows as the memory plan sized it, not 0 (the plan's pick)."""
    from conftest import run_config
    from megaopd.config import load_config
    from megaopd.run.trainer import Trainer

    trainer = Trainer(run_config(assets, tmp_path / "run"))
    try:
        saved = load_config(tmp_path / "run" / "config.yaml")
        assert saved == trainer.cfg and saved.train.logit_chunk_rows > 0
    finally:
        trainer.close()

# What resolve_run derives and refuses: called in the package from megaopd/run/resolve.py only.
CHECKS = ("resolve_tis", "resolve_shared_prompt", "check_is_correction", "check_temperature", "alignment_tokenizers",
          "check_opd", "check_fixed_advantage", "check_stop", "check_chunk_rows", "StopRule", "check_run", "chunk_rows")


def test_resolve_run_is_the_only_caller_of_the_refusals():
    callers = {check: [] for check in CHECKS}
    for path in sorted((ROOT / "megaopd").rglob("*.py")):
        text = path.read_text()
        for check in CHECKS:  # a call, plain or through its module; not its definition
            if re.search(rf"(?<!\w)(?<!def )(?<!class ){re.escape(check)}\(", text):
                callers[check].append(str(path.relative_to(ROOT)))
    assert callers == {check: ["megaopd/run/resolve.py"] for check in CHECKS}
