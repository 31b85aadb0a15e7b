from dataclasses import dataclass

import torch

from kvleague.engine.contract import BatchCacheView, CacheView, EvictionMethod, Needs, groups_by
from kvleague.engine.to_device import to_device
from kvleague.methods.registry import register_method


@register_method("streaming_llm")
@dataclass
class StreamingLLM(EvictionMethod):
    """StreamingLLM: keep ``n_sink`` attention-sink tokens plus the most recent ones.

    score_t = +inf for the ``n_sink`` lowest absolute positions, else the absolute position t
    (newer = higher), so the kept set is exactly sinks + the most recent ``B - n_sink`` tokens.

    Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.
    Reference code: mit-han-lab/streaming-llm; kvpress ``StreamingLLMPress`` (same kept set on prefill).
    Deviation from the paper: keys keep their original RoPE positions (the paper re-rotates keys to
    cache-relative positions); select ``positions: compact`` in the protocol for the paper's setting.
    """

    needs = Needs(ordered_slots=False)

    n_sink: int = 4

    def __post_init__(self) -> None:
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")

    def score(self, cache: CacheView) -> torch.Tensor:
        positions = cache.token_positions.to(torch.float32)
        sinks = torch.argsort(positions)[: self.n_sink]
        scores = positions.clone()
        scores[sinks] = float("inf")
        return scores

    @classmethod
    def score_batch(cls, methods, caches: BatchCacheView) -> list[torch.Tensor]:
        """Sequences holding equal numbers of slots: the ``n_sink`` lowest positions of each row at once."""
        out: list = [None] * len(caches)
        for members in groups_by(caches.lengths):
            positions = torch.stack([caches.views[i].token_positions for i in members]).to(torch.float32)  # [n, T]
            order = torch.argsort(positions, dim=-1)
            n_sink = to_device([methods[i].n_sink for i in members], positions.device)[:, None]
            sink = torch.arange(positions.shape[-1], device=positions.device)[None, :] < n_sink  # in sorted order
            scores = positions.scatter(1, order, torch.where(sink, float("inf"), positions.gather(1, order)))
            for i, row in zip(members, scores.unbind(0)):
                out[i] = row
        return out
