"""What a page reads, and how it is cached: the read-only database engine, the results' fingerprint and
the page context whose ``data(fn, ...)`` runs one of the analysis layer's table functions.

Page data is cached with ``st.cache_data`` keyed on the function, its arguments (the filters) and a
fingerprint of the results tables (largest id and row count of sample_results and of benchmark_results,
re-read at most every few seconds), so new results show up on the next rerun without recomputing
anything when nothing changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import streamlit as st

from kvleague.analysis import queries as q

FINGERPRINT_TTL_S = 3


@st.cache_resource(show_spinner=False)
def engine_for(url: str):
    return q.open_readonly(url)


@st.cache_data(show_spinner=False, ttl=FINGERPRINT_TTL_S)
def fingerprint(url: str) -> tuple[int, ...]:
    """sample_results' ``(max id, count)``, then benchmark_results': ``kvleague bench --store`` adds no
    sample results, yet its figures must show up too."""
    engine = engine_for(url)
    return q.fingerprint(engine) + q.benchmark_fingerprint(engine)


@st.cache_data(show_spinner="Aggregating results...", max_entries=256)
def _cached(_fn: Callable[..., Any], name: str, url: str, fp: tuple[int, ...], *args: Any) -> Any:
    """``_fn(engine, *args)`` until the fingerprint changes; the function is keyed by ``name`` (Streamlit
    does not hash arguments whose name starts with an underscore)."""
    return _fn(engine_for(url), *args)


def cached(fn: Callable[..., Any], url: str, fp: tuple[int, ...], *args: Any) -> Any:
    """``fn(engine, *args)``, cached: ``fn`` is a table function of :mod:`analysis`."""
    return _cached(fn, f"{fn.__module__}.{fn.__qualname__}", url, fp, *args)


@dataclass
class Context:
    url: str
    fp: tuple[int, ...]
    filters: q.Filters
    opts: q.Options | None

    def data(self, fn: Callable[..., Any], *args: Any) -> Any:
        return cached(fn, self.url, self.fp, *args)
