from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.runner.engine.contract import CacheView, EvictionMethod, Needs, Observation, SequenceInfo
from kvleague.methods.registry import register_method
from kvleague.methods.kernels import last_query_row


@register_method("longflow_authors")
@dataclass
class LongFlowAuthors(EvictionMethod):
    """LongFlow as the EpiKV authors' harness runs it (their ``LongFlowEviction``): attention times value L1 norm.

    score_i = a_i · n_i with a = mean over layers of the newest query's attention row (mean over query
    heads) and n_i = mean over layers of (mean over KV heads of ||v_i||_1), both float32, recomputed at
    every eviction from the current step ("zero-history"). No window, no sinks, prompt evictable; one
    ``[T]`` score. Run it with ``protocol: {positions: compact}`` (the authors' harness); kept positions
    and greedy tokens then equal the authors' class (float32 eager; docs/methods.md).

    Deviations: equal scores keep the more recent position (theirs: ``topk``'s choice); a prompt
    longer than B is compressed right after prefill with the last prompt query's row (theirs waits for
    the first decode step). The original LongFlow computes the same score inside a fused attention
    kernel per layer and compresses long prompts with SnapKV; neither is reproduced.

    Paper: LongFlow (Su et al., 2026), as adapted in stevenkolawole/epiphany-kv-cache
    ``src/eviction.py`` ``LongFlowEviction`` (``scripts/benchmark.py`` method ``longflow``).
    """

    needs = Needs(attention=True, eager=True)

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.row: torch.Tensor | None = None

    def observe(self, obs: Observation) -> None:
        self.row = torch.stack([last_query_row(r, self.info.dtype).mean(dim=(0, 1))[-1, :] for r in obs.attention]).mean(dim=0).float().cpu()

    def score(self, cache: CacheView) -> torch.Tensor:
        value_l1 = torch.stack([v[None].float().abs().sum(dim=-1).mean(dim=(0, 1)) for v in cache.values]).mean(dim=0).cpu()
        return self.row * value_l1
