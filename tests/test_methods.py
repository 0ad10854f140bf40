"""The algorithm table (megaopd.objectives.methods): every method walked through the planner, `megaopd submit --dry-run` and the
FLOP audit, each reading what the method needs from its row."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaopd.objectives.methods import METHODS, method
from megaopd.run.plan import build_plan
from tests.conftest import run_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"sft": "sft.yaml", "grpo": "grpo.yaml", "opd": "opd.yaml", "grpo_opd": "opd.yaml",
           "fixed_advantage": "opd.yaml"}


def method_overrides(assets, name: str) -> dict:
    """A teacher for every method (those without a teacher term must ignore it) and GRPO's KL on."""
    return {"train.algorithm": name, "opd.teachers.*": assets / "models" / "qwen3-tiny-seed1",
            "opd.form": "full_vocab", "grpo.kl_coef": 0.01}


def test_every_method_has_an_embedded_config():
    assert set(CONFIGS) == set(METHODS)


def test_a_grpo_opd_plan_includes_its_teachers_and_reference(assets, tmp_path):
    """grpo_opd needs both sides: GRPO's reference model and OPD's teacher memory, teacher FLOPs and the
    full-vocabulary workspace (the planner once tested the name 'opd' and gave it none of them)."""
    plans = {name: build_plan(run_config(assets, tmp_path / name, **method_overrides(assets, name)))
             for name in ("grpo", "opd", "grpo_opd")}
    names = {k: [i.component for i in p.items] for k, p in plans.items()}
    assert any(c.startswith("teacher *") for c in names["grpo_opd"]), names["grpo_opd"]
    assert "reference model" in names["grpo_opd"]
    workspace = {k: next(i.bytes for i in p.items if i.component.startswith("logits/KL")) for k, p in plans.items()}
    assert workspace["grpo_opd"] == workspace["opd"] > workspace["grpo"]
    # Its step costs GRPO's (reference included) plus OPD's teacher passes.
    no_kl = build_plan(run_config(assets, tmp_path / "no_kl", **method_overrides(assets, "grpo") |
                                  {"grpo.kl_coef": 0})).step_flops
    teacher = plans["opd"].step_flops - no_kl
    assert teacher > 0 and plans["grpo_opd"].step_flops == plans["grpo"].step_flops + teacher


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_through_plan_submit_and_the_flop_audit(assets, tmp_path, capsys, name):
    from megaopd.run import study_plan
    from megaopd.run.flop_audit import audit_step
    from megaopd.launch import submit

    spec = method(name)
    over = method_overrides(assets, name)
    cfg = run_config(assets, tmp_path / "run", **over)

    # plan: the items follow the row
    components = [i.component for i in build_plan(cfg).items]
    assert any(c.startswith("teacher") for c in components) == spec.teacher_term, components
    assert ("reference model" in components) == spec.uses_reference(cfg.grpo), components
    config = ROOT / "configs" / "embedded" / CONFIGS[name]
    args = [f"{k}={v}" for k, v in over.items()] + [f"model.path={cfg.model.path}"]
    assert study_plan.main([str(config), *args]) == 0
    assert "one step:" in capsys.readouterr().out

    # submit --dry-run: rollout servers for a method that samples, teacher servers for one with a teacher term
    study = tmp_path / "study.yaml"
    study.write_text(f"out: {tmp_path / 'study'}\nstages:\n  - name: stage\n    config: {config}\n"
                     f"    overrides: [{', '.join(args)}, 'opd.form=sampled']\n")
    launch = ["nodes=1", "gpus_per_node=1", "rollout_nodes=1", "teacher_servers=true"]
    assert submit.main([str(study), "--dry-run", *[x for kv in launch for x in ("--set", kv)]]) == 0
    script = capsys.readouterr().out
    assert ("ROLLOUT_NODES=1\n" in script) == spec.rollouts
    assert (f"TEACHERS=('*={over['opd.teachers.*']}')" in script) == spec.teacher_term, script[-3000:]

    # the FLOP audit: one real step of the method, counted phase by phase, against the ledger
    audit = audit_step(run_config(assets, tmp_path / "audit", **over, **{
        "train.prompts_per_step": 1, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 6}))
    assert audit.mismatches() == [], audit.mismatches()  # the whole step under one counter: every FLOP billed
    for component, row in audit.items():
        assert row.booked == row.ledger_form, component
        assert row.measured == row.executed_form + row.recomputed, component  # recomputed: hardware work
        assert (row.booked > 0) == (component in spec.components and (component != "reference" or
                                                                       spec.uses_reference(cfg.grpo))), component
