"""One module per dashboard page; each has ``render(ctx)``."""

from __future__ import annotations

from dashboard.views import cost, curves, leaderboard, provenance, samples, scorecard, signals

PAGE_RENDERERS = {
    "Leaderboard": leaderboard.render,
    "Budget curves": curves.render,
    "Replication scorecard": scorecard.render,
    "Cost": cost.render,
    "Samples": samples.render,
    "Provenance": provenance.render,
    "Signals": signals.render,
}
