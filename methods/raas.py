from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvleague.engine.contract import CacheView, SequenceInfo
from kvleague.methods.kernels import NotableAttention, PositionTable, ScoresOnHost
from kvleague.methods.registry import register_method


@register_method("raas")
@dataclass
class RaaS(ScoresOnHost, NotableAttention):
    """RaaS: keep "milestone" tokens: each token's timestamp is the last step it received notable attention.

    stamp_t starts at t's own position; whenever a query at position p gives t an attention weight
    (averaged over layers and query heads) above ``alpha`` / n (n = cached keys it sees), stamp_t := p.
    score_t = stamp_t: the token whose last notable attention is oldest goes first. One global ``[T]``
    score. Every step. The paper keeps the prompt (``protect_prompt: true`` in the protocol).

    Paper: Hu et al., "Efficient Long-Decoding Inference with Reasoning-Aware Attention Sparsity",
    2025 (RaaS; arXiv id not verified offline). Reference code: none consulted; written from the
    paper. Choices: the "notable attention" threshold alpha / n with alpha = 1 (above uniform); one
    timestamp per token from the layer- and head-averaged row (the paper works per head on pages of
    tokens, which we did not reproduce); prefill queries update stamps only through the last prompt
    query.
    """

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.stamp = PositionTable()

    def note(self, new: np.ndarray, attended: np.ndarray, now: float) -> None:
        stamp = self.stamp.array(int(new.max()))
        stamp[new] = new
        stamp[attended] = now

    def score_on_host(
        self, positions: torch.Tensor, cache: CacheView, top: int | None, prompt: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.stamp.read_host(positions, top)
