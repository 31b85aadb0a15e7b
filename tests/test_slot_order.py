"""Order-free scores evicted by filling holes where the backend reorders slots (issue 49).

The EpiKV family's and KV-key / KV-val's scores are each slot's own (frozen, by position), as are H2O's
accumulated sums (carried by position, sorted first where the slots are not); SnapKV pools its window's
attention over neighbouring positions (sorted first where the slots are not); only their references
keep the slots in position order, where attention sums them in that order. The slab
backend on CUDA (``reorders_slots``) evicts them as order-free methods: an eviction moves at most the
evicted slots, not every kept one. Off CUDA it keeps the order (``hf``'s bits, which the slab == hf
tests compare). The oracle here is the ``hf`` backend keeping the order, in float64, where the order
attention sums its slots in moves the logits by ~1e-16: the same tokens, kept positions and counts,
alone and batched, with the slots out of position order on the slab backend.
"""

from __future__ import annotations

import pytest
import torch

from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import build_method
from tests.float64_pair import float64_pair

BUDGET = 16
PROTOCOLS = {
    "sinks": Protocol(sink=2, recent=3),
    "epikv_paper": Protocol.preset("epikv_paper"),
    # a prompt over the budget is kept whole: its row drops one slot a step where the others drop the
    # buffer's, so a batched eviction fills holes in rows that drop different counts
    "buffered": Protocol(cadence="buffer=4", recent=3, protect_prompt=True, prompt_over_budget="keep"),
}


@pytest.fixture(scope="module")
def pair(tiny_models):
    """``hf`` and the slab backend reordering as on CUDA (its captured body's path), both float64."""
    torch.set_num_threads(1)
    hf, slab = float64_pair(tiny_models["llama"])
    slab.backend.graphs = True
    slab.backend.reorders_slots = True
    return hf, slab


def _same(oracle, result) -> None:
    assert result.token_ids == oracle.token_ids
    assert result.kept_positions == oracle.kept_positions
    for name in ("evictions", "evicted_tokens", "ranked_evictions", "peak_cache_entries"):
        assert getattr(result, name) == getattr(oracle, name), name


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize(
    "name", ["epikv", "epikv_bands", "hs_variance", "kv_key", "kv_val", "h2o", "snapkv", "tova", "keydiff"]
)
def test_order_free_scores_evicted_by_filling_holes_equal_the_ordered_cache(pair, prompt_ids, name, protocol):
    """SnapKV with a window of 4 queries, so that it ranks slots outside its window by pooled attention.
    TOVA and KeyDiff are order-free on every backend (``Needs(ordered_slots=False)``): ``hf`` fills
    their holes alone, and the batch must fill each row's as it would alone."""
    hf, slab = pair
    params = {"window": 4} if name == "snapkv" else {}
    proto = PROTOCOLS[protocol]
    settings = GenerationSettings(max_new_tokens=20)
    prompts = [prompt_ids[:6], prompt_ids[3:12], prompt_ids[5:20], prompt_ids[: BUDGET + 4]]
    oracle = [hf.generate(p, build_method(name, params), BUDGET, proto, settings) for p in prompts]
    for p, want in zip(prompts, oracle):
        _same(want, slab.generate(p, build_method(name, params), BUDGET, proto, settings))
    for engine in (slab, hf):  # hf's batch fills the holes of order-free methods as the slabs do
        batched = engine.generate_batch(prompts, [build_method(name, params) for _ in prompts], BUDGET, proto, settings)
        for want, got in zip(oracle, batched):
            _same(want, got)
    assert sum(r.ranked_evictions for r in oracle) > 0


def test_the_slots_are_out_of_order_where_the_backend_reorders_and_in_order_on_hf(pair, prompt_ids):
    """The declaration takes effect: on the reordering slab backend an EpiKV cache's slots leave
    position order (the holes filled from the top); on ``hf`` they stay in order; a method that
    relies on the order and does not declare otherwise (R-KV pools neighbouring slots) keeps it on both."""
    hf, slab = pair
    settings = GenerationSettings(max_new_tokens=20)

    def slots(engine, name):
        with engine.session(build_method(name), BUDGET, PROTOCOLS["sinks"]) as session:
            session.feed(prompt_ids[:10])
            orders = []
            session.decode(settings)
            orders.append(session.cache.positions[0][0].tolist())
            return session.ordered_slots, orders[-1]

    ordered, positions = slots(slab, "epikv")
    assert not ordered and positions != sorted(positions)
    for engine, name in ((hf, "epikv"), (slab, "rkv"), (hf, "rkv")):
        ordered, positions = slots(engine, name)
        assert ordered and positions == sorted(positions)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["epikv", "kv_key", "h2o", "snapkv"])
def test_order_free_scores_fill_holes_on_cuda_as_hf_keeps_order(tiny_models, prompt_ids, name):
    """On CUDA (``scripts/gpu_check.sh``), where the slab backend reorders by default: float64, its
    captured steps against ``hf`` keeping the order on the same GPU, alone and batched."""
    hf, slab = float64_pair(tiny_models["llama"], dtype="float32", device="cuda")
    assert slab.backend.reorders_slots and slab.backend.graphs
    test_order_free_scores_evicted_by_filling_holes_equal_the_ordered_cache((hf, slab), prompt_ids, name, "sinks")
