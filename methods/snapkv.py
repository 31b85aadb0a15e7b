"""SnapKV: the observation window's attention, pooled, per KV head (the window itself is in ``methods.kernels``, shared with R-KV and Scissorhands)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.runner.engine.contract import BatchCacheView, CacheView, EvictionMethod, Needs, groups_by
from kvleague.methods.kernels import ObservesQueryWindow, check_window_kernel, pool, window_importance
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

    needs = Needs(queries=True)

    window: int = 32
    kernel: int = 7

    def __post_init__(self) -> None:
        check_window_kernel(self.window, self.kernel)

    def score(self, cache: CacheView) -> torch.Tensor:
        scores, own = window_importance(self.queries, cache, self.kernel, "avg")
        return scores.masked_fill(own, float("inf"))

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        """Sequences with equal slot counts, window fill and kernel: the window attention of each layer
        for all of them in one batched matmul, then the same per-row softmax, mean, pooling and GQA mean
        as :func:`window_importance`."""
        if cls.score is not SnapKV.score:
            return super().score_batch(methods, caches)
        out: list = [None] * len(caches)
        keys = [(n, m.queries.positions.shape[0], m.kernel) for n, m in zip(caches.lengths, methods)]
        for members in groups_by(keys):
            if len(members) == 1:
                out[members[0]] = methods[members[0]].score(caches.views[members[0]])
                continue
            views = [caches.views[i] for i in members]
            windows = [methods[i].queries for i in members]
            rows = None if len(members) == len(caches) else torch.tensor(members, device=caches.keys[0].device)
            t = views[0].length
            scores, owns = [], []
            queries = torch.stack([w.queries for w in windows])  # [n, L, H_q, w, d]
            query_pos = torch.stack([w.positions for w in windows]).to(caches.keys[0].device)  # [n, w]
            for layer in range(len(caches.keys)):
                q = queries[:, layer]  # [n, H_q, w, d]
                padded = caches.keys[layer]  # every evicting row's keys, one tensor (a view of the slab where it can be)
                k = (padded if rows is None else padded.index_select(0, rows))[:, :, :t]  # [n, H_kv, T, d]
                key_pos = torch.stack([v.positions[layer] for v in views])  # [n, H_kv, T]
                n, h_q, w, d = q.shape
                h_kv, t = k.shape[1], k.shape[2]
                group = h_q // h_kv
                logits = torch.matmul(q.float().reshape(n, h_kv, group * w, d), k.float().transpose(-1, -2)).view(n, h_q, w, t)
                logits.mul_(windows[0].scaling)
                future = key_pos[:, :, None, None, :] > query_pos[:, None, None, :, None]
                logits.view(n, h_kv, group, w, t).masked_fill_(future, float("-inf"))
                attn = torch.softmax(logits, dim=-1).mean(dim=2)  # [n, H_q, T]
                own = key_pos >= query_pos[:, :1, None]  # the window's own slots
                attn = attn.masked_fill(own.repeat_interleave(group, dim=1), 0.0)
                pooled = pool(attn.reshape(n * h_q, t), methods[members[0]].kernel, "avg")
                scores.append(pooled.view(n, h_kv, group, t).mean(dim=2))
                owns.append(own)
            batch = torch.stack(scores, dim=1).masked_fill(torch.stack(owns, dim=1), float("inf"))  # [n, L, H_kv, T]
            for j, i in enumerate(members):
                out[i] = batch[j]
        return out
