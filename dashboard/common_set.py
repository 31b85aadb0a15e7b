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

from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Hashable, Iterable

from dashboard import ranking, stats

CELL_KEY = ("task_id", "sample_id", "model_id", "protocol_id", "generation_id")
WEIGHTINGS = ("problem", "task")


@dataclass(frozen=True)
class CellResult:
    k: int  # correct samples
    m: int  # samples, failed ones included
    failed: int
    fired: int  # samples where eviction fired


Results = dict[int, dict[tuple, CellResult]]  # method -> cell key -> result


def results_from_rows(rows: Iterable[dict[str, Any]], method_of: Callable[[int], int] = lambda m: m) -> Results:
    """:func:`dashboard.queries.question_cells` rows -> :data:`Results` (``method_of`` maps a spec to the
    method it stands for, e.g. full cache at another budget)."""
    out: Results = defaultdict(dict)
    for r in rows:
        out[method_of(r["method_spec_id"])][tuple(r[k] for k in CELL_KEY)] = CellResult(
            int(r["k"]), int(r["m"]), int(r["failed"] or 0), int(r["fired"] or 0))
    return out


def question_of(cell: tuple) -> tuple:
    return cell[:2]


@dataclass
class CommonSet:
    methods: list[int]
    cells: list[tuple]  # sorted
    results: Results
    weights: dict[tuple, Fraction] = field(default_factory=dict)  # question -> weight

    @property
    def questions(self) -> list[tuple]:
        return sorted({question_of(c) for c in self.cells})

    def _weights(self) -> dict[tuple, Fraction] | None:
        return self.weights or None

    def scores(self, method: int) -> stats.Scores:
        r = self.results[method]
        per_question = stats.question_scores((question_of(c), r[c].k, r[c].m) for c in self.cells)
        return stats.scores_of(per_question, self._weights())

    def differences(self, a: int, b: int) -> stats.Scores:
        ra, rb = self.results[a], self.results[b]
        per_question = stats.question_differences((question_of(c), ra[c].k, ra[c].m, rb[c].k, rb[c].m) for c in self.cells)
        return stats.scores_of(per_question, self._weights())

    def total(self, method: int, what: str) -> int:
        r = self.results[method]
        return sum(getattr(r[c], what) for c in self.cells)

    def accuracy(self, method: int) -> stats.Accuracy:
        return stats.accuracy(self.scores(method), self.total(method, "m"))

    def compare(self, a: int, b: int) -> stats.Comparison:
        return stats.compare(self.differences(a, b))

    def rank_intervals(self) -> dict[int, ranking.RankInterval]:
        scores = {m: self.scores(m) for m in self.methods}
        if not scores or not self.cells:
            return {}
        first = next(iter(scores.values()))
        return ranking.rank_intervals({m: s.values for m, s in scores.items()}, first.weights, first.max_samples)


def common_set(results: Results, methods: Iterable[int], keep: Callable[[tuple], bool] = lambda c: True,
               weighting: str = "problem", stratum: Callable[[tuple], Hashable] | None = None) -> CommonSet:
    """The cells (passing ``keep``) that every method in ``methods`` has. ``stratum(question)`` groups
    questions that weigh the same in total (each domain, for a mean over domains); within a stratum
    ``weighting`` decides between questions and tasks."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    methods = sorted(set(methods))
    cells: set[tuple] | None = None
    for m in methods:
        mine = {c for c in results.get(m, {}) if keep(c)}
        cells = mine if cells is None else cells & mine
    cells_sorted = sorted(cells or (), key=repr)
    questions = sorted({question_of(c) for c in cells_sorted}, key=repr)
    weights: dict[tuple, Fraction] = {}
    if weighting == "task" or stratum is not None:
        per_stratum: dict[Hashable, dict[Hashable, int]] = defaultdict(lambda: defaultdict(int))
        for qn in questions:
            per_stratum[stratum(qn) if stratum else None][qn[0]] += 1
        for qn in questions:
            tasks = per_stratum[stratum(qn) if stratum else None]
            if weighting == "task":
                weights[qn] = Fraction(1, len(tasks) * tasks[qn[0]])
            else:
                weights[qn] = Fraction(1, sum(tasks.values()))
    return CommonSet(methods, cells_sorted, results, weights)
