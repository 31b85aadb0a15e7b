from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, SequenceInfo
from kvleague.methods.kernels import ObservesTogether, PositionTable, ScoresOnHost, layer_mean_row, newest_on_host
from kvleague.methods.registry import register_method


@register_method("raas_authors")
@dataclass
class RaaSAuthors(ScoresOnHost, ObservesTogether, EvictionMethod):
    """RaaS as the EpiKV authors' harness runs it (their ``RaaSEviction``): LRU stamps from median attention.

    Every generated token gets a timestamp when it enters the cache (the decode step, here its
    position: one token per step, so the order is the same). After every decode forward, a =
    mean over layers of the newest query's attention row (mean over query heads); among the cached
    *generated* tokens, those with a >= the median of a over them (``torch.median``: the lower middle
    value) are re-stamped with the current step. score = timestamp for generated tokens; fed (prompt)
    tokens score +inf (the authors keep them unconditionally). No recent window, no sinks. One ``[T]``
    score; only decode forwards update stamps (the authors' class never sees the prefill).

    Run it with ``protocol: {positions: compact, protect_prompt: true, prompt_over_budget: keep}`` (the
    authors' harness: no ``position_ids``, prompt kept even beyond B, eviction after every decode
    forward, no window).

    Ties: stamps are integers, and about half the generated tokens share the newest stamp, so ties are
    frequent. The authors rank with ``torch.topk``, which leaves the choice among equal stamps open;
    kvleague keeps the more recent position (the engine's tie-break). Kept positions therefore equal the
    authors' class only as long as no eviction boundary falls inside a group of equal stamps, or when
    the authors' ``topk`` is given the same tie-break (the evidence in docs/methods.md runs their class
    with a ``topk`` that breaks ties by recency; tests/test_baselines_authors.py uses that rule).

    The original RaaS (stamp refreshed by attention above alpha / n, per token position) is ``raas``.

    Paper: Hu et al., 2025 (RaaS), as adapted in stevenkolawole/epiphany-kv-cache ``src/eviction.py``
    ``RaaSEviction`` (``scripts/benchmark.py`` method ``raas``). The attention rows are averaged in the
    model's dtype, as theirs.
    """

    needs = Needs(attention=True, eager=True)

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.stamp = PositionTable()
        self.fed = PositionTable()  # 1.0 at positions that were fed (prompt), never stamped

    @classmethod
    def observe_together(cls, methods, observations) -> None:
        """Decode steps: each sequence's row (:func:`layer_mean_row`, the model's dtype) with its new and
        cached positions, sequences of equal lengths in one reduction and one copy to the host."""
        decoding = []
        for i, (method, obs) in enumerate(zip(methods, observations)):
            if obs.phase == "prefill":
                method.fed.write(obs.new_positions, torch.ones(obs.new_positions.shape[0]))
            else:
                decoding.append(i)
        group = [methods[i] for i in decoding]

        def row(rows: torch.Tensor, i: int) -> list[torch.Tensor]:
            return [layer_mean_row(rows, group[i].info.dtype)]

        dtypes = [m.info.dtype for m in group]
        for members, new, cached, (attention,) in newest_on_host([observations[i] for i in decoding], dtypes, row):
            for j, i in enumerate(members):
                group[i]._stamp(new[j], cached[j], attention[j])

    def _stamp(self, new: np.ndarray, positions: np.ndarray, row: np.ndarray) -> None:
        """One decode step, on the host (numpy views of the tables, no torch op per sequence)."""
        step = float(new[-1])
        top = int(max(new.max(), positions.max()))
        stamp, fed = self.stamp.array(top), self.fed.array(top)
        stamp[new] = step
        generated = fed[positions] == 0
        decode_attention = row[generated]
        if decode_attention.size:
            median = np.sort(decode_attention)[(decode_attention.size - 1) // 2]  # the lower one, as torch's
            stamp[positions[generated][decode_attention >= median]] = step

    def score_on_host(
        self, positions: torch.Tensor, cache: CacheView, top: int | None, prompt: torch.Tensor | None = None
    ) -> torch.Tensor:
        scores = self.stamp.read_host(positions, top).clone()
        scores[self.fed.read_host(positions, top) != 0] = float("inf")
        return scores
