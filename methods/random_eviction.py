from dataclasses import dataclass

import torch

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, SequenceInfo
from kvleague.methods.registry import register_method


@register_method("random")
@dataclass
class RandomEviction(EvictionMethod):
    """Random eviction: every evictable token is equally likely to go (a floor for any method).

    score_t ~ U(0, 1), drawn fresh at each eviction from a generator seeded with
    ``seed`` + the sequence seed, so a run is reproducible.
    """

    needs = Needs(ordered_slots=False)

    seed: int = 0

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + info.seed)

    def score(self, cache: CacheView) -> torch.Tensor:
        return torch.rand(cache.length, generator=self.generator)
