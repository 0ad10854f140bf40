"""The paper's findings as a table of rules: each claim, the number that measures it per pair (or domain, or
stage), the threshold that number must pass and the paper's own magnitude; ``findings`` evaluates the table on one
seed's numbers and ``judge`` gives each check its verdict from its bootstrap interval (``stats``: reproduced, not
reproduced, inconclusive when the interval straddles the threshold, inconclusive (censored) when an arm stopped
before its target and the bound that leaves does not settle the claim).

A number of a check is ``Bounds``: an arm that never reached a target needs more FLOPs than it spent, which bounds a
ratio on one side only (CENSORING_RULE). No 0, inf or -inf stands for "never".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from megaopd.analysis.stats import TEACHER_BELOW, Bounds, agree, combine, verdict

MATCH_TOLERANCE = 0.05  # (d): a student "matches" its expert when at most this much below it (absolute accuracy)
SMALL_SHARE = 0.10  # (e): distillation is "a small share" of specialist FLOPs at or below this
PINNED_SHARE = 0.5  # (b): an arm whose last rollouts are at least this share truncated is pinned at its token cap
CENSORING_RULE = ("censoring: an arm whose smoothed curve never reached a target needs more FLOPs than its last "
                  "periodic eval's, and no more is known: its FLOPs-to-target is a lower bound, a ratio built on it a "
                  "bound on one side, and a check is decided only where that bound settles it (else inconclusive "
                  "(censored), naming the arm, where it stopped and why). Over seeds a bound stays a bound: the mean "
                  "of numbers known within [lo, hi] lies within [mean lo, mean hi] (geometric means for ratios), "
                  "unbounded on a side where any seed is.")
TARGETS = {"teacher": "GRPO final", "fraction": "base + gain share"}  # (a), (c): both targets must agree
FINDING_RULES = ("each finding is checked per pair (per domain for (d)) as a number against a threshold: (a) GRPO/OPD "
                 "FLOPs to GRPO's final accuracy and to base + the gain share < 1, the two targets agreeing; (b) OPD's "
                 "last response length minus GRPO's, over the base model's (both arms' first-step rollouts, the same "
                 "token cap) > 0, each arm's truncated share beside it; (c) as (a) for the self-GRPO teacher, > 1; (d) "
                 "student - expert final accuracy >= -tolerance; (e) distillation / specialist FLOPs <= the "
                 "small-share bound; (f) 1 - split/joint FLOPs to joint GRPO's final accuracy > 0; (g1) the "
                 "control's (OPD without the teacher) best smoothed accuracy - OPD's final < 0 (it never attains OPD's accuracy); "
                 "(g2) control/OPD FLOPs to OPD's final accuracy > 1. A check whose arms need no FLOPs to a target "
                 "(their first eval meets it) is not measured; an (a) or (c) check whose target lies above the OPD "
                 "stage's teacher's greedy validation accuracy (its teacher check) is not measured (teacher below "
                 "target): OPD could not reach it from that teacher. A finding needs all its checks: one not "
                 "reproduced decides it, else one inconclusive leaves it inconclusive. " + CENSORING_RULE)


@dataclass(frozen=True)
class Check:
    """One pair's (or domain's) number for a finding."""

    label: str
    bounds: Bounds  # (v, v) when measured; open on the side an arm's censoring leaves unknown
    detail: str  # how it was measured, for the report
    group: str = ""  # checks that must agree to decide (one pair's two targets); "" for the label alone
    censored: str = ""  # the arm that stopped before the target: where and why
    unmeasured: str = ""  # a verdict of stats.UNMEASURED that stands instead of the number's (TEACHER_BELOW)


@dataclass(frozen=True)
class Finding:
    """A claim of the paper, reproduced where `measure`'s value OP threshold holds for every pair it measures."""

    id: str
    claim: str
    measure: Callable[[dict], Iterator[Check]]  # one seed's numbers (`analyse`) -> a check per pair / domain
    op: str  # the direction: one of stats.OPS
    threshold: float
    paper: str  # the paper's magnitude, printed beside ours
    log: bool = False  # pooled over seeds as a geometric mean (ratios of FLOPs)


def reached(flops: float | None, best: float | None) -> str:
    """FLOPs to a target, or why there are none (a stage with no periodic mean eval has no best either)."""
    if flops is not None:
        return f"{flops:.3e}"
    return f"not reached (best smoothed {best:.3f})" if best is not None else "not reached (no periodic mean eval)"


def needed(t: dict, role: str) -> Bounds:
    """A role's FLOPs to a target: (f, f) when its curve reached it, (more than its last eval's FLOPs, unknown)
    when not."""
    flops = t[f"{role}_flops"]
    return (flops, flops) if flops is not None else (t.get(f"{role}_flops_more_than"), None)


def ratio(num: Bounds, den: Bounds) -> Bounds:
    """num / den of two positive bounded numbers: the lower end over the other's upper end, and the reverse."""
    lo = num[0] / den[1] if num[0] is not None and den[1] else None
    hi = num[1] / den[0] if num[1] is not None and den[0] else None
    return lo, hi


def censoring(c: dict, t: dict, roles: tuple[str, ...]) -> str:
    """Which of the roles never reached target `t`, where it stopped and why; "" when every one did."""
    return "; ".join(f"{c[x]} never reached {t['target']:.3f} (best smoothed {t[f'{x}_best_smoothed']:.3f}; "
                     f"{c['stopped'][x]} after {t[f'{x}_flops_more_than']:.3e} FLOPs)"
                     for x in roles if t[f"{x}_flops"] is None and t.get(f"{x}_flops_more_than") is not None)


def _pairs(r: dict, self_teacher: bool) -> list[dict]:
    """The E1-E3 comparisons with a target: the self-GRPO teacher's (E3) or the external teachers' (E1/E2)."""
    return [c for c in r["comparisons"] if (c["role"] == "opd_self") == self_teacher and "teacher" in c["targets"]]


def teacher_note(c: dict) -> str:
    """The pair's teacher check in a few words, for a check's detail ("" without one)."""
    check = c.get("teacher_check")
    if not check:
        return ""
    below = "; teacher below student (run with allow_weaker_teacher)" if check["below_student"] else ""
    return f"; teacher {check['accuracy']:.3f} greedy on validation{below}"


def _grpo_over_opd(r: dict, self_teacher: bool) -> Iterator[Check]:
    """GRPO/OPD FLOPs to each target, per pair; not where either arm needs no FLOPs to it (nothing to compare), nor
    where the target lies above the OPD stage's teacher (TEACHER_BELOW)."""
    for c in _pairs(r, self_teacher):
        pair = f"{c['opd']} vs {c['grpo']}"
        teacher = (c.get("teacher_check") or {}).get("accuracy")
        for name, t in c["targets"].items():
            if 0 in (t["grpo_flops"], t["opd_flops"]):
                continue
            label = f"{pair} ({TARGETS[name]})"
            if teacher is not None and t["target"] > teacher:
                yield Check(label, (None, None), f"target {t['target']:.3f} above the teacher's {teacher:.3f} "
                            "(greedy, validation)" + teacher_note(c), pair, unmeasured=TEACHER_BELOW)
                continue
            b = ratio(needed(t, "grpo"), needed(t, "opd"))
            yield Check(label, b,
                        f"FLOPs to {t['target']:.3f}: GRPO {reached(t['grpo_flops'], t['grpo_best_smoothed'])}, OPD "
                        f"{reached(t['opd_flops'], t['opd_best_smoothed'])}{teacher_note(c)}; GRPO/OPD", pair,
                        censoring(c, t, ("grpo", "opd")))


def external_flops_ratio(r: dict) -> Iterator[Check]:
    """(a) GRPO/OPD FLOPs to GRPO's final accuracy and to base + the gain share, per external-teacher pair."""
    yield from _grpo_over_opd(r, self_teacher=False)


def self_flops_ratio(r: dict) -> Iterator[Check]:
    """(c) GRPO/OPD FLOPs to the checkpoint's final accuracy and to base + the gain share, per self-teacher pair."""
    yield from _grpo_over_opd(r, self_teacher=True)


def length_growth_difference(r: dict) -> Iterator[Check]:
    """(b) OPD's last response length minus GRPO's, over the base model's (both arms' first-step rollouts: the same
    model, sampling and token cap), per external-teacher pair where both have rollouts; each arm's truncated share
    of its last rollouts beside it."""
    for c in _pairs(r, self_teacher=False):
        lo, lg, base = c["length"]["opd"], c["length"]["grpo"], c["length"].get("base")
        if not base or None in (lo["last"], lg["last"]):
            continue
        go, gg = lo["last"] / base, lg["last"] / base
        pinned = [f"{c[x]} pinned at its token cap ({100 * c['length'][x]['truncated']:.0f}% truncated)"
                  for x in ("opd", "grpo") if (c["length"][x].get("truncated") or 0) >= PINNED_SHARE]
        truncated = ", ".join(f"{x.upper()} {_share(c['length'][x].get('truncated'))}" for x in ("opd", "grpo"))
        yield Check(f"{c['opd']} vs {c['grpo']}", (go - gg, go - gg),
                    f"base {base:.1f} tokens; OPD x{go:.2f} ({lo['last']:.1f}) vs GRPO x{gg:.2f} ({lg['last']:.1f}); "
                    f"truncated at the end: {truncated}" + (f"; read while {', '.join(pinned)}" if pinned else "")
                    + teacher_note(c) + "; difference")


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def expert_gaps(r: dict) -> Iterator[Check]:
    """(d) student - expert final accuracy, per multi-teacher stage and expert domain."""
    for m in r["multi_teacher"]:
        for k, v in m["domains"].items():
            if v["gap"] is not None:
                yield Check(f"{m['stage']} {k}", (v["gap"], v["gap"]),
                            f"student {v['student_acc']:.3f} vs expert {v['expert']} {v['expert_acc']:.3f}; gap")


def _flops(v: float | None) -> str:
    return "-" if v is None else f"{v:.3e}"


def distillation_share(r: dict) -> Iterator[Check]:
    """(e) distillation FLOPs / the specialists' FLOPs, per multi-teacher stage."""
    for m in r["multi_teacher"]:
        if m["share"] is not None:
            to_final = m["share_experts_to_final"]
            yield Check(m["stage"], (m["share"], m["share"]),
                        f"{m['distill_flops']:.3e} / {m['specialist_flops']:.3e} (experts' whole runs; to their own "
                        f"final accuracy {_flops(m['specialist_flops_to_final'])}: share "
                        f"{'-' if to_final is None else format(to_final, '.3g')}); share")


def split_saving(r: dict) -> Iterator[Check]:
    """(f) 1 - split/joint FLOPs to joint GRPO's final accuracy, per joint GRPO stage; the merge never reaching it
    bounds the saving from above. Joint GRPO's first eval already at it (0 FLOPs to it): no saving to measure."""
    for s in r["split_vs_joint"]:
        joint, merge = s["joint_flops_to_target"], s["merge_flops_to_target"]
        if not joint or s["experts_flops"] is None or (merge is None and s["merge_flops_more_than"] is None):
            continue
        split = (s["experts_flops"] + merge, s["experts_flops"] + merge) if merge is not None else (
            s["experts_flops"] + s["merge_flops_more_than"], None)
        b = (1 - split[1] / joint if split[1] is not None else None, 1 - split[0] / joint)
        censored = "" if merge is not None else (
            f"{s['merge']} never reached {s['target']:.3f} (best smoothed {s['merge_best_smoothed']:.3f}; "
            f"{s['stopped']} after {s['merge_flops_more_than']:.3e} FLOPs)")
        yield Check(f"{s['merge']} + experts vs {s['joint']}", b,
                    f"to {s['target']:.3f}: split {reached(s['split_flops'], s['merge_best_smoothed'])} (experts' "
                    f"whole runs), joint {joint:.3e}; saving", censored=censored)


def _controls(r: dict) -> Iterator[tuple[dict, dict]]:
    for c in r["controls"]:
        t = c["targets"].get("teacher")
        if t is not None and t["opd_flops"] != 0:  # OPD's first eval already at its final accuracy: no gain
            yield c, t


def control_attainment(r: dict) -> Iterator[Check]:
    """(g1) the control's best smoothed accuracy minus OPD's final, per OPD stage and its control; a
    control that stopped short of OPD's accuracy before spending OPD's FLOPs to it could still have attained it:
    the difference is then bounded from below only."""
    for c, t in _controls(r):
        gap = t["control_best_smoothed"] - t["target"]
        short = t["control_flops"] is None and (t["control_flops_more_than"] or 0) < t["opd_flops"]
        yield Check(f"{c['opd']} vs {c['control']}", (gap, None if short else gap),
                    f"control best {t['control_best_smoothed']:.3f} vs OPD final {t['target']:.3f} ({c['domain']}); "
                    "difference", censored=censoring(c, t, ("control",)) + " before OPD's FLOPs to it" if short else "")


def control_flops_ratio(r: dict) -> Iterator[Check]:
    """(g2) the control's FLOPs over OPD's to OPD's final accuracy, per OPD stage and its control; a
    control that never reached it bounds the ratio from below by its FLOPs over OPD's."""
    for c, t in _controls(r):
        yield Check(f"{c['opd']} vs {c['control']}", ratio(needed(t, "control"), needed(t, "opd")),
                    f"FLOPs to {t['target']:.3f} (OPD's final, {c['domain']}): OPD {t['opd_flops']:.3e}, control "
                    f"{reached(t['control_flops'], t['control_best_smoothed'])}; control/OPD",
                    censored=censoring(c, t, ("control", "opd")))


FINDINGS = (
    Finding("a", "external-teacher OPD loses to GRPO per FLOP (E1/E2)", external_flops_ratio, "<", 1.0,
            "OPD loses (no number given)", log=True),
    Finding("b", "external-teacher OPD inflates response length more than GRPO (over the base model's length)",
            length_growth_difference, ">", 0.0, "often inflates (no number given)"),
    Finding("c", "self-GRPO-teacher OPD reaches the checkpoint's accuracy with fewer FLOPs than GRPO (E3)",
            self_flops_ratio, ">", 1.0, "~50x (math)", log=True),
    Finding("d", f"the multi-teacher student matches each expert (within {MATCH_TOLERANCE} absolute) (E6)",
            expert_gaps, ">=", -MATCH_TOLERANCE, "matches each expert"),
    Finding("e", "distillation is a small share of the specialists' FLOPs (E6)", distillation_share, "<=",
            SMALL_SHARE, "0.052 (2 domains) / 0.080 (4 domains)", log=True),
    Finding("f", "split-then-merge uses fewer total FLOPs than joint GRPO to reach its accuracy (E7)", split_saving,
            ">", 0.0, "0.42 (42.0% fewer)"),
    Finding("g1", "OPD's accuracy needs the teacher: its control (OPD without the teacher) never attains it",
            control_attainment, "<", 0.0, "the control falls short (arXiv 2608.31046)"),
    Finding("g2", "OPD's gain needs the teacher: OPD reaches its accuracy with fewer FLOPs than its control (OPD "
            "without the teacher)", control_flops_ratio, ">", 1.0, "the control needs more (arXiv 2608.31046)", log=True),
)
BY_ID = {f.id: f for f in FINDINGS}


def findings(r: dict) -> list[dict]:
    """Each finding's checks, keyed by pair / domain, from one seed's numbers (`analyse`); verdicts come later."""
    return [{"id": f.id, "claim": f.claim, "paper": f.paper,
             "checks": {c.label: {"bounds": list(c.bounds), "op": f.op, "threshold": f.threshold,
                                  "detail": c.detail, "group": c.group or c.label, "censored": c.censored,
                                  "unmeasured": c.unmeasured}
                        for c in f.measure(r)}} for f in FINDINGS]


def point(bounds: Bounds | list | None) -> float | None:
    """The measured number of a check, None where only a bound is known."""
    return bounds[0] if bounds is not None and bounds[0] is not None and bounds[0] == bounds[1] else None


def judged(bounds: Bounds | list | None, op: str, threshold: float, interval: Bounds | list | None,
           defined: float = 1.0, unmeasured: str = "") -> dict:
    """A check's number against its rule, with its interval (its bounds when it has no resamples), the share of
    resamples where it is defined, and its verdict (stats.verdict; `unmeasured` instead where it is given)."""
    interval = list(interval) if interval is not None else None
    decides = interval if interval is not None else (list(bounds) if bounds is not None else None)
    return {"value": point(bounds), "bounds": list(bounds) if bounds is not None else None, "op": op,
            "threshold": threshold, "interval": interval, "defined": defined, "unmeasured": unmeasured,
            "verdict": unmeasured or verdict(decides, op, threshold, None, defined)}


def verdict_of(checks: Mapping[str, dict]) -> str:
    """A finding from its judged checks: each group's checks must agree (stats.agree), then one group not
    reproduced decides the finding, else one inconclusive leaves it inconclusive (stats.combine)."""
    groups: dict[str, list[str]] = {}
    for label, c in checks.items():
        groups.setdefault(c.get("group") or label, []).append(c["verdict"])
    return combine([agree(v) for v in groups.values()])


def judge(finding: dict, intervals: Mapping[str, list]) -> dict:
    """Every check of `finding` judged on its interval (label -> [lo, hi] or [lo, hi, defined share]; none: its
    bounds decide), then the finding (`verdict_of`)."""
    for label, check in finding["checks"].items():
        interval = intervals.get(label)
        check.update(judged(check["bounds"], check["op"], check["threshold"], interval and interval[:2],
                            interval[2] if interval and len(interval) > 2 else 1.0, check.get("unmeasured", "")))
    finding["verdict"] = verdict_of(finding["checks"])
    return finding
