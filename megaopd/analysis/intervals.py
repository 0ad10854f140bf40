"""Bootstrap intervals for every number of the analysis, and verdicts over one or several seeds (INTERVAL_RULE):
``bootstrap`` resamples one study directory's held-out prompts, ``aggregate`` pools seeds, and ``analyse_seeds``
does both for the report. The statistics themselves are in ``stats``.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from megaopd.analysis.curves import LENGTH_WINDOW, analyse, curve_points, pooled_geometrically
from megaopd.analysis.findings import BY_ID, judge, judged, verdict_of
from megaopd.analysis.runs import Stage, load_study, resample_stage
from megaopd.analysis.stats import (LEVEL, MAX_UNDEFINED, MIN_SEEDS, NOT_REPRODUCED, REPLICATES, REPRODUCED,
                                    UNMEASURED, bounds_interval, defined_fraction, mean_bounds, mean_of,
                                    percentile_interval, resample, seed_bootstrap)

BOOTSTRAP_SEED = 17  # the resamples are drawn from a fixed seed: the same runs give the same report
# FLOPs to a target that a replicate may never reach, and the key of what bounds them then (more than its last eval's)
CENSORED_BY = ({key: f"{key}_more_than" for key in ("grpo_flops", "opd_flops", "reference_flops", "stage_flops",
                                                    "control_flops")}
               | {"merge_flops_to_target": "merge_flops_more_than"})
INTERVAL_RULE = (f"intervals: {int(100 * LEVEL)}% percentile bootstrap, `replicates` resamples (fixed seed). Each "
                 "replicate resamples every domain's test prompts with replacement, once per prompt set, so that "
                 "every eval and every stage on the same prompts sees the same resample (comparisons are paired), "
                 "recomputes every accuracy from the per-prompt results (evals/*.json), then every smoothed curve, "
                 "FLOPs-to-target, ratio, gap and saving; response lengths resample the training steps within the "
                 "first and the last `length_window`. A target a replicate never reaches bounds its FLOPs from below "
                 "(the arm's last eval's FLOPs), and an interval end that falls on such a bound is open. With several "
                 "seeds a replicate also draws the seeds with replacement (then one prompt replicate of each) and "
                 "averages over them, bounds as bounds (CENSORING_RULE). FLOPs themselves carry no interval: the test "
                 "sample does not move them. A verdict is reproduced when the whole interval satisfies the rule, not "
                 "reproduced when none of it does, inconclusive when it straddles the threshold or when the number is "
                 f"undefined in more than {100 * MAX_UNDEFINED:.0f}% of the resamples (the defined ones alone are no "
                 "sample of it), and inconclusive (censored) when an open end leaves it undecided. A decisive verdict "
                 f"over fewer than {MIN_SEEDS} seeds is provisional.")


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


def _check_bounds(findings: list[dict]) -> dict[str, tuple | None]:
    """Each check's bounds by the JSON pointer of its bounds (the key of its replicates)."""
    return {pointer(("findings", i, "checks", label, "bounds")): tuple(c["bounds"])
            for i, f in enumerate(findings) for label, c in f["checks"].items()}


def bootstrap(study_dir: str | Path, study: dict, stages: list[Stage], metric: str = "greedy",
              target_fraction: float = 0.9, window: int = 3, x: str = "stage", length_window: int = LENGTH_WINDOW,
              replicates: int = REPLICATES, seed: int = 0) -> tuple[dict, dict[str, list]]:
    """`analyse` on the measured curves, then on `replicates` resamples (INTERVAL_RULE); returns the result with
    "intervals" (JSON pointer -> [lo, hi], plus the share of replicates where it is defined when not all; None for an
    open end) and the findings' verdicts, and every number's replicates (for the seeds' bootstrap): a check's
    replicates are its bounds."""
    args = (metric, target_fraction, window, x, length_window)
    result = analyse(study_dir, study, stages, *args)
    draws, check_draws = [], []
    if any(s.records for s in stages):
        for b in range(replicates):
            indices: dict[tuple, np.ndarray] = {}

            def draw(domain: str, prompts: dict) -> np.ndarray:  # one resample per prompt set: comparisons paired
                key = (domain, prompts["sha1"], prompts["n"])
                if key not in indices:
                    indices[key] = resample(_rng(seed, b, *key), prompts["n"])
                return indices[key]

            replicate = analyse(study_dir, study, [resample_stage(s, metric, draw, _rng(seed, b, s.name),
                                                                  length_window) for s in stages], *args)
            check_draws.append(_check_bounds(replicate.pop("findings")))
            draws.append(dict(_numbers(replicate)))
    intervals, reps = {}, {}
    for path, value in _numbers({k: v for k, v in result.items() if k != "findings"}):
        values = [d.get(path) for d in draws]
        if path[-1] in CENSORED_BY:  # not reached: more than its bound, how much more unknown
            more = [d.get(path[:-1] + (CENSORED_BY[path[-1]],)) for d in draws]
            interval = bounds_interval([(v, v) if v is not None else (m, None) for v, m in zip(values, more)])
            share = 1.0
        else:
            interval, share = percentile_interval(values), defined_fraction(values)
        reps[pointer(path)] = values
        if interval is None or (tuple(interval) == (value, value) and None not in values):
            continue  # no replicates, or a number the test sample does not move (FLOPs)
        intervals[pointer(path)] = _stored(interval, share)
    for key, bounds in _check_bounds(result["findings"]).items():
        reps[key] = [d.get(key) for d in check_draws]
    result["intervals"] = intervals
    for i, f in enumerate(result["findings"]):
        judge(f, {label: interval for label, c in f["checks"].items()
                  if (interval := _check_interval(reps[pointer(("findings", i, "checks", label, "bounds"))],
                                                  c["bounds"]))})
    return result, reps


def _stored(interval: tuple, share: float) -> list:
    """An interval as the report reads it: [lo, hi], or [lo, hi, share of replicates defined] when some lack it."""
    return list(interval) + ([share] if share < 1 else [])


def _check_interval(draws: list, bounds: list) -> list | None:
    """A check's interval from its replicates' bounds, with the share of them where it is defined; None without
    replicates, or where the test sample does not move it (FLOPs): its bounds decide."""
    if not draws or all(d is not None and list(d) == list(bounds) for d in draws):
        return None
    return list(bounds_interval(draws) or (None, None)) + [defined_fraction(draws)]


def aggregate(seeds: list[dict], reps: list[dict[str, list]]) -> tuple[dict, list[dict]]:
    """Headline numbers (mean, min-max, interval; ratios of FLOPs pooled geometrically, as the findings pool them)
    and one verdict per finding over the seeds (INTERVAL_RULE): each check's mean over the seeds, as bounds where a
    seed's arm was censored, with its two-level bootstrap interval, and how many seeds reproduce it; a decisive
    verdict over fewer than MIN_SEEDS seeds is provisional."""
    rng = np.random.default_rng([BOOTSTRAP_SEED, len(seeds)])
    numbers = [dict(_numbers(s)) for s in seeds]

    spread = {}
    for name in sorted({k for s in seeds for k in s["headline"]}):
        values = [s["headline"][name] for s in seeds if name in s["headline"]]
        path, log = ("headline", name), pooled_geometrically(name)
        if len(seeds) == 1:
            interval = seeds[0]["intervals"].get(pointer(path))
        else:
            per_seed = [reps[k].get(pointer(path)) or [n[path]] for k, n in enumerate(numbers) if path in n]
            draws = seed_bootstrap(per_seed, rng, pool=lambda d: mean_of(d, log)) if len(values) == len(seeds) else []
            interval, share = percentile_interval(draws), defined_fraction(draws)
            interval = _stored(interval, share) if interval else None
        # A number some seed lacks (its arm censored, say) gets no mean: the others alone are no sample of it.
        spread[name] = {"mean": mean_of(values, log) if len(values) == len(seeds) else None, "min": min(values),
                        "max": max(values), "n": len(values), "interval": interval}
    overall = []
    for i, f in enumerate(seeds[0]["findings"]):
        rule = BY_ID[f["id"]]
        labels = list(dict.fromkeys(label for s in seeds for label in s["findings"][i]["checks"]))
        checks = {}
        for label in labels:
            have = [k for k, s in enumerate(seeds) if label in s["findings"][i]["checks"]]
            first = seeds[have[0]]["findings"][i]["checks"][label]
            path = ("findings", i, "checks", label, "bounds")
            bounds = mean_bounds([tuple(seeds[k]["findings"][i]["checks"][label]["bounds"]) for k in have], rule.log)
            if len(seeds) == 1:
                interval, defined = first["interval"], first["defined"]
            else:
                own = [reps[k].get(pointer(path)) or [tuple(seeds[k]["findings"][i]["checks"][label]["bounds"])]
                       for k in have]  # a seed without per-prompt results: its point
                draws = seed_bootstrap(own, rng,
                                       pool=lambda d: mean_bounds(d, rule.log))
                interval, defined = bounds_interval(draws), defined_fraction(draws)
            censored = "; ".join(dict.fromkeys(c for k in have if (c := seeds[k]["findings"][i]["checks"][label]
                                                                   ["censored"])))
            # A seed whose teacher is below the target leaves the pooled check unmeasured: it has no number to pool.
            unmeasured = next((u for k in have if (u := seeds[k]["findings"][i]["checks"][label].get("unmeasured"))),
                              "")
            checks[label] = {**judged(bounds, rule.op, rule.threshold, interval, defined, unmeasured),
                             "group": first["group"],
                             "detail": first["detail"] if len(seeds) == 1 else "mean over seeds",
                             "censored": censored}
        measured = [s["findings"][i]["verdict"] for s in seeds if s["findings"][i]["verdict"] not in UNMEASURED]
        call = verdict_of(checks)
        overall.append({"id": f["id"], "claim": f["claim"], "paper": rule.paper, "verdict": call, "checks": checks,
                        "seeds_reproduced": f"{measured.count(REPRODUCED)} of {len(measured)}",
                        "n_seeds": len(seeds),
                        "provisional": call in (REPRODUCED, NOT_REPRODUCED) and len(seeds) < MIN_SEEDS})
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
