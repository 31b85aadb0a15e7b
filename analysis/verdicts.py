"""One verdict per comparison: the test, p, adjusted p, interval and verdict word of every comparison any
page or the report shows come from :func:`decide`, under a family declared in ``analysis/paper.yaml``
(``verdicts``) before any result is read.

* A comparison is one method against one reference (one claim) in one stratum (a domain, a task...), on
  the questions both have (never on a set that depends on which other methods are present).
* A family is the comparisons of one (method, reference, claim, budget...) across the strata its
  declaration names (``across``); Holm's adjustment runs within it. The family key always holds the
  method and the reference (paper.py refuses a declaration that spans them), so **adding a method
  cannot change the adjusted p or the verdict of a comparison that does not involve it**.
* The word: the (adjusted) test rejects: "higher" / "lower" (or, for a claim, "replicates" / "does not
  replicate"); else "equivalent within ±margin" when the two one-sided tests at the declared margin
  reject (the ``1 - 2 alpha/m`` interval of the same test, Bonferroni over the family's m members, lies
  inside ±margin); else "inconclusive". "Not significant" is never read as "no difference".
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from kvleague.analysis import multiplicity
from kvleague.analysis.paper import MARGINS, VERDICT_ALPHA, VERDICT_FAMILIES
from kvleague.analysis.stats import MIN_PROBLEMS, NOT_MEASURED, TOO_FEW, Comparison

INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Tested:
    """One comparison as its test computed it: ``estimate`` (method minus reference), the interval that
    inverts ``test`` at 95%, the test's two-sided p at 0, the questions paired, and ``interval(level)``,
    the same inversion at another level (for the equivalence test)."""

    estimate: float
    lo: float
    hi: float
    p: float
    test: str
    n: int
    interval: Callable[[float], tuple[float, float]]


@dataclass(frozen=True)
class Verdict:
    estimate: float
    lo: float
    hi: float
    test: str
    n: int
    p: float
    p_adjusted: float
    family: str  # "<declared family> (m comparisons, Holm)"
    margin: float  # the equivalence margin tested
    equivalent: bool  # the two one-sided tests at ±margin reject
    word: str


def _word(t: Tested, p_adj: float, equivalent: bool, margin_text: str, words: tuple[str, str]) -> str:
    if t.n == 0 or p_adj is None or math.isnan(p_adj):
        return NOT_MEASURED
    if t.n < MIN_PROBLEMS:
        return TOO_FEW
    if p_adj < VERDICT_ALPHA:
        return words[0] if t.estimate > 0 else words[1]
    if equivalent:
        return f"equivalent within ±{margin_text}"
    return INCONCLUSIVE


def from_comparison(c: Comparison, at_level: Callable[[float], Comparison]) -> Tested:
    """A paired accuracy comparison (:func:`analysis.stats.compare`: Tango's score test, or exact McNemar
    with the interval reaching 0 where it does not reject)."""
    return Tested(c.diff, c.lo, c.hi, c.pvalue, c.test, c.n, lambda level: (at_level(level).lo, at_level(level).hi))


def margin_text(margin_name: str, margin: float) -> str:
    return f"{100 * margin:g} pts" if margin_name == "accuracy" else f"{margin:g} nats"


def decide(
    family: str,
    comparisons: Sequence[tuple[Mapping[str, Hashable], Tested]],
    words: tuple[str, str] = ("higher", "lower"),
) -> list[Verdict]:
    """The verdicts of ``comparisons`` (each with its key: method, reference, claim and strata fields) under
    the declared ``family``: comparisons whose keys agree outside the family's ``across`` fields form one
    Holm family. ``words``: what a rejection says when the estimate is above / below 0."""
    across, adjust, margin_name = VERDICT_FAMILIES[family]
    margin = MARGINS[margin_name]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (key, t) in enumerate(comparisons):
        if not {"method", "reference"} <= set(key):
            raise ValueError(f"a comparison's key must name its method and reference, got {sorted(key)}")
        if t.n >= MIN_PROBLEMS and not math.isnan(t.p):  # a comparison without a verdict joins no family
            groups[tuple(sorted((k, v) for k, v in key.items() if k not in across))].append(i)
    adjusted = [t.p for _, t in comparisons]
    size = [1] * len(comparisons)
    if adjust == "holm":
        for members in groups.values():
            for i, p in zip(members, multiplicity.holm([comparisons[i][1].p for i in members])):
                adjusted[i], size[i] = p, len(members)
    out = []
    for i, (_key, t) in enumerate(comparisons):
        level = 1 - 2 * VERDICT_ALPHA / size[i]
        lo, hi = t.interval(level) if t.n >= MIN_PROBLEMS else (math.nan, math.nan)
        equivalent = -margin < lo and hi < margin
        label = f"{family} ({size[i]} comparison{'s' if size[i] > 1 else ''}, {'Holm' if adjust == 'holm' else 'not adjusted'})"
        out.append(
            Verdict(
                t.estimate,
                t.lo,
                t.hi,
                t.test,
                t.n,
                t.p,
                adjusted[i],
                label,
                margin,
                equivalent,
                _word(t, adjusted[i], equivalent, margin_text(margin_name, margin), words),
            )
        )
    return out
