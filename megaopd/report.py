"""The study report: held-out accuracy against training FLOPs, the paper's ratios, and whether each finding reproduces.

    megaopd report runs/study [runs/study_seed1 ...] [--out DIR] [--target-fraction 0.9] [--metric greedy|sampled]

Reads a study directory (``study.yaml`` plus one run directory per stage, see ``megaopd/study.py``) and writes
``report.md``, ``report.json`` (every number of the markdown) and PNG plots into ``<first study>/report/``. Several
study directories of the same layout are read as seeds (a study run with ``seeds`` is its ``seed_<s>/``): each is
analysed alone, then each headline number is shown as mean and min-max across them. Every comparison is computed
from the measured curves; nothing is asserted. Each number computed from held-out accuracy carries a bootstrap
interval (INTERVAL_RULE; per-prompt results in ``<stage>/evals/``, statistics in ``megaopd/stats.py``), and each
finding's verdict is reproduced, not reproduced or inconclusive by where that interval lies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from megaopd.flops import ModelShape  # noqa: E402
from megaopd.metrics import read_metrics  # noqa: E402
from megaopd.stats import (LEVEL, NOT_MEASURED, REPLICATES, REPRODUCED, combine, mean_and_se,  # noqa: E402
                           percentile_interval, resample, seed_bootstrap, verdict)

COMPONENTS = ("rollout", "old_logprob", "reference", "teacher", "train")
TOTALS = ("stage", "with_teachers", "with_cold_start", "external")
OPD_VS_GRPO = ("opd_external", "opd_external_grpo", "opd_self")
MATCH_TOLERANCE = 0.05  # (d): a student "matches" its expert when at most this much below it (absolute accuracy)
SMALL_SHARE = 0.10  # (e): distillation is "a small share" of specialist FLOPs at or below this
TARGET_RULE = ("FLOPs-to-target: smooth the accuracy with a trailing moving average over `window` evals (fewer at "
               "the start), find the first eval whose smoothed accuracy >= target, and interpolate linearly in "
               "FLOPs between it and the previous eval (on the smoothed accuracy); the first eval itself if it "
               "already reaches the target; not reached if no eval does.")
FINDING_RULES = ("each finding is checked per pair (per domain for (d)) as a number against a threshold: (a) GRPO/OPD "
                 "FLOPs to GRPO's final accuracy < 1 (OPD never reaching it: 0; if neither does: GRPO - OPD "
                 "smoothed accuracy at the smaller of the two final FLOPs > 0); (b) OPD's last/first length ratio "
                 "minus GRPO's > 0; (c) GRPO/OPD FLOPs to the checkpoint's final accuracy > 1 (OPD never: 0); (d) "
                 "student - expert final accuracy >= -tolerance; (e) distillation / specialist FLOPs <= the "
                 "small-share bound; (f) 1 - split/joint FLOPs > 0 (the merge never reaching the target: -inf; not "
                 "measured if joint GRPO's own curve never does). A finding needs all its checks: one not "
                 "reproduced decides it, else one inconclusive leaves it inconclusive.")
TARGET_STYLES = (":", "-.", "--")
BOOTSTRAP_SEED = 17  # the resamples are drawn from a fixed seed: the same runs give the same report
NOT_REACHED_IS_INF = ("grpo_flops", "opd_flops", "merge_flops_to_target", "joint_flops_to_target", "split_flops")
INTERVAL_RULE = (f"intervals: {int(100 * LEVEL)}% percentile bootstrap, `replicates` resamples (fixed seed). Each "
                 "replicate resamples every domain's held-out prompts with replacement, once per prompt set, so "
                 "that every eval and every stage on the same prompts sees the same resample (comparisons are "
                 "paired), recomputes every accuracy from the per-prompt results (evals/*.json), then every "
                 "smoothed curve, FLOPs-to-target, ratio, gap and saving; response lengths resample the training "
                 "steps within the first and the last `length_window`. A target not reached counts as infinite "
                 "FLOPs. With several seeds a replicate also draws the seeds with replacement (then one prompt "
                 "replicate of each) and averages over them. FLOPs themselves carry no interval: the held-out "
                 "sample does not move them. A verdict is reproduced when the whole interval satisfies the rule, "
                 "not reproduced when none of it does, and inconclusive when it straddles the threshold.")
LENGTH_WINDOW = 10  # training steps averaged at each end for the response length
LENGTH_RULE = "mean rollout/response_length of the first (last) `length_window` training steps"


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
    records: dict = field(default_factory=dict)  # eval step or "final" -> per-prompt results (megaopd/evaluate.py)
    teacher_cost: dict[str, float] = field(default_factory=dict)  # OPD: domain -> teacher/student FLOPs per token
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

    def curve_se(self, domain: str, metric: str) -> list[float | None]:
        """Standard error of each curve point over its prompts (the mean: of the domains' mean); None without
        per-prompt results."""
        key = f"eval/{domain}/accuracy_{metric}"
        return [_record_se(self.records.get(m["step"]), domain, metric) for m in self.lines if key in m]

    def domains(self, metric: str) -> list[str]:
        keys = {k for m in self.lines for k in m if k.startswith(("eval/", "final/")) and k.endswith(metric)}
        return sorted({k.split("/")[1] for k in keys} - {"mean"})

    def lengths(self) -> tuple[list[int], list[float], list[float]]:
        pts = [(m["step"], m["flops/total_stage"], m["rollout/response_length"]) for m in self.lines
               if "rollout/response_length" in m]
        return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]

    def length_first_last(self, window: int) -> tuple[float | None, float | None]:
        """LENGTH_RULE: mean response length of the first and of the last `window` training steps."""
        lengths = self.lengths()[2]
        if not lengths:
            return None, None
        return float(np.mean(lengths[:window])), float(np.mean(lengths[-window:]))


def _record_se(record: dict | None, domain: str, metric: str) -> float | None:
    if record is None or metric not in record["reward"]:
        return None
    rewards = record["reward"][metric]
    if domain != "mean":
        return mean_and_se(rewards[domain])[1] if domain in rewards else None
    return math.sqrt(sum(mean_and_se(v)[1] ** 2 for v in rewards.values())) / len(rewards)


def study_dirs(paths: list[str | Path]) -> list[Path]:
    """Study directories; one run with `seeds` (seed_<s>/ below it, no study.yaml of its own) counts as its seeds."""
    out = []
    for p in map(Path, paths):
        seeds = sorted(p.glob("seed_*/study.yaml"), key=lambda y: int(y.parent.name.split("_")[1]))
        out += [y.parent for y in seeds] if not (p / "study.yaml").exists() and seeds else [p]
    return out


def _records(run_dir: Path) -> dict:
    out = {}
    for path in sorted((run_dir / "evals").glob("*.json")):
        rec = json.loads(path.read_text())
        rec["reward"] = {mode: {d: np.asarray(v, dtype=float) for d, v in by.items()}
                         for mode, by in rec["reward"].items()}
        out["final" if rec["final"] else rec["step"]] = rec
    return out


def _teacher_cost(run_dir: Path) -> dict[str, float]:
    """Teacher FLOPs per token over the student's (2 x matmul parameters each, megaopd/flops.py) for an OPD stage."""
    path = run_dir / "config.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.exists() else {}
    teachers = (cfg.get("opd") or {}).get("teachers") or {}
    student = _matmul_params((cfg.get("model") or {}).get("path"))
    if not teachers or student is None:
        return {}
    costs = {d: _matmul_params(t) for d, t in teachers.items()}
    return {d: c / student for d, c in sorted(costs.items()) if c is not None}


def _matmul_params(model_dir: str | None) -> int | None:
    config = Path(model_dir or "") / "config.json"
    if not model_dir or not config.exists():
        return None
    return ModelShape.from_hf_config(json.loads(config.read_text())).matmul_params


def load_study(study_dir: str | Path) -> tuple[dict, list[Stage]]:
    """study.yaml and every stage that has a run directory; a stage without `method` counts as `other`."""
    study_dir = Path(study_dir)
    study = yaml.safe_load((study_dir / "study.yaml").read_text()) or {}
    stages = []
    for s in study.get("stages") or []:
        run_dir = study_dir / s["name"]
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        stages.append(Stage(s["name"], s.get("method") or "other", s.get("compare_with") or "", s.get("domain") or "",
                            summary.get("algorithm", ""), read_metrics(run_dir), _records(run_dir),
                            _teacher_cost(run_dir), summary.get("form", "")))
    return study, [s for s in stages if s.lines]


def resample_stage(stage: Stage, metric: str, draw, rng: np.random.Generator, length_window: int) -> Stage:
    """One bootstrap replicate of a stage: every accuracy recomputed on resampled prompts, and the response lengths
    of the first and last `length_window` training steps resampled among those steps.

    `draw(domain, prompts)` gives the replicate's indices for a set of prompts (the same for every eval and stage
    on those prompts, so that comparisons are paired); evals without per-prompt results keep their value."""
    lines = []
    for m in stage.lines:
        final = any(k.startswith("final/") for k in m)
        record = stage.records.get("final" if final else m["step"])
        if record is not None and metric in record["reward"]:
            prefix = "final" if final else "eval"
            acc = {d: float(v[draw(d, record["prompts"][d])].mean()) for d, v in record["reward"][metric].items()}
            m = {**m, **{f"{prefix}/{d}/accuracy_{metric}": a for d, a in acc.items()},
                 f"{prefix}/mean/accuracy_{metric}": sum(acc.values()) / len(acc)}
        lines.append(m)
    steps = [i for i, m in enumerate(lines) if "rollout/response_length" in m]
    for group in (steps[:length_window], steps[-length_window:]):
        values = [lines[i]["rollout/response_length"] for i in group]
        for i, j in zip(group, resample(rng, len(group))):
            lines[i] = {**lines[i], "rollout/response_length": values[j]}
    return replace(stage, lines=lines)


def _reached(flops: float | None, best: float | None) -> str:
    return f"{flops:.3e}" if flops is not None else f"not reached (best smoothed {best:.3f})"


def compare_opd_grpo(opd: Stage, grpo: Stage, metric: str, fraction: float, window: int, x: str,
                     length_window: int = LENGTH_WINDOW) -> dict:
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
           "teacher": teacher, "teacher_cost_ratio": max(opd.teacher_cost.values(), default=None), "targets": {}}
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
    out["length"] = {k: dict(zip(("first", "last"), s.length_first_last(length_window)))
                     for k, s in (("opd", opd), ("grpo", grpo))}
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
            "share": mt.total("stage") / specialist if specialist else None, "teacher_cost_ratio": mt.teacher_cost}


def analyse(study_dir: str | Path, study: dict, stages: list[Stage], metric: str = "greedy",
            target_fraction: float = 0.9, window: int = 3, x: str = "stage",
            length_window: int = LENGTH_WINDOW) -> dict:
    """Every number of one study directory (one seed), from `load_study`'s study.yaml and stages."""
    by_name = {s.name: s for s in stages}
    comparisons = [compare_opd_grpo(s, by_name[s.compare_with], metric, target_fraction, window, x, length_window)
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
                      "length": dict(zip(("first", "last"), s.length_first_last(length_window)))} for s in stages}
    result = {"study_dir": str(study_dir), "seed": study.get("seed"), "stages": table, "comparisons": comparisons,
              "multi_teacher": mts, "split_vs_joint": splits}
    result["findings"] = findings(result)
    result["headline"] = headline(result)
    return result


def pointer(path: tuple) -> str:
    """RFC 6901 JSON pointer of a number in the analysis (the key of its interval in report.json)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _numbers(obj, path: tuple = ()):
    """(path, value) of every number (or None) in an analysis result."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, path + (i,))
    elif obj is None or (isinstance(obj, (int, float)) and not isinstance(obj, bool)):
        yield path, obj


def _rng(*key) -> np.random.Generator:
    """A generator per (seed dir, replicate, prompt set or stage): a number's resamples do not depend on which other
    stages the study holds or in which order they are read."""
    digest = hashlib.sha1(repr((BOOTSTRAP_SEED,) + key).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def bootstrap(study_dir: str | Path, study: dict, stages: list[Stage], metric: str = "greedy",
              target_fraction: float = 0.9, window: int = 3, x: str = "stage", length_window: int = LENGTH_WINDOW,
              replicates: int = REPLICATES, seed: int = 0) -> tuple[dict, dict[str, list]]:
    """`analyse` on the measured curves, then on `replicates` resamples (INTERVAL_RULE); returns the result with
    "intervals" (JSON pointer -> [lo, hi], plus the share of replicates where it is defined when not all) and the
    findings' verdicts, and every number's replicates (for the seeds' bootstrap)."""
    args = (metric, target_fraction, window, x, length_window)
    result = analyse(study_dir, study, stages, *args)
    draws = []
    if any(s.records for s in stages):
        for b in range(replicates):
            indices: dict[tuple, np.ndarray] = {}

            def draw(domain: str, prompts: dict) -> np.ndarray:  # one resample per prompt set: comparisons paired
                key = (domain, prompts["sha1"], prompts["n"])
                if key not in indices:
                    indices[key] = resample(_rng(seed, b, *key), prompts["n"])
                return indices[key]

            replicate = [resample_stage(s, metric, draw, _rng(seed, b, s.name), length_window) for s in stages]
            draws.append(dict(_numbers(analyse(study_dir, study, replicate, *args))))
    intervals, reps = {}, {}
    for path, point in _numbers(result):
        values = [d.get(path) for d in draws]
        if path[-1] in NOT_REACHED_IS_INF:
            values = [math.inf if v is None else v for v in values]
        reps[pointer(path)] = values
        interval = percentile_interval(values)
        if interval is None or (interval == (point, point) and None not in values):
            continue  # no replicates, or a number the held-out sample does not move (FLOPs)
        share = sum(v is not None for v in values) / len(values)
        intervals[pointer(path)] = list(interval) + ([share] if share < 1 else [])
    result["intervals"] = intervals
    for i, f in enumerate(result["findings"]):
        for label, check in f["checks"].items():
            interval = intervals.get(pointer(("findings", i, "checks", label, "value")))
            check["interval"] = interval[:2] if interval else None
            check["verdict"] = verdict(check["interval"], check["op"], check["threshold"], check["value"])
        f["verdict"] = combine([c["verdict"] for c in f["checks"].values()])
    return result, reps


def flops_ratio(grpo: float | None, opd: float | None) -> float | None:
    """GRPO/OPD FLOPs to a target as a number a rule can compare: 0 when OPD never reaches it, inf when GRPO never
    does (or OPD needs none); None when neither does."""
    if grpo is None and opd is None:
        return None
    if opd is None:
        return 0.0
    return math.inf if grpo is None or opd == 0 else grpo / opd


def _check(value: float | None, op: str, threshold: float, detail: str) -> dict:
    """One measured claim "value OP threshold" (a pair, a domain): its verdict comes with its interval later."""
    return {"value": value, "op": op, "threshold": threshold, "detail": detail}


def findings(r: dict) -> list[dict]:
    """The checks of each finding of the paper, keyed by pair / domain, computed from this seed's numbers."""
    ext = [c for c in r["comparisons"] if c["method"] != "opd_self" and "teacher" in c["targets"]]
    own = [c for c in r["comparisons"] if c["method"] == "opd_self" and "teacher" in c["targets"]]
    a, b, c_, d, e, f = {}, {}, {}, {}, {}, {}
    for c in ext:
        t, m, pair = c["targets"]["teacher"], c["matched"], f"{c['opd']} vs {c['grpo']}"
        if t["grpo_flops"] is not None or t["opd_flops"] is not None:
            # GRPO/OPD < 1 (fewer GRPO FLOPs to the target, or OPD never reaching it: 0) means OPD loses per FLOP.
            a[pair] = _check(flops_ratio(t["grpo_flops"], t["opd_flops"]), "<", 1.0,
                             f"FLOPs to {t['target']:.3f}: GRPO {_reached(t['grpo_flops'], t['grpo_best_smoothed'])}"
                             f", OPD {_reached(t['opd_flops'], t['opd_best_smoothed'])}; GRPO/OPD")
        elif m["grpo_acc"] is not None and m["opd_acc"] is not None:  # neither reached: accuracy at matched FLOPs
            a[pair + " (matched FLOPs)"] = _check(m["grpo_acc"] - m["opd_acc"], ">", 0.0,
                                                  f"at {m['flops']:.3e} FLOPs GRPO {m['grpo_acc']:.3f}, OPD "
                                                  f"{m['opd_acc']:.3f}; GRPO - OPD")
        lo, lg = c["length"]["opd"], c["length"]["grpo"]
        if None not in (lo["first"], lg["first"]):
            go, gg = lo["last"] / lo["first"], lg["last"] / lg["first"]
            b[pair] = _check(go - gg, ">", 0.0, f"OPD length x{go:.2f} ({lo['first']:.1f} -> {lo['last']:.1f}) vs "
                                                f"GRPO x{gg:.2f} ({lg['first']:.1f} -> {lg['last']:.1f}); difference")
    for c in own:
        t = c["targets"]["teacher"]
        if t["opd_flops"] == 0:  # the base already meets the teacher's accuracy: nothing to compare
            continue
        c_[f"{c['opd']} vs {c['grpo']}"] = _check(
            flops_ratio(t["grpo_flops"], t["opd_flops"]), ">", 1.0,
            f"FLOPs to {t['target']:.3f}: GRPO {_reached(t['grpo_flops'], t['grpo_best_smoothed'])}, OPD "
            f"{_reached(t['opd_flops'], t['opd_best_smoothed'])}; GRPO/OPD")
    for m in r["multi_teacher"]:
        for k, v in m["domains"].items():
            if v["gap"] is not None:
                d[f"{m['stage']} {k}"] = _check(v["gap"], ">=", -MATCH_TOLERANCE,
                                                f"student {v['student_acc']:.3f} vs expert {v['expert']} "
                                                f"{v['expert_acc']:.3f}; gap")
        if m["share"] is not None:
            e[m["stage"]] = _check(m["share"], "<=", SMALL_SHARE, f"{m['distill_flops']:.3e} / "
                                                                  f"{m['specialist_flops']:.3e}; share")
    for s in r["split_vs_joint"]:
        if s["split_flops"] is not None and s["saving"] is None:
            continue  # joint GRPO never reaches its own final accuracy: (f) is undefined
        # The merge never reaching the target contradicts (f): saving -inf.
        f[f"{s['merge']} + experts vs {s['joint']}"] = _check(
            s["saving"] if s["saving"] is not None else -math.inf, ">", 0.0,
            f"to {s['target']:.3f}: split " + (f"{s['split_flops']:.3e}" if s["split_flops"] is not None
                                              else f"not reached (merge best smoothed {s['merge_best_smoothed']:.3f})")
            + f", joint {_reached(s['joint_flops_to_target'], s['joint_best_smoothed'])}; saving")
    claims = {
        "a": ("external-teacher OPD loses to GRPO per FLOP (E1/E2)", a),
        "b": ("external-teacher OPD inflates response length more than GRPO (last/first)", b),
        "c": ("self-GRPO-teacher OPD reaches the checkpoint's accuracy with fewer FLOPs than GRPO (E3)", c_),
        "d": (f"the multi-teacher student matches each expert (within {MATCH_TOLERANCE} absolute) (E6)", d),
        "e": ("distillation is a small share of the specialists' FLOPs (E6)", e),
        "f": ("split-then-merge uses fewer total FLOPs than joint GRPO to reach its accuracy (E7)", f),
    }
    return [{"id": k, "claim": claim, "checks": checks} for k, (claim, checks) in claims.items()]


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


def aggregate(seeds: list[dict], reps: list[dict[str, list]]) -> tuple[dict, list[dict]]:
    """Headline numbers (mean, min-max, interval) and one verdict per finding over the seeds (INTERVAL_RULE):
    each check's mean over the seeds with its two-level bootstrap interval, and how many seeds reproduce it."""
    rng = np.random.default_rng([BOOTSTRAP_SEED, len(seeds)])

    numbers = [dict(_numbers(s)) for s in seeds]

    def pooled(path: tuple) -> tuple[float | None, list[float] | None]:
        have = [(k, n[path]) for k, n in enumerate(numbers) if n.get(path) is not None]
        if not have:
            return None, None
        if len(seeds) == 1:
            interval = seeds[0]["intervals"].get(pointer(path))
            return have[0][1], interval[:2] if interval else None
        per_seed = [reps[k].get(pointer(path)) or [v] for k, v in have]
        interval = percentile_interval(seed_bootstrap(per_seed, rng))
        return float(np.mean([v for _, v in have])), list(interval) if interval else None

    spread = {}
    for name in sorted({k for s in seeds for k in s["headline"]}):
        values = [s["headline"][name] for s in seeds if name in s["headline"]]
        mean, interval = pooled(("headline", name))
        spread[name] = {"mean": float(np.mean(values)), "min": min(values), "max": max(values), "n": len(values),
                        "interval": interval}
    overall = []
    for i, f in enumerate(seeds[0]["findings"]):
        labels = list(dict.fromkeys(label for s in seeds for label in s["findings"][i]["checks"]))
        checks = {}
        for label in labels:
            first = next(s["findings"][i]["checks"][label] for s in seeds if label in s["findings"][i]["checks"])
            value, interval = pooled(("findings", i, "checks", label, "value"))
            checks[label] = {"value": value, "op": first["op"], "threshold": first["threshold"], "interval": interval,
                             "verdict": verdict(interval, first["op"], first["threshold"], value),
                             "detail": first["detail"] if len(seeds) == 1 else "mean over seeds"}
        measured = [s["findings"][i]["verdict"] for s in seeds if s["findings"][i]["verdict"] != NOT_MEASURED]
        overall.append({"id": f["id"], "claim": f["claim"], "verdict": combine([c["verdict"] for c in checks.values()]),
                        "checks": checks, "seeds_reproduced": f"{measured.count(REPRODUCED)} of {len(measured)}",
                        "n_seeds": len(seeds)})
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
            # 0 FLOPs has no place on a log axis; the bars are 1.96 standard errors over the eval's prompts.
            pts = [(f, a, 1.96 * se if se is not None else 0.0)
                   for f, a, se in zip(fx, acc, s.curve_se(domain, metric)) if f > 0]
            if not pts:
                continue
            color = colors.setdefault(s.name, f"C{len(colors) % 10}")
            f, a, err = zip(*pts)
            ax.errorbar(f, a, yerr=err, fmt=styles[k % 4], marker="o", ms=3, color=color, elinewidth=0.6, capsize=1.5,
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
        if drawn:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _f(v, fmt: str = ".3e") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):  # json_safe's "inf" / "-inf"
        return "never" if v == "inf" else v
    return ("never" if v > 0 else "-inf") if math.isinf(v) else format(v, fmt)


def _pct(v: float | None) -> str:
    return "not measurable" if v is None else f"{100 * v:.1f}%"


def _ci(r: dict, path: tuple, fmt: str = ".3e", scale: float = 1.0) -> str:
    """ " [lo, hi]" after a number when it has an interval (and how often it is defined when not always)."""
    interval = r.get("intervals", {}).get(pointer(path))
    if interval is None:
        return ""
    lo, hi = (_f(v * scale if not math.isinf(v) else v, fmt) for v in interval[:2])
    return f" [{lo}, {hi}]" + (f" (defined in {100 * interval[2]:.0f}% of resamples)" if len(interval) > 2 else "")


def _check_line(label: str, c: dict) -> str:
    interval = "" if c["interval"] is None else f" [{_f(c['interval'][0], '.3g')}, {_f(c['interval'][1], '.3g')}]"
    return (f"  - {label}: {c['detail']} {_f(c['value'], '.3g')}{interval} "
            f"{c['op']} {c['threshold']:g}: {c['verdict']}")


def _seed_markdown(r: dict, fraction: float) -> list[str]:
    md = ["#### OPD vs GRPO (E1-E3): FLOPs to reach a target, on the GRPO stage's domain (the mean when it has none)", "",
          "| OPD stage | GRPO stage | teacher/student FLOPs per token | target | accuracy | GRPO FLOPs | OPD FLOPs "
          "| GRPO/OPD |", "|---" * 8 + "|"]
    if not r["comparisons"]:
        md = md[:2] + ["- no opd stage with compare_with in this study"]
    for i, c in enumerate(r["comparisons"]):
        for name, t in c["targets"].items():
            label = "GRPO final" if name == "teacher" else f"base + {fraction} x GRPO gain (base {c['base']:.3f})"
            path = ("comparisons", i, "targets", name)
            md.append(f"| {c['opd']} ({c['method']}) | {c['grpo']} | {_f(c['teacher_cost_ratio'], '.2f')}x | {label} "
                      f"| {t['target']:.3f}{_ci(r, path + ('target',), '.3f')} | "
                      f"{_reached(t['grpo_flops'], t['grpo_best_smoothed'])}{_ci(r, path + ('grpo_flops',))} | "
                      f"{_reached(t['opd_flops'], t['opd_best_smoothed'])}{_ci(r, path + ('opd_flops',))} | "
                      f"{_f(t['ratio'], '.2f')}{_ci(r, path + ('ratio',), '.2f')} |")
    for i, c in enumerate(r["comparisons"]):
        if "matched" in c:
            m, path = c["matched"], ("comparisons", i, "matched")
            md.append(f"\nAt matched FLOPs ({m['flops']:.3e}), smoothed accuracy: "
                      f"{c['grpo']} {_f(m['grpo_acc'], '.3f')}{_ci(r, path + ('grpo_acc',), '.3f')}, "
                      f"{c['opd']} {_f(m['opd_acc'], '.3f')}{_ci(r, path + ('opd_acc',), '.3f')}.")
    md += ["", "#### Multi-teacher OPD (E6)", ""]
    for i, m in enumerate(r["multi_teacher"]):
        md.append(f"- {m['stage']}: distillation {_f(m['distill_flops'])} FLOPs / specialists "
                  f"{_f(m['specialist_flops'])} = {_pct(m['share'])} (paper: 5.2% / 8.0%)")
        for d, v in m["domains"].items():
            path = ("multi_teacher", i, "domains", d)
            md.append(f"  - {d}: student {_f(v['student_acc'], '.3f')}{_ci(r, path + ('student_acc',), '.3f')} vs "
                      f"expert {v['expert']} {_f(v['expert_acc'], '.3f')}{_ci(r, path + ('expert_acc',), '.3f')} "
                      f"(gap {_f(v['gap'], '+.3f')}{_ci(r, path + ('gap',), '+.3f')})")
    if not r["multi_teacher"]:
        md.append("- no multi_teacher_opd stage in this study")
    md += ["", "#### Split-then-merge vs joint GRPO (E7)", ""]
    for i, s in enumerate(r["split_vs_joint"]):
        path = ("split_vs_joint", i)
        md.append(f"- target {s['target']:.3f}{_ci(r, path + ('target',), '.3f')} ({s['joint']} final mean accuracy, "
                  f"last smoothed eval); experts {s['experts_flops']:.3e} + {s['merge']} "
                  f"{_reached(s['merge_flops_to_target'], s['merge_best_smoothed'])} = split "
                  f"{_f(s['split_flops'])}{_ci(r, path + ('split_flops',))}; joint "
                  f"{_reached(s['joint_flops_to_target'], s['joint_best_smoothed'])}"
                  f"{_ci(r, path + ('joint_flops_to_target',))}; saving 1 - split/joint = {_pct(s['saving'])}"
                  f"{_ci(r, path + ('saving',), '.1f', 100)} (paper: 42.0%)")
    if not r["split_vs_joint"]:
        md.append("- no joint_grpo stage (with a multi_teacher_opd stage) in this study")
    md += ["", "#### FLOPs ledger and response length per stage", "",
           "| stage | method | steps | final mean acc | stage | + teachers | + cold start | external | "
           + " | ".join(COMPONENTS) + " | length first | length last |", "|---" * (10 + len(COMPONENTS)) + "|"]
    for name, s in r["stages"].items():
        form = f" {s['form']}" if s.get("form") and s["form"] != s["algorithm"] else ""  # the OPD form, labelled
        md.append(f"| {name} | {s['method']}{form} | {s['steps']} | {_f(s['final_mean_acc'], '.3f')}"
                  f"{_ci(r, ('stages', name, 'final_mean_acc'), '.3f')} | "
                  + " | ".join(_f(s["totals"][k]) for k in TOTALS) + " | "
                  + " | ".join(_f(s["components"][c]) for c in COMPONENTS)
                  + f" | {_f(s['length']['first'], '.1f')} | {_f(s['length']['last'], '.1f')} |")
    return md


def _curves(stages: list[Stage], metric: str, x: str) -> dict:
    """Every curve point with its standard error: stage -> domain -> [[FLOPs, accuracy, se or None], ...]."""
    return {s.name: {d: [list(p) for p in zip(*s.curve(d, metric, x), s.curve_se(d, metric))]
                     for d in ["mean"] + s.domains(metric)} for s in stages}


def json_safe(obj):
    """report.json is strict JSON: infinite numbers (a target never reached) become the strings "inf" / "-inf"."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    return obj


def analyse_seeds(dirs: list[Path], metric: str = "greedy", target_fraction: float = 0.9, window: int = 3,
                  x: str = "stage", length_window: int = LENGTH_WINDOW, replicates: int = REPLICATES):
    """Load and bootstrap every seed's directory, then pool them: (loaded, seeds, replicates, spread, findings)."""
    loaded = [load_study(d) for d in dirs]
    analysed = [bootstrap(d, *ld, metric, target_fraction, window, x, length_window, replicates, seed=k)
                for k, (d, ld) in enumerate(zip(dirs, loaded))]
    seeds, reps = [a[0] for a in analysed], [a[1] for a in analysed]
    for r, (_, stages) in zip(seeds, loaded):
        r["curves"] = _curves(stages, metric, x)
    return (loaded, seeds, reps, *aggregate(seeds, reps))


def write_report(study_dir: str | Path | list, out_dir: str | Path | None = None, target_fraction: float = 0.9,
                 metric: str = "greedy", window: int = 3, x: str = "stage", length_window: int = LENGTH_WINDOW,
                 replicates: int = REPLICATES) -> dict:
    """Analyse one study directory (or several: seeds), write report.md, report.json and PNGs; return the json."""
    dirs = study_dirs(study_dir if isinstance(study_dir, (list, tuple)) else [study_dir])
    out = Path(out_dir) if out_dir is not None else dirs[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    loaded, seeds, _, spread, overall = analyse_seeds(dirs, metric, target_fraction, window, x, length_window,
                                                      replicates)
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
    report = json_safe({
        "x_axis": f"flops/total_{x}", "metric": metric, "target_fraction": target_fraction, "window": window,
        "length_window": length_window, "replicates": replicates,
        "rules": {"flops_to_target": TARGET_RULE, "length": LENGTH_RULE, "findings": FINDING_RULES,
                  "intervals": INTERVAL_RULE, "match_tolerance": MATCH_TOLERANCE, "small_share": SMALL_SHARE},
        "single_seed": len(seeds) == 1, "findings": overall, "spread": spread, "seeds": seeds, "plots": plots})
    (out / "report.json").write_text(json.dumps(report, indent=1))

    md = ["# megaopd report: held-out accuracy vs training FLOPs", "",
          "Studies: " + ", ".join(f"`{d}`" for d in dirs) + (" (single seed)" if len(dirs) == 1 else
                                                             f" ({len(dirs)} seeds)"), "",
          "## Conventions", "",
          f"- x axis: `flops/total_{x}`, cumulative model FLOPs (1 MAC = 2 FLOPs, backward = 2x forward, causal "
          "attention halved, LM head where logits are used, R-1 decode forwards per response, real token counts: "
          "megaopd/flops.py); E6 shares and E7 totals always use stage FLOPs "
          "(`flops/total_stage`); the ledger table gives all totals. Teacher/student cost: FLOPs per token, 2 x "
          "matmul parameters of each (attention's length terms aside).",
          f"- accuracy: `accuracy_{metric}`; curves are the periodic evals on a fixed held-out subset (error bars: "
          "1.96 standard errors over its prompts), targets and per-domain comparisons use the final eval on all "
          "held-out prompts. Points at 0 FLOPs are off the log axis.",
          f"- {TARGET_RULE} window = {window}.",
          f"- response length first/last: {LENGTH_RULE}, length_window = {length_window}.",
          f"- {INTERVAL_RULE} replicates = {replicates}; intervals are printed in brackets after their number.",
          f"- findings: {FINDING_RULES} Tolerance {MATCH_TOLERANCE}; small share <= {SMALL_SHARE}.", "",
          "## Findings of the paper, checked against this study", ""]
    for f in overall:
        md.append(f"- ({f['id']}) {f['claim']}: **{f['verdict']}**"
                  + (f" (reproduced in {f['seeds_reproduced']} seeds)"
                     if len(seeds) > 1 and f["verdict"] != NOT_MEASURED else ""))
        md += [_check_line(label, c) for label, c in f["checks"].items()]
    md += ["", "## Headline numbers" + (" (single seed)" if len(seeds) == 1 else
                                        " across seeds (mean [interval], min-max)"), ""]
    md += [f"- {k}: {v['mean']:.4g}"
           + (f" [{_f(v['interval'][0], '.4g')}, {_f(v['interval'][1], '.4g')}]" if v["interval"] else "")
           + (f" (min {v['min']:.4g}, max {v['max']:.4g}, n={v['n']})" if len(seeds) > 1 else "")
           for k, v in spread.items()] or ["- none measured"]
    md += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    for k, r in enumerate(seeds):
        seed = f" (seed {r['seed']})" if r["seed"] is not None else ""
        md += ["", f"## Study {k + 1}{seed}: `{r['study_dir']}`", "", "### Findings", ""]
        for f in r["findings"]:
            md.append(f"- ({f['id']}) **{f['verdict']}**")
            md += [_check_line(label, c) for label, c in f["checks"].items()]
        md += [""] + _seed_markdown(r, target_fraction)
    (out / "report.md").write_text("\n".join(md) + "\n")
    return report


def finding_line(finding: dict) -> str:
    """One printed line per finding: its verdict, then each check's number [interval] against its threshold."""
    checks = "; ".join(f"{label} {_f(c['value'], '.3g')}"
                       + (f" [{_f(c['interval'][0], '.3g')}, {_f(c['interval'][1], '.3g')}]" if c["interval"] else "")
                       + f" {c['op']} {c['threshold']:g}" for label, c in finding["checks"].items())
    seeds = (f" (reproduced in {finding['seeds_reproduced']} seeds)"
             if finding["n_seeds"] > 1 and finding["verdict"] != NOT_MEASURED else "")
    return f"({finding['id']}) {finding['verdict']}{seeds}: {finding['claim']}" + (f": {checks}" if checks else "")


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
    parser.add_argument("--length-window", type=int, default=LENGTH_WINDOW,
                        help="training steps averaged at each end for the response length")
    parser.add_argument("--replicates", type=int, default=REPLICATES, help="bootstrap replicates (0: no intervals)")
    parser.add_argument("--length-sweep", action="store_true",
                        help="the directories are the points of a response-length sweep (length_sweep.sh): plot the "
                             "GRPO/OPD FLOP ratio against response length")
    args = parser.parse_args(argv)
    if args.length_sweep:
        from megaopd.length_sweep import write_length_sweep

        out = Path(args.out) if args.out else Path(args.study_dirs[0]).parent / "report"
        sweep = write_length_sweep(args.study_dirs, out, args.target_fraction, args.metric, args.window,
                                   args.length_window, args.replicates)
        print(f"wrote {out / 'length_sweep.md'}\n{sweep['conclusion']}")
        return 0
    report = write_report(args.study_dirs, args.out, args.target_fraction, args.metric, args.window, args.x,
                          args.length_window, args.replicates)
    out = Path(args.out) if args.out else study_dirs(args.study_dirs)[0] / "report"
    print(f"wrote {out / 'report.md'}")
    for f in report["findings"]:
        print(finding_line(f))
    return 0
