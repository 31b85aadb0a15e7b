"""The compaction plans against a naive re-computation, row by row: after an order-free eviction each
row's slots below its count hold exactly its kept entries, each dropped slot there refilled by the
kept slots from the count on, in increasing order on both sides, nothing else moved."""

from __future__ import annotations

import random

import pytest
import torch

from kvleague.engine.compaction import fill_slab_holes, gather_slots, row_order


def naive_order_free(keep: list[bool], kept: int) -> list[int]:
    """The old slot of each of the first ``kept`` new slots (``compaction``'s order-free layout)."""
    holes = [s for s in range(kept) if not keep[s]]
    donors = [s for s in range(kept, len(keep)) if keep[s]]
    assert len(holes) == len(donors)
    order = list(range(kept))
    for hole, donor in zip(holes, donors):
        order[hole] = donor
    return order


def draw(rng: random.Random, rows: int, layers: int, heads: int, padded: bool):
    """Keep masks ``[N, L, H, t]`` with each row's own length and count (a row may drop nothing, or
    fewer than the others), and every row's kept count."""
    t = rng.randint(6, 20)
    lengths = [t if not padded and r == 0 else rng.randint(2, t) for r in range(rows)]
    kept = [rng.randint(1, n) for n in lengths]
    keep = torch.zeros(rows, layers, heads, t, dtype=torch.bool)
    for r in range(rows):
        for layer in range(layers):
            for h in range(heads):
                keep[r, layer, h, rng.sample(range(lengths[r]), kept[r])] = True
    return keep, lengths, kept


@pytest.mark.parametrize("seed", range(40))
def test_fill_slab_holes_and_row_order_match_the_naive_plan(seed):
    """Rows dropping different counts, with and without padding past a row's length: the case a
    batched eviction meets when one row drops one slot and another drops five (the fuzz's finding: a
    row dropping fewer had its kept slots shifted)."""
    rng = random.Random(seed)
    rows, layers, heads, head_dim = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3), 2
    keep, lengths, kept = draw(rng, rows, layers, heads, padded=seed % 2 == 0)
    t = keep.shape[-1]
    capacity = t + rng.randint(0, 3)
    kv = torch.randn(layers, 2, rows, heads, capacity, head_dim, dtype=torch.float64)
    before = kv.clone()
    kept_t = torch.tensor(kept).view(rows, 1, 1, 1)
    fill_slab_holes(kv, keep, kept_t, max(n - k for n, k in zip(lengths, kept)))
    order = row_order(keep, kept_t, max(kept), ordered=False)
    for r in range(rows):
        for layer in range(layers):
            for h in range(heads):
                want = naive_order_free(keep[r, layer, h].tolist(), kept[r])
                assert order[r, layer, h, : kept[r]].tolist() == want
                assert torch.equal(kv[layer, :, r, h, : kept[r]], before[layer, :, r, h, want])


@pytest.mark.parametrize("seed", range(10))
def test_gather_slots_keeps_each_rows_kept_slots_in_order(seed):
    rng = random.Random(seed)
    rows, layers, heads = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3)
    keep, lengths, kept = draw(rng, rows, layers, heads, padded=True)
    t = keep.shape[-1]
    kv = torch.randn(layers, 2, rows, heads, t, 2, dtype=torch.float64)
    before = kv.clone()
    kept_t = torch.tensor(kept).view(rows, 1, 1, 1)
    gather_slots(kv, row_order(keep, kept_t, max(kept), ordered=True), 0, t)
    for r in range(rows):
        for layer in range(layers):
            for h in range(heads):
                want = [s for s in range(t) if keep[r, layer, h, s]]
                assert torch.equal(kv[layer, :, r, h, : kept[r]], before[layer, :, r, h, want])
