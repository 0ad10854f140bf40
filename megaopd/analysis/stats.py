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
# A number undefined in more of the resamples than this (a ratio whose curve missed the target) gets no verdict from
# the resamples where it happens to exist: they are not a sample of the number.
MAX_UNDEFINED = 0.05
NOT_MEASURED = "not measured in this study"


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
    return sum(v is not None and not math.isnan(v) for v in values) / len(values) if values else 0.0


def interval_wording(n_seeds: int) -> str:
    """What a report's bracketed interval is, for a study of ``n_seeds`` seeds."""
    level = f"{100 * LEVEL:.0f}%"
    if n_seeds <= 1:
        return (f"{level} percentile bootstrap over the held-out prompts of one seed (training noise is not in it)")
    draws = math.comb(2 * n_seeds - 1, n_seeds)
    text = (f"{level} two-level percentile bootstrap over {n_seeds} seeds: each replicate draws the {n_seeds} seeds "
            f"with replacement ({draws} distinct draws), then one held-out-prompt replicate of each, and averages them")
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


def seed_bootstrap(per_seed: Sequence[Sequence[float | None]], rng: np.random.Generator,
                   replicates: int = REPLICATES) -> list[float | None]:
    """Replicates of the mean over seeds: draw the seeds with replacement, then one prompt-level replicate of each.

    per_seed[s] holds seed s's replicates of the number (None where undefined); a draw with an undefined value
    is undefined. This two-level bootstrap carries both the seed-to-seed spread and each seed's prompt noise.
    """
    arrays = [np.array([np.nan if v is None else v for v in values], dtype=float) for values in per_seed]
    if not arrays or any(a.size == 0 for a in arrays):
        raise ValueError("seed_bootstrap needs at least one replicate for every seed")
    out: list[float | None] = []
    for _ in range(replicates):
        seeds = rng.integers(0, len(arrays), size=len(arrays))
        draws = [arrays[s][rng.integers(0, arrays[s].size)] for s in seeds]
        value = float(np.mean(draws))
        out.append(None if math.isnan(value) else value)
    return out


def holds(value: float, op: str, threshold: float) -> bool:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return {">": value > threshold, ">=": value >= threshold, "<": value < threshold,
            "<=": value <= threshold}[op]


def verdict(interval: tuple[float, float] | None, op: str, threshold: float, point: float | None = None,
            defined: float = 1.0) -> str:
    """A claim "value OP threshold": reproduced when the whole interval satisfies it, not reproduced when none of
    it does, inconclusive when it straddles the threshold or when the number is undefined in more than
    MAX_UNDEFINED of the resamples (``defined``: the share where it exists). Without an interval, the point decides
    (two-way)."""
    if interval is None:
        if point is None:
            return NOT_MEASURED
        return REPRODUCED if holds(point, op, threshold) else NOT_REPRODUCED
    if defined < 1 - MAX_UNDEFINED:
        return INCONCLUSIVE
    lo, hi = interval
    if holds(lo, op, threshold) and holds(hi, op, threshold):
        return REPRODUCED
    if not holds(lo, op, threshold) and not holds(hi, op, threshold):
        return NOT_REPRODUCED
    return INCONCLUSIVE


def combine(verdicts: Sequence[str]) -> str:
    """A finding made of several claims (pairs, domains) holds when all do: one clear failure decides it, else any
    inconclusive claim leaves it inconclusive."""
    measured = [v for v in verdicts if v != NOT_MEASURED]
    if not measured:
        return NOT_MEASURED
    if NOT_REPRODUCED in measured:
        return NOT_REPRODUCED
    return INCONCLUSIVE if INCONCLUSIVE in measured else REPRODUCED
