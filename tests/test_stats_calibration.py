"""The simulation harness of issue 15: under a true null each test rejects about 5% of the time and
each 95% interval covers the truth about 95% of the time, at n = 10, 30, 100 questions with 1 and 3
samples per question (asserted within 1.5 points on the anti-conservative side; conservative is
allowed, as it must be for discrete data). n = 5 is measured by runner/bench/stats_calibration.py and
flagged "too few problems" on the pages. Fixed seeds; 3,000 replicates per cell (Monte Carlo
standard error ~0.4 points), so this is a tripwire for a broken procedure, and docs/statistics.md
has the 4,000-replicate table."""

from __future__ import annotations

import pytest

from kvleague.analysis import calibration

REPS = 3000
TOLERANCE = 0.015


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n", [10, 30, 100])
def test_paired_test_level_and_interval_coverage(n, m):
    null = calibration.paired(n, m, REPS, 0.0, seed=100 * n + m)
    assert null.rejection <= 0.05 + TOLERANCE, null
    shifted = calibration.paired(n, m, REPS, calibration.ALTERNATIVE_SHIFT, seed=100 * n + m + 1)
    assert shifted.coverage >= 0.95 - TOLERANCE, shifted
    assert shifted.rejection == pytest.approx(1 - shifted.coverage, abs=0.002)  # the test is the interval's dual


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n", [10, 30, 100])
def test_accuracy_interval_coverage(n, m):
    cal = calibration.accuracy(n, m, REPS, seed=100 * n + m + 2)
    assert cal.coverage >= 0.95 - TOLERANCE and cal.rejection <= 0.05 + TOLERANCE, cal


def test_the_harness_sees_a_miscalibrated_procedure():
    """A 70% interval presented as the test's acceptance region rejects the null ~30% of the time."""
    cal = calibration.paired(100, 3, 400, 0.0, seed=7, level=0.70)
    assert 0.2 < cal.rejection < 0.4


def test_true_difference_against_the_closed_form():
    # Beta(2, 2), density 6 p (1 - p): E[min(p + s, 1) - p] = s - int_{1-s}^1 (p - 1 + s) 6 p (1 - p) dp
    #                                                         = s - s^3 + s^4 / 2
    for s in (0.05, 0.1, 0.3):
        assert calibration.true_difference(s) == pytest.approx(s - s**3 + s**4 / 2, abs=1e-10)
