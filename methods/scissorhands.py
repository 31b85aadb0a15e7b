from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.runner.engine.contract import CacheView, EvictionMethod, Needs, Observation, SequenceInfo
from kvleague.methods.kernels import QueryWindow, per_kv_head
from kvleague.methods.registry import register_method


@register_method("scissorhands")
@dataclass
class Scissorhands(EvictionMethod):
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

    history: int = 64

    def __post_init__(self) -> None:
        if self.history < 1:
            raise ValueError(f"history must be >= 1, got {self.history}")

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.queries = QueryWindow(self.history, info.head_dim)

    def observe(self, obs: Observation) -> None:
        self.queries.push(obs)

    def score(self, cache: CacheView) -> torch.Tensor:
        out = []
        for layer, (keys, positions) in enumerate(zip(cache.keys, cache.positions)):
            attn = self.queries.attention(layer, keys, positions)  # [H_q, w, T]
            h_q, w, t = attn.shape
            group = per_kv_head(attn.reshape(h_q, w * t), keys.shape[0]).view(-1, w, t)  # [H_kv, w, T]
            seen = positions[:, None, :] <= self.queries.positions.to(positions.device)[None, :, None]  # [H_kv, w, T]
            visible = seen.sum(dim=-1, keepdim=True).clamp_min(1)  # keys each query sees
            unimportant = (group < 1.0 / visible) & seen
            out.append(-unimportant.sum(dim=1).float() + group.mean(dim=1))
        return torch.stack(out)
