"""knorm's documented exception to "the same selection on every device and at every batch size".

A key's norm survives RoPE in exact arithmetic, so the copies of a repeated token tie in layer 0, and
in float32 they differ only by the rotation's rounding (on the tiny llama 10 of 25 repeated tokens
still tie bit for bit on CPU). Worse, a model whose QK-norm weights are all 1 (a freshly initialised
qwen3) gives every key the norm sqrt(head_dim): every score ties, within 1.4e-6, and knorm ranks
rounding noise (``make_tiny_model`` therefore spreads those weights, as training does). Which copy
is kept is decided by float rounding of the keys, and that rounding differs between devices (CPU vs
CUDA kernels) and between batch shapes (a decode step's key projection at batch 1 vs batch 4). Two
runs may therefore part ways at such a near-tie, and only there. :func:`assert_parted_only_at_a_rounding_tie`
checks exactly that, from the scores :class:`LoggedKnorm` records at every eviction. (Every method
that ranks can meet such a tie; knorm meets them by construction.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.methods.knorm import KeyNorm

#: scores this close (relative) are one tie up to float32 rounding of keys computed by different kernels
TIE_RTOL = 1e-5


@dataclass
class LoggedKnorm(KeyNorm):
    """knorm that keeps, for every eviction, the slots' positions ``[L, H, T]`` and its scores."""

    def reset(self, info) -> None:
        super().reset(info)
        self.log: list[tuple[torch.Tensor, torch.Tensor]] = []

    def score(self, cache):
        return self.record(cache.positions, super().score(cache))

    def record(self, positions: list[torch.Tensor], scores: torch.Tensor) -> torch.Tensor:
        self.log.append((torch.stack(positions).cpu(), scores.double().cpu()))
        return scores

    @classmethod
    def score_batch(cls, methods, caches):
        out = super().score_batch(methods, caches)
        return [method.record(view.positions, scores) for method, view, scores in zip(methods, caches.views, out)]


def kept_after(log: list, i: int, final_kept: list) -> list[set]:
    """Per (layer, head): the positions eviction ``i`` kept (those of its cache still there next time)."""
    before = log[i][0]
    after = log[i + 1][0] if i + 1 < len(log) else None
    out = []
    for l in range(before.shape[0]):
        for h in range(before.shape[1]):
            held = set(before[l, h].tolist())
            if after is not None:
                now = set(after[l, h].tolist())
            else:
                layer = final_kept[l]
                now = set(layer[h] if layer and isinstance(layer[0], list) else layer)
            out.append(held & now)
    return out


def assert_parted_only_at_a_rounding_tie(a: LoggedKnorm, b: LoggedKnorm, a_kept: list, b_kept: list) -> bool:
    """Walk both runs' evictions in order; at the first where their kept sets differ, every slot kept
    by one run and not the other must score within :data:`TIE_RTOL` of the others such slots (one
    tie, decided by rounding). Returns whether the runs parted at all."""
    for i, ((pos_a, s_a), (pos_b, s_b)) in enumerate(zip(a.log, b.log)):
        assert torch.equal(pos_a, pos_b), f"eviction {i}: the caches differ before any kept set did"
        torch.testing.assert_close(s_a, s_b, rtol=TIE_RTOL, atol=0)
        kept_a, kept_b = kept_after(a.log, i, a_kept), kept_after(b.log, i, b_kept)
        if kept_a == kept_b:
            continue
        flat_pos, flat_s = pos_a.flatten(0, 1), s_a.flatten(0, 1)
        for row, (ka, kb) in enumerate(zip(kept_a, kept_b)):
            differing = ka ^ kb
            if not differing:
                continue
            index = [flat_pos[row].tolist().index(p) for p in sorted(differing)]
            scores = flat_s[row, index]
            spread = float(scores.max() - scores.min())
            assert spread <= TIE_RTOL * float(scores.abs().max()), (
                f"eviction {i}, layer/head row {row}: the runs kept different slots {sorted(differing)} whose "
                f"scores {scores.tolist()} are not one rounding-level tie"
            )
        return True
    assert len(a.log) == len(b.log), "one run evicted more often than the other"
    return False
