from __future__ import annotations

from dataclasses import dataclass

import torch

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, SequenceInfo, groups_by, stacked_layers
from kvleague.engine.errors import KvleagueError
from kvleague.methods.kernels import ObservesTogether
from kvleague.methods.registry import register_method


@register_method("tova")
@dataclass
class TOVA(ObservesTogether, EvictionMethod):
    """TOVA: keep the tokens the current query attends to most, averaged over heads, per layer.

    score[l, t] = mean over the query heads of layer l of A_l[q, t], the softmax attention of the
    newest query q (the last token of the forward pass) over the cache after it was appended. Shape
    ``[L, T]``: each layer keeps its own set. With ``cadence: every_step`` it evicts the lowest-scoring
    token at every decode step, as in the paper; at prefill it compresses with the last prompt query.

    Paper: Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104. Reference code:
    schwartz-lab-NLP/TOVA (``tova_cache.py``); kvpress ``TOVAPress`` (same kept indices on prefill once
    the newest token is protected). Deviations: none in the rule. TOVA, like this method, may evict the
    newest token itself when its self-attention is low; kvpress always keeps it (set the protocol's
    ``recent: 1`` for kvpress's behaviour).
    """

    needs = Needs(attention=True, attention_window=1, ordered_slots=False)

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.last: torch.Tensor | None = None

    @classmethod
    def observe_together(cls, methods, observations) -> None:
        """Sequences holding equal numbers of slots: the head mean of every layer's newest row, for all
        of them in one operation (a sequence alone: a batch of one)."""
        for members in groups_by([o.cache_positions.shape[-1] for o in observations]):
            rows = torch.stack([stacked_layers(observations[i].attention) for i in members])  # [n, L, H_q, w, T]
            last = rows[:, :, :, -1, :].mean(dim=2)  # [n, L, T]
            for i, row in zip(members, last.unbind(0)):
                methods[i].last = row

    def score(self, cache: CacheView) -> torch.Tensor:
        if self.last is None or self.last.shape[-1] != cache.length:
            raise KvleagueError("method tova: the last observation does not match the cache being scored")
        return self.last
