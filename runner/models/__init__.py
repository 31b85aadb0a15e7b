"""Making models: resolving a spec (a known name, a GGUF file, a checkpoint, a Hub id) to a local
checkpoint (``source``), building tiny random-weight test models (``tiny``), and loading either into
an engine (``loading``)."""

from kvleague.runner.models.loading import load_engine

__all__ = ["load_engine"]
