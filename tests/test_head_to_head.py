"""Head-to-head pairs: the 2x2 table counted from the rows, McNemar (exact below 25 discordant pairs)
against statsmodels, the common set (a problem one method lacks is left out; a failed sample is wrong)."""

import math
import random

import pytest
from statsmodels.stats.contingency_tables import mcnemar

from kvleague.analysis import common_set as cs
from kvleague.analysis import stats
from kvleague.analysis.head_to_head import pair_row
from kvleague.analysis.tables import Slice


def _results(outcomes: dict[int, list[int | None]]) -> cs.Results:
    """method -> per-problem outcome: 1 right, 0 wrong, None failed (a sample that raised)."""
    return {
        m: {(1, f"s{i}", 1, 1, 1): (int(o == 1), 1, int(o is None), 1) for i, o in enumerate(out)}
        for m, out in outcomes.items()
    }


def _pair(b: int, c: int, concordant: int = 17) -> dict:
    """A pair with ``b`` problems only A gets right, ``c`` only B, and ``concordant`` both or neither."""
    return pair_row(
        Slice(_results({1: [1] * b + [0] * c + [1] * concordant, 2: [0] * b + [1] * c + [1] * concordant}), None),
        1,
        2,
        {},
    )


@pytest.mark.parametrize("b,c", [(0, 0), (0, 5), (6, 0), (9, 2), (3, 3), (2, 10)])
def test_few_discordant_pairs_get_exact_mcnemar_and_an_interval_that_agrees(b, c):
    row = _pair(b, c)
    assert row["test"] == "exact McNemar"
    assert row["p"] == pytest.approx(mcnemar([[10, b], [c, 7]], exact=True).pvalue, abs=1e-12)
    # the interval goes with the adjusted test (analysis/verdicts.py): it excludes 0 exactly when that rejects
    assert row["p (adj.)"] == pytest.approx(min(1.0, 4 * row["p"]))
    assert (row["p (adj.)"] < 0.05) == (row["Δ lo"] > 0 or row["Δ hi"] < 0)


def test_many_discordant_pairs_get_mcnemars_score_test():
    row = _pair(12, 30)
    assert row["test"] == stats.TEST_NAME
    assert row["p"] == pytest.approx(mcnemar([[10, 12], [30, 7]], exact=False, correction=False).pvalue, rel=1e-9)


def test_pair_row_counts_the_table_from_the_rows():
    rng = random.Random(3)
    a = [rng.randint(0, 1) for _ in range(40)]
    b = [rng.randint(0, 1) for _ in range(40)]
    row = pair_row(Slice(_results({1: a, 2: b}), None), 1, 2, {1: "snapkv", 2: "streaming_llm"})
    both = sum(x and y for x, y in zip(a, b))
    a_only = sum(x and not y for x, y in zip(a, b))
    b_only = sum(y and not x for x, y in zip(a, b))
    assert (row["both right"], row["A only"], row["B only"], row["both wrong"]) == (
        both,
        a_only,
        b_only,
        40 - both - a_only - b_only,
    )
    assert row["p"] == pytest.approx(mcnemar([[both, a_only], [b_only, 0]], exact=True).pvalue)
    assert row["Δ A−B (pts)"] == pytest.approx(100 * (sum(a) - sum(b)) / 40)
    assert row["test"] == "exact McNemar" and row["problems"] == 40


def test_pairs_use_the_common_problems_and_failed_counts_as_wrong():
    res = _results({1: [1, 1, 1, None, 1, 1], 2: [0, 0, 0, 1, 0, 0]})
    del res[2][(1, "s5", 1, 1, 1)]  # method 2 never ran problem 5: it is left out of the pair
    row = pair_row(Slice(res, None), 1, 2, {})
    assert row["problems"] == 5
    assert (row["both right"], row["A only"], row["B only"], row["both wrong"]) == (0, 4, 1, 0)
    assert row["p"] == pytest.approx(0.375)  # 2 * P[X <= 1], X ~ Bin(5, 1/2)


def test_several_samples_per_question_fall_back_to_the_score_test():
    res = {
        m: {(1, f"s{i}", 1, 1, 1): (k, 3, 0, 1) for i, k in enumerate(ks)}
        for m, ks in {1: [3, 2, 3, 3, 2, 3, 3, 3, 2, 3], 2: [0, 1, 0, 1, 0, 0, 1, 0, 0, 1]}.items()
    }
    row = pair_row(Slice(res, None), 1, 2, {})
    assert row["test"] != "exact McNemar" and math.isnan(row["A only"]) and row["p"] < 0.05
