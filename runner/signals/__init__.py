"""The signal study (``kvleague signals``, docs/signals.md): which per-token signals predict occlusion
importance. Per sample, labels and signals (:mod:`runner.signals.study`, every registered method's
scores on one session through :mod:`runner.signals.method_panel`); over the samples, pooled Spearman
rho with its bootstrap (:mod:`runner.signals.correlation`); the rows in table ``signal_correlations``
(:mod:`runner.signals.store`); the command (:mod:`runner.signals.commands`). Its tables for the
Signals page and the report are :mod:`analysis.signal_tables` (the analysis layer, below this one)."""
