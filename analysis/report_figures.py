"""The report's figures: per domain, each method's accuracy and fidelity (KL, top-1 agreement) against
budget with 95% intervals. Written as PNGs with no timestamp or software tag, so the same results
always give the same bytes."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; set before pyplot is imported
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib import ticker

_STYLE = {"dpi": 110, "figsize": (7.6, 3.6)}


def _save(fig, path: Path) -> None:
    plt.rcParams["svg.hashsalt"] = "kvleague"
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def _panel(ax, curves: pd.DataFrame, y: str, lo: str, hi: str, solid: Collection[str]) -> None:
    for method, rows in curves.groupby("method", sort=True):
        rows = rows.sort_values("budget")
        style = "-" if method in solid else "--"
        (line,) = ax.plot(rows["budget"], rows[y], style, marker="o", markersize=3, label=method, linewidth=1.4)
        ax.fill_between(rows["budget"], rows[lo], rows[hi], color=line.get_color(), alpha=0.12, linewidth=0)
    # a tick at every budget measured, written out (log2 ticks would label powers of two only)
    budgets = sorted({int(b) for b in curves["budget"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [f"{b:,}" for b in budgets])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.set_xlabel("KV budget (tokens)")
    ax.grid(alpha=0.3)


def budget_figure(
    curves: pd.DataFrame,
    y: str,
    lo: str,
    hi: str,
    ylabel: str,
    title: str,
    path: Path,
    solid: Collection[str] = (),
    reference: float | None = None,
    reference_label: str = "full cache",
) -> Path:
    """One domain's curves (``curves``: method, budget, y, lo, hi), intervals shaded; the methods in
    ``solid`` (the EpiKV family, so the paper's question reads at a glance) drawn solid, the rest dashed;
    ``reference``: a horizontal line (full cache)."""
    fig, ax = plt.subplots(figsize=_STYLE["figsize"], dpi=_STYLE["dpi"])
    _panel(ax, curves, y, lo, hi, solid)
    if reference is not None:
        ax.axhline(reference, color="black", linewidth=1, linestyle=":", label=reference_label)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    # beside the axes, never over the curves and their bands
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    _save(fig, path)
    return path
