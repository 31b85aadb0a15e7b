"""The oracle pair of the tests that let the slab backend part from ``hf``'s float bits (slots
reordered, eager attention grouped): both backends over one checkpoint in float64, where those
differences are ~1e-16 and the tokens and kept positions must agree."""

from __future__ import annotations


def float64_pair(path, **load):
    """``(hf, slab)`` engines of the checkpoint ``path`` (``load``: ``load_engine``'s options for both),
    in float64, with no EOS."""
    from kvleague.runner.models import load_engine

    hf, slab = load_engine(str(path), **load), load_engine(str(path), backend="slab", **load)
    for engine in (hf, slab):
        engine.model.double()
        engine.eos_ids = set()
    return hf, slab
