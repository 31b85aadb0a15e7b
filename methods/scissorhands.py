from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.engine.contract import BatchCacheView, CacheView, EvictionMethod, Needs, groups_by
from kvleague.methods.kernels import ObservesQueryWindow, window_attention, window_attention_batch
from kvleague.methods.registry import register_method


@register_method("scissorhands")
@dataclass
class Scissorhands(ObservesQueryWindow, EvictionMethod):
    """Scissorhands: evict the tokens most often unimportant to the last ``history`` queries, per KV head.

    For each of the last ``history`` (64) queries q and cached key t, t is "unimportant" to q when its
    attention weight (averaged over the query heads of the KV head's GQA group) is below the average
    weight 1 / n_q, n_q = number of keys q sees. score[l, h, t] = -(number of those queries to which t
    was unimportant) + (mean weight t received from them), the second term only breaking ties
    (it is < 1). Shape ``[L, H_kv, T]``. The paper's recent window is the protocol's ``recent``.

    The window's attention is recomputed at scoring time from the kept post-RoPE queries and the
    current keys (causal by absolute position, scale 1 / sqrt(head_dim)), so a query's weights are
    normalised over the keys still cached rather than over the cache it saw when it ran.

    Paper: Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV
    Cache Compression at Test Time", NeurIPS 2023 (arXiv 2305.17118). Reference code: none official that we
    consulted; written from the paper's Algorithm 2. Choices: history 64, threshold = uniform weight,
    per KV head, evict at every step (the paper compresses when the cache is full, which under a hard
    budget is every step).
    """

    needs = Needs(queries=True)
    window_field = "history"  # the queries it keeps

    history: int = 64

    def __post_init__(self) -> None:
        if self.history < 1:
            raise ValueError(f"history must be >= 1, got {self.history}")

    def score(self, cache: CacheView) -> torch.Tensor:
        return _unimportance(window_attention(self.queries, cache))[0]

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        """Sequences with equal slot counts and history fill: the history's attention for all of them
        in one batched matmul (:func:`window_attention_batch`), then ``score``'s counts and means."""
        if cls.score is not Scissorhands.score:
            return super().score_batch(methods, caches)
        out: list = [None] * len(caches)
        for members in groups_by([(n, m.queries.positions.shape[0]) for n, m in zip(caches.lengths, methods)]):
            if len(members) == 1:
                out[members[0]] = methods[members[0]].score(caches.views[members[0]])
                continue
            batch = _unimportance(window_attention_batch([methods[i].queries for i in members], caches, members))
            for i, row in zip(members, batch.unbind(0)):
                out[i] = row
        return out


def _unimportance(attention) -> torch.Tensor:
    """``[n, L, H_kv, T]``: the score from the history's attention, chunk by chunk of layers (as
    ``kernels.window_attention`` / ``window_attention_batch`` yield it)."""
    scores = []
    for attn, positions, query_pos in attention:
        n, c, h_q, w, t = attn.shape
        h_kv = positions.shape[2]
        group = attn.reshape(n, c, h_kv, h_q // h_kv, w * t).mean(dim=3).view(n, c, h_kv, w, t)  # GQA mean
        seen = positions[:, :, :, None, :] <= query_pos[:, None, None, :, None]  # [n, c, H_kv, w, T]
        visible = seen.sum(dim=-1, keepdim=True).clamp_min(1)  # keys each query sees
        unimportant = (group < 1.0 / visible) & seen
        scores.append(-unimportant.sum(dim=3).float() + group.mean(dim=3))
    return scores[0] if len(scores) == 1 else torch.cat(scores, dim=1)
