"""Every benchmark of the project, in one place. Systems benchmarks (``kvleague bench ...``, or
``python -m runner.bench.<module>``): feasible context under a memory cap, decode speed under a
budget, the engine against kvpress and against ``model.generate``, batched decoding. Scripts run with
``python -m``: the per-step cost of each method (``method_overhead``), the dashboard's load time on
200k rows (``dashboard_load``) and the statistics' calibration table (``stats_calibration``).
The shared measuring code is :mod:`runner.bench.harness`."""
