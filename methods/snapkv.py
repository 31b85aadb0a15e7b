"""SnapKV: the observation window's attention, pooled, per KV head (the window itself is in ``methods.kernels``, shared with R-KV and Scissorhands)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.engine.contract import BatchCacheView, CacheView, EvictionMethod, Needs, groups_by
from kvleague.methods.kernels import (
    ObservesQueryWindow,
    check_window_kernel,
    window_importance,
    window_importance_batch,
)
from kvleague.methods.registry import register_method


@register_method("snapkv")
@dataclass
class SnapKV(ObservesQueryWindow, EvictionMethod):
    """SnapKV: mean attention of the last ``window`` queries, avg-pooled (kernel 7), per KV head.

    score[l, h, t] = mean over the query heads of GQA group h of AvgPool_k( mean over the last
    ``window`` (32) queries of A_l[q, t] ) for the slots before the window; the window's own slots get
    +inf (always kept). Pooling: stride 1, kernel ``kernel`` (7), zero padding counted (PyTorch
    ``avg_pool1d``); the window's own columns count as zeros, as in kvpress. Shape ``[L, H_kv, T]``.

    * Prefill: the window is the last 32 prompt queries, as in the paper.
    * Decode: the same rule over the last ``window`` queries seen (generated ones once there are 32);
      the interval (128 steps in the paper) is the protocol's ``cadence: buffer=128``, which lets the
      cache grow to B + 128 and then compresses to B.

    The window's attention is recomputed at scoring time from the kept post-RoPE queries and the
    current keys, scaled by 1 / sqrt(head_dim), causal by absolute position.

    Paper: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469.
    Reference code: FasterDecoding/SnapKV; kvpress ``SnapKVPress`` (same kept indices on prefill with
    ``window_size=32, kernel_size=7``). Deviations: the reference pools with max-pool by default
    (kernel 5) and kvpress with avg-pool; we follow the issue (avg, 7). The decode variant is not in
    the paper. The scaling assumes 1 / sqrt(head_dim) (true for Llama/Qwen; not for models with a
    custom query scale).
    """

    # pooled along positions (sorted first where the slots are not in order); in order as its references
    needs = Needs(queries=True, order_free_scores=True)

    window: int = 32
    kernel: int = 7

    def __post_init__(self) -> None:
        check_window_kernel(self.window, self.kernel)

    def score(self, cache: CacheView) -> torch.Tensor:
        scores, own = window_importance(self.queries, cache, self.kernel, "avg", self.info.ordered_slots)
        return scores.masked_fill(own, float("inf"))

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        """Sequences with equal slot counts, window fill and kernel: :func:`window_importance_batch`
        (each layer's window attention for all of them in one batched matmul)."""
        if cls.score is not SnapKV.score:
            return super().score_batch(methods, caches)
        out: list = [None] * len(caches)
        keys = [(n, m.queries.positions.shape[0], m.kernel) for n, m in zip(caches.lengths, methods)]
        for members in groups_by(keys):
            if len(members) == 1:
                out[members[0]] = methods[members[0]].score(caches.views[members[0]])
                continue
            first = methods[members[0]]
            scores, own = window_importance_batch(
                [methods[i].queries for i in members], caches, members, first.kernel, "avg", first.info.ordered_slots
            )
            batch = scores.masked_fill(own, float("inf"))  # [n, L, H_kv, T]
            for i, row in zip(members, batch.unbind(0)):
                out[i] = row
        return out
