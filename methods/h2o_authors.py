from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, SequenceInfo
from kvleague.methods.kernels import ObservesTogether, ScoresOnHost, layer_mean_row, newest_on_host
from kvleague.methods.registry import register_method


@register_method("h2o_authors")
@dataclass
class H2OAuthors(ScoresOnHost, ObservesTogether, EvictionMethod):
    """H2O as the EpiKV authors' harness runs it (their ``H2OEviction``): one global accumulated-attention score.

    Per decode step, a_t = mean over layers of (mean over query heads of the new query's softmax
    attention row), one value per cached slot (float32, as the eager weights). acc[t] = sum of a over
    the decode steps since t entered the cache; the **prefill attention is not accumulated** (the
    authors' buffer starts at the first decode step, prompt slots at 0 plus what decode queries give
    them). score[t] = acc[t], except the first ``min(n_sink, B // 4)`` positions and the newest
    ``min(recent, B - sinks)`` positions, which get +inf: with B <= recent + sinks this is
    StreamingLLM. One ``[T]`` score (the same tokens in every layer and head).

    Run it with ``protocol: {positions: compact}`` and nothing protected (the authors' harness: no
    ``position_ids``, prompt evictable, eviction after every decode forward). Under those settings kept
    positions and greedy tokens equal the authors' class (float32 eager model; see docs/methods.md).
    The original-paper H2O (per KV head, prefill attention accumulated, recent half) is ``h2o``.

    Paper: Zhang et al., arXiv 2306.14048 (H2O), as adapted in stevenkolawole/epiphany-kv-cache
    ``src/eviction.py`` ``H2OEviction`` (``scripts/benchmark.py`` method ``h2o``). Deviation: equal
    accumulated scores keep the more recent position (theirs: ``topk``'s choice); bf16 models average
    the weights in float32 here (theirs in bf16).
    """

    needs = Needs(attention=True, eager=True)

    n_sink: int = 4
    recent: int = 128

    def __post_init__(self) -> None:
        if self.n_sink < 0 or self.recent < 0:
            raise ValueError(f"n_sink and recent must be >= 0, got {self.n_sink}, {self.recent}")

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.acc = torch.zeros(1024, dtype=torch.float32)  # by absolute position

    @classmethod
    def observe_together(cls, methods, observations) -> None:
        """Decode steps: each sequence's row (:func:`layer_mean_row`, float32) with its cached positions,
        sequences of equal lengths in one reduction and one copy to the host."""
        decoding = [i for i, obs in enumerate(observations) if obs.phase == "decode"]
        group = [methods[i] for i in decoding]

        def row(rows: torch.Tensor, i: int) -> list[torch.Tensor]:
            return [layer_mean_row(rows, torch.float32)]

        for members, _, cached, (step,) in newest_on_host(
            [observations[i] for i in decoding], [None] * len(group), row
        ):
            for j, i in enumerate(members):
                group[i]._accumulate(cached[j], step[j].astype(np.float32))

    def _accumulate(self, positions: np.ndarray, step: np.ndarray) -> None:
        """One decode step's float32 row added at its positions, on the host (a numpy view of ``acc``)."""
        top = int(positions.max()) + 1
        if top > self.acc.shape[0]:
            self.acc = torch.cat([self.acc, torch.zeros(max(top, self.acc.shape[0]), dtype=torch.float32)])
        self.acc.numpy()[positions] += step

    def score_on_host(
        self, positions: torch.Tensor, cache: CacheView, top: int | None, prompt: torch.Tensor | None = None
    ) -> torch.Tensor:
        budget = cache.budget
        scores = self.acc[positions].clone()
        sinks = min(self.n_sink, budget // 4)
        recent = min(self.recent, budget - sinks)
        ordered = positions.sort().values
        scores[positions < (ordered[sinks] if sinks < len(ordered) else positions.max() + 1)] = float("inf")
        if recent > 0:
            scores[positions >= ordered[-recent]] = float("inf")
        return scores
