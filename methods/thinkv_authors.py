from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.engine.contract import (
    CacheView,
    EvictionMethod,
    Needs,
    SequenceInfo,
    groups_by,
    newest_rows,
)
from kvleague.methods.kernels import (
    ObservesTogether,
    ScoresOnHost,
    layer_mean_row,
    segment_bounds,
    tertile_types,
    top_by_score_then_position,
)
from kvleague.methods.registry import register_method


def attention_entropy(row: torch.Tensor) -> float:
    """Entropy of ``row`` normalised to a distribution: p = a / (sum a + 1e-9), H = -sum p log(p + 1e-12)."""
    p = row / (row.sum() + 1e-9)
    return float(-(p * torch.log(p + 1e-12)).sum())


@register_method("thinkv_authors")
@dataclass
class ThinKVAuthors(ScoresOnHost, ObservesTogether, EvictionMethod):
    """ThinKV as the EpiKV authors' harness runs it (their ``ThinKVEviction``): per-segment quotas, fewer than B.

    At each eviction (cache length T > B), with r = min(``recent``, B // 4) and C = T - r:

    * the newest r slots are kept (+inf);
    * slots 0..C-1 (the current cache, prompt included, in position order) are cut into segments of
      ``segment`` (128) slots, the last one shorter;
    * each segment's entropy: a = mean over the last ``classifier_layers`` (4) layers of the newest
      query's attention row (mean over query heads), p = a_seg / (sum a_seg + 1e-9),
      H = -sum p log(p + 1e-12);
    * types by tertiles of the S entropies (sorted e, t_low = e[S // 3], t_high = e[2S // 3]):
      H <= t_low -> R, H <= t_high -> E, else T; a single segment is R;
    * segments in order, while budget remains (B - r to start): keep the min(quota, segment length,
      remaining) slots of highest last-layer attention (newest query, mean over heads), ``quotas`` =
      (R 64, E 32, T 8); every other slot scores -inf, so the cache keeps **fewer than B** (see the
      "keeping fewer than B" contract in ``engine/contract.py``) and refills before the next eviction.

    Stateless: every eviction re-types the segments from the current step's attention. One ``[T]`` score.
    Run it with ``protocol: {positions: compact}`` (the authors' harness: no ``position_ids``, prompt
    evictable, evict after every decode forward when the cache exceeds B). Under those settings kept
    positions and greedy tokens equal the authors' class (float32 eager; tests/test_baselines_authors.py,
    docs/methods.md).

    Deviations, all where the authors' class leaves the result open: equal attention inside a segment
    keeps the more recent position (theirs: ``topk``'s choice); with B < 4 (r = 0) theirs keeps the whole
    cache (``keep_mask[-0:]``), kvleague keeps no window; a prompt longer than B is compressed by the
    engine right after prefill with the last prompt query's row (theirs waits for the first decode step).

    The original ThinKV (thought types by attention sparsity, thought-age schedule, refresh, no
    quantisation here) is ``thinkv``. The authors also have ``ThinKVFaithfulEviction`` (a Gaussian-KDE
    split of the entropies and a 128-step label refresh); their accuracy tables and figures use this
    class (``benchmark.py`` method ``thinKV``), so this is the one offered.

    Paper: ThinKV, arXiv 2510.01290, as adapted in stevenkolawole/epiphany-kv-cache ``src/eviction.py``.
    """

    needs = Needs(attention=True, eager=True, keeps_fewer=True)

    segment: int = 128
    quotas: tuple[int, int, int] = (64, 32, 8)
    classifier_layers: int = 4
    recent: int = 128

    def __post_init__(self) -> None:
        if self.segment < 1:
            raise ValueError(f"segment must be >= 1, got {self.segment}")
        self.quotas = tuple(self.quotas)  # type: ignore[assignment]  # a YAML list; its length is checked next
        if len(self.quotas) != 3 or any(q < 0 for q in self.quotas):
            raise ValueError(f"quotas must be three counts >= 0 (R, E, T), got {self.quotas}")
        if self.classifier_layers < 1 or self.recent < 0:
            raise ValueError(
                f"classifier_layers must be >= 1 and recent >= 0, got {self.classifier_layers}, {self.recent}"
            )

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.entropy_row: torch.Tensor | None = None
        self.rank_row: torch.Tensor | None = None

    @classmethod
    def observe_together(cls, methods, observations) -> None:
        """Each sequence's rows from the newest query's attention in the last ``classifier_layers``
        layers: sequences of equal lengths together, one copy to the host per group (alone: a group of one)."""
        keys = [(o.cache_positions.shape[-1], m.classifier_layers, m.info.dtype) for m, o in zip(methods, observations)]
        for members in groups_by(keys):
            first = methods[members[0]]
            rows = torch.stack([newest_rows(observations[i].attention[-first.classifier_layers :]) for i in members])
            # as the authors: the classifier layers' mean row; the last layer's ranks the slots
            entropy, rank = layer_mean_row(rows, first.info.dtype), layer_mean_row(rows[:, -1:], first.info.dtype)
            host = torch.stack([entropy, rank], dim=1).cpu()
            for i, (entropy_row, rank_row) in zip(members, host):
                methods[i].entropy_row, methods[i].rank_row = entropy_row, rank_row

    def score_on_host(
        self, positions: torch.Tensor, cache: CacheView, top: int | None, prompt: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert self.entropy_row is not None and self.rank_row is not None, "score() follows an observed pass"
        budget, length = cache.budget, positions.shape[0]
        recent = min(self.recent, budget // 4)
        classify = length - recent
        scores = torch.full((length,), float("-inf"), dtype=torch.float64)
        scores[classify:] = float("inf")
        bounds = segment_bounds(classify, self.segment)
        labels = tertile_types([attention_entropy(self.entropy_row[a:b]) for a, b in bounds])
        remaining = budget - recent
        for (start, end), label in zip(bounds, labels):
            if remaining <= 0:
                break
            n_keep = min(self.quotas[label], end - start, remaining)
            if n_keep > 0:
                chosen = start + top_by_score_then_position(self.rank_row[start:end], positions[start:end], n_keep)
                scores[chosen] = self.rank_row[chosen].double()
                remaining -= n_keep
        return scores
