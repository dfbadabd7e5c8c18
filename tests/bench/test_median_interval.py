"""The verdict on a median of many back-to-back pairs (pure): a distribution-free interval from
order statistics, checked against the binomial it is built from and against pairs drawn by hand."""

from __future__ import annotations

import math
import random

import pytest

from bench.common import median_interval, median_verdict

pytestmark = pytest.mark.timeout(30)


def _miss(n: int, k: int) -> float:
    """P(the interval [x_(k), x_(n+1-k)] misses the median) = 2 P(Binomial(n, 1/2) < k)."""
    return 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0**n


@pytest.mark.parametrize("n, k", [(5, 1), (6, 1), (7, 1), (8, 2), (9, 2), (12, 3), (20, 6)])
def test_the_interval_is_the_widest_order_statistics_pair_at_the_level(n, k):
    xs = list(range(n))
    random.Random(n).shuffle(xs)
    ci = median_interval(xs, 0.9)
    assert (ci["low"], ci["high"]) == (k - 1, n - k), ci  # the k-th smallest and the k-th largest
    assert ci["coverage"] == pytest.approx(1.0 - _miss(n, k)) and ci["coverage"] >= 0.9
    assert 1.0 - _miss(n, k + 1) < 0.9  # one step narrower would fall short of the level


def test_too_few_pairs_give_no_interval_and_say_so():
    for xs in ([], [1.0], [0.5, 1.0, 1.5], [0.1, 0.2, 0.3, 0.4]):
        assert median_interval(xs)["coverage"] is None
        assert median_verdict(xs, 2.0) == "too few pairs"


def test_the_verdict_reads_the_interval_not_the_single_pairs():
    spread_low = [-19.7, -1.3, 4.4, 1.0, 0.0, -3.0, 2.0, 1.5, -0.5]  # one pair past 2 %: every-pair verdicts say "unresolved"
    assert median_interval(spread_low)["high"] == 2.0 and median_verdict(spread_low, 2.0) == "yes"
    assert median_verdict([3.0, 5.0, 2.5, 9.0, 4.0], 2.0) == "NO"
    assert median_verdict([-1.0, 0.0, 1.0, 3.0, 4.0], 2.0) == "unresolved"
    assert median_verdict([float("nan"), None, 1.0, 1.0, 1.0, 1.0, 1.0], 2.0) == "yes"  # missing figures are left out
