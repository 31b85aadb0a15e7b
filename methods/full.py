from dataclasses import dataclass

import torch

from kvleague.engine.contract import CacheView, EvictionMethod
from kvleague.methods.registry import register_method


@register_method("full")
@dataclass
class FullCache(EvictionMethod):
    """Full cache: never evicts. The accuracy ceiling every method is compared with.

    The engine ignores the budget for this method (it reports the budget it was given, but the cache
    grows with the sequence), so ``full`` rows show the real memory cost of no compression.
    """

    @property
    def never_evicts(self) -> bool:
        return True

    def score(self, cache: CacheView) -> torch.Tensor:
        return torch.zeros(cache.length)
