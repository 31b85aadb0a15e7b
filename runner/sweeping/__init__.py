"""A sweep, one module per job: ``grid`` expands a config into cells, ``cell`` runs one (no Ray),
``scheduler`` runs cells on Ray actors, ``writer`` is the single database writer, ``progress`` draws,
``driver`` ties them into a resumable sweep. ``runner/sweep.py`` is the command line.

Every cell has a deterministic key (the spec hash of everything that determines its result); cells
whose key already has a row are skipped, so an interrupted sweep resumes where it stopped and a
finished one re-runs in seconds without writing anything.
"""

from kvleague.runner.sweeping.cell import CellWorker
from kvleague.runner.sweeping.driver import SweepRunner, SweepSummary, print_summary
from kvleague.runner.sweeping.grid import Cell, Grid, expand, load_tokenizer

__all__ = ["Cell", "CellWorker", "Grid", "SweepRunner", "SweepSummary", "expand", "load_tokenizer", "print_summary"]
