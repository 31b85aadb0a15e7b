"""Math scorers proved on gold answers: MATH-500, AIME 2024/2025, GSM8K."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from kvleague.tasks.math import (
    MATH_SUFFIX,
    aime_integer,
    gsm8k_gold,
    last_boxed,
    last_boxed_span,
    math_equal,
    parse_number,
)
from kvleague.tasks.registry import build_task

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="module")
def math500():
    task = build_task("math500")
    return task, task.load(data_dir=DATA_DIR)


def _perturb(answer: str) -> str:
    """A different final value: a number moved by one, anything else with "+1" appended."""
    n = parse_number(answer)
    if n is not None:
        return str(n + 1) if n.denominator == 1 else f"\\frac{{{n.numerator + 1}}}{{{n.denominator}}}"
    return answer + "+1"


def test_last_boxed_nested_and_last():
    text = r"First \boxed{1}, then \boxed{\frac{a^{2}}{\sqrt{b_{1}}}} and done."
    assert last_boxed(text) == r"\frac{a^{2}}{\sqrt{b_{1}}}"
    assert last_boxed(r"\fbox{ 12 }") == "12"
    assert last_boxed(r"set \boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\boxed{1} and a truncated \boxed{\frac{1}{") is None
    assert last_boxed("no box at all: 42") is None
    text = r"so \boxed{(3, \frac{\pi}{2})}."
    a, b = last_boxed_span(text)
    assert text[a:b] == r"(3, \frac{\pi}{2})"


def test_math_equal_is_symbolic():
    assert math_equal(r"\frac{1}{2}", "0.5")
    assert math_equal(r"\left( 3, \frac{\pi}{2} \right)", r"(3,\pi/2)")
    assert math_equal(r"2\sqrt{2}", r"\sqrt{8}")
    assert math_equal(r"\dfrac{14}{3}", r"\frac{14}{3}")
    assert math_equal(r"\text{Evelyn}", "Evelyn")
    assert not math_equal(r"\frac{1}{2}", r"\frac{1}{3}")
    assert not math_equal(r"2\sqrt{2}", r"\sqrt{6}")
    assert not math_equal(r"(3, \frac{\pi}{2})", r"(3, \pi)")


def test_prompt_has_the_suffix(math500):
    task, samples = math500
    assert len(samples) == 500
    assert all(s.prompt.endswith(MATH_SUFFIX) for s in samples)
    assert MATH_SUFFIX == "Please reason step by step, and put your final answer within \\boxed{}."
    assert len({s.sample_id for s in samples}) == 500


def test_math500_reference_solutions_score_at_least_99(math500):
    task, samples = math500
    results = [task.score(s, s.metadata["solution"]) for s in samples]
    acc = task.aggregate(results)["accuracy"]
    assert acc >= 0.99, [(r.sample_id, r.extracted) for r in results if not r.correct]


def test_math500_changed_final_value_scores_zero(math500):
    task, samples = math500
    wrong = []
    for s in samples:
        sol = s.metadata["solution"]
        a, b = last_boxed_span(sol)
        changed = sol[:a] + _perturb(sol[a:b]) + sol[b:]
        r = task.score(s, changed)
        if r.correct:
            wrong.append((s.sample_id, s.reference, r.extracted))
    assert wrong == []


def test_math500_needs_a_box(math500):
    task, samples = math500
    s = samples[0]
    assert not task.score(s, f"The answer is {s.reference}.").correct
    assert task.score(s, f"... so the answer is $\\boxed{{{s.reference}}}$.").correct


@pytest.mark.parametrize("name", ["aime24", "aime25"])
def test_aime_answers_score_100(name):
    task = build_task(name)
    samples = task.load(data_dir=DATA_DIR)
    assert len(samples) == 30
    plain = [task.score(s, f"Thus the answer is \\boxed{{{int(s.reference)}}}.") for s in samples]
    padded = [task.score(s, f"\\boxed{{{int(s.reference):03d}}}") for s in samples]
    as_given = [task.score(s, f"\\boxed{{{s.reference}}}") for s in samples]
    assert task.aggregate(plain)["accuracy"] == 1.0
    assert task.aggregate(padded)["accuracy"] == 1.0
    assert task.aggregate(as_given)["accuracy"] == 1.0
    off_by_one = [task.score(s, f"\\boxed{{{int(s.reference) + 1}}}") for s in samples]
    assert task.aggregate(off_by_one)["accuracy"] == 0.0


def test_aime24_leading_zero_answers():
    task = build_task("aime24")
    samples = {s.sample_id: s for s in task.load(data_dir=DATA_DIR)}
    zero_padded = [s for s in samples.values() if s.reference.startswith("0")]
    assert len(zero_padded) == 7  # "025", "073", ... (see the data's SOURCE.md)
    for s in zero_padded:
        assert task.score(s, f"\\boxed{{{s.reference.lstrip('0')}}}").correct


def test_aime25_known_answer_key():
    # the official 2025 answer keys, independently of the data file
    key = [
        70,
        588,
        16,
        117,
        279,
        504,
        821,
        77,
        62,
        81,
        259,
        510,
        204,
        60,
        735,
        468,
        49,
        82,
        106,
        336,
        293,
        237,
        610,
        149,
        907,
        113,
        19,
        248,
        104,
        240,
    ]
    task = build_task("aime25")
    samples = task.load(data_dir=DATA_DIR)
    assert [s.sample_id for s in samples[:2]] == ["I-1", "I-2"]
    assert all(task.score(s, f"\\boxed{{{k}}}").correct for s, k in zip(samples, key, strict=True))


def test_aime_integer():
    assert aime_integer("025") == 25
    assert aime_integer(r"\text{073}") == 73
    assert aime_integer("25.0") == 25
    assert aime_integer("2.5") is None
    assert aime_integer("x+1") is None


def test_gsm8k_reference_solutions_score_at_least_99():
    task = build_task("gsm8k")
    samples = task.load(data_dir=DATA_DIR)
    assert len(samples) == 1319
    # the raw worked solutions end with "#### answer"
    raw = [task.score(s, s.metadata["solution"]) for s in samples]
    assert task.aggregate(raw)["accuracy"] >= 0.99
    boxed = [task.score(s, f"So she makes \\boxed{{{s.reference}}} dollars.") for s in samples]
    assert task.aggregate(boxed)["accuracy"] >= 0.99
    wrong = [task.score(s, f"\\boxed{{{parse_number(s.reference) + 1}}}") for s in samples]
    assert task.aggregate(wrong)["accuracy"] == 0.0


def test_gsm8k_numbers():
    assert gsm8k_gold("blah <<2*3=6>>6\n#### 1,000") == "1000"
    assert parse_number("1,000") == 1000
    assert parse_number("$18.00") == 18
    assert parse_number(r"\frac{3}{4}") == Fraction(3, 4)
    assert parse_number("12 apples") is None
    task = build_task("gsm8k")
    s = task.load(data_dir=DATA_DIR)[0]  # Janet's ducks: 18
    assert s.reference == "18"
    assert task.score(s, "She makes 9 * 2 = $18 every day.").correct
    assert task.score(s, "#### 18.0").correct
    assert not task.score(s, "She makes 9 * 2 = $18, i.e. \\boxed{17}").correct
