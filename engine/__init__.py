"""The ground floor: generation under a hard KV budget, and the contract eviction methods implement.

Everything above (methods, tasks, the sweep, the database, the dashboard) builds on this package;
it imports nothing from them. Its modules, one job each:

* ``contract``  what a method is and sees (:class:`EvictionMethod`, :class:`Needs`, observations);
* ``generation``  :class:`Engine`: sessions over one backend, ``generate`` and ``generate_batch``;
* ``backend``  the seam to a model runtime (:class:`~engine.backend.HFBackend`: Hugging Face's forward);
* ``slab``  the slab backend: fixed-size KV slabs compacted in place, decode steps capturable as CUDA graphs;
* ``session``  :class:`Session`: one sequence's cache, prefill, decode and teacher forcing;
* ``decode``  the one decode loop: a step (forward, track, observe, evict) for any number of sequences;
* ``batch``  batching policy: which sequences decode together, and how many fit;
* ``cache``  the budgeted KV cache (``cache_layers``, ``selection``, ``compaction``, ``cache_rows`` beside it);
* ``probe``  the attention-weight recorder for methods that read attention;
* ``protocol``  the budget rules (:class:`Protocol`) and decoding settings;
* ``resources``  peak-memory measurement;
* ``registry``  the one registry implementation behind methods and tasks (decorator, package modules, entry points);
* ``errors``  :class:`KvleagueError`, the one-line input error every layer raises.
"""

from typing import Literal, get_args

from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol

#: the engine backends a model can run on (``backend.py``: ``HFBackend.name``; ``slab.py``: fixed KV slabs,
#: CUDA-graph decode steps), as sweeps and
#: ``load_engine`` name them: here, not in backend.py, so that configs check names without torch
Backend = Literal["hf", "slab"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)


def check_backend(name: str) -> None:
    """One-line error for a backend name that is not in :data:`BACKENDS`."""
    if name not in BACKENDS:
        raise KvleagueError(f"backend: unknown {name!r}; allowed: {', '.join(BACKENDS)}")


# ``generation`` and ``session`` import torch and transformers (seconds); loaded on first use so that
# importing ``engine.errors`` (every CLI command does) stays cheap
_LAZY = {"DecodeOutput": "decode", "Engine": "generation", "GenerationResult": "session", "Session": "session"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"kvleague.engine.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvleague.engine' has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "check_backend",
    "DecodeOutput",
    "Engine",
    "GenerationResult",
    "GenerationSettings",
    "KvleagueError",
    "Protocol",
    "Session",
]
