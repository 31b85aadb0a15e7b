from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvleague.engine.contract import BatchCacheView, CacheView, EvictionMethod, Needs, groups_by, over_chunks
from kvleague.methods.registry import register_method


@register_method("keydiff")
@dataclass
class KeyDiff(EvictionMethod):
    """KeyDiff: keep the keys least similar to the mean normalised key, per layer and KV head.

    anchor[l, h] = mean over the cached slots of K[l, h, t] / ||K[l, h, t]||;
    score[l, h, t] = -cos(K[l, h, t], anchor[l, h]) (float32). Shape ``[L, H_kv, T]``. No attention,
    stateless; recomputed at every eviction over the whole cache.

    Paper: Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
    Inference in Resource-Constrained Environments", arXiv 2504.15364. Reference code: kvpress
    ``KeyDiffPress`` (same kept indices on prefill). Deviation: the paper evicts block by block while
    prefilling; here that is the protocol's ``prefill_chunk`` (compress after each chunk), so the rule
    itself is unchanged.
    """

    needs = Needs(ordered_slots=False)

    def score(self, cache: CacheView) -> torch.Tensor:
        keys = cache.keys  # every layer's, a few at a time (their float32 copies)
        return over_chunks(lambda part: _dissimilarity(torch.stack(keys[part])), len(keys), 12 * keys[0].numel())

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        """Sequences holding equal numbers of slots (the steady state: all at B) in one computation over
        the layers; the anchor is a mean over the slots, so it never runs over padding."""
        out: list = [None] * len(caches)
        for members in groups_by(caches.lengths):
            keys = caches.stacked_of(members, 0)  # [L, n, H, T, d]
            scores = over_chunks(lambda part: _dissimilarity(keys[part]), keys.shape[0], 12 * keys.shape[1:].numel())  # noqa: B023 - called before the loop moves on
            for i, row in zip(members, scores.unbind(1)):  # [L, n, H, T]
                out[i] = row
        return out


def _dissimilarity(keys: torch.Tensor) -> torch.Tensor:
    """``[..., T]``: -cos(k_t, mean normalised key) over the slots of ``keys`` ``[..., T, d]``, float32."""
    k = keys.float()
    anchor = F.normalize(k, p=2, dim=-1).mean(dim=-2, keepdim=True)
    return -F.cosine_similarity(k, anchor, dim=-1)
