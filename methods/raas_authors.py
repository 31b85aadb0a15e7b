from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.runner.engine.contract import CacheView, EvictionMethod, Needs, Observation, SequenceInfo
from kvleague.methods.kernels import PositionTable, last_query_row
from kvleague.methods.registry import register_method


@register_method("raas_authors")
@dataclass
class RaaSAuthors(EvictionMethod):
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

    def observe(self, obs: Observation) -> None:
        if obs.phase == "prefill":
            self.fed.write(obs.new_positions, torch.ones(obs.new_positions.shape[0]))
            return
        step = float(obs.new_positions[-1])
        self.stamp.write(obs.new_positions, torch.full((obs.new_positions.shape[0],), step))
        positions = obs.cache_positions[0][0].cpu()
        row = torch.stack([last_query_row(r, self.info.dtype).mean(dim=(0, 1, 2)) for r in obs.attention]).mean(dim=0).cpu()
        generated = self.fed.read(positions) == 0
        decode_attention = row[generated]
        if decode_attention.numel():
            hit = positions[generated][decode_attention >= decode_attention.median()]
            self.stamp.write(hit, torch.full((hit.shape[0],), step))

    def score(self, cache: CacheView) -> torch.Tensor:
        positions = cache.token_positions.cpu()
        scores = self.stamp.read(positions).clone()
        scores[self.fed.read(positions) != 0] = float("inf")
        return scores
