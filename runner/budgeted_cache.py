"""A transformers ``DynamicCache`` plus the bookkeeping eviction needs.

For every layer it tracks, slot by slot, the absolute position of the token held there and whether
that token was fed (prompt) or generated. Eviction selects per layer and KV head and **physically
gathers** the key/value tensors, so memory really shrinks.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from methods.base import CacheView, Phase
from runner.errors import KvleagueError
from runner.protocol import Protocol


class BudgetedCache:
    def __init__(self, config, n_layers: int, n_kv_heads: int, device: torch.device):
        self.cache = DynamicCache(config=config)
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.device = device
        empty_long = torch.empty(n_kv_heads, 0, dtype=torch.long, device=device)
        empty_bool = torch.empty(n_kv_heads, 0, dtype=torch.bool, device=device)
        self.positions = [empty_long] * n_layers
        self.is_prompt = [empty_bool] * n_layers
        self.uniform = True  # every layer and head holds the same tokens

    @property
    def length(self) -> int:
        return self.positions[0].shape[1]

    def kv_bytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers if layer.is_initialized)

    def track(self, new_positions: torch.Tensor, prompt: bool) -> None:
        """Record the slots the last forward pass appended (call right after it)."""
        c = new_positions.shape[0]
        pos = new_positions.to(self.device)[None].expand(self.n_kv_heads, c)
        flag = torch.full((self.n_kv_heads, c), prompt, dtype=torch.bool, device=self.device)
        self.positions = [torch.cat([p, pos], dim=1) for p in self.positions]
        self.is_prompt = [torch.cat([f, flag], dim=1) for f in self.is_prompt]

    def view(self, budget: int, phase: Phase, current_position: int) -> CacheView:
        return CacheView(
            keys=[layer.keys[0] for layer in self.cache.layers],
            values=[layer.values[0] for layer in self.cache.layers],
            positions=self.positions,
            is_prompt=self.is_prompt,
            budget=budget,
            phase=phase,
            current_position=current_position,
        )

    def protected(self, protocol: Protocol, current_position: int) -> list[torch.Tensor]:
        """Per layer ``[H, T]``: slots the protocol forbids evicting."""
        masks = []
        for pos, prompt in zip(self.positions, self.is_prompt):
            mask = (pos < protocol.sink) | (pos > current_position - protocol.recent)
            if protocol.protect_prompt:
                mask |= prompt
            masks.append(mask)
        return masks

    def evict(self, scores: torch.Tensor, budget: int, protocol: Protocol, current_position: int) -> int:
        """Keep the ``budget`` best slots (protected ones first); return how many slots were dropped."""
        length = self.length
        scores = self._normalise(scores, length)
        protected = self.protected(protocol, current_position)
        n_protected = max(int(m.sum(dim=1).max()) for m in protected)
        if n_protected > budget:
            raise KvleagueError(
                f"budget: {n_protected} protected tokens (sink + recent + prompt) exceed the budget {budget}; "
                "raise the budget or turn off protect_prompt"
            )
        if scores.dim() == 1 and self.uniform:
            keep = _top_slots(scores.masked_fill(protected[0][0], float("inf")), budget)
            for i, layer in enumerate(self.cache.layers):
                layer.keys = layer.keys.index_select(2, keep)
                layer.values = layer.values.index_select(2, keep)
                self.positions[i] = self.positions[i].index_select(1, keep)
                self.is_prompt[i] = self.is_prompt[i].index_select(1, keep)
        else:
            if scores.dim() == 1:
                raise KvleagueError("score: per-token scores [T] need every layer and head to hold the same tokens")
            if scores.dim() == 2:
                scores = scores[:, None, :].expand(self.n_layers, self.n_kv_heads, length)
            for i, layer in enumerate(self.cache.layers):
                keep = _top_slots(scores[i].masked_fill(protected[i], float("inf")), budget)  # [H, B]
                index = keep[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
                layer.keys = layer.keys.gather(2, index)
                layer.values = layer.values.gather(2, index)
                self.positions[i] = self.positions[i].gather(1, keep)
                self.is_prompt[i] = self.is_prompt[i].gather(1, keep)
            self.uniform = self.uniform and _all_equal(self.positions)
        return length - budget

    def _normalise(self, scores: torch.Tensor, length: int) -> torch.Tensor:
        if not isinstance(scores, torch.Tensor):
            raise KvleagueError(f"score: a method must return a torch.Tensor, got {type(scores).__name__}")
        allowed = {1: (length,), 2: (self.n_layers, length), 3: (self.n_layers, self.n_kv_heads, length)}
        if allowed.get(scores.dim()) != tuple(scores.shape):
            raise KvleagueError(
                f"score: shape {tuple(scores.shape)} is not one of [T]={allowed[1]}, [L, T]={allowed[2]}, [L, H, T]={allowed[3]}"
            )
        if torch.isnan(scores).any():
            raise KvleagueError("score: the method returned NaN scores")
        return scores.to(self.device, scores.dtype if scores.is_floating_point() else torch.float32)


def _top_slots(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores along the last dim, in slot order."""
    return torch.topk(scores, k, dim=-1, sorted=False).indices.sort(dim=-1).values


def _all_equal(tensors: list[torch.Tensor]) -> bool:
    first = tensors[0]
    return bool((first == first[:1]).all()) and all(torch.equal(t, first) for t in tensors[1:])
