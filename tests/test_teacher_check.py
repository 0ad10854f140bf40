"""The teacher check of an external-teacher OPD stage (megaopd/teachers/check.py): a study whose teacher is not above
its student on validation stops before that stage trains, in one line naming both accuracies; with
allow_weaker_teacher it runs, and the report prints the check beside the stage and marks the teacher."""

import json
from pathlib import Path

import pytest
import yaml

from conftest import validation
from megaopd.cli import main
from megaopd.teachers.check import teacher_domains, weaker

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["train.steps=2", "train.prompts_per_step=4", "train.micro_batch_size=16", "rollout.max_new_tokens=12",
         "eval.every=1", "eval.prompts_per_domain=6", "eval.final_prompts_per_domain=12", "checkpoint.every=2"]


def answers(accuracy: dict[str, float], path: str = "m") -> dict:
    """One model's answers as `teacher_check.answer` writes them."""
    mode = {"accuracy": accuracy | {"mean": sum(accuracy.values()) / len(accuracy)}, "length": 8.0,
            "truncated": 0.0}
    return {"path": path, "prompts": 12, "greedy": mode, "sampled": mode}


def test_a_teacher_is_weaker_where_it_is_not_above_the_student_on_its_own_domains():
    """Each route against the student on the domains it serves: the math teacher above the student on math is
    not weaker even though the student's mean over both domains is higher than the teacher's score."""
    check = {"student": answers({"math": 0.2, "code": 0.9}),
             "teachers": {"math": answers({"math": 0.5}) | {"domains": ["math"]},
                          "code": answers({"code": 0.9}) | {"domains": ["code"]}}}
    assert weaker(check) == {"code": (0.9, 0.9)}  # equal is not above
    assert teacher_domains({"*": "t", "code": "c"}, ["code", "math"]) == {"code": ["code"], "*": ["math"]}


def _study(tmp_path: Path, assets: Path, allow: bool) -> Path:
    """A student SFT'd for a few steps, distilled from the untrained embedded model: a teacher not above it."""
    data = assets / "data" / "arith_add"
    files = [f"data.train=[{data / 'train.jsonl'}]", f"data.eval=[{data / 'test.jsonl'}]",
             f"data.validation=[{validation(assets)['data.validation'].strip('[]').split(', ')[0]}]"]
    study = {"out": str(tmp_path / f"study_{allow}"), "stages": [
        {"name": "base", "role": "base", "config": str(ROOT / "configs/embedded/sft.yaml"),
         "overrides": [f"model.path={assets / 'models' / 'qwen3-tiny'}", *files, *SMALL]},
        {"name": "grpo", "role": "grpo", "config": str(ROOT / "configs/embedded/grpo.yaml"),
         "overrides": ["model.path={out}/base/final", *files, *SMALL]},
        {"name": "opd", "role": "opd_external", "compare_with": "grpo", "allow_weaker_teacher": allow,
         "config": str(ROOT / "configs/embedded/opd.yaml"),
         "overrides": ["model.path={out}/base/final", f"opd.teachers.*={assets / 'models' / 'qwen3-tiny-seed1'}",
                       *files, *SMALL]}]}
    path = tmp_path / f"study_{allow}.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_weaker_external_teacher_is_refused_before_training_and_runs_when_allowed(assets, tmp_path, capsys):
    assert main(["study", str(_study(tmp_path, assets, allow=False))]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megaopd:")]
    opd = tmp_path / "study_False" / "opd"
    check = json.loads((opd / "teacher_check.json").read_text())
    teacher = check["teachers"]["*"]["greedy"]["accuracy"]["mean"]
    student = check["student"]["greedy"]["accuracy"]["mean"]
    assert teacher <= student
    assert len(err) == 1 and err[0].startswith("megaopd: teacher check: teacher ")
    assert f"scores {teacher:.3f} greedy" in err[0] and f"/base/final {student:.3f}" in err[0]
    assert "allow_weaker_teacher: true" in err[0]
    assert not (opd / "metrics.jsonl").exists()  # refused before its first step
    assert {m["sampled"]["accuracy"]["mean"] >= 0 for m in (check["student"], check["teachers"]["*"])} == {True}

    assert main(["study", str(_study(tmp_path, assets, allow=True))]) == 0
    out = tmp_path / "study_True"
    assert json.loads((out / "opd" / "teacher_check.json").read_text())["allowed_weaker"] is True
    assert main(["report", str(out)]) == 0
    md = (out / "report" / "report.md").read_text()
    assert "#### Teachers checked before OPD" in md and "| `base/final` | student |" in md and "| teacher * (below student) |" in md
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["seeds"][0]["teacher_checks"]["opd"]["allowed_weaker"] is True
    b = next(f for f in report["findings"] if f["id"] == "b")  # lengths: measured however short the stages
    assert "teacher below student" in b["checks"]["opd vs grpo"]["detail"]
