"""One verdict per comparison: every page and the report take a comparison's test, p, adjusted p, interval and
verdict word from :func:`judge`, under the rule declared in ``analysis/paper.yaml`` (``verdicts``) before any
result is read.

* A comparison is one method against one reference (one measure, claim, budget, protocol) in one slice, on
  the questions the two have: never on a set that depends on which other methods are present.
* Its family is the same pair's comparisons across the declared domains (``FAMILY_DOMAINS``), whatever the
  data holds: the adjusted p is Bonferroni's ``min(1, m p)`` and the interval is the same test's inverted at
  ``1 - alpha / m``, so **the interval excludes 0 exactly when the adjusted test rejects**, and both come from
  the comparison alone: adding a method (or a domain's results, or looking from another page) cannot move them.
* The word: the adjusted test rejects: "higher" / "lower" (a claim: "replicates" / "does not replicate");
  else "equivalent within ±margin" when both one-sided tests at the declared margin reject (the
  ``1 - 2 alpha / m`` interval lies inside ±margin, TOST); else "inconclusive". Not significant is never
  read as no difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvleague.analysis.paper import FAMILY_DOMAINS, MARGINS, VERDICT_ALPHA
from kvleague.analysis.stats import MIN_PROBLEMS, NOT_MEASURED, TOO_FEW, Comparison, shifted_pvalue

INCONCLUSIVE = "inconclusive"
FAMILY_SIZE = len(FAMILY_DOMAINS)
#: the level of every interval shown beside a verdict
LEVEL = 1 - VERDICT_ALPHA / FAMILY_SIZE
LEVEL_TEXT = f"{100 * LEVEL:g}%"
FAMILY_TEXT = (
    f"Bonferroni over the pair's {FAMILY_SIZE} declared domains ({', '.join(FAMILY_DOMAINS)}): "
    f"p adj = min(1, {FAMILY_SIZE} p), interval at {LEVEL_TEXT}"
)


@dataclass(frozen=True)
class Tested:
    """One comparison as its test computed it: the estimate (method minus reference), the test's two-sided p
    at 0, its name, the questions paired, and ``interval(level)``, the set of values the same test does not
    reject at ``1 - level``."""

    estimate: float
    p: float
    test: str
    n: int
    interval: Callable[[float], tuple[float, float]]
    #: the same test's two-sided p of ``difference = delta`` where it has one (the equivalence test then needs
    #: no second interval: TOST by its two one-sided p-values, the dual of the interval inclusion)
    p_at: Callable[[float], float] | None = None


@dataclass(frozen=True)
class Verdict:
    estimate: float
    lo: float  # at LEVEL: excludes 0 exactly when p_adjusted < alpha
    hi: float
    test: str
    n: int
    p: float
    p_adjusted: float
    margin: float  # the equivalence margin tested
    equivalent: bool
    word: str


def margin_text(measure: str) -> str:
    m = MARGINS[measure]
    return f"{100 * m:g} pts" if measure == "accuracy" else f"{m:g} nats/token"


def judge(t: Tested, measure: str, words: tuple[str, str] = ("higher", "lower"), equivalence: bool = True) -> Verdict:
    """The verdict of one comparison. ``measure``: ``accuracy`` or ``kl`` (its margin); ``words``: what a
    rejection says when the estimate is above / below 0; ``equivalence``: False for a claim tested at a
    margin already (non-inferiority), whose non-rejection is inconclusive."""
    margin = MARGINS[measure]
    if t.n == 0 or t.p is None or math.isnan(t.p):
        return Verdict(t.estimate, math.nan, math.nan, t.test, t.n, t.p, math.nan, margin, False, NOT_MEASURED)
    p_adj = min(1.0, FAMILY_SIZE * t.p)
    lo, hi = t.interval(LEVEL)
    equivalent = equivalence and t.n >= MIN_PROBLEMS and not p_adj < VERDICT_ALPHA and _equivalent(t, margin)
    if t.n < MIN_PROBLEMS:
        word = TOO_FEW
    elif p_adj < VERDICT_ALPHA:
        word = words[0] if t.estimate > 0 else words[1]
    elif equivalent:
        word = f"equivalent within ±{margin_text(measure)}"
    else:
        word = INCONCLUSIVE
    return Verdict(t.estimate, lo, hi, t.test, t.n, t.p, p_adj, margin, equivalent, word)


def _equivalent(t: Tested, margin: float) -> bool:
    """Both one-sided tests at ±margin reject at alpha / m (TOST)."""
    if not -margin < t.estimate < margin:
        return False
    if t.p_at is not None:  # one-sided p at -margin (estimate above it) and at +margin (estimate below it)
        return max(t.p_at(-margin), t.p_at(margin)) / 2 < VERDICT_ALPHA / FAMILY_SIZE
    lo, hi = t.interval(1 - 2 * VERDICT_ALPHA / FAMILY_SIZE)
    return -margin < lo and hi < margin


def from_comparison(c: Comparison, at_level: Callable[[float], Comparison]) -> Tested:
    """A paired accuracy comparison (:func:`analysis.stats.compare`: Tango's score test, or exact McNemar with
    its interval reaching 0 where it does not reject); ``at_level``: the same comparison at another level."""

    def interval(level: float) -> tuple[float, float]:
        other = at_level(level)
        return other.lo, other.hi

    return Tested(c.diff, c.pvalue, c.test, c.n, interval, lambda delta: shifted_pvalue(c, delta))
