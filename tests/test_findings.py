"""The findings' rule table (megaopd/analysis/findings.py) on hand-made seed results: each finding reproduced, not
reproduced and inconclusive by where its interval lies, and the edge values (a target never reached, reached at 0
FLOPs) that decide a verdict without one."""

from __future__ import annotations

import math

import pytest

from megaopd.analysis import findings, judge
from megaopd.analysis.stats import INCONCLUSIVE, NOT_MEASURED, NOT_REPRODUCED, REPRODUCED


def pair(method: str, grpo_flops: float, opd_flops: float | None, opd_length=(10.0, 20.0),
         grpo_length=(10.0, 12.0)) -> dict:
    """One E1-E3 comparison as `analyse` writes it: FLOPs to GRPO's final smoothed accuracy 0.5."""
    return {"opd": method, "grpo": "grpo", "method": method,
            "targets": {"teacher": {"target": 0.5, "grpo_flops": grpo_flops, "opd_flops": opd_flops,
                                    "grpo_best_smoothed": 0.5, "opd_best_smoothed": 0.4}},
            "length": {"opd": dict(zip(("first", "last"), opd_length)),
                       "grpo": dict(zip(("first", "last"), grpo_length))}}


def multi(gaps: dict[str, float | None] | None = None, distill: float = 50.0, specialist: float = 1000.0) -> dict:
    """One E6 stage: student - expert gaps per domain (expert accuracy 0.8), distillation / specialist FLOPs."""
    domains = {d: {"expert": f"expert_{d}", "expert_acc": None if g is None else 0.8,
                   "student_acc": 0.8 + (g or 0.0), "gap": g} for d, g in (gaps or {}).items()}
    return {"stage": "multi", "domains": domains, "distill_flops": distill, "specialist_flops": specialist,
            "share": distill / specialist, "specialist_flops_to_final": specialist / 2,
            "share_experts_to_final": 2 * distill / specialist}


def split(merge: float | None, joint: float, experts: float = 1000.0) -> dict:
    """One E7 comparison as `split_vs_joint` writes it (FLOPs of the merge and of joint GRPO to its final 0.6)."""
    total = experts + merge if merge is not None else None
    return {"joint": "joint", "merge": "multi", "target": 0.6, "experts_flops": experts,
            "merge_flops_to_target": merge, "merge_best_smoothed": 0.55, "split_flops": total,
            "joint_flops_to_target": joint, "joint_best_smoothed": 0.6,
            "saving": 1 - total / joint if total is not None and joint else None,
            "saving_experts_to_final": 1 - (total - experts / 2) / joint if total is not None and joint else None}


def control(opd_flops: float, control_flops: float | None) -> dict:
    """One OPD stage against its teacher-free control as `compare_control` writes it: FLOPs to OPD's final 0.6."""
    ratio = None if not opd_flops else math.inf if control_flops is None else control_flops / opd_flops
    return {"opd": "opd_self", "control": "opsa", "domain": "mean",
            "targets": {"teacher": {"target": 0.6, "opd_flops": opd_flops, "control_flops": control_flops,
                                    "opd_best_smoothed": 0.6, "control_best_smoothed": 0.45, "ratio": ratio}}}


def seed(comparisons=(), mts=(), splits=(), controls=()) -> dict:
    return {"comparisons": list(comparisons), "multi_teacher": list(mts), "split_vs_joint": list(splits),
            "teacher_free": list(controls)}


def judged(finding_id: str, r: dict, interval: list[float] | None = None) -> dict:
    """The finding, every check judged on `interval` (None: on its point, as without per-prompt results)."""
    f = next(f for f in findings(r) if f["id"] == finding_id)
    return judge(f, {label: interval for label in f["checks"]} if interval else {})


# (finding, seed result, its one check's value, interval, verdict): one case per verdict of each finding.
CASES = [
    # (a) GRPO/OPD FLOPs < 1: OPD needs 4x GRPO's FLOPs / 4x fewer / about the same.
    ("a", seed([pair("opd_external", 100.0, 400.0)]), 0.25, [0.2, 0.4], REPRODUCED),
    ("a", seed([pair("opd_external", 400.0, 100.0)]), 4.0, [3.0, 6.0], NOT_REPRODUCED),
    ("a", seed([pair("opd_external_grpo", 100.0, 110.0)]), 100 / 110, [0.7, 1.2], INCONCLUSIVE),
    # (b) OPD's length growth minus GRPO's > 0: x2 vs x1.2 / x1 vs x1.5 / x1.25 vs x1.2.
    ("b", seed([pair("opd_external", 100.0, 400.0)]), 0.8, [0.5, 1.1], REPRODUCED),
    ("b", seed([pair("opd_external", 100.0, 400.0, opd_length=(10.0, 10.0), grpo_length=(10.0, 15.0))]), -0.5,
     [-0.7, -0.3], NOT_REPRODUCED),
    ("b", seed([pair("opd_external", 100.0, 400.0, opd_length=(10.0, 12.5))]), 0.05, [-0.1, 0.2], INCONCLUSIVE),
    # (c) GRPO/OPD FLOPs > 1 for the self-GRPO teacher: 50x fewer (the paper) / 2x more / about the same.
    ("c", seed([pair("opd_self", 500.0, 10.0)]), 50.0, [30.0, 80.0], REPRODUCED),
    ("c", seed([pair("opd_self", 100.0, 200.0)]), 0.5, [0.3, 0.9], NOT_REPRODUCED),
    ("c", seed([pair("opd_self", 100.0, 90.0)]), 100 / 90, [0.8, 1.5], INCONCLUSIVE),
    # (d) student - expert >= -0.05: within / far below / at the tolerance.
    ("d", seed(mts=[multi({"arith_add": -0.01})]), -0.01, [-0.03, 0.01], REPRODUCED),
    ("d", seed(mts=[multi({"arith_add": -0.2})]), -0.2, [-0.25, -0.15], NOT_REPRODUCED),
    ("d", seed(mts=[multi({"arith_add": -0.05})]), -0.05, [-0.08, -0.02], INCONCLUSIVE),
    # (e) distillation <= 10% of the specialists' FLOPs (FLOPs carry no interval in a report; the rule still can).
    ("e", seed(mts=[multi(distill=52.0)]), 0.052, [0.04, 0.06], REPRODUCED),
    ("e", seed(mts=[multi(distill=300.0)]), 0.3, [0.25, 0.35], NOT_REPRODUCED),
    ("e", seed(mts=[multi(distill=100.0)]), 0.1, [0.08, 0.12], INCONCLUSIVE),
    # (f) 1 - split/joint > 0: 42% fewer (the paper) / 50% more / about the same.
    ("f", seed(splits=[split(160.0, 2000.0)]), 0.42, [0.3, 0.5], REPRODUCED),
    ("f", seed(splits=[split(500.0, 1000.0)]), -0.5, [-0.6, -0.4], NOT_REPRODUCED),
    ("f", seed(splits=[split(20.0, 1000.0)]), -0.02, [-0.1, 0.05], INCONCLUSIVE),
    # (g) control/OPD FLOPs to OPD's final accuracy > 1: the control needs 5x OPD's / half / about the same.
    ("g", seed(controls=[control(100.0, 500.0)]), 5.0, [3.0, 9.0], REPRODUCED),
    ("g", seed(controls=[control(100.0, 50.0)]), 0.5, [0.3, 0.8], NOT_REPRODUCED),
    ("g", seed(controls=[control(100.0, 110.0)]), 1.1, [0.8, 1.6], INCONCLUSIVE),
]


@pytest.mark.parametrize("finding_id, r, value, interval, expected", CASES,
                         ids=[f"{c[0]}-{c[4].replace(' ', '_')}" for c in CASES])
def test_each_finding_reproduced_not_reproduced_or_inconclusive(finding_id, r, value, interval, expected):
    f = judged(finding_id, r, interval)
    (check,) = f["checks"].values()
    assert check["value"] == pytest.approx(value)
    assert check["interval"] == interval and check["verdict"] == expected and f["verdict"] == expected
    # Without an interval the point decides, two-way (the straddling cases fall on the side of their point).
    point = judged(finding_id, r)["verdict"]
    assert (point == expected) if expected != INCONCLUSIVE else (point in (REPRODUCED, NOT_REPRODUCED))


def test_targets_never_reached_or_reached_at_zero_flops():
    # OPD never reaches GRPO's final accuracy: GRPO/OPD counts as 0, for (a) and against (c).
    never = seed([pair("opd_external", 300.0, None), pair("opd_self", 300.0, None)])
    assert [c["value"] for c in judged("a", never)["checks"].values()] == [0.0]
    assert judged("a", never)["verdict"] == REPRODUCED and judged("c", never)["verdict"] == NOT_REPRODUCED
    # OPD's first eval already at the target (0 FLOPs): inf against (a); (c) has nothing to compare.
    at_zero = seed([pair("opd_external", 300.0, 0.0), pair("opd_self", 300.0, 0.0)])
    assert [c["value"] for c in judged("a", at_zero)["checks"].values()] == [math.inf]
    assert judged("a", at_zero)["verdict"] == NOT_REPRODUCED and judged("c", at_zero)["verdict"] == NOT_MEASURED
    # The merge never reaching joint GRPO's accuracy: saving -inf; joint GRPO at it from its first eval: no saving.
    assert judged("f", seed(splits=[split(None, 1000.0)]))["checks"]["multi + experts vs joint"]["value"] == -math.inf
    assert judged("f", seed(splits=[split(None, 1000.0)]))["verdict"] == NOT_REPRODUCED
    assert judged("f", seed(splits=[split(100.0, 0.0)]))["verdict"] == NOT_MEASURED
    # The control never reaching OPD's accuracy: inf, for (g); OPD's first eval already at it: no gain to explain.
    assert [c["value"] for c in judged("g", seed(controls=[control(100.0, None)]))["checks"].values()] == [math.inf]
    assert judged("g", seed(controls=[control(100.0, None)]))["verdict"] == REPRODUCED
    assert judged("g", seed(controls=[control(0.0, 0.0)]))["verdict"] == NOT_MEASURED
    # No rollout lengths (b), an expert without its final eval (d): not measured.
    no_lengths = seed([pair("opd_external", 100.0, 400.0, opd_length=(None, None))])
    assert judged("b", no_lengths)["verdict"] == NOT_MEASURED
    assert judged("d", seed(mts=[multi({"arith_add": None})]))["verdict"] == NOT_MEASURED


def test_a_finding_needs_all_its_checks():
    r = seed(mts=[multi({"arith_add": 0.0, "prog_trace": -0.05})])
    f = next(f for f in findings(r) if f["id"] == "d")
    judge(f, {"multi arith_add": [-0.02, 0.02], "multi prog_trace": [-0.08, -0.02]})
    assert [c["verdict"] for c in f["checks"].values()] == [REPRODUCED, INCONCLUSIVE] and f["verdict"] == INCONCLUSIVE
    judge(f, {"multi arith_add": [-0.3, -0.1], "multi prog_trace": [-0.08, -0.02]})
    assert f["verdict"] == NOT_REPRODUCED
