"""From measured curves to the paper's numbers for one study directory (one seed): FLOPs-to-target on smoothed
accuracy curves, the E1-E3 OPD vs GRPO comparisons, E6 (multi-teacher student vs experts), E7 (split-then-merge
vs joint GRPO), each OPD stage against its teacher-free control, the FLOPs ledger per stage, and the headline ratios
(``analyse``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megaopd.analysis.controls import control_pairs
from megaopd.analysis.findings import findings
from megaopd.analysis.runs import Stage
from megaopd.accounting.flops import COMPONENTS

TOTALS = ("stage", "with_teachers", "with_cold_start", "external")
OPD_VS_GRPO = ("opd_external", "opd_external_grpo", "opd_self")
OPD_METHODS = OPD_VS_GRPO + ("multi_teacher_opd",)  # the stages a teacher-free control controls
TARGET_RULE = ("FLOPs-to-target: smooth the accuracy with a trailing moving average over `window` evals (fewer at "
               "the start), find the first eval whose smoothed accuracy >= target, and interpolate linearly in "
               "FLOPs between it and the previous eval (on the smoothed accuracy); the first eval itself if it "
               "already reaches the target; not reached if no eval does.")
SPLIT_RULE = ("data: every study dataset is split three ways (train / validation / test, fixed by seed); stop rules, "
              "budgets to cover, learning-rate choices and any selection read the validation split (valid/ metrics), "
              "and this report's curves, targets and verdicts read the test split alone (eval/ and final/ metrics, "
              "per-prompt results in evals/).")
LENGTH_WINDOW = 10  # training steps averaged at each end for the response length
LENGTH_RULE = "mean rollout/response_length of the first (last) `length_window` training steps"
WALL_RULE = ("wall-clock: s / step is the mean of perf/step_seconds over the stage's training steps (rollouts to "
             "update, evals and checkpoints left out), train s their sum, and rollout wait the trainer's time blocked "
             "on rollouts (perf/rollout_wait_seconds) over that sum; K is rollout.max_staleness (0: synchronous); "
             "- where the run did not log them (SFT steps, runs before they were logged)")


def smooth(values: list[float], window: int = 3) -> list[float]:
    """Trailing moving average; the first evals average over the fewer values there are. (Summed in order, in
    Python: np.mean's overhead on a few numbers dominated the bootstrap's time.)"""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1):i + 1]
        total = 0.0
        for v in part:
            total += v
        out.append(total / len(part))
    return out


def flops_to_target(flops: list[float], accuracy: list[float], target: float, window: int = 3) -> float | None:
    """FLOPs at which the smoothed accuracy first reaches `target` (TARGET_RULE); None when it never does."""
    s = smooth(accuracy, window)
    for i, value in enumerate(s):
        if value >= target:
            if i == 0:
                return float(flops[0])
            # s[i-1] < target <= s[i], so the slope is positive.
            return float(flops[i - 1] + (target - s[i - 1]) / (s[i] - s[i - 1]) * (flops[i] - flops[i - 1]))
    return None


def accuracy_at(flops: list[float], accuracy: list[float], at: float, window: int = 3) -> float | None:
    """Smoothed accuracy interpolated at `at` FLOPs (None outside the curve): for accuracy at matched FLOPs."""
    if not flops or at < flops[0] or at > flops[-1]:
        return None
    return float(np.interp(at, flops, smooth(accuracy, window)))


def split_vs_joint(expert_flops: list[float], merge_flops: list[float], merge_acc: list[float],
                   joint_flops: list[float], joint_acc: list[float], target: float, window: int = 3,
                   expert_flops_to_final: list[float] | None = None) -> dict:
    """E7: experts + the multi-teacher OPD FLOPs to reach `target` vs joint GRPO's FLOPs to reach it; with
    `expert_flops_to_final`, also with each expert counted only up to its own final accuracy."""
    merge = flops_to_target(merge_flops, merge_acc, target, window)
    joint = flops_to_target(joint_flops, joint_acc, target, window)
    out = {"target": target, "merge_flops_to_target": merge,
           "merge_flops_more_than": merge_flops[-1] if merge is None and merge_flops else None,
           "merge_best_smoothed": max(smooth(merge_acc, window), default=None), "joint_flops_to_target": joint,
           "joint_best_smoothed": max(smooth(joint_acc, window), default=None)}
    ways = {"": expert_flops} | ({"_experts_to_final": expert_flops_to_final}
                                         if expert_flops_to_final is not None else {})
    for suffix, experts in ways.items():
        total = float(sum(experts)) if None not in experts else None  # an expert without a curve on its domain
        split = total + merge if merge is not None and total is not None else None
        out |= {f"experts_flops{suffix}": total, f"split_flops{suffix}": split,
                f"saving{suffix}": 1 - split / joint if split is not None and joint else None}
    return out


def flops_to_own_final(stage: Stage, metric: str, window: int = 3) -> float | None:
    """An expert's FLOPs to its own final smoothed accuracy on its domain (what it needed; its whole run may go on
    past it); its whole run when it has no curve there."""
    f, a = stage.curve(stage.domain, metric, "stage")
    return flops_to_target(f, a, smooth(a, window)[-1], window) if a else stage.total("stage")


def compare_stages(stage: Stage, ref: Stage, metric: str, fraction: float, window: int, x: str,
                   length_window: int = LENGTH_WINDOW, roles: tuple[str, str] = ("opd", "grpo"),
                   domain: str = "") -> dict:
    """FLOPs each of two stages needs to reach the reference stage's final accuracy (and base + a fraction of its
    gain), their ratio reference / stage (> 1: the stage needs fewer; None where a stage never reached it: its
    FLOPs are then only bounded, `{role}_flops_more_than`), accuracy at matched FLOPs and response lengths; keys
    name the stages by `roles` (stage, reference): E1-E3's ("opd", "grpo"), ("stage", "reference") for two settings
    of one method (`compare_same_method`), or ("control", "opd") (`compare_control`).

    On `domain` when given, else the reference's own domain when it is an expert (the paper's E3 is math on math),
    else the mean; the target is the last point of the reference's smoothed curve, so that both curves and the
    target come from the same held-out prompts (and the reference always reaches it: its FLOPs to it are never None).
    """
    s, r = roles
    domain = domain or ref.domain or "mean"
    fo, ao = stage.curve(domain, metric, x)
    fg, ag = ref.curve(domain, metric, x)
    teacher = smooth(ag, window)[-1] if ag else None
    base = ag[0] if ag else None  # the reference's step-0 eval: the accuracy both stages start from
    out = {s: stage.name, r: ref.name, "role": stage.role, "domain": domain, "base": base,
           "teacher": teacher, "teacher_cost_ratio": max(stage.teacher_cost.values(), default=None), "targets": {},
           "stopped": {s: stage.stopped, r: ref.stopped}}
    if stage.teacher_check:  # an external teacher's (megaopd/teachers/check.py): a target above it is not measured
        out["teacher_check"] = {"accuracy": stage.teacher_accuracy(domain),
                                "below_student": bool(stage.teacher_check.get("allowed_weaker"))}
    if not ao or not ag:
        return out
    for name, target in (("teacher", teacher), ("fraction", base + fraction * (teacher - base))):
        g, o = flops_to_target(fg, ag, target, window), flops_to_target(fo, ao, target, window)
        out["targets"][name] = {"target": target, f"{r}_flops": g, f"{s}_flops": o,
                                # censored: more FLOPs than its last eval's were needed, how many more is unknown
                                f"{r}_flops_more_than": fg[-1] if g is None else None,
                                f"{s}_flops_more_than": fo[-1] if o is None else None,
                                f"{r}_best_smoothed": max(smooth(ag, window)),
                                f"{s}_best_smoothed": max(smooth(ao, window)),
                                "ratio": g / o if g is not None and o else None}
    at = min(fg[-1], fo[-1])
    out["matched"] = {"flops": at, f"{r}_acc": accuracy_at(fg, ag, at, window),
                      f"{s}_acc": accuracy_at(fo, ao, at, window)}
    out["length"] = {k: {**dict(zip(("first", "last"), v.length_first_last(length_window))),
                         "truncated": v.truncated_last(length_window)} for k, v in ((s, stage), (r, ref))}
    # The base model's length under the same token cap and sampling: both stages' first rollouts come from it.
    starts = [v for v in (stage.first_step_length(), ref.first_step_length()) if v is not None]
    out["length"]["base"] = float(np.mean(starts)) if len(starts) == 2 else None
    return out


def compare_same_method(stage: Stage, ref: Stage, metric: str, fraction: float, window: int, x: str,
                        length_window: int = LENGTH_WINDOW) -> dict:
    """A stage against the one in its `compare_with` when the pair is not OPD vs GRPO (the same expert at another
    rollout.max_staleness, say): `compare_stages`' numbers, each stage's K, the matched-FLOPs accuracy gap
    stage - reference, and both final accuracies on the compared domain (all held-out prompts)."""
    out = compare_stages(stage, ref, metric, fraction, window, x, length_window, roles=("stage", "reference"))
    out["max_staleness"] = {"stage": stage.max_staleness, "reference": ref.max_staleness}
    out["final"] = {k: v.final_acc(out["domain"], metric) for k, v in (("stage", stage), ("reference", ref))}
    m = out.get("matched")
    if m is not None:
        m["gap"] = m["stage_acc"] - m["reference_acc"] if None not in (m["stage_acc"], m["reference_acc"]) else None
    return out


def controlled(stages: list[Stage]) -> list[tuple[Stage, Stage]]:
    """(control, OPD stage) for every OPD stage that starts from the control's model and trains on its
    data (as their config.yaml say): what the control takes away from that stage is its teacher."""
    return [(c, s) for c in stages if c.role == "control" and c.trains_on for s in stages
            if s.role in OPD_METHODS and (s.starts_from, s.trains_on) == (c.starts_from, c.trains_on)]


def compare_control(control: Stage, opd: Stage, metric: str, fraction: float, window: int, x: str,
                    length_window: int = LENGTH_WINDOW, pairing: dict | None = None) -> dict:
    """(g): the FLOPs an OPD stage and its teacher-free control need to reach OPD's final accuracy (and base + a
    fraction of OPD's gain), on the control's domain (else the mean), with `compare_stages`' other numbers; here
    each target's ratio is control / OPD (> 1: OPD needs fewer; None where the control never gets there, its FLOPs
    only bounded, or where OPD's own first eval already meets the target: no gain to compare). `pairing`: why the
    two are compared, and whether the verdict reads them (`controls.control_pairs`)."""
    out = compare_stages(control, opd, metric, fraction, window, x, length_window, ("control", "opd"), control.domain)
    out["pairing"] = pairing or {}
    for t in out["targets"].values():
        control_flops, opd_flops = t["control_flops"], t["opd_flops"]
        t["ratio"] = control_flops / opd_flops if control_flops is not None and opd_flops else None
    return out


def multi_teacher(mt: Stage, experts: list[Stage], metric: str, window: int = 3) -> dict:
    """E6: per-domain student vs expert final accuracy; distillation FLOPs over the experts' stage FLOPs (their
    whole runs, and each only up to its own final accuracy)."""
    own = [e for e in experts if mt.final_acc(e.domain, metric) is not None]
    domains = {e.domain: {"expert": e.name, "expert_acc": e.final_acc(e.domain, metric),
                          "student_acc": mt.final_acc(e.domain, metric)} for e in own}
    for d in domains.values():
        d["gap"] = d["student_acc"] - d["expert_acc"] if d["expert_acc"] is not None else None
    specialist = sum(e.total("stage") for e in own)
    each_to_final = [flops_to_own_final(e, metric, window) for e in own]
    to_final = sum(each_to_final) if None not in each_to_final else None
    distill = mt.total("stage")
    return {"stage": mt.name, "domains": domains, "distill_flops": distill, "specialist_flops": specialist,
            "share": distill / specialist if specialist else None, "specialist_flops_to_final": to_final,
            "share_experts_to_final": distill / to_final if to_final else None, "teacher_cost_ratio": mt.teacher_cost}


def analyse(study_dir: str | Path, study: dict, stages: list[Stage], metric: str = "greedy",
            target_fraction: float = 0.9, window: int = 3, x: str = "stage",
            length_window: int = LENGTH_WINDOW) -> dict:
    """Every number of one study directory (one seed), from `load_study`'s study.yaml and stages."""
    by_name = {s.name: s for s in stages}
    pairs = [(s, by_name[s.compare_with]) for s in stages if s.compare_with in by_name]
    # An OPD stage against a stage of another method is OPD vs GRPO; against another OPD stage (the same distillation
    # at another rollout.max_staleness, say) it is one method at another setting, which no finding reads.
    opd_vs_grpo = [(s, ref) for s, ref in pairs if s.role in OPD_VS_GRPO and ref.role not in OPD_METHODS]
    comparisons = [compare_stages(s, ref, metric, target_fraction, window, x, length_window) for s, ref in opd_vs_grpo]
    same_method = [compare_same_method(s, ref, metric, target_fraction, window, x, length_window)
                   for s, ref in pairs if (s, ref) not in opd_vs_grpo]
    controls = [compare_control(c, opd, metric, target_fraction, window, x, length_window, pairing)
                for c, opd, pairing in control_pairs(controlled(stages))]
    experts = [s for s in stages if s.role == "expert" and s.domain]
    mts = [multi_teacher(s, experts, metric, window) for s in stages if s.role == "multi_teacher_opd"]
    splits = []
    for joint in (s for s in stages if s.role == "joint_grpo"):
        # The multi-teacher stage over the same domains as joint GRPO (the 2-domain mix), else the first one.
        mt = next((m for m in mts if sorted(m["domains"]) == joint.domains(metric)), mts[0] if mts else None)
        joint_f, joint_a = joint.curve("mean", metric, "stage")
        if mt is None or not joint_a:
            continue
        merge_f, merge_a = by_name[mt["stage"]].curve("mean", metric, "stage")
        target = smooth(joint_a, window)[-1]  # joint GRPO's final accuracy, on the same prompts as the curves
        mt_experts = [by_name[d["expert"]] for d in mt["domains"].values()]
        splits.append({"joint": joint.name, "merge": mt["stage"], "experts": [e.name for e in mt_experts],
                       "stopped": by_name[mt["stage"]].stopped,
                       **split_vs_joint([e.total("stage") for e in mt_experts], merge_f, merge_a, joint_f, joint_a,
                                        target, window, [flops_to_own_final(e, metric, window) for e in mt_experts])})
    table = {s.name: {"role": s.role, "algorithm": s.algorithm, "form": s.form, "steps": s.lines[-1]["step"],
                      "stop": s.stop,
                      "final_mean_acc": s.final_acc("mean", metric),
                      "totals": {k: s.total(k) for k in TOTALS},
                      "components": {c: s.lines[-1].get(f"flops/{c}") for c in COMPONENTS},
                      "length": dict(zip(("first", "last"), s.length_first_last(length_window))),
                      "max_staleness": s.max_staleness, "wall_clock": s.wall_clock()} for s in stages}
    result = {"study_dir": str(study_dir), "seed": study.get("seed"), "stages": table, "comparisons": comparisons,
              "stage_comparisons": same_method, "multi_teacher": mts, "split_vs_joint": splits,
              "controls": [c for c in controls if not c["pairing"]["set_aside"]],
              "controls_set_aside": [c for c in controls if c["pairing"]["set_aside"]],
              "teacher_checks": {s.name: s.teacher_check for s in stages if s.teacher_check}}
    result["findings"] = findings(result)
    result["headline"] = headline(result)
    return result


def wall_clock_across(seeds: list[dict]) -> dict:
    """Each stage's wall-clock (WALL_RULE) over the seeds that timed it: mean, min, max and n per number, and the
    K of each seed."""
    out = {}
    for name in dict.fromkeys(n for r in seeds for n in r["stages"]):
        stages = [r["stages"][name] for r in seeds if name in r["stages"]]
        out[name] = {"max_staleness": sorted({s["max_staleness"] for s in stages}, key=str)}
        for key in ("step_seconds", "train_seconds", "rollout_wait_share"):
            values = [s["wall_clock"][key] for s in stages if s["wall_clock"][key] is not None]
            out[name][key] = ({"mean": float(np.mean(values)), "min": min(values), "max": max(values),
                               "n": len(values)} if values else None)
    return out


# Headline numbers that are ratios of FLOPs: pooled over seeds as a geometric mean, as the findings pool them.
FLOPS_RATIO, DISTILLATION_SHARE = "FLOPs ratio", "distillation share of specialist FLOPs"


def pooled_geometrically(name: str) -> bool:
    return name.startswith((FLOPS_RATIO, DISTILLATION_SHARE))


def headline(r: dict) -> dict[str, float]:
    """The ratios worth a mean and a spread across seeds, by name."""
    out = {}
    for c in r["comparisons"]:
        for t, v in c["targets"].items():
            if v["ratio"] is not None:
                out[f"{FLOPS_RATIO} GRPO/OPD, {c['opd']} vs {c['grpo']} ({t} target)"] = v["ratio"]
    for c in r["stage_comparisons"]:
        for t, v in c["targets"].items():
            if v["ratio"] is not None:
                out[f"{FLOPS_RATIO} {c['reference']}/{c['stage']} ({t} target)"] = v["ratio"]
        if c.get("matched", {}).get("gap") is not None:
            out[f"accuracy at matched FLOPs, {c['stage']} - {c['reference']}"] = c["matched"]["gap"]
        if None not in c["final"].values():
            out[f"final accuracy, {c['stage']} - {c['reference']}"] = c["final"]["stage"] - c["final"]["reference"]
    for m in r["multi_teacher"]:
        if m["share"] is not None:
            out[f"{DISTILLATION_SHARE}, {m['stage']}"] = m["share"]
    for s in r["split_vs_joint"]:
        if s["saving"] is not None:
            out[f"split-then-merge saving vs {s['joint']}"] = s["saving"]
    return out


def curve_points(stages: list[Stage], metric: str, x: str) -> dict:
    """Every curve point with its standard error: stage -> domain -> [[FLOPs, accuracy, se or None], ...]."""
    return {s.name: {d: [list(p) for p in zip(*s.curve(d, metric, x), s.curve_se(d, metric))]
                     for d in ["mean"] + s.domains(metric)} for s in stages}
