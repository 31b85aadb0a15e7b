"""Systems benchmarks (``kvleague bench ...``; scripts in ``benchmarks/``): feasible context under a
memory cap, decode speed under a budget, the engine against kvpress and against ``model.generate``.
The shared measuring code is :mod:`runner.bench.harness`."""
