"""Pairing done once: the problem cells every compared method has, and the numbers computed on them.

A *cell* is one problem under one model, protocol and generation setting (``CELL_KEY``); a
*question* is ``(task_id, sample_id)``, the statistical unit (its cells are clustered in it). For a
group of methods the common set is the cells every one of them has a row for, ok or failed; a
failed sample counts as wrong. Accuracies, differences, failure counts and ranks shown side by side
are all computed on this one set, so a difference is exactly the difference of the accuracies beside it.

Pooling questions of several tasks states its weighting: ``"problem"`` (each question weighs the
same, so math500 outweighs aime24 by 500 : 30) or ``"task"`` (each task weighs the same).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from kvleague.analysis import queries as q
from kvleague.analysis import stats

CELL_KEY = ("task_id", "sample_id", "model_id", "protocol_id", "generation_id")
WEIGHTINGS = ("problem", "task")


class CellResult(NamedTuple):
    k: int  # correct samples
    m: int  # samples, failed ones included
    failed: int
    fired: int  # samples where eviction fired


Results = dict[int, dict[tuple, CellResult]]  # method -> cell key -> result
K, M, FAILED, FIRED = range(4)  # CellResult's positions, for the (cells, 4) arrays
assert q.QUESTION_CELL_COLUMNS[2:7] == CELL_KEY and q.QUESTION_CELL_COLUMNS[7:] == CellResult._fields


def results_from_rows(rows: Iterable[tuple]) -> Results:
    """:func:`analysis.queries.question_cells` rows -> :data:`Results` (the columns are laid out so that
    the cell key and the result are two slices)."""
    out: Results = defaultdict(dict)
    for r in rows:
        out[r[0]][r[2:7]] = CellResult._make(r[7:11])
    return out


def question_of(cell: tuple) -> tuple:
    return cell[:2]


@dataclass
class CommonSet:
    methods: list[int]
    cells: list[tuple]  # sorted
    results: Results
    weights: dict[tuple, Fraction] = field(default_factory=dict)  # question -> weight; empty: all 1

    def __post_init__(self) -> None:
        self.questions = sorted({question_of(c) for c in self.cells}, key=repr)
        position = {qn: i for i, qn in enumerate(self.questions)}
        self._question_of_cell = np.array([position[question_of(c)] for c in self.cells], dtype=np.int64)
        cells_per_question = np.bincount(self._question_of_cell, minlength=len(self.questions))
        # one denominator for every method's question scores: lcm of the sample counts times lcm of the
        # cells per question, so a score is (sum over cells of k * M / m) * (L / cells) / (M * L)
        sample_counts = {r[M] for m in self.methods for c in self.cells if (r := self.results[m][c])[M]}
        self._m_lcm = math.lcm(*sample_counts) if sample_counts else 1
        cells_lcm = math.lcm(*{int(x) for x in cells_per_question}) if self.cells else 1
        self.denominator = self._m_lcm * cells_lcm
        self._cell_scale = (cells_lcm // np.maximum(cells_per_question, 1))[self._question_of_cell]
        distinct = sorted(set(self.weights.values())) or [Fraction(1)]
        index = {w: i for i, w in enumerate(distinct)}
        self._group = np.array(
            [index[self.weights[qn]] if self.weights else 0 for qn in self.questions], dtype=np.int64
        )
        self._group_weights = tuple(distinct)
        self._arrays: dict[int, np.ndarray] = {}
        self._cache: dict[int, tuple[np.ndarray, int]] = {}
        self._accuracy: dict[int, stats.Accuracy] = {}

    def _cell_array(self, method: int) -> np.ndarray:
        """``(cells, 4)`` integers: k, m, failed, fired per common cell."""
        if method not in self._arrays:
            r = self.results[method]
            self._arrays[method] = np.array([r[c] for c in self.cells], dtype=np.int64).reshape(len(self.cells), 4)
        return self._arrays[method]

    def _per_question(self, method: int) -> tuple[np.ndarray, int]:
        """Question-score numerators over :attr:`denominator` and the most samples behind one question."""
        if method not in self._cache:
            a = self._cell_array(method)
            k, m = a[:, K], a[:, M]
            per_cell = k * (self._m_lcm // np.maximum(m, 1)) * self._cell_scale
            n = len(self.questions)
            sums = np.bincount(self._question_of_cell, weights=per_cell, minlength=n)  # exact below 2^53
            samples = np.bincount(self._question_of_cell, weights=m, minlength=n)
            self._cache[method] = (np.rint(sums).astype(np.int64), int(samples.max()) if n else 1)
        return self._cache[method]

    def _scores(self, numerators: np.ndarray, max_samples: int) -> stats.Scores:
        return stats.Scores(numerators, self.denominator, self._group, self._group_weights, max(1, max_samples))

    def scores(self, method: int) -> stats.Scores:
        return self._scores(*self._per_question(method))

    def differences(self, a: int, b: int) -> stats.Scores:
        (num_a, max_a), (num_b, max_b) = self._per_question(a), self._per_question(b)
        return self._scores(num_a - num_b, max(max_a, max_b))

    def total(self, method: int, what: str) -> int:
        """Sum over the common cells of ``"m"`` (samples), ``"failed"`` or ``"fired"``."""
        return int(self._cell_array(method)[:, {"m": M, "failed": FAILED, "fired": FIRED}[what]].sum())

    def accuracy(self, method: int) -> stats.Accuracy:
        if method not in self._accuracy:  # the table, its best and its wide view all read it
            self._accuracy[method] = stats.accuracy(self.scores(method), self.total(method, "m"))
        return self._accuracy[method]

    def compare(self, a: int, b: int, level: float = stats.LEVEL) -> stats.Comparison:
        return stats.compare(self.differences(a, b), level)


def common_set(
    results: Results,
    methods: Iterable[int],
    tasks: set[int] | None = None,
    weighting: str = "problem",
    stratum: Callable[[tuple], Hashable] | None = None,
) -> CommonSet:
    """The cells (of ``tasks``, default all) that every method in ``methods`` has. ``stratum(question)``
    groups questions that weigh the same in total (each domain, for a mean over domains); within a
    stratum ``weighting`` decides between questions and tasks."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    methods = sorted(set(methods))
    cells: set[tuple] | None = None
    for m in methods:
        mine = {c for c in results.get(m, {}) if tasks is None or c[0] in tasks}
        cells = mine if cells is None else cells & mine
    cells_sorted = sorted(cells or (), key=repr)
    weights: dict[tuple, Fraction] = {}
    if weighting == "task" or stratum is not None:
        questions = sorted({question_of(c) for c in cells_sorted}, key=repr)
        per_stratum: dict[Hashable, dict[Hashable, int]] = defaultdict(lambda: defaultdict(int))
        for qn in questions:
            per_stratum[stratum(qn) if stratum else None][qn[0]] += 1
        for qn in questions:
            tasks_here = per_stratum[stratum(qn) if stratum else None]
            weights[qn] = (
                Fraction(1, len(tasks_here) * tasks_here[qn[0]])
                if weighting == "task"
                else Fraction(1, sum(tasks_here.values()))
            )
    return CommonSet(methods, cells_sorted, results, weights)
