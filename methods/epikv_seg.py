from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvleague.engine.contract import BatchCacheView, CacheView, Needs, Observation, SequenceInfo
from kvleague.engine.deferred_reads import now
from kvleague.methods.epikv import EpiKV
from kvleague.methods.kernels import (
    PositionTable,
    positions_on_host,
    rank_in_unit,
    rank_within,
    segment_bounds,
    tertile_types,
    top_by_score_then_position,
)
from kvleague.methods.registry import register_method

#: score tiers (added to a value in [0, 1) that orders tokens inside a tier)
TIER_RECENT, TIER_QUOTA, TIER_FILL = 2.0, 1.0, 0.0


def key_variance(new_keys: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """``[C]``: variance over head_dim (population) of each new key, averaged over KV heads and layers."""
    total = None
    for k in new_keys:
        v = k.float().var(dim=-1, unbiased=False).mean(dim=0)
        total = v if total is None else total + v
    assert total is not None, "a pass has at least one layer"
    return total / len(new_keys)


def tertile_quotas(segment_variance: torch.Tensor, quotas: tuple[int, int, int]) -> torch.Tensor:
    """Per segment: the quota of its variance tertile (rank r of S, highest first: tier floor(3r/S))."""
    s = segment_variance.shape[0]
    order = torch.argsort(segment_variance, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(s)
    tier = (3 * rank) // max(s, 1)
    return torch.tensor(quotas, dtype=torch.long)[tier]


@register_method("epikv_seg")
@dataclass
class EpiKVSeg(EpiKV):
    """EpiKV-Seg: per-segment quotas by key variance (64 / 32 / 8), ``epikv`` score inside a segment.

    ``selection: authors`` (default; the authors' ``KVSegHSEviction``, which the paper's EpiKV-Seg
    rows come from: ``benchmark.py`` method ``kv_seg_hs``). At each eviction (cache length T > B), with
    r = ``recent_window`` (default min(128, B // 4)) and C = T - r:

    * the prompt slots and the newest r slots are kept (+inf);
    * slots 0..C-1 of the current cache (position order, prompt slots included) are cut into
      segments of ``segment`` (128) slots, the last one shorter; per slot, the key variance is the
      sample variance over head_dim (ddof = 1) averaged over KV heads, then over layers (float32,
      recomputed from the cache); a segment's statistic is the mean over its slots;
    * types by descending tertile thresholds of the S statistics (sorted s, t_low = s[S // 3],
      t_high = s[2S // 3]): s >= t_high -> quota ``quotas[0]`` (64), s >= t_low -> ``quotas[1]`` (32),
      else ``quotas[2]`` (8); a single segment takes ``quotas[0]``;
    * segments in order, while budget remains (B - r - prompt to start): the generated slots of the
      segment with the highest ``epikv`` score (z_A - z_B, frozen, same hyperparameters and defaults as
      ``epikv``) fill min(quota, generated slots in the segment, remaining); every other slot scores
      -inf, so the cache keeps **fewer than B** (the "keeping fewer than B" contract in
      ``engine/contract.py``) and refills before the next eviction.

    Under ``protocol: epikv_paper`` kept positions and greedy tokens equal the authors' class
    (tests/test_baselines_authors.py, docs/methods.md). Deviations: equal scores inside a segment keep
    the more recent position (theirs: ``topk``'s choice); when the prompt and the recent window together
    exceed B the authors' class keeps both (more than B), kvleague's engine gives the window what the
    prompt leaves; the authors' value-magnitude swap (``kv_seg_hs_v*``) is not offered, so
    ``value_reserve`` needs ``selection: fill``.

    ``selection: fill`` (kvleague's earlier reading of the paper, off by default): segments of
    ``segment`` absolute positions (id = position // 128) outside the window, ranked by mean population
    key variance (computed once per token), tertile of rank r of S = floor(3r / S); scores are tier +
    rank in [0, 1) with tier 2 = recent window, 1 = inside the segment's quota, 0 = the rest, so the
    engine keeps exactly B and spare slots go to the best out-of-quota tokens by ``epikv`` score.
    ``value_reserve`` tokens get 1e9 + range as in ``epikv``.

    Paper: Kolawole & Smith, arXiv 2606.26472 (EpiKV, segment variant). Reference code:
    stevenkolawole/epiphany-kv-cache ``src/eviction.py`` ``KVSegHSEviction``.
    """

    needs = Needs(hidden_states=True, new_keys_values=True, keeps_fewer=True)

    segment: int = 128
    quotas: tuple[int, int, int] = (64, 32, 8)
    recent_window: int | None = None
    selection: Literal["authors", "fill"] = "authors"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.segment < 1:
            raise ValueError(f"segment must be >= 1, got {self.segment}")
        self.quotas = tuple(self.quotas)  # type: ignore[assignment]  # a YAML list becomes the declared tuple
        if any(q < 0 or q > self.segment for q in self.quotas):
            raise ValueError(f"quotas must lie in [0, segment={self.segment}], got {self.quotas}")
        if self.recent_window is not None and self.recent_window < 0:
            raise ValueError(f"recent_window must be >= 0 or null, got {self.recent_window}")
        if self.selection not in ("authors", "fill"):
            raise ValueError(f"selection must be authors or fill, got {self.selection!r}")
        if self.selection == "authors" and self.value_reserve:
            raise ValueError("value_reserve needs selection: fill (the authors' reserve swap is not offered)")

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.key_var = PositionTable()

    def observe(self, obs: Observation) -> None:
        with now():  # its eviction ranks the new token's score among the others' at once
            super().observe(obs)
        self._observe_variance(obs)

    @classmethod
    def observe_batch(cls, methods, observations) -> None:
        """The EpiKV family's batched signals, then each sequence's key variances."""
        if cls.observe is not EpiKVSeg.observe:
            return super().observe_batch(methods, observations)
        with now():
            EpiKV._observe_signals(methods, observations)
        for method, obs in zip(methods, observations):
            method._observe_variance(obs)

    def _observe_variance(self, obs: Observation) -> None:
        if self.selection == "fill":  # the authors' selection reads the variances from the cache instead
            assert obs.new_keys is not None, "needs.new_keys_values is declared"
            self.key_var.write(obs.new_positions, key_variance(obs.new_keys))

    def token_scores(self, cache: CacheView) -> torch.Tensor:
        """The frozen EpiKV scores on the host, where the selection ranks them."""
        return self.table.read_host(cache.token_positions.cpu())

    def _recent(self, budget: int) -> int:
        return self.recent_window if self.recent_window is not None else min(128, budget // 4)

    def score(self, cache: CacheView) -> torch.Tensor:
        if self.selection == "authors":
            return self._authors_scores(cache)
        positions = cache.token_positions.cpu()
        epikv = self.token_scores(cache)
        recent = self._recent(cache.budget)
        in_recent = positions > cache.current_position - recent
        seg = positions // self.segment
        old = ~in_recent
        tier = torch.where(in_recent, TIER_RECENT, TIER_FILL).to(torch.float64)
        if bool(old.any()):
            seg_ids, seg_index = torch.unique(seg[old], return_inverse=True)
            var = self.key_var.read_host(positions[old])
            mean_var = torch.zeros(seg_ids.shape[0], dtype=torch.float64).index_add_(0, seg_index, var)
            mean_var /= torch.bincount(seg_index, minlength=seg_ids.shape[0]).to(torch.float64)
            quota = tertile_quotas(mean_var, self.quotas)[seg_index]  # per old token
            rank_in_segment = rank_within(seg_index, epikv[old])
            old_tier = torch.where(rank_in_segment < quota, TIER_QUOTA, TIER_FILL).to(torch.float64)
            tier[old] = old_tier
        scores = tier + rank_in_unit(epikv)
        return self.apply_value_reserve(scores, cache)

    def _authors_scores(self, cache: CacheView) -> torch.Tensor:
        (host,), _ = positions_on_host([cache], with_prompt=True)
        classify = max(cache.length - self._recent(cache.budget), 0)
        # as the authors: k.float().var(dim=-1).mean(dim=(0, 1)) per layer on [1, H, C, d], mean over layers
        per_slot = torch.stack([k[None, :, :classify].float().var(dim=-1).mean(dim=(0, 1)) for k in cache.keys]).mean(
            dim=0
        )
        return self._authors_from(host[0], host[1].bool(), self.token_scores(cache), per_slot.cpu(), cache.budget)

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        """``selection: authors``, caches of equal lengths: every row's key variances per slot in one
        operation per layer, and with its positions and prompt flags one copy to the host."""
        if (
            cls.score is not EpiKVSeg.score
            or cls._authors_scores is not EpiKVSeg._authors_scores
            or cls.token_scores is not EpiKVSeg.token_scores
            or not caches.equal_lengths
            or any(m.selection != "authors" for m in methods)
        ):
            return super().score_batch(methods, caches)
        members = list(range(len(methods)))
        # [n, T]: every slot's, the same per slot as the prefix of ``classify`` slots that a row alone reads
        per_slot = torch.stack([k.float().var(dim=-1).mean(dim=1) for k in caches.keys_of(members)]).mean(dim=0)
        host, top = positions_on_host(caches.views, with_prompt=True)
        per_slot = per_slot.cpu()
        out = []
        for method, view, row, variances in zip(methods, caches.views, host, per_slot):
            classify = max(view.length - method._recent(view.budget), 0)
            positions, prompt = row
            # the epikv scores as token_scores reads them, from the positions already on the host
            epikv = method.table.read_host(positions, top)
            out.append(method._authors_from(positions, prompt.bool(), epikv, variances[:classify], view.budget))
        return out

    def _authors_from(
        self, positions: torch.Tensor, prompt: torch.Tensor, epikv: torch.Tensor, per_slot: torch.Tensor, budget: int
    ) -> torch.Tensor:
        """The authors' selection from a cache's positions, prompt flags and ``epikv`` scores
        (:meth:`token_scores`) and the key variance of its first ``classify`` slots (``per_slot``), on
        the host."""
        length = positions.shape[0]
        recent = self._recent(budget)
        classify = per_slot.shape[0]
        scores = torch.full((length,), float("-inf"), dtype=torch.float64)
        scores[prompt] = float("inf")
        scores[classify:] = float("inf")
        if classify == 0:
            return scores
        bounds = segment_bounds(classify, self.segment)
        types = tertile_types([float(per_slot[a:b].mean()) for a, b in bounds], descending=True)
        remaining = budget - recent - int(prompt.sum())
        for (start, end), kind in zip(bounds, types):
            if remaining <= 0:
                break
            generated = start + (~prompt[start:end]).nonzero()[:, 0]
            if generated.numel() == 0:
                continue
            n_keep = min(self.quotas[kind], generated.numel(), remaining)
            if n_keep > 0:
                chosen = generated[top_by_score_then_position(epikv[generated], positions[generated], n_keep)]
                scores[chosen] = epikv[chosen]
                remaining -= n_keep
        return scores
