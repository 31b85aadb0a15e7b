"""The Streamlit leaderboard (``streamlit run dashboard/app.py`` or ``kvleague dashboard``): the app
(:mod:`dashboard.ui`) and one module per page (:mod:`dashboard.views`), showing the tables of
:mod:`analysis`; ``kvleague dashboard`` / ``kvleague report`` (:mod:`dashboard.commands`)."""
