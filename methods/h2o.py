from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.engine.contract import (
    CacheView,
    EvictionMethod,
    Needs,
    Observation,
    SequenceInfo,
    groups_by,
    stacked_layers,
)
from kvleague.engine.to_device import to_device
from kvleague.methods.registry import register_method


def carry(
    values: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor, ordered: bool = True
) -> torch.Tensor:
    """Re-align per-slot state ``values`` ``[H, T_old]`` from ``old_positions`` to ``new_positions`` ``[H, T_new]``.

    Slots whose absolute position was held before keep their value; new positions get 0. ``ordered``:
    positions are ascending along each row (the engine appends newer tokens and gathers in slot
    order); else (slots filled as holes) the old ones are sorted first, with their values.
    """
    t_old = old_positions.shape[-1]
    if t_old == 0:
        return torch.zeros(new_positions.shape, dtype=values.dtype, device=values.device)
    if not ordered:
        old_positions, order = old_positions.sort(dim=-1)
        values = values.gather(-1, order)
    # one path whether or not anything was evicted since: no host read of the positions
    index = torch.searchsorted(old_positions.contiguous(), new_positions.contiguous()).clamp_max(t_old - 1)
    found = old_positions.gather(-1, index) == new_positions
    return torch.where(found, values.gather(-1, index), torch.zeros((), dtype=values.dtype, device=values.device))


@register_method("h2o")
@dataclass
class H2O(EvictionMethod):
    """H2O: heavy hitters by true accumulated attention, plus a recent window, per KV head.

    acc[l, h, t] = sum over every query q that has attended to the cache so far (all prefill queries
    and every decode query) of the softmax attention weight A_l[q, t], averaged over the query heads of
    KV head h's GQA group (sum first, then the group mean). A token evicted from a head loses its sum;
    a token arriving starts at 0 and receives its own query's weight. score[l, h, t] = acc[l, h, t],
    except the ``recent_ratio`` * B newest positions, which get +inf (H2O's recent window); the other
    (1 - ``recent_ratio``) * B slots go to the heavy hitters. Shape ``[L, H_kv, T]``.

    The prefill part needs every prefill query's attention row (column sums of the full prefill
    attention), so the method runs **eager** attention: the rows come from the eager kernel's own
    weights; where every layer's ``H_q x C x T`` rows would not fit the worker's attention memory, it
    reads their sum over queries instead (``Needs.attention_sum``, ``engine/eager.py``), all it uses.
    Decode steps add the one new row.

    Paper: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs", arXiv
    2306.14048. Reference code: FMInference/H2O (``h2o_hf``). Deviations: scores are kept per KV head
    (the reference is per attention head on MHA models; with GQA the group mean is the natural
    per-KV-head score); the recent window is part of the method, so the protocol's ``recent`` should be
    0 to reproduce the paper; the reference accumulates from fp16 weights, ours in float32.
    """

    # its sums are each slot's own, carried by position; slots in order as its references keep them
    needs = Needs(attention=True, eager=True, attention_sum=True, order_free_scores=True)

    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        #: ``[L, H_kv, T]``: the accumulated attention of the slots whose positions ``acc_positions`` holds
        self.acc: torch.Tensor | None = None
        self.acc_positions: torch.Tensor | None = None

    def observe(self, obs: Observation) -> None:
        # every layer's rows summed over the pass's queries (a prefill's layer by layer: C x T each)
        attention = obs.attention
        assert attention is not None, "needs.attention is declared"
        rows = (
            attention.sum(dim=2)
            if isinstance(attention, torch.Tensor)
            else torch.stack([r.sum(dim=1) for r in attention])
        )
        received = rows.view(rows.shape[0], self.info.n_kv_heads, -1, rows.shape[-1]).mean(dim=2)  # [L, H_kv, T]
        positions = obs.cache_positions.stacked
        if self.acc is not None:
            assert self.acc_positions is not None  # set together with acc
            received = received + carry(self.acc, self.acc_positions, positions, self.info.ordered_slots)
        self.acc, self.acc_positions = received, positions

    @classmethod
    def observe_batch(cls, methods, observations) -> None:
        """Sequences holding equal numbers of slots before and after the step: every layer's accumulation
        for all of them in one operation (``carry`` and the GQA mean work on leading batch dimensions)."""
        if cls.observe is not H2O.observe:
            return super().observe_batch(methods, observations)
        keys = [
            (o.cache_positions.shape[-1], None if m.acc is None else m.acc.shape[-1])
            for m, o in zip(methods, observations)
        ]
        for members in groups_by(keys):
            if len(members) == 1:
                methods[members[0]].observe(observations[members[0]])
            else:
                cls._observe_together([methods[i] for i in members], [observations[i] for i in members])

    @classmethod
    def _observe_together(cls, methods, observations) -> None:
        n, n_kv = len(methods), methods[0].info.n_kv_heads
        rows = torch.stack([stacked_layers(o.attention) for o in observations]).sum(dim=3)  # [N, L, H_q, T]
        received = rows.view(n, rows.shape[1], n_kv, rows.shape[2] // n_kv, rows.shape[-1]).mean(
            dim=3
        )  # [N, L, H_kv, T]
        positions = torch.stack([o.cache_positions.stacked for o in observations])  # [N, L, H, T]
        if methods[0].acc is not None:
            received = received + carry(
                torch.stack([m.acc for m in methods]),
                torch.stack([m.acc_positions for m in methods]),
                positions,
                methods[0].info.ordered_slots,
            )
        for method, acc, pos in zip(methods, received, positions):
            method.acc, method.acc_positions = acc, pos

    def accumulated(self, cache: CacheView) -> torch.Tensor:
        """``[L, H_kv, T]`` accumulated attention of the cached slots."""
        assert self.acc is not None and self.acc_positions is not None, "score() follows an observed pass"
        return carry(self.acc, self.acc_positions, cache.positions.stacked, self.info.ordered_slots)

    def n_recent(self, cache: CacheView) -> int:
        """How many of the newest positions H2O's recent window holds under ``cache.budget``."""
        return int(self.recent_ratio * cache.budget)

    def score(self, cache: CacheView) -> torch.Tensor:
        scores = self.accumulated(cache)
        n_recent = self.n_recent(cache)
        if n_recent > 0:
            recent = cache.positions.stacked > cache.current_position - n_recent
            scores = scores.masked_fill(recent, float("inf"))
        return scores

    @classmethod
    def score_batch(cls, methods, caches) -> list[torch.Tensor]:
        """Sequences holding equal numbers of slots (now and at their last observation): each layer's
        carried sums for all of them in one operation, and the recent window per row, as ``score``."""
        if cls.score is not H2O.score or cls.accumulated is not H2O.accumulated:
            return super().score_batch(methods, caches)
        keys = [(view.length, m.acc.shape[-1]) for m, view in zip(methods, caches.views)]
        out: list = [None] * len(methods)
        for members in groups_by(keys):
            if len(members) == 1:
                out[members[0]] = methods[members[0]].score(caches.views[members[0]])
                continue
            group, views = [methods[i] for i in members], [caches.views[i] for i in members]
            positions = torch.stack([v.positions.stacked for v in views])  # [n, L, H, T]
            scores = carry(
                torch.stack([m.acc for m in group]),
                torch.stack([m.acc_positions for m in group]),
                positions,
                group[0].info.ordered_slots,
            )
            # the recent window per row (with none, the threshold is the newest position: nothing is above it)
            threshold = to_device([v.current_position - m.n_recent(v) for m, v in zip(group, views)], positions.device)
            scores = scores.masked_fill(positions > threshold.view(-1, 1, 1, 1), float("inf"))
            for i, row in zip(members, scores):
                out[i] = row
        return out
