"""analysis/stats.py on numbers with known answers: percentile intervals, the bootstrap of a Bernoulli mean against
its normal-theory width, the seeds' bootstrap, and the three-way verdict (including intervals that straddle)."""

import math

import numpy as np
import pytest

from megaopd.analysis.stats import (INCONCLUSIVE, NOT_MEASURED, NOT_REPRODUCED, REPRODUCED, combine,
                                    mean_and_se, percentile_interval, resample, seed_bootstrap, verdict)


def test_percentile_interval_is_order_statistics():
    # 1..1000: the 25th and 975th smallest (0-based 25 and 974).
    assert percentile_interval(list(range(1, 1001))) == (26.0, 975.0)
    assert percentile_interval([5.0] * 10) == (5.0, 5.0)
    assert percentile_interval([None, float("nan")]) is None


def test_percentile_interval_orders_infinity_and_skips_undefined():
    # 40 of 100 replicates never reach the target (inf): the upper end is infinite, the lower end finite.
    lo, hi = percentile_interval([float(v) for v in range(60)] + [math.inf] * 40)
    assert lo == 2.0 and math.isinf(hi)  # the 3rd smallest of 100 (0-based floor(0.025 * 100))
    assert percentile_interval([None] * 50 + [1.0] * 50) == (1.0, 1.0)


def test_mean_and_se_of_zero_one_rewards():
    mean, se = mean_and_se([1] * 30 + [0] * 70)
    assert mean == pytest.approx(0.3)
    assert se == pytest.approx(math.sqrt(0.3 * 0.7 / 99))  # sample variance (ddof 1) / n
    assert mean_and_se([1.0]) == (1.0, 0.0)


def test_bootstrap_of_a_bernoulli_mean_matches_normal_theory():
    rewards = np.array([1.0] * 300 + [0.0] * 700)
    rng = np.random.default_rng(0)
    lo, hi = percentile_interval([rewards[resample(rng, rewards.size)].mean() for _ in range(2000)])
    half = 1.96 * math.sqrt(0.3 * 0.7 / 1000)  # 0.0284
    assert lo < 0.3 < hi
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.15)


def test_seed_bootstrap_draws_seeds_then_replicates():
    rng = np.random.default_rng(0)
    # Two seeds without prompt noise: means of two draws from {1, 3} are 1, 2 or 3, each seen.
    values = seed_bootstrap([[1.0], [3.0]], rng, replicates=400)
    assert set(values) == {1.0, 2.0, 3.0}
    assert percentile_interval(values) == (1.0, 3.0)
    # An undefined replicate makes that draw undefined, not zero.
    assert None in seed_bootstrap([[None, 1.0], [2.0]], rng, replicates=50)
    with pytest.raises(ValueError, match="every seed"):
        seed_bootstrap([[1.0], []], rng)


@pytest.mark.parametrize("interval, op, threshold, expected", [
    ((1.2, 3.0), ">", 1.0, REPRODUCED),
    ((0.2, 0.9), ">", 1.0, NOT_REPRODUCED),
    ((0.8, 1.3), ">", 1.0, INCONCLUSIVE),  # straddles: must not be called either way
    ((1.0, 2.0), ">", 1.0, INCONCLUSIVE),  # touching a strict threshold is not above it
    ((-0.05, 0.02), ">=", -0.05, REPRODUCED),
    ((-0.09, -0.02), ">=", -0.05, INCONCLUSIVE),
    ((-0.2, -0.1), ">=", -0.05, NOT_REPRODUCED),
    ((0.0, 0.5), "<", 1.0, REPRODUCED),
    ((0.5, math.inf), "<", 1.0, INCONCLUSIVE),
    ((0.04, 0.08), "<=", 0.1, REPRODUCED),
])
def test_three_way_verdict(interval, op, threshold, expected):
    assert verdict(interval, op, threshold) == expected


def test_verdict_without_interval_uses_the_point_and_rejects_unknown_ops():
    assert verdict(None, ">", 0.0, point=0.3) == REPRODUCED
    assert verdict(None, ">", 0.0, point=-0.3) == NOT_REPRODUCED
    assert verdict(None, ">", 0.0) == NOT_MEASURED
    with pytest.raises(ValueError, match="op must be one of"):
        verdict((0, 1), "=>", 0.0)


def test_combine_one_failure_decides_then_inconclusive():
    assert combine([REPRODUCED, REPRODUCED]) == REPRODUCED
    assert combine([REPRODUCED, INCONCLUSIVE]) == INCONCLUSIVE
    assert combine([INCONCLUSIVE, NOT_REPRODUCED]) == NOT_REPRODUCED
    assert combine([NOT_MEASURED]) == NOT_MEASURED
    assert combine([NOT_MEASURED, REPRODUCED]) == REPRODUCED
