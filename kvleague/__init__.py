"""kvleague: a benchmark and leaderboard for KV-cache eviction methods.

Everything installs under this one name: ``kvleague.methods``, ``kvleague.tasks``, ``kvleague.db``,
``kvleague.analysis``, ``kvleague.runner`` and ``kvleague.dashboard`` are the repository's top-level
folders of those names (pyproject's ``package-dir`` maps them), so a user's own ``tasks.py`` or
``db/`` never collides with kvleague's.
"""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_here, "runner")):
    # a checkout used without installing (``python runner/sweep.py`` under ``ray job submit
    # --working-dir .``, ``PYTHONPATH=.``): the subpackages are the folders beside this one
    __path__.append(_os.path.dirname(_here))
