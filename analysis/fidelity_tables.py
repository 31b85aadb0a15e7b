"""Fidelity to the full cache (issue 16; rows of ``measure: fidelity`` sweeps, ``runner/fidelity.py``):
the tables behind the leaderboard's fidelity section, the fidelity budget curves and the scorecard's
fidelity claims.

* Per method, budget and domain (or task): the mean over samples of each sample's mean KL(full ||
  method) (nats per token) with a 95% bootstrap interval over samples (:func:`bootstrap_mean_interval`:
  ``scipy.stats.bootstrap``, 2,000 resamples, seed 0; BCa below 30 samples), descriptive, and top-1
  agreement with the leaderboard's Wilson interval (:func:`top1_interval`: tokens are the samples of a
  question, so agreeing samples do not collapse it to a point).
* Paired differences between two methods on the samples the two have: the mean difference (descriptive)
  and the signed-rank test of the KL differences (:func:`signed_rank`): a difference that float32
  rounding of the logits explains is a tie (:func:`kl_tolerance`), ties are left out (Wilcoxon's zero
  handling); the estimate is the Hodges–Lehmann shift with the interval inverting that test, and the
  adjusted p and verdict are :func:`analysis.verdicts.judge`'s, so the interval excludes 0 exactly when
  the adjusted test rejects.

The unit is the sample (one ``sample_id`` of one task; a prompt two task rows share counts once where
they are pooled, :mod:`analysis.identity`); a sample with several cells (models, protocols, seeds)
counts once, with the mean over its cells. Each table compares its methods on the samples all of them
have, and its paired tests use that same set. Full cache does not depend on the budget: its rows at the
budget where it has the most samples (the one asked for on a tie) stand in at every budget, as for
accuracy (:func:`analysis.tables.full_reference_budget`).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import bootstrap, rankdata, wilcoxon

from kvleague.analysis import common_set as cs
from kvleague.analysis import identity, stats, verdicts
from kvleague.analysis import queries as q
from kvleague.analysis.paper import PAPER_BASELINES, REFERENCE_FAMILY
from kvleague.analysis.rank_tests import hodges_lehmann
from kvleague.analysis.tables import full_cache_ids, full_reference_budget, method_label
from kvleague.engine.protocol import Protocol

LEVEL = stats.LEVEL
N_RESAMPLES = 2000
#: below this many samples the bootstrap interval is BCa, not percentile
PERCENTILE_MIN = 30
#: the scorecard's rule: below this full-cache accuracy (%) in a domain at a budget, accuracy cannot
#: separate methods (every method sits near the floor), so the scorecard judges them by fidelity
ACCURACY_FLOOR = 20.0
#: how far two runs' float32 logits can differ when the caches hold the same tokens (attention kernels,
#: batch shapes): a cell that evicted nothing measures KL(full || method) = E[δ²]/2 <= 2.3e-11 in the
#: committed export, so δ ≈ 7e-6; 1e-5 bounds it
LOGIT_ROUNDING = 1e-5
#: the signed-rank test's exact null distribution is used up to this many non-tied differences
EXACT_MAX = 50

Question = tuple[int, str]  # (task id, sample id)


@dataclass(frozen=True)
class SampleFidelity:
    """One sample's figures: means over its cells of the per-cell means, and the tokens scored in all."""

    kl: float
    top1: float
    delta_nll: float
    tokens: int
    top1_share: Fraction | None = None  # top-1 agreement as the exact mean over cells of agreeing / scored tokens
    #: whether the method's own ranking decided what was evicted in some cell of the sample
    #: (:func:`ranked`); False: nothing was evicted, or every candidate was, as the protocol dictated
    ranked: bool = True
    #: the runs (sweep rows: a resume is a run of its own) that stored the sample's cells
    sweeps: frozenset[int] = frozenset()


#: method spec id -> budget -> question -> figures
Fidelity = dict[int, dict[int, dict[Question, SampleFidelity]]]


def bootstrap_mean_interval(values: Iterable[float], level: float = LEVEL) -> tuple[float, float]:
    """Bootstrap interval of the mean over ``values`` (the samples are the unit): percentile from
    :data:`PERCENTILE_MIN` samples, BCa below (the percentile interval of a small skewed sample is Monte-Carlo
    luck: with 10 samples and 3 outliers its lower bound swings by 0.4 nats). A single value or constant
    values: the value itself (no spread to resample); none: NaN. Descriptive only: no verdict reads it."""
    v = np.asarray(list(values), dtype=float)
    if len(v) == 0:
        return math.nan, math.nan
    if len(v) < 2 or np.all(v == v[0]):
        return float(v[0]), float(v[0])
    res = bootstrap(
        (v,),
        np.mean,
        n_resamples=N_RESAMPLES,
        confidence_level=level,
        method="percentile" if len(v) >= PERCENTILE_MIN else "BCa",
        rng=np.random.default_rng(0),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def top1_interval(values: list[SampleFidelity], level: float = LEVEL) -> tuple[float, float]:
    """Top-1 agreement (%) over samples with the leaderboard's interval (:func:`analysis.stats.accuracy`):
    a sample is a question and its scored tokens its samples, so the interval is Wilson's with the design
    effect of tokens clustered in samples, never narrower than for independent tokens. Samples that all
    agree (every one 13 of 24 tokens) leave the percentile bootstrap nothing to resample and it collapses
    to a point; this interval does not."""
    shares = [v.top1_share for v in values if v.top1_share is not None]
    if not shares:
        return math.nan, math.nan
    a = stats.accuracy(stats.unweighted(shares, max(v.tokens for v in values)))
    return 100 * a.lo, 100 * a.hi


def kl_tolerance(kl_a: float, kl_b: float) -> float:
    """The largest difference between two per-sample KLs that float32 rounding of the logits explains.
    Moving one side's logits by at most δ moves KL(p || q) by at most ||p − q||₁ δ + δ²/2 (Hoeffding's
    lemma for the log-normaliser) and ||p − q||₁ <= sqrt(2 KL) (Pinsker); by Jensen the bound carries to
    means over tokens. δ = :data:`LOGIT_ROUNDING`."""
    k = max(kl_a, kl_b, 0.0)
    return LOGIT_ROUNDING * math.sqrt(2 * k) + LOGIT_ROUNDING**2 / 2


@dataclass(frozen=True)
class SignedRank:
    """Wilcoxon's signed-rank test of paired KL differences with float-rounding ties left out."""

    n: int  # pairs
    ties: int  # pairs whose difference is within rounding
    w_plus: float  # rank sums of the positive and negative differences among the rest
    w_minus: float
    p: float
    nz: tuple[float, ...] = ()  # the differences the test ranks

    def tested(self) -> verdicts.Tested:
        """For :func:`analysis.verdicts.judge`: the Hodges–Lehmann shift of the ranked differences and the
        interval inverting this test (:func:`analysis.rank_tests.hodges_lehmann`)."""
        shift = hodges_lehmann(self.nz, LEVEL, EXACT_MAX)[0] if self.nz else 0.0
        return verdicts.Tested(
            shift,
            self.p,
            "Wilcoxon signed-rank",
            self.n,
            lambda level: hodges_lehmann(self.nz, level, EXACT_MAX)[1:] if self.nz else (math.nan, math.nan),
        )

    @property
    def sign(self) -> int:
        """The test's direction: +1 when the first of the pair is higher (W+ > W-), -1 lower, 0 neither."""
        return (self.w_plus > self.w_minus) - (self.w_plus < self.w_minus)


def signed_rank(first: Iterable[float], second: Iterable[float]) -> SignedRank:
    """Two-sided signed-rank test of ``first - second`` (per-sample KLs, paired). Differences within
    :func:`kl_tolerance` are ties and are dropped before ranking (Wilcoxon's zero handling, as McNemar
    drops concordant pairs): a tie says nothing about direction, and zsplit or Pratt would let the count
    of float-noise pairs and their noise-sized ranks move the statistic. Exact null distribution up to
    :data:`EXACT_MAX` differences without tied ranks, else the normal approximation with tie correction.
    No pairs: NaN; all tied: p = 1."""
    a, b = np.asarray(list(first), dtype=float), np.asarray(list(second), dtype=float)
    if len(a) == 0:
        return SignedRank(0, 0, 0.0, 0.0, math.nan)
    d = a - b
    keep = np.abs(d) > np.array([kl_tolerance(x, y) for x, y in zip(a, b)])
    nz = d[keep]
    ties = int(len(d) - len(nz))
    if len(nz) == 0:
        return SignedRank(len(d), ties, 0.0, 0.0, 1.0)
    ranks = rankdata(np.abs(nz))
    exact = len(nz) <= EXACT_MAX and len(np.unique(np.abs(nz))) == len(nz)
    test: Any = wilcoxon(nz, method="exact" if exact else "approx")  # scipy's result types are not declared
    p = float(test.pvalue)
    return SignedRank(len(d), ties, float(ranks[nz > 0].sum()), float(ranks[nz < 0].sum()), p, tuple(nz.tolist()))


def ranks_text(r: SignedRank, first: str, second: str) -> str:
    """The test's direction as a table cell: which of the pair the signed ranks put higher."""
    return {1: f"{first} > {second}", -1: f"{first} < {second}", 0: f"{first} = {second}"}[r.sign] if r.n else "-"


def ranked(
    evicted_tokens: int | None, ranked_evictions: int | None, prompt_tokens: int | None, budget: int, protocol: Protocol
) -> bool:
    """Whether a cell's method ranked anything: some eviction kept some of its candidates and dropped
    others (``ranked_evictions``, stored since migration 0008). For rows stored before it: not when
    nothing was evicted (a row without eviction counts is taken to have ranked), nor when the protocol keeps the prompt and the prompt with the sink and recent
    window fills the budget (then every other token goes as soon as it is fed: the protocol chose, not
    the method)."""
    if ranked_evictions is not None:
        return ranked_evictions > 0
    if evicted_tokens is None:
        return True  # not recorded: nothing says the protocol chose, so the row is tested
    if evicted_tokens == 0:
        return False
    protected = (prompt_tokens or 0) + protocol.sink + protocol.recent_for(budget)
    return not (protocol.protect_prompt and protected >= budget)


def _protocols(engine) -> dict[int, Protocol]:
    from sqlalchemy import select

    with engine.connect() as conn:
        return {int(r["id"]): Protocol.from_spec(r) for r in (dict(x._mapping) for x in conn.execute(select(q.P)))}


def load(engine, filters: q.Filters, budgets: Iterable[int] | None = None) -> Fidelity:
    """The fidelity rows under the filters, one entry per sample (its cells averaged)."""
    cells: dict[tuple[int, int, Question], list[tuple]] = defaultdict(list)
    protocols = _protocols(engine)
    for (
        m,
        b,
        t,
        s,
        _model,
        proto,
        _seed,
        kl,
        top1,
        dnll,
        tokens,
        evicted,
        n_ranked,
        prompt,
        resolved,
        sweep,
    ) in q.fidelity_rows(engine, filters, budgets):
        chose = ranked(evicted, n_ranked, prompt, int(resolved or b), protocols[int(proto)])
        cells[(int(m), int(b), (int(t), str(s)))].append(
            (float(kl), float(top1), float(dnll or 0.0), int(tokens or 0), chose, int(sweep))
        )
    out: Fidelity = defaultdict(lambda: defaultdict(dict))
    for (m, b, question), vals in cells.items():
        arr = np.array([v[:3] for v in vals])
        kl, top1, dnll = arr.mean(axis=0)
        # a cell's top-1 agreement is agreeing / scored tokens: recover the count, keep the share exact
        shares = [Fraction(round(v[1] * v[3]), v[3]) for v in vals if v[3] > 0]
        share = sum(shares, Fraction(0)) / len(shares) if len(shares) == len(vals) else None
        out[m][b][question] = SampleFidelity(
            float(kl),
            float(top1),
            float(dnll),
            sum(v[3] for v in vals),
            share,
            any(v[4] for v in vals),
            frozenset(v[5] for v in vals),
        )
    return out


def at_budget(
    data: Fidelity, budget: int, full_ids: list[int]
) -> tuple[dict[int, dict[Question, SampleFidelity]], int | None]:
    """Every method's samples at ``budget``; full cache from the budget where it has the most samples
    (this one on a tie): it is the same at every budget, and a sweep may measure it at its first budget
    only (the rule of :func:`analysis.tables.full_reference_budget`). Returns ``(method -> samples, full
    cache's budget)``."""
    out = {m: by_budget[budget] for m, by_budget in data.items() if m not in full_ids and by_budget.get(budget)}
    full_budget = None
    for f in sorted(full_ids):
        by_budget = data.get(f, {})
        if not by_budget:
            continue
        b = max(by_budget, key=lambda x: (len(by_budget[x]), x == budget, -x))
        out[f], full_budget = by_budget[b], b
    return out, full_budget


def common_questions(
    samples: dict[int, dict[Question, SampleFidelity]], methods: Iterable[int], tasks: set[int] | None = None
) -> list[Question]:
    """The samples every one of ``methods`` has (within ``tasks``), in a fixed order."""
    sets = [set(samples[m]) for m in methods]
    common = set.intersection(*sets) if sets else set()
    return sorted(qn for qn in common if tasks is None or qn[0] in tasks)


def _fmt(lo: float, hi: float, digits: int) -> str:
    return "-" if math.isnan(lo) else f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def _summary_rows(samples, methods, questions, dims, **where) -> list[dict[str, Any]]:
    rows = []
    for m in methods:
        vals = [samples[m][qn] for qn in questions]
        kl = [v.kl for v in vals]
        top1 = [100 * v.top1 for v in vals]
        kl_lo, kl_hi = bootstrap_mean_interval(kl)
        t_lo, t_hi = top1_interval(vals)
        rows.append(
            {
                "method": method_label(dims["methods"], m),
                "method_id": m,
                **where,
                "KL": float(np.mean(kl)) if kl else math.nan,
                "KL lo": kl_lo,
                "KL hi": kl_hi,
                "KL 95% CI": _fmt(kl_lo, kl_hi, 4),
                "top-1 %": float(np.mean(top1)) if top1 else math.nan,
                "top-1 lo": t_lo,
                "top-1 hi": t_hi,
                "top-1 95% CI": _fmt(t_lo, t_hi, 1),
                "ΔNLL": float(np.mean([v.delta_nll for v in vals])) if vals else math.nan,
                "samples": len(vals),
                "tokens": sum(v.tokens for v in vals),
                "ranked": sum(v.ranked for v in vals),
            }
        )
    return rows


BOARD_COLUMNS = [
    "method",
    "domain",
    "task",
    "KL",
    "KL 95% CI",
    "top-1 %",
    "top-1 95% CI",
    "ΔNLL",
    "samples",
    "tokens",
    "ranked",
    "KL lo",
    "KL hi",
    "top-1 lo",
    "top-1 hi",
    "method_id",
]
#: what a pair's ``signed ranks`` says when it is not tested (:func:`chose_nothing`)
NOT_A_FINDING = "not a finding"


def chose_nothing(samples, m: int, questions: list[Question], full_ids: Iterable[int]) -> bool:
    """Whether ``m`` (not a full cache) ranked nothing in any of ``questions``: every eviction dropped
    nothing or every candidate, as the protocol dictated, so its figures are the protocol's, not the
    method's, and a comparison involving it is not tested."""
    return m not in set(full_ids) and bool(questions) and not any(samples[m][qn].ranked for qn in questions)


@dataclass
class FidelityBoard:
    budget: int
    full_budget: int | None
    by_domain: pd.DataFrame  # one row per (method, domain)
    by_task: pd.DataFrame  # one row per (method, task)


def _domains(samples, dims) -> dict[str, set[int]]:
    tasks = dims["tasks"]
    out: dict[str, set[int]] = defaultdict(set)
    for per_q in samples.values():
        for t, _ in per_q:
            out[tasks.get(t, {}).get("domain", "?")].add(t)
    return dict(sorted(out.items()))


def _present(samples, tasks: set[int]) -> list[int]:
    return sorted(m for m, per_q in samples.items() if any(t in tasks for t, _ in per_q))


def _pooled(samples, dims) -> dict[int, dict[Question, SampleFidelity]]:
    """``samples`` with a prompt that several task rows hold counted once (:func:`analysis.identity.pool`)."""
    return identity.pool(samples, dims["tasks"])


def fidelity_board(engine, filters: q.Filters, budget: int, dims: dict[str, Any] | None = None) -> FidelityBoard:
    """Mean KL and top-1 agreement with their intervals per (method, domain) and (method, task) at
    ``budget``, each table on the samples every method in it has, best (lowest KL) first."""
    dims = dims or q.dimensions(engine)
    full_ids = full_cache_ids(dims)
    data = load(engine, filters)
    samples, full_budget = at_budget(data, budget, full_ids)
    if not any(m not in full_ids for m in samples):
        samples = {}
    pooled = _pooled(samples, dims)
    domain_rows, task_rows = [], []
    for domain, tasks in _domains(samples, dims).items():
        methods = _present(pooled, tasks)
        domain_rows += _summary_rows(
            pooled, methods, common_questions(pooled, methods, tasks), dims, domain=domain, task="(all)"
        )
        for t in sorted(tasks, key=lambda t: dims["tasks"].get(t, {}).get("name", str(t))):
            here = _present(samples, {t})
            task_rows += _summary_rows(
                samples,
                here,
                common_questions(samples, here, {t}),
                dims,
                domain=domain,
                task=dims["tasks"].get(t, {}).get("name", f"#{t}"),
            )

    def frame(rows, keys):
        df = pd.DataFrame(rows, columns=BOARD_COLUMNS)
        return df.sort_values([*keys, "KL", "method"], kind="stable").reset_index(drop=True)

    return FidelityBoard(budget, full_budget, frame(domain_rows, ["domain"]), frame(task_rows, ["domain", "task"]))


#: the interval column of every KL comparison: the Hodges–Lehmann shift's, at the verdicts' level
HL_CI = f"HL shift {verdicts.LEVEL_TEXT} CI"


PAIR_COLUMNS = [
    "domain",
    "A",
    "B",
    "samples",
    "runs",
    "tied",
    "KL A",
    "KL B",
    "Δ KL (A−B)",
    "HL shift",
    HL_CI,
    "Δ top-1 (pts)",
    "Δ top-1 95% CI",
    "signed ranks",
    "p (Wilcoxon)",
    "p (adj.)",
    "verdict",
]


def _paired(samples, a: int, b: int, questions: list[Question]) -> dict[str, Any]:
    """A − B on ``questions`` (the samples the two have): ``runs`` counts the runs (sweep rows) whose rows
    the pair reads, more than one where its two sides (or its samples) were computed apart; ``tied`` counts the samples whose KLs differ by
    float rounding only; ``signed ranks`` is the direction the test found; the shift, its interval, p (adj.)
    and the verdict are :func:`analysis.verdicts.judge`'s of the signed-rank test."""
    kl_a, kl_b = [samples[a][qn].kl for qn in questions], [samples[b][qn].kl for qn in questions]
    d_kl = [x - y for x, y in zip(kl_a, kl_b)]
    d_top1 = [100 * (samples[a][qn].top1 - samples[b][qn].top1) for qn in questions]
    t_lo, t_hi = bootstrap_mean_interval(d_top1)
    test = signed_rank(kl_a, kl_b)
    v = verdicts.judge(test.tested(), "kl", ("A higher", "A lower"))
    runs = frozenset().union(*(samples[m][qn].sweeps for m in (a, b) for qn in questions))
    return {
        "samples": len(questions),
        "runs": len(runs),
        "tied": test.ties,
        "KL A": float(np.mean(kl_a)) if questions else math.nan,
        "KL B": float(np.mean(kl_b)) if questions else math.nan,
        "Δ KL (A−B)": float(np.mean(d_kl)) if d_kl else math.nan,
        "HL shift": v.estimate if test.nz else (0.0 if questions else math.nan),
        "Δ KL lo": v.lo,
        "Δ KL hi": v.hi,
        HL_CI: _fmt(v.lo, v.hi, 4),
        "Δ top-1 (pts)": float(np.mean(d_top1)) if d_top1 else math.nan,
        "Δ top-1 95% CI": _fmt(t_lo, t_hi, 1),
        "signed ranks": ranks_text(test, "A", "B"),
        "p (Wilcoxon)": test.p,
        "p (adj.)": v.p_adjusted,
        "verdict": v.word,
        "_test": test,
    }


#: a pair whose protocol chose what was kept (:func:`chose_nothing`): shown, not tested
_UNTESTED = {"signed ranks": NOT_A_FINDING, "p (Wilcoxon)": math.nan, "p (adj.)": math.nan, "verdict": NOT_A_FINDING}


def fidelity_pairs(engine, filters: q.Filters, budget: int, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """Every pair of methods per domain at ``budget`` on the samples the two have: paired mean differences of
    KL and top-1 agreement, the signed-rank test of the KL differences (:func:`signed_rank`) with its
    Hodges–Lehmann shift, interval, adjusted p and verdict (:func:`_paired`). ``sign``: the test's
    direction (+1: A higher)."""
    dims = dims or q.dimensions(engine)
    full_ids = full_cache_ids(dims)
    samples = _pooled(at_budget(load(engine, filters), budget, full_ids)[0], dims)
    rows = []
    for domain, tasks in _domains(samples, dims).items():
        methods = sorted(_present(samples, tasks), key=lambda m: (method_label(dims["methods"], m), m))
        for a, b in itertools.combinations(methods, 2):
            questions = common_questions(samples, [a, b], tasks)
            row = {
                "domain": domain,
                "A": method_label(dims["methods"], a),
                "B": method_label(dims["methods"], b),
                **_paired(samples, a, b, questions),
            }
            if chose_nothing(samples, a, questions, full_ids) or chose_nothing(samples, b, questions, full_ids):
                row.update(_UNTESTED)  # shown, never tested
            rows.append(row)
    if not rows:
        return pd.DataFrame(columns=PAIR_COLUMNS)
    for r in rows:
        r["sign"] = 0 if r["signed ranks"] == NOT_A_FINDING else r["_test"].sign
        r.pop("_test")
    df = pd.DataFrame(rows)[PAIR_COLUMNS + ["Δ KL lo", "Δ KL hi", "sign"]]
    return df.sort_values(["domain", "p (Wilcoxon)", "A", "B"], kind="stable").reset_index(drop=True)


ABLATION_COLUMNS = [
    "field",
    "A",
    "B",
    "domain",
    "budget",
    "method",
    "samples",
    "tied",
    "KL A",
    "KL B",
    "Δ KL (B−A)",
    "HL shift",
    HL_CI,
    "signed ranks",
    "p (Wilcoxon)",
    "p (adj.)",
    "verdict",
]
#: protocol columns that are not settings
_NOT_SETTINGS = {"id", "spec_hash", "label"}


def protocol_ablations(
    engine, filters: q.Filters, protocols: list[dict[str, Any]], dims: dict[str, Any] | None = None
) -> pd.DataFrame:
    """What one protocol setting changes: for each pair of ``protocols`` (rows of the protocols table)
    that differ in exactly one setting, at each budget and in each domain, every method spec (full cache
    left out) measured under both, on the samples every one of them has under both (one set per
    protocol pair, budget and domain, as a finding reads them together): its KL under A and under B, the
    paired mean difference B−A, the signed-rank test (:func:`signed_rank`; ``sign`` +1: higher under B)
    with its Hodges–Lehmann shift, interval, adjusted p and verdict (:func:`analysis.verdicts.judge`)."""
    dims = dims or q.dimensions(engine)
    full_ids = set(full_cache_ids(dims))
    protocols = sorted(protocols, key=lambda p: p["id"])
    settings = [k for k in (protocols[0] if protocols else {}) if k not in _NOT_SETTINGS]
    loaded: dict[int, Fidelity] = {}

    def fidelity_under(protocol: dict[str, Any]) -> Fidelity:
        if protocol["id"] not in loaded:  # each protocol's rows read once, however many pairs it is in
            loaded[protocol["id"]] = load(engine, replace(filters, protocols=(protocol["id"],)))
        return loaded[protocol["id"]]

    label = lambda m: (method_label(dims["methods"], m), m)  # noqa: E731
    rows = []
    for a, b in itertools.combinations(protocols, 2):
        changed = [k for k in settings if a[k] != b[k]]
        # budgets of different kinds (cache entries, room on top of the prompt) are not one budget
        if len(changed) != 1 or (a.get("budget_base") or "none") != (b.get("budget_base") or "none"):
            continue
        da, db = fidelity_under(a), fidelity_under(b)
        methods = sorted(set(da) & set(db) - full_ids, key=label)
        for budget in sorted({x for m in methods for x in set(da[m]) & set(db[m])}):
            here = [m for m in methods if budget in da[m] and budget in db[m]]
            # a sample counts for a method when it has it under both protocols
            pa, pb = _pooled({m: da[m][budget] for m in here}, dims), _pooled({m: db[m][budget] for m in here}, dims)
            both = {m: {qn: v for qn, v in pa[m].items() if qn in pb[m]} for m in here}
            for domain, tasks in _domains(both, dims).items():
                present = sorted(_present(both, tasks), key=label)
                questions = common_questions(both, present, tasks)
                for m in present:
                    kl_a = [pa[m][qn].kl for qn in questions]
                    kl_b = [pb[m][qn].kl for qn in questions]
                    d = [y - x for x, y in zip(kl_a, kl_b)]
                    test = signed_rank(kl_b, kl_a)
                    v = verdicts.judge(test.tested(), "kl", ("B higher", "B lower"))
                    rows.append(
                        {
                            "field": changed[0],
                            "A": f"#{a['id']}: {a[changed[0]]}",
                            "B": f"#{b['id']}: {b[changed[0]]}",
                            "domain": domain,
                            "budget": q.budget_label(int(budget), a.get("budget_base")),
                            "method": method_label(dims["methods"], m),
                            "samples": len(questions),
                            "tied": test.ties,
                            "KL A": float(np.mean(kl_a)) if questions else math.nan,
                            "KL B": float(np.mean(kl_b)) if questions else math.nan,
                            "Δ KL (B−A)": float(np.mean(d)) if d else math.nan,
                            "HL shift": v.estimate if test.nz else (0.0 if d else math.nan),
                            "Δ KL lo": v.lo,
                            "Δ KL hi": v.hi,
                            HL_CI: _fmt(v.lo, v.hi, 4),
                            "signed ranks": ranks_text(test, "B", "A"),
                            "p (Wilcoxon)": test.p,
                            "p (adj.)": v.p_adjusted,
                            "verdict": v.word,
                            "sign": test.sign,
                        }
                    )
    extra = ["Δ KL lo", "Δ KL hi", "sign"]
    if not rows:
        return pd.DataFrame(columns=ABLATION_COLUMNS + extra)
    return pd.DataFrame(rows)[ABLATION_COLUMNS + extra]


CURVE_COLUMNS = ["method", "domain", "budget", "KL", "KL lo", "KL hi", "top-1 %", "top-1 lo", "top-1 hi", "samples"]


def fidelity_curves(engine, filters: q.Filters, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """Mean KL and top-1 agreement with their intervals per (method, domain, budget), full cache
    left out (0 and 100% by construction); each (domain, budget) on the samples its methods all have."""
    dims = dims or q.dimensions(engine)
    full_ids = full_cache_ids(dims)
    data = load(engine, filters)
    rows = []
    for budget in sorted({b for by_budget in data.values() for b in by_budget}):
        samples = _pooled(
            {m: by_budget[budget] for m, by_budget in data.items() if m not in full_ids and by_budget.get(budget)}, dims
        )
        for domain, tasks in _domains(samples, dims).items():
            methods = _present(samples, tasks)
            for r in _summary_rows(samples, methods, common_questions(samples, methods, tasks), dims, domain=domain):
                rows.append({**r, "budget": int(budget)})
    df = pd.DataFrame(rows, columns=CURVE_COLUMNS)
    return df.sort_values(["domain", "method", "budget"]).reset_index(drop=True)


SCORECARD_COLUMNS = [
    "domain",
    "budget",
    "method",
    "claim",
    "reference",
    "why fidelity",
    "KL",
    "reference KL",
    "Δ KL",
    "HL shift",
    HL_CI,
    "samples",
    "tied",
    "signed ranks",
    "test",
    "p",
    "p (adj.)",
    "verdict",
]
#: the claim "closer to full cache" (lower KL) in the words of a pair's verdict
_CLAIM_WORDS = {"A lower": "replicates", "A higher": "does not replicate"}


def _full_accuracy(engine, filters: q.Filters, budget: int, dims: dict[str, Any], tasks: set[int]) -> float | None:
    """Full cache's accuracy (%) on the domain's questions from the generation rows, at its reference
    budget for ``budget``; None when it has none there."""
    full_ids = sorted(full_cache_ids(dims))
    gen = replace(filters, measure=q.MEASURE_GENERATION)
    at = full_reference_budget(engine, gen, budget, full_ids) if full_ids else None
    if at is None:
        return None
    results = identity.pool(cs.results_from_rows(q.question_cells(engine, gen, [at], full_ids)), dims["tasks"])
    full = min(results, key=lambda i: (-len(results[i]), i)) if results else None
    if full is None or not any(c[0] in tasks for c in results[full]):
        return None
    return 100 * float(cs.common_set(results, [full], tasks=tasks).accuracy(full).mean)


def fidelity_scorecard(
    engine, filters: q.Filters, floor: float = ACCURACY_FLOOR, dims: dict[str, Any] | None = None
) -> pd.DataFrame:
    """Where accuracy cannot separate methods - full-cache accuracy below ``floor`` % in the (domain,
    budget), or no accuracy results there - each EpiKV-family method against each paper baseline (H2O,
    ThinKV) by fidelity: the claim "closer to the full cache" (lower KL), each pair on the samples the two
    have, with the pair's verdict from :func:`_paired` (the same as in the fidelity pairs table): replicates
    when the adjusted signed-rank test rejects with EpiKV lower, does not replicate when it rejects with
    EpiKV higher, equivalent within the declared margin when that is tested, else inconclusive; fewer than
    ``stats.MIN_PROBLEMS`` samples: no verdict."""
    dims = dims or q.dimensions(engine)
    name = lambda m: dims["methods"].get(m, {}).get("name")  # noqa: E731
    full_ids = full_cache_ids(dims)
    data = load(engine, filters)
    rows = []
    for budget in sorted({b for m, by_budget in data.items() if name(m) in REFERENCE_FAMILY for b in by_budget}):
        samples = _pooled(at_budget(data, budget, full_ids)[0], dims)
        for domain, tasks in _domains(samples, dims).items():
            methods = _present(samples, tasks)
            questions = common_questions(samples, methods, tasks)
            family = [m for m in methods if name(m) in REFERENCE_FAMILY]
            baselines = [m for m in methods if name(m) in PAPER_BASELINES]
            if not family or not baselines:
                continue
            accuracy = _full_accuracy(engine, filters, budget, dims, tasks)
            if accuracy is not None and accuracy >= floor:
                continue  # accuracy can separate here: the accuracy scorecard judges
            why = "no accuracy results" if accuracy is None else f"full-cache accuracy {accuracy:.1f}% < {floor:g}%"
            for f, b in itertools.product(family, baselines):
                questions = common_questions(samples, [f, b], tasks)
                p = _paired(samples, f, b, questions)
                if chose_nothing(samples, f, questions, full_ids) or chose_nothing(samples, b, questions, full_ids):
                    p.update(_UNTESTED)  # the protocol chose what was kept: not a finding, not tested
                rows.append(
                    {
                        "domain": domain,
                        "budget": int(budget),
                        "method": method_label(dims["methods"], f),
                        "claim": f"closer to full cache than {name(b)}",
                        "reference": method_label(dims["methods"], b),
                        "why fidelity": why,
                        "KL": p["KL A"],
                        "reference KL": p["KL B"],
                        "Δ KL": p["Δ KL (A−B)"],
                        "HL shift": p["HL shift"],
                        HL_CI: p[HL_CI],
                        "samples": p["samples"],
                        "tied": p["tied"],
                        "signed ranks": p["signed ranks"]
                        if p["signed ranks"] == NOT_A_FINDING
                        else ranks_text(p["_test"], "method", "reference"),
                        "test": "Wilcoxon signed-rank",
                        "p": p["p (Wilcoxon)"],
                        "p (adj.)": p["p (adj.)"],
                        "verdict": _CLAIM_WORDS.get(p["verdict"], p["verdict"]),
                    }
                )
    if not rows:
        return pd.DataFrame(columns=SCORECARD_COLUMNS)
    return pd.DataFrame(rows, columns=SCORECARD_COLUMNS)


def markdown(engine, filters: q.Filters = q.Filters()) -> str:
    """The fidelity table of a database as Markdown: per domain, method and budget, the samples, mean KL
    and top-1 agreement with their 95% intervals, and delta NLL (docs/fidelity.md)."""
    dims = q.dimensions(engine)
    lines = [
        "| domain | method | budget | n | mean KL [95% CI] | top-1 % [95% CI] | ΔNLL |",
        "|---|---|---:|---:|---|---|---:|",
    ]
    budgets = sorted({b for by_budget in load(engine, filters).values() for b in by_budget})
    rows = pd.concat(
        [fidelity_board(engine, filters, b, dims).by_domain.assign(budget=b) for b in budgets], ignore_index=True
    )
    for _, r in rows.sort_values(["domain", "budget", "KL", "method"], kind="stable").iterrows():
        lines.append(
            f"| {r['domain']} | {r['method']} | {r['budget']} | {r['samples']} | {r['KL']:.4f} {r['KL 95% CI']} | "
            f"{r['top-1 %']:.1f} {r['top-1 95% CI']} | {r['ΔNLL']:+.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m analysis.fidelity_tables", description="Print a database's fidelity table (Markdown)."
    )
    p.add_argument("--db", required=True, help="database URL (opened read-only)")
    print(markdown(q.open_readonly(p.parse_args(argv).db)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
