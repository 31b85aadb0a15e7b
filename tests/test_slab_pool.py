"""Slabs kept for reuse (``engine/slab_pool.py``, issue 49): a captured step replays for the next
sequences of its shape instead of being captured again, and reuse never shows one sequence another's
K/V. Oracles: the ``hf`` backend (no pool, no graphs) for tokens and kept positions; the shapes a
run meets for the captures it may pay."""

from __future__ import annotations

import pytest
import torch

from kvleague.engine.decode import DecodeLoop
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.engine.slab_pool import SlabPool
from kvleague.methods import build_method

BUDGET = 12


@pytest.fixture(scope="module")
def pair(tiny_models):
    from kvleague.runner.models import load_engine

    torch.set_num_threads(1)
    hf, slab = load_engine(str(tiny_models["llama"])), load_engine(str(tiny_models["llama"]), backend="slab")
    hf.eos_ids, slab.eos_ids = set(), set()
    return hf, slab


@pytest.fixture(scope="module")
def prompts(pair) -> list[list[int]]:
    text = "A slab given back is zeroed and handed to the next sequence of its shape, whose graph replays. " * 3
    ids = pair[0].tokenizer(text, add_special_tokens=False)["input_ids"]
    return [ids[i : i + 24] for i in range(8)]


def test_a_benchmark_run_captures_once_per_shape(pair, prompts):
    """``bench batch``'s runs, two rounds of `full` and `epikv` at batch 1 (both paths) and 4, on the
    captured step's path: one capture per (batch, capacity) shape (before the pool: a capture per
    run, 12 here), and every round's tokens those of ``hf``."""
    from kvleague.runner.bench.batch import time_engine, time_single

    hf, slab = pair
    backend = slab.backend
    backend.graphs = True
    backend._graphed.clear()
    before = backend.describe()
    try:
        runs = []
        for _ in range(2):
            for method in ("full", "epikv"):
                runs.append((method, 1, time_single(slab, prompts[0], method, BUDGET, 8)["tokens"]))
                for b in (1, 4):
                    runs.append((method, b, time_engine(slab, prompts[:b], method, BUDGET, 8)["tokens"]))
    finally:
        backend.graphs = False
    after = backend.describe()
    shapes = after["graph_capture_shapes"]
    assert after["graph_captures"] - before["graph_captures"] <= shapes <= 4
    assert after["slabs_reused"] > before["slabs_reused"]
    for method, b, tokens in runs:
        assert tokens == time_engine(hf, prompts[:b], method, BUDGET, 8)["tokens"], (method, b)


def test_a_sequence_still_bound_to_a_given_back_slab_moves_out_before_its_next_owner_writes(pair, prompts):
    """A batch's sequences stay bound to their rows when it ends (a multi-turn sequence goes on from
    there). The next batch of that shape takes the slab: the old sequences are first moved to slabs
    of their own, and their next turn is what ``hf`` gives for the same calls."""
    hf, slab = pair
    settings = GenerationSettings(max_new_tokens=6)

    def conversation(engine, interleave: bool):
        first = [engine.session(build_method("snapkv"), BUDGET, Protocol(sink=1, recent=2)) for _ in range(3)]
        for s, p in zip(first, prompts):
            with s:
                s.feed(p)
        DecodeLoop(engine, first, settings).run()
        if interleave:  # another batch of the same shape takes the slabs the first one gave back
            taken = engine.backend.pool.reused
            others = [engine.session(build_method("snapkv"), BUDGET, Protocol(sink=1, recent=2)) for _ in range(3)]
            for s, p in zip(others, prompts[3:]):
                with s:
                    s.feed(p)
            DecodeLoop(engine, others, settings).run()
            assert engine.backend.pool.reused > taken
            assert all(s.cache.slabs() is not None for s in first)  # on slabs of their own again
        for s, p in zip(first, prompts[5:]):
            with s:
                s.feed(p[:5])  # the last turn's pending token first
        DecodeLoop(engine, first, settings).run()
        return [(s.generated, s.kept_positions()) for s in first]

    assert conversation(slab, interleave=True) == conversation(hf, interleave=False)


def test_the_pool_hands_out_zeroed_slabs_one_a_shape_the_first_given_back():
    pool = SlabPool(shapes=2)
    like = torch.zeros(1)
    a, b = pool.take((2, 3), like), pool.take((2, 3), like)
    a.fill_(7.0)
    b.fill_(8.0)
    pool.give(a)
    pool.give(b)  # one of a shape is kept: the first, over which a graph may be captured
    again = pool.take((2, 3), like)
    assert again is a and torch.count_nonzero(again) == 0 and pool.reused == 1
    assert pool.take((2, 3), like) is not b  # b was let go
    pool.give(a)
    pool.give(pool.take((4,), like))
    pool.give(pool.take((5,), like))  # a third shape: the least recent (a's) goes
    assert pool.take((2, 3), like) is not a
    with torch.inference_mode():
        made = pool.take((6,), like)
    pool.give(made)
    assert pool.take((6,), like) is not made  # an inference tensor is not writable outside inference mode
