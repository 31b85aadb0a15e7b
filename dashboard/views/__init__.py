"""The dashboard's pages, one module each with ``render(ctx)``, and the one list of them: the sidebar,
the ``?page=`` slugs and the dispatch all read :data:`PAGES`, so a new page is one module and one line here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvleague.dashboard.data import Context
from kvleague.dashboard.views import cost, curves, leaderboard, provenance, samples, scorecard, signals


@dataclass(frozen=True)
class Page:
    title: str
    render: Callable[[Context], None]
    #: False: the page reads a table of its own (not sample results) and shows without the sidebar's filters
    results: bool = True

    @property
    def slug(self) -> str:
        return self.title.lower().replace(" ", "-")


#: title -> page, in the sidebar's order
PAGES = {
    p.title: p
    for p in (
        Page("Leaderboard", leaderboard.render),
        Page("Budget curves", curves.render),
        Page("Replication scorecard", scorecard.render),
        Page("Cost", cost.render),
        Page("Samples", samples.render),
        Page("Provenance", provenance.render),
        Page("Signals", signals.render, results=False),
    )
}
