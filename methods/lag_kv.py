from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvleague.engine.contract import BatchCacheView, CacheView, EvictionMethod, chunks
from kvleague.methods.registry import register_method


def lag_std(x: torch.Tensor, lag: int, eps: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` ``[..., T, d]`` -> ``[..., T]``: std over d of each token, chunk i min/max-normalised by chunk i-1.

    Chunks are consecutive runs of ``lag`` cache slots from the oldest (the last may be shorter).
    For chunk i > 0: x' = (x - min_{i-1}) / (max_{i-1} - min_{i-1} + eps), min/max per head and
    channel over the tokens of chunk i-1; chunk 0 uses raw x. Sample std (ddof = 1) over head_dim,
    stored in ``dtype``. Leading dimensions (heads, a batch's rows) are independent.
    """
    *lead, t, d = x.shape
    full = (t // lag) * lag
    std = torch.empty(*lead, t, dtype=dtype, device=x.device)
    std[..., : min(lag, t)] = x[..., : min(lag, t), :].std(dim=-1)
    if t <= lag:
        return std
    chunks = x[..., :full, :].reshape(*lead, t // lag, lag, d)
    lo, hi = chunks.amin(dim=-2), chunks.amax(dim=-2)  # [..., n_chunks, d]
    n_full = t // lag
    if n_full > 1:
        ref_lo, ref_hi = lo[..., :-1, None, :], hi[..., :-1, None, :]
        normed = (chunks[..., 1:, :, :] - ref_lo).div_(ref_hi - ref_lo + eps)
        std[..., lag:full] = normed.std(dim=-1).reshape(*lead, -1)
    if full < t:  # the trailing partial chunk, normalised by the last full chunk
        tail = (x[..., full:, :] - lo[..., -1:, :]) / (hi[..., -1:, :] - lo[..., -1:, :] + eps)
        std[..., full:] = tail.std(dim=-1)
    return std


@register_method("lag_kv")
@dataclass
class LagKV(EvictionMethod):
    """LagKV (EpiKV paper's lag-normalised variant): K/V spread after normalising by the previous chunk.

    K̄ = mean over layers of the cached keys ``[H, T, d]``, V̄ likewise (float32). Cut the cache slots,
    oldest first, into chunks of ``lag`` (128); normalise chunk i per head and channel by the min/max
    of chunk i - 1: (x - min) / (max - min + ``eps``); the first chunk uses the raw values.
    score_t = mean over KV heads of std_d(K̄'_t) + mean over KV heads of std_d(V̄'_t), one global
    ``[T]`` score. Stateless (recomputed from the cache at every eviction). No attention.

    As the authors' ``LagKVEviction``: std is the sample std (ddof = 1, ``torch.std``); ``eps`` = 1e-9;
    chunks follow the current cache slots, prompt included (after evictions a chunk spans more than
    ``lag`` original positions); a trailing partial chunk is normalised by the last full chunk; the
    arithmetic is theirs (``arithmetic: reference``: in the cache's dtype, so bf16 models round as
    theirs do; ``float32`` is kvleague's earlier float32 path, which avoids stacking the layers). Under
    ``protocol: epikv_paper`` (prompt kept, recent min(128, B // 4)) the cache equals that class's,
    bit for bit, at every step (evidence in docs/methods.md).

    Paper: Kolawole & Smith, arXiv 2606.26472 (lag-normalised KV baseline), after LagKV (Liang et
    al., arXiv 2504.04704). Reference code: stevenkolawole/epiphany-kv-cache ``src/eviction.py``
    ``LagKVEviction``. kvpress ``LagKVPress`` is the original LagKV (it normalises by the *next* chunk,
    per layer, with a softmax and sink/tail handling) and is deliberately not what this method does.
    """

    lag: int = 128
    eps: float = 1e-9
    #: ``reference``: as the authors' class, in the cache dtype (layer mean of the stacked K/V, std and
    #: head mean in that dtype, then float32); ``float32``: accumulated in float32 without the stack
    arithmetic: Literal["reference", "float32"] = "reference"

    def __post_init__(self) -> None:
        if self.lag < 2:
            raise ValueError(f"lag must be >= 2, got {self.lag}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.arithmetic not in ("reference", "float32"):
            raise ValueError(f"arithmetic must be reference or float32, got {self.arithmetic!r}")

    #: scored from the keys and the values (``lag_kv_key``: the keys alone)
    uses_values: ClassVar[bool] = True

    def score(self, cache: CacheView) -> torch.Tensor:
        return self.scores(cache.keys, cache.values if self.uses_values else None)

    def scores(self, keys: list[torch.Tensor], values: list[torch.Tensor] | None) -> torch.Tensor:
        """Per layer ``[..., H, T, d]`` keys and values (leading dimensions: a batch's rows) -> ``[..., T]``."""
        total = None
        for tensors in (keys, values) if values is not None else (keys,):
            if self.arithmetic == "reference":
                x = torch.stack(tensors).mean(dim=0)
                s = lag_std(x, self.lag, self.eps, x.dtype).mean(dim=-2).float()
            else:
                s = lag_std(_layer_mean(tensors), self.lag, self.eps).mean(dim=-2)
            total = s if total is None else total + s
        assert total is not None
        return total

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        """Caches of equal lengths, equal hyperparameters: the rows scored together, as many at once as
        keep the reference arithmetic's stack of every layer under ``contract.STACK_BYTES`` (``chunks``)."""
        first = methods[0]
        if (
            cls.score is not LagKV.score
            or cls.scores is not LagKV.scores
            or not caches.equal_lengths
            or any(m.params() != first.params() for m in methods)
        ):
            return super().score_batch(methods, caches)
        keys = caches.stacked(0)  # [L, N, H, T, d]
        n_layers, _, heads, _, dim = keys.shape
        out: list[torch.Tensor] = []
        for part in chunks(len(methods), n_layers * heads * caches.lengths[0] * dim * keys.element_size()):
            members = list(range(part.start, part.stop))
            values = caches.values_of(members) if cls.uses_values else None
            out.extend(first.scores(caches.keys_of(members), values))
        return out


def _layer_mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Mean over layers in float32, accumulated in place (no [L, H, T, d] stack)."""
    total = tensors[0].float().clone()
    for t in tensors[1:]:
        total.add_(t)
    return total.div_(len(tensors))


@register_method("lag_kv_key")
@dataclass
class LagKVKey(LagKV):
    """Lag-KV-key: ``lag_kv``'s rule on the keys alone, score_t = mean over KV heads of std_d(K̄'_t).

    As the authors' ``LagKVKeyVarianceEviction`` (``benchmark.py`` method ``lag_kv_key``, the paper's
    "Lag-KV-key" row) under ``protocol: epikv_paper``; chunking, normalisation, ``eps`` and arithmetic as
    :class:`LagKV`.
    """

    uses_values: ClassVar[bool] = False
