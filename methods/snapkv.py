"""SnapKV: the observation window's attention, pooled, per KV head (the window itself is in ``methods.kernels``, shared with R-KV and Scissorhands)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.engine.contract import CacheView, EvictionMethod, Needs, Observation, SequenceInfo
from methods.kernels import QueryWindow, check_window_kernel, window_importance
from methods.registry import register_method


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
