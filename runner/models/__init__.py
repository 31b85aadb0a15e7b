"""Making models: resolving a spec (a known name, a GGUF file, a checkpoint, a Hub id) to a local
checkpoint (``source``), building tiny random-weight test models (``tiny``), and loading either into
an engine (``loading``).

``load_engine`` is imported on first use: a sweep's driver resolves and checks model specs
(``source``) without torch or transformers, which only its workers need."""

__all__ = ["load_engine"]


def __getattr__(name: str):
    if name == "load_engine":
        from kvleague.runner.models.loading import load_engine

        return load_engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
