"""Uncertainty for the study report: bootstrap intervals and three-way verdicts, as pure functions on numbers.

The report resamples held-out prompts (and seeds, when there are several) and recomputes every number from each
resample; this module holds the statistics around that: percentile intervals from the replicates, the standard
error of an accuracy, the seed-level bootstrap of a mean, and the verdict of a claim "value OP threshold" given an
interval (reproduced / not reproduced / inconclusive when the interval straddles the threshold).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LEVEL = 0.95  # two-sided coverage of every interval
REPLICATES = 1000  # bootstrap replicates per study directory
OPS = (">", ">=", "<", "<=")
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
# Inconclusive because an arm stopped before the target: its number is only bounded on one side (``Bounds``), and the
# bound does not settle the claim. A run with more budget could decide it.
CENSORED = "inconclusive (censored)"
# A decisive verdict over fewer seeds is provisional: two seeds' bootstrap is little more than their range.
MIN_SEEDS = 3
# A number undefined in more of the resamples than this (a ratio whose curve missed the target) gets no verdict from
# the resamples where it happens to exist: they are not a sample of the number.
MAX_UNDEFINED = 0.05
NOT_MEASURED = "not measured in this study"
# A target above the external teacher's own validation accuracy (megaopd/teachers/check.py): OPD could never reach
# it, so the check would measure the teacher, not the method.
TEACHER_BELOW = "not measured (teacher below target)"

# A number known to lie in [lo, hi]: lo == hi when measured; None on a side where it is unbounded, as when an arm
# stopped before a target (its FLOPs to it: more than it spent, no more known). Never 0, inf or -inf for "never".
Bounds = tuple[float | None, float | None]


def percentile_interval(values: Sequence[float | None], level: float = LEVEL) -> tuple[float, float] | None:
    """Percentile interval from order statistics (values may be +-inf; None and nan count as undefined).

    The lower end is the floor(a/2 * n)-th smallest defined value and the upper the ceil((1 - a/2) * n)-th, so
    that infinite values (a target never reached) order correctly without interpolating. None if none is defined.
    """
    defined = sorted(v for v in values if v is not None and not math.isnan(v))
    if not defined:
        return None
    tail = (1 - level) / 2
    lo = defined[min(len(defined) - 1, math.floor(tail * len(defined)))]
    hi = defined[max(0, math.ceil((1 - tail) * len(defined)) - 1)]
    return float(lo), float(hi)


def defined_fraction(values: Sequence[float | None]) -> float:
    """Share of replicates where the number exists (e.g. a ratio needs both curves to reach the target)."""
    return (sum(v is not None and not (isinstance(v, float) and math.isnan(v)) for v in values) / len(values)
            if values else 0.0)


def interval_wording(n_seeds: int) -> str:
    """What a report's bracketed interval is, for a study of ``n_seeds`` seeds."""
    level = f"{100 * LEVEL:.0f}%"
    if n_seeds <= 1:
        return (f"{level} percentile bootstrap over the test prompts of one seed (training noise is not in it)")
    draws = math.comb(2 * n_seeds - 1, n_seeds)
    text = (f"{level} two-level percentile bootstrap over {n_seeds} seeds: each replicate draws the {n_seeds} seeds "
            f"with replacement ({draws} distinct draws), then one test-prompt replicate of each, and averages them")
    if n_seeds == 2:
        text += ("; with 2 seeds a draw is both seeds or one of them twice, so the interval is little more than the "
                 "range of the two seeds plus prompt noise, not a 95% interval of seed-to-seed variation")
    return text


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error, sqrt(sample variance / n) (for 0/1 rewards: ~sqrt(p(1-p)/n)); se 0 if n < 2."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("mean_and_se of no values")
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0
    return float(x.mean()), se


def linear_trend(values: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope of values against their index, and its standard error (residual variance over the
    index's sum of squares, n - 2 degrees of freedom); needs three values or more."""
    y = np.asarray(values, dtype=float)
    if y.size < 3:
        raise ValueError(f"a trend needs at least 3 values, got {y.size}")
    x = np.arange(y.size) - (y.size - 1) / 2
    slope = float((x * (y - y.mean())).sum() / (x * x).sum())
    residual = y - y.mean() - slope * x
    return slope, float(math.sqrt((residual * residual).sum() / (y.size - 2) / (x * x).sum()))


def resample(rng: np.random.Generator, n: int) -> np.ndarray:
    """n indices drawn with replacement from range(n): one bootstrap resample of n items."""
    return rng.integers(0, n, size=n)


def seed_bootstrap(per_seed: Sequence[Sequence], rng: np.random.Generator, replicates: int = REPLICATES,
                   pool=None) -> list:
    """Replicates of the mean over seeds: draw the seeds with replacement, then one prompt-level replicate of each.

    per_seed[s] holds seed s's replicates of the number (None or nan where undefined); a draw with an undefined
    value is undefined. This two-level bootstrap carries both the seed-to-seed spread and each seed's prompt noise.
    ``pool`` averages one draw (default: the mean of numbers; ``mean_bounds`` for bounded numbers).
    """
    if not per_seed or any(len(values) == 0 for values in per_seed):
        raise ValueError("seed_bootstrap needs at least one replicate for every seed")
    pool = pool or (lambda draws: float(np.mean(draws)))
    out = []
    for _ in range(replicates):
        seeds = rng.integers(0, len(per_seed), size=len(per_seed))
        draws = [per_seed[s][rng.integers(0, len(per_seed[s]))] for s in seeds]
        undefined = any(d is None or (isinstance(d, float) and math.isnan(d)) for d in draws)
        out.append(None if undefined else pool(draws))
    return out


def mean_bounds(values: Sequence[Bounds], log: bool = False) -> Bounds:
    """The mean of numbers each known only within its bounds (the geometric mean with ``log``, for ratios): it lies
    between the mean of their lower bounds and the mean of their upper ones, and is unbounded on a side where any of
    them is. A censored seed stays a bound; it never becomes a number."""
    def side(ends: list[float | None]) -> float | None:
        if any(e is None or (log and e <= 0) for e in ends):
            return None
        return float(np.exp(np.mean(np.log(ends)))) if log else float(np.mean(ends))

    return side([b[0] for b in values]), side([b[1] for b in values])


def mean_of(values: Sequence[float], log: bool = False) -> float | None:
    """The mean of numbers, the geometric one with ``log`` (ratios; None where one is not positive)."""
    return mean_bounds([(v, v) for v in values], log)[0]


def bounds_interval(draws: Sequence[Bounds | None], level: float = LEVEL) -> Bounds | None:
    """Percentile interval of a bounded number's replicates (None where undefined): the lower end is the order
    statistic of their lower bounds, an unbounded one below every number, and the upper end that of their upper
    bounds; None on a side where the order statistic is unbounded, and None if no replicate is defined."""
    defined = [d for d in draws if d is not None]
    if not defined:
        return None
    tail, n = (1 - level) / 2, len(defined)
    lows = sorted(defined, key=lambda d: (d[0] is not None, d[0] or 0.0))
    highs = sorted(defined, key=lambda d: (d[1] is None, d[1] or 0.0))
    return lows[min(n - 1, math.floor(tail * n))][0], highs[max(0, math.ceil((1 - tail) * n) - 1)][1]


def holds(value: float, op: str, threshold: float) -> bool:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return {">": value > threshold, ">=": value >= threshold, "<": value < threshold,
            "<=": value <= threshold}[op]


def verdict(interval: Bounds | None, op: str, threshold: float, point: float | None = None,
            defined: float = 1.0) -> str:
    """A claim "value OP threshold": reproduced when the whole interval satisfies it, not reproduced when none of
    it does, inconclusive when it straddles the threshold or when the number is undefined in more than
    MAX_UNDEFINED of the resamples (``defined``: the share where it exists). An interval end may be None (a censored
    arm: unbounded on that side): the claim is then decided only where the bounded end settles it, else it is
    CENSORED. Without an interval, the point decides (two-way)."""
    if interval is None:
        if point is None:
            return NOT_MEASURED
        return REPRODUCED if holds(point, op, threshold) else NOT_REPRODUCED
    if defined < 1 - MAX_UNDEFINED:
        return INCONCLUSIVE
    lo, hi = interval
    # Every value of the interval holds when its far end does (its lower end for > and >=), none when its near
    # end fails.
    far, near = (lo, hi) if op in (">", ">=") else (hi, lo)
    if far is not None and holds(far, op, threshold):
        return REPRODUCED
    if near is not None and not holds(near, op, threshold):
        return NOT_REPRODUCED
    return CENSORED if None in interval else INCONCLUSIVE


UNMEASURED = (NOT_MEASURED, TEACHER_BELOW)


def unmeasured(verdicts: Sequence[str]) -> str:
    """Why none of `verdicts` was measured: the teacher below the target where that was the reason."""
    return TEACHER_BELOW if TEACHER_BELOW in verdicts else NOT_MEASURED


def agree(verdicts: Sequence[str]) -> str:
    """One claim measured several ways (a pair's two targets): decisive only where they all say the same; a
    reproduced beside a not reproduced is inconclusive."""
    measured = [v for v in verdicts if v not in UNMEASURED]
    if not measured:
        return unmeasured(verdicts)
    if len(set(measured)) == 1:
        return measured[0]
    return CENSORED if CENSORED in measured else INCONCLUSIVE


def combine(verdicts: Sequence[str]) -> str:
    """A finding made of several claims (pairs, domains) holds when all do: one clear failure decides it, else any
    inconclusive claim leaves it inconclusive."""
    measured = [v for v in verdicts if v not in UNMEASURED]
    if not measured:
        return unmeasured(verdicts)
    if NOT_REPRODUCED in measured:
        return NOT_REPRODUCED
    for undecided in (INCONCLUSIVE, CENSORED):
        if undecided in measured:
            return undecided
    return REPRODUCED
