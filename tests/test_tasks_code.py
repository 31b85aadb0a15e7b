"""Code scorers proved on reference programs: HumanEval, MBPP (sanitized and full test splits)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from kvleague.tasks.base import ScoreResult
from kvleague.tasks.code import extract_code, pass_at_k
from kvleague.tasks.registry import build_task

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="module")
def humaneval(code_sandbox):
    task = build_task("humaneval")
    return task, task.load(data_dir=DATA_DIR)


def test_extract_code():
    fenced = "Here you go:\n```python\ndef f(x):\n    return x + 1\n```\nDone."
    assert extract_code(fenced, "f") == "def f(x):\n    return x + 1\n"
    two = "```python\nimport math\n```\ntext\n```python\ndef g():\n    return 2\n```"
    assert extract_code(two, "g") == "def g():\n    return 2\n"
    assert extract_code(two, None) == "import math\n"
    truncated = "```python\ndef f(x):\n    return x"
    assert extract_code(truncated, "f") == "def f(x):\n    return x"
    raw = "    return x + 1\n"
    assert extract_code(raw, "f") == raw


def test_humaneval_canonical_solutions_pass_164(humaneval):
    task, samples = humaneval
    assert len(samples) == 164
    results = task.score_many([(s, s.reference) for s in samples])
    failed = [(r.sample_id, r.details["status"], r.details["stderr"][-300:]) for r in results if not r.correct]
    assert failed == []
    assert task.aggregate(results)["pass@1"] == 1.0


def test_humaneval_full_function_in_a_fence_passes(humaneval):
    task, samples = humaneval
    chosen = random.Random(0).sample(samples, 6)
    pairs = []
    for s in chosen:
        code = s.metadata["code_prompt"] + s.reference  # signature + docstring + body, imports included
        head = code[code.index(f"def {s.metadata['entry_point']}") :]  # drop the prompt's imports and helpers
        pairs.append((s, f"Sure, here it is.\n\n```python\n{head}```\nThis works because..."))
    results = task.score_many(pairs)
    assert [r.sample_id for r in results if not r.correct] == []


def test_humaneval_truncated_and_wrong_programs_fail(humaneval):
    task, samples = humaneval
    chosen = random.Random(1).sample(samples, 10)
    truncated = [(s, s.reference[: len(s.reference.rstrip()) // 2]) for s in chosen]
    wrong = [(s, "    return None\n") for s in chosen]
    results = task.score_many(truncated + wrong)
    assert [r.sample_id for r in results if r.correct] == []


@pytest.mark.parametrize("name,size", [("mbpp", 257), ("mbpp_full", 500)])
@pytest.mark.usefixtures("code_sandbox")
def test_mbpp_reference_code_passes_99(name, size):
    task = build_task(name)
    samples = task.load(data_dir=DATA_DIR)
    assert len(samples) == size
    assert [int(s.sample_id) for s in samples] == sorted(int(s.sample_id) for s in samples)
    assert all(11 <= int(s.sample_id) <= 510 for s in samples)
    if name == "mbpp_full":  # the full split re-checks the same scorer: a seeded tenth keeps CI fast
        samples = task.load(limit=50, seed=0, data_dir=DATA_DIR)
    results = task.score_many([(s, f"```python\n{s.reference}\n```") for s in samples])
    assert task.aggregate(results)["pass@1"] >= 0.99, [r.sample_id for r in results if not r.correct]


@pytest.mark.usefixtures("code_sandbox")
def test_mbpp_wrong_and_truncated_programs_fail():
    task = build_task("mbpp")
    samples = task.load(limit=8, seed=3, data_dir=DATA_DIR)
    wrong = []
    for s in samples:
        name = s.metadata["entry_point"]
        wrong.append((s, f"def {name}(*args, **kwargs):\n    return None\n"))
    truncated = [(s, s.reference[: len(s.reference) // 2]) for s in samples]
    results = task.score_many(wrong + truncated)
    assert [r.sample_id for r in results if r.correct] == []


def _pass_at_k_brute(n: int, c: int, k: int) -> float:
    """Probability that a uniformly drawn k-subset of n completions (c correct) has a correct one."""
    items = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(items[i] for i in sub) for sub in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 1, 1), (5, 2, 3), (6, 3, 2), (8, 1, 5), (10, 4, 10), (7, 7, 3)])
def test_pass_at_k_matches_brute_force(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_brute(n, c, k))


def test_aggregate_groups_completions_by_sample():
    task = build_task("humaneval")
    # sample a: 1 of 5 correct; sample b: 4 of 5 correct
    results = [ScoreResult(correct=i < 1, score=float(i < 1), extracted=None, sample_id="a") for i in range(5)]
    results += [ScoreResult(correct=i < 4, score=float(i < 4), extracted=None, sample_id="b") for i in range(5)]
    agg = task.aggregate(results)
    assert agg["n"] == 10 and agg["n_samples"] == 2
    assert agg["pass@1"] == pytest.approx((1 / 5 + 4 / 5) / 2)
    assert agg["pass@5"] == pytest.approx(1.0)
    assert "pass@10" not in agg
