"""Head-to-head pairs: the 2x2 table counted from the rows, exact McNemar against statsmodels, the
common set (a problem one method lacks is left out; a failed sample is wrong), Holm over the pairs."""

import math
import random

import pytest
from statsmodels.stats.contingency_tables import mcnemar

from dashboard import common_set as cs
from dashboard.head_to_head import exact_mcnemar, pair_row


def _results(outcomes: dict[int, list[int | None]]) -> cs.Results:
    """method -> per-problem outcome: 1 right, 0 wrong, None failed (a sample that raised)."""
    return {m: {(1, f"s{i}", 1, 1, 1): (int(o == 1), 1, int(o is None), 1) for i, o in enumerate(out)}
            for m, out in outcomes.items()}


@pytest.mark.parametrize("b,c", [(0, 0), (0, 5), (6, 0), (9, 2), (3, 3), (12, 30)])
def test_exact_mcnemar_is_statsmodels_exact(b, c):
    assert exact_mcnemar(b, c) == pytest.approx(mcnemar([[10, b], [c, 7]], exact=True).pvalue, abs=1e-12)


def test_pair_row_counts_the_table_from_the_rows():
    rng = random.Random(3)
    a = [rng.randint(0, 1) for _ in range(40)]
    b = [rng.randint(0, 1) for _ in range(40)]
    row = pair_row(_results({1: a, 2: b}), 1, 2, {1: "snapkv", 2: "streaming_llm"})
    both = sum(x and y for x, y in zip(a, b))
    a_only = sum(x and not y for x, y in zip(a, b))
    b_only = sum(y and not x for x, y in zip(a, b))
    assert (row["both right"], row["A only"], row["B only"], row["both wrong"]) == (both, a_only, b_only, 40 - both - a_only - b_only)
    assert row["p"] == pytest.approx(mcnemar([[both, a_only], [b_only, 0]], exact=True).pvalue)
    assert row["Δ A−B (pts)"] == pytest.approx(100 * (sum(a) - sum(b)) / 40)
    assert row["test"] == "exact McNemar" and row["problems"] == 40


def test_pairs_use_the_common_problems_and_failed_counts_as_wrong():
    res = _results({1: [1, 1, 1, None, 1, 1], 2: [0, 0, 0, 1, 0, 0]})
    del res[2][(1, "s5", 1, 1, 1)]  # method 2 never ran problem 5: it is left out of the pair
    row = pair_row(res, 1, 2, {})
    assert row["problems"] == 5
    assert (row["both right"], row["A only"], row["B only"], row["both wrong"]) == (0, 4, 1, 0)
    assert row["p"] == pytest.approx(0.375)  # 2 * P[X <= 1], X ~ Bin(5, 1/2)


def test_several_samples_per_question_fall_back_to_the_score_test():
    res = {m: {(1, f"s{i}", 1, 1, 1): (k, 3, 0, 1) for i, k in enumerate(ks)}
           for m, ks in {1: [3, 2, 3, 3, 2, 3, 3, 3, 2, 3], 2: [0, 1, 0, 1, 0, 0, 1, 0, 0, 1]}.items()}
    row = pair_row(res, 1, 2, {})
    assert row["test"] != "exact McNemar" and math.isnan(row["A only"]) and row["p"] < 0.05
