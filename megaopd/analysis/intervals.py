"""Bootstrap intervals for every number of the analysis, and verdicts over one or several seeds (INTERVAL_RULE):
``bootstrap`` resamples one study directory's held-out prompts, ``aggregate`` pools seeds, and ``analyse_seeds``
does both for the report. The statistics themselves are in ``stats``.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from megaopd.analysis.curves import LENGTH_WINDOW, analyse, curve_points
from megaopd.analysis.findings import judge, judged
from megaopd.analysis.runs import Stage, load_study, resample_stage
from megaopd.analysis.stats import (LEVEL, MAX_UNDEFINED, NOT_MEASURED, REPLICATES, REPRODUCED, combine,
                                    defined_fraction, percentile_interval, resample, seed_bootstrap)

BOOTSTRAP_SEED = 17  # the resamples are drawn from a fixed seed: the same runs give the same report
# FLOPs to a target that a replicate never reaches count as infinite (GRPO's to a fraction of its gain above 1).
NOT_REACHED_IS_INF = ("grpo_flops", "opd_flops", "reference_flops", "stage_flops", "control_flops",
                      "merge_flops_to_target", "split_flops", "split_flops_experts_to_final")
INTERVAL_RULE = (f"intervals: {int(100 * LEVEL)}% percentile bootstrap, `replicates` resamples (fixed seed). Each "
                 "replicate resamples every domain's held-out prompts with replacement, once per prompt set, so "
                 "that every eval and every stage on the same prompts sees the same resample (comparisons are "
                 "paired), recomputes every accuracy from the per-prompt results (evals/*.json), then every "
                 "smoothed curve, FLOPs-to-target, ratio, gap and saving; response lengths resample the training "
                 "steps within the first and the last `length_window`. A target not reached counts as infinite "
                 "FLOPs. With several seeds a replicate also draws the seeds with replacement (then one prompt "
                 "replicate of each) and averages over them. FLOPs themselves carry no interval: the held-out "
                 "sample does not move them. A verdict is reproduced when the whole interval satisfies the rule, "
                 "not reproduced when none of it does, and inconclusive when it straddles the threshold, or when "
                 f"the number is undefined in more than {100 * MAX_UNDEFINED:.0f}% of the resamples (the defined ones alone are no "
                 "sample of it).")


def json_safe(obj):
    """report.json is strict JSON: infinite numbers (a target never reached) become the strings "inf" / "-inf"."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    return obj


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
        share = defined_fraction(values)
        intervals[pointer(path)] = list(interval) + ([share] if share < 1 else [])
    result["intervals"] = intervals
    for i, f in enumerate(result["findings"]):
        judge(f, {label: interval for label in f["checks"]
                  if (interval := intervals.get(pointer(("findings", i, "checks", label, "value"))))})
    return result, reps


def aggregate(seeds: list[dict], reps: list[dict[str, list]]) -> tuple[dict, list[dict]]:
    """Headline numbers (mean, min-max, interval) and one verdict per finding over the seeds (INTERVAL_RULE):
    each check's mean over the seeds with its two-level bootstrap interval, and how many seeds reproduce it."""
    rng = np.random.default_rng([BOOTSTRAP_SEED, len(seeds)])

    numbers = [dict(_numbers(s)) for s in seeds]

    def pooled(path: tuple) -> tuple[float, list[float] | None, float]:
        """A headline or check value (defined in at least one seed), its interval over the seeds and the share of
        the replicates where it is defined."""
        have = [(k, n[path]) for k, n in enumerate(numbers) if n.get(path) is not None]
        if len(seeds) == 1:
            interval = seeds[0]["intervals"].get(pointer(path))
            share = interval[2] if interval and len(interval) > 2 else 1.0
            return have[0][1], interval[:2] if interval else None, share
        per_seed = [reps[k].get(pointer(path)) or [v] for k, v in have]
        draws = seed_bootstrap(per_seed, rng)
        interval = percentile_interval(draws)
        return float(np.mean([v for _, v in have])), list(interval) if interval else None, defined_fraction(draws)

    spread = {}
    for name in sorted({k for s in seeds for k in s["headline"]}):
        values = [s["headline"][name] for s in seeds if name in s["headline"]]
        _, interval, _ = pooled(("headline", name))
        spread[name] = {"mean": float(np.mean(values)), "min": min(values), "max": max(values), "n": len(values),
                        "interval": interval}
    overall = []
    for i, f in enumerate(seeds[0]["findings"]):
        labels = list(dict.fromkeys(label for s in seeds for label in s["findings"][i]["checks"]))
        checks = {}
        for label in labels:
            first = next(s["findings"][i]["checks"][label] for s in seeds if label in s["findings"][i]["checks"])
            value, interval, defined = pooled(("findings", i, "checks", label, "value"))
            checks[label] = {**judged(value, first["op"], first["threshold"], interval, defined),
                             "detail": first["detail"] if len(seeds) == 1 else "mean over seeds"}
        measured = [s["findings"][i]["verdict"] for s in seeds if s["findings"][i]["verdict"] != NOT_MEASURED]
        overall.append({"id": f["id"], "claim": f["claim"], "verdict": combine([c["verdict"] for c in checks.values()]),
                        "checks": checks, "seeds_reproduced": f"{measured.count(REPRODUCED)} of {len(measured)}",
                        "n_seeds": len(seeds)})
    return spread, overall


def analyse_seeds(dirs: list[Path], metric: str = "greedy", target_fraction: float = 0.9, window: int = 3,
                  x: str = "stage", length_window: int = LENGTH_WINDOW, replicates: int = REPLICATES):
    """Load and bootstrap every seed's directory, then pool them: (loaded, seeds, replicates, spread, findings)."""
    loaded = [load_study(d) for d in dirs]
    analysed = [bootstrap(d, *ld, metric, target_fraction, window, x, length_window, replicates, seed=k)
                for k, (d, ld) in enumerate(zip(dirs, loaded))]
    seeds, reps = [a[0] for a in analysed], [a[1] for a in analysed]
    for r, (_, stages) in zip(seeds, loaded):
        r["curves"] = curve_points(stages, metric, x)
    return (loaded, seeds, reps, *aggregate(seeds, reps))
