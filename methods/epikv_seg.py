from __future__ import annotations

from dataclasses import dataclass

import torch

from methods.base import CacheView, Needs, Observation, SequenceInfo
from methods.epikv import EpiKV, PositionTable
from methods.registry import register_method

#: score tiers (added to a value in [0, 1) that orders tokens inside a tier)
TIER_RECENT, TIER_QUOTA, TIER_FILL = 2.0, 1.0, 0.0


def key_variance(new_keys: list[torch.Tensor]) -> torch.Tensor:
    """``[C]``: variance over head_dim (population) of each new key, averaged over KV heads and layers."""
    total = None
    for k in new_keys:
        v = k.float().var(dim=-1, unbiased=False).mean(dim=0)
        total = v if total is None else total + v
    return total / len(new_keys)


def tertile_quotas(segment_variance: torch.Tensor, quotas: tuple[int, int, int]) -> torch.Tensor:
    """Per segment: the quota of its variance tertile (rank r of S, highest first: tier floor(3r/S))."""
    s = segment_variance.shape[0]
    order = torch.argsort(segment_variance, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(s)
    tier = (3 * rank) // max(s, 1)
    return torch.tensor(quotas, dtype=torch.long)[tier]


def rank_within(groups: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Rank (0 = highest score; ties by slot order) of each element inside its group ``0..G-1``."""
    order = torch.argsort(-scores, stable=True)
    order = order[torch.argsort(groups[order], stable=True)]
    counts = torch.bincount(groups)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0]) - starts[groups[order]]
    return rank


def rank_in_unit(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving map of float64 ``x`` into [0, 1) (rank / T), so tiers never overlap."""
    t = x.shape[0]
    order = torch.argsort(x, stable=True)
    out = torch.empty(t, dtype=torch.float64)
    out[order] = torch.arange(t, dtype=torch.float64) / max(t, 1)
    return out


@register_method("epikv_seg")
@dataclass
class EpiKVSeg(EpiKV):
    """EpiKV-Seg: per-segment quotas by key variance (64 / 32 / 8), ``epikv`` score inside a segment.

    Outside the method's recent window, the cached tokens are cut into segments of ``segment`` (128)
    absolute positions (segment id = position // 128). Segments are ranked by their mean key variance
    (per token: variance over head_dim, population, averaged over KV heads and layers; the segment
    mean is over its tokens still in the cache) and split into tertiles (rank r of S segments, highest
    variance first, tertile floor(3r / S)), which keep ``quotas`` = 64 / 32 / 8 tokens (high / mid /
    low). Inside a segment the tokens with the highest ``epikv`` score (z_A - z_B, frozen, same
    hyperparameters as ``epikv``) fill its quota.

    Scores (one global ``[T]``): tier + rank in [0, 1) where tier 2 = inside the method's recent window
    (``recent_window``; default min(128, B // 4), the paper's protocol window), tier 1 = inside its
    segment's quota, tier 0 = everything else; inside each tier tokens are ordered by the ``epikv``
    score. ``value_reserve`` tokens get 1e9 + range as in ``epikv``.

    Deviation (contract): the reference "may keep fewer than B" (only the quotas survive); the engine
    always keeps exactly B, so when the quotas and the recent window leave room, the remaining slots go
    to the best tier-0 tokens by ``epikv`` score. When they overflow B, tier-1 tokens compete by
    ``epikv`` score. Choices where the paper is silent: segments are fixed by absolute position, so the
    prompt is segmented too (under the paper's ``protect_prompt`` it is kept anyway); the newest,
    partial segment outside the window is a segment like the others; key variances are computed once
    per token when it enters the cache (its keys never change).

    Not the authors' code: their ``KVSegHSEviction`` (stevenkolawole/epiphany-kv-cache
    ``src/eviction.py``) cuts the current cache into 128-*slot* segments before the recent window
    (prompt slots included), types them by ``>=`` tertile thresholds of the mean key variance (top
    tertile 64, middle 32, bottom 8), ranks generated tokens inside a segment by the EpiKV score and
    keeps only those quotas, the prompt and the recent window, so it holds fewer than B; kvleague's
    engine always keeps B. The ``epikv`` score inside a segment follows the authors' semantics (the
    defaults of ``epikv``: generated-token series, normed last layer, reference arithmetic).

    Paper: Kolawole & Smith, arXiv 2606.26472 (EpiKV, segment variant).
    """

    needs = Needs(hidden_states=True, new_keys_values=True)

    segment: int = 128
    quotas: tuple[int, int, int] = (64, 32, 8)
    recent_window: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.segment < 1:
            raise ValueError(f"segment must be >= 1, got {self.segment}")
        self.quotas = tuple(self.quotas)
        if any(q < 0 or q > self.segment for q in self.quotas):
            raise ValueError(f"quotas must lie in [0, segment={self.segment}], got {self.quotas}")
        if self.recent_window is not None and self.recent_window < 0:
            raise ValueError(f"recent_window must be >= 0 or null, got {self.recent_window}")

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.key_var = PositionTable()

    def observe(self, obs: Observation) -> None:
        super().observe(obs)
        self.key_var.write(obs.new_positions, key_variance(obs.new_keys))

    def score(self, cache: CacheView) -> torch.Tensor:
        positions = cache.token_positions.cpu()
        epikv = self.token_scores(cache)
        recent = self.recent_window if self.recent_window is not None else min(128, cache.budget // 4)
        in_recent = positions > cache.current_position - recent
        seg = positions // self.segment
        old = ~in_recent
        tier = torch.where(in_recent, TIER_RECENT, TIER_FILL).to(torch.float64)
        if bool(old.any()):
            seg_ids, seg_index = torch.unique(seg[old], return_inverse=True)
            var = self.key_var.read(positions[old])
            mean_var = torch.zeros(seg_ids.shape[0], dtype=torch.float64).index_add_(0, seg_index, var)
            mean_var /= torch.bincount(seg_index, minlength=seg_ids.shape[0]).to(torch.float64)
            quota = tertile_quotas(mean_var, self.quotas)[seg_index]  # per old token
            rank_in_segment = rank_within(seg_index, epikv[old])
            old_tier = torch.where(rank_in_segment < quota, TIER_QUOTA, TIER_FILL).to(torch.float64)
            tier[old] = old_tier
        scores = tier + rank_in_unit(epikv)
        return self.apply_value_reserve(scores, cache)
