"""The findings' rule table (megaopd/analysis/findings.py) on hand-made seed results: each finding reproduced, not
reproduced and inconclusive by where its interval lies; censored arms (a target never reached) as bounds that decide
a verdict only where the bound settles it, alone and pooled over seeds; the two targets of (a) and (c) that must
agree; and provisional verdicts under three seeds."""

from __future__ import annotations


import pytest

from megaopd.analysis import aggregate, findings, judge
from megaopd.analysis.stats import (CENSORED, INCONCLUSIVE, NOT_MEASURED, NOT_REPRODUCED, REPRODUCED,
                                    TEACHER_BELOW)


def pair(method: str, grpo_flops: float, opd_flops: float | None, opd_length=(10.0, 20.0),
         grpo_length=(10.0, 12.0), opd_spent: float = 1000.0, fraction: tuple | None = None) -> dict:
    """One E1-E3 comparison as `analyse` writes it: FLOPs to GRPO's final smoothed accuracy 0.5 (OPD, if it never
    reaches it, stopped after `opd_spent` FLOPs), and to base + the gain share when `fraction` = (GRPO's, OPD's)."""
    def target(value, g, o):
        return {"target": value, "grpo_flops": g, "opd_flops": o, "grpo_flops_more_than": None,
                "opd_flops_more_than": opd_spent if o is None else None, "grpo_best_smoothed": 0.5,
                "opd_best_smoothed": 0.4}

    targets = {"teacher": target(0.5, grpo_flops, opd_flops)}
    if fraction is not None:
        targets["fraction"] = target(0.45, *fraction)
    return {"opd": method, "grpo": "grpo", "role": method, "targets": targets,
            "stopped": {"opd": "plateau (teacher_gap) at 70", "grpo": "plateau (arith_add) at 90"},
            "length": {"opd": {**dict(zip(("first", "last"), opd_length)), "truncated": 0.0},
                       "grpo": {**dict(zip(("first", "last"), grpo_length)), "truncated": 0.0},
                       "base": opd_length[0]}}


def multi(gaps: dict[str, float | None] | None = None, distill: float = 50.0, specialist: float = 1000.0) -> dict:
    """One E6 stage: student - expert gaps per domain (expert accuracy 0.8), distillation / specialist FLOPs."""
    domains = {d: {"expert": f"expert_{d}", "expert_acc": None if g is None else 0.8,
                   "student_acc": 0.8 + (g or 0.0), "gap": g} for d, g in (gaps or {}).items()}
    return {"stage": "multi", "domains": domains, "distill_flops": distill, "specialist_flops": specialist,
            "share": distill / specialist, "specialist_flops_to_final": specialist / 2,
            "share_experts_to_final": 2 * distill / specialist}


def split(merge: float | None, joint: float, experts: float = 1000.0, merge_spent: float = 300.0) -> dict:
    """One E7 comparison as `split_vs_joint` writes it (FLOPs of the merge and of joint GRPO to its final 0.6)."""
    total = experts + merge if merge is not None else None
    return {"joint": "joint", "merge": "multi", "target": 0.6, "experts_flops": experts,
            "merge_flops_to_target": merge, "merge_flops_more_than": merge_spent if merge is None else None,
            "merge_best_smoothed": 0.55, "split_flops": total, "stopped": "plateau (teacher_gap) at 40",
            "joint_flops_to_target": joint, "joint_best_smoothed": 0.6,
            "saving": 1 - total / joint if total is not None and joint else None}


def control(opd_flops: float, control_flops: float | None, control_spent: float = 1000.0) -> dict:
    """One OPD stage against its teacher-free control as `compare_control` writes it: FLOPs to OPD's final 0.6 (the
    control, if it never reaches it, stopped after `control_spent` FLOPs at best 0.45)."""
    ratio = control_flops / opd_flops if control_flops is not None and opd_flops else None
    return {"opd": "opd_self", "control": "opsa", "domain": "mean",
            "stopped": {"opd": "plateau (teacher_gap) at 40", "control": "plateau (mean) at 30"},
            "targets": {"teacher": {"target": 0.6, "opd_flops": opd_flops, "control_flops": control_flops,
                                    "opd_flops_more_than": None,
                                    "control_flops_more_than": control_spent if control_flops is None else None,
                                    "opd_best_smoothed": 0.6,
                                    "control_best_smoothed": 0.65 if control_flops is not None else 0.45,
                                    "ratio": ratio}}}


def seed(comparisons=(), mts=(), splits=(), controls=()) -> dict:
    return {"comparisons": list(comparisons), "multi_teacher": list(mts), "split_vs_joint": list(splits),
            "controls": list(controls)}


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
    # (g1) the control's best - OPD's final < 0: never attained / attained / about equal.
    ("g1", seed(controls=[control(100.0, None)]), -0.15, [-0.2, -0.1], REPRODUCED),
    ("g1", seed(controls=[control(100.0, 500.0)]), 0.05, [0.02, 0.08], NOT_REPRODUCED),
    ("g1", seed(controls=[control(100.0, 500.0)]), 0.05, [-0.02, 0.08], INCONCLUSIVE),
    # (g2) control/OPD FLOPs to OPD's final accuracy > 1: the control needs 5x OPD's / half / about the same.
    ("g2", seed(controls=[control(100.0, 500.0)]), 5.0, [3.0, 9.0], REPRODUCED),
    ("g2", seed(controls=[control(100.0, 50.0)]), 0.5, [0.3, 0.8], NOT_REPRODUCED),
    ("g2", seed(controls=[control(100.0, 110.0)]), 1.1, [0.8, 1.6], INCONCLUSIVE),
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


def only(f: dict) -> dict:
    (check,) = f["checks"].values()
    return check


# (finding, seed whose arm never reached the target, its bounds, verdict): the bound decides where it settles the
# claim, else the verdict is inconclusive (censored). The old sentinel (0 for OPD never arriving, inf for a control,
# -inf for a merge) would have decided each CENSORED case: the 0 < 1 of (a), the inf > 1 of (g2), the -inf of (f).
CENSORED_CASES = [
    # (a): OPD stopped at 400 FLOPs, past GRPO's 300: GRPO/OPD < 0.75 < 1 whatever OPD would have needed.
    ("a", seed([pair("opd_external", 300.0, None, opd_spent=400.0)]), [None, 0.75], REPRODUCED),
    # (a): OPD stopped at 100 FLOPs, before GRPO's 300: GRPO/OPD < 3 says nothing about < 1.
    ("a", seed([pair("opd_external", 300.0, None, opd_spent=100.0)]), [None, 3.0], CENSORED),
    # (c): OPD never reached it at 600 FLOPs: GRPO/OPD < 0.5, so OPD did not need fewer FLOPs.
    ("c", seed([pair("opd_self", 300.0, None, opd_spent=600.0)]), [None, 0.5], NOT_REPRODUCED),
    ("c", seed([pair("opd_self", 300.0, None, opd_spent=100.0)]), [None, 3.0], CENSORED),
    # (g2): the control stopped at 500 FLOPs against OPD's 100: control/OPD > 5 > 1.
    ("g2", seed(controls=[control(100.0, None, control_spent=500.0)]), [5.0, None], REPRODUCED),
    # (g2): the control stopped at 50 FLOPs, half OPD's: > 0.5 cannot show > 1 (the budget did not cover OPD's).
    ("g2", seed(controls=[control(100.0, None, control_spent=50.0)]), [0.5, None], CENSORED),
    # (f): the merge stopped at 300 FLOPs: split > 1300, so against joint's 1000 the saving < -0.3.
    ("f", seed(splits=[split(None, 1000.0, merge_spent=300.0)]), [None, -0.3], NOT_REPRODUCED),
    # (f): against joint's 2000 the saving < 0.35: inconclusive whatever the merge would have needed.
    ("f", seed(splits=[split(None, 2000.0, merge_spent=300.0)]), [None, 0.35], CENSORED),
]


@pytest.mark.parametrize("finding_id, r, bounds, expected", CENSORED_CASES,
                         ids=[f"{c[0]}-{c[3].replace(' ', '_')}" for c in CENSORED_CASES])
def test_a_censored_arm_is_a_bound_that_decides_only_where_it_settles_the_claim(finding_id, r, bounds, expected):
    check = only(judged(finding_id, r))
    assert check["value"] is None and check["bounds"] == [pytest.approx(b) if b is not None else None for b in bounds]
    assert check["verdict"] == expected
    if expected == CENSORED:  # names the arm, where it stopped and why
        assert "never reached" in check["censored"] and "plateau" in check["censored"]
    # An interval over resamples with the same open end decides the same way.
    assert only(judged(finding_id, r, bounds))["verdict"] == expected


@pytest.mark.parametrize("opd_flops", [20.0, 60.0, 99.0, 101.0, 400.0, 5000.0])
def test_a_control_stopped_short_stays_censored_whatever_its_opd_partner_does(opd_flops):
    """The control stopped after 100 FLOPs without reaching OPD's accuracy: with OPD at or above 100 FLOPs the
    bound control/OPD > 100/opd is <= 1 and cannot show > 1; below, it can (and does)."""
    check = only(judged("g2", seed(controls=[control(opd_flops, None, control_spent=100.0)])))
    assert check["verdict"] == (REPRODUCED if opd_flops < 100.0 else CENSORED)
    assert "opsa never reached 0.600" in check["censored"] and "plateau (mean) at 30" in check["censored"]


def test_edge_targets_are_not_measured_and_missing_numbers_are_skipped():
    # OPD's (or the control's partner's) first eval already at the target: no FLOPs to compare.
    at_zero = seed([pair("opd_external", 300.0, 0.0), pair("opd_self", 300.0, 0.0)])
    assert judged("a", at_zero)["verdict"] == NOT_MEASURED and judged("c", at_zero)["verdict"] == NOT_MEASURED
    assert judged("f", seed(splits=[split(100.0, 0.0)]))["verdict"] == NOT_MEASURED
    assert judged("g2", seed(controls=[control(0.0, 0.0)]))["verdict"] == NOT_MEASURED
    # No rollout lengths (b), an expert without its final eval (d): not measured.
    no_lengths = seed([pair("opd_external", 100.0, 400.0, opd_length=(None, None))])
    assert judged("b", no_lengths)["verdict"] == NOT_MEASURED
    assert judged("d", seed(mts=[multi({"arith_add": None})]))["verdict"] == NOT_MEASURED
    # (e) with no specialist FLOPs to their own final accuracy: a check all the same, its detail says so.
    m = multi(distill=52.0) | {"specialist_flops_to_final": None, "share_experts_to_final": None}
    assert "final accuracy -: share -" in only(judged("e", seed(mts=[m])))["detail"]


@pytest.mark.parametrize("finding_id", ["a", "c"])
def test_the_two_targets_must_agree(finding_id):
    """(a) and (c) are judged on GRPO's final accuracy and on base + the gain share: a decisive verdict needs both."""
    method = "opd_external" if finding_id == "a" else "opd_self"
    both = seed([pair(method, 100.0, 400.0, fraction=(50.0, 200.0))])  # OPD 4x GRPO's FLOPs on both targets
    split_targets = seed([pair(method, 100.0, 400.0, fraction=(200.0, 50.0))])  # 1/4 on one, 4 on the other
    f = judged(finding_id, both)
    assert len(f["checks"]) == 2 and len({c["group"] for c in f["checks"].values()}) == 1
    assert f["verdict"] == (REPRODUCED if finding_id == "a" else NOT_REPRODUCED)
    f = judged(finding_id, split_targets)
    assert sorted(c["verdict"] for c in f["checks"].values()) == [NOT_REPRODUCED, REPRODUCED]
    assert f["verdict"] == INCONCLUSIVE


def seeds_of(*rs: dict) -> list[dict]:
    """Seed results as `bootstrap` leaves them without per-prompt results: findings judged on their bounds."""
    return [{"headline": {}, "findings": [judge(f, {}) for f in findings(r)], "intervals": {}} for r in rs]


def test_seeds_pool_bounds_never_sentinels():
    """One seed's OPD never reached GRPO's final accuracy (stopped at 100 FLOPs, before GRPO's 300), two others
    needed 8.2x fewer FLOPs: the old pooling averaged the first seed's 0 with them into a number. Pooled as bounds,
    (c)'s check is known only below a bound, and censored."""
    censored = seed([pair("opd_self", 300.0, None, opd_spent=100.0)])
    fast = seed([pair("opd_self", 300.0, 300.0 / 8.2)])
    _, overall = aggregate(seeds_of(censored, fast, fast), [{}, {}, {}])
    c = next(f for f in overall if f["id"] == "c")
    check = only(c)
    assert check["value"] is None and check["bounds"][0] is None  # unbounded below: a censored seed is no number
    assert check["bounds"][1] == pytest.approx((3.0 * 8.2 * 8.2) ** (1 / 3))  # geometric mean of the upper bounds
    assert check["verdict"] == CENSORED and c["verdict"] == CENSORED and "never reached" in check["censored"]
    # Three seeds that each reached it: the geometric mean, decisive and not provisional.
    _, overall = aggregate(seeds_of(fast, fast, fast), [{}, {}, {}])
    c = next(f for f in overall if f["id"] == "c")
    assert only(c)["value"] == pytest.approx(8.2) and c["verdict"] == REPRODUCED and not c["provisional"]


def test_fewer_than_three_seeds_make_a_decisive_verdict_provisional():
    fast = seed([pair("opd_self", 300.0, 300.0 / 8.2)])
    for n, provisional in ((1, True), (2, True), (3, False)):
        _, overall = aggregate(seeds_of(*[fast] * n), [{}] * n)
        c = next(f for f in overall if f["id"] == "c")
        assert c["verdict"] == REPRODUCED and c["provisional"] is provisional


def test_a_finding_needs_all_its_checks():
    r = seed(mts=[multi({"arith_add": 0.0, "prog_trace": -0.05})])
    f = next(f for f in findings(r) if f["id"] == "d")
    judge(f, {"multi arith_add": [-0.02, 0.02], "multi prog_trace": [-0.08, -0.02]})
    assert [c["verdict"] for c in f["checks"].values()] == [REPRODUCED, INCONCLUSIVE] and f["verdict"] == INCONCLUSIVE
    judge(f, {"multi arith_add": [-0.3, -0.1], "multi prog_trace": [-0.08, -0.02]})
    assert f["verdict"] == NOT_REPRODUCED


def with_teacher(comparison: dict, accuracy: float, below_student: bool = False) -> dict:
    """The pair's OPD stage checked its external teacher (megaopd/teachers/check.py) at `accuracy`."""
    return {**comparison, "teacher_check": {"accuracy": accuracy, "below_student": below_student}}


def test_a_target_above_the_teacher_is_not_measured_never_reproduced():
    """(a) with OPD 4x cheaper to GRPO's 0.5 would be 'not reproduced' from its number; with the teacher at 0.3 the
    target lies above anything OPD could reach from it: not measured (teacher below target), alone, over seeds and
    beside a measured target (which then decides alone). A teacher above the target leaves the number to decide."""
    weak = seed([with_teacher(pair("opd_external", 400.0, 100.0), 0.3, below_student=True)])
    f = judged("a", weak, [3.5, 4.5])
    assert f["verdict"] == TEACHER_BELOW and only(f)["verdict"] == TEACHER_BELOW and only(f)["value"] is None
    assert "teacher below student" in only(f)["detail"]
    _, overall = aggregate(seeds_of(weak, seed([pair("opd_external", 400.0, 100.0)])), [{}, {}])
    assert next(f for f in overall if f["id"] == "a")["verdict"] == TEACHER_BELOW
    # GRPO final (0.5) above a teacher at 0.47, the fraction target (0.45) below it: that one is measured, decides.
    two = seed([with_teacher(pair("opd_external", 400.0, 100.0, fraction=(400.0, 100.0)), 0.47)])
    f = judged("a", two)
    assert sorted(c["verdict"] for c in f["checks"].values()) == sorted([NOT_REPRODUCED, TEACHER_BELOW])
    assert f["verdict"] == NOT_REPRODUCED
    strong = seed([with_teacher(pair("opd_external", 400.0, 100.0), 0.9)])
    assert judged("a", strong)["verdict"] == NOT_REPRODUCED  # negative control: a stronger teacher is measured
