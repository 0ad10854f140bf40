"""The plateau stop rule (megaopd/stopping.py): on synthetic curves, and in a real run that stops early."""

from __future__ import annotations

import json

import pytest

from conftest import run_config
from megaopd.config import ConfigError
from megaopd.ledger import LEDGER_FILE
from megaopd.stopping import StopRule, plateaued
from megaopd.trainer import train


def first_stop(values, window=3, min_delta=0.01):
    """The eval index at which the rule stops a stage whose watched values are `values` (None: it never does)."""
    return next((i for i in range(len(values)) if plateaued(values[:i + 1], window, min_delta)), None)


def test_a_curve_that_plateaus_early_stops_early_and_a_rising_one_does_not():
    early = [0.1, 0.4, 0.6, 0.62, 0.61, 0.62, 0.6, 0.61, 0.62, 0.6, 0.61, 0.6]
    late = [0.1 + 0.05 * i for i in range(12)]
    # Smoothed (3 evals) the early curve is at 0.61 from eval 4 on (0.617 at eval 5, less than 0.01 better), so
    # evals 5-7 bring no improvement of 0.01: it stops at eval 7 of 12; a rising curve never stops.
    assert first_stop(early) == 7
    assert first_stop(late) is None
    assert first_stop(early, min_delta=0.0) == 8 and first_stop(early, window=5) == 9
    assert first_stop(late, min_delta=0.2) == 3  # a bar above what the curve gains in `window` evals


def rule(tmp_path, metric, teachers=None, **stop):
    overrides = {"train.stop.rule": "plateau", "train.stop.metric": metric, "train.stop.window": 2,
                 **{f"train.stop.{k}": v for k, v in stop.items()}}
    for route, path in (teachers or {}).items():
        overrides[f"opd.teachers.{route}"] = path
    cfg = run_config(tmp_path, tmp_path / "run", "opd" if teachers else "grpo", **overrides)
    return StopRule(cfg.train.stop, cfg.train.steps, dict(cfg.opd.teachers), ["arith_add"], ["arith_add", "prog_trace"])


def evals(**acc):
    return {f"eval/{d}/accuracy_greedy": a for d, a in acc.items()}


def test_each_method_watches_its_own_number(tmp_path):
    """An expert its domain (the other domain's gains do not keep it going); OPD its distance to the teacher."""
    expert = rule(tmp_path, "arith_add")
    curve = [evals(arith_add=0.5, prog_trace=0.1 * i, mean=0.3 + 0.05 * i) for i in range(3)]
    assert [expert.observe(m) for m in curve] == [False, False, True] and expert.record(20)["reason"] == "plateau"
    joint = rule(tmp_path, "mean")
    assert not any(joint.observe(m) for m in curve) and joint.record(20)["reason"] == "max_steps"

    teacher = tmp_path / "teacher"
    (teacher / "final").mkdir(parents=True)
    (teacher / "summary.json").write_text(json.dumps({"final": {"final/arith_add/accuracy_greedy": 0.6}}))
    opd = rule(tmp_path, "teacher_gap", {"*": teacher / "final"})
    # Closing the gap 0.5 -> 0.3 -> 0.1 -> 0 (above the teacher counts as 0): then no more to gain, it stops.
    stops = [opd.observe(evals(arith_add=a)) for a in (0.1, 0.3, 0.5, 0.7, 0.7, 0.7, 0.7, 0.7)]
    assert stops.index(True) == 7  # smoothed gap 0.033 at eval 4, 0 from eval 5: evals 6-7 cannot close it
    assert opd.record(70) == {"reason": "plateau", "step": 70, "rule": "plateau", "cap": 4, "metric": "teacher_gap",
                              "window": 2, "min_delta": 0.01, "teacher_accuracy": {"arith_add": 0.6}}


def test_a_metric_it_cannot_watch_is_refused_with_what_to_watch(tmp_path):
    with pytest.raises(ConfigError, match="'arith_mul' is not evaluated: use 'mean', teacher_gap or a domain"):
        rule(tmp_path, "arith_mul")
    with pytest.raises(ConfigError, match="teacher_gap needs opd.teachers"):
        rule(tmp_path, "teacher_gap")
    with pytest.raises(ConfigError, match="no final arith_add accuracy in .*summary.json"):
        rule(tmp_path, "teacher_gap", {"*": tmp_path / "downloaded"})


def test_a_run_that_cannot_improve_stops_at_its_plateau_and_says_why(assets, tmp_path):
    """min_delta 1 (no eval can beat the best by a whole accuracy): the run stops after `window` evals, at step 4 of
    a 20-step cap, and the summary and the ledger beside the model say so (a run that reaches its cap: the steps
    rule's record above)."""
    config = run_config(assets, tmp_path / "plateau", "grpo", **{
        "train.steps": 20, "eval.every": 2, "checkpoint.every": 100,
        "train.stop.rule": "plateau", "train.stop.metric": "arith_add", "train.stop.window": 2,
        "train.stop.min_delta": 1.0})
    summary = train(config)
    assert summary["steps"] == 4 and summary["stop"]["reason"] == "plateau"
    ledger = json.loads((tmp_path / "plateau" / "final" / LEDGER_FILE).read_text())
    assert ledger["stop"] == summary["stop"]
    again = train(config)  # the same command again: it had stopped, so it trains no further
    assert again["steps"] == 4 and again["ledger"]["own"] == summary["ledger"]["own"]
