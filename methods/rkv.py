from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvleague.engine.contract import BatchCacheView, CacheView, EvictionMethod, Needs, groups_by, over_chunks
from kvleague.methods.kernels import (
    ObservesQueryWindow,
    check_window_kernel,
    window_importance,
    window_importance_batch,
)
from kvleague.methods.registry import register_method


def redundancy(keys: torch.Tensor) -> torch.Tensor:
    """R-KV's redundancy ``[H, T]`` of keys ``[H, T, d]``: softmax over tokens of the mean cosine similarity.

    r_i = 1 / (T - 1) * sum_{j != i} cos(k_i, k_j) (the similarity matrix with its diagonal zeroed,
    averaged over each row), R = softmax_i(r). Computed in O(T d) as
    r_i = (k̂_i . sum_j k̂_j - k̂_i . k̂_i) / (T - 1) with k̂ = k / max(||k||, 1e-8).
    """
    t = keys.shape[-2]
    unit = F.normalize(keys.float(), dim=-1, eps=1e-8)
    total = unit.sum(dim=-2, keepdim=True)  # [H, 1, d]
    self_sim = (unit * unit).sum(dim=-1)
    r = ((unit * total).sum(dim=-1) - self_sim) / max(t - 1, 1)
    return torch.softmax(r, dim=-1)


@register_method("rkv")
@dataclass
class RKV(ObservesQueryWindow, EvictionMethod):
    """R-KV: lambda * importance - (1 - lambda) * redundancy, per KV head, compressed every 128 steps.

    importance[l, h, t]: SnapKV's rule with the last ``window`` (8) queries: their mean attention over
    the cache, pooled along the slots (``pooling``, kernel ``kernel`` = 7, stride 1, zero padding),
    averaged over the GQA group. redundancy[l, h, t]: softmax over the cached tokens of each key's mean
    cosine similarity to the other cached keys of that head (:func:`redundancy`).
    score = ``lam`` * importance - (1 - ``lam``) * redundancy with lam = 0.1; the window's own slots get
    +inf. Shape ``[L, H_kv, T]``.

    When it fires: the paper compresses once every 128 decode steps (a buffer of 128 new tokens); that
    is the protocol's ``cadence: buffer=128`` (the cache grows to B + 128, then is scored and cut to B).

    Choices where the paper is silent or where we simplify: the importance pooling defaults to average
    pooling, like ``snapkv`` (``pooling: max`` is available); the window's own tokens are always kept;
    attention is recomputed from the kept queries, scaled by 1 / sqrt(head_dim).

    Paper: Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models", arXiv
    2505.24133. Reference code: Zefan-Cai/R-KV (not consulted here; written from the paper's
    description). Deviation: the paper's redundancy step also thresholds the similarity so that the
    most recent of a group of near-duplicate keys is spared; this implementation uses the plain mean
    similarity (O(T d) instead of O(T^2 d)), so every copy of a duplicated key is equally redundant.
    """

    needs = Needs(queries=True)

    lam: float = 0.1
    window: int = 8
    kernel: int = 7
    pooling: Literal["avg", "max"] = "avg"

    def __post_init__(self) -> None:
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        check_window_kernel(self.window, self.kernel)
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"pooling must be 'avg' or 'max', got {self.pooling!r}")

    def score(self, cache: CacheView) -> torch.Tensor:
        importance, own = window_importance(self.queries, cache, self.kernel, self.pooling)
        keys = cache.keys  # every layer's, a few at a time: the unit keys in float32 and their products
        redundant = over_chunks(lambda part: redundancy(torch.stack(keys[part])), len(keys), 8 * keys[0].numel())
        scores = self.lam * importance - (1.0 - self.lam) * redundant
        return scores.masked_fill(own, float("inf"))

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        """Sequences with equal slot counts, window fill and hyperparameters: the importance of all of
        them from one batched matmul (:func:`window_importance_batch`), the redundancy of every
        layer's keys for all of them in one operation, then ``score``'s arithmetic."""
        if cls.score is not RKV.score:
            return super().score_batch(methods, caches)
        out: list = [None] * len(caches)
        keys = [
            (n, m.queries.positions.shape[0], tuple(sorted(m.params().items())))
            for n, m in zip(caches.lengths, methods)
        ]
        for members in groups_by(keys):
            first = methods[members[0]]
            if len(members) == 1:
                out[members[0]] = first.score(caches.views[members[0]])
                continue
            importance, own = window_importance_batch(
                [methods[i].queries for i in members], caches, members, first.kernel, first.pooling
            )
            keys = caches.stacked_of(members, 0)  # [L, n, H_kv, T, d]
            redundant = over_chunks(
                lambda part, keys=keys: redundancy(keys[part]),
                keys.shape[0],
                8 * keys.shape[1:].numel(),
            ).transpose(0, 1)  # [n, L, H_kv, T]
            scores = (first.lam * importance - (1.0 - first.lam) * redundant).masked_fill(own, float("inf"))
            for i, row in zip(members, scores.unbind(0)):
                out[i] = row
        return out
