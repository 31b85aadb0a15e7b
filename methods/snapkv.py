"""SnapKV, and the observation-window attention that SnapKV and R-KV share."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runner.engine.contract import CacheView, EvictionMethod, Needs, Observation, SequenceInfo
from methods.h2o import per_kv_head
from methods.registry import register_method


class QueryWindow:
    """The last ``window`` post-RoPE queries of every layer, with their absolute positions.

    Queries are kept across prefill chunks and decode steps, so "the last ``window`` queries" is
    always well defined, whatever the phase and the cadence.
    """

    def __init__(self, window: int, head_dim: int):
        self.window = window
        self.scaling = 1.0 / math.sqrt(head_dim)
        self.queries: list[torch.Tensor] | None = None
        self.positions: torch.Tensor | None = None

    def push(self, obs: Observation) -> None:
        w = self.window
        new = [q[:, -w:] for q in obs.queries]
        pos = obs.new_positions[-w:]
        if self.queries is None or pos.shape[0] >= w:
            self.queries, self.positions = new, pos
        else:
            self.queries = [torch.cat([old, q], dim=1)[:, -w:] for old, q in zip(self.queries, new)]
            self.positions = torch.cat([self.positions, pos])[-w:]

    def attention(self, layer: int, keys: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Softmax attention ``[H_q, w, T]`` (float32) of the window's queries over ``keys`` ``[H_kv, T, d]``.

        Causal by absolute position: a query at position p sees the cached keys at positions <= p.
        """
        q = self.queries[layer].float()
        group = q.shape[0] // keys.shape[0]
        k = keys.float().repeat_interleave(group, dim=0)
        logits = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        kpos = key_positions.repeat_interleave(group, dim=0)  # [H_q, T]
        future = kpos[:, None, :] > self.positions.to(kpos.device)[None, :, None]
        return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)

    def in_window(self, key_positions: torch.Tensor) -> torch.Tensor:
        """``[H, T]`` True for the slots holding the window's own tokens."""
        return key_positions >= int(self.positions[0])


def pool(scores: torch.Tensor, kernel: int, how: str = "avg") -> torch.Tensor:
    """Stride-1 pooling along the last dim of ``[N, T]`` with zero padding ``kernel // 2`` at each end.

    ``avg`` counts the padding (as ``F.avg_pool1d`` does by default); ``max`` pads with zeros too
    (scores are non-negative, so this equals ignoring the padding).
    """
    if kernel <= 1:
        return scores
    if how == "avg":
        return F.avg_pool1d(scores[:, None], kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0]
    return F.max_pool1d(scores[:, None], kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0]


def window_importance(
    window: QueryWindow, cache: CacheView, kernel: int, how: str = "avg"
) -> tuple[torch.Tensor, torch.Tensor]:
    """SnapKV's importance ``[L, H_kv, T]`` and the ``[L, H_kv, T]`` mask of the window's own slots.

    Per layer: mean over the window's queries of their attention, the window's own slots set to 0,
    pooled along the slots, then averaged over each GQA group.
    """
    scores, masks = [], []
    for layer, (keys, positions) in enumerate(zip(cache.keys, cache.positions)):
        attn = window.attention(layer, keys, positions).mean(dim=1)  # [H_q, T]
        own = window.in_window(positions)
        group = attn.shape[0] // keys.shape[0]
        attn = attn.masked_fill(own.repeat_interleave(group, dim=0), 0.0)
        scores.append(per_kv_head(pool(attn, kernel, how), keys.shape[0]))
        masks.append(own)
    return torch.stack(scores), torch.stack(masks)


def check_window_kernel(window: int, kernel: int) -> None:
    """The observation window (>= 1 queries) and the pooling kernel (odd, so it centres on a token) of
    the SnapKV-style methods."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be a positive odd integer, got {kernel}")


@register_method("snapkv")
@dataclass
class SnapKV(EvictionMethod):
    """SnapKV: mean attention of the last ``window`` queries, avg-pooled (kernel 7), per KV head.

    score[l, h, t] = mean over the query heads of GQA group h of AvgPool_k( mean over the last
    ``window`` (32) queries of A_l[q, t] ) for the slots before the window; the window's own slots get
    +inf (always kept). Pooling: stride 1, kernel ``kernel`` (7), zero padding counted (PyTorch
    ``avg_pool1d``); the window's own columns count as zeros, as in kvpress. Shape ``[L, H_kv, T]``.

    * Prefill: the window is the last 32 prompt queries, as in the paper.
    * Decode: the same rule over the last ``window`` queries seen (generated ones once there are 32);
      the interval (128 steps in the paper) is the protocol's ``cadence: buffer=128``, which lets the
      cache grow to B + 128 and then compresses to B.

    The window's attention is recomputed at scoring time from the kept post-RoPE queries and the
    current keys, scaled by 1 / sqrt(head_dim), causal by absolute position.

    Paper: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469.
    Reference code: FasterDecoding/SnapKV; kvpress ``SnapKVPress`` (same kept indices on prefill with
    ``window_size=32, kernel_size=7``). Deviations: the reference pools with max-pool by default
    (kernel 5) and kvpress with avg-pool; we follow the issue (avg, 7). The decode variant is not in
    the paper. The scaling assumes 1 / sqrt(head_dim) (true for Llama/Qwen; not for models with a
    custom query scale).
    """

    needs = Needs(queries=True)

    window: int = 32
    kernel: int = 7

    def __post_init__(self) -> None:
        check_window_kernel(self.window, self.kernel)

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        self.queries = QueryWindow(self.window, info.head_dim)

    def observe(self, obs: Observation) -> None:
        self.queries.push(obs)

    def score(self, cache: CacheView) -> torch.Tensor:
        scores, own = window_importance(self.queries, cache, self.kernel, "avg")
        return scores.masked_fill(own, float("inf"))
