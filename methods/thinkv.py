from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, SequenceInfo
from kvleague.methods.kernels import (
    ObservesTogether,
    PositionTable,
    ScoresOnHost,
    newest_on_host,
    rank_in_unit,
    rank_within,
)
from kvleague.methods.registry import register_method

REASONING, EXECUTION, TRANSITION = "R", "E", "T"
#: score tiers (plus a rank in [0, 1) by accumulated attention inside each tier)
TIER_OPEN, TIER_TRANSITION, TIER_QUOTA, TIER_FILL = 3.0, 2.0, 1.0, 0.0


def classify(sparsity: float, thresholds: tuple[float, float]) -> str:
    """Thought type of a segment from its mean attention sparsity."""
    low, high = thresholds
    if sparsity >= high:
        return TRANSITION
    return EXECUTION if sparsity >= low else REASONING


def thought_quotas(types: list[str], schedule: tuple[int, ...]) -> list[int | None]:
    """Per complete segment (oldest first): its keep quota, or ``None`` for a protected transition.

    A thought is a maximal run of consecutive segments of one type (R or E); a transition segment ends
    the thought before it. The newest thought has age 0; segments of a thought of age a keep
    ``schedule[min(a, len(schedule) - 1)]`` tokens each.
    """
    quotas: list[int | None] = [None] * len(types)
    age, previous = -1, None
    for k in reversed(range(len(types))):
        kind = types[k]
        if kind != TRANSITION and kind != previous:
            age += 1
        previous = kind
        if kind != TRANSITION:
            quotas[k] = schedule[min(age, len(schedule) - 1)]
    return quotas


@register_method("thinkv")
@dataclass
class ThinKV(ScoresOnHost, ObservesTogether, EvictionMethod):
    """ThinKV (eviction part): thought-typed 128-token segments, older thoughts keep fewer tokens.

    Generated tokens are cut into segments of ``segment`` (128) positions counted from the first
    generated token. Each decode query q gets an attention sparsity s_q = the fraction of cache slots
    whose weight is below ``sparsity_tau`` / T (T = cache length), averaged over query heads and
    layers; a completed segment's sparsity is the mean over its decode queries, and its type is
    transition (s >= ``thresholds[1]``), execution (s >= ``thresholds[0]``) or reasoning (below).
    Thoughts are maximal runs of same-type R/E segments (a transition segment ends a thought); the
    newest thought keeps ``keep_schedule[0]`` = 64 tokens per segment, the one before 32, then 16, 8,
    and 4 for all older ones; transition segments are protected whole. Inside a segment, tokens are
    ranked by accumulated attention (mean over layers and query heads, summed over every query that
    saw them, H2O-style, by absolute position).

    Scores (one global ``[T]``): tier + rank in [0, 1) by accumulated attention, tier 3 = the open
    (incomplete) segment, 2 = transition segments, 1 = within a segment's quota, 0 = the rest
    (out-of-quota generated tokens, and prompt or fed tokens, which are not segmented).

    Choices where the paper is silent (all ours, documented): the sparsity measure (share of weights
    below tau / T, tau = 1: "below uniform"); the thresholds (0.90, 0.97) with transition as the
    sparsest type (ThinKV calibrates its thresholds per model offline; recalibrate them per model);
    segments are counted from the first generated position; the thought-age rule above; ranking
    inside a segment by accumulated attention; prompt tokens are never segmented. Deviation
    (contract): ThinKV keeps only the quotas, possibly fewer than B; the engine keeps exactly B, so
    leftover slots go to the best tier-0 tokens. The quantisation half of ThinKV is out of scope.

    Paper: "ThinKV: Thought-Adaptive KV Cache Compression for Efficient Reasoning Models", arXiv
    2510.01290. Reference code: none public that we could consult; written from the paper.
    """

    needs = Needs(attention=True, attention_window=1)
    prompt_on_host = True  # generated tokens are segmented, prompt ones not

    segment: int = 128
    keep_schedule: tuple[int, ...] = (64, 32, 16, 8, 4)
    thresholds: tuple[float, float] = (0.90, 0.97)
    sparsity_tau: float = 1.0

    def __post_init__(self) -> None:
        if self.segment < 1:
            raise ValueError(f"segment must be >= 1, got {self.segment}")
        self.keep_schedule = tuple(self.keep_schedule)
        self.thresholds = tuple(self.thresholds)  # type: ignore[assignment]  # a YAML list becomes the declared tuple
        if not self.keep_schedule or any(not 0 <= q <= self.segment for q in self.keep_schedule):
            raise ValueError(
                f"keep_schedule must be non-empty, each in [0, segment={self.segment}], got {self.keep_schedule}"
            )
        low, high = self.thresholds
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"thresholds must be (low, high) with 0 <= low <= high <= 1, got {self.thresholds}")
        if self.sparsity_tau <= 0:
            raise ValueError(f"sparsity_tau must be > 0, got {self.sparsity_tau}")

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.acc = PositionTable()
        self.gen_start: int | None = None
        self.sparsity_sum: dict[int, float] = {}
        self.sparsity_count: dict[int, int] = {}

    @classmethod
    def observe_together(cls, methods, observations) -> None:
        """Every sequence's accumulated attention and sparsity from one reduction per group and one copy
        to the host (:func:`newest_on_host`)."""

        def reduce(rows: torch.Tensor, i: int) -> list[torch.Tensor]:  # [n, L, H_q, T]
            below = rows < methods[i].sparsity_tau / rows.shape[-1]
            return [rows.mean(dim=(1, 2)), below.float().mean(dim=(1, 2, 3))[:, None]]

        taus = [m.sparsity_tau for m in methods]
        for members, new, cached, (mean, sparsity) in newest_on_host(observations, taus, reduce):
            for j, i in enumerate(members):
                methods[i]._note(observations[i].phase, new[j], cached[j], mean[j], float(sparsity[j, 0]))

    def _note(self, phase: str, new: np.ndarray, cached: np.ndarray, mean: np.ndarray, sparsity: float) -> None:
        """One pass: the newest query's attention ``mean`` (over layers and query heads) on the ``cached``
        positions, and, decoding, its ``sparsity``."""
        self.acc.array(int(cached.max()))[cached] += mean  # positions are distinct
        if phase != "decode":
            return
        position = int(new[-1])
        if self.gen_start is None:
            self.gen_start = position
        seg = (position - self.gen_start) // self.segment
        self.sparsity_sum[seg] = self.sparsity_sum.get(seg, 0.0) + sparsity
        self.sparsity_count[seg] = self.sparsity_count.get(seg, 0) + 1

    def segment_types(self, n_complete: int) -> list[str]:
        types = []
        for seg in range(n_complete):
            count = self.sparsity_count.get(seg, 0)
            mean = self.sparsity_sum[seg] / count if count else 0.0
            types.append(classify(mean, self.thresholds))
        return types

    def score_on_host(
        self, positions: torch.Tensor, cache: CacheView, top: int | None, prompt: torch.Tensor | None = None
    ) -> torch.Tensor:
        acc = self.acc.read_host(positions, top)
        tier = torch.zeros(positions.shape[0], dtype=torch.float64)
        if self.gen_start is not None:
            assert prompt is not None  # prompt_on_host
            generated = ~prompt
            rel = positions - self.gen_start
            n_complete = (cache.current_position - self.gen_start + 1) // self.segment
            seg = torch.div(rel, self.segment, rounding_mode="floor")
            tier[generated & (seg >= n_complete)] = TIER_OPEN
            closed = generated & (seg >= 0) & (seg < n_complete)
            if n_complete > 0:
                quotas = thought_quotas(self.segment_types(n_complete), self.keep_schedule)
                # -1 marks a protected transition segment
                quota_of = torch.tensor([-1 if q is None else q for q in quotas], dtype=torch.long)
                seg_closed = seg[closed]
                quota = quota_of[seg_closed]
                rank = rank_within(seg_closed, acc[closed])
                closed_tier = torch.where(rank < quota, TIER_QUOTA, TIER_FILL)
                closed_tier = torch.where(quota < 0, TIER_TRANSITION, closed_tier)
                tier[closed] = closed_tier.to(torch.float64)
        return tier + rank_in_unit(acc)
