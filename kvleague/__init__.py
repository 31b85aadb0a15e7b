"""kvleague: a benchmark and leaderboard for KV-cache eviction methods.

Everything installs under this one name: ``kvleague.engine``, ``kvleague.methods``, ``kvleague.tasks``,
``kvleague.db``, ``kvleague.analysis``, ``kvleague.runner`` and ``kvleague.dashboard`` are the
repository's top-level folders of those names, linked into this folder (``kvleague/engine ->
../engine``, ...), so a user's own ``tasks.py`` or ``db/`` never collides with kvleague's, and a type
checker or an IDE resolves every ``kvleague.*`` import to its file with no import hook.
"""
