"""The analysis layer: what the dashboard, ``kvleague report`` and the benchmarks compute from results,
below all of them so that each imports it and none imports another. Read-only SQL aggregations
(:mod:`analysis.queries`), the statistics (:mod:`analysis.stats`, :mod:`analysis.score_tests`,
:mod:`analysis.verdicts`, :mod:`analysis.multiplicity`, :mod:`analysis.calibration`), the tables
every page and the report show (:mod:`analysis.tables`, :mod:`analysis.fidelity_tables`,
:mod:`analysis.head_to_head`, :mod:`analysis.signal_tables`), the paper's claims
(:mod:`analysis.paper`, ``paper.yaml``) and the report itself (:mod:`analysis.report`)."""
