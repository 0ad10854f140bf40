"""Budget sensitivity (BUDGET_RULE): every finding recomputed with each stage's logged curve cut at a share of its
run, no extra training, so that a reader sees which verdicts measure the methods and which measure the budgets.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megaopd.analysis.curves import LENGTH_WINDOW, analyse
from megaopd.analysis.findings import BY_ID, judged, verdict_of
from megaopd.analysis.runs import Stage
from megaopd.analysis.stats import mean_bounds

CUTS = (0.5, 0.75, 1.0)
BUDGET_RULE = ("budget sensitivity: every stage's run is cut at the last periodic eval within 50% / 75% of its "
               "steps (that eval, on the fixed subset, stands in for the final one, and the stage's FLOPs end there; "
               "100% is the report's own numbers), each stage alone with its inputs as they were, and every finding "
               "recomputed; a verdict is from the check's point value (the mean over seeds, bounds where censored), no "
               "interval. A finding whose verdict differs between cuts is budget-dependent, at the first cut where it "
               "changes.")


def cut_stage(stage: Stage, fraction: float) -> Stage:
    """`stage` as if it had stopped at its last periodic eval within `fraction` of its steps (the first eval at
    least): that eval becomes its final one, and its FLOPs end there."""
    if fraction >= 1:
        return stage
    evals = [i for i, m in enumerate(stage.lines)
             if i != stage.final_index and any(k.startswith("eval/") for k in m)]
    if not evals:
        return stage
    cut = fraction * stage.lines[-1]["step"]
    end = max([i for i in evals if stage.lines[i]["step"] <= cut], default=evals[0])
    last = stage.lines[end]
    final = {"step": last["step"], **{k: v for k, v in last.items() if k.startswith("flops/")},
             **{"final/" + k.removeprefix("eval/"): v for k, v in last.items() if k.startswith("eval/")}}
    return replace(stage, lines=stage.lines[:end + 1] + [final], records={})


def _pooled(per_seed: list[list[dict]], i: int) -> dict:
    """Finding i over the seeds at one cut: each check's mean over the seeds that measure it (bounds where an arm
    was censored), judged on that point."""
    rule = BY_ID[per_seed[0][i]["id"]]
    checks = {}
    for label in dict.fromkeys(label for findings in per_seed for label in findings[i]["checks"]):
        have = [f[i]["checks"][label] for f in per_seed if label in f[i]["checks"]]
        bounds = mean_bounds([tuple(c["bounds"]) for c in have], rule.log)
        unmeasured = next((c["unmeasured"] for c in have if c.get("unmeasured")), "")
        checks[label] = {**judged(bounds, rule.op, rule.threshold, None, unmeasured=unmeasured),
                         "group": have[0]["group"]}
    return {"verdict": verdict_of(checks), "values": {label: c["bounds"] for label, c in checks.items()}}


def budget_sensitivity(dirs: list[Path], loaded: list[tuple[dict, list[Stage]]], metric: str = "greedy",
                       target_fraction: float = 0.9, window: int = 3, x: str = "stage",
                       length_window: int = LENGTH_WINDOW,
                       cuts: tuple[float, ...] = CUTS) -> list[dict]:
    """Per finding: its verdict and check values at each cut, whether it is budget-dependent, and the first cut
    whose verdict differs from the cut before it (BUDGET_RULE)."""
    by_cut = {}
    for cut in cuts:
        per_seed = [analyse(d, study, [cut_stage(s, cut) for s in stages], metric, target_fraction, window, x,
                            length_window)["findings"] for d, (study, stages) in zip(dirs, loaded)]
        by_cut[f"{100 * cut:g}%"] = [_pooled(per_seed, i) for i in range(len(per_seed[0]))]
    out = []
    for i in range(len(next(iter(by_cut.values())))):
        at = {cut: results[i] for cut, results in by_cut.items()}
        verdicts = [r["verdict"] for r in at.values()]
        changes = next((cut for cut, before, now in zip(list(at)[1:], verdicts, verdicts[1:]) if now != before), None)
        out.append({"cuts": at, "budget_dependent": changes is not None, "changes_at": changes})
    return out
