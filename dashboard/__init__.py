"""The Streamlit leaderboard (``streamlit run dashboard/app.py`` or ``kvleague dashboard``): read-only
SQL aggregations (:mod:`dashboard.queries`), statistics (:mod:`dashboard.stats`), page data
(:mod:`dashboard.tables`) and one module per page (:mod:`dashboard.views`)."""
