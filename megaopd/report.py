"""The study report: held-out accuracy against training FLOPs, the paper's ratios, and whether each finding reproduces.

    megaopd report runs/study [runs/study_seed1 ...] [--out DIR] [--target-fraction 0.9] [--metric greedy|sampled]

Reads a study directory (``study.yaml`` plus one run directory per stage, see ``megaopd/study.py``) and writes
``report.md``, ``report.json`` (every number of the markdown) and PNG plots into ``<first study>/report/``. Several
study directories of the same layout are read as seeds: each is analysed alone, then each headline number is shown
as mean and min-max across them. Every comparison is computed from the measured curves; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from megaopd.metrics import read_metrics  # noqa: E402

COMPONENTS = ("rollout", "old_logprob", "reference", "teacher", "train")
TOTALS = ("stage", "with_teachers", "with_cold_start", "external")
OPD_VS_GRPO = ("opd_external", "opd_external_grpo", "opd_self")
MATCH_TOLERANCE = 0.05  # (d): a student "matches" its expert when at most this much below it (absolute accuracy)
SMALL_SHARE = 0.10  # (e): distillation is "a small share" of specialist FLOPs at or below this
TARGET_RULE = ("FLOPs-to-target: smooth the accuracy with a trailing moving average over `window` evals (fewer at "
               "the start), find the first eval whose smoothed accuracy >= target, and interpolate linearly in "
               "FLOPs between it and the previous eval (on the smoothed accuracy); the first eval itself if it "
               "already reaches the target; not reached if no eval does.")
FINDING_RULES = ("(a) per pair, against GRPO's final accuracy: GRPO reaches it with fewer FLOPs, or OPD never does "
                 "(if neither does: GRPO's smoothed accuracy is higher at the smaller of the two final FLOPs); "
                 "(b) OPD's last/first length ratio exceeds GRPO's; (c) OPD reaches GRPO's final accuracy and "
                 "GRPO/OPD > 1 (or GRPO never does); (d) every domain's student >= expert - tolerance; (e) share <= "
                 "the small-share bound; (f) saving > 0, not reproduced if the merge never reaches the target, not "
                 "measured if joint GRPO's own curve never does. A finding with several pairs needs all of them.")
TARGET_STYLES = (":", "-.", "--")
LENGTH_RULE = "mean rollout/response_length of the first (last) `window` training steps"


def smooth(values: list[float], window: int = 3) -> list[float]:
    """Trailing moving average; the first evals average over the fewer values there are."""
    return [float(np.mean(values[max(0, i - window + 1):i + 1])) for i in range(len(values))]


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
                   joint_flops: list[float], joint_acc: list[float], target: float, window: int = 3) -> dict:
    """E7: experts + the multi-teacher OPD FLOPs to reach `target` vs joint GRPO's FLOPs to reach it."""
    merge = flops_to_target(merge_flops, merge_acc, target, window)
    joint = flops_to_target(joint_flops, joint_acc, target, window)
    experts = float(sum(expert_flops))
    split = experts + merge if merge is not None else None
    saving = 1 - split / joint if split is not None and joint else None
    return {"target": target, "experts_flops": experts, "merge_flops_to_target": merge,
            "merge_best_smoothed": max(smooth(merge_acc, window), default=None), "split_flops": split,
            "joint_flops_to_target": joint, "joint_best_smoothed": max(smooth(joint_acc, window), default=None),
            "saving": saving}


@dataclass
class Stage:
    """One stage's run directory as the report needs it."""

    name: str
    method: str
    compare_with: str = ""
    domain: str = ""
    algorithm: str = ""
    lines: list[dict] = field(default_factory=list)
    form: str = ""  # the objective as objectives.form_label names it, e.g. opd:topk(K=16,reverse)

    @property
    def final(self) -> dict:
        return next((m for m in reversed(self.lines) if any(k.startswith("final/") for k in m)), {})

    def final_acc(self, domain: str, metric: str) -> float | None:
        return self.final.get(f"final/{domain}/accuracy_{metric}")

    def total(self, kind: str = "stage") -> float | None:
        return self.lines[-1].get(f"flops/total_{kind}") if self.lines else None

    def curve(self, domain: str, metric: str, x: str = "stage") -> tuple[list[float], list[float]]:
        """The periodic evals (a fixed held-out subset): the final eval, on all prompts, is not on the curve."""
        key = f"eval/{domain}/accuracy_{metric}"
        pts = [(m[f"flops/total_{x}"], m[key]) for m in self.lines if key in m]
        return [p[0] for p in pts], [p[1] for p in pts]

    def domains(self, metric: str) -> list[str]:
        keys = {k for m in self.lines for k in m if k.startswith(("eval/", "final/")) and k.endswith(metric)}
        return sorted({k.split("/")[1] for k in keys} - {"mean"})

    def lengths(self) -> tuple[list[int], list[float], list[float]]:
        pts = [(m["step"], m["flops/total_stage"], m["rollout/response_length"]) for m in self.lines
               if "rollout/response_length" in m]
        return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]

    def length_first_last(self, window: int) -> tuple[float | None, float | None]:
        lengths = self.lengths()[2]
        if not lengths:
            return None, None
        return float(np.mean(lengths[:window])), float(np.mean(lengths[-window:]))


def load_study(study_dir: str | Path) -> tuple[dict, list[Stage]]:
    """study.yaml and every stage that has a run directory; a stage without `method` counts as `other`."""
    study_dir = Path(study_dir)
    study = yaml.safe_load((study_dir / "study.yaml").read_text()) or {}
    stages = []
    for s in study.get("stages") or []:
        run_dir = study_dir / s["name"]
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        stages.append(Stage(s["name"], s.get("method") or "other", s.get("compare_with") or "", s.get("domain") or "",
                            summary.get("algorithm", ""), read_metrics(run_dir), summary.get("form", "")))
    return study, [s for s in stages if s.lines]


def _reached(flops: float | None, best: float | None) -> str:
    return f"{flops:.3e}" if flops is not None else f"not reached (best smoothed {best:.3f})"


def compare_opd_grpo(opd: Stage, grpo: Stage, metric: str, fraction: float, window: int, x: str) -> dict:
    """E1-E3: FLOPs each stage needs to reach the GRPO stage's final accuracy (and a fraction of its gain).

    On the GRPO stage's own domain when it is an expert (the paper's E3 is math on math), else the mean; the
    target is the last point of GRPO's smoothed curve, so that both curves and the target come from the same
    held-out prompts.
    """
    domain = grpo.domain or "mean"
    fo, ao = opd.curve(domain, metric, x)
    fg, ag = grpo.curve(domain, metric, x)
    teacher = smooth(ag, window)[-1] if ag else None
    base = ag[0] if ag else None  # GRPO's step-0 eval: the accuracy both stages start from
    out = {"opd": opd.name, "grpo": grpo.name, "method": opd.method, "domain": domain, "base": base,
           "teacher": teacher, "targets": {}}
    if teacher is None or not ao or not ag:
        return out
    for name, target in (("teacher", teacher), ("fraction", base + fraction * (teacher - base))):
        g, o = flops_to_target(fg, ag, target, window), flops_to_target(fo, ao, target, window)
        out["targets"][name] = {"target": target, "grpo_flops": g, "opd_flops": o,
                                "grpo_best_smoothed": max(smooth(ag, window)),
                                "opd_best_smoothed": max(smooth(ao, window)),
                                "ratio": g / o if g is not None and o else None}
    at = min(fg[-1], fo[-1])
    out["matched"] = {"flops": at, "grpo_acc": accuracy_at(fg, ag, at, window),
                      "opd_acc": accuracy_at(fo, ao, at, window)}
    out["length"] = {k: dict(zip(("first", "last"), s.length_first_last(window))) for k, s in (("opd", opd),
                                                                                              ("grpo", grpo))}
    return out


def multi_teacher(mt: Stage, experts: list[Stage], metric: str) -> dict:
    """E6: per-domain student vs expert final accuracy; distillation FLOPs over the experts' stage FLOPs."""
    own = [e for e in experts if mt.final_acc(e.domain, metric) is not None]
    domains = {e.domain: {"expert": e.name, "expert_acc": e.final_acc(e.domain, metric),
                          "student_acc": mt.final_acc(e.domain, metric)} for e in own}
    for d in domains.values():
        d["gap"] = d["student_acc"] - d["expert_acc"] if d["expert_acc"] is not None else None
    specialist = sum(e.total("stage") for e in own)
    return {"stage": mt.name, "domains": domains, "distill_flops": mt.total("stage"), "specialist_flops": specialist,
            "share": mt.total("stage") / specialist if specialist else None}


def analyse(study_dir: str | Path, study: dict, stages: list[Stage], metric: str = "greedy",
            target_fraction: float = 0.9, window: int = 3, x: str = "stage") -> dict:
    """Every number of one study directory (one seed), from `load_study`'s study.yaml and stages."""
    by_name = {s.name: s for s in stages}
    comparisons = [compare_opd_grpo(s, by_name[s.compare_with], metric, target_fraction, window, x)
                   for s in stages if s.method in OPD_VS_GRPO and s.compare_with in by_name]
    experts = [s for s in stages if s.method == "expert" and s.domain]
    mts = [multi_teacher(s, experts, metric) for s in stages if s.method == "multi_teacher_opd"]
    splits = []
    for joint in (s for s in stages if s.method == "joint_grpo"):
        # The multi-teacher stage over the same domains as joint GRPO (the 2-domain mix), else the first one.
        mt = next((m for m in mts if sorted(m["domains"]) == joint.domains(metric)), mts[0] if mts else None)
        merge_f, merge_a = by_name[mt["stage"]].curve("mean", metric, "stage") if mt else ([], [])
        joint_f, joint_a = joint.curve("mean", metric, "stage")
        if mt is None or not joint_a:
            continue
        target = smooth(joint_a, window)[-1]  # joint GRPO's final accuracy, on the same prompts as the curves
        expert_flops = [by_name[d["expert"]].total("stage") for d in mt["domains"].values()]
        splits.append({"joint": joint.name, "merge": mt["stage"],
                       "experts": [d["expert"] for d in mt["domains"].values()],
                       **split_vs_joint(expert_flops, merge_f, merge_a, joint_f, joint_a, target, window)})
    table = {s.name: {"method": s.method, "algorithm": s.algorithm, "form": s.form, "steps": s.lines[-1]["step"],
                      "final_mean_acc": s.final_acc("mean", metric),
                      "totals": {k: s.total(k) for k in TOTALS},
                      "components": {c: s.lines[-1].get(f"flops/{c}") for c in COMPONENTS},
                      "length": dict(zip(("first", "last"), s.length_first_last(window)))} for s in stages}
    result = {"study_dir": str(study_dir), "seed": study.get("seed"), "stages": table, "comparisons": comparisons,
              "multi_teacher": mts, "split_vs_joint": splits}
    result["findings"] = findings(result)
    result["headline"] = headline(result)
    return result


def _verdict(claims: list[tuple[bool | None, str]]) -> tuple[str, str]:
    """All measured claims must hold; a claim is None when its comparison is undefined (a target not reached)."""
    measured = [ok for ok, _ in claims if ok is not None]
    detail = "; ".join(d for _, d in claims) or "the needed stages are absent"
    if not measured:
        return "not measured in this study", detail
    return ("reproduced" if all(measured) else "not reproduced"), detail


def findings(r: dict) -> list[dict]:
    """One verdict per finding of the paper, each computed from this seed's numbers."""
    ext = [c for c in r["comparisons"] if c["method"] != "opd_self" and "teacher" in c["targets"]]
    own = [c for c in r["comparisons"] if c["method"] == "opd_self" and "teacher" in c["targets"]]
    a, b, c_ = [], [], []
    for c in ext:
        t, m = c["targets"]["teacher"], c["matched"]
        if t["grpo_flops"] is not None or t["opd_flops"] is not None:
            # Fewer GRPO FLOPs to the target (or OPD never reaching it) means OPD loses per FLOP.
            loses = t["opd_flops"] is None or (t["grpo_flops"] is not None and t["grpo_flops"] < t["opd_flops"])
            a.append((loses, f"{c['opd']} vs {c['grpo']}: FLOPs to {t['target']:.3f}: GRPO "
                             f"{_reached(t['grpo_flops'], t['grpo_best_smoothed'])}, OPD "
                             f"{_reached(t['opd_flops'], t['opd_best_smoothed'])}"))
        elif m["grpo_acc"] is not None and m["opd_acc"] is not None:  # neither reached: accuracy at matched FLOPs
            a.append((m["grpo_acc"] > m["opd_acc"], f"{c['opd']} vs {c['grpo']}: at {m['flops']:.3e} FLOPs GRPO "
                                                    f"{m['grpo_acc']:.3f}, OPD {m['opd_acc']:.3f}"))
        lo, lg = c["length"]["opd"], c["length"]["grpo"]
        if None not in (lo["first"], lg["first"]):
            go, gg = lo["last"] / lo["first"], lg["last"] / lg["first"]
            b.append((go > gg, f"{c['opd']} length x{go:.2f} ({lo['first']:.1f} -> {lo['last']:.1f}) vs "
                               f"{c['grpo']} x{gg:.2f} ({lg['first']:.1f} -> {lg['last']:.1f})"))
    for c in own:
        t = c["targets"]["teacher"]
        if t["opd_flops"] == 0:  # the base already meets the teacher's accuracy: nothing to compare
            continue
        ok = t["opd_flops"] is not None and (t["grpo_flops"] is None or t["ratio"] > 1)
        ratio = f"ratio GRPO/OPD {t['ratio']:.2f}" if t["ratio"] is not None else "no ratio"
        c_.append((ok, f"{c['opd']} vs {c['grpo']}: FLOPs to {t['target']:.3f}: GRPO "
                       f"{_reached(t['grpo_flops'], t['grpo_best_smoothed'])}, OPD "
                       f"{_reached(t['opd_flops'], t['opd_best_smoothed'])}, {ratio}"))
    d = [(all(v["gap"] is not None and v["gap"] >= -MATCH_TOLERANCE for v in m["domains"].values()),
          f"{m['stage']}: " + ", ".join(f"{k} student {v['student_acc']:.3f} vs expert {v['expert_acc']:.3f}"
                                        for k, v in m["domains"].items()))
         for m in r["multi_teacher"] if m["domains"]]
    e = [(m["share"] <= SMALL_SHARE, f"{m['stage']}: {m['distill_flops']:.3e} / {m['specialist_flops']:.3e} = "
                                     f"{100 * m['share']:.1f}% (small: <= {100 * SMALL_SHARE:.0f}%)")
         for m in r["multi_teacher"] if m["share"] is not None]
    # Merge never reaching the target contradicts (f); joint GRPO never reaching its own final leaves it undefined.
    f = [(None if s["split_flops"] is not None and s["saving"] is None else s["saving"] is not None and s["saving"] > 0,
          f"{s['merge']} + experts vs {s['joint']} to {s['target']:.3f}: split "
          + (f"{s['split_flops']:.3e}" if s["split_flops"] is not None
             else f"not reached (merge best smoothed {s['merge_best_smoothed']:.3f})")
          + f", joint {_reached(s['joint_flops_to_target'], s['joint_best_smoothed'])}"
          + (f", saving {100 * s['saving']:.1f}%" if s["saving"] is not None else ""))
         for s in r["split_vs_joint"]]
    claims = {
        "a": ("external-teacher OPD loses to GRPO per FLOP (E1/E2)", a),
        "b": ("external-teacher OPD inflates response length more than GRPO (last/first)", b),
        "c": ("self-GRPO-teacher OPD reaches the checkpoint's accuracy with fewer FLOPs than GRPO (E3)", c_),
        "d": (f"the multi-teacher student matches each expert (within {MATCH_TOLERANCE} absolute) (E6)", d),
        "e": ("distillation is a small share of the specialists' FLOPs (E6)", e),
        "f": ("split-then-merge uses fewer total FLOPs than joint GRPO to reach its accuracy (E7)", f),
    }
    return [{"id": k, "claim": claim, **dict(zip(("verdict", "detail"), _verdict(cl)))}
            for k, (claim, cl) in claims.items()]


def headline(r: dict) -> dict[str, float]:
    """The ratios worth a mean and a spread across seeds, by name."""
    out = {}
    for c in r["comparisons"]:
        for t, v in c["targets"].items():
            if v["ratio"] is not None:
                out[f"FLOPs ratio GRPO/OPD, {c['opd']} vs {c['grpo']} ({t} target)"] = v["ratio"]
    for m in r["multi_teacher"]:
        if m["share"] is not None:
            out[f"distillation share of specialist FLOPs, {m['stage']}"] = m["share"]
    for s in r["split_vs_joint"]:
        if s["saving"] is not None:
            out[f"split-then-merge saving vs {s['joint']}"] = s["saving"]
    return out


def aggregate(seeds: list[dict]) -> tuple[dict, list[dict]]:
    names = sorted({k for s in seeds for k in s["headline"]})
    spread = {}
    for name in names:
        values = [s["headline"][name] for s in seeds if name in s["headline"]]
        spread[name] = {"mean": float(np.mean(values)), "min": min(values), "max": max(values), "n": len(values)}
    overall = []
    for i, f in enumerate(seeds[0]["findings"]):
        verdicts = [s["findings"][i]["verdict"] for s in seeds]
        measured = [v for v in verdicts if v != "not measured in this study"]
        verdict = ("not measured in this study" if not measured
                   else "reproduced" if all(v == "reproduced" for v in measured) else "not reproduced")
        overall.append({"id": f["id"], "claim": f["claim"], "verdict": verdict,
                        "seeds_reproduced": f"{measured.count('reproduced')} of {len(measured)}"})
    return spread, overall


def _plot_accuracy(seeds: list[tuple[dict, list[Stage]]], domain: str, metric: str, x: str, path: Path,
                   targets: dict[str, float]) -> None:
    fig, ax = plt.subplots(figsize=(10, 5))
    for k, (label, value) in enumerate(targets.items()):
        ax.axhline(value, color="grey", ls=TARGET_STYLES[k % 3], lw=1, label=f"target: {label} {value:.3f}")
    colors, styles = {}, ["-", "--", ":", "-."]
    for k, (_, stages) in enumerate(seeds):
        for s in stages:
            fx, acc = s.curve(domain, metric, x)
            pts = [(f, a) for f, a in zip(fx, acc) if f > 0]  # 0 FLOPs has no place on a log axis
            if not pts:
                continue
            color = colors.setdefault(s.name, f"C{len(colors) % 10}")
            ax.plot(*zip(*pts), styles[k % 4], marker="o", ms=3, color=color,
                    label=f"{s.name} ({s.method})" if k == 0 else None)
    ax.set_xscale("log")
    ax.set_xlabel(f"cumulative training FLOPs (flops/total_{x}, log scale)")
    ax.set_ylabel(f"held-out accuracy ({metric}, fraction correct)")
    seed_note = f", {len(seeds)} seeds (line style = seed)" if len(seeds) > 1 else ""
    ax.set_title(f"Held-out accuracy vs training FLOPs: {domain}{seed_note}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: curves fill the whole axes
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_length(seeds: list[tuple[dict, list[Stage]]], path: Path) -> bool:
    fig, (by_step, by_flops) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors, drawn = {}, False
    for k, (_, stages) in enumerate(seeds):
        for s in stages:
            steps, fx, lengths = s.lengths()
            if not steps:
                continue
            drawn = True
            color = colors.setdefault(s.name, f"C{len(colors) % 10}")
            label = f"{s.name} ({s.method})" if k == 0 else None
            by_step.plot(steps, lengths, color=color, lw=1, label=label)
            by_flops.plot(fx, lengths, color=color, lw=1, label=label)
    by_step.set_xlabel("training step")
    by_flops.set_xlabel("cumulative stage FLOPs (flops/total_stage, log scale)")
    by_flops.set_xscale("log")
    for ax, title in ((by_step, "vs step"), (by_flops, "vs FLOPs")):
        ax.set_ylabel("mean sampled response length (tokens)")
        ax.set_title(f"Rollout response length {title}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _f(v, fmt: str = ".3e") -> str:
    return "-" if v is None else format(v, fmt)


def _pct(v: float | None) -> str:
    return "not measurable" if v is None else f"{100 * v:.1f}%"


def _seed_markdown(r: dict, fraction: float) -> list[str]:
    md = ["#### OPD vs GRPO (E1-E3): FLOPs to reach a target, on the GRPO stage's domain (the mean when it has none)", "",
          "| OPD stage | GRPO stage | target | accuracy | GRPO FLOPs | OPD FLOPs | GRPO/OPD |", "|---" * 7 + "|"]
    if not r["comparisons"]:
        md = md[:2] + ["- no opd stage with compare_with in this study"]
    for c in r["comparisons"]:
        for name, t in c["targets"].items():
            label = "GRPO final" if name == "teacher" else f"base + {fraction} x GRPO gain (base {c['base']:.3f})"
            md.append(f"| {c['opd']} ({c['method']}) | {c['grpo']} | {label} | {t['target']:.3f} | "
                      f"{_reached(t['grpo_flops'], t['grpo_best_smoothed'])} | "
                      f"{_reached(t['opd_flops'], t['opd_best_smoothed'])} | {_f(t['ratio'], '.2f')} |")
    for c in r["comparisons"]:
        if "matched" in c:
            m = c["matched"]
            md.append(f"\nAt matched FLOPs ({m['flops']:.3e}), smoothed accuracy: "
                      f"{c['grpo']} {_f(m['grpo_acc'], '.3f')}, "
                      f"{c['opd']} {_f(m['opd_acc'], '.3f')}.")
    md += ["", "#### Multi-teacher OPD (E6)", ""]
    for m in r["multi_teacher"]:
        md.append(f"- {m['stage']}: distillation {_f(m['distill_flops'])} FLOPs / specialists "
                  f"{_f(m['specialist_flops'])} = {_pct(m['share'])} (paper: 5.2% / 8.0%)")
        md += [f"  - {d}: student {_f(v['student_acc'], '.3f')} vs expert {v['expert']} {_f(v['expert_acc'], '.3f')} "
               f"(gap {_f(v['gap'], '+.3f')})" for d, v in m["domains"].items()]
    if not r["multi_teacher"]:
        md.append("- no multi_teacher_opd stage in this study")
    md += ["", "#### Split-then-merge vs joint GRPO (E7)", ""]
    for s in r["split_vs_joint"]:
        md.append(f"- target {s['target']:.3f} ({s['joint']} final mean accuracy, last smoothed eval); experts {s['experts_flops']:.3e} + "
                  f"{s['merge']} {_reached(s['merge_flops_to_target'], s['merge_best_smoothed'])} = split "
                  f"{_f(s['split_flops'])}; joint {_reached(s['joint_flops_to_target'], s['joint_best_smoothed'])}; "
                  f"saving 1 - split/joint = {_pct(s['saving'])} (paper: 42.0%)")
    if not r["split_vs_joint"]:
        md.append("- no joint_grpo stage (with a multi_teacher_opd stage) in this study")
    md += ["", "#### FLOPs ledger and response length per stage", "",
           "| stage | method | steps | final mean acc | stage | + teachers | + cold start | external | "
           + " | ".join(COMPONENTS) + " | length first | length last |", "|---" * (10 + len(COMPONENTS)) + "|"]
    for name, s in r["stages"].items():
        form = f" {s['form']}" if s.get("form") and s["form"] != s["algorithm"] else ""  # the OPD form, labelled
        md.append(f"| {name} | {s['method']}{form} | {s['steps']} | {_f(s['final_mean_acc'], '.3f')} | "
                  + " | ".join(_f(s["totals"][k]) for k in TOTALS) + " | "
                  + " | ".join(_f(s["components"][c]) for c in COMPONENTS)
                  + f" | {_f(s['length']['first'], '.1f')} | {_f(s['length']['last'], '.1f')} |")
    return md


def write_report(study_dir: str | Path | list, out_dir: str | Path | None = None, target_fraction: float = 0.9,
                 metric: str = "greedy", window: int = 3, x: str = "stage") -> dict:
    """Analyse one study directory (or several: seeds), write report.md, report.json and PNGs; return the json."""
    dirs = [Path(d) for d in (study_dir if isinstance(study_dir, (list, tuple)) else [study_dir])]
    out = Path(out_dir) if out_dir is not None else dirs[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    loaded = [load_study(d) for d in dirs]
    seeds = [analyse(d, *ld, metric, target_fraction, window, x) for d, ld in zip(dirs, loaded)]
    spread, overall = aggregate(seeds)
    domains = sorted({d for _, stages in loaded for s in stages for d in s.domains(metric)})
    plots = []
    # The first seed's targets on the mean plot: where each curve has to get to.
    targets = {f"{c['grpo']} final": c["teacher"] for c in seeds[0]["comparisons"] if c["teacher"] is not None}
    targets |= {f"{s['joint']} final": s["target"] for s in seeds[0]["split_vs_joint"]}
    for domain in ["mean"] + domains:
        _plot_accuracy(loaded, domain, metric, x, out / f"accuracy_{domain}.png", targets if domain == "mean" else {})
        plots.append(f"accuracy_{domain}.png")
    if _plot_length(loaded, out / "response_length.png"):
        plots.append("response_length.png")
    report = {"x_axis": f"flops/total_{x}", "metric": metric, "target_fraction": target_fraction, "window": window,
              "rules": {"flops_to_target": TARGET_RULE, "length": LENGTH_RULE, "findings": FINDING_RULES,
                        "match_tolerance": MATCH_TOLERANCE, "small_share": SMALL_SHARE},
              "single_seed": len(seeds) == 1, "findings": overall, "spread": spread, "seeds": seeds, "plots": plots}
    (out / "report.json").write_text(json.dumps(report, indent=1))

    md = ["# megaopd report: held-out accuracy vs training FLOPs", "",
          "Studies: " + ", ".join(f"`{d}`" for d in dirs) + (" (single seed)" if len(dirs) == 1 else
                                                             f" ({len(dirs)} seeds)"), "",
          "## Conventions", "",
          f"- x axis: `flops/total_{x}`, cumulative model FLOPs (1 MAC = 2 FLOPs, backward = 2x forward, causal "
          "attention halved, LM head where logits are used, R-1 decode forwards per response, real token counts: "
          "megaopd/flops.py); E6 shares and E7 totals always use stage FLOPs "
          "(`flops/total_stage`); the ledger table gives all totals.",
          f"- accuracy: `accuracy_{metric}`; curves are the periodic evals on a fixed held-out subset, targets and "
          "per-domain comparisons use the final eval on all held-out prompts. Points at 0 FLOPs are off the log axis.",
          f"- {TARGET_RULE} window = {window}.",
          f"- response length first/last: {LENGTH_RULE}.",
          f"- findings: {FINDING_RULES} Tolerance {MATCH_TOLERANCE}; small share <= {SMALL_SHARE}.", "",
          "## Findings of the paper, checked against this study", ""]
    md += [f"- ({f['id']}) {f['claim']}: **{f['verdict']}**"
           + (f" (reproduced in {f['seeds_reproduced']} seeds)"
              if len(seeds) > 1 and f["verdict"] != "not measured in this study"
              else "") for f in overall]
    md += ["", "## Headline numbers" + (" (single seed)" if len(seeds) == 1 else " across seeds (mean, min-max)"), ""]
    md += [f"- {k}: {v['mean']:.4g}"
           + (f" (min {v['min']:.4g}, max {v['max']:.4g}, n={v['n']})" if len(seeds) > 1 else "")
           for k, v in spread.items()] or ["- none measured"]
    md += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    for k, r in enumerate(seeds):
        seed = f" (seed {r['seed']})" if r["seed"] is not None else ""
        md += ["", f"## Study {k + 1}{seed}: `{r['study_dir']}`", "", "### Findings", ""]
        md += [f"- ({f['id']}) **{f['verdict']}**: {f['detail']}" for f in r["findings"]]
        md += [""] + _seed_markdown(r, target_fraction)
    (out / "report.md").write_text("\n".join(md) + "\n")
    return report


def finding_line(finding: dict) -> str:
    return f"({finding['id']}) {finding['verdict']}: {finding['claim']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megaopd report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study_dirs", nargs="+", help="study directories; several = seeds of the same study")
    parser.add_argument("--out", default=None, help="default: <first study>/report")
    parser.add_argument("--target-fraction", type=float, default=0.9, help="of GRPO's gain over the base")
    parser.add_argument("--metric", choices=("greedy", "sampled"), default="greedy")
    parser.add_argument("--window", type=int, default=3, help="evals in the trailing moving average")
    parser.add_argument("--x", choices=("stage", "with_teachers", "with_cold_start"), default="stage",
                        help="the FLOPs total on the x axis and in E1-E3")
    args = parser.parse_args(argv)
    report = write_report(args.study_dirs, args.out, args.target_fraction, args.metric, args.window, args.x)
    out = Path(args.out) if args.out else Path(args.study_dirs[0]) / "report"
    print(f"wrote {out / 'report.md'}")
    for f in report["findings"]:
        print(finding_line(f))
    return 0
