"""The paper's findings as a table of rules: each claim, the number that measures it per pair (or domain, or
stage), and the threshold that number must pass; ``findings`` evaluates the table on one seed's numbers and
``judge`` gives each check its verdict from its bootstrap interval (``stats``: reproduced, not
reproduced, or inconclusive when the interval straddles the threshold).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from megaopd.analysis.stats import combine, verdict

MATCH_TOLERANCE = 0.05  # (d): a student "matches" its expert when at most this much below it (absolute accuracy)
SMALL_SHARE = 0.10  # (e): distillation is "a small share" of specialist FLOPs at or below this
FINDING_RULES = ("each finding is checked per pair (per domain for (d)) as a number against a threshold: (a) GRPO/OPD "
                 "FLOPs to GRPO's final accuracy < 1 (OPD never reaching it: 0); (b) OPD's last/first length ratio "
                 "minus GRPO's > 0; (c) GRPO/OPD FLOPs to the checkpoint's final accuracy > 1 (OPD never: 0); (d) "
                 "student - expert final accuracy >= -tolerance; (e) distillation / specialist FLOPs <= the "
                 "small-share bound; (f) 1 - split/joint FLOPs > 0 (the merge never reaching the target: -inf; not "
                 "measured if joint GRPO's first eval already reaches it); (g) teacher-free control/OPD FLOPs to "
                 "OPD's final accuracy > 1, per OPD stage and the control from its base on its data (the control "
                 "never reaching it: inf; not measured if OPD's first eval already reaches it). A finding needs all "
                 "its checks: one not reproduced decides it, else one inconclusive leaves it inconclusive.")

Check = tuple[str, float, str]  # (pair / domain label, the measured number, how it was measured)


@dataclass(frozen=True)
class Finding:
    """A claim of the paper, reproduced where `measure`'s value OP threshold holds for every pair it measures."""

    id: str
    claim: str
    measure: Callable[[dict], Iterator[Check]]  # one seed's numbers (`analyse`) -> a check per pair / domain
    op: str  # the direction: one of stats.OPS
    threshold: float


def reached(flops: float | None, best: float | None) -> str:
    """FLOPs to a target, or why there are none (a stage with no periodic mean eval has no best either)."""
    if flops is not None:
        return f"{flops:.3e}"
    return f"not reached (best smoothed {best:.3f})" if best is not None else "not reached (no periodic mean eval)"


def flops_ratio(grpo: float, opd: float | None) -> float:
    """GRPO/OPD FLOPs to GRPO's own final smoothed accuracy (which GRPO always reaches) as a number a rule can
    compare: 0 when OPD never reaches it, inf when OPD needs no FLOPs to (its first eval already does)."""
    if opd is None:
        return 0.0
    return math.inf if opd == 0 else grpo / opd


def _pairs(r: dict, self_teacher: bool) -> list[dict]:
    """The E1-E3 comparisons with a target: the self-GRPO teacher's (E3) or the external teachers' (E1/E2)."""
    return [c for c in r["comparisons"] if (c["method"] == "opd_self") == self_teacher and "teacher" in c["targets"]]


def _to_grpo_final(c: dict) -> Check:
    t = c["targets"]["teacher"]
    return (f"{c['opd']} vs {c['grpo']}", flops_ratio(t["grpo_flops"], t["opd_flops"]),
            f"FLOPs to {t['target']:.3f}: GRPO {t['grpo_flops']:.3e}, OPD "
            f"{reached(t['opd_flops'], t['opd_best_smoothed'])}; GRPO/OPD")


def external_flops_ratio(r: dict) -> Iterator[Check]:
    """(a) GRPO/OPD FLOPs to GRPO's final accuracy, per external-teacher pair."""
    yield from map(_to_grpo_final, _pairs(r, self_teacher=False))


def length_growth_difference(r: dict) -> Iterator[Check]:
    """(b) OPD's last/first response length minus GRPO's, per external-teacher pair where both have rollouts."""
    for c in _pairs(r, self_teacher=False):
        lo, lg = c["length"]["opd"], c["length"]["grpo"]
        if None in (lo["first"], lg["first"]):
            continue
        go, gg = lo["last"] / lo["first"], lg["last"] / lg["first"]
        yield (f"{c['opd']} vs {c['grpo']}", go - gg, f"OPD length x{go:.2f} ({lo['first']:.1f} -> {lo['last']:.1f})"
                                                      f" vs GRPO x{gg:.2f} ({lg['first']:.1f} -> {lg['last']:.1f}); "
                                                      "difference")


def self_flops_ratio(r: dict) -> Iterator[Check]:
    """(c) GRPO/OPD FLOPs to the checkpoint's final accuracy, per self-teacher pair; not where OPD's base already
    meets it (no FLOPs to compare)."""
    yield from (_to_grpo_final(c) for c in _pairs(r, self_teacher=True) if c["targets"]["teacher"]["opd_flops"] != 0)


def expert_gaps(r: dict) -> Iterator[Check]:
    """(d) student - expert final accuracy, per multi-teacher stage and expert domain."""
    for m in r["multi_teacher"]:
        for k, v in m["domains"].items():
            if v["gap"] is not None:
                yield (f"{m['stage']} {k}", v["gap"],
                       f"student {v['student_acc']:.3f} vs expert {v['expert']} {v['expert_acc']:.3f}; gap")


def distillation_share(r: dict) -> Iterator[Check]:
    """(e) distillation FLOPs / the specialists' FLOPs, per multi-teacher stage."""
    for m in r["multi_teacher"]:
        if m["share"] is not None:
            yield (m["stage"], m["share"], f"{m['distill_flops']:.3e} / {m['specialist_flops']:.3e} (experts' "
                   f"whole runs; to their own final accuracy {m['specialist_flops_to_final']:.3e}: share "
                   f"{m['share_experts_to_final']:.3g}); share")


def split_saving(r: dict) -> Iterator[Check]:
    """(f) 1 - split/joint FLOPs to joint GRPO's final accuracy, per joint GRPO stage; the merge never reaching it:
    -inf. Joint GRPO's first eval already at it (0 FLOPs to it): no saving to measure."""
    for s in r["split_vs_joint"]:
        if s["saving"] is None and s["split_flops"] is not None:
            continue
        split = reached(s["split_flops"], s["merge_best_smoothed"])
        to_final = s["saving_experts_to_final"]
        yield (f"{s['merge']} + experts vs {s['joint']}", -math.inf if s["saving"] is None else s["saving"],
               f"to {s['target']:.3f}: split {split} (experts' whole runs; to their own final accuracy: saving "
               f"{'-inf' if to_final is None else format(to_final, '.3g')}), joint "
               f"{reached(s['joint_flops_to_target'], s['joint_best_smoothed'])}; saving")


def control_flops_ratio(r: dict) -> Iterator[Check]:
    """(g) the teacher-free control's FLOPs over OPD's to OPD's final accuracy, per OPD stage and its control; not
    where OPD's first eval already meets it (no gain to explain)."""
    for c in r["teacher_free"]:
        t = c["targets"].get("teacher")
        if t is not None and t["ratio"] is not None:
            yield (f"{c['opd']} vs {c['control']}", t["ratio"],
                   f"FLOPs to {t['target']:.3f} (OPD's final, {c['domain']}): OPD {t['opd_flops']:.3e}, control "
                   f"{reached(t['control_flops'], t['control_best_smoothed'])}; control/OPD")


FINDINGS = (
    Finding("a", "external-teacher OPD loses to GRPO per FLOP (E1/E2)", external_flops_ratio, "<", 1.0),
    Finding("b", "external-teacher OPD inflates response length more than GRPO (last/first)",
            length_growth_difference, ">", 0.0),
    Finding("c", "self-GRPO-teacher OPD reaches the checkpoint's accuracy with fewer FLOPs than GRPO (E3)",
            self_flops_ratio, ">", 1.0),
    Finding("d", f"the multi-teacher student matches each expert (within {MATCH_TOLERANCE} absolute) (E6)",
            expert_gaps, ">=", -MATCH_TOLERANCE),
    Finding("e", "distillation is a small share of the specialists' FLOPs (E6)", distillation_share, "<=",
            SMALL_SHARE),
    Finding("f", "split-then-merge uses fewer total FLOPs than joint GRPO to reach its accuracy (E7)", split_saving,
            ">", 0.0),
    Finding("g", "OPD's gain needs the teacher: OPD reaches its accuracy with fewer FLOPs than its teacher-free "
            "control", control_flops_ratio, ">", 1.0),
)


def findings(r: dict) -> list[dict]:
    """Each finding's checks, keyed by pair / domain, from one seed's numbers (`analyse`); verdicts come later."""
    return [{"id": f.id, "claim": f.claim,
             "checks": {label: {"value": value, "op": f.op, "threshold": f.threshold, "detail": detail}
                        for label, value, detail in f.measure(r)}} for f in FINDINGS]


def judged(value: float | None, op: str, threshold: float, interval: list[float] | None,
           defined: float = 1.0) -> dict:
    """A check's number against its rule, with its interval, the share of resamples where the number is defined,
    and its verdict (three-way with an interval, else the point decides; stats.verdict)."""
    return {"value": value, "op": op, "threshold": threshold, "interval": interval, "defined": defined,
            "verdict": verdict(interval, op, threshold, value, defined)}


def judge(finding: dict, intervals: Mapping[str, list[float]]) -> dict:
    """Every check of `finding` judged on its interval (label -> [lo, hi] or [lo, hi, defined share]; none: the
    point decides), then the finding: one check not reproduced decides it, else one inconclusive leaves it
    inconclusive."""
    for label, check in finding["checks"].items():
        interval = intervals.get(label)
        check.update(judged(check["value"], check["op"], check["threshold"], interval and interval[:2],
                            interval[2] if interval and len(interval) > 2 else 1.0))
    finding["verdict"] = combine([c["verdict"] for c in finding["checks"].values()])
    return finding
