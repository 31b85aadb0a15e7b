from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvleague.engine.contract import CacheView, SequenceInfo
from kvleague.methods.kernels import NotableAttention, PositionTable, ScoresOnHost
from kvleague.methods.registry import register_method


@register_method("lazy_eviction")
@dataclass
class LazyEviction(ScoresOnHost, NotableAttention):
    """LazyEviction: keep tokens whose attention recurs; evict those overdue past their usual recurrence gap.

    A token t is "attended" at step p when the query at position p gives it a weight (averaged over
    layers and query heads) above ``alpha`` / n (n = cached keys). State per token: last_t (position
    of the last such step; initially t itself) and mri_t, the maximum recurrence interval (largest gap
    between consecutive attended steps so far; initially 0). score_t = mri_t - (p_now - last_t): a
    token still within its largest observed gap scores >= 0, an overdue one < 0. One global ``[T]``.
    Fires lagged: use ``cadence: buffer=W`` (W = 128 here), so tokens get W steps to show recurrence.

    Paper: "LazyEviction: Lagged KV Eviction with Attention Pattern Observation for Efficient Long
    Reasoning", 2025 (arXiv id not verified offline). Reference code: none consulted; written from
    the paper's description (recurrence interval tracking, lagged eviction). Choices: the attention
    threshold (alpha = 1: above uniform), layer/head averaging, and this exact score are ours.
    """

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.last = PositionTable()
        self.mri = PositionTable()

    def note(self, new: np.ndarray, attended: np.ndarray, now: float) -> None:
        top = int(new.max())
        last, mri = self.last.array(top), self.mri.array(top)
        last[new] = new
        mri[new] = 0.0
        mri[attended] = np.maximum(mri[attended], now - last[attended])
        last[attended] = now

    def score_on_host(
        self, positions: torch.Tensor, cache: CacheView, top: int | None, prompt: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.mri.read_host(positions, top) - (cache.current_position - self.last.read_host(positions, top))
