"""The Streamlit app: the database, sidebar filters, page dispatch (pages: :data:`dashboard.views.PAGES`;
what they read and its caching: :mod:`dashboard.data`).

The database URL comes from ``--db`` (after ``--`` on the ``streamlit run`` line), else
``$KVLEAGUE_DB`` (what ``kvleague dashboard`` sets: a URL may hold a password, which must stay out of
argv), else ``sqlite:///kvleague.db``; it is opened read-only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import streamlit as st
from sqlalchemy.exc import SQLAlchemyError

from kvleague.analysis import queries as q
from kvleague.dashboard.data import Context, cached, engine_for, fingerprint
from kvleague.dashboard.views import PAGES
from kvleague.dashboard.views.common import plain
from kvleague.engine.errors import KvleagueError

SLUGS = {title: page.slug for title, page in PAGES.items()}


def cli_db_url(argv: list[str] | None = None) -> str | None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--db", default=None)
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args.db


def _multiselect(
    label: str, options: list, fmt: Callable[[Any], str] = str, key: str | None = None, help: str | None = None
) -> tuple | None:
    """A filter defaulting to everything; None when everything is selected (a stable cache key)."""
    chosen = st.sidebar.multiselect(label, options, default=options, format_func=fmt, key=key, help=help)
    if len(chosen) == len(options):
        return None
    return tuple(chosen)


def sidebar_filters(opts: q.Options) -> q.Filters:
    st.sidebar.header("Filters")
    models = {m["id"]: m["name"] for m in opts.models}
    f_models = _multiselect("Model", list(models), lambda i: models.get(i, str(i)), key="f_model")
    f_domains = _multiselect("Domain", opts.domains, key="f_domain")
    task_opts = [t for t in opts.tasks if f_domains is None or t["domain"] in f_domains]
    names = {t["id"]: t["label"] for t in task_opts}
    # keyed on the domain choice: a new domain choice starts the task choice afresh (all of them)
    task_key = "f_task" if f_domains is None else "f_task_" + "_".join(sorted(f_domains))
    f_tasks = _multiselect("Task", list(names), lambda i: names.get(i, str(i)), key=task_key)
    f_budgets = _multiselect(
        "Budget (KV entries)",
        opts.budgets,
        opts.budget_labels.__getitem__,
        key="f_budget",
        help="prompt+B: B entries of room on top of each sample's prompt",
    )
    protos = {p["id"]: p["label"] for p in opts.protocols}
    f_protocols = _multiselect(
        "Protocol",
        list(protos),
        lambda i: protos.get(i, str(i)),
        key="f_protocol",
        help="cadence, position handling, sink and recent windows, prompt protection",
    )
    f_decoding = _multiselect(
        "Decoding", opts.decodings, key="f_decoding", help="greedy: temperature 0; sampled: temperature > 0"
    )
    if f_tasks is not None and f_domains is not None:
        f_domains = None  # the task list already reflects the domains
    elif f_domains is not None:
        f_tasks = tuple(names)
        f_domains = None
    return q.Filters(
        models=f_models, domains=f_domains, tasks=f_tasks, budgets=f_budgets, protocols=f_protocols, decoding=f_decoding
    )


def choose_page() -> str:
    slug_to_page = {v: k for k, v in SLUGS.items()}
    wanted = st.query_params.get("page")
    if "page" not in st.session_state:
        st.session_state["page"] = slug_to_page.get(str(wanted), next(iter(PAGES)))
    page = st.sidebar.radio("Page", list(PAGES), key="page")
    if st.query_params.get("page") != SLUGS[page]:
        st.query_params["page"] = SLUGS[page]
    return page


def main() -> None:
    st.set_page_config(page_title="kvleague leaderboard", page_icon=":bar_chart:", layout="wide")
    url = q.resolve_url(cli_db_url())
    st.sidebar.title("kvleague")
    page = choose_page()
    try:
        engine = engine_for(url)
        if not PAGES[page].results:  # its own table and no filters: it shows on a database without results
            PAGES[page].render(Context(url=url, fp=(), filters=q.Filters(), opts=None))
            return
        if not q.has_schema(engine):
            st.title(page)
            st.info(
                f"The database at `{_display(url)}` has no results tables yet. Run a sweep first: "
                "`kvleague sweep --config sweeps/demo.yaml`."
            )
            return
        fp = fingerprint(url)
    except KvleagueError as exc:
        st.title(page)
        st.error(plain(exc))
        return
    except SQLAlchemyError as exc:  # a database read-only where WAL needs to write, a server gone
        from kvleague.db.session import error_reason, storage_fault

        st.title(page)
        st.error(f"Could not open {plain(_display(url))}: {plain(storage_fault(exc) or error_reason(exc))}.")
        return
    if fp[1] == 0:
        st.title(page)
        st.info(f"No results in `{_display(url)}` yet. Run a sweep: `kvleague sweep --config sweeps/demo.yaml`.")
        return
    opts = cached(q.options, url, fp)
    filters = sidebar_filters(opts)
    shown = _display(url)
    short = shown.rsplit("/", 1)[-1] if shown.startswith("sqlite") else shown
    st.sidebar.caption(f"{fp[1]:,} sample results in `{short}` (read-only)", help=shown)
    ctx = Context(url=url, fp=fp, filters=filters, opts=opts)
    try:
        PAGES[page].render(ctx)
    except (SQLAlchemyError, KvleagueError) as exc:  # a schema behind the code, a dropped connection
        first = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        st.error(
            f"Could not read the results: {plain(first[0] if first else type(exc).__name__)}. "
            "If the schema is old, run `kvleague db upgrade --db URL`."
        )


def _display(url: str) -> str:
    try:
        from kvleague.db.session import display_url

        return display_url(url)
    except Exception:
        return url
