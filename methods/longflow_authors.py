from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.engine.contract import BatchCacheView, CacheView, EvictionMethod, Needs, SequenceInfo
from kvleague.methods.kernels import ObservesTogether, layer_mean_row, newest_on_host
from kvleague.methods.registry import register_method


@register_method("longflow_authors")
@dataclass
class LongFlowAuthors(ObservesTogether, EvictionMethod):
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

    @classmethod
    def observe_together(cls, methods, observations) -> None:
        """Each sequence's row (:func:`layer_mean_row`, the model's dtype, then float32), sequences of
        equal lengths in one reduction and one copy to the host."""

        def row(rows: torch.Tensor, i: int) -> list[torch.Tensor]:
            return [layer_mean_row(rows, methods[i].info.dtype).float()]

        for members, _, _, (attention,) in newest_on_host(observations, [m.info.dtype for m in methods], row):
            for j, i in enumerate(members):
                methods[i].row = torch.from_numpy(attention[j]).float()

    def score(self, cache: CacheView) -> torch.Tensor:
        assert self.row is not None, "score() follows an observed pass"
        return self.row * value_l1([v[None] for v in cache.values])[0].cpu()

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        """Caches of equal lengths: the value norms of every row in one operation per layer, one copy to the host."""
        if cls.score is not LongFlowAuthors.score or not caches.equal_lengths:
            return super().score_batch(methods, caches)
        norms = value_l1(caches.values_of(list(range(len(methods))))).cpu()
        return [m.row * n for m, n in zip(methods, norms)]


def value_l1(values: list[torch.Tensor]) -> torch.Tensor:
    """Per layer ``[n, H, T, d]`` -> ``[n, T]``: as the authors, ``v.float().abs().sum(dim=-1)`` averaged
    over KV heads per layer, then over layers."""
    return torch.stack([v.float().abs().sum(dim=-1).mean(dim=1) for v in values]).mean(dim=0)
