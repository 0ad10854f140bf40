"""The plateau stop rule (megaopd/run/stopping.py): on synthetic curves, and in a real run that stops early."""

from __future__ import annotations

import json

import pytest

from conftest import run_config, validation
from megaopd.analysis.curves import flops_to_target, smooth
from megaopd.config import ConfigError
from megaopd.accounting.ledger import LEDGER_FILE
from megaopd.accounting.metrics import read_metrics
from megaopd.run.stopping import StopRule, check_stop, plateaued
from megaopd.run.trainer import train


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


def rule(tmp_path, metric, teachers=None, valid=("arith_add", "prog_trace"), **stop):
    overrides = {"train.stop.rule": "plateau", "train.stop.metric": metric, "train.stop.window": 2,
                 **{f"train.stop.{k}": v for k, v in stop.items()}}
    for route, path in (teachers or {}).items():
        overrides[f"opd.teachers.{route}"] = path
    cfg = run_config(tmp_path, tmp_path / "run", "opd" if teachers else "grpo", **overrides)
    check_stop(cfg.train.stop, dict(cfg.opd.teachers))  # what the config alone refuses, as resolve_run does first
    return StopRule(cfg.train.stop, cfg.train.steps, dict(cfg.opd.teachers), ["arith_add"], list(valid))


def evals(flops=0.0, **acc):
    """One eval's metrics: validation accuracies (what the rules read), the test split's the opposite (which they
    must not read), and the stage's FLOPs."""
    return ({f"valid/{d}/accuracy_greedy": a for d, a in acc.items()} | {"flops/total_stage": flops}
            | {f"eval/{d}/accuracy_greedy": 1 - a for d, a in acc.items()})


def observed(stop, curve):
    """Feed `curve` (one eval's metrics each, step 10 x its index) to `stop`: whether it stopped after each."""
    return [stop.observe(10 * i, m) for i, m in enumerate(curve)]


def test_each_method_watches_its_own_validation_number(tmp_path):
    """An expert its domain (the other domain's gains do not keep it going); OPD its distance to the teacher's final
    validation accuracy; each reads valid/, never the test split's eval/ (which here moves the other way)."""
    expert = rule(tmp_path, "arith_add")
    curve = [evals(arith_add=0.5, prog_trace=0.1 * i, mean=0.3 + 0.05 * i) for i in range(3)]
    assert observed(expert, curve) == [False, False, True] and expert.record(20)["reason"] == "plateau"
    joint = rule(tmp_path, "mean")
    assert not any(observed(joint, curve)) and joint.record(20)["reason"] == "max_steps"

    teacher = tmp_path / "teacher"
    (teacher / "final").mkdir(parents=True)
    (teacher / "summary.json").write_text(json.dumps({"final": {"final/arith_add/accuracy_greedy": 0.9,
                                                                "final_valid/arith_add/accuracy_greedy": 0.6}}))
    opd = rule(tmp_path, "teacher_gap", {"*": teacher / "final"})
    # Closing the gap 0.5 -> 0.3 -> 0.1 -> 0 (above the teacher counts as 0): then no more to gain, it stops.
    stops = observed(opd, [evals(arith_add=a) for a in (0.1, 0.3, 0.5, 0.7, 0.7, 0.7, 0.7, 0.7)])
    assert stops.index(True) == 7  # smoothed gap 0.033 at eval 4, 0 from eval 5: evals 6-7 cannot close it
    assert opd.record(70) == {"reason": "plateau", "step": 70, "rule": "plateau", "cap": 4, "metric": "teacher_gap",
                              "window": 2, "min_delta": 0.01, "teacher_accuracy": {"arith_add": 0.6}}


def test_what_a_rule_cannot_read_is_refused_with_what_to_set(tmp_path):
    with pytest.raises(ConfigError, match="'arith_mul' is not evaluated: use 'mean', teacher_gap or a domain of "
                                          "data.validation"):
        rule(tmp_path, "arith_mul")
    with pytest.raises(ConfigError, match="teacher_gap needs opd.teachers"):
        rule(tmp_path, "teacher_gap")
    with pytest.raises(ConfigError, match="no final_valid/arith_add/accuracy_greedy in .*summary.json"):
        rule(tmp_path, "teacher_gap", {"*": tmp_path / "downloaded"})
    with pytest.raises(ConfigError, match="^train.stop.rule=plateau reads the validation split: set data.validation"):
        rule(tmp_path, "arith_add", valid=())
    cold = run_config(tmp_path, tmp_path / "run", "sft", **{"sft.stop_at_accuracy": 0.15})
    with pytest.raises(ConfigError, match="^sft.stop_at_accuracy=0.15 reads the validation split: set data.validation"):
        StopRule(cold.train.stop, 4, {}, ["arith_add"], [], cold.sft.stop_at_accuracy)
    StopRule(cold.train.stop, 4, {}, ["arith_add"], [], 0.0)  # the steps rule reads nothing: no validation needed
    with pytest.raises(ConfigError, match="train.stop.cover holds back the plateau rule: set train.stop.rule=plateau"):
        rule(tmp_path, "arith_add", rule="steps", cover=f"[{{run: {partner(tmp_path)}}}]")
    with pytest.raises(ConfigError, match="margin -0.1 would stop it short of its partner's FLOPs-to-target; set"):
        rule(tmp_path, "arith_add", cover=f"[{{run: {partner(tmp_path)}, margin: -0.1}}]")
    with pytest.raises(ConfigError, match="no finished run there .summary.json missing.; run the partner stage first"):
        rule(tmp_path, "arith_add", cover=f"[{{run: {tmp_path / 'absent'}}}]")
    with pytest.raises(ConfigError, match="no valid/arith_add/accuracy_greedy; train the partner with data.valid"):
        rule(tmp_path, "arith_add", cover=f"[{{run: {partner(tmp_path, key='eval')}, domain: arith_add}}]")


def test_the_refusal_without_validation_comes_before_any_model_loads(assets, tmp_path):
    """The trainer refuses a plateau stage without data.validation before it builds a model (a model path that
    does not exist would fail later, when the model loads)."""
    config = run_config(assets, tmp_path / "run", "grpo", **{"train.stop.rule": "plateau",
                                                             "model.path": tmp_path / "no_model"})
    with pytest.raises(ConfigError, match="set data.validation"):
        train(config)


def partner(tmp_path, name="partner", key="valid"):
    """A finished partner run: its validation accuracy on arith_add 0.2, 0.4, 0.6, 0.6, 0.6 at 0, 10, ..., 40
    FLOPs: smoothed 0.2, 0.3, 0.4, 0.53, 0.6, so its target is 0.6, reached at 40 FLOPs."""
    run = tmp_path / name
    run.mkdir(exist_ok=True)
    (run / "summary.json").write_text("{}")
    lines = [{"step": 10 * i, "flops/total_stage": 10.0 * i, f"{key}/arith_add/accuracy_greedy": a,
              f"{key}/mean/accuracy_greedy": a} for i, a in enumerate((0.2, 0.4, 0.6, 0.6, 0.6))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return run


def test_a_covered_stage_runs_past_its_plateau_until_its_partners_target_or_budget(tmp_path):
    """A stage flat at 0.3 plateaus at eval 2 alone; covering the partner (target 0.6 at 40 FLOPs, margin 0.25) it
    goes on until it has spent 1.25 x 40 = 50 FLOPs (the budget path), then the plateau ends it; a stage that
    reaches 0.6 on its smoothed validation curve first meets the cover by its target (and the plateau then waits
    for its own window)."""
    cover = f"[{{run: {partner(tmp_path)}, domain: arith_add}}]"
    flat = [evals(10.0 * i, arith_add=0.3) for i in range(8)]
    assert observed(rule(tmp_path, "arith_add"), flat).index(True) == 2  # the plateau alone
    budget = rule(tmp_path, "arith_add", cover=cover)
    assert observed(budget, flat).index(True) == 5  # 50 FLOPs at eval 5
    assert budget.record(50)["cover"] == [{"run": str(tmp_path / "partner"), "domain": "arith_add", "target": 0.6,
                                           "partner_flops_to_target": 40.0, "min_flops": 50.0, "met": "budget",
                                           "met_at_step": 50}]
    assert budget.record(50)["reason"] == "plateau"
    tight = rule(tmp_path, "arith_add", cover=f"[{{run: {tmp_path / 'partner'}, domain: arith_add, margin: 0}}]")
    assert observed(tight, flat).index(True) == 4

    # Cheap evals (5 FLOPs each): the cover is met by the target, smoothed (0.3 + 0.65 + 0.65) / 3 < 0.6 at eval 4,
    # 0.65 at eval 5 (25 FLOPs, under the budget); the plateau's window then needs two more evals.
    rising = [evals(5.0 * i, arith_add=a) for i, a in enumerate([0.3] * 3 + [0.65] * 6)]
    assert observed(rule(tmp_path, "arith_add"), rising).index(True) == 2
    target = rule(tmp_path, "arith_add", cover=cover)
    assert observed(target, rising).index(True) == 7
    (record,) = target.record(70)["cover"]
    assert record["met"] == "target" and record["met_at_step"] == 50
    never = rule(tmp_path, "arith_add", cover=cover)
    assert not any(observed(never, flat[:5])) and never.record(40)["reason"] == "max_steps"
    assert never.record(40)["cover"][0]["met"] is None and never.record(40)["cover"][0]["met_at_step"] is None


def test_a_run_that_cannot_improve_stops_at_its_plateau_and_says_why(assets, tmp_path):
    """min_delta 1 (no eval can beat the best by a whole accuracy): the run stops after `window` evals, at step 4 of
    a 20-step cap, and the summary and the ledger beside the model say so (a run that reaches its cap: the steps
    rule's record above). Every eval measures both splits (the test split's per-prompt records only in evals/), the
    final one all their prompts."""
    config = run_config(assets, tmp_path / "plateau", "grpo", **validation(assets), **{
        "train.steps": 20, "eval.every": 2, "checkpoint.every": 100,
        "train.stop.rule": "plateau", "train.stop.metric": "arith_add", "train.stop.window": 2,
        "train.stop.min_delta": 1.0})
    summary = train(config)
    assert summary["steps"] == 4 and summary["stop"]["reason"] == "plateau"
    ledger = json.loads((tmp_path / "plateau" / "final" / LEDGER_FILE).read_text())
    assert ledger["stop"] == summary["stop"]
    evals = [m for m in read_metrics(tmp_path / "plateau") if "eval/mean/accuracy_greedy" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]
    assert all({"valid/arith_add/accuracy_greedy", "valid/prog_trace/accuracy_greedy", "valid/mean/accuracy_greedy",
                "eval/arith_add/accuracy_sampled"} <= m.keys() for m in evals)
    assert not any("valid/arith_add/accuracy_sampled" in m for m in evals)  # greedy only
    assert {"final/mean/accuracy_greedy", "final_valid/arith_add/accuracy_greedy",
            "final_valid/mean/accuracy_greedy"} <= summary["final"].keys()
    assert sorted(p.name for p in (tmp_path / "plateau" / "evals").iterdir()) == [
        "final.json", "step_000000.json", "step_000002.json", "step_000004.json"]
    again = train(config)  # the same command again: it had stopped, so it trains no further
    assert again["steps"] == 4 and again["ledger"]["own"] == summary["ledger"]["own"]


def test_a_trained_stage_covers_a_trained_partner(assets, tmp_path):
    """End to end: a partner GRPO run, then a stage that alone would stop at step 4 (min_delta 1, as above) covering
    it with margin 1: the trainer feeds the rule each eval's step, validation accuracy and stage FLOPs, and the
    summary's record agrees with both runs' metrics (the target and FLOPs-to-target recomputed here from the
    partner's, the stop at or after the eval that met the cover, and none of the evals before it meeting it).
    The tiny models answer nothing right in a few steps, so the partner's validation curve is rewritten to climb
    (0.2, 0.4, 0.6 at its evals: target 0.4 at its last eval's FLOPs), which the stage meets by its budget."""
    small = {**validation(assets), "eval.every": 2, "checkpoint.every": 100}
    train(run_config(assets, tmp_path / "partner", "grpo", **small, **{"train.steps": 4}))
    lines, climb = read_metrics(tmp_path / "partner"), iter((0.2, 0.4, 0.6))
    for m in lines:
        if "valid/arith_add/accuracy_greedy" in m:
            m["valid/arith_add/accuracy_greedy"] = next(climb)
    (tmp_path / "partner" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    summary = train(run_config(assets, tmp_path / "stage", "grpo", **small, **{
        "train.steps": 12, "train.stop.rule": "plateau", "train.stop.metric": "arith_add", "train.stop.window": 2,
        "train.stop.min_delta": 1.0,
        "train.stop.cover": f"[{{run: {tmp_path / 'partner'}, domain: arith_add, margin: 1.0}}]"}))
    key = "valid/arith_add/accuracy_greedy"
    partner = [m for m in read_metrics(tmp_path / "partner") if key in m]
    target = smooth([m[key] for m in partner])[-1]
    to_target = flops_to_target([m["flops/total_stage"] for m in partner], [m[key] for m in partner], target)
    (cover,) = summary["stop"]["cover"]
    assert cover["target"] == target and cover["partner_flops_to_target"] == to_target > 0
    assert cover["min_flops"] == 2 * to_target
    evals = [m for m in read_metrics(tmp_path / "stage") if key in m]
    smoothed = smooth([m[key] for m in evals])
    met = [i for i, m in enumerate(evals) if smoothed[i] >= target or m["flops/total_stage"] >= cover["min_flops"]]
    assert met and cover["met_at_step"] == evals[met[0]]["step"] > 4  # the plateau alone stopped at step 4
    assert cover["met"] == ("target" if smoothed[met[0]] >= target else "budget")
    assert summary["stop"]["reason"] == "plateau" and summary["steps"] >= cover["met_at_step"]
