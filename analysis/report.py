"""``kvleague report --db URL --out DIR``: the replication report of any kvleague database, as markdown
with figures (``DIR/replication.md``, ``DIR/replication_figures/*.png``).

It is the dashboard's tables written down, so every number in it is computed by the code the
dashboard's tests check: per (model, protocol) and domain, accuracy and fidelity against budget with
95% intervals; per budget, each method's accuracy and fidelity with paired tests against full cache
and against EpiKV; the scorecard of the paper's claims (accuracy, fidelity where accuracy cannot
separate methods, and the paper's own numbers); the totals (cells, samples, tokens, CPU time) and
provenance. The findings at the top are sentences generated from those tests, never written by hand.
The preamble (``--preamble``, what the data is) is written by hand, but its counts are placeholders such as
``{{samples protocol=4 each=domain}}`` that the report computes from the database (:mod:`analysis.preamble`;
an unknown key or a selection that matches nothing is an error, never a 0).
Output depends only on the database's content (bootstraps are seeded; figures carry no timestamp), so
the same export always gives the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd
from sqlalchemy import case, func, select

from kvleague.analysis import fidelity_tables as fid
from kvleague.analysis import identity, paper, tables
from kvleague.analysis import queries as q
from kvleague.analysis.head_to_head import head_to_head
from kvleague.analysis.preamble import resolve as resolve_preamble
from kvleague.analysis.report_figures import budget_figure
from kvleague.analysis.verdicts import FAMILY_TEXT, INCONCLUSIVE
from kvleague.db.models import MEASURE_FIDELITY, STATUS_OK, SampleResult

R = SampleResult.__table__
REPORT = "replication.md"
FIGURES = "replication_figures"
EPIKV = paper.REFERENCE_METHOD
RECENCY = paper.RECENCY_CONTROL
RECENCY_LABEL = "StreamingLLM" if RECENCY == "streaming_llm" else RECENCY
ALPHA = 0.05


# ------------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------------


def _cell(value: Any, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _p(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.2g}" if value >= 0.001 else f"{value:.1e}"


def _is_p(column: str) -> bool:
    return column in ("p", "p_value") or column.startswith("p ")


def markdown_table(df: pd.DataFrame, columns: list[str], digits: dict[str, int] | None = None) -> str:
    """``columns`` of ``df`` as a markdown table; floats at ``digits[column]`` places (default 2); the
    columns ``p``, ``p_value`` and ``p (...)`` / ``p vs ...`` are p-values."""
    digits = digits or {}
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = []
    for _, row in df.iterrows():
        cells = [_p(row[c]) if _is_p(c) else _cell(row[c], digits.get(c, 2)) for c in columns]
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *body])


# ------------------------------------------------------------------------------------------------
# What the database holds
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slice:
    """One model under one protocol: methods are only compared inside a slice."""

    model_id: int
    model: str
    protocol_id: int
    protocol: str
    budget_base: str | None = None

    @property
    def filters(self) -> q.Filters:
        return q.Filters(models=(self.model_id,), protocols=(self.protocol_id,))

    def budget(self, b: int) -> str:
        return q.budget_label(b, self.budget_base)


def slices(engine, opts: q.Options) -> list[Slice]:
    with engine.connect() as conn:
        pairs = conn.execute(
            select(R.c.model_id, R.c.protocol_id).distinct().order_by(R.c.model_id, R.c.protocol_id)
        ).all()
    models = {m["id"]: m["name"] for m in opts.models}
    protocols = {p["id"]: p for p in opts.protocols}
    return [
        Slice(
            int(m),
            models.get(m, f"#{m}"),
            int(p),
            protocols.get(p, {}).get("label", f"#{p}"),
            protocols.get(p, {}).get("budget_base"),
        )
        for m, p in pairs
    ]


def totals(engine, filters: q.Filters | None = None, tasks: Mapping[int, Any] | None = None) -> dict[str, Any]:
    """Cells, failed cells, samples (distinct prompts by content, :func:`analysis.identity.prompt_key`, across
    every reference row, with ``tasks`` the dimensions' tasks; else distinct (task, sample id)), tokens through the model (prompt + generated or
    scored) and the cells' summed wall time (one CPU-bound worker per cell: its CPU time)."""
    cond = filters.conditions() if filters else []
    tokens = (
        func.coalesce(R.c.prompt_tokens, 0)
        + func.coalesce(R.c.generated_tokens, 0)
        + func.coalesce(R.c.scored_tokens, 0)
    )
    with engine.connect() as conn:
        row = conn.execute(
            select(
                func.count(),
                func.sum(case((R.c.status != STATUS_OK, 1), else_=0)),
                func.sum(tokens),
                func.sum(R.c.wall_seconds),
                func.sum(case((R.c.measure == MEASURE_FIDELITY, 1), else_=0)),
            ).where(*cond)
        ).one()
        questions = [
            (int(t), str(s)) for t, s in conn.execute(select(R.c.task_id, R.c.sample_id).distinct().where(*cond))
        ]
    n, failed, tok, seconds, fidelity_cells = row
    samples = (
        len({identity.prompt_key({"id": t, **tasks.get(t, {})}, sid) for t, sid in questions})
        if tasks is not None
        else len(questions)
    )
    return {
        "cells": int(n or 0),
        "failed": int(failed or 0),
        "samples": samples,
        "tokens": int(tok or 0),
        "seconds": float(seconds or 0.0),
        "fidelity_cells": int(fidelity_cells or 0),
    }


def _budgets(engine, filters: q.Filters) -> list[int]:
    with engine.connect() as conn:
        return [
            int(b)
            for (b,) in conn.execute(select(R.c.budget).distinct().where(*filters.conditions()).order_by(R.c.budget))
        ]


def method_names(dims: dict[str, Any]) -> dict[str, str]:
    """Method label (as the tables show it) -> registered name: labels add the hyperparameters that tell
    specs of one name apart (``queries.method_labels``)."""
    return {m["label"]: m["name"] for m in dims["methods"].values()}


def _named(labels: pd.Series, name_of: Mapping[str, str]) -> pd.Series:
    return labels.map(lambda label: name_of.get(label, label))


def _involves(df: pd.DataFrame, names: Iterable[str], name_of: Mapping[str, str]) -> pd.DataFrame:
    names = set(names)
    if df.empty:
        return df
    keep = _named(df["A"], name_of).isin(names) | _named(df["B"], name_of).isin(names)
    return df[keep].reset_index(drop=True)


# ------------------------------------------------------------------------------------------------
# Findings: one sentence per (domain, budget), from the paired tests in the tables below
# ------------------------------------------------------------------------------------------------


def _who(label: str) -> str:
    return "EpiKV" if label == EPIKV else f"EpiKV ({label})"


def _direction(row: pd.Series, sign: int, lower_is_better: bool) -> str:
    """What a pair's verdict (:func:`analysis.verdicts.judge`, the same on every page) says: "better" or
    "worse" by the direction the test found (``sign`` +1: the first of the pair higher) when the adjusted
    test rejects; "equivalent" when the equivalence test at the declared margin rejects; else "inconclusive"."""
    if str(row.get("verdict", "")).startswith("equivalent"):
        return "equivalent"
    if not (row["p (adj.)"] < ALPHA) or sign == 0:
        return "inconclusive"
    return "better" if (sign < 0) == lower_is_better else "worse"


def _tied(row: pd.Series) -> str:
    return f", {int(row['tied'])} of {int(row['samples'])} tied" if row.get("tied") else ""


def _against_baselines(
    pairs: pd.DataFrame, label: str, delta: str, lower_is_better: bool, fmt, name_of: Mapping[str, str], fidelity: bool
) -> dict[str, list[tuple[str, str]]]:
    """The pairs of ``label`` (an EpiKV spec) with an attention baseline, grouped by what the paired test
    says (:func:`_direction`): "better", "worse", "equivalent" or "inconclusive", each as (baseline, its figures);
    every credit ("better") carries the recency control (:func:`_recency`).
    ``delta``: the A−B column, turned into EpiKV minus the baseline; ``fmt(row, d, epikv_first)``: the
    figures shown. The direction is the test's: for KL the signed ranks (``sign``), which the mean can
    contradict when a few samples carry it; for accuracy the sign of b − c, which is the difference's.
    ``fidelity``: a pair whose every KL difference is within float rounding (all ``tied``) is "the same"."""
    out: dict[str, list[tuple[str, str]]] = {
        "better": [],
        "worse": [],
        "equivalent": [],
        "inconclusive": [],
        "same": [],
    }
    recency = next((x for x in set(pairs["A"]) | set(pairs["B"]) if name_of.get(x, x) == RECENCY), None)
    for _, row in pairs.iterrows():
        if label not in (row["A"], row["B"]):
            continue
        first = row["A"] == label
        other = row["B"] if first else row["A"]
        if name_of.get(other, other) not in paper.ATTENTION_SCORING:
            continue
        if fidelity and row.get("signed ranks") == fid.NOT_A_FINDING:
            continue  # the protocol chose what was kept: nothing to say about either method
        d = row[delta] if first else -row[delta]
        sign = int(row["sign"]) * (1 if first else -1) if fidelity else (d > 0) - (d < 0)  # EpiKV's side
        kind = _direction(row, sign, lower_is_better)
        if fidelity and row["samples"] and row["tied"] == row["samples"]:
            kind = "same"
        n = int(row["samples"] if fidelity else row["problems"])
        figures = f"{fmt(row, d, first)}{_tied(row) if fidelity else ''}, n={n}, p adj. {_p(row['p (adj.)'])}"
        if kind == "better" and recency is not None and label != recency:
            figures += _recency(pairs, label, other, recency, delta, lower_is_better, fmt, fidelity)
        out[kind].append((other, figures))
    return out


#: what EpiKV against the recency control found, where it is not a win
_AGAINST_RECENCY = {
    "worse": "worse",
    "inconclusive": "inconclusive",
    "equivalent": "equivalent",
    "same": "the same",
}


def _recency(
    pairs, label: str, baseline: str, recency: str, delta: str, lower_is_better: bool, fmt, fidelity: bool
) -> str:
    """The control for a credit: StreamingLLM (keeps the most recent tokens) against the same baseline on the
    same table, and "no better than recency" when EpiKV does not beat StreamingLLM itself."""
    out = ""
    for a, b, what in ((recency, baseline, f"{RECENCY_LABEL} vs {baseline}"), (label, recency, None)):
        row = _pair_of(pairs, a, b)
        if row is None:
            continue
        first = row["A"] == a
        sign = (int(row["sign"]) if fidelity else int(row[delta] > 0) - int(row[delta] < 0)) * (1 if first else -1)
        kind = _direction(row, sign, lower_is_better)
        if what is not None:
            d = row[delta] if first else -row[delta]
            out += f"; control: {what} {fmt(row, d, first)}, p adj. {_p(row['p (adj.)'])}"
        elif kind != "better":
            out += f"; no better than recency (against {RECENCY_LABEL} itself: {_AGAINST_RECENCY[kind]})"
    return out


def _said(groups: dict[str, list[tuple[str, str]]], better: str, worse: str) -> str:
    words = {
        "better": better,
        "worse": worse,
        "equivalent": "equivalent (within the declared margin, tested) to",
        "inconclusive": "not shown different from, and not shown equivalent to (inconclusive),",
        "same": "the same within float32 rounding (every per-sample difference) as",
    }
    return "; ".join(
        f"{words[kind]} {', '.join(f'{name} ({figures})' for name, figures in items)}"
        for kind, items in groups.items()
        if items
    )


@dataclass(frozen=True)
class Finding:
    """One sentence of the findings and its row of the at-a-glance table (``GLANCE`` columns)."""

    text: str
    glance: dict[str, Any]


GLANCE = [
    "domain",
    "budget",
    "EpiKV spec",
    "measure",
    "EpiKV vs full cache",
    "baselines EpiKV beats",
    "equivalent (tested margin)",
    "inconclusive",
    "baselines that beat EpiKV",
]


def _glance(
    domain: str, budget: int | str, label: str, measure: str, vs_full: str, groups: dict[str, list[tuple[str, str]]]
) -> dict[str, Any]:
    def names(kind: str) -> list[str]:
        return [name for name, _ in groups.get(kind, [])]

    level = names("equivalent") + [f"{n} (same within rounding)" for n in names("same")]
    return {
        "domain": domain,
        "budget": budget,
        "EpiKV spec": label,
        "measure": measure,
        "EpiKV vs full cache": vs_full,
        "baselines EpiKV beats": ", ".join(names("better")) or "-",
        "equivalent (tested margin)": ", ".join(level) or "-",
        "inconclusive": ", ".join(names("inconclusive")) or "-",
        "baselines that beat EpiKV": ", ".join(names("worse")) or "-",
    }


def _signed(v: float) -> str:
    """A KL difference: 3 decimals, or 2 significant digits below 0.0005 (a significant difference then
    still shows its size and sign instead of +0.000)."""
    return f"{v:+.3f}" if v == 0 or abs(v) >= 0.0005 else f"{v:+.1e}"


def _kl_delta(row: pd.Series, d: float, epikv_first: bool) -> str:
    """The Hodges–Lehmann shift with the interval of its test (``d``, the mean, is descriptive only)."""
    sign = 1 if epikv_first else -1
    lo, hi = (row["Δ KL lo"], row["Δ KL hi"]) if epikv_first else (-row["Δ KL hi"], -row["Δ KL lo"])
    return f"HL shift {_signed(sign * row['HL shift'])} [{_signed(lo)}, {_signed(hi)}] (mean Δ {_signed(d)})"


def _heading(domain: str, budget: int | str, protocol: int | None) -> str:
    """A finding's bold lead: ``**protocol #4, math, budget prompt+64**`` (two protocols' findings on one
    domain and budget would otherwise read alike)."""
    return f"**{f'protocol #{protocol}, ' if protocol is not None else ''}{domain}, budget {budget}**"


def fidelity_findings(
    pairs: pd.DataFrame,
    board: pd.DataFrame,
    domain: str,
    budget: int | str,
    name_of: Mapping[str, str],
    protocol: int | None = None,
) -> list[Finding]:
    """How close each EpiKV spec stays to the full cache, and whether it matches the attention
    baselines, at one budget in one domain; only what the pairs' verdicts (signed-rank, adjusted) support."""
    out = []
    for _, e in board[_named(board["method"], name_of) == EPIKV].iterrows():
        if e.get("ranked", 1) == 0:  # (a board without the column: every method ranked)
            text = (
                f"{_heading(domain, budget, protocol)} (fidelity, {int(e['samples'])} samples): not a finding. In none of its "
                f"samples did {_who(e['method'])}'s ranking decide what was evicted (each eviction dropped nothing or every "
                "candidate, as the protocol dictated), so its KL and every comparison of it are the protocol's, untested."
            )
            out.append(
                Finding(
                    text,
                    {
                        **_glance(
                            domain,
                            budget,
                            e["method"],
                            "fidelity (KL)",
                            f"not a finding: the protocol chose ({int(e['samples'])} samples)",
                            {},
                        ),
                        "equivalent (tested margin)": "-",
                        "inconclusive": "-",
                    },
                )
            )
            continue
        line = (
            f"{_heading(domain, budget, protocol)} (fidelity, {int(e['samples'])} samples): {_who(e['method'])}'s mean KL to the "
            f"full cache is {e['KL']:.3f} nats/token {e['KL 95% CI']}, top-1 agreement {e['top-1 %']:.1f}% {e['top-1 95% CI']}."
        )
        groups = _against_baselines(pairs, e["method"], "Δ KL (A−B)", True, _kl_delta, name_of, fidelity=True)
        said = _said(groups, "lower than", "higher than")
        vs_full = f"KL {e['KL']:.3f} {e['KL 95% CI']}, top-1 {e['top-1 %']:.1f}% ({int(e['samples'])} samples)"
        out.append(
            Finding(
                line + (f" Its KL is {said}." if said else ""),
                _glance(domain, budget, e["method"], "fidelity (KL)", vs_full, groups),
            )
        )
    return out


def _pair_of(pairs: pd.DataFrame, a: str, b: str) -> pd.Series | None:
    hit = (
        pairs[((pairs["A"] == a) & (pairs["B"] == b)) | ((pairs["A"] == b) & (pairs["B"] == a))]
        if not pairs.empty
        else pairs
    )
    return None if hit.empty else hit.iloc[0]


def accuracy_findings(
    board: pd.DataFrame,
    pairs: pd.DataFrame,
    domain: str,
    budget: int | str,
    name_of: Mapping[str, str],
    protocol: int | None = None,
) -> list[Finding]:
    """Each EpiKV spec's accuracy against full cache and against the attention baselines, at one budget in
    one domain: each pair's verdict (:func:`analysis.verdicts.judge`, the leaderboard's and the head-to-head
    table's), with StreamingLLM against the same baseline as the control for every credit."""
    full = board[board["test"] == "reference"]
    if full.empty:
        return []
    f = full.iloc[0]
    out = []
    for _, e in board[_named(board["method"], name_of) == EPIKV].iterrows():
        pair = _pair_of(pairs, e["method"], f["method"])
        p_adj = pair["p (adj.)"] if pair is not None else math.nan
        close = str({"lower": "below", "higher": "above"}.get(e["verdict_full"], e["verdict_full"]))
        if close.startswith("equivalent"):
            close = f"{close} of"
        elif close == INCONCLUSIVE:
            close = "inconclusive (neither shown different nor shown equivalent) against"
        line = (
            f"{_heading(domain, budget, protocol)} (accuracy, {int(e['problems'])} problems): {_who(e['method'])} {e['accuracy']:.1f}% "
            f"{e['interval']} against full cache {f['accuracy']:.1f}% {f['interval']}: {close} full cache (on the "
            f"{int(e['delta_n'])} problems the two have: Δ {e['delta_full']:+.1f} pts [{e['delta_lo']:+.1f}, "
            f"{e['delta_hi']:+.1f}], {e['test']} p {_p(e['p_value'])}, "
            f"p adj. {_p(p_adj)})."
        )
        groups = _against_baselines(
            pairs,
            e["method"],
            "Δ A−B (pts)",
            False,
            lambda row, d, _: f"Δ {d:+.1f} pts, {row['test']}",
            name_of,
            fidelity=False,
        )
        said = _said(groups, "above", "below")
        vs_full = (
            f"{e['accuracy']:.1f}% vs {f['accuracy']:.1f}%, Δ {e['delta_full']:+.1f} pts "
            f"[{e['delta_lo']:+.1f}, {e['delta_hi']:+.1f}], p {_p(e['p_value'])}, p adj. {_p(p_adj)} "
            f"({int(e['problems'])} problems)"
        )
        out.append(
            Finding(
                line + (f" Against the attention baselines it is {said}." if said else ""),
                _glance(domain, budget, e["method"], "accuracy", vs_full, groups),
            )
        )
    return out


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------

_BOARD = [
    "method",
    "accuracy",
    "interval",
    "delta_full",
    "delta_lo",
    "delta_hi",
    "p_value",
    "verdict_full",
    "vs_best",
    "problems",
    "failed",
]
_FID = ["method", "KL", "KL 95% CI", "top-1 %", "top-1 95% CI", "ΔNLL", "samples", "ranked", "tokens"]
_FID_PAIRS = [
    "A",
    "B",
    "samples",
    "runs",
    "tied",
    "Δ KL (A−B)",
    "HL shift",
    fid.HL_CI,
    "Δ top-1 (pts)",
    "Δ top-1 95% CI",
    "signed ranks",
    "p (Wilcoxon)",
    "p (adj.)",
    "verdict",
]
_ACC_PAIRS = ["A", "B", "problems", "A only", "B only", "A %", "B %", "Δ A−B (pts)", "test", "p", "p (adj.)", "verdict"]


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


class _Writer:
    def __init__(self, engine, out: Path, dims: dict[str, Any]):
        self.engine, self.out = engine, out
        self.dims = dims
        self.name_of = method_names(dims)
        # the EpiKV family is drawn solid in the figures, every other method dashed
        self.family = {label for label, name in self.name_of.items() if name in paper.REFERENCE_FAMILY}
        self.figures = out / FIGURES
        self.lines: list[str] = []
        self.findings: list[str] = []
        self.glance: list[dict[str, Any]] = []

    def found(self, s: Slice, findings: list[Finding]) -> None:
        self.findings += [f.text for f in findings]
        self.glance += [{"protocol": f"#{s.protocol_id}", **f.glance} for f in findings]

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def figure(self, name: str, path_maker) -> None:
        self.figures.mkdir(parents=True, exist_ok=True)
        path = path_maker(self.figures / name)
        self.add(f"![{name}]({FIGURES}/{path.name})", "")


def _domain_section(
    w: _Writer,
    s: Slice,
    dims: dict[str, Any],
    domain: str,
    budgets: list[int],
    acc_curves: pd.DataFrame,
    acc_full: pd.DataFrame,
    fid_curves: pd.DataFrame,
    tag: str,
) -> None:
    w.add(f"### {domain}", "")
    acc = acc_curves[acc_curves["domain"] == domain]
    full = acc_full[acc_full["domain"] == domain]
    if not acc.empty:
        ref = float(full["accuracy"].iloc[0]) if not full.empty else None
        w.figure(
            f"{tag}-{_slug(domain)}-accuracy.png",
            lambda p: budget_figure(
                acc,
                "accuracy",
                "acc_lo",
                "acc_hi",
                "accuracy (%)",
                f"{domain}: accuracy vs budget ({s.model})",
                p,
                w.family,
                ref,
            ),
        )
    fc = fid_curves[fid_curves["domain"] == domain]
    if not fc.empty:
        w.figure(
            f"{tag}-{_slug(domain)}-kl.png",
            lambda p: budget_figure(
                fc,
                "KL",
                "KL lo",
                "KL hi",
                "mean KL(full || method), nats/token",
                f"{domain}: KL to the full cache vs budget",
                p,
                w.family,
                0.0,
            ),
        )
        w.figure(
            f"{tag}-{_slug(domain)}-top1.png",
            lambda p: budget_figure(
                fc,
                "top-1 %",
                "top-1 lo",
                "top-1 hi",
                "top-1 agreement with full cache (%)",
                f"{domain}: top-1 agreement vs budget",
                p,
                w.family,
                100.0,
            ),
        )
    for b in budgets:
        f_dom = replace(s.filters, domains=(domain,))
        board = tables.leaderboard(w.engine, f_dom, b, dims).by_domain
        board = board[board["domain"] == domain] if not board.empty else board
        fb = fid.fidelity_board(w.engine, f_dom, b, dims)
        fboard = fb.by_domain[fb.by_domain["domain"] == domain] if not fb.by_domain.empty else fb.by_domain
        non_full = (board["test"] != "reference").any() if not board.empty else False
        if not non_full and (fboard.empty or (_named(fboard["method"], w.name_of) == "full").all()):
            continue
        w.add(f"#### {domain}, budget {s.budget(b)}", "")
        if non_full:
            w.add(
                "Accuracy (95% interval; Δ vs full cache with the interval of its test: exact McNemar below 25 discordant "
                "problems, else McNemar's score test; each comparison alone, on the problems the two have; vs best: against the "
                "table's best, equivalence only within a tested ±5-point margin):",
                "",
                markdown_table(board, _BOARD, {"accuracy": 1, "delta_full": 1, "delta_lo": 1, "delta_hi": 1}),
                "",
            )
            all_pairs = head_to_head(w.engine, f_dom, b, dims, {"full", EPIKV, RECENCY})
            pairs = _involves(all_pairs, ("full", EPIKV), w.name_of)
            if not pairs.empty:
                w.add(
                    "Paired accuracy tests against full cache and against EpiKV, on the problems of the table above (A only / "
                    f"B only: the discordant problems; {FAMILY_TEXT}):",
                    "",
                    markdown_table(pairs, _ACC_PAIRS, {"A %": 1, "B %": 1, "Δ A−B (pts)": 1}),
                    "",
                )
            w.found(s, accuracy_findings(board, all_pairs, domain, s.budget(b), w.name_of, s.protocol_id))
        if not fboard.empty:
            fpairs = fid.fidelity_pairs(w.engine, f_dom, b, dims)
            fpairs = fpairs[fpairs["domain"] == domain] if not fpairs.empty else fpairs
            full_at = (
                f"; full cache's rows from budget {s.budget(fb.full_budget)}" if fb.full_budget not in (None, b) else ""
            )
            w.add(
                "Fidelity (mean over samples of per-token KL(full || method) in nats, 95% bootstrap interval; top-1 "
                "agreement, 95% Wilson interval over tokens with the design effect of their samples; ranked: samples in which "
                "the method's own ranking decided what was evicted, the others evicted nothing or every candidate, as the "
                f"protocol dictated, and a method ranked in none is not a finding{full_at}):",
                "",
                markdown_table(fboard, _FID, {"KL": 4, "top-1 %": 1, "ΔNLL": 4}),
                "",
            )
            shown = _involves(fpairs, ("full", EPIKV), w.name_of)
            if not shown.empty:
                w.add(
                    "Paired fidelity tests against full cache and against EpiKV, on the samples of the table above (Δ of "
                    "per-sample means, descriptive; Wilcoxon signed-rank: differences within float32 rounding are tied and left "
                    "out, the signed ranks give the direction, the Hodges–Lehmann shift and the interval inverting the test; "
                    "runs: the sweep runs whose rows the pair reads (a resume is a run of its own), more than one where its "
                    f"sides were computed apart; {FAMILY_TEXT}):",
                    "",
                    markdown_table(shown, _FID_PAIRS, {"Δ KL (A−B)": 4, "HL shift": 4, "Δ top-1 (pts)": 1}),
                    "",
                )
            w.found(s, fidelity_findings(fpairs, fboard, domain, s.budget(b), w.name_of, s.protocol_id))


def _slice_section(w: _Writer, s: Slice, dims: dict[str, Any], index: int) -> None:
    t = totals(w.engine, replace(s.filters, measure=None), dims["tasks"])
    w.add(
        f"## {s.model} — protocol {s.protocol}",
        "",
        f"{t['cells']} cells ({t['fidelity_cells']} fidelity, {t['failed']} failed), {t['samples']} samples, "
        f"{t['tokens']:,} tokens through the model, {_hours(t['seconds'])} of cell time.",
        "",
    )
    budgets = _budgets(w.engine, replace(s.filters, measure=None))
    acc_curves, acc_full = tables.budget_curves(w.engine, s.filters, dims)
    fid_curves = fid.fidelity_curves(w.engine, s.filters, dims)
    domains = sorted({d for d in [*acc_curves["domain"], *fid_curves["domain"], *acc_full["domain"]]})
    for domain in domains:
        _domain_section(w, s, dims, domain, budgets, acc_curves, acc_full, fid_curves, f"s{index}")
    claims = tables.scorecard(w.engine, s.filters, dims=dims)
    fclaims = fid.fidelity_scorecard(w.engine, s.filters, dims=dims)
    w.add("### Scorecard of the paper's claims", "")
    if not claims.empty:
        w.add(
            f"By accuracy (score tests, each claim on the problems the method and its reference have; {FAMILY_TEXT}):",
            "",
            markdown_table(
                claims,
                [
                    "domain",
                    "budget",
                    "method",
                    "claim",
                    "accuracy",
                    "reference %",
                    "Δ",
                    tables.CI,
                    "problems",
                    "test",
                    "p",
                    "p (adj.)",
                    "verdict",
                ],
                {"accuracy": 1, "reference %": 1, "Δ": 1},
            ),
            "",
        )
    if not fclaims.empty:
        w.add(
            f"By fidelity, where accuracy cannot separate methods (full-cache accuracy below {fid.ACCURACY_FLOOR:g}% "
            f"or not measured; Wilcoxon signed-rank with float-rounding ties left out, Hodges–Lehmann shift; {FAMILY_TEXT}):",
            "",
            markdown_table(
                fclaims,
                [
                    "domain",
                    "budget",
                    "method",
                    "claim",
                    "why fidelity",
                    "KL",
                    "reference KL",
                    "Δ KL",
                    "HL shift",
                    fid.HL_CI,
                    "samples",
                    "tied",
                    "signed ranks",
                    "p",
                    "p (adj.)",
                    "verdict",
                ],
                {"KL": 4, "reference KL": 4, "Δ KL": 4, "HL shift": 4},
            ),
            "",
        )
    if claims.empty and fclaims.empty:
        w.add("No EpiKV-family method with a paper baseline here: nothing to judge.", "")
    paper = tables.paper_claims(w.engine, s.filters, dims)
    w.add(
        "The paper's numbers beside kvleague's (score test of kvleague's accuracy against the paper's value):",
        "",
        markdown_table(paper, ["claim", "paper", "kvleague", "p vs paper", "p vs paper (Holm)", "verdict", "problems"]),
        "",
    )


def _ablations(w: _Writer, opts: q.Options) -> None:
    """Per model, the protocols that differ in one setting (``fidelity.protocol_ablations``): the table
    and one finding per (setting, domain, budget) naming the methods whose KL the change moved."""
    for model in opts.models:
        df = fid.protocol_ablations(w.engine, q.Filters(models=(model["id"],)), opts.protocols, w.dims)
        if df.empty:
            continue
        w.add(
            f"## Protocol ablations ({model['name']})",
            "",
            "The same method, budget and samples under two protocols that differ in exactly one setting (per pair of "
            "protocols, budget and domain, the samples every method there has under both): mean KL to the full cache "
            "under each, the paired mean difference B−A, Wilcoxon signed-rank (differences within float32 rounding tied "
            f"and left out; the signed ranks give the direction) with its Hodges–Lehmann shift and interval; {FAMILY_TEXT}.",
            "",
            markdown_table(df, fid.ABLATION_COLUMNS, {"KL A": 4, "KL B": 4, "Δ KL (B−A)": 4, "HL shift": 4}),
            "",
        )
        for (field, a, b, domain, budget), g in df.groupby(["field", "A", "B", "domain", "budget"], sort=False):
            groups: dict[str, list[str]] = {"better": [], "worse": [], "equivalent": [], "inconclusive": [], "same": []}
            for _, r in g.iterrows():
                kind = "same" if r["tied"] == r["samples"] else _direction(r, int(r["sign"]), True)
                groups[kind].append(
                    f"{r['method']} ({r['KL A']:.3f} → {r['KL B']:.3f}, HL shift {_signed(r['HL shift'])} "
                    f"[{_signed(r['Δ KL lo'])}, {_signed(r['Δ KL hi'])}]{_tied(r)}, p adj. {_p(r['p (adj.)'])})"
                )
            words = {
                "better": "lower",
                "worse": "higher",
                "equivalent": "equivalent within the declared margin",
                "inconclusive": "inconclusive",
                "same": "the same within float32 rounding (every per-sample difference)",
            }
            said = "; ".join(f"{words[kind]} for {', '.join(items)}" for kind, items in groups.items() if items)
            (n,) = set(g["samples"])  # one sample set per protocol pair, budget and domain
            w.findings.append(
                f"**{domain}, budget {budget}, protocol ablation** ({field} {a} → {b}, {int(n)} "
                f"samples, {model['name']}): KL to the full cache is {said}."
            )


def _signals(w: _Writer) -> None:
    """The signal studies (``kvleague signals``), when the database has them: the tables of
    :mod:`analysis.signal_tables` and one finding per task on the paper's sign pattern."""
    from kvleague.analysis import signal_tables as signals

    df = signals.read_correlations(w.engine)
    if df.empty:
        return
    w.add(
        "## Signal studies",
        "",
        "Spearman's rho between per-token signals and importance by occlusion (the increase in the reference "
        "continuation's NLL when a window is occluded), pooled over samples as the EpiKV authors pool, with 95% "
        "bootstrap intervals over samples. The paper's bands: positive at "
        f"{paper.band_text(paper.POSITIVE_LAYERS)} of depth, negative at {paper.band_text(paper.NEGATIVE_LAYERS)}.",
        "",
    )
    settings = [x for x in signals.SETTINGS if (df["occluded"] == x).any()]
    for setting in settings:  # each setting of the occlusion windows on its own, never pooled
        rows = df[df["occluded"] == setting]
        if len(settings) > 1:
            w.add(f"### Signal studies with {signals.SETTING_TITLES[setting]}", "")
        w.add(signals.markdown(rows), "")
        where = f", windows over the {setting}" if len(settings) > 1 else ""
        for _, v in signals.band_verdicts(signals.depth_table(rows)).iterrows():
            w.findings.append(
                f"**{v['domain']} ({v['task']}), signal study** ({v['samples']} samples, {v['model']}{where}): the paper's "
                f"sign pattern {v['verdict']} (early band: {v['early band: layers > 0']} of {v['early band: layers']} layers "
                f"above 0, {v['early band: layers < 0']} below; late band: {v['late band: layers < 0']} of "
                f"{v['late band: layers']} below 0, {v['late band: layers > 0']} above)."
            )
    if len(settings) > 1:
        comparison = signals.comparison_markdown(df)
        if comparison:
            w.add("### Signal studies: the two settings of the windows side by side", "", comparison, "")


def _provenance(w: _Writer) -> None:
    prov = q.provenance(w.engine, q.Filters(measure=None))
    w.add("## Environment and provenance", "")
    sweeps = pd.DataFrame(prov["sweeps"])
    if not sweeps.empty:
        sweeps["commit"] = sweeps["git_commit"].str[:12] + sweeps["git_dirty"].map(lambda d: " (dirty)" if d else "")
        sweeps["versions"] = (
            "torch "
            + sweeps["torch_version"].astype(str)
            + ", transformers "
            + sweeps["transformers_version"].astype(str)
            + ", kvleague "
            + sweeps["kvleague_version"].astype(str)
        )
        sweeps["hardware"] = sweeps["platform"].astype(str) + "; GPU " + sweeps["gpu_name"].astype(str)
        w.add(
            "Sweeps:",
            "",
            markdown_table(
                sweeps, ["name", "config_hash", "commit", "status", "rows", "ok_rows", "versions", "hardware"]
            ),
            "",
        )
    seeds = pd.DataFrame(prov["seeds"])
    if not seeds.empty:
        w.add("Seeds:", "", markdown_table(seeds, ["seed", "sample_indices", "rows"]), "")
    gens = pd.DataFrame(prov["generations"])
    if not gens.empty:
        w.add(
            "Decoding settings:", "", markdown_table(gens, ["id", "max_new_tokens", "temperature", "top_p", "stop"]), ""
        )
    tasks = pd.DataFrame(prov["tasks"])
    if not tasks.empty:
        w.add(
            "Tasks:",
            "",
            markdown_table(tasks, ["name", "domain", "dataset", "metric", "scorer_version", "options"]),
            "",
        )
    models = pd.DataFrame(prov["models"])
    if not models.empty:
        w.add("Models:", "", markdown_table(models, ["name", "source", "dtype", "attn_implementation"]), "")


def build(engine, out: str | Path, source: str = "", preamble: str = "") -> Path:
    """Write ``out/replication.md`` and its figures from ``engine``'s results; returns the markdown's path.
    ``preamble``: markdown placed before the findings (what the data is, what it leaves out), its
    ``{{...}}`` counts computed from the database (:mod:`analysis.preamble`) before anything is written."""
    dims = q.dimensions(engine)
    preamble = resolve_preamble(engine, preamble, dims["tasks"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    w = _Writer(engine, out, dims)
    for stale in sorted(w.figures.glob("*.png")) if w.figures.is_dir() else []:  # figures of an earlier report
        stale.unlink()
    opts = q.options(engine)
    every = totals(engine, tasks=dims["tasks"])
    for i, s in enumerate(slices(engine, opts)):
        _slice_section(w, s, dims, i)
    _ablations(w, opts)
    _signals(w)
    _provenance(w)
    head = [
        "# kvleague replication report",
        "",
        f"Generated by `kvleague report` from {source or 'a kvleague database'}. Every number below comes from the "
        "dashboard's own tables; p-values are two-sided; every comparison's adjusted p, interval and verdict follow one "
        f"declared rule (analysis/paper.yaml): {FAMILY_TEXT}.",
        "",
        f"**Totals:** {every['cells']} cells ({every['fidelity_cells']} fidelity, {every['failed']} failed), "
        f"{every['samples']} samples (distinct prompts), {every['tokens']:,} tokens through the model, {_hours(every['seconds'])} of cell time "
        "(the sum of the cells' wall times, each cell on one CPU-bound worker; cells run as one batch share its wall time "
        "equally).",
        "",
        *([preamble.strip(), ""] if preamble.strip() else []),
        "## Findings",
        "",
        "Each sentence restates rows of the tables below, on the same samples (the n it states is the table's): a "
        "difference is called lower, higher, above or below only when its adjusted p is under 0.05, and in the "
        "direction its test found (for KL the signed ranks, which a mean carried by a few samples can contradict). "
        "KL differences within float32 rounding are ties (`tied`), left out of the signed-rank test; a prompt that two "
        'task variants share counts once. "Equivalent" is said only where both one-sided tests at the declared margin '
        'reject; a difference neither shown nor excluded is "inconclusive". Every credit of EpiKV over a baseline '
        "also reports StreamingLLM (recency) against the same baseline on the same samples.",
        "",
    ]
    if w.glance:
        head += [
            "At a glance: per protocol, domain and budget, how close each EpiKV spec stays to the full cache and which "
            "attention-scoring baselines it beats, is shown equivalent to, or loses to (paired tests, adjusted p < 0.05; by KL "
            "for fidelity, by accuracy for accuracy):",
            "",
            markdown_table(pd.DataFrame(w.glance), ["protocol", *GLANCE]),
            "",
        ]
    findings = [f"- {line}" for line in w.findings] or ["- No EpiKV results in this database: nothing to report."]
    text = "\n".join([*head, *findings, "", *w.lines]).rstrip() + "\n"
    path = out / REPORT
    path.write_text(text, encoding="utf-8")
    return path
