from dataclasses import dataclass

import torch

from kvleague.engine.contract import BatchCacheView, CacheView, EvictionMethod, Needs
from kvleague.methods.registry import register_method


@register_method("knorm")
@dataclass
class KeyNorm(EvictionMethod):
    """Knorm: keep the keys with the lowest L2 norm, per layer and KV head.

    score[l, h, t] = -|| K[l, h, t, :] ||_2, computed in float32 (a bf16 norm ties many keys).

    Paper: Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
    arXiv 2406.11430. Reference code: kvpress ``KnormPress`` (same kept indices on prefill).
    """

    needs = Needs(ordered_slots=False)

    def score(self, cache: CacheView) -> torch.Tensor:
        return torch.stack([_neg_norm(k) for k in cache.keys])

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        """One norm over the padded batch per layer (each row's norm is the same operation)."""
        norms = _neg_norm(caches.stacked(0))  # [L, N, H, S]
        if caches.equal_lengths:
            return list(norms.unbind(1))
        return [norms[:, i, :, :n] for i, n in enumerate(caches.lengths)]


def _neg_norm(keys: torch.Tensor) -> torch.Tensor:
    """-||k|| over the last dim, in float32 at least (float64 keys stay float64)."""
    return -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.promote_types(keys.dtype, torch.float32))
